"""Processes of container sandboxes as the host sees them: identities from /proc, trees,
and :class:`Process`, a command started in a sandbox (its exit comes through the spawner)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from dataclasses import dataclass
from pathlib import Path

from dsec.backends.container import cgroups
from dsec.backends.container.records import ContainerRecord
from dsec.backends.container.spawner import ChildExit
from dsec.spec import SandboxState


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def is_paused(rec: ContainerRecord) -> bool:
    """(A function, so type checkers do not keep a narrowing across awaits that change the state.)"""
    return rec.state is SandboxState.PAUSED


def proc_start_time(pid: int) -> int:
    """Start time (clock ticks since boot) of ``pid``: with the pid, a unique process identity."""
    return proc_identity(pid)[0]


def proc_identity(pid: int) -> tuple[int, bool]:
    """(start time, exited): an exited process that is not reaped yet (a zombie) still has one."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        data = f.read()
    fields = data[data.rindex(b")") + 2 :].split()
    return int(fields[19]), fields[0] in (b"Z", b"X")


def children_tree(pid: int) -> list[int]:
    """All descendants of ``pid`` (host pids), read from /proc/*/task/*/children."""
    out: list[int] = []
    stack = [pid]
    while stack:
        p = stack.pop()
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for t in tasks:
            try:
                with open(f"/proc/{p}/task/{t}/children") as f:
                    kids = [int(x) for x in f.read().split()]
            except OSError:
                continue
            out.extend(kids)
            stack.extend(kids)
    return out


def reap(pid: int) -> None:
    """Reap an exited child of ours, if it is one."""
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


def kill_tree(pid: int, *, include_root: bool = True) -> None:
    """SIGKILL a process, its process group and every descendant."""
    victims = children_tree(pid)
    if include_root:
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGKILL)
        victims.append(pid)
    for v in victims:
        with contextlib.suppress(OSError):
            os.kill(v, signal.SIGKILL)


@dataclass(slots=True)
class Process:
    """A process started inside a sandbox. Its exit arrives through the spawner."""

    sandbox_id: str
    pid: int
    exited: asyncio.Future[ChildExit]
    started_at: float

    track: Path | None = None
    """The command's own freezer cgroup: every process it started, detached or not."""

    start_latency_s: float = 0.0
    """From the request to the command's execve (namespaces entered, limits set)."""

    def kill(self, *, tree: bool = True) -> None:
        """SIGKILL the process; with ``tree``, everything it started (its cgroup, group and descendants)."""
        if tree:
            if self.track is not None:
                cgroups.RuntimeCgroups.kill_tracked_path(self.track)
            if not self.exited.done():
                kill_tree(self.pid)
        elif not self.exited.done():
            with contextlib.suppress(OSError):
                os.kill(self.pid, signal.SIGKILL)




__all__ = ["Process", "children_tree", "is_paused", "kill_tree", "pid_alive", "proc_identity", "proc_start_time", "reap"]
