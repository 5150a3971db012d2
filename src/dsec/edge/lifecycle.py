"""Lifecycle enforcement: TTL and idle timeout per sandbox, by the edge alone.

A sandbox's limits come from ``CreateSandbox.lifecycle`` and are stored in its
runtime record's metadata (``edge.expires_at`` as wall-clock time,
``edge.idle_timeout_s``), so they survive an edge restart and need no control
plane: the watchdog here destroys expired sandboxes even when nobody else is
alive. Idle means no exec, session or file call *and* none running: a
command that runs for an hour is activity. Activity stamps are monotonic and
in memory, so after an edge restart every re-adopted sandbox's idle clock
starts again (never an early kill; a TTL is still exact).

Sandboxes that failed (their init died) are destroyed at the next sweep; the
tombstone keeps why. A sandbox idle for its ``auto_pause_s`` is paused (not
destroyed); paused time counts toward its TTL and idle timeout. Never blocks: a sweep is a pass over in-memory records.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

from dsec.edge.loop import BackgroundLoop
from dsec.spec import SandboxState

if TYPE_CHECKING:
    from dsec.backends.container.runtime import SandboxRecord
    from dsec.edge.service import EdgeService

log = logging.getLogger("dsec.edge.lifecycle")


def lifecycle_meta(created_at: float, ttl_s: float, idle_timeout_s: float | None,
                   auto_pause_s: float | None = None) -> dict[str, Any]:
    meta = {"created_at": created_at, "ttl_s": ttl_s, "expires_at": created_at + ttl_s, "idle_timeout_s": idle_timeout_s}
    if auto_pause_s is not None:
        meta["auto_pause_s"] = auto_pause_s
    return meta


class Watchdog(BackgroundLoop):
    task_name = "dsec-edge-watchdog"

    def __init__(self, service: EdgeService) -> None:
        self.service = service
        self.interval = service.config.watchdog_interval_s
        self._expiring: set[str] = set()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.sweep()
            except Exception:  # the watchdog must outlive any one bad sweep
                log.exception("watchdog sweep failed")

    def due(self, rec: SandboxRecord, now: float, mono: float) -> str | None:
        """Why ``rec`` must go now ("ttl", "idle", "failed"), "pause" if it has been idle
        for its auto-pause time, or None."""
        edge = rec.meta.get("edge") or {}
        if edge.get("pool"):
            return None  # ready in a warm pool: its lifetime starts when claimed
        if rec.state is SandboxState.FAILED:
            return "failed"
        if rec.state not in (SandboxState.RUNNING, SandboxState.PAUSED):
            return None  # paused time counts: TTL and idle clocks run on while paused
        expires = edge.get("expires_at")
        if expires is not None and now >= float(expires):
            return "ttl"
        idle = edge.get("idle_timeout_s")
        if idle is not None and not self.service.is_busy(rec.id):
            last = self.service.runtime.last_activity.get(rec.id)
            if last is not None and mono - last >= float(idle):
                return "idle"
        pause_after = edge.get("auto_pause_s")
        if pause_after is not None and rec.state is SandboxState.RUNNING and not self.service.is_busy(rec.id):
            last = self.service.runtime.last_activity.get(rec.id)
            if last is not None and mono - last >= float(pause_after):
                return "pause"
        return None

    async def sweep(self) -> list[tuple[str, str]]:
        now, mono = time.time(), time.monotonic()
        todo = [(rec.id, why) for rec in self.service.runtime.list()
                if rec.id not in self._expiring and (why := self.due(rec, now, mono))]
        if todo:
            await asyncio.gather(*(self._expire(sid, why) for sid, why in todo), return_exceptions=True)
        return todo

    async def _expire(self, sandbox_id: str, why: str) -> None:
        self._expiring.add(sandbox_id)
        try:
            if why == "pause":
                await self.service.auto_pause(sandbox_id)
                return
            await self.service.expire(sandbox_id, why)
        except Exception:
            log.exception("could not destroy expired sandbox %s (%s)", sandbox_id, why)
        finally:
            self._expiring.discard(sandbox_id)
