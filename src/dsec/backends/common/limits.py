"""Which sandbox limit ended a command: evidence read from the kernel, judged after each exec.

Owns the verdict in ``ExecResult.limit`` (issue 10) and the one test of "the writable
layer is full" that the edge's audit uses too. The verdict comes from evidence, never
from a guess at an exit code alone:

| kind | evidence |
|---|---|
| ``timeout``, ``idle_timeout`` | the runtime killed the command for it |
| ``memory`` | the memory cgroup's ``oom_kill`` counter grew while the command ran, and the command died by SIGKILL (or its shell reported a child's: exit 137) |
| ``pids`` | the pids cgroup's ``pids.events`` ``max`` counter grew while it ran, and it failed |
| ``disk_full`` | it failed, the writable layer was full when it ended (:func:`disk_room`), and either it was not full when the command started (as last seen) or the command's output names ENOSPC/EDQUOT |
| ``output_cap`` | its output went beyond ``output_cap`` (head and tail kept) |

The first that holds, in that order, wins. Counters are per sandbox, not per command:
a sibling command (or a background job) that hit the limit while this one ran, and this
one then failing the way such a hit makes commands fail, is reported as this one's hit.
A layer full before the command is only blamed with the command's own word for it: a
test suite that fails on a full disk for its own reasons is not "disk full".

Never raises for a sandbox that vanished (no evidence: no verdict) and never blocks:
two small cgroup reads before and after a command, one statvfs after a failed one.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from typing import Final, Protocol

from dsec.backends.base import DiskRoom
from dsec.spec import Resources
from dsec.spec.results import LimitHit

DISK_FULL_BYTES: Final = 64 * 1024
"""A writable layer with less than this free (or no free inode) is full: a write just failed or will."""
_SIGKILL_STATUS: Final = 128 + signal.SIGKILL
"""What a shell exits with when the child it waited for died by SIGKILL."""
_FULL_TEXTS: Final = (b"No space left on device", b"Disk quota exceeded", b"Quota exceeded")
"""strerror(ENOSPC), strerror(EDQUOT) in glibc's words (also Python's, busybox's), and musl's EDQUOT."""


@dataclass(frozen=True, slots=True)
class Counters:
    """The sandbox's cumulative limit counters at one moment."""

    oom_kills: int
    pids_hits: int


@dataclass(frozen=True, slots=True)
class Baseline:
    """What a command starts from: the counters, and whether the layer was last seen full."""

    counters: Counters | None
    disk_full: bool = False


class CounterSource(Protocol):
    """Where a backend reads a sandbox's limit counters (the container's cgroups)."""

    def limit_counters(self, sandbox_id: str) -> tuple[int, int]:
        """(OOM kills, pids-limit hits) so far."""
        ...


def counters(cg: CounterSource, sandbox_id: str) -> Counters | None:
    """OOM kills and pids-limit hits so far; None if they cannot be read (sandbox gone)."""
    try:
        kills, hits = cg.limit_counters(sandbox_id)
    except (OSError, ValueError, IndexError):
        return None
    return Counters(kills, hits)


def disk_room(init_pid: int) -> DiskRoom | None:
    """The room left in the writable layer, through the sandbox init's handle on it (fd 3).

    The one place that knows how full a sandbox's upper is: a writable-layer medium whose
    statvfs does not show the sandbox's quota must answer here (None: cannot tell)."""
    if init_pid <= 0:
        return None
    try:
        st = os.statvfs(f"/proc/{init_pid}/fd/3")
    except OSError:
        return None  # gone, or not there yet: nothing to say
    free = st.f_bavail * st.f_frsize
    full = free < DISK_FULL_BYTES or (st.f_files > 0 and st.f_favail == 0)
    return DiskRoom(free, int(st.f_favail), full)


def failed(exit_code: int | None, sig: int | None) -> bool:
    return sig is not None or exit_code != 0


def judge(
    res: Resources,
    *,
    exit_code: int | None,
    sig: int | None,
    timed_out: str | None,
    timeout_s: float | None,
    idle_timeout_s: float | None,
    truncated: bool,
    output_cap: int,
    before: Baseline | None,
    after: Counters | None,
    disk: DiskRoom | None,
    output: tuple[bytes, ...] = (),
) -> LimitHit | None:
    """The limit that ended a command, from what was seen before and after it (pure).

    ``after`` and ``disk`` may be None when the command succeeded (they are not read then);
    ``output`` is what it wrote (its stdout and stderr, as kept)."""
    if timed_out == "timeout" and timeout_s is not None:
        return LimitHit.of("timeout", timeout_s)
    if timed_out == "idle_timeout" and idle_timeout_s is not None:
        return LimitHit.of("idle_timeout", idle_timeout_s)
    start = None if before is None else before.counters
    if failed(exit_code, sig) and start is not None and after is not None:
        if after.oom_kills > start.oom_kills and (sig == signal.SIGKILL or exit_code == _SIGKILL_STATUS):
            hit = LimitHit.of("memory", res.memory)
            if res.disk_medium == "memory":
                # Its written files are RAM too: say so, it is the usual surprise.
                hit = LimitHit("memory", hit.value, hit.message + " (written files count against it on the "
                               "memory medium: --disk-medium disk keeps them on disk)")
            return hit
        if after.pids_hits > start.pids_hits:
            return LimitHit.of("pids", res.pids)
    if failed(exit_code, sig) and disk is not None and disk.full and before is not None and (
            not before.disk_full or any(t in out for out in output for t in _FULL_TEXTS)):
        return LimitHit.of("disk_full", res.disk)
    if truncated:
        return LimitHit.of("output_cap", output_cap)
    return None
