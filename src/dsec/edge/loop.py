"""The shape every background duty of the edge shares: one named asyncio task,
started with the service and cancelled (and awaited) when it stops."""

from __future__ import annotations

import asyncio
import contextlib


class BackgroundLoop:
    """Subclasses set ``task_name`` and implement :meth:`_run` (usually ``while True``)."""

    task_name = "dsec-edge-loop"

    _task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=self.task_name)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        raise NotImplementedError
