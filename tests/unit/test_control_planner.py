"""LaunchPlanner: when a create may start on an edge before its reservation commits."""

from __future__ import annotations

import random

from dsec.control.iam import Amount
from dsec.control.placement import Demand, EdgeView, Room
from dsec.control.planner import LaunchPlanner, Seen

GiB = 1 << 30
NEED = Room(1, 1000, GiB, GiB)
DEMAND = Demand(need=NEED, layers=("busybox:latest",))


def edge(eid: str, sandboxes: int = 10) -> tuple[EdgeView, str]:
    v = EdgeView(id=eid, capacity=Room(sandboxes, 64_000, 64 * GiB, 64 * GiB), committed=Room(),
                 layers=frozenset({"busybox:latest"}))
    return v, f"http://{eid}.test"


def planner(max_age_s: float = 60.0) -> LaunchPlanner:
    return LaunchPlanner(k=2, require_layers=False, rng=random.Random(7), max_age_s=max_age_s)


def seen(free: int = 10, *, views: tuple[tuple[EdgeView, str], ...] | None = None, **kw: object) -> Seen:
    return Seen(project_id=1, project_free=Amount(free, free * 1000, free * GiB),
                views=views if views is not None else (edge("e1"), edge("e2")), **kw)  # type: ignore[arg-type]


def test_nothing_seen_means_the_careful_path() -> None:
    p = planner()
    assert p.plan(1, None, False, DEMAND, "k1") is None
    p.seen(seen())
    assert p.plan(2, None, False, DEMAND, "k2") is None  # another project: not seen
    plan = p.plan(1, None, False, DEMAND, "k3")
    assert plan is not None and plan.key == "k3" and plan.url == f"http://{plan.edge.id}.test"


def test_unrecorded_launches_use_up_the_seen_quota() -> None:
    p = planner()
    p.seen(seen(free=2))
    assert p.plan(1, None, False, DEMAND, "a") is not None
    assert p.plan(1, None, False, DEMAND, "b") is not None
    assert p.plan(1, None, False, DEMAND, "c") is None  # a and b are not recorded yet
    p.seen(seen(free=1), key="a")  # a's transaction saw one left after charging itself; b pending
    assert p.plan(1, None, False, DEMAND, "d") is None
    p.done("b")  # b dropped without a reservation
    assert p.plan(1, None, False, DEMAND, "e") is not None


def test_a_refusal_stops_optimism_until_the_next_transaction() -> None:
    p = planner()
    p.seen(seen())
    p.refused(1)
    assert p.plan(1, None, False, DEMAND, "a") is None
    p.seen(seen())
    assert p.plan(1, None, False, DEMAND, "b") is not None


def test_old_views_are_not_trusted() -> None:
    p = planner(max_age_s=0.0)
    p.seen(seen())
    assert p.plan(1, None, False, DEMAND, "a") is None


def test_a_retried_request_id_is_careful() -> None:
    p = planner()
    p.seen(seen())
    assert p.plan(1, None, False, DEMAND, "a", "req-1") is not None
    assert p.plan(1, None, False, DEMAND, "b", "req-1") is None
    assert p.plan(1, None, False, DEMAND, "c", "req-2") is not None


def test_tasks_with_stages_or_unknown_tasks_are_careful() -> None:
    p = planner()
    p.seen(seen())
    assert p.plan(1, "job", False, DEMAND, "a") is None  # never seen: made on first use
    p.seen(seen(task="job", task_free={"sandboxes": 1, "cpu": None, "memory": None}, task_has_stages=True))
    assert p.plan(1, "job", False, DEMAND, "b") is None  # would inherit stages
    assert p.plan(1, "job", True, DEMAND, "c") is not None  # declares its own
    assert p.plan(1, "job", True, DEMAND, "d") is None  # the task's one free sandbox is taken by c


def test_unknown_layers_and_full_edges_are_careful() -> None:
    p = planner()
    p.seen(seen())
    assert p.plan(1, None, False, Demand(need=NEED, layers=("debian:latest",)), "a") is None
    p.seen(seen(views=(edge("e1", sandboxes=1),)))
    assert p.plan(1, None, False, DEMAND, "b") is not None
    assert p.plan(1, None, False, DEMAND, "c") is None  # b's room on e1 is counted


def test_launches_spread_over_edges_by_their_unrecorded_load() -> None:
    p = planner()
    p.seen(seen(free=100))
    got = [p.plan(1, None, False, DEMAND, f"k{i}") for i in range(8)]
    edges = [g.edge.id for g in got if g is not None]
    assert len(edges) == 8 and edges.count("e1") == 4 and edges.count("e2") == 4


def test_what_is_in_flight_is_summed_as_it_changes_and_leaves_nothing_behind() -> None:
    p = planner()
    p.seen(seen(free=1000, views=(edge("e1", 1000), edge("e2", 1000))))
    keys = [f"k{i}" for i in range(100)]
    plans = [p.plan(1, None, False, DEMAND, k) for k in keys]
    assert all(plans)
    assert p._by_project[1] == Amount(100, 100_000, 100 * GiB)
    assert sum(r.sandboxes for r in p._by_edge.values()) == 100
    for i, k in enumerate(keys):  # every way out: recorded, dropped, refused
        if i % 3 == 0:
            p.seen(seen(free=1000, views=(edge("e1", 1000), edge("e2", 1000))), key=k)
        elif i % 3 == 1:
            p.done(k)
        else:
            p.refused(1, k)
    assert (p._pending, p._by_project, p._by_task, p._by_edge) == ({}, {}, {}, {})
