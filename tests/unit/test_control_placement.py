"""Placement: the filter, power-of-k choices, and the simulation behind the choice (docs/CONTROL.md)."""

from __future__ import annotations

import random

import pytest

from dsec.control.placement import (
    Demand,
    EdgeView,
    Room,
    choose_best_fit,
    choose_power_of_k,
    feasible,
    fits,
    layer_set,
    load_after,
    never_fits,
    normalize_ref,
    place,
    room_of_health,
    why_nothing_fits,
)
from dsec.control.placement_sim import compare, simulate
from dsec.spec.api import EdgeHealth

GiB = 1024**3
CAP = Room(100, 64_000, 64 * GiB, 100 * GiB)
ONE = Demand(need=Room(1, 1000, 1 * GiB, 1 * GiB))


EMPTY = Room()


def edge(eid: str, used: Room = EMPTY, **kw: object) -> EdgeView:
    return EdgeView(id=eid, capacity=kw.pop("capacity", CAP), committed=used, **kw)  # type: ignore[arg-type]


def test_fits_checks_every_dimension_and_state() -> None:
    assert fits(edge("a"), ONE)
    assert not fits(edge("a", Room(100, 0, 0, 0)), ONE)  # count
    assert not fits(edge("a", Room(0, 63_500, 0, 0)), ONE)  # cpu
    assert not fits(edge("a", Room(0, 0, 63 * GiB + 1, 0)), ONE)  # memory
    assert not fits(edge("a", Room(0, 0, 0, 100 * GiB)), ONE)  # disk
    assert fits(edge("a", Room(99, 63_000, 63 * GiB, 99 * GiB)), ONE)  # exactly full after
    assert not fits(edge("a", draining=True), ONE)
    assert not fits(edge("a", alive=False), ONE)


def test_selector_and_layer_tiers() -> None:
    gpu = edge("g", labels={"zone": "a", "gpu": "1"}, layers=layer_set(["py:3.12"]))
    plain = edge("p", labels={"zone": "a"})
    d = Demand(need=ONE.need, selector={"gpu": "1"})
    assert [e.id for e in feasible([gpu, plain], d)] == ["g"]
    # edges holding the layers form the first tier; others only when none of those fits
    d = Demand(need=ONE.need, layers=("py:3.12",))
    assert [e.id for e in feasible([gpu, plain], d)] == ["g"]
    full_gpu = edge("g", Room(100, 0, 0, 0), layers=layer_set(["py:3.12"]))
    assert [e.id for e in feasible([full_gpu, plain], d)] == ["p"]
    assert feasible([full_gpu, plain], d, require_layers=True) == []


def test_edges_with_a_registry_come_before_edges_that_cannot_fetch() -> None:
    d = Demand(need=ONE.need, layers=("py:3.12",))
    holder = edge("h", Room(100, 0, 0, 0), layers=layer_set(["py:3.12"]))  # full
    fetcher = edge("f", fetches=True)
    plain = edge("p")
    # nobody fitting holds the layers: the edge with a registry, not the one that would 404
    assert feasible([holder, fetcher, plain], d) == [fetcher]
    # a holder that fits still wins over fetching
    assert feasible([edge("h2", layers=layer_set(["py:3.12"])), fetcher], d)[0].id == "h2"
    # no registry anywhere: as before, any edge that fits (its answer says what is missing)
    assert feasible([holder, plain], d) == [plain]
    # the health report's registry sets it
    h = EdgeHealth(edge_id="x", url="http://x", sandboxes=0, capacity_sandboxes=1, cpu_committed=0,
                   cpu_capacity=1, memory_committed=0, memory_capacity=1, disk_committed=0, disk_capacity=1,
                   registry="http://reg:5000")
    assert h.registry == "http://reg:5000"


def test_layer_refs_normalize_like_the_store() -> None:
    assert normalize_ref("busybox") == "busybox:latest"
    assert normalize_ref("busybox:test") == "busybox:test"
    digest = "sha256:" + "a" * 64
    assert normalize_ref(digest) == digest
    e = edge("a", layers=layer_set(["busybox", digest]))
    assert feasible([e], Demand(need=ONE.need, layers=("busybox:latest", digest))) == [e]


def test_load_after_is_the_dominant_fraction() -> None:
    e = edge("a", Room(10, 32_000, 8 * GiB, 0))
    assert load_after(e, ONE) == pytest.approx(33_000 / 64_000)
    assert load_after(edge("z", capacity=Room(10, 0, GiB, GiB)), ONE) == float("inf")


def test_power_of_k_takes_the_least_loaded_of_its_sample() -> None:
    light = edge("light", Room(1, 1000, GiB, GiB))
    heavy = edge("heavy", Room(50, 50_000, 50 * GiB, 50 * GiB))
    rng = random.Random(0)
    # with k >= candidates it is exactly least-loaded
    assert choose_power_of_k([heavy, light], ONE, 2, rng).id == "light"
    assert choose_best_fit([heavy, light], ONE, rng).id == "heavy"
    # with k=1 it is random: both are chosen sometimes
    seen = {choose_power_of_k([heavy, light], ONE, 1, rng).id for _ in range(50)}
    assert seen == {"light", "heavy"}
    # k=2 among many never picks the globally heaviest when a lighter one was sampled with it
    many = [edge(f"e{i}", Room(i, i * 1000, i * GiB // 2, 0)) for i in range(20)]
    picks = [choose_power_of_k(many, ONE, 2, rng).id for _ in range(500)]
    assert "e19" not in picks
    assert picks.count("e0") > picks.count("e10")


def test_place_excludes_refusing_edges_and_reports_why() -> None:
    a, b = edge("a"), edge("b", Room(5, 5000, 5 * GiB, 0))
    assert place([a, b], ONE, exclude=frozenset({"a"})).id == "b"  # type: ignore[union-attr]
    assert place([a, b], ONE, exclude=frozenset({"a", "b"})) is None
    assert why_nothing_fits([], ONE) == "no edges registered"
    assert why_nothing_fits([edge("a", alive=False)], ONE) == "no live edges"
    assert why_nothing_fits([edge("a", draining=True)], ONE) == "every live edge is draining"
    assert "memory on 1" in why_nothing_fits([edge("a", Room(0, 0, 64 * GiB, 0))], ONE)
    assert "edge_selector" in why_nothing_fits([a], Demand(need=ONE.need, selector={"x": "y"}))


def test_never_fits_tells_too_big_from_full() -> None:
    big = Demand(need=Room(1, 99_000, 1 * GiB, 1 * GiB))  # 99 cores; the edges have 64
    full = edge("a", Room(100, 64_000, 64 * GiB, 100 * GiB))
    assert never_fits([full], ONE) is None  # full now: a wait, not a never
    assert never_fits([full, edge("b")], big).id == "a"  # type: ignore[union-attr]
    # the closest edge is named: b is short of cpu by less than a
    small = edge("s", capacity=Room(100, 8_000, 64 * GiB, 100 * GiB))
    assert never_fits([small, edge("b", capacity=Room(100, 96_000, 64 * GiB, 100 * GiB))], big).id == "b"  # type: ignore[union-attr]
    # one edge with the cpu and another with the memory: neither holds it alone
    odd = Demand(need=Room(1, 32_000, 100 * GiB, 0))
    many = edge("m", capacity=Room(100, 64_000, 256 * GiB, 100 * GiB), labels={"zone": "x"})
    assert never_fits([edge("c", capacity=Room(10, 64_000, 1 * GiB, 0)),
                       edge("d", capacity=Room(10, 1_000, 200 * GiB, 0))], odd) is not None
    # an edge that could hold it counts even when dead or draining (it may come back)
    assert never_fits([edge("a"), edge("m2", capacity=many.capacity, alive=False)], odd) is None
    assert never_fits([edge("a"), edge("m3", capacity=many.capacity, draining=True)], odd) is None
    # only edges that could run it count: its selector and its backend
    assert never_fits([edge("a"), many], odd) is None
    assert never_fits([edge("y", labels={"zone": "y"}), many],
                      Demand(need=odd.need, selector={"zone": "y"})).id == "y"  # type: ignore[union-attr]
    assert never_fits([many], Demand(need=odd.need, backend="gvisor")) is None  # no edge runs it: another answer
    assert never_fits([], big) is None


def test_room_of_health() -> None:
    h = EdgeHealth(edge_id="e1", url="http://x", sandboxes=3, capacity_sandboxes=10, cpu_committed=1.5,
                   cpu_capacity=16, memory_committed=GiB, memory_capacity=8 * GiB, disk_committed=0,
                   disk_capacity=GiB)
    cap, used = room_of_health(h)
    assert cap == Room(10, 16_000, 8 * GiB, GiB) and used == Room(3, 1500, GiB, 0)


# ------------------------------------------------------------- simulation ----


def test_simulation_is_deterministic() -> None:
    a = simulate("power-of-2", edges=8, arrivals=800, seed=3)
    b = simulate("power-of-2", edges=8, arrivals=800, seed=3)
    assert (a.imbalance, a.rejected, a.refusals) == (b.imbalance, b.rejected, b.refusals)


def test_power_of_two_balances_better_than_random_and_best_fit_and_survives_stale_views() -> None:
    """The measured reason for the default (docs/CONTROL.md has the full table)."""
    res = {(r.strategy, r.staleness): r for r in compare(edges=16, arrivals=3000, staleness=(0, 50), seed=1)}
    p2, rnd, bf, ll = (res[(s, 0)] for s in ("power-of-2", "random", "best-fit", "least-loaded"))
    # fresh views: spreads load far better than random and best fit; least-loaded is the ideal
    assert p2.imbalance < rnd.imbalance and p2.cv < rnd.cv
    assert p2.cv < bf.cv
    assert ll.imbalance <= p2.imbalance
    # stale views (a burst through several replicas): best fit herds onto the same edge and
    # least-loaded onto the same few; power-of-2 barely notices
    p2s, bfs, lls = (res[(s, 50)] for s in ("power-of-2", "best-fit", "least-loaded"))
    assert p2s.refusals * 10 < bfs.refusals
    assert p2s.refusals * 5 < lls.refusals
    assert p2s.rejected <= bfs.rejected
    assert p2s.imbalance < lls.imbalance
    assert p2.probes_per_decision <= 2 < ll.probes_per_decision
