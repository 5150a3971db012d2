"""A command's output, collected: bounded, streamed with backpressure, under its timeouts.

:class:`BoundedCapture` keeps the first and the last ``cap`` bytes of a stream and counts
the rest, so a ``yes`` that runs until its timeout costs at most ``2 * cap`` bytes of
host memory per stream, never disk. :func:`collect` feeds a command's stdin, reads its
stdout and stderr into two of them (handing each chunk to the consumer, and reading no
more while the consumer says it is full), kills the command's whole tree on its timeout
or idle timeout, and returns once it has exited and its output is read.
:func:`start_piped` starts a command on three fresh pipes; :func:`check_exec` and
:func:`check_timed_out` are an exec's arguments and its timeout, the same on every backend.

Any backend's command will do, as long as it has an ``exited`` future, ``started_at``
and a ``kill(tree=...)`` that kills everything it started. Never blocks the event loop:
the pipes are non-blocking and read from loop callbacks.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Final, Generic, Protocol, TypeVar

from dsec.backends.base import OutputCallback, _Unset
from dsec.backends.common.fdio import read_chunk, write_all
from dsec.errors import ExecTimeout, InvalidSpec
from dsec.spec.results import ExecResult

DEFAULT_TIMEOUT_S: Final = 600.0
"""An exec's time limit when it names none."""
OUTPUT_WINDOW_S: Final = 0.1
"""After a command exits, how long output still held open by background children is read
(not counting time spent waiting for a full consumer)."""


class Exit(Protocol):
    """How a command ended, as any backend reports it."""

    @property
    def exit_code(self) -> int | None: ...
    @property
    def signal(self) -> int | None: ...
    @property
    def utime_s(self) -> float: ...
    @property
    def stime_s(self) -> float: ...


E = TypeVar("E", bound=Exit)
P = TypeVar("P")


def check_exec(cmd: Sequence[str] | str, *, timeout: float | _Unset | None, idle_timeout: float | None,
               output_cap: int | None) -> tuple[list[str], float | None]:
    """An exec's argv (a string runs under ``/bin/sh -c``) and time limit (left out: the
    default; None: none); InvalidSpec for a limit or output cap that is not positive."""
    argv = ["/bin/sh", "-c", cmd] if isinstance(cmd, str) else list(cmd)
    limit = DEFAULT_TIMEOUT_S if isinstance(timeout, _Unset) else timeout
    if limit is not None and limit <= 0:
        raise InvalidSpec("timeout must be positive (or None for no timeout)", field="timeout")
    if idle_timeout is not None and idle_timeout <= 0:
        raise InvalidSpec("idle_timeout must be positive (or None for none)", field="idle_timeout")
    if output_cap is not None and output_cap < 1:
        raise InvalidSpec(f"output_cap {output_cap} must be at least 1 byte (or None for the sandbox's)",
                          field="output_cap")
    return argv, limit


def check_timed_out(result: ExecResult, sandbox_id: str, *, limit: float | None, idle_timeout: float | None) -> None:
    """ExecTimeout, carrying the partial result, when the command was killed for a timeout."""
    if result.timed_out:
        what = "produced no output for" if result.timed_out == "idle_timeout" else "ran longer than"
        secs = idle_timeout if result.timed_out == "idle_timeout" else limit
        raise ExecTimeout(f"command in sandbox {sandbox_id} {what} {secs} s and was killed (with its process tree)",
                          sandbox_id=sandbox_id, timeout=secs, reason=result.timed_out, result=result)


class BoundedCapture:
    __slots__ = ("_head", "_tail", "cap", "total")

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.total = 0
        self._head = bytearray()
        self._tail = bytearray()

    def feed(self, data: bytes) -> bytes:
        """Take ``data``; returns the part of it that went to the head (a stream sends that
        at once, and the tail at the end)."""
        self.total += len(data)
        room = self.cap - len(self._head)
        head = b""
        if room > 0:
            head = data[:room]
            self._head += head
            data = data[room:]
        if data:
            self._tail += data
            if len(self._tail) > self.cap:
                del self._tail[: len(self._tail) - self.cap]
        return head

    @property
    def tail(self) -> bytes:
        """The newest bytes past the head (at most ``cap``)."""
        return bytes(self._tail)

    @property
    def dropped(self) -> int:
        """Bytes neither in the head nor in the tail."""
        return self.total - len(self._head) - len(self._tail)

    @property
    def truncated(self) -> bool:
        return self.total > len(self._head) + len(self._tail)

    def value(self) -> bytes:
        if not self.truncated:
            return bytes(self._head + self._tail)
        dropped = self.total - len(self._head) - len(self._tail)
        marker = f"\n[... dsec: {dropped} bytes omitted ...]\n".encode()
        return bytes(self._head) + marker + bytes(self._tail)


class CommandHandle(Protocol[E]):
    """What :func:`collect` needs of a started command."""

    exited: asyncio.Future[E]
    started_at: float
    """``time.monotonic()`` when it was started."""

    def kill(self, *, tree: bool = True) -> None:
        """Kill it (``tree``: and everything it started, however detached); returns at once."""
        ...


@dataclass(slots=True)
class Collected(Generic[E]):
    exit: E
    """The command's own exit, as its backend reports it."""
    stdout: BoundedCapture
    stderr: BoundedCapture
    timed_out: str | None
    """"timeout" or "idle_timeout" when :func:`collect` killed it for that; else None."""
    duration_s: float
    """From ``started_at`` until its output was read."""

    @property
    def truncated(self) -> bool:
        return self.stdout.truncated or self.stderr.truncated

    def result(self, start_latency_s: float) -> ExecResult:
        """The exec's result (its ``limit`` is the backend's to fill in)."""
        so, se = self.stdout, self.stderr
        return ExecResult(
            exit_code=self.exit.exit_code, signal=self.exit.signal, stdout=so.value(), stderr=se.value(),
            stdout_bytes=so.total, stderr_bytes=se.total, truncated=self.truncated, duration_s=self.duration_s,
            start_latency_s=start_latency_s, timed_out=self.timed_out, cpu_user_s=self.exit.utime_s,
            cpu_system_s=self.exit.stime_s,
        )


async def start_piped(start: Callable[[int, int, int], Awaitable[P]]) -> tuple[P, int, int, int]:
    """Start a command on three fresh pipes: ``start(stdin, stdout, stderr)`` gets their far
    ends (closed here once it returns). Returns the command and our ends: stdin's writer,
    stdout's and stderr's readers. If anything fails, every end is closed."""
    fds: list[int] = []
    try:
        for _ in range(3):
            fds.extend(os.pipe2(os.O_CLOEXEC))
        in_r, in_w, out_r, out_w, err_r, err_w = fds
        proc = await start(in_r, out_w, err_w)
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    for fd in (in_r, out_w, err_w):
        os.close(fd)
    return proc, in_w, out_r, err_r


async def feed_stdin(fd: int, data: bytes | None) -> None:
    """Write ``data`` to a command's stdin and close it (a command that stopped reading
    is not an error)."""
    try:
        if data:
            os.set_blocking(fd, False)
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                await write_all(fd, data)
    finally:
        os.close(fd)


async def collect(cmd: CommandHandle[E], in_w: int, out_r: int, err_r: int, stdin: bytes | None, limit: float | None,
                  idle_timeout: float | None, on_output: OutputCallback | None, cap: int) -> Collected[E]:
    """Feed ``stdin`` to ``in_w`` (then close it), read ``out_r`` and ``err_r`` (head and tail
    of each kept, ``on_output`` streamed with its backpressure), enforce ``limit`` and
    ``idle_timeout`` (killing the tree) and wait for the exit. Closes the three fds; on
    cancellation the command's tree is killed."""
    loop = asyncio.get_running_loop()
    caps = {out_r: BoundedCapture(cap), err_r: BoundedCapture(cap)}
    names = {out_r: "stdout", err_r: "stderr"}
    open_fds = {out_r, err_r}
    eof: asyncio.Future[None] = loop.create_future()
    last_output = [time.monotonic()]
    timed_out: list[str] = []
    paused: list[asyncio.Future[None]] = []  # the consumer's "drained" future while it is full
    reading = [True]  # False once the pipes are closed: a late resume must not touch them

    def resume(_f: object) -> None:
        paused.clear()
        last_output[0] = time.monotonic()  # waiting for the consumer is not idleness
        if reading[0]:
            for f in open_fds:
                loop.add_reader(f, on_readable, f)

    def on_readable(fd: int, reads: int = 16, final: bool = False) -> None:
        for _ in range(reads):
            chunk = read_chunk(fd)
            if chunk is None:
                return
            if not chunk:
                loop.remove_reader(fd)
                open_fds.discard(fd)
                if not open_fds and not eof.done():
                    eof.set_result(None)
                return
            caps[fd].feed(chunk)
            last_output[0] = time.monotonic()
            if on_output is not None:
                wait = on_output(names[fd], chunk)
                if wait is not None and not final and not paused and not wait.done():
                    for f in open_fds:  # the consumer is full: read on once it has drained
                        loop.remove_reader(f)
                    paused.append(wait)
                    wait.add_done_callback(resume)
                    return

    for fd in (out_r, err_r):
        os.set_blocking(fd, False)
        loop.add_reader(fd, on_readable, fd)
    writer: asyncio.Future[None] | None = None
    if stdin:
        writer = asyncio.ensure_future(feed_stdin(in_w, stdin))
    else:
        os.close(in_w)

    def expire(reason: str) -> None:
        if not cmd.exited.done():
            timed_out.append(reason)
            cmd.kill(tree=True)

    timer = loop.call_later(limit, expire, "timeout") if limit is not None else None
    idle_task = None
    if idle_timeout is not None:
        async def idle_watch() -> None:
            while not cmd.exited.done():
                if paused:  # blocked on a slow consumer, not idle
                    await asyncio.wait((paused[0],))
                    continue
                wait = last_output[0] + idle_timeout - time.monotonic()
                if wait <= 0:
                    expire("idle_timeout")
                    return
                await asyncio.sleep(wait)

        idle_task = asyncio.ensure_future(idle_watch())
    try:
        ex = cmd.exited.result() if cmd.exited.done() else await asyncio.shield(cmd.exited)
        # Output written before exit is in the pipes; stray background children holding
        # them open do not keep the result waiting.
        window = OUTPUT_WINDOW_S
        while not eof.done() and window > 0:
            if paused:
                await asyncio.wait((paused[0],))
                continue
            t = loop.time()
            await asyncio.wait((eof,), timeout=window)
            window -= loop.time() - t
        for fd in list(open_fds):
            on_readable(fd, reads=64, final=True)  # what is left in the pipe, whatever the consumer
    except asyncio.CancelledError:
        cmd.kill(tree=True)
        raise
    finally:
        reading[0] = False
        if timer is not None:
            timer.cancel()
        if idle_task is not None:
            idle_task.cancel()
        if writer is not None:
            writer.cancel()
        for fd in (out_r, err_r):
            if fd in open_fds:
                loop.remove_reader(fd)
            os.close(fd)
    return Collected(ex, caps[out_r], caps[err_r], timed_out[0] if timed_out else None,
                     time.monotonic() - cmd.started_at)
