"""The scheduling policies (dsec.control.sched): priorities and preemption, elastic minimums, the
burst pool, and the edge admission's side of a preemption pause. Pure functions, no I/O."""

from __future__ import annotations

import random
from collections.abc import Hashable, Iterable
from pathlib import Path

import pytest

from dsec.control.iam import Amount
from dsec.control.placement import Demand, EdgeView, Room, place
from dsec.control.sched import (
    Ask,
    BurstNode,
    BurstSizing,
    Placed,
    Policy,
    Pools,
    Preempting,
    Refused,
    SchedConfig,
    Standing,
    Victim,
    ask_for,
    burst_plan,
    decide,
    paused_room,
    pick_victims,
    priority_value,
    reserved,
    split_pools,
    utilisation,
)
from dsec.edge.admission import Admission, Budgets
from dsec.errors import Backpressure
from dsec.spec import Resources

GiB = 1024**3
CAP = Room(100, 100_000, 100 * GiB, 1000 * GiB)
ONE = Room(1, 1000, 10 * GiB, 1 * GiB)
CFG = SchedConfig()


EMPTY = Room()


def edge(eid: str, used: Room = EMPTY, *, burst: bool = False, cap: Room = CAP) -> EdgeView:
    return EdgeView(id=eid, capacity=cap, committed=used, labels={"pool": "burst"} if burst else {})


def victim(key: str, prio: int, *, task: str | None = None, preemption: str = "pause", room: Room = ONE) -> Victim:
    return Victim(key, task, prio, preemption, room)


def victims_of(table: dict[str, list[Victim]]):  # type: ignore[no-untyped-def]
    def on(edge_id: str, below: int | None) -> Iterable[Victim]:
        vs = sorted(table.get(edge_id, []), key=lambda v: v.priority)
        return [v for v in vs if below is None or v.priority < below]
    return on


def full(n: int = 0) -> Room:
    """An edge's committed room with ``n`` slots of memory still free."""
    return Room(90, 10_000, (100 - 10 * n) * GiB, 10 * GiB)


def test_priority_names_and_bounds() -> None:
    assert priority_value("evaluation") == 300 > priority_value("training") == 200 > priority_value("background")
    assert priority_value(None) == 200 and priority_value(7) == 7
    with pytest.raises(ValueError):
        priority_value(1001)
    with pytest.raises(ValueError):
        priority_value("urgent")


def test_a_higher_priority_create_preempts_the_least_urgent_newest_first() -> None:
    e = edge("a", full(0))
    vs = {"a": [victim("old-bg", 100), victim("new-bg", 100), victim("train", 200), victim("eval", 300)]}
    on = victims_of(vs)
    pools = split_pools([e])
    d = decide(Demand(need=ONE), Ask(priority=300), pools, held_back=Amount(), victims_on=on, standings={},
               cfg=CFG, rng=random.Random(1))
    assert isinstance(d, Preempting) and d.edge.id == "a"
    assert [v.key for v in d.victims] == ["old-bg"]  # one is enough; the least urgent goes first
    # equal priority never preempts; lower priority never preempts higher
    d = decide(Demand(need=ONE), Ask(priority=100), pools, held_back=Amount(), victims_on=on, standings={},
               cfg=CFG, rng=random.Random(1))
    assert isinstance(d, Refused)
    # needing two slots of memory takes two victims, both below the ask
    two = Room(1, 1000, 20 * GiB, 1 * GiB)
    d = decide(Demand(need=two), Ask(priority=300), pools, held_back=Amount(), victims_on=on, standings={},
               cfg=CFG, rng=random.Random(1))
    assert isinstance(d, Preempting) and {v.priority for v in d.victims} == {100}


def test_never_and_the_victims_minimum_are_respected() -> None:
    e = edge("a", full(0))
    st: dict[Hashable, Standing] = {"t": Standing(Policy(priority=100, min=Amount(2, 2000, 20 * GiB)), active=Amount(3, 3000, 30 * GiB))}
    on = victims_of({"a": [victim("n1", 100, preemption="never"),
                           victim("t1", 100, task="t"), victim("t2", 100, task="t"), victim("t3", 100, task="t")]})
    # the task holds 3 with a minimum of 2: one of its sandboxes may go, not two
    got = pick_victims(e, ONE, Ask(priority=300), on("a", 300), st, CFG)
    assert got is not None and [v.key for v in got] == ["t1"]
    assert pick_victims(e, Room(1, 1000, 20 * GiB, 1 * GiB), Ask(priority=300), on("a", 300), st, CFG) is None


def test_a_pause_frees_memory_and_cpu_but_not_the_slot() -> None:
    slots_full = edge("a", Room(100, 10_000, 10 * GiB, 10 * GiB))
    on = victims_of({"a": [victim("p", 100), victim("d", 100, preemption="destroy")]})
    got = pick_victims(slots_full, ONE, Ask(priority=300), on("a", 300), {}, CFG)
    assert got is not None and [v.key for v in got] == ["d"]  # only a destroy gives a slot back
    assert victim("p", 1).frees() == Room(0, 1000, 10 * GiB, 0)
    assert victim("d", 1, preemption="destroy").frees() == ONE
    assert paused_room(ONE) == Room(1, 0, 0, 1 * GiB)


def test_elastic_minimums_are_reserved_and_a_create_inside_its_minimum_may_take_elastic_room() -> None:
    # 4 edges of 10 memory slots; 39 slots used, 1 free (on e3)
    edges = [edge(f"e{i}", Room(0, 0, (100 if i < 3 else 90) * GiB, 0)) for i in range(4)]
    pools = split_pools(edges)
    assert utilisation(pools.capacity, pools.committed) == pytest.approx(390 / 400)
    guaranteed = Standing(Policy(priority=200, min=Amount(1, 1000, 10 * GiB)), active=Amount(0, 0, 0))
    elastic = Standing(Policy(priority=200), active=Amount(39, 39_000, 390 * GiB))
    st: dict[Hashable, Standing] = {"g": guaranteed, "e": elastic}
    held = reserved(st.values())
    assert held == Amount(1, 1000, 10 * GiB)
    # the elastic task cannot take the room reserved for g's minimum...
    ask_e = ask_for(elastic, "e", Amount(1, 1000, 10 * GiB), CFG)
    d = decide(Demand(need=ONE), ask_e, pools, held_back=held, victims_on=None, standings=st, cfg=CFG,
               rng=random.Random(1))
    assert isinstance(d, Refused) and d.reserved
    # ...g, inside its minimum, gets it
    ask_g = ask_for(guaranteed, "g", Amount(1, 1000, 10 * GiB), CFG)
    assert ask_g.guaranteed
    d = decide(Demand(need=ONE), ask_g, pools, held_back=held, victims_on=None, standings=st, cfg=CFG,
               rng=random.Random(1))
    assert isinstance(d, Placed)
    # and when there is no free room, g takes e's elastic part whatever the priorities
    packed = split_pools([edge(f"e{i}", Room(0, 0, 100 * GiB, 0)) for i in range(4)])
    on = victims_of({f"e{i}": [victim(f"v{i}", 500, task="e")] for i in range(4)})
    d = decide(Demand(need=ONE), ask_g, packed, held_back=held, victims_on=on, standings=st, cfg=CFG,
               rng=random.Random(1))
    assert isinstance(d, Preempting) and d.victims[0].task == "e"
    # above its minimum, g is an ordinary create again
    full_g = Standing(guaranteed.policy, active=Amount(1, 1000, 10 * GiB))
    assert not ask_for(full_g, "g", Amount(1, 1000, 10 * GiB), CFG).guaranteed


def test_burst_edges_only_above_the_threshold() -> None:
    low = [edge(f"p{i}", Room(0, 0, 50 * GiB, 0)) for i in range(4)] + [edge("b0", burst=True)]
    pools = split_pools(low)
    assert [e.id for e in pools.burst] == ["b0"] and len(pools.primary) == 4
    for seed in range(20):
        d = decide(Demand(need=ONE), Ask(), pools, held_back=Amount(), victims_on=None, standings={},
                   cfg=CFG, rng=random.Random(seed))
        assert isinstance(d, Placed) and not d.burst and d.edge.id.startswith("p")
    high = split_pools([edge(f"p{i}", Room(0, 0, 80 * GiB, 0)) for i in range(4)] + [edge("b0", burst=True)])
    d = decide(Demand(need=ONE), Ask(), high, held_back=Amount(), victims_on=None, standings={}, cfg=CFG,
               rng=random.Random(1))
    assert isinstance(d, Placed) and d.burst and d.edge.id == "b0"
    # a task that may not burst stays on the primary pool
    d = decide(Demand(need=ONE), Ask(burst=False), high, held_back=Amount(), victims_on=None, standings={},
               cfg=CFG, rng=random.Random(1))
    assert isinstance(d, Placed) and not d.burst


def test_burst_plan_asks_for_nodes_above_the_threshold_and_gives_empty_ones_back_below() -> None:
    node = CAP
    busy = Pools([], [], capacity=Room(400, 400_000, 400 * GiB, 0), committed=Room(0, 0, 340 * GiB, 0))
    full_node = BurstNode("b0", True, 90, CAP, Room(90, 0, 95 * GiB, 0))
    plan = burst_plan(busy, [full_node], 0, CFG, BurstSizing(node=node))
    assert plan.provision == 1 and not plan.release
    assert burst_plan(busy, [full_node], 1, CFG, BurstSizing(node=node)).provision == 0  # one is on its way
    assert burst_plan(busy, [full_node], 0, CFG, BurstSizing(node=node, max_nodes=1)).provision == 0
    calm = Pools([], [], capacity=busy.capacity, committed=Room(0, 0, 200 * GiB, 0))
    empty = BurstNode("b1", True, 0, CAP, Room())
    plan = burst_plan(calm, [full_node, empty], 0, CFG, BurstSizing(node=node))
    assert plan.release == ("b1",) and plan.provision == 0  # the busy one drains first
    between = Pools([], [], capacity=busy.capacity, committed=Room(0, 0, 300 * GiB, 0))
    assert burst_plan(between, [empty], 0, CFG, BurstSizing(node=node)) == burst_plan(between, [], 0, CFG)


def test_a_resume_decides_on_its_own_edge() -> None:
    a, b = edge("a", full(1)), edge("b", full(0))
    pools = split_pools([a, b])
    d = decide(Demand(need=ONE), Ask(), pools, held_back=Amount(), victims_on=None, standings={}, cfg=CFG,
               rng=random.Random(1), only=b)
    assert isinstance(d, Refused)
    on = victims_of({"b": [victim("x", 100)]})
    d = decide(Demand(need=ONE), Ask(priority=300), pools, held_back=Amount(), victims_on=on, standings={},
               cfg=CFG, rng=random.Random(1), only=b)
    assert isinstance(d, Preempting) and d.edge.id == "b"
    d = decide(Demand(need=ONE), Ask(), pools, held_back=Amount(), victims_on=None, standings={}, cfg=CFG,
               rng=random.Random(1), only=a)
    assert isinstance(d, Placed) and d.edge.id == "a"


def test_place_samples_first_among_many_edges_and_stays_uniform() -> None:
    edges = [edge(f"e{i:02d}", Room(0, 0, (100 if i % 2 else 0) * GiB, 0)) for i in range(40)]
    seen: dict[str, int] = {}
    rng = random.Random(3)
    for _ in range(4000):
        got = place(edges, Demand(need=ONE), k=1, rng=rng)
        assert got is not None and got.committed.memory == 0  # only edges with room
        seen[got.id] = seen.get(got.id, 0) + 1
    assert len(seen) == 20 and min(seen.values()) > 120  # each of the 20 with room ~200 times
    assert place([edge(f"f{i}", full(0)) for i in range(40)], Demand(need=ONE), rng=rng) is None


def test_admission_suspend_and_unsuspend() -> None:
    adm = Admission(Budgets(sandboxes=3, cpu=2.0, memory=3 * GiB, disk=100 * GiB))
    r = Resources(cpu=1.0, memory=1 * GiB, disk=1 * GiB)
    adm.reserve("a", r)
    adm.reserve("b", r)
    adm.reserve("c", Resources(cpu=0.5, memory=1 * GiB, disk=1 * GiB))
    with pytest.raises(Backpressure):
        adm.check(Resources(cpu=0.5, memory=1 * GiB, disk=1 * GiB))  # count and memory are full
    assert adm.suspend("a") and not adm.suspend("a")
    assert adm.real.sandboxes == 3 and adm.real.memory == 2 * GiB and adm.real.cpu == pytest.approx(1.5)
    adm.release("c")  # a slot for the newcomer; a's memory makes room for it
    big = Resources(cpu=0.5, memory=1 * GiB, disk=1 * GiB)
    assert adm.check(big) is None
    adm.reserve("d", big)
    with pytest.raises(Backpressure) as exc:
        adm.unsuspend("a")  # its memory is taken: it stays suspended
    assert exc.value.fields["reason"] == "preempted" and adm.suspended("a")
    adm.release("d")
    adm.unsuspend("a")
    assert not adm.suspended("a") and adm.real.memory == 2 * GiB and adm.real.cpu == pytest.approx(2.0)
    adm.suspend("b")
    adm.release("b")  # a suspended sandbox deleted: only what it still held goes
    assert (adm.real.sandboxes, adm.real.memory, adm.real.disk) == (1, 1 * GiB, 1 * GiB)
    adm.resync([("a", r, False), ("b", r, False)], suspended=["b"])
    assert adm.suspended("b") and adm.real.memory == 1 * GiB and adm.real.sandboxes == 2


def test_the_edge_keeps_its_preempted_sandboxes_across_restarts(tmp_path: Path) -> None:
    from dsec.edge.preempt import Preempted
    from dsec.errors import SandboxPreempted

    path = tmp_path / "preempted-rt.json"
    book = Preempted(path)
    book.gate("a")  # not preempted: wakes as usual
    book.add("a", at=1.0, by_priority=300, reason="a create in project p")
    book.add("b", at=2.0, by_priority=None, reason="")
    with pytest.raises(SandboxPreempted) as exc:
        book.gate("a")
    assert exc.value.fields == {"sandbox_id": "a", "by_priority": 300}
    again = Preempted(path)  # the edge restarted
    assert "a" in again and "b" in again
    again.keep_only(["a"])  # b is gone
    assert "b" not in Preempted(path) and again.discard("a") and not again.discard("a")
    path.write_text("{not json")
    assert Preempted(path).by_id == {}  # unreadable: nothing held (and a warning)
