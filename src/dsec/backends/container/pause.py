"""Pausing a sandbox: freeze every process, then push its memory out to swap.

Freeze: the sandbox's v1 freezer cgroup goes ``FROZEN`` (the per-command
cgroups below it with it) and we wait until the kernel says so; it reads
``FREEZING`` while a task sits in an uninterruptible sleep.

Reclaim, measured on this machine (zram lz4, 200 MiB of anonymous memory and
a 100 MiB file in the writable layer, which is tmpfs):

==========================================  ========  =========
method                                      returned  time
==========================================  ========  =========
``memory.force_empty``                      99.7 %    0.6-1.1 s
``process_madvise(MADV_PAGEOUT)`` per proc  66 %      0.3 s
both (pageout first, then force_empty)      99.7 %    0.44-0.57 s
==========================================  ========  =========

MADV_PAGEOUT only reaches memory mapped by a process, not the tmpfs pages of
the writable layer nor page cache; force_empty reaches everything charged to
the cgroup but reclaims in small batches. Paging the mapped memory out first
in large ranges and leaving the rest to force_empty is fastest, so that is
the default (``"pageout+force_empty"``).

The cgroup's ``memory.swappiness`` is raised to 100 on the first pause, so
reclaim prefers anonymous and tmpfs pages (what swap is for) over page cache.
That a running sandbox cannot use swap to grow past its memory limit is the
runtime's business: it sets ``memory.memsw.limit_in_bytes`` equal to the
memory limit when it creates the sandbox.

Everything here is synchronous and may take up to a second: the runtime runs
:func:`reclaim` in a worker thread. :func:`freeze` is async (it polls).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, Literal

from dsec.backends.common import cgroupfs
from dsec.errors import HostError

if TYPE_CHECKING:
    from dsec.backends.container.cgroups import RuntimeCgroups

ReclaimMethod = Literal["pageout+force_empty", "force_empty", "pageout", "none"]
RECLAIM_METHODS: Final = ("pageout+force_empty", "force_empty", "pageout", "none")
SYS_process_madvise: Final = 440
MADV_PAGEOUT: Final = 21
IOV_MAX: Final = 1024
FREEZE_TIMEOUT_S: Final = 10.0
RECLAIM_MIN: Final = 2 << 20
"""A sandbox holding less than this is frozen but not reclaimed (measured: force_empty ~11 ms,
pageout ~3 ms of kernel time per sandbox, for ~0.3 MiB won back)."""
FORCE_EMPTY_PASSES: Final = 3
FORCE_EMPTY_MIN_GAIN: Final = 1 << 20

_libc = ctypes.CDLL(None, use_errno=True)


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


@dataclass(frozen=True, slots=True)
class ReclaimStats:
    method: str
    before: int
    """Bytes charged to the sandbox's memory cgroup when it was frozen."""
    after: int
    """... and after reclaim: what the paused sandbox still holds in RAM (kernel memory, unswappable pages)."""
    swapped: int
    """Bytes of the sandbox now in swap (memsw minus memory), if the kernel accounts swap."""
    seconds: float

    @property
    def returned(self) -> int:
        return max(0, self.before - self.after)

    @property
    def returned_frac(self) -> float:
        return self.returned / self.before if self.before else 0.0


def freezer_state(cg: RuntimeCgroups, sandbox_id: str) -> str:
    """THAWED, FREEZING or FROZEN ("" if the cgroup is gone)."""
    try:
        return cgroupfs.read(cg.parents["freezer"] / sandbox_id / "freezer.state").strip()
    except OSError:
        return ""


async def freeze(cg: RuntimeCgroups, sandbox_id: str, *, timeout: float = FREEZE_TIMEOUT_S) -> float:
    """Freeze every process of the sandbox and wait until all are frozen; returns the seconds taken.

    On timeout (a task stuck in an uninterruptible sleep) the sandbox is thawed
    again and HostError raised: a half-frozen sandbox is worse than a running one."""
    t0 = time.perf_counter()
    cg.freeze(sandbox_id, True)
    delay = 0.0002
    while True:
        state = freezer_state(cg, sandbox_id)
        if state == "FROZEN":
            return time.perf_counter() - t0
        if state == "":
            raise HostError(f"sandbox {sandbox_id} has no freezer cgroup (destroyed?)", sandbox_id=sandbox_id)
        if time.perf_counter() - t0 > timeout:
            with contextlib.suppress(OSError):
                cg.freeze(sandbox_id, False)
            raise HostError(
                f"sandbox {sandbox_id} did not freeze within {timeout} s (a process is in an "
                "uninterruptible sleep); it was thawed again",
                sandbox_id=sandbox_id, reason="freeze_timeout",
            )
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.01)


def thaw(cg: RuntimeCgroups, sandbox_id: str) -> None:
    cg.freeze(sandbox_id, False)


def memory_usage(cg: RuntimeCgroups, sandbox_id: str) -> tuple[int, int]:
    """(memory bytes, memory+swap bytes; 0 if swap is not accounted)."""
    d = cg.parents["memory"] / sandbox_id
    mem = int(cgroupfs.read(d / "memory.usage_in_bytes"))
    try:
        memsw = int(cgroupfs.read(d / "memory.memsw.usage_in_bytes"))
    except OSError:
        memsw = 0
    return mem, memsw


def _ranges(pid: int) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    try:
        with open(f"/proc/{pid}/maps", "rb") as f:
            for line in f:
                span, _, rest = line.partition(b" ")
                if b"[vsyscall]" in rest:
                    continue
                a, _, b = span.partition(b"-")
                lo, hi = int(a, 16), int(b, 16)
                out.append((lo, hi - lo))
    except OSError:
        pass
    return out


def pageout_process(pid: int) -> int:
    """MADV_PAGEOUT every mapping of ``pid`` (a host pid); returns bytes advised (0 if it is gone)."""
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        return 0
    total = 0
    try:
        ranges = _ranges(pid)
        i = 0
        while i < len(ranges):
            chunk = ranges[i : i + IOV_MAX]
            arr = (_IoVec * len(chunk))(*[_IoVec(a, n) for a, n in chunk])
            r = _libc.syscall(SYS_process_madvise, pidfd, arr, len(chunk), MADV_PAGEOUT, 0)
            if r >= 0:
                total += r
                i += len(chunk)
                continue
            err = ctypes.get_errno()
            if err in (errno.ESRCH, errno.EPERM, errno.ENOSYS):
                break
            # One mapping refused (locked, PFN-mapped...): advise the rest one by one.
            for a, n in chunk:
                one = (_IoVec * 1)(_IoVec(a, n))
                r = _libc.syscall(SYS_process_madvise, pidfd, one, 1, MADV_PAGEOUT, 0)
                if r > 0:
                    total += r
            i += len(chunk)
    finally:
        os.close(pidfd)
    return total


def reclaim(cg: RuntimeCgroups, sandbox_id: str, method: str = "pageout+force_empty") -> ReclaimStats:
    """Push a (frozen) sandbox's memory out to swap; blocking, run it in a worker thread."""
    if method not in RECLAIM_METHODS:
        raise ValueError(f"reclaim method {method!r}: choose one of {', '.join(RECLAIM_METHODS)}")
    mdir = cg.parents["memory"] / sandbox_id
    t0 = time.perf_counter()
    before, _ = memory_usage(cg, sandbox_id)
    if before < RECLAIM_MIN:
        method = "none"  # an idle shell: reclaim costs ~10 ms of kernel work to win a few hundred KiB
    if method != "none":
        with contextlib.suppress(OSError):
            if cgroupfs.read(mdir / "memory.swappiness").strip() != "100":
                cgroupfs.write(mdir / "memory.swappiness", "100")
    if method in ("pageout", "pageout+force_empty"):
        for pid in cg.pids(sandbox_id):
            pageout_process(pid)
    if method in ("force_empty", "pageout+force_empty"):
        # Reclaim decides whether to deactivate active pages (recently read tmpfs files)
        # from the cgroup's LRU statistics, which the kernel refreshes at most every 2 s;
        # stale ones said "inactive list is big" and force_empty left those pages alone.
        # Reading memory.stat flushes them, so every pass starts from fresh numbers.
        last = memory_usage(cg, sandbox_id)[0]
        for _ in range(FORCE_EMPTY_PASSES):
            with contextlib.suppress(OSError):
                cgroupfs.read(mdir / "memory.stat")
            with contextlib.suppress(OSError):  # EINTR/EBUSY: what was freed stays freed
                cgroupfs.write(mdir / "memory.force_empty", "0")
            now = memory_usage(cg, sandbox_id)[0]
            if last - now < FORCE_EMPTY_MIN_GAIN:
                break
            last = now
    after, memsw = memory_usage(cg, sandbox_id)
    return ReclaimStats(method=method, before=before, after=after, swapped=max(0, memsw - after) if memsw else 0,
                        seconds=time.perf_counter() - t0)


__all__ = [
    "RECLAIM_METHODS",
    "ReclaimMethod",
    "ReclaimStats",
    "freeze",
    "freezer_state",
    "memory_usage",
    "pageout_process",
    "reclaim",
    "thaw",
]
