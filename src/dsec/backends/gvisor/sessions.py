"""Persistent shells in gVisor sandboxes: the container backend's :class:`Session` over a
command started through ``runsc exec``.

The protocol (one long-lived shell, each command an ``eval`` followed by a marker with
``$?``) is the container backend's own, reused as is. What differs is how a timed-out
command is killed: its processes are not host processes, so the shell's descendants are
stopped and killed from inside the sandbox by the helper (``killchildren``), and the
shell lives on with its state.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, cast

from dsec.backends.container.sessions import Session

if TYPE_CHECKING:
    from dsec.backends.gvisor.backend import GVisorBackend
    from dsec.backends.gvisor.process import Command


class GVisorSession(Session):
    def __init__(self, backend: GVisorBackend, sandbox_id: str, session_id: str) -> None:
        # Session talks to its runtime through start_process, sandboxes, last_activity,
        # limit_baseline/limit_hit and _sessions: the backend offers each of them.
        super().__init__(cast(Any, backend), sandbox_id, session_id)
        self._backend = backend
        self._kills: set[asyncio.Task[None]] = set()

    def _kill_command(self) -> None:
        proc = cast("Command | None", self._proc)
        if proc is None:
            return
        task = asyncio.ensure_future(self._backend.kill_children(proc))
        self._kills.add(task)
        task.add_done_callback(self._kills.discard)
