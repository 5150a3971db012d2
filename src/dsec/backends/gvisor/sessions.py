"""Persistent shells in gVisor sandboxes: the container backend's :class:`Session` over a
command started through ``runsc exec``.

The protocol (one long-lived shell, each command an ``eval`` followed by a marker with
``$?``) is the container backend's own, reused as is. What differs is how a timed-out
command is killed: its processes are not host processes, so the helper stops and kills,
from inside the sandbox, everything the shell started (its cgroup, session and
descendants), and the shell lives on with its state.

Session talks to "its runtime" through a few members; :class:`_Door` is exactly those,
backed by the gVisor backend, so Session never reaches into the backend itself.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

from dsec.backends.container.sessions import Session

if TYPE_CHECKING:
    from dsec.backends.gvisor.backend import GVisorBackend
    from dsec.backends.gvisor.process import Command


class _Box:
    """The per-sandbox part Session asks for (``sandbox_state``): its session table."""

    def __init__(self, backend: GVisorBackend, sandbox_id: str) -> None:
        self._backend = backend
        self._sid = sandbox_id

    def drop_session(self, session_id: str) -> None:
        self._backend.forget_session(self._sid, session_id)


class _Door:
    """What :class:`Session` uses of a runtime, and nothing more."""

    def __init__(self, backend: GVisorBackend) -> None:
        self._backend = backend
        self.sandboxes = backend.sandboxes
        self.last_activity = backend.last_activity

    async def start_process(self, sandbox_id: str, argv: Sequence[str], *, stdin: int, stdout: int, stderr: int,
                            env: Mapping[str, str] | None = None, cwd: str = "/", user: int | str = 0,
                            **_: Any) -> Command:
        return await self._backend.start_process(sandbox_id, argv, stdin=stdin, stdout=stdout, stderr=stderr,
                                                 env=env, cwd=cwd, user=user)

    def limit_baseline(self, rec: Any) -> Any:
        return self._backend.limit_baseline(rec)

    def limit_hit(self, rec: Any, before: Any, **kw: Any) -> Any:
        return self._backend.limit_hit(rec, before, **kw)

    def sandbox_state(self, sandbox_id: str) -> _Box | None:
        return _Box(self._backend, sandbox_id) if sandbox_id in self._backend.sandboxes else None

    @property
    def _sessions(self) -> dict[str, dict[str, Any]]:  # what older Session versions pop from
        return self._backend.session_table()


class GVisorSession(Session):
    def __init__(self, backend: GVisorBackend, sandbox_id: str, session_id: str) -> None:
        super().__init__(cast(Any, _Door(backend)), sandbox_id, session_id)
        self._backend = backend
        self._kills: set[asyncio.Task[None]] = set()
        self.opened_at = time.monotonic()

    def _kill_command(self) -> None:
        proc = cast("Command | None", self._proc)
        if proc is None:
            return
        task = asyncio.ensure_future(self._backend.kill_children(proc))
        self._kills.add(task)
        task.add_done_callback(self._kills.discard)
