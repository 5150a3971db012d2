"""Pause and resume of gVisor sandboxes (the freezer, or runsc pause), one and in groups. A part of
:class:`~dsec.backends.gvisor.backend.GVisorBackend` (a mixin over the :class:`GVisorNode`
protocol)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from dsec.backends.base import (
    GroupOutcome,
)
from dsec.backends.gvisor.records import (
    GVisorRecord,
    PauseResult,
)
from dsec.errors import (
    DsecError,
    HostError,
    SandboxStateError,
)
from dsec.spec import SandboxState

if TYPE_CHECKING:
    from dsec.backends.gvisor.node import GVisorNode


class GVisorPausing:
    # ----- pause / resume -----

    def wake(self: GVisorNode, sandbox_id: str) -> bool:
        """Thaw a paused sandbox at once (freezer pause); False if it was not paused or the
        pause method needs an async resume."""
        rec = self._sandboxes.get(sandbox_id)
        if rec is None or rec.state is not SandboxState.PAUSED or self.config.pause_method != "freezer":
            return False
        if self.wake_gate is not None:
            self.wake_gate(sandbox_id)  # raises to keep it paused (preempted)
        self.cgroups.thaw(sandbox_id)
        self.records.move(rec, SandboxState.RUNNING)
        self.records.event(rec, "woken")
        self.last_activity[sandbox_id] = time.monotonic()
        return True

    async def pause(self: GVisorNode, sandbox_id: str, *, reclaim: bool = True) -> PauseResult:
        """Freeze the sandbox (``reclaim`` is ignored: its memory is the sentry's, not swapped out)."""
        async with self._locks.setdefault(sandbox_id, asyncio.Lock()):
            return await self._pause(sandbox_id)

    async def _pause(self: GVisorNode, sandbox_id: str) -> PauseResult:
        t0 = time.monotonic()
        rec = self.get(sandbox_id)
        if rec.state is not SandboxState.RUNNING:
            raise SandboxStateError(f"sandbox {sandbox_id} is {rec.state.value}: only a running sandbox can be paused",
                                    sandbox_id=sandbox_id, state=rec.state.value)
        if self.config.pause_method == "runsc":
            await self._require_started().pause(rec.container_id)
        else:
            self.cgroups.freeze(sandbox_id)
            deadline = time.monotonic() + 10
            again = time.monotonic() + 0.05
            while self.cgroups.freezer_state(sandbox_id) != "FROZEN":
                if time.monotonic() > deadline:
                    self.cgroups.thaw(sandbox_id)
                    raise HostError(f"sandbox {sandbox_id} did not freeze within 10 s", sandbox_id=sandbox_id)
                if time.monotonic() > again:
                    # a v1 freezer left in FREEZING (a task was busy in the kernel when asked)
                    # freezes what is left only when asked again
                    self.cgroups.freeze(sandbox_id)
                    again = time.monotonic() + 0.05
                await asyncio.sleep(0.001)
        freeze_s = time.monotonic() - t0
        self.records.move(rec, SandboxState.PAUSED)
        self.records.event(rec, "paused", freeze_s=round(freeze_s, 6), method=self.config.pause_method)
        return PauseResult(sandbox_id, freeze_s, None, time.monotonic() - t0)

    async def resume(self: GVisorNode, sandbox_id: str) -> GVisorRecord:
        if self.config.pause_method == "freezer":
            return self._resume(sandbox_id)  # one write, no await: nothing to interleave with
        async with self._locks.setdefault(sandbox_id, asyncio.Lock()):
            return await self._resume_runsc(sandbox_id)

    def _not_paused(self: GVisorNode, rec: GVisorRecord) -> SandboxStateError:
        return SandboxStateError(f"sandbox {rec.id} is {rec.state.value}: only a paused sandbox can be resumed",
                                 sandbox_id=rec.id, state=rec.state.value)

    def _resume(self: GVisorNode, sandbox_id: str) -> GVisorRecord:
        rec = self.get(sandbox_id)
        if rec.state is not SandboxState.PAUSED:
            raise self._not_paused(rec)
        self.cgroups.thaw(sandbox_id)
        self.records.move(rec, SandboxState.RUNNING)
        self.records.event(rec, "resumed")
        self.last_activity[sandbox_id] = time.monotonic()
        return rec

    async def _resume_runsc(self: GVisorNode, sandbox_id: str) -> GVisorRecord:
        rec = self.get(sandbox_id)
        if rec.state is not SandboxState.PAUSED:
            raise self._not_paused(rec)
        await self._require_started().resume(rec.container_id)
        self.records.move(rec, SandboxState.RUNNING)
        self.records.event(rec, "resumed")
        self.last_activity[sandbox_id] = time.monotonic()
        return rec

    async def pause_many(self: GVisorNode, sandbox_ids: Sequence[str], *, reclaim: bool = True) -> GroupOutcome:
        return await self._group(sandbox_ids, SandboxState.PAUSED, lambda s: self.pause(s, reclaim=reclaim))

    async def resume_many(self: GVisorNode, sandbox_ids: Sequence[str]) -> GroupOutcome:
        return await self._group(sandbox_ids, SandboxState.RUNNING, self.resume)

    async def _group(self: GVisorNode, ids: Sequence[str], target: SandboxState, op: Any) -> GroupOutcome:
        t0 = time.monotonic()
        out = GroupOutcome()

        async def one(sid: str) -> None:
            try:
                if self.get(sid).state is target:
                    out.skipped.append(sid)
                    return
                await op(sid)
                out.done.append(sid)
            except DsecError as exc:
                out.errors[sid] = exc

        await asyncio.gather(*(one(s) for s in dict.fromkeys(ids)))
        out.seconds = time.monotonic() - t0
        return out


__all__ = ["GVisorPausing"]
