"""Audit: what sandboxes tried and hit, in their event logs and in metrics, so a trainer
can see which rollouts misbehaved (issue 5, section 4).

Sources, and where each lands:

| what | seen by | event (origin) | metric |
|---|---|---|---|
| packets refused by the network policy | ``runtime.collect_denied()`` every ``audit_interval_s`` | ``net_denied`` (runtime): count, recent destinations | ``dsec_edge_net_denied_total`` |
| OOM kills, pids-limit hits | cgroup counters after each exec and every audit pass | ``oom``, ``pids_limit`` (runtime): count | ``dsec_edge_limit_events_total{kind}`` |
| the writable layer full (blocks or inodes) | ``runtime.disk_room`` after each exec and every audit pass, ENOSPC from the files API | ``disk_full`` (edge) | same, ``kind="disk_full"`` |
| output beyond ``output_cap`` | each exec / session result | ``output_capped`` (edge) | same, ``kind="output_cap"`` |
| policy and stage changes | the runtime when applying them | ``policy_changed``, ``stage_changed`` (runtime) | ``dsec_edge_policy_changes_total``, ``dsec_edge_stage_changes_total`` |

Labels stay bounded (kinds and results, never sandbox ids): per-sandbox detail
lives in the event log. The pass runs on the event loop: two cgroup reads and
one statvfs (60-180 us) per sandbox active lately, every running sandbox once
a minute, yielding every few dozen, plus ``collect_denied`` (off the loop); a
failing pass is logged and the next one runs anyway.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import time
from collections.abc import Callable, Container
from typing import TYPE_CHECKING

from dsec.edge.loop import BackgroundLoop
from dsec.spec import SandboxState

if TYPE_CHECKING:
    from dsec.backends.base import Backend, SandboxRecord
    from dsec.edge.backends import EdgeBackends
    from dsec.edge.events import EventLog
    from dsec.edge.metrics import EdgeMetrics

log = logging.getLogger("dsec.edge.audit")

DISK_REARM_FRACTION = 0.02
"""A full layer is reported again only after at least this share of its quota was freed."""
FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
CHECKS_PER_SLICE = 32
"""Sandboxes checked between two yields to the event loop (60-180 us each: two cgroup reads
and a statvfs; a pass over 1,000 must not stall requests)."""
FULL_PASS_S = 60.0
"""Every pass checks sandboxes active lately; all running ones are checked this often
(a limit hit by a background process of an idle sandbox shows up within this)."""


class Auditor(BackgroundLoop):
    task_name = "dsec-edge-audit"

    def __init__(self, backends: EdgeBackends, events: EventLog, metrics: EdgeMetrics, *, interval: float,
                 is_busy: Callable[[str], bool], pooled: Callable[[], Container[str]],
                 scan_limits: Callable[[SandboxRecord], None]) -> None:
        self.backends = backends
        self.events = events
        self.metrics = metrics
        self.interval = interval
        self.is_busy = is_busy
        self.pooled = pooled
        self.scan_limits = scan_limits
        self._disk_full: set[str] = set()
        self._last_full = 0.0
        self.passes = 0

    def forget(self, sandbox_id: str) -> None:
        self._disk_full.discard(sandbox_id)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.sweep()
            except Exception:  # the audit must outlive any one bad pass
                log.exception("audit pass failed")

    async def sweep(self) -> dict[str, int]:
        """One pass; returns the denied-packet increments per sandbox id."""
        denied = await self.collect_denied()
        pooled = self.pooled()
        now = time.monotonic()
        full = now - self._last_full >= FULL_PASS_S
        if full:
            self._last_full = now
        recent = max(3 * self.interval, 5.0)
        checked = 0
        for backend in list(self.backends.sandbox_backends()):
            for rec in list(backend.sandboxes.values()):
                if rec.state is not SandboxState.RUNNING or rec.id in pooled or rec.id not in backend.sandboxes:
                    continue
                if not full and not self.is_busy(rec.id) and now - backend.last_activity.get(rec.id, 0.0) > recent:
                    continue  # idle: its background processes are seen by the next full pass
                self.check_limits(backend, rec)
                checked += 1
                if checked % CHECKS_PER_SLICE == 0:
                    await asyncio.sleep(0)  # let requests in between slices
        self.passes += 1
        return denied

    async def collect_denied(self) -> dict[str, int]:
        grown: dict[str, int] = {}
        for backend in self.backends.sandbox_backends():
            grown.update(await backend.collect_denied())
        pooled = self.pooled()
        grown = {sid: n for sid, n in grown.items() if n > 0 and sid not in pooled}
        if grown:
            self.metrics.net_denied.inc(sum(grown.values()))
            self.metrics.net_denied_sandboxes.inc(len(grown))
        return grown

    def check_limits(self, backend: Backend, rec: SandboxRecord) -> None:
        """New OOM kills / pids-limit hits (the backend's events) and a full disk (ours)."""
        backend.check_limits(rec)
        self.scan_limits(rec)
        self.check_disk(backend, rec)

    def check_disk(self, backend: Backend, rec: SandboxRecord) -> None:
        # The backend's test, the same one that judges an exec's ``limit`` (disk_full).
        room = backend.disk_room(rec)
        if room is None:
            return  # gone, or not there yet: nothing to say
        if room.full and rec.id not in self._disk_full:
            self.note_disk_full(rec.id, bytes_free=room.bytes_free, inodes_free=room.inodes_free, source="statvfs")
        elif (not room.full and rec.id in self._disk_full
              and room.bytes_free >= DISK_REARM_FRACTION * rec.spec.resources.disk):
            self._disk_full.discard(rec.id)

    def note_disk_full(self, sandbox_id: str, *, source: str, bytes_free: int | None = None,
                       inodes_free: int | None = None) -> None:
        if sandbox_id in self._disk_full:
            return
        self._disk_full.add(sandbox_id)
        rec = self.backends.record(sandbox_id)
        self.events.add(sandbox_id, "disk_full", source=source, bytes_free=bytes_free, inodes_free=inodes_free,
                                disk=rec.spec.resources.disk if rec is not None else None)
        self.metrics.limit_events.labels("disk_full").inc()

    def note_output(self, sandbox_id: str, kind: str, *, stdout_bytes: int, stderr_bytes: int, cap: int) -> None:
        """A command's output went beyond the sandbox's ``output_cap`` (head and tail were kept)."""
        self.events.add(sandbox_id, "output_capped", kind=kind, stdout_bytes=stdout_bytes,
                                stderr_bytes=stderr_bytes, output_cap=cap)
        self.metrics.limit_events.labels("output_cap").inc()
