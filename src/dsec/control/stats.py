"""This replica's own counters of creates: outcomes, error codes, latency, a per-second window.

The dashboard's live figures (``GET /v1/admin/overview``, docs/DASHBOARD.md) and the
control plane's ``/metrics`` read them; ``Sandboxes.create`` feeds them (each item of a
batch is a create). Pure bookkeeping on the event loop: no I/O, no locks, O(1) per
create. Counters are per replica: with several replicas, each shows its own share
(Prometheus sums them).
"""

from __future__ import annotations

import bisect
import math
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass

WINDOW_S = 300
"""Seconds of per-second history kept (the dashboard's sparkline)."""
LATENCY_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
"""Upper bounds (seconds) of the create-latency histogram (``dsec_control_create_seconds``)."""
RECENT_ERRORS = 20
RECENT_LATENCIES = 1000


@dataclass(frozen=True)
class CreateError:
    """One refused or failed create, as the dashboard lists it."""

    at: float
    """Wall-clock time (seconds since the epoch)."""
    code: str
    message: str
    project: str
    status: int


class CreateStats:
    """Create outcomes since this replica started, and per second over the last :data:`WINDOW_S`."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self.ok_total = 0
        self.failed_total = 0
        self.failed_by_code: Counter[str] = Counter()
        self.latency_counts = [0] * (len(LATENCY_BUCKETS) + 1)
        """Per bucket (not cumulative); the last one is +Inf."""
        self.latency_sum = 0.0
        self._recent_latency: deque[float] = deque(maxlen=RECENT_LATENCIES)
        self.recent_errors: deque[CreateError] = deque(maxlen=RECENT_ERRORS)
        self._sec = [-1] * WINDOW_S  # which second each slot holds
        self._ok = [0] * WINDOW_S
        self._failed = [0] * WINDOW_S
        self.started_at = clock()

    def _slot(self, now: float) -> int:
        sec = int(now)
        i = sec % WINDOW_S
        if self._sec[i] != sec:
            self._sec[i] = sec
            self._ok[i] = 0
            self._failed[i] = 0
        return i

    def _latency(self, seconds: float) -> None:
        if not math.isfinite(seconds) or seconds < 0:
            return
        self.latency_counts[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
        self.latency_sum += seconds
        self._recent_latency.append(seconds)

    def ok(self, seconds: float) -> None:
        self.ok_total += 1
        self._ok[self._slot(self._clock())] += 1
        self._latency(seconds)

    def failed(self, code: str, message: str, *, project: str, status: int, seconds: float) -> None:
        now = self._clock()
        self.failed_total += 1
        self.failed_by_code[code] += 1
        self._failed[self._slot(now)] += 1
        self.recent_errors.append(CreateError(at=now, code=code, message=message[:300], project=project, status=status))
        self._latency(seconds)

    def series(self, seconds: int = WINDOW_S) -> list[tuple[int, int, int]]:
        """``(second, ok, failed)`` for each of the last ``seconds`` whole seconds, oldest first
        (the current, incomplete second is left out)."""
        seconds = max(1, min(seconds, WINDOW_S - 1))
        now = int(self._clock())
        out = []
        for sec in range(now - seconds, now):
            i = sec % WINDOW_S
            held = self._sec[i] == sec
            out.append((sec, self._ok[i] if held else 0, self._failed[i] if held else 0))
        return out

    def rate(self, seconds: int = 10) -> tuple[float, float]:
        """Creates and failures per second over the last ``seconds`` whole seconds (fewer while
        the replica is younger than that)."""
        series = self.series(seconds)
        span = min(len(series), max(1, int(self._clock() - self.started_at)))
        tail = series[-span:]
        return sum(s[1] for s in tail) / span, sum(s[2] for s in tail) / span

    def recent_latency(self) -> dict[str, float | None]:
        """p50 / p99 / max of the last :data:`RECENT_LATENCIES` creates (seconds)."""
        xs = sorted(self._recent_latency)
        if not xs:
            return {"p50": None, "p99": None, "max": None}

        def q(p: float) -> float:
            return xs[min(len(xs) - 1, int(p * len(xs)))]

        return {"p50": q(0.5), "p99": q(0.99), "max": xs[-1]}
