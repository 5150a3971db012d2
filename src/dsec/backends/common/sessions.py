"""Persistent shell sessions: what an agent's bash tool needs.

A session is one long-lived shell in the sandbox (bash when the image has it,
else sh). Each ``run`` sends the command as a single-quoted ``eval`` followed by
an end marker carrying ``$?``, so cwd, variables and functions persist between
commands. The marker holds a random nonce the sandbox never sees in advance.
Commands get stdin from /dev/null so they cannot eat the protocol.

A timeout kills the command's processes (the shell's descendants), not the
shell, so the session survives with its state.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import time
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from dsec.backends.common.fdio import read_chunk
from dsec.backends.common.fdio import set_done as _set_done
from dsec.backends.common.output import BoundedCapture, start_piped
from dsec.errors import ExecTimeout, InvalidSpec, SessionClosed
from dsec.spec.results import ExecResult, LimitHit


class ShellExit(Protocol):
    exit_code: int | None
    signal: int | None


class ShellProcess(Protocol):
    """The session's shell as its backend started it."""

    pid: int
    exited: asyncio.Future[Any]
    """Done when the shell exits; its result has ``exit_code`` and ``signal``."""

    def kill(self, *, tree: bool = True) -> None: ...


class SessionHost(Protocol):
    """What a session needs of its sandbox, and nothing more: each backend's sandbox object
    (or a small adapter) provides it, so sessions are written once for every backend."""

    async def start_process(self, argv: Sequence[str], *, stdin: int, stdout: int, stderr: int,
                            env: Mapping[str, str] | None = None, cwd: str = "/",
                            user: int | str = 0) -> ShellProcess: ...

    def wake(self) -> bool:
        """Resume the sandbox if it is paused (a session's command resumes it, as exec does)."""
        ...

    def limit_baseline(self) -> object | None:
        """What a command starts from, for :meth:`limit_hit` (None: the sandbox is gone)."""
        ...

    def limit_hit(self, before: Any, *, exit_code: int | None, sig: int | None, timed_out: str | None,
                  timeout_s: float | None, truncated: bool, output_cap: int,
                  output: tuple[bytes, ...]) -> LimitHit | None:
        """Which limit ended a command (``ExecResult.limit``); None when none did or the sandbox is gone."""
        ...

    def kill_command(self, shell: ShellProcess) -> None:
        """Kill what the shell runs now (its descendants), never the shell."""
        ...

    def touch(self) -> None:
        """Record activity (the idle watchdog's clock)."""
        ...

    def drop_session(self, session_id: str) -> object:
        """Forget the session (it closed)."""
        ...

_SHELL = "if command -v bash >/dev/null 2>&1; then exec bash --noprofile --norc; else exec sh; fi"



def _quote(cmd: str) -> str:
    return "'" + cmd.replace("'", "'\"'\"'") + "'"


class _Stream:
    """Accumulates one pipe's bytes; ``take_until`` returns what precedes a marker."""

    def __init__(self) -> None:
        self.buf = bytearray()
        self.eof = False
        self.changed = asyncio.Event()

    def feed(self, data: bytes) -> None:
        self.buf += data
        self.changed.set()


class Session:
    """One persistent shell in a sandbox, of any backend (through its :class:`SessionHost`)."""

    def __init__(self, host: SessionHost, sandbox_id: str, session_id: str) -> None:
        self.host = host
        self.sandbox_id = sandbox_id
        self.id = session_id
        self._nonce = secrets.token_hex(8)
        self._seq = 0
        self._proc: ShellProcess | None = None
        self._stdin = -1
        self._fds: list[int] = []
        self._streams: dict[int, _Stream] = {}
        self._lock = asyncio.Lock()
        self._resync: asyncio.Future[None] | None = None
        self.closed = False
        self.ended_reason = ""
        """Why the runtime ended the session (e.g. a stage switch), for the next run's error."""

    async def start(self, *, env: dict[str, str] | None = None, cwd: str = "/", user: int | str = 0) -> None:
        proc, in_w, out_r, err_r = await start_piped(lambda i, o, e: self.host.start_process(
            ["/bin/sh", "-c", _SHELL], stdin=i, stdout=o, stderr=e, env=env, cwd=cwd, user=user))
        self._proc = proc
        self._stdin = in_w
        loop = asyncio.get_running_loop()
        for fd in (out_r, err_r):
            os.set_blocking(fd, False)
            self._streams[fd] = _Stream()
            loop.add_reader(fd, self._on_readable, fd)
            self._fds.append(fd)
        proc.exited.add_done_callback(lambda _f: self._wake_all())

    def _wake_all(self) -> None:
        for s in self._streams.values():
            s.changed.set()

    def _on_readable(self, fd: int) -> None:
        stream = self._streams[fd]
        data = read_chunk(fd)
        if data is None:
            return
        if not data:
            stream.eof = True
            asyncio.get_running_loop().remove_reader(fd)
            stream.changed.set()
            return
        stream.feed(data)

    async def run(self, command: str, *, timeout: float | None = 600.0, output_cap: int = 256 * 1024) -> ExecResult:
        """Run ``command`` in the session's shell and return its output and exit status.
        A paused sandbox is resumed first, as for exec."""
        self.host.wake()
        if "\0" in command:
            raise InvalidSpec("command contains a NUL byte", field="command")
        async with self._lock:
            if self._resync is not None:
                with contextlib.suppress(Exception):
                    await self._resync
                self._resync = None
            if self.closed or self._proc is None or self._proc.exited.done():
                self.closed = True
                why = f": {self.ended_reason}" if self.ended_reason else ""
                raise SessionClosed(f"session {self.id} of sandbox {self.sandbox_id} has ended{why}",
                                    sandbox_id=self.sandbox_id, session_id=self.id, reason=self.ended_reason or None)
            self._seq += 1
            marker = f"__DSEC_{self._nonce}_{self._seq}__".encode()
            script = (
                f"eval {_quote(command)} </dev/null\n"
                f"__dsec_rc=$?; printf '\\n%s %d\\n' '{marker.decode()}' \"$__dsec_rc\"; "
                f"printf '\\n%s\\n' '{marker.decode()}' >&2\n"
            ).encode()
            started = time.monotonic()
            before = self.host.limit_baseline()
            try:
                await self._write(script)
            except BrokenPipeError:
                self.closed = True
                raise SessionClosed(f"session {self.id} has ended", sandbox_id=self.sandbox_id) from None
            out_fd, err_fd = self._fds
            deadline = None if timeout is None else started + timeout
            timed_out = False
            while True:
                done_out = self._find(self._streams[out_fd], marker)
                done_err = self._find(self._streams[err_fd], marker)
                if done_out is not None and done_err is not None:
                    break
                if self._proc.exited.done() and all(s.eof for s in self._streams.values()):
                    break
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0 and not timed_out:
                    timed_out = True
                    self._kill_command()
                    deadline = time.monotonic() + 5  # the shell reports back after its child died
                    continue
                if remaining is not None and remaining <= 0 and timed_out:
                    break
                for s in self._streams.values():
                    s.changed.clear()
                waits = [asyncio.ensure_future(s.changed.wait()) for s in self._streams.values()]
                try:
                    await asyncio.wait(waits, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
                except asyncio.CancelledError:
                    # The caller gave up: kill the command and let the shell reach its end
                    # marker in the background, so the next run() stays in step.
                    self._kill_command()
                    self._resync = asyncio.ensure_future(self._drain(marker))
                    raise
                finally:
                    for w in waits:
                        w.cancel()
            out, rc = self._take(self._streams[out_fd], marker, with_rc=True)
            err, _ = self._take(self._streams[err_fd], marker, with_rc=False)
            sig = None
            if rc is None:
                self.closed = True
                ex = self._proc.exited.result() if self._proc.exited.done() else None
                rc, sig = (ex.exit_code, ex.signal) if ex else (None, None)
            so, se = BoundedCapture(output_cap), BoundedCapture(output_cap)
            so.feed(out)
            se.feed(err)
            stdout, stderr = so.value(), se.value()
            hit = None if before is None else self.host.limit_hit(
                before, exit_code=rc, sig=sig, timed_out="timeout" if timed_out else None, timeout_s=timeout,
                truncated=so.truncated or se.truncated, output_cap=output_cap, output=(stderr, stdout),
            )
            result = ExecResult(
                exit_code=rc, signal=sig, stdout=stdout, stderr=stderr, stdout_bytes=so.total,
                stderr_bytes=se.total, truncated=so.truncated or se.truncated,
                duration_s=time.monotonic() - started, start_latency_s=0.0,
                timed_out="timeout" if timed_out else None, limit=hit,
            )
            self.host.touch()
            if timed_out:
                raise ExecTimeout(
                    f"session command ran longer than {timeout} s; its processes were killed, the session lives on",
                    sandbox_id=self.sandbox_id, timeout=timeout, reason="timeout", result=result,
                )
            return result

    async def _drain(self, marker: bytes) -> None:
        """After a cancelled run: wait (bounded) for the markers and drop that output."""
        out_fd, err_fd = self._fds
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self._find(self._streams[out_fd], marker) is not None and self._find(self._streams[err_fd], marker) is not None:
                self._take(self._streams[out_fd], marker, with_rc=True)
                self._take(self._streams[err_fd], marker, with_rc=False)
                return
            if self._proc is None or self._proc.exited.done():
                return
            for s in self._streams.values():
                s.changed.clear()
            waits = [asyncio.ensure_future(s.changed.wait()) for s in self._streams.values()]
            try:
                await asyncio.wait(waits, timeout=0.5, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()
        self.closed = True  # never came back in step: refuse further runs

    @staticmethod
    def _find(stream: _Stream, marker: bytes) -> int | None:
        i = stream.buf.find(b"\n" + marker)
        if i < 0:
            return None
        j = stream.buf.find(b"\n", i + 1 + len(marker))
        return None if j < 0 else i

    @staticmethod
    def _take(stream: _Stream, marker: bytes, *, with_rc: bool) -> tuple[bytes, int | None]:
        i = stream.buf.find(b"\n" + marker)
        if i < 0:
            data = bytes(stream.buf)
            stream.buf.clear()
            return data, None
        j = stream.buf.find(b"\n", i + 1 + len(marker))
        line = bytes(stream.buf[i + 1 + len(marker) : j]).strip()
        data = bytes(stream.buf[:i])
        del stream.buf[: j + 1]
        rc = int(line) if with_rc and line.lstrip(b"-").isdigit() else None
        return data, rc

    def _kill_command(self) -> None:
        if self._proc is not None:
            self.host.kill_command(self._proc)

    async def _write(self, data: bytes) -> None:
        view = memoryview(data)
        loop = asyncio.get_running_loop()
        os.set_blocking(self._stdin, False)
        while view:
            try:
                view = view[os.write(self._stdin, view):]
            except BlockingIOError:
                ready: asyncio.Future[None] = loop.create_future()
                loop.add_writer(self._stdin, _set_done, ready)
                try:
                    await ready
                finally:
                    loop.remove_writer(self._stdin)

    async def close(self) -> None:
        """Kill the shell and everything it started. Idempotent."""
        self.host.drop_session(self.id)
        if self._proc is not None and not self._proc.exited.done():
            self._proc.kill(tree=True)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(self._proc.exited), 5)
        self.closed = True
        loop = asyncio.get_running_loop()
        for fd in self._fds:
            with contextlib.suppress(Exception):
                loop.remove_reader(fd)
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds = []
        if self._stdin >= 0:
            with contextlib.suppress(OSError):
                os.close(self._stdin)
            self._stdin = -1


__all__ = ["Session", "SessionHost", "ShellExit", "ShellProcess"]
