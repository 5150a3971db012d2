"""The runsc command line, and the host processes it runs as.

Owns every ``runsc`` invocation of the gVisor backend: the global flags (the same on
every call: ``start`` reads ``--network`` again, for one), container ids, ``run``,
``exec``, ``delete``, ``pause``/``resume``, ``list``. Processes are started with
``posix_spawn`` (vfork: no copy of a large edge's page tables) and awaited through a
pidfd on the event loop; nothing here blocks the loop or forks the Python process.

Must never: pass a flag that differs between calls for one container, or leave a
child unreaped (every spawned pid is awaited; sandbox and gofer processes that are
reparented to us are watched and reaped by :class:`Reaper`).
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import ctypes
import functools
import json
import os
import shutil
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from dsec.backends.common.fdio import read_chunk
from dsec.errors import HostError

PR_SET_CHILD_SUBREAPER: Final = 36
_FD_FLOOR: Final = 10
"""Source fds are moved at or above this before a spawn, so dup2 onto 0..9 never clobbers one."""


@dataclass(frozen=True, slots=True)
class Exit:
    """How a host process ended: ``code`` when it exited, ``signal`` when a signal killed it."""

    code: int | None
    signal: int | None


_subreaper_holders = 0
_awaited: set[int] = set()
"""Pids a :class:`Watched` reaps itself (its exit status matters): the sweeper leaves them."""
RUNSC_COMMS: Final = frozenset({"exe", "runsc", "runsc-gofer", "runsc-sandbox", "dsec-gvexec"})
"""Names of the processes runsc leaves behind (it re-executes itself as /proc/self/exe)."""


def hold_subreaper() -> bool:
    """Make this process a child subreaper (orphans of its descendants become its children,
    to be reaped by their watchers) for as long as one backend holds it."""
    global _subreaper_holders
    _subreaper_holders += 1
    if _subreaper_holders == 1:
        return _prctl_subreaper(1)
    return True


def release_subreaper() -> None:
    global _subreaper_holders
    _subreaper_holders = max(0, _subreaper_holders - 1)
    if _subreaper_holders == 0:
        _prctl_subreaper(0)
        reap_orphans()  # what was reparented while we held it


def _forget_awaited(pid: int, _f: object) -> None:
    _awaited.discard(pid)


def reap_orphans() -> int:
    """Reap the zombies of runsc processes that were reparented to this process (it is
    their subreaper while a gVisor backend runs) and that nobody awaits: a sandbox's
    ``runsc`` and gofer helpers, ``runsc exec`` leftovers. Reads only this process's own
    children lists (cheap at any node size); returns how many it reaped."""
    me = os.getpid()
    n = 0
    for t in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{t}/children") as f:
                kids = [int(x) for x in f.read().split()]
        except OSError:
            continue
        for pid in kids:
            if pid in _awaited:
                continue
            try:
                with open(f"/proc/{pid}/stat", "rb") as f:
                    stat = f.read()
            except OSError:
                continue
            comm = stat[stat.index(b"(") + 1 : stat.rindex(b")")].decode(errors="replace")
            rest = stat[stat.rindex(b")") + 2 :].split()
            if rest[0] != b"Z" or int(rest[1]) != me or comm not in RUNSC_COMMS:
                continue
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG)
                n += 1
    return n


def _prctl_subreaper(on: int) -> bool:
    libc = ctypes.CDLL(None, use_errno=True)
    return int(libc.prctl(PR_SET_CHILD_SUBREAPER, on, 0, 0, 0)) == 0


def _high(fd: int) -> int:
    return fcntl_dupfd(fd) if fd < _FD_FLOOR else fd


def fcntl_dupfd(fd: int) -> int:
    import fcntl

    return fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, _FD_FLOOR)


def spawn(argv: Sequence[str], fds: Mapping[int, int], *, env: Mapping[str, str] | None = None) -> int:
    """Start ``argv`` with ``fds`` (child fd -> our fd) as its only open descriptors; its pid."""
    moved: list[int] = []
    actions: list[tuple[Any, ...]] = []
    try:
        for child_fd, ours in sorted(fds.items()):
            src = _high(ours)
            if src != ours:
                moved.append(src)
            actions.append((os.POSIX_SPAWN_DUP2, src, child_fd))
        return os.posix_spawn(argv[0], list(argv), dict(env if env is not None else os.environ),
                              file_actions=actions, setsigdef=(signal.SIGPIPE, signal.SIGINT, signal.SIGQUIT,
                                                               signal.SIGHUP, signal.SIGTERM))
    finally:
        for fd in moved:
            os.close(fd)


class Watched:
    """A host process awaited through a pidfd: ``exited`` resolves (and the zombie is reaped
    if it is our child) once it ends."""

    def __init__(self, pid: int, loop: asyncio.AbstractEventLoop) -> None:
        self.pid = pid
        self.exited: asyncio.Future[Exit] = loop.create_future()
        self._loop = loop
        try:
            self._fd = os.pidfd_open(pid)
        except ProcessLookupError:
            self._fd = -1
            self.exited.set_result(Exit(None, None))
            return
        _awaited.add(pid)
        self.exited.add_done_callback(functools.partial(_forget_awaited, pid))
        loop.add_reader(self._fd, self._ready)

    def _ready(self) -> None:
        self._loop.remove_reader(self._fd)
        ex = Exit(None, None)
        try:
            info = os.waitid(os.P_PIDFD, self._fd, os.WEXITED)
            if info is not None:
                ex = Exit(info.si_status, None) if info.si_code == os.CLD_EXITED else Exit(None, info.si_status)
        except ChildProcessError:
            pass  # not our child (adopted after a restart): its parent reaps it
        os.close(self._fd)
        self._fd = -1
        if not self.exited.done():
            self.exited.set_result(ex)

    def signal(self, sig: int) -> None:
        if self._fd >= 0:
            with contextlib.suppress(ProcessLookupError, OSError):
                signal.pidfd_send_signal(self._fd, sig)

    def close(self) -> None:
        """Stop watching (the process is left alone)."""
        if self._fd >= 0:
            self._loop.remove_reader(self._fd)
            os.close(self._fd)
            self._fd = -1


async def run_captured(argv: Sequence[str], *, timeout: float = 60.0, stdin_fd: int | None = None,
                       extra_fds: Mapping[int, int] | None = None) -> tuple[Exit, bytes, bytes]:
    """Run to completion with stdout and stderr captured (both small: runsc's own output);
    ``extra_fds`` (child fd -> ours, from 3 up) are handed over too."""
    loop = asyncio.get_running_loop()
    out_r, out_w = os.pipe2(os.O_CLOEXEC)
    err_r, err_w = os.pipe2(os.O_CLOEXEC)
    null = os.open("/dev/null", os.O_RDWR | os.O_CLOEXEC)
    try:
        pid = spawn(argv, {0: stdin_fd if stdin_fd is not None else null, 1: out_w, 2: err_w, **(extra_fds or {})})
    except BaseException:
        for fd in (out_r, out_w, err_r, err_w, null):
            os.close(fd)
        raise
    for fd in (out_w, err_w, null):
        os.close(fd)
    proc = Watched(pid, loop)
    bufs: dict[int, bytearray] = {out_r: bytearray(), err_r: bytearray()}
    eof: dict[int, asyncio.Future[None]] = {fd: loop.create_future() for fd in bufs}

    def readable(fd: int) -> None:
        chunk = read_chunk(fd)
        if chunk is None:
            return
        if chunk:
            bufs[fd] += chunk
            if len(bufs[fd]) > 1 << 24:
                del bufs[fd][: len(bufs[fd]) - (1 << 24)]
            return
        loop.remove_reader(fd)
        if not eof[fd].done():
            eof[fd].set_result(None)

    for fd in bufs:
        os.set_blocking(fd, False)
        loop.add_reader(fd, readable, fd)
    try:
        ex = await asyncio.wait_for(asyncio.shield(proc.exited), timeout)
        # What runsc wrote is in the pipes once it has exited; its children (the sandbox of a
        # `run --detach` holds them as the container's stdio) may keep them open for good, so
        # drain what is there and never wait for an EOF.
        for fd in bufs:
            while not eof[fd].done() and len(bufs[fd]) < 1 << 24:
                size = len(bufs[fd])
                readable(fd)
                if len(bufs[fd]) == size:
                    break
    except TimeoutError:
        proc.signal(signal.SIGKILL)
        await proc.exited
        raise
    finally:
        for fd in bufs:
            if not eof[fd].done():
                loop.remove_reader(fd)
            os.close(fd)
    return ex, bytes(bufs[out_r]), bytes(bufs[err_r])


class RunscError(HostError):
    """A runsc command failed (``command``, ``stderr``)."""


class Runsc:
    """One runsc state root and the global flags every call of this backend uses."""

    def __init__(self, binary: Path | None, *, root: Path, platform: str, file_access: str = "shared",
                 debug_log_dir: Path | None = None) -> None:
        found = str(binary) if binary is not None else shutil.which("runsc")
        if found is None or not os.access(found, os.X_OK):
            raise HostError("runsc is not installed: apt-get install -t bookworm-backports runsc "
                            "(scripts/setup.sh enables bookworm-backports and installs it)", binary=str(binary))
        self.binary = found
        self.root = root
        self.platform = platform
        self.flags = [
            f"--root={root}", f"--platform={platform}",
            "--network=none",  # loopback only: no host network, no veth
            "--overlay2=none",  # writes land in our upper (a host overlay), not in sentry memory
            f"--file-access={file_access}",  # shared: the host edits files too (files API), no stale caches
        ]
        if debug_log_dir is not None:
            self.flags += ["--debug", f"--debug-log={debug_log_dir}/"]

    def argv(self, *args: str) -> list[str]:
        return [self.binary, *self.flags, *args]

    async def call(self, *args: str, timeout: float = 60.0, what: str = "",
                   extra_fds: Mapping[int, int] | None = None) -> bytes:
        """Run a runsc subcommand; its stdout, or :class:`RunscError` with its stderr."""
        argv = self.argv(*args)
        ex, out, err = await run_captured(argv, timeout=timeout, extra_fds=extra_fds)
        if ex.code != 0:
            text = err.decode(errors="replace").strip().splitlines()
            raise RunscError(f"runsc {what or args[0]} failed: {text[-1] if text else ex}",
                             command=" ".join(argv), stderr=err.decode(errors="replace")[-4000:])
        return out

    async def version(self) -> str:
        _ex, out, _ = await run_captured([self.binary, "--version"], timeout=20)
        return out.decode(errors="replace").splitlines()[0] if out else ""

    def container_ids(self) -> builtins.list[str]:
        """Containers under this root, from runsc's state files. (``runsc list`` asks each
        sandbox for its status and hangs on one whose cgroup is frozen.)"""
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return []
        return sorted({n.split("_sandbox:", 1)[0] for n in names if "_sandbox:" in n and n.endswith(".state")})

    async def delete(self, cid: str, *, timeout: float = 30.0) -> None:
        await self.call("delete", "-force", cid, timeout=timeout, what="delete")

    async def pause(self, cid: str) -> None:
        await self.call("pause", cid, what="pause")

    async def resume(self, cid: str) -> None:
        await self.call("resume", cid, what="resume")

    def gofer_pid(self, cid: str) -> int:
        """The gofer's host pid from runsc's state file (0: unknown). A gofer that exited while
        no backend watched it is a zombie runsc delete waits for; its reaper needs the pid."""
        path = self.root / f"{cid}_sandbox:{cid}.state"
        try:
            return int(json.loads(path.read_bytes()).get("goferPid") or 0)
        except (OSError, ValueError, TypeError, AttributeError):
            return 0

    def state_files(self, cid: str) -> builtins.list[Path]:
        """runsc's own files of one container (a fallback cleanup when ``delete`` cannot run)."""
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return []
        return [self.root / n for n in names if n.startswith(f"{cid}_sandbox:") or n == f"runsc-{cid}.sock"]
