"""Asyncio client of the native dsec-spawner (one per runtime).

Owns the SOCK_SEQPACKET conversation: requests carry a request id, replies may
arrive out of order, and ``exit`` events report every child the spawner reaps.
Never blocks the event loop: the socket is read from a loop reader callback.
Never builds a request itself: :mod:`~dsec.backends.container.wire` does
(:meth:`Spawner.send` takes its typed requests).
"""

from __future__ import annotations

import array
import asyncio
import itertools
import os
import socket
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from dsec.backends.container import wire
from dsec.errors import HostError


@dataclass(frozen=True, slots=True)
class ChildExit:
    pid: int
    status: int
    utime_s: float
    stime_s: float
    maxrss_kib: int

    @property
    def exit_code(self) -> int | None:
        return os.waitstatus_to_exitcode(self.status) if os.WIFEXITED(self.status) else None

    @property
    def signal(self) -> int | None:
        return os.WTERMSIG(self.status) if os.WIFSIGNALED(self.status) else None


class SpawnError(Exception):
    """The spawner refused or failed a request; ``stage`` says which step."""

    def __init__(self, stage: str, errno_: int, message: str, pid: int = 0) -> None:
        super().__init__(f"{stage}: {message} ({os.strerror(errno_) if errno_ else 'failed'})")
        self.stage = stage
        self.errno = errno_
        self.detail = message
        self.pid = pid
        """A failed create's init, exited but not reaped: the runtime's child, to reap (0: none)."""


@dataclass(frozen=True, slots=True)
class Spawned:
    pid: int
    pidfd: int


class Spawner:
    def __init__(self, binary: Path, *, netns_pool: int = 32) -> None:
        self._binary = binary
        self._netns_pool = netns_pool
        self._sock: socket.socket | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._rids = itertools.count(1)
        self._waiting: dict[str, asyncio.Future[tuple[list[str], int | None]]] = {}
        self._exits: dict[int, asyncio.Future[ChildExit]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self.lost = False

    async def start(self) -> None:
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        parent.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 * 1024 * 1024)
        parent.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 * 1024 * 1024)
        try:
            self._proc = subprocess.Popen(
                ["dsec-spawner", str(child.fileno()), str(self._netns_pool)],
                executable=str(self._binary),
                pass_fds=(child.fileno(),),
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # Ctrl-C in a terminal must not kill sandboxes' parent
                close_fds=True,
            )
        except OSError as exc:
            parent.close()
            raise HostError(f"cannot start {self._binary}: {exc}") from exc
        finally:
            child.close()
        parent.setblocking(False)
        self._sock = parent
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(parent.fileno(), self._on_readable)
        ping = wire.PingRequest()
        reply, _ = await self.request(ping.OP, ping.encode())
        if reply[0] != "ok":
            raise HostError("dsec-spawner did not answer its first ping")

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def alive(self) -> bool:
        """The process runs and its socket is open (a health check; it reaps a dead one)."""
        return not self.lost and self._proc is not None and self._proc.poll() is None

    async def close(self) -> None:
        if self._sock is not None and self._loop is not None:
            self._loop.remove_reader(self._sock.fileno())
            self._sock.close()
            self._sock = None
        if self._proc is not None:
            proc = self._proc
            self._proc = None
            await asyncio.get_running_loop().run_in_executor(None, proc.wait)

    def exit_future(self, pid: int) -> asyncio.Future[ChildExit]:
        fut = self._exits.get(pid)
        if fut is None:
            assert self._loop is not None
            fut = self._loop.create_future()
            self._exits[pid] = fut
        return fut

    def forget_exit(self, pid: int) -> None:
        self._exits.pop(pid, None)

    async def request(
        self, op: str, fields: Sequence[tuple[str, str]], fds: Sequence[int] = ()
    ) -> tuple[list[str], int | None]:
        """Send one request (raw fields: :meth:`send` is the typed way) and wait for its reply."""
        if self._sock is None or self.lost:
            raise HostError("the dsec-spawner is not running")
        rid = str(next(self._rids))
        data = wire.frame(op, rid, fields)
        assert self._loop is not None
        fut: asyncio.Future[tuple[list[str], int | None]] = self._loop.create_future()
        self._waiting[rid] = fut
        try:
            anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())] if fds else []
            while True:
                try:
                    self._sock.sendmsg([data], anc)
                    break
                except BlockingIOError:
                    await asyncio.sleep(0.0005)
            return await fut
        finally:
            self._waiting.pop(rid, None)

    async def send(self, req: wire.CreateRequest | wire.ExecRequest) -> Spawned:
        """Start what ``req`` asks for (its fields from ``req.encode()``, its fds in order)."""
        return await self.spawn(req.OP, req.encode(), req.fds())

    async def spawn(self, op: str, fields: Sequence[tuple[str, str]], fds: Sequence[int] = ()) -> Spawned:
        """A create or exec from raw fields (tests of the spawner's own checks use it)."""
        reply, fd = await self.request(op, fields, fds)
        if reply[0] == "ok":
            assert fd is not None, "spawner replied ok without a pidfd"
            return Spawned(pid=int(reply[3]), pidfd=fd)
        stage, err, msg, pid = ([*reply[2:], "?", "0", "", "0"])[:4]
        raise SpawnError(stage, int(err or 0), msg, int(pid) if pid.isdigit() else 0)

    def _on_readable(self) -> None:
        assert self._sock is not None
        while True:
            try:
                data, anc, _flags, _addr = self._sock.recvmsg(65536, socket.CMSG_SPACE(16))
            except BlockingIOError:
                return
            except OSError:
                data = b""
                anc = []
            if not data:
                self._on_lost()
                return
            fd: int | None = None
            for level, typ, payload in anc:
                if level == socket.SOL_SOCKET and typ == socket.SCM_RIGHTS and len(payload) >= 4:
                    fd = int.from_bytes(payload[:4], "little", signed=True)
            toks = data.rstrip(b"\0").decode(errors="replace").split("\0")
            if toks[0] == "exit":
                ex = ChildExit(int(toks[1]), int(toks[2]), int(toks[3]) / 1e6, int(toks[4]) / 1e6, int(toks[5]))
                fut = self.exit_future(ex.pid)
                if not fut.done():
                    fut.set_result(ex)
                continue
            if toks[0] == "ok" and len(toks) >= 4 and toks[2] == "pid":
                self.exit_future(int(toks[3]))  # registered before any exit event can arrive
            waiter = self._waiting.get(toks[1]) if len(toks) > 1 else None
            if waiter is not None and not waiter.done():
                waiter.set_result((toks, fd))
            elif fd is not None:
                os.close(fd)

    def _on_lost(self) -> None:
        self.lost = True
        if self._sock is not None and self._loop is not None:
            self._loop.remove_reader(self._sock.fileno())
        err = HostError("dsec-spawner exited unexpectedly; the runtime starts a new one on the next request")
        for fut in self._waiting.values():
            if not fut.done():
                fut.set_exception(err)
        # Exit statuses of processes it was watching are lost with it.
        for pid, xfut in self._exits.items():
            if not xfut.done():
                xfut.set_exception(HostError(f"exit status of pid {pid} lost: dsec-spawner exited", pid=pid))
                xfut.exception()  # mark retrieved: nobody may be waiting
