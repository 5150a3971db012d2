"""Commands in a gVisor sandbox: one ``runsc exec`` of our helper per command, and its output.

A command runs as ``runsc exec --exec-fd=<helper> <container> dsec-gvexec run UID GID TOKEN
CWD ARGV...``: the helper (native/dsec-gvexec.c) starts the command inside the sandbox in a
cgroup of its own (``<helper pid>.TOKEN`` of gVisor's job hierarchy), and reports on fd 3 (a
pipe of ours) its own pid, which is the command's session id, then the exact wait status
(``runsc exec`` alone says 128+n for a signal, like a shell). The command's stdio are our
pipes, passed through runsc to the sentry as they are.

Killing the tree (timeouts, cancellation) is a second ``runsc exec`` of the helper as
root: ``kill <cgroup> <uts ns> <helper> <helper>`` stops every process of the command's
UTS namespace (its own; the command's seccomp filter keeps everything it starts there,
however it detached: setsid, orphaned, another cgroup), of its cgroup and of its session and
their descendants, then kills them, so nothing forks its way out. A helper that dies
without reporting (a root command may kill it) gets its command killed the same way before
the end is reported: nothing of a command runs on unwatched.

Owns: :class:`Command` (the process handle); its output is collected as every backend's is
(:func:`dsec.backends.common.output.collect`). Never blocks the loop; never signals a host
process of the sandbox (its processes are not host processes).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Final

from dsec.backends.common.fdio import read_chunk
from dsec.backends.gvisor.runsc import Exit, Watched

KILL_GRACE_S: Final = 10.0
"""After the in-sandbox kill, how long ``runsc exec`` may take to report before it is killed itself."""


MAX_STATUS_LINES: Final = 8


def _is_int(word: str) -> bool:
    return word.lstrip("-").isdigit() and len(word) < 20


@dataclass(frozen=True, slots=True)
class CommandExit:
    """How a command ended, as the helper saw it inside the sandbox."""

    exit_code: int | None
    signal: int | None
    utime_s: float = 0.0
    stime_s: float = 0.0
    error: tuple[int, str] | None = None
    """(errno, stage) when it could not start: "cwd", "exec", or the helper's own steps ("fork",
    "cgroup", "namespace", "creds", "seccomp")."""
    lost: bool = False
    """The helper never reported: runsc could not start it, the sandbox died, or the helper was
    killed (by its own command: root may; then the command is killed too, before this is known)."""
    runsc: Exit | None = None


class Command:
    """A command started in a sandbox (satisfies ``dsec.backends.base.ProcessHandle``).

    ``pid`` is the host pid of its ``runsc exec`` process; ``inner_pid`` the helper's pid
    inside the sandbox (the command's session id) once ``started`` is done."""

    def __init__(self, sandbox_id: str, runsc_exec: Watched, status_fd: int,
                 killer: Callable[[Command, bool], Awaitable[None]], *, cgroup_token: str = "") -> None:
        self.sandbox_id = sandbox_id
        self.cgroup_token = cgroup_token
        self.pid = runsc_exec.pid
        self.started_at = time.monotonic()
        self.start_latency_s = 0.0
        self.inner_pid = 0
        self.command_pid = 0
        self.uts_ns = 0
        """The command's own UTS namespace (its inode inside the sandbox): nothing it starts can
        leave it (its seccomp filter), so a kill finds them all by it."""
        self._runsc = runsc_exec
        self._killer = killer
        self._kill_task: asyncio.Task[None] | None = None
        self._fd = status_fd
        self._buf = bytearray()
        self._lines: list[list[str]] = []
        loop = asyncio.get_running_loop()
        self.started: asyncio.Future[None] = loop.create_future()
        self.exited: asyncio.Future[CommandExit] = loop.create_future()
        self._status_eof: asyncio.Future[None] = loop.create_future()
        os.set_blocking(status_fd, False)
        loop.add_reader(status_fd, self._readable)
        self._waiter = asyncio.ensure_future(self._wait())

    def _readable(self) -> None:
        chunk = read_chunk(self._fd, 4096)
        if chunk is None:
            return
        if not chunk:
            asyncio.get_running_loop().remove_reader(self._fd)
            if not self._status_eof.done():
                self._status_eof.set_result(None)
            if not self.started.done():
                self.started.set_result(None)
            return
        # Lines are parsed defensively and few are kept: the helper is root's and not dumpable
        # (no command can ptrace it), but a root command of the same sandbox can write here
        # (gVisor skips the ptrace check on /proc/<pid>/fd: docs/GVISOR.md), so a lie
        # misreports a command of that sandbox, never anything beyond it.
        self._buf += chunk[: max(0, 4096 - len(self._buf))]
        while b"\n" in self._buf:
            line, _, rest = bytes(self._buf).partition(b"\n")
            self._buf[:] = rest
            words = line.decode(errors="replace").split()
            if not words or len(self._lines) >= MAX_STATUS_LINES or not all(_is_int(w) for w in words[1:2]):
                continue
            self._lines.append(words)
            if words[0] == "P" and len(words) == 4 and all(_is_int(w) for w in words[2:]) and not self.inner_pid:
                self.inner_pid, self.command_pid, self.uts_ns = int(words[1]), int(words[2]), int(words[3])
                self.start_latency_s = time.monotonic() - self.started_at
            if words[0] in ("P", "E") and not self.started.done():
                self.started.set_result(None)

    async def _wait(self) -> None:
        ex = await self._runsc.exited
        # runsc exec exits after the helper: what it wrote is in the pipe (EOF follows at once).
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._status_eof), 2.0)
        if not self._status_eof.done():
            self._readable()
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(self._fd)
        os.close(self._fd)
        self._fd = -1
        if not self.started.done():
            self.started.set_result(None)
        try:
            outcome = self._outcome(ex)
        except (ValueError, IndexError):  # nothing the helper says may keep exited unresolved
            outcome = CommandExit(ex.code, ex.signal, lost=True, runsc=ex)
        if outcome.lost and self.inner_pid > 0:
            # The helper started the command and then never reported: killed, by the command
            # itself (root may), or with the sandbox. What it started would run on unwatched,
            # past any timeout: it is killed before the end is reported (nothing to do if the
            # sandbox is gone).
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._killer(self, True), KILL_GRACE_S)
        self.exited.set_result(outcome)

    def _outcome(self, ex: Exit) -> CommandExit:
        error: tuple[int, str] | None = None
        for words in self._lines:
            if words[0] == "E" and len(words) == 3:
                error = (int(words[1]), words[2])
            elif words[0] in ("X", "K") and len(words) == 4 and all(_is_int(w) for w in words[1:]):
                code, ut, st = int(words[1]), int(words[2]) / 1e6, int(words[3]) / 1e6
                if error is not None:
                    return CommandExit(None, None, ut, st, error=error, runsc=ex)
                if words[0] == "X":
                    return CommandExit(code, None, ut, st, runsc=ex)
                return CommandExit(None, code, ut, st, runsc=ex)
        if error is not None:
            return CommandExit(None, None, error=error, runsc=ex)
        # No word from the helper: it was killed (by the command itself: `kill -9` of its
        # parent), runsc failed, or the sandbox is gone. runsc's own status is all there is.
        if ex.code is not None and ex.code > 128:
            return CommandExit(None, ex.code - 128, lost=True, runsc=ex)
        return CommandExit(ex.code, ex.signal, lost=True, runsc=ex)

    @property
    def cgroup(self) -> str:
        """The command's cgroup inside the sandbox, ``<helper pid>.<token>`` ("-": none known)."""
        return f"{self.inner_pid}.{self.cgroup_token}" if self.inner_pid > 0 and self.cgroup_token else "-"

    @property
    def namespace(self) -> str:
        """The command's UTS namespace for the helper's kill ("-": none known)."""
        return str(self.uts_ns) if self.uts_ns > 0 else "-"

    @property
    def running(self) -> bool:
        return not self.exited.done()

    def kill(self, *, tree: bool = True) -> None:
        """Kill the command (with ``tree``: every process of its session, and their
        descendants) from inside the sandbox. Returns at once; ``exited`` tells when."""
        if self._kill_task is None and not self.exited.done():
            self._kill_task = asyncio.ensure_future(self._kill(tree))

    async def _kill(self, tree: bool) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self.started), KILL_GRACE_S)
        if not self.exited.done():
            with contextlib.suppress(Exception):
                await self._killer(self, tree)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self.exited), KILL_GRACE_S)
        if not self.exited.done():
            self._runsc.signal(signal.SIGKILL)  # last resort: runsc exec itself

    async def wait_killed(self) -> None:
        if self._kill_task is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(self._kill_task)
