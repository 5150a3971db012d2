"""Terminals and streamed stdin: the WebSocket ``/v1/sandboxes/{id}/attach``.

A client (``sb.pty()`` / ``sb.attach()`` in the SDK, ``dsec shell``, ``dsec exec -i/-t``)
opens the socket and sends an :class:`~dsec.spec.api.AttachOpen`. The edge starts the
command — on a pseudo-terminal inside the sandbox (``tty``: job control, ^C/^Z as
signals to the foreground group, resize) or on pipes with stdin streamed — and relays
bytes both ways as they come. Output is never dropped: when a client reads slower than
the command writes, the edge stops reading the command's output until it catches up
(the command blocks on its writes).

A *named* terminal outlives the connection: the client may go away (or send
``{"detach": true}``) and attach to the name again later; the edge replays the last
:data:`REPLAY_BYTES` of its screen output. An unnamed one is killed when its client goes.
Terminals end when their command exits (the last message is ``{"exit": ...}``).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import os
import signal
import time
from collections.abc import Callable
from typing import Any

from dsec.backends.base import Backend, Capability, ProcessHandle, TtySize, set_tty_size
from dsec.backends.common.fdio import write_all
from dsec.errors import InvalidSpec, QuotaExceeded
from dsec.spec.api import AttachOpen, TerminalInfo

log = logging.getLogger(__name__)

REPLAY_BYTES = 64 * 1024
"""Screen output a named terminal keeps for the next client that attaches."""
PAUSE_BYTES = 1024 * 1024
"""Output queued for one client beyond which the edge stops reading the command's output."""
MAX_NAMED = 16
"""Named terminals per sandbox."""
SIGNALS = {"INT": signal.SIGINT, "TERM": signal.SIGTERM, "KILL": signal.SIGKILL, "HUP": signal.SIGHUP,
           "QUIT": signal.SIGQUIT, "TSTP": signal.SIGTSTP, "CONT": signal.SIGCONT, "WINCH": signal.SIGWINCH}

SHELL_ARGV = ("/bin/sh", "-c", "if command -v bash >/dev/null 2>&1; then exec bash -l; else exec sh -l; fi")
"""The default command: the image's login shell (bash when it has it)."""

Item = bytes | dict[str, Any] | None
"""What a client's queue carries: output (stream byte + data), a control message, the end."""



class _Client:
    def __init__(self, on_drained: Callable[[], None]) -> None:
        self.queue: asyncio.Queue[Item] = asyncio.Queue()
        self.pending = 0
        self._on_drained = on_drained

    def put(self, item: Item) -> None:
        if isinstance(item, bytes):
            self.pending += len(item)
        self.queue.put_nowait(item)

    async def get(self) -> Item:
        item = await self.queue.get()
        if isinstance(item, bytes):
            self.pending -= len(item)
            if self.pending < PAUSE_BYTES // 2:
                self._on_drained()
        return item


class Terminal:
    """One command started for attaching clients: on a pty (``master``) or on pipes."""

    def __init__(self, sandbox_id: str, name: str | None, argv: list[str], proc: ProcessHandle, *,
                 master: int = -1, stdin: int = -1, stdout: int = -1, stderr: int = -1,
                 on_end: Callable[[Terminal], None]) -> None:
        self.sandbox_id, self.name, self.argv, self.proc = sandbox_id, name, argv, proc
        self.master, self.stdin = master, stdin
        self.tty = master >= 0
        self.started_at = time.time()
        self.clients: list[_Client] = []
        self.replay = bytearray()
        self.exit: dict[str, Any] | None = None
        self.ended = asyncio.Event()
        self._on_end = on_end
        # fd -> stream byte (1 stdout, 2 stderr); a terminal's one fd carries both
        self._readers: dict[int, int] = {master: 1} if self.tty else {stdout: 1, stderr: 2}
        self._open = set(self._readers)
        self._paused = False
        self._loop = asyncio.get_running_loop()

    def start(self) -> None:
        for fd in self._readers:
            os.set_blocking(fd, False)
            self._loop.add_reader(fd, self._on_readable, fd)
        if self.stdin >= 0:
            os.set_blocking(self.stdin, False)
        self._watcher = asyncio.ensure_future(self._watch())

    # ---------------------------------------------------------------- output --

    def _on_readable(self, fd: int) -> None:
        try:
            data = os.read(fd, 65536)
        except BlockingIOError:
            return
        except OSError as exc:  # EIO: every slave fd is closed
            if exc.errno != errno.EIO:
                log.warning("terminal %s/%s: read: %s", self.sandbox_id, self.name, exc)
            data = b""
        if not data:
            self._loop.remove_reader(fd)
            self._open.discard(fd)
            return
        if self.tty and self.name is not None:
            self.replay += data
            if len(self.replay) > REPLAY_BYTES:
                del self.replay[: len(self.replay) - REPLAY_BYTES]
        item = bytes([self._readers[fd]]) + data
        for c in self.clients:
            c.put(item)
        if not self._paused and any(c.pending > PAUSE_BYTES for c in self.clients):
            self._paused = True
            for f in self._open:
                self._loop.remove_reader(f)

    def _drained(self) -> None:
        if self._paused and all(c.pending < PAUSE_BYTES // 2 for c in self.clients):
            self._paused = False
            for f in self._open:
                self._loop.add_reader(f, self._on_readable, f)

    async def _watch(self) -> None:
        lost = None
        try:
            ex = await asyncio.shield(self.proc.exited)
            code, sig, user_s, system_s = ex.exit_code, ex.signal, ex.utime_s, ex.stime_s
        except Exception as exc:  # the backend lost the command (a VM that went away): ended, status unknown
            lost = str(exc)
            code, sig, user_s, system_s = None, None, 0.0, 0.0
        # The rest of the output: until every writer closed its end (a background process
        # that still holds the terminal gets one second).
        deadline = time.monotonic() + 1.0
        while self._open and time.monotonic() < deadline:
            if self._paused and self.clients:
                deadline = time.monotonic() + 1.0  # a slow client is still reading
            await asyncio.sleep(0.02)
        self.exit = {"exit_code": code, "signal": sig, "cpu_user_s": round(user_s, 6),
                     "cpu_system_s": round(system_s, 6)}
        if lost is not None:
            self.exit["lost"] = lost
        for c in self.clients:
            c.put({"exit": self.exit})
            c.put(None)
        self._close_fds()
        self.ended.set()
        self._on_end(self)

    def _close_fds(self) -> None:
        for fd in {*self._readers, self.stdin} - {-1}:
            with contextlib.suppress(OSError, ValueError):
                self._loop.remove_reader(fd)
            with contextlib.suppress(OSError):
                os.close(fd)
        self._open.clear()
        self.stdin = -1

    # ---------------------------------------------------------------- clients --

    def attach(self) -> _Client:
        c = _Client(self._drained)
        if self.replay:
            c.put(b"\x01" + bytes(self.replay))
        if self.exit is not None:
            c.put({"exit": self.exit})
            c.put(None)
        else:
            self.clients.append(c)
        return c

    def detach(self, c: _Client) -> None:
        with contextlib.suppress(ValueError):
            self.clients.remove(c)
        self._drained()

    # ---------------------------------------------------------------- input --

    async def write(self, data: bytes) -> None:
        fd = self.master if self.tty else self.stdin
        if fd < 0:
            return  # stdin closed (eof sent) or the command ended: input goes nowhere
        with contextlib.suppress(OSError, TimeoutError):  # the reader is gone, or stopped reading for 30 s
            await write_all(fd, data, stall_s=30.0)

    def eof(self) -> None:
        if self.tty:
            with contextlib.suppress(OSError):
                os.write(self.master, b"\x04")
        elif self.stdin >= 0:
            os.close(self.stdin)
            self.stdin = -1

    def resize(self, rows: int, cols: int) -> None:
        if self.tty and self.exit is None:
            set_tty_size(self.master, TtySize(rows, cols))

    def signal(self, name: str) -> None:
        sig = SIGNALS.get(name.upper().removeprefix("SIG"))
        if sig is None:
            raise InvalidSpec(f"signal {name!r}: one of {', '.join(SIGNALS)}", field="signal")
        if self.exit is not None:
            return
        job = getattr(self.proc, "signal_job", None)
        if job is not None:  # a process whose pid is not the host's (a VM's): its backend signals it
            job(sig)
            return
        pgid = self.proc.pid
        if self.tty:
            with contextlib.suppress(OSError):
                pgid = os.tcgetpgrp(self.master)  # the foreground job, as ^C would reach
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, sig)

    def kill(self) -> None:
        if self.exit is None:
            self.proc.kill()

    def info(self) -> TerminalInfo:
        return TerminalInfo(name=self.name or "", pid=self.proc.pid, cmd=self.argv, started_at=self.started_at,
                            attached=len(self.clients))


class TerminalHub:
    """The edge's terminals: named ones by (sandbox, name), unnamed ones only while attached."""

    def __init__(self, backend_of: Callable[[str], Backend]) -> None:
        self._backend_of = backend_of
        self.named: dict[tuple[str, str], Terminal] = {}
        self._starting: dict[tuple[str, str], asyncio.Lock] = {}

    async def open(self, sandbox_id: str, req: AttachOpen) -> tuple[Terminal, bool]:
        """The terminal for ``req``: the named one if it runs (False), else a new one (True)."""
        if req.name is not None:
            if not req.tty:
                raise InvalidSpec("a named terminal needs tty=true (streamed stdin is one connection's)",
                                  field="name")
            key = (sandbox_id, req.name)
            lock = self._starting.setdefault(key, asyncio.Lock())
            async with lock:
                t = self.named.get(key)
                if t is not None and t.exit is None:
                    return t, False
                if sum(1 for s, _ in self.named if s == sandbox_id) >= MAX_NAMED:
                    raise QuotaExceeded(f"sandbox {sandbox_id} has {MAX_NAMED} named terminals: end one first "
                                        "(exit its shell) or attach to an existing name")
                t = await self._start(sandbox_id, req)
                self.named[key] = t
                return t, True
        return await self._start(sandbox_id, req), True

    async def _start(self, sandbox_id: str, req: AttachOpen) -> Terminal:
        rt = self._backend_of(sandbox_id)
        rt.capabilities.require(Capability.PTY if req.tty else Capability.EXEC,
                                what="terminals" if req.tty else None)
        argv = list(SHELL_ARGV) if req.cmd is None else ["/bin/sh", "-c", req.cmd] if isinstance(req.cmd, str) \
            else list(req.cmd)
        if req.tty:
            env = {"TERM": "xterm-256color", **req.env}
            proc, master = await rt.start_tty(sandbox_id, argv, size=TtySize(req.rows, req.cols), env=env,
                                              cwd=req.cwd, user=req.user)
            t = Terminal(sandbox_id, req.name, argv, proc, master=master, on_end=self._ended)
        else:
            in_r, in_w = os.pipe2(os.O_CLOEXEC)
            out_r, out_w = os.pipe2(os.O_CLOEXEC)
            err_r, err_w = os.pipe2(os.O_CLOEXEC)
            try:
                proc = await rt.start_process(sandbox_id, argv, stdin=in_r, stdout=out_w, stderr=err_w, env=req.env,
                                              cwd=req.cwd, user=req.user)
            except BaseException:
                for fd in (in_w, out_r, err_r):
                    os.close(fd)
                raise
            finally:
                for fd in (in_r, out_w, err_w):
                    os.close(fd)
            t = Terminal(sandbox_id, None, argv, proc, stdin=in_w, stdout=out_r, stderr=err_r, on_end=self._ended)
        t.start()
        return t

    def _ended(self, t: Terminal) -> None:
        if t.name is not None and self.named.get((t.sandbox_id, t.name)) is t:
            del self.named[(t.sandbox_id, t.name)]
            self._starting.pop((t.sandbox_id, t.name), None)

    def list(self, sandbox_id: str) -> list[TerminalInfo]:
        return [t.info() for (s, _), t in sorted(self.named.items()) if s == sandbox_id]

    def close_all(self) -> None:
        for t in list(self.named.values()):
            t.kill()


async def serve_terminal(ws: Any, term: Terminal, *, new: bool) -> None:
    """Relay one WebSocket client (Starlette's ``WebSocket``) to ``term`` until the command
    ends, the client goes or detaches. An unnamed terminal dies with its client."""
    client = term.attach()
    await ws.send_text(json.dumps({"attached": {"name": term.name, "pid": term.proc.pid, "new": new,
                                                "tty": term.tty}}))

    async def pump_out() -> None:
        while True:
            item = await client.get()
            if item is None:
                return
            if isinstance(item, bytes):
                await ws.send_bytes(item)
            else:
                await ws.send_text(json.dumps(item))

    async def pump_in() -> str:
        while True:
            msg = await ws.receive()
            if msg["type"] == "websocket.disconnect":
                return "gone"
            if msg.get("bytes") is not None:
                await term.write(msg["bytes"])
                continue
            try:
                ctl = json.loads(msg.get("text") or "")
            except ValueError:
                ctl = None
            if not isinstance(ctl, dict):
                await ws.send_text(json.dumps({"error": {"code": "invalid_spec", "message":
                                                         "control messages are JSON objects: resize, eof, signal, detach"}}))
                continue
            try:
                if "resize" in ctl:
                    size = ctl["resize"] or {}
                    term.resize(int(size.get("rows", 24)), int(size.get("cols", 80)))
                if ctl.get("eof"):
                    term.eof()
                if ctl.get("signal"):
                    term.signal(str(ctl["signal"]))
            except (InvalidSpec, TypeError, ValueError) as exc:
                await ws.send_text(json.dumps({"error": {"code": "invalid_spec", "message": str(exc)}}))
            if ctl.get("detach"):
                return "detached"

    out = asyncio.ensure_future(pump_out())
    inp = asyncio.ensure_future(pump_in())
    try:
        await asyncio.wait((out, inp), return_when=asyncio.FIRST_COMPLETED)
    finally:
        term.detach(client)
        for task in (out, inp):
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        if term.name is None:
            term.kill()  # nobody can come back to an unnamed terminal
    with contextlib.suppress(Exception):
        await ws.close()
