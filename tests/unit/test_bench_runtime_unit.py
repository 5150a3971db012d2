"""The pure parts of ``dsec bench runtime``: order rotation, decile math, key naming, memory fit.

No root, no sandboxes: what the bench computes from its samples, not the samples.
"""

from __future__ import annotations

import math
from collections import Counter
from itertools import pairwise
from pathlib import Path

import pytest

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
