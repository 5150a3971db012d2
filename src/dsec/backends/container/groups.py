"""Group pause and resume of a node's sandboxes (a preempted job, a task's group): a part of
:class:`~dsec.backends.container.runtime.ContainerRuntime` (a mixin over the
:class:`GroupedNode` protocol)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from typing import Protocol

from dsec.backends.base import GroupOutcome
from dsec.backends.common.records import RecordBook
from dsec.backends.container.records import ContainerRecord
from dsec.backends.container.sandbox import ContainerSandbox, RecordView
from dsec.errors import DsecError, HostError, SandboxNotFound, SandboxStateError
from dsec.spec import SandboxState


class GroupedNode(Protocol):
    sandboxes: RecordView
    records: RecordBook[ContainerRecord]
    _boxes: dict[str, ContainerSandbox]

    def live(self, sandbox_id: str) -> ContainerSandbox: ...
    async def resume(self, sandbox_id: str) -> ContainerRecord: ...


class NodeGroups:
    async def pause_many(self: GroupedNode, sandbox_ids: Sequence[str], *, reclaim: bool = True,
                         concurrency: int = 64) -> GroupOutcome:
        """Pause every sandbox in ``sandbox_ids``: all are frozen first (a preempted job stops
        at once), then their memory is pushed out. Already paused ones are skipped; errors
        are collected per sandbox (one bad sandbox never stops the group)."""
        out = GroupOutcome()
        t0 = time.perf_counter()
        frozen: list[str] = []

        async def freeze_one(sid: str) -> None:
            try:
                await self.live(sid).freeze()
                frozen.append(sid)
            except SandboxStateError as exc:
                if getattr(exc, "state", "") == "paused":
                    out.skipped.append(sid)
                else:
                    out.errors[sid] = exc
            except DsecError as exc:
                out.errors[sid] = exc

        await asyncio.gather(*(freeze_one(s) for s in dict.fromkeys(sandbox_ids)))
        if reclaim:
            sem = asyncio.Semaphore(max(1, concurrency))

            async def reclaim_one(sid: str) -> None:
                async with sem:
                    with contextlib.suppress(OSError):
                        box = self._boxes.get(sid)
                        stats = None if box is None else await box.reclaim_paused()
                        rec = self.sandboxes.get(sid)
                        if rec is not None:
                            self.records.event(rec, "paused", group=True, memory_before=stats.before if stats else None,
                                        memory_after=stats.after if stats else None)

            await asyncio.gather(*(reclaim_one(s) for s in frozen))
        out.done = frozen
        out.seconds = time.perf_counter() - t0
        return out

    async def resume_many(self: GroupedNode, sandbox_ids: Sequence[str]) -> GroupOutcome:
        """Resume every paused sandbox in ``sandbox_ids``; running ones are skipped."""
        out = GroupOutcome()
        t0 = time.perf_counter()
        for sid in dict.fromkeys(sandbox_ids):
            rec = self.sandboxes.get(sid)
            if rec is None:
                out.errors[sid] = SandboxNotFound(f"no sandbox {sid!r} on this node", sandbox_id=sid)
            elif rec.state is SandboxState.RUNNING:
                out.skipped.append(sid)
            else:
                try:
                    await self.resume(sid)
                    out.done.append(sid)
                except DsecError as exc:
                    out.errors[sid] = exc
                except OSError as exc:
                    out.errors[sid] = HostError(f"cannot thaw sandbox {sid}: {exc}", sandbox_id=sid)
        out.seconds = time.perf_counter() - t0
        return out


__all__ = ["GroupedNode", "NodeGroups"]
