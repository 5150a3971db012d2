"""Final admission: the edge refuses a create that would overcommit the node.

Budgets are logical (the sum of what live sandboxes *requested*), not measured
use: a sandbox may grow to its limits at any time, so the node must be able to
hold every limit it accepted (cpu is the exception, overcommitted 8x by
default because agents mostly idle).

Warm-pool sandboxes are *reserved* capacity: they count toward the budgets, so
a pool never makes the node overcommit, but a real create that only fits
without them evicts as many pooled sandboxes as it needs (``check`` answers
with the shortfall to free). A refill only happens when the pooled sandbox
fits beside everything else. So pools take free room and give it back on
demand; they never block a real create.

Usage is tracked incrementally (reserve/claim/release), synchronously, so a
check and its reservation cannot interleave with another create; ``resync``
rebuilds it from the runtime's records (at start and now and then). Nothing
here awaits or does I/O except :func:`resolve_budgets`.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from dsec.edge.config import BYTES_PER_SANDBOX_SLOT, CPU_OVERCOMMIT, MEMORY_FRACTION, EdgeConfig
from dsec.errors import Backpressure, ExceedsCapacity
from dsec.spec import Resources

REASONS = ("count", "cpu", "memory", "disk")
UID_SLOTS = 60000  # the runtime's uid ranges: a hard ceiling on sandboxes per node


@dataclass(frozen=True, slots=True)
class Budgets:
    sandboxes: int
    cpu: float
    memory: int
    disk: int


def host_memory_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    return 0


def resolve_budgets(config: EdgeConfig) -> Budgets:
    """The configured budgets, with the unset ones derived from this machine."""
    cores = os.cpu_count() or 1
    mem = host_memory_bytes()
    memory = config.memory_capacity if config.memory_capacity is not None else int(mem * MEMORY_FRACTION)
    cpu = config.cpu_capacity if config.cpu_capacity is not None else cores * CPU_OVERCOMMIT
    if config.disk_capacity is not None:
        disk = config.disk_capacity
    else:
        usage = shutil.disk_usage(_existing(config.state_dir))
        disk = int(max(0, usage.free - disk_reserve(config)) * config.disk_overcommit)
    count = config.max_sandboxes if config.max_sandboxes is not None else min(
        UID_SLOTS, max(16, mem // BYTES_PER_SANDBOX_SLOT)
    )
    return Budgets(sandboxes=count, cpu=cpu, memory=memory, disk=disk)


def _existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def disk_reserve(config: EdgeConfig) -> int:
    """Bytes of the node's disk a create must leave free (see ``EdgeConfig.disk_reserve``)."""
    if config.disk_reserve is not None:
        return config.disk_reserve
    return max(1 << 30, shutil.disk_usage(_existing(config.state_dir)).total // 20)


def disk_of(res: Resources) -> int:
    """Disk budget a sandbox takes: its quota on the disk medium; none on the memory medium
    (those pages are memory, and its memory limit holds them)."""
    return res.disk if res.disk_medium == "disk" else 0


@dataclass(slots=True)
class Usage:
    sandboxes: int = 0
    cpu: float = 0.0
    memory: int = 0
    disk: int = 0

    def add(self, res: Resources, sign: int = 1) -> None:
        self.sandboxes += sign
        self.cpu += sign * res.cpu
        self.memory += sign * res.memory
        self.disk += sign * disk_of(res)

    def plus(self, other: Usage) -> Usage:
        return Usage(self.sandboxes + other.sandboxes, self.cpu + other.cpu,
                     self.memory + other.memory, self.disk + other.disk)

    @staticmethod
    def of(res: Resources) -> Usage:
        return Usage(1, res.cpu, res.memory, disk_of(res))


_EPS = 1e-9


def over(usage: Usage, budgets: Budgets) -> list[str]:
    """The dimensions in which ``usage`` exceeds ``budgets``, in REASONS order."""
    out = []
    if usage.sandboxes > budgets.sandboxes:
        out.append("count")
    if usage.cpu > budgets.cpu + _EPS:
        out.append("cpu")
    if usage.memory > budgets.memory:
        out.append("memory")
    if usage.disk > budgets.disk:
        out.append("disk")
    return out


class Admission:
    """Committed resources of this edge, split into real sandboxes and pooled ones."""

    def __init__(self, budgets: Budgets, *, retry_after_s: float = 1.0,
                 store_free: Callable[[], int] | None = None, disk_reserve: int = 0, edge_id: str = "") -> None:
        """``store_free`` tells the free bytes of the disk holding writable layers (cheap,
        cached by the caller); below ``disk_reserve`` disk-medium creates are refused.
        ``edge_id`` names this edge in refusals."""
        self.budgets = budgets
        self.edge_id = edge_id
        self.retry_after_s = retry_after_s
        self.store_free = store_free
        self.disk_reserve = disk_reserve
        self._real: dict[str, Resources] = {}
        self._pooled: dict[str, Resources] = {}
        self._suspended: dict[str, Resources] = {}
        """Real sandboxes paused by preemption: they hold their slot and disk, not their cpu and
        memory (pushed to swap) until :meth:`unsuspend` takes those back."""
        self.real = Usage()
        self.pooled = Usage()

    # -- bookkeeping --

    def reserve(self, sandbox_id: str, res: Resources, *, pooled: bool = False) -> None:
        self.release(sandbox_id)
        if pooled:
            self._pooled[sandbox_id] = res
            self.pooled.add(res)
        else:
            self._real[sandbox_id] = res
            self.real.add(res)

    def claim(self, sandbox_id: str) -> None:
        """A pooled sandbox became a real one (same resources)."""
        res = self._pooled.pop(sandbox_id, None)
        if res is not None:
            self.pooled.add(res, -1)
            self._real[sandbox_id] = res
            self.real.add(res)

    def release(self, sandbox_id: str) -> None:
        res = self._real.pop(sandbox_id, None)
        if res is not None:
            self.real.add(res, -1)
            if self._suspended.pop(sandbox_id, None) is not None:  # its cpu and memory were out already
                self.real.cpu += res.cpu
                self.real.memory += res.memory
        res = self._pooled.pop(sandbox_id, None)
        if res is not None:
            self.pooled.add(res, -1)

    def resync(self, live: Iterable[tuple[str, Resources, bool]], suspended: Iterable[str] = ()) -> None:
        """Rebuild from ``(id, resources, pooled)`` of every sandbox that holds resources, and the
        ids of those paused by preemption (:meth:`suspend`)."""
        self._real.clear()
        self._pooled.clear()
        self._suspended.clear()
        self.real = Usage()
        self.pooled = Usage()
        for sid, res, pooled in live:
            self.reserve(sid, res, pooled=pooled)
        for sid in suspended:
            self.suspend(sid)

    def suspend(self, sandbox_id: str) -> bool:
        """A real sandbox paused by preemption (its memory pushed to swap): from now on it holds
        its slot and its disk, and its cpu and memory return to the budgets. False if it is not
        held here or is suspended already."""
        res = self._real.get(sandbox_id)
        if res is None or sandbox_id in self._suspended:
            return False
        self._suspended[sandbox_id] = res
        self.real.cpu -= res.cpu
        self.real.memory -= res.memory
        return True

    def unsuspend(self, sandbox_id: str) -> None:
        """Take a suspended sandbox's cpu and memory back (it is resumed). Backpressure (reason
        ``preempted``) when they do not fit beside everything else now (warm-pool members
        included: a resume never evicts them); nothing changes then."""
        res = self._suspended.get(sandbox_id)
        if res is None:
            return
        want = Usage(0, res.cpu, res.memory, 0)
        full = over(self.real.plus(self.pooled).plus(want), self.budgets)
        if full:
            raise Backpressure(
                f"sandbox {sandbox_id} was paused to make room for more urgent work and this edge has no "
                f"room to resume it yet ({full[0]}: {self._describe(full[0])})",
                retry_after=self.retry_after_s, reason="preempted", reasons=full, sandbox_id=sandbox_id,
                **self._figures(),
            )
        del self._suspended[sandbox_id]
        self.real.cpu += res.cpu
        self.real.memory += res.memory

    def suspended(self, sandbox_id: str) -> bool:
        return sandbox_id in self._suspended

    def holds(self, sandbox_id: str) -> bool:
        return sandbox_id in self._real or sandbox_id in self._pooled

    # -- decisions --

    def check(self, res: Resources) -> Usage | None:
        """Admit one sandbox of ``res``: None if it fits as things are, else the shortfall
        that evicting pooled sandboxes must free. Raises when it cannot fit at all:
        ExceedsCapacity if it exceeds the node's whole budget (never fits here: a larger edge
        may take it), Backpressure if real sandboxes hold the room (retry later or elsewhere)."""
        self._check_store(res)
        b, r, pl = self.budgets, self.real, self.pooled
        if (r.sandboxes + pl.sandboxes + 1 <= b.sandboxes and r.cpu + pl.cpu + res.cpu <= b.cpu + _EPS
                and r.memory + pl.memory + res.memory <= b.memory  # the common case, spelled out
                and r.disk + pl.disk + disk_of(res) <= b.disk):
            return None
        want = Usage.of(res)
        if over(want, self.budgets):
            raise self._too_big(want)
        if not over(self.real.plus(self.pooled).plus(want), self.budgets):
            return None
        full = over(self.real.plus(want), self.budgets)
        if full:
            raise Backpressure(
                f"edge is full ({full[0]}): {self._describe(full[0])}",
                retry_after=self.retry_after_s, reason=full[0], reasons=full, **self._figures(),
            )
        total = self.real.plus(self.pooled).plus(want)
        b = self.budgets
        return Usage(
            max(0, total.sandboxes - b.sandboxes), max(0.0, total.cpu - b.cpu),
            max(0, total.memory - b.memory), max(0, total.disk - b.disk),
        )

    def _too_big(self, want: Usage, what: str = "the sandbox") -> ExceedsCapacity:
        """More than this edge's whole budget: it never fits here (a larger edge may take it)."""
        b = self.budgets
        return ExceedsCapacity.of(
            {"cpu": want.cpu, "memory": want.memory, "disk": want.disk, "sandboxes": want.sandboxes},
            {"cpu": b.cpu, "memory": b.memory, "disk": b.disk, "sandboxes": b.sandboxes},
            edge_id=self.edge_id, cluster=False, what=what, **self._figures())

    def _check_store(self, res: Resources) -> None:
        """The disk itself, whatever was committed: layers, snapshots and other writers share it."""
        if self.store_free is None or disk_of(res) == 0:
            return
        free = self.store_free()
        if free < self.disk_reserve:
            raise Backpressure(
                f"edge is full (disk): the writable-layer store has {free >> 20} MiB free, below its reserve "
                f"of {self.disk_reserve >> 20} MiB (free disk, or lower EdgeConfig.disk_reserve)",
                retry_after=self.retry_after_s, reason="disk", reasons=["disk"], store_free=free,
                store_reserve=self.disk_reserve, **self._figures(),
            )

    def check_room(self, res: Resources, n: int) -> None:
        """Refuse at once if ``n`` sandboxes of ``res`` cannot all fit, even after evicting
        pooled ones (a fork checks this before it freezes and packs anything)."""
        want = Usage(n, n * res.cpu, n * res.memory, n * disk_of(res))
        self._check_store(res)
        if over(want, self.budgets):
            raise self._too_big(want, what=f"a fork into {n} sandboxes")
        full = over(self.real.plus(want), self.budgets)
        if full:
            raise Backpressure(
                f"edge has no room for {n} more sandboxes ({full[0]}): {self._describe(full[0])}",
                retry_after=self.retry_after_s, reason=full[0], reasons=full, **self._figures(),
            )

    def fits_pooled(self, res: Resources) -> bool:
        """Can one more pooled sandbox of ``res`` be made without overcommitting?"""
        return not over(self.real.plus(self.pooled).plus(Usage.of(res)), self.budgets)

    def _describe(self, reason: str) -> str:
        b, u = self.budgets, self.real
        return {
            "count": f"{u.sandboxes} of {b.sandboxes} sandboxes",
            "cpu": f"{u.cpu:g} of {b.cpu:g} cpu committed",
            "memory": f"{u.memory} of {b.memory} B memory committed",
            "disk": f"{u.disk} of {b.disk} B disk committed",
        }[reason]

    def _figures(self) -> dict[str, float | int]:
        b, u = self.budgets, self.real
        return {
            "sandboxes": u.sandboxes, "capacity_sandboxes": b.sandboxes,
            "cpu_committed": round(u.cpu, 6), "cpu_capacity": b.cpu,
            "memory_committed": u.memory, "memory_capacity": b.memory,
            "disk_committed": u.disk, "disk_capacity": b.disk,
        }
