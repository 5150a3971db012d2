"""Persistent shells in gVisor sandboxes: the shared :class:`Session` over a command started
through ``runsc exec``.

The protocol (one long-lived shell, each command an ``eval`` followed by a marker with
``$?``) is the one every backend uses (:mod:`dsec.backends.common.sessions`). What differs
is how a timed-out command is killed: its processes are not host processes, so the helper
stops and kills, from inside the sandbox, everything the shell started (its cgroup,
session and descendants), and the shell lives on with its state. :class:`GVisorSessionHost`
is exactly what a session uses of the backend, for one sandbox.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from dsec.backends.common.sessions import Session, ShellProcess
from dsec.spec.results import LimitHit

if TYPE_CHECKING:
    from dsec.backends.base import SandboxRecord
    from dsec.backends.gvisor.process import Command


class GVisorCalls(Protocol):
    """What a session uses of the gVisor backend (it satisfies this)."""

    last_activity: dict[str, float]

    @property
    def sandboxes(self) -> Mapping[str, SandboxRecord]: ...
    async def start_process(self, sandbox_id: str, argv: Sequence[str], *, stdin: int, stdout: int, stderr: int,
                            env: Mapping[str, str] | None = None, cwd: str = "/",
                            user: int | str = 0) -> Command: ...
    def wake(self, sandbox_id: str) -> bool: ...
    def limit_baseline(self, rec: SandboxRecord) -> Any: ...
    def limit_hit(self, rec: SandboxRecord, before: Any, *, exit_code: int | None, sig: int | None,
                  timed_out: str | None = None, timeout_s: float | None = None, idle_timeout_s: float | None = None,
                  truncated: bool = False, output_cap: int = 0,
                  output: tuple[bytes, ...] = ()) -> LimitHit | None: ...
    async def kill_children(self, proc: Command) -> None: ...
    def forget_session(self, sandbox_id: str, session_id: str) -> None: ...


class GVisorSessionHost:
    """One gVisor sandbox as its sessions see it (:class:`SessionHost`)."""

    def __init__(self, backend: GVisorCalls, sandbox_id: str) -> None:
        self._backend = backend
        self._sid = sandbox_id
        self._kills: set[asyncio.Task[None]] = set()

    async def start_process(self, argv: Sequence[str], *, stdin: int, stdout: int, stderr: int,
                            env: Mapping[str, str] | None = None, cwd: str = "/", user: int | str = 0) -> Command:
        return await self._backend.start_process(self._sid, argv, stdin=stdin, stdout=stdout, stderr=stderr,
                                                 env=env, cwd=cwd, user=user)

    def wake(self) -> bool:
        return self._backend.wake(self._sid)

    def limit_baseline(self) -> object | None:
        rec = self._backend.sandboxes.get(self._sid)
        return None if rec is None else self._backend.limit_baseline(rec)

    def limit_hit(self, before: Any, **kw: Any) -> LimitHit | None:
        rec = self._backend.sandboxes.get(self._sid)
        return None if rec is None else self._backend.limit_hit(rec, before, **kw)

    def kill_command(self, shell: ShellProcess) -> None:
        task = asyncio.ensure_future(self._backend.kill_children(shell))  # type: ignore[arg-type]
        self._kills.add(task)
        task.add_done_callback(self._kills.discard)

    def touch(self) -> None:
        self._backend.last_activity[self._sid] = time.monotonic()

    def drop_session(self, session_id: str) -> None:
        self._backend.forget_session(self._sid, session_id)


class GVisorSession(Session):
    def __init__(self, backend: GVisorCalls, sandbox_id: str, session_id: str) -> None:
        super().__init__(GVisorSessionHost(backend, sandbox_id), sandbox_id, session_id)
        self.opened_at = time.monotonic()


__all__ = ["GVisorSession", "GVisorSessionHost"]
