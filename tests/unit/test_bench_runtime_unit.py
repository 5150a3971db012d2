"""The pure parts of ``dsec bench runtime``: order rotation, decile math, key naming, memory and
disk fit, and the baseline runner's concurrency (threads only).

No root, no sandboxes: what the bench computes from its samples, not the samples.
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter
from collections.abc import Iterator
from itertools import pairwise
from pathlib import Path

import pytest

from dsec.bench import baselines
from dsec.bench import runtime as rb
from dsec.bench.baselines import decile_rates


def test_parse_order_takes_each_runtime_once() -> None:
    assert rb.parse_order("crun,dsec,bwrap") == ("crun", "dsec", "bwrap")
    assert rb.parse_order(" BWRAP, crun ,dsec ") == ("bwrap", "crun", "dsec")
    for bad in ("dsec,crun", "dsec,crun,crun", "dsec,crun,bwrap,dsec", "dsec,crun,runc", ""):
        with pytest.raises(ValueError):
            rb.parse_order(bad)


def test_rotation_is_fair_over_six_runs() -> None:
    orders = [rb.rotated_order(i) for i in range(6)]
    assert len(set(orders)) == 6  # every permutation once
    for place in range(3):
        assert Counter(o[place] for o in orders) == dict.fromkeys(rb.RUNTIMES, 2)
    # Who comes right before whom: each ordered pair equally often.
    follows = Counter((o[i], o[i + 1]) for o in orders for i in range(2))
    assert set(follows.values()) == {2}
    # Back-to-back runs never start with the same runtime (nor does the wrap-around).
    firsts = [o[0] for o in orders] + [orders[0][0]]
    assert all(a != b for a, b in pairwise(firsts))
    assert rb.rotated_order(6) == rb.rotated_order(0)


def test_run_counter_counts_and_survives_a_bad_file(tmp_path: Path) -> None:
    d = tmp_path / "bench"
    assert rb.next_run_counter(d)[0] == 0
    assert rb.next_run_counter(d)[0] == 1
    (d / "runtime-bench-runs").write_text("garbage\n")
    assert rb.next_run_counter(d)[0] == 0
    blocked = tmp_path / "file"
    blocked.write_text("")
    counter, source = rb.next_run_counter(blocked)  # not a directory: the current minute
    assert source == "current minute" and counter > 0


def test_decile_rates() -> None:
    # 20 sandboxes, one every 0.1 s, then the last two deciles slower.
    done = [0.1 * (i + 1) for i in range(20)]
    first, last = decile_rates(done)
    assert math.isclose(first, 2 / 0.2) and math.isclose(last, 2 / 0.2)
    done[-1] += 0.2  # the last sandbox came 0.2 s late
    first, last = decile_rates(done)
    assert math.isclose(last, 2 / 0.4)
    assert decile_rates(list(reversed(done))) == (first, last)  # any order
    assert decile_rates([0.5]) == (2.0, 2.0)  # one sandbox: both deciles are it
    with pytest.raises(ValueError):
        decile_rates([])


def test_keep_keys_name_the_runtime_and_n() -> None:
    done = [0.01 * (i + 1) for i in range(200)]
    sb = {"0:40": "proc", "0:41": "tmpfs", "0:42": "tmpfs"}
    dsec = rb.keep_keys("dsec", n=200, done_s=done, idle_bytes=200 * rb.MiB, teardown_s=0.5, superblocks=sb)
    crun = rb.keep_keys("crun", n=200, done_s=done, idle_bytes=400 * rb.MiB, teardown_s=2.0, superblocks=sb)
    assert dsec["keep_n"] == 200 and crun["crun_keep_n"] == 200
    assert set(crun) == {f"crun_{k}" for k in dsec}
    assert math.isclose(dsec["create_rate"], 100.0)
    assert math.isclose(dsec["create_rate_last_decile_ratio"], 1.0)
    assert math.isclose(dsec["idle_mib_per_sandbox"], 1.0) and math.isclose(crun["crun_idle_mib_per_sandbox"], 2.0)
    assert dsec["teardown_rate"] == 400.0
    assert dsec["superblocks_per_sandbox"] == 3 and dsec["superblocks_per_sandbox_kinds"] == "proc:1 tmpfs:2"
    assert rb.key("bwrap", "keep_n") == "bwrap_keep_n"
    with pytest.raises(ValueError):
        rb.keep_keys("dsec", n=201, done_s=done, idle_bytes=0, teardown_s=1, superblocks={})
    with pytest.raises(ValueError):
        rb.key("runc", "keep_n")


def test_mountinfo_and_own_superblocks() -> None:
    text = (
        "145692 145543 0:31172 / / rw,nosuid - overlay dsec-root rw,lowerdir=l0\n"
        "145693 145692 0:31241 / /proc rw - proc proc rw\n"
        "145694 145693 0:31241 /sys /proc/sys ro - proc proc rw\n"
        "145699 145692 0:31141 /devskel /dev ro - tmpfs dsec-skel rw,size=64k\n"
        "145700 145699 0:6 /null /dev/null rw - devtmpfs devtmpfs rw\n"
        "145706 145699 0:31157 /sb-1/shm /dev/shm rw shared:5 master:1 - btrfs /dev/loop3 rw\n"
        "garbage line\n"
    )
    devs = rb.mountinfo_devs(text)
    assert devs == {"0:31172": "overlay", "0:31241": "proc", "0:31141": "tmpfs", "0:6": "devtmpfs",
                    "0:31157": "btrfs"}
    host = {"0:6", "0:31157", "8:0"}
    other = {"0:40": "overlay", "0:41": "proc", "0:31141": "tmpfs", "0:6": "devtmpfs"}
    own = rb.own_superblocks(devs, other, host)
    assert own == {"0:31172": "overlay", "0:31241": "proc"}  # the skel tmpfs is shared, not made per sandbox
    assert rb.kinds_summary(own) == "overlay:1 proc:1"


def test_memory_budget_and_fit() -> None:
    # The shrinker map term grows with n: 10,000 sandboxes of 8 superblocks = 80,000 ids.
    small = rb.mib_per_sandbox(100, hwm_ids=0)
    big = rb.mib_per_sandbox(10_000, hwm_ids=0)
    assert math.isclose(big - small, (math.ceil(80_000 / 64) - math.ceil(800 / 64)) / 1024)
    assert rb.mib_per_sandbox(100, hwm_ids=64_000) > small  # a high mark left by an earlier run costs too
    assert rb.mib_per_sandbox(100, hwm_ids=0, extra_mib=50) == small + 50

    def per(n: int) -> float:
        return rb.mib_per_sandbox(n, hwm_ids=0)

    free = 8 << 30
    n = rb.fit_n(100_000, free, per)
    assert n * per(n) * rb.MiB <= free < (n + 1) * per(n + 1) * rb.MiB
    assert rb.fit_n(50, free, per) == 50
    assert rb.fit_n(50, 0, per) == 0
    assert rb.headroom_bytes(8 << 30) == 1 << 30 and rb.headroom_bytes(100 << 30) == 5 << 30


def test_units_to_ids() -> None:
    assert rb.units_to_ids(49.0, 1) == 64 * 49
    assert rb.units_to_ids(48.6, 1) == 64 * 49
    assert rb.units_to_ids(98.0, 2) == 64 * 49  # one unit per node


def test_table_order_does_not_depend_on_run_order() -> None:
    a = {"quick": True, "order": "crun,dsec,bwrap", "crun_keep_n": 1, "keep_n": 1, "bwrap_keep_n": 1,
         "create_rate_vs_crun": 1.0, "written_50mb_n": 1, "cpus": 2}
    assert list(rb.in_table_order(a)) == ["quick", "order", "keep_n", "written_50mb_n", "crun_keep_n",
                                          "bwrap_keep_n", "create_rate_vs_crun", "cpus"]


def test_disk_fit() -> None:
    gib = 1 << 30
    per = rb.WRITE_BYTES + rb.DISK_SLACK_BYTES
    assert rb.disk_headroom_bytes(10 * gib) == 2 * gib and rb.disk_headroom_bytes(80 * gib) == 8 * gib
    # 80 GiB free: 72 GiB usable, 1,000 x 51 MiB = 49.8 GiB fits.
    assert rb.disk_fit_n(1_000, 80 * gib) == 1_000
    k = rb.disk_fit_n(100_000, 80 * gib)
    assert k * per <= 72 * gib < (k + 1) * per
    assert rb.disk_fit_n(50, 2 * gib) == 0  # all of it is headroom
    assert rb.disk_fit_n(50, 0) == 0


def test_disk_free_bytes(tmp_path: Path) -> None:
    assert rb.disk_free_bytes([tmp_path]) > 0
    assert rb.disk_free_bytes([tmp_path, tmp_path]) == rb.disk_free_bytes([tmp_path])
    with pytest.raises(ValueError):
        rb.disk_free_bytes([])


def test_one_concurrency_for_every_runtime() -> None:
    assert rb.KEEP_CONCURRENCY is baselines.KEEP_CONCURRENCY
    assert baselines.KEEP_CONCURRENCY == 8
    with pytest.raises(ValueError):
        baselines.Keeper("crun", Path("/nonexistent"), concurrency=0)


def test_rate_summary_takes_the_last_ready_not_the_last_started() -> None:
    # Four in flight: the sandbox started last (index 3) was ready before index 2.
    created = {"done": [0.1, 0.2, 0.4, 0.3], "ms": [100.0, 100.0, 300.0, 100.0]}
    removed = {"done": [0.05, 0.2, 0.1, 0.15]}
    out = baselines._rate_summary(4, created, removed)
    assert out["create_s"] == 0.4 and math.isclose(out["rate"], 10.0)
    assert out["teardown_s"] == 0.2 and math.isclose(out["teardown_rate"], 20.0)


@pytest.fixture
def runner() -> Iterator[baselines._Runner]:
    r = baselines._Runner(tool="crun", crun_root="/nonexistent")
    yield r
    if r._pool is not None:
        r._pool.shutdown(wait=True)


def test_runner_runs_width_at_a_time_in_index_order(runner: baselines._Runner) -> None:
    lock = threading.Lock()
    started: list[int] = []
    active = 0
    peak = 0

    def work(i: int) -> None:
        nonlocal active, peak
        with lock:
            started.append(i)
            active += 1
            peak = max(peak, active)
        time.sleep(0.01)
        with lock:
            active -= 1

    assert runner._in_parallel(40, 8, work) == []
    assert started == list(range(40))  # claimed in order (each claim under the lock)
    assert peak == 8
    started.clear()
    peak = 0
    assert runner._in_parallel(3, 8, work) == []  # never wider than the work
    assert sorted(started) == [0, 1, 2] and peak <= 3
    assert runner._in_parallel(0, 8, work) == []


def test_runner_stops_starting_after_a_failure(runner: baselines._Runner) -> None:
    started: list[int] = []

    def work(i: int) -> None:
        started.append(i)
        time.sleep(0.01)
        if i == 2:
            raise baselines._CommandFailed("box 2: crun run -d exited 1", "crun: no such file")

    failures = runner._in_parallel(100, 4, work)
    assert [str(f) for f in failures] == ["box 2: crun run -d exited 1"]
    assert len(started) < 20  # those in flight finished, nothing new started
    with pytest.raises(baselines._CommandFailed) as info:
        runner._raise_first(failures)
    assert info.value.detail == "crun: no such file"

    started.clear()
    failures = runner._in_parallel(10, 4, work, best_effort=True)  # cleanup: every one is tried
    assert sorted(started) == list(range(10)) and len(failures) == 1


def test_runner_reports_the_first_failure_and_how_many(runner: baselines._Runner) -> None:
    failures: list[BaseException] = [
        baselines._CommandFailed("box 1: exited 1", "stderr of box 1"),
        TimeoutError("box 5: no ready"),
        TimeoutError("box 6: no ready"),
    ]
    with pytest.raises(baselines._CommandFailed, match=r"box 1: exited 1 \(and 2 more failures\)") as info:
        runner._raise_first(failures)
    assert info.value.detail == "stderr of box 1"
    with pytest.raises(baselines._Terminate):  # the parent went away: that wins
        runner._raise_first([TimeoutError("x"), baselines._Terminate()])
    runner._raise_first([])


def test_runner_abort_starts_nothing_new(runner: baselines._Runner) -> None:
    started: list[int] = []

    def work(i: int) -> None:
        started.append(i)
        if i == 1:
            runner.abort.set()  # as SIGTERM's handler does
        time.sleep(0.01)

    with pytest.raises(baselines._Terminate):
        runner._in_parallel(100, 2, work)
    assert len(started) <= 4
    started.clear()
    assert runner._in_parallel(5, 2, work, best_effort=True) == []  # cleanup ignores the abort
    assert sorted(started) == list(range(5))
