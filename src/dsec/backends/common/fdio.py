"""Non-blocking fd plumbing every backend and the edge share (no backend's internals)."""

from __future__ import annotations

import asyncio
import os


def read_chunk(fd: int, size: int = 65536) -> bytes | None:
    """One read of a non-blocking ``fd`` (a loop reader's callback): None when nothing is
    there yet; b"" at its end, which a read error (EIO of a hung-up pty, EBADF) counts as."""
    try:
        return os.read(fd, size)
    except BlockingIOError:
        return None
    except OSError:
        return b""


def set_done(fut: asyncio.Future[None]) -> None:
    """Resolve ``fut`` unless it is already (a loop callback: add_reader/add_writer)."""
    if not fut.done():
        fut.set_result(None)


async def write_all(fd: int, data: bytes, *, stall_s: float | None = None) -> None:
    """Write all of ``data`` to a non-blocking ``fd``, waiting for room on the loop.
    OSError (EPIPE: the reader is gone) goes to the caller; with ``stall_s``, so does
    TimeoutError when no room came for that long."""
    loop = asyncio.get_running_loop()
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view):]
        except BlockingIOError:
            ready: asyncio.Future[None] = loop.create_future()
            loop.add_writer(fd, set_done, ready)
            try:
                await asyncio.wait_for(ready, stall_s)
            finally:
                loop.remove_writer(fd)
