"""The control plane's create counters (control/stats.py): totals, the per-second window, rates,
latency buckets and the last errors, on a clock the test moves."""

from __future__ import annotations

from dsec.control.stats import LATENCY_BUCKETS, RECENT_ERRORS, WINDOW_S, CreateStats


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_totals_series_and_rates() -> None:
    clock = Clock(1000.0)
    st = CreateStats(clock)
    for _ in range(3):
        st.ok(0.004)
    st.failed("quota_exceeded", "over", project="p", status=403, seconds=0.001)
    clock.t = 1001.5
    st.ok(0.02)
    clock.t = 1002.2
    assert (st.ok_total, st.failed_total, dict(st.failed_by_code)) == (4, 1, {"quota_exceeded": 1})
    # whole seconds only: 1000 and 1001, not the current 1002
    assert st.series(3) == [(999, 0, 0), (1000, 3, 1), (1001, 1, 0)]
    ok, bad = st.rate(10)
    assert (ok, bad) == (4 / 2, 1 / 2)  # the replica is 2 s old: not diluted over 10 s
    clock.t = 1100.0
    assert st.rate(10) == (0.0, 0.0)
    assert sum(x[1] for x in st.series()) == 4  # still in the 5-minute window


def test_the_window_forgets_old_seconds() -> None:
    clock = Clock(5000.0)
    st = CreateStats(clock)
    st.ok(0.01)
    clock.t += WINDOW_S  # the same slot, a later second: reused, not added to
    st.ok(0.01)
    clock.t += 1
    series = st.series()
    assert len(series) == WINDOW_S - 1 and sum(x[1] for x in series) == 1 and series[-1][1] == 1
    assert st.ok_total == 2


def test_latency_buckets_and_recent_errors() -> None:
    st = CreateStats(Clock(0.0))
    st.ok(0.0005)
    st.ok(LATENCY_BUCKETS[-1] + 1)
    st.ok(float("nan"))  # not counted in the histogram
    assert st.latency_counts[0] == 1 and st.latency_counts[-1] == 1 and sum(st.latency_counts) == 2
    assert st.recent_latency()["max"] == LATENCY_BUCKETS[-1] + 1
    for i in range(RECENT_ERRORS + 5):
        st.failed("backpressure", f"m{i}" + "x" * 500, project="p", status=429, seconds=0.001)
    assert len(st.recent_errors) == RECENT_ERRORS
    last = st.recent_errors[-1]
    assert last.message.startswith(f"m{RECENT_ERRORS + 4}") and len(last.message) == 300
    assert CreateStats(Clock(0.0)).recent_latency() == {"p50": None, "p99": None, "max": None}
