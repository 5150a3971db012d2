"""The server side of the control channel (:mod:`.control` has the protocol and the client).

Runs on the FUSE process's trio loop; one request per connection.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import trio

from dsec.errors import DsecError, InvalidSpec

from .control import MAX_REQUEST, error_answer

log = logging.getLogger("dsec.images.lazy")

Handler = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]


async def serve_control(
    path: Path, handler: Handler, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    """Listen on ``path`` (mode 0600) until cancelled; each connection is one request."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o077)
    try:
        await sock.bind(os.fspath(path))
    finally:
        os.umask(old)
    sock.listen(64)
    listener = trio.SocketListener(sock)
    task_status.started()

    async def one(stream: trio.SocketStream) -> None:
        await _one(stream, handler)

    try:
        await trio.serve_listeners(one, [listener])
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)


async def _one(stream: trio.SocketStream, handler: Handler) -> None:
    async with stream:
        buf = bytearray()
        try:
            while b"\n" not in buf:
                data = await stream.receive_some(1 << 20)
                if not data:
                    return
                buf += data
                if len(buf) > MAX_REQUEST:
                    raise ValueError("request too large")
            req = json.loads(buf[: buf.index(b"\n")])
            if not isinstance(req, dict):
                raise ValueError("a request is a JSON object")
            answer = await handler(req)
        except (ValueError, TypeError, KeyError) as exc:
            answer = error_answer(InvalidSpec(f"bad control request: {exc}", field="request"))
        except Exception as exc:
            if not isinstance(exc, DsecError):
                log.exception("control request failed")
            answer = error_answer(exc)
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await stream.send_all(json.dumps(answer).encode() + b"\n")


__all__ = ["Handler", "serve_control"]
