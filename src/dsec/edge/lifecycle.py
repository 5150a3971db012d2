"""Lifecycle enforcement: TTL and idle timeout per sandbox, by the edge alone.

A sandbox's limits come from ``CreateSandbox.lifecycle`` and are stored in the
edge's part of its record (``EdgeMeta.expires_at`` as wall-clock time,
``EdgeMeta.idle_timeout_s``), so they survive an edge restart and need no control
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
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from dsec.edge.loop import BackgroundLoop
from dsec.spec import SandboxState

if TYPE_CHECKING:
    from dsec.backends.base import SandboxRecord
    from dsec.edge.backends import EdgeBackends

log = logging.getLogger("dsec.edge.lifecycle")


class Watchdog(BackgroundLoop):
    task_name = "dsec-edge-watchdog"

    def __init__(self, backends: EdgeBackends, *, interval: float, is_busy: Callable[[str], bool],
                 expire: Callable[[str, str], Awaitable[None]], auto_pause: Callable[[str], Awaitable[None]]) -> None:
        self.backends = backends
        self.interval = interval
        self.is_busy = is_busy
        self.expire = expire
        self.auto_pause = auto_pause
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
        edge = rec.edge
        if edge.pool is not None:
            return None  # ready in a warm pool: its lifetime starts when claimed
        if rec.state is SandboxState.FAILED:
            return "failed"
        if rec.state not in (SandboxState.RUNNING, SandboxState.PAUSED):
            return None  # paused time counts: TTL and idle clocks run on while paused
        if edge.expires_at is not None and now >= edge.expires_at:
            return "ttl"
        idle = edge.idle_timeout_s
        if idle is not None and not self.is_busy(rec.id):
            last = self.backends.last_activity(rec.id)
            if last is not None and mono - last >= idle:
                return "idle"
        pause_after = edge.auto_pause_s
        if pause_after is not None and rec.state is SandboxState.RUNNING and not self.is_busy(rec.id):
            last = self.backends.last_activity(rec.id)
            if last is not None and mono - last >= pause_after:
                return "pause"
        return None

    async def sweep(self) -> list[tuple[str, str]]:
        now, mono = time.time(), time.monotonic()
        todo = [(rec.id, why) for rec in self.backends.records()
                if rec.id not in self._expiring and (why := self.due(rec, now, mono))]
        if todo:
            await asyncio.gather(*(self._expire(sid, why) for sid, why in todo), return_exceptions=True)
        return todo

    async def _expire(self, sandbox_id: str, why: str) -> None:
        self._expiring.add(sandbox_id)
        try:
            if why == "pause":
                await self.auto_pause(sandbox_id)
                return
            await self.expire(sandbox_id, why)
        except Exception:
            log.exception("could not destroy expired sandbox %s (%s)", sandbox_id, why)
        finally:
            self._expiring.discard(sandbox_id)
