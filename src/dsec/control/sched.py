"""Scheduling decisions: priorities, preemption, elastic minimums, the burst pool. Pure: no I/O.

The control plane (the reserve transaction of sandboxes.py, preempt.py, burst.py) and the
simulator behind ``dsec bench sched`` (dsec/bench/sched.py) call these same functions, so
what the simulation proves at 160 edges is what a create does. Nothing here awaits, reads
the store or the clock; callers hand in what they know (edge views, task standings, the
victims an edge holds) and get a decision back.

A create asks with an :class:`Ask`: its priority, whether it is inside its task's
guaranteed minimum, whether it may go to the burst pool. :func:`decide` answers:

1. **Burst.** When the primary pool's utilisation (the dominant share of sandboxes, cpu
   and memory committed over capacity, alive and undrained edges) is at or above
   ``burst_threshold`` (80 %), an eligible create goes to the burst pool (edges labelled
   ``pool=burst``) if one of those has room. Below the threshold burst edges get nothing:
   they drain as their sandboxes end (burst.py gives empty ones back to their provider).
2. **Primary**, leaving other tasks' unmet minimums alone: the pool's free room less
   :func:`reserved` (every task's ``min - active``, per dimension) must still hold the
   create — unless the create is itself inside its task's minimum (it is what was reserved).
3. **Preempt.** Nothing fits: on a few candidate edges, find the fewest, least urgent
   sandboxes whose room makes it fit (:func:`pick_victims`): only of strictly lower
   priority (a create inside its minimum may take any task's elastic part), never below
   a task's minimum, never of a task whose policy is ``never``. ``pause`` victims keep
   their slot and disk on the edge (their memory goes to swap, the edge stops counting it);
   ``destroy`` victims free everything.
4. Otherwise refuse (a 429 with the reason).

Priorities are integers; the names map onto them (:data:`PRIORITIES`).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from dsec.control.iam import Amount
from dsec.control.placement import Demand, EdgeView, Room, fits, has_layers, place, sample_edges

PRIORITIES: dict[str, int] = {"background": 100, "training": 200, "evaluation": 300}
"""Named priorities (``priority`` accepts a name or an integer 0..1000)."""
DEFAULT_PRIORITY = PRIORITIES["training"]
PREEMPTION = ("pause", "destroy", "never")
"""What may happen to a task's sandboxes when a more urgent create needs their room."""
POOL_LABEL = "pool"
BURST_POOL = "burst"


def priority_value(p: int | str | None, default: int = DEFAULT_PRIORITY) -> int:
    """A priority as an integer: a name of :data:`PRIORITIES`, an int in 0..1000, or None (default)."""
    if p is None:
        return default
    if isinstance(p, str):
        if p in PRIORITIES:
            return PRIORITIES[p]
        raise ValueError(f"priority {p!r}: one of {', '.join(PRIORITIES)} or an integer 0..1000")
    if isinstance(p, bool) or not 0 <= int(p) <= 1000:
        raise ValueError(f"priority {p!r}: an integer 0..1000 or one of {', '.join(PRIORITIES)}")
    return int(p)


def priority_name(p: int) -> str:
    for name, v in PRIORITIES.items():
        if v == p:
            return name
    return str(p)


@dataclass(frozen=True, slots=True)
class SchedConfig:
    burst_threshold: float = 0.8
    """Primary utilisation at or above which eligible creates go to the burst pool."""
    burst_release_below: float = 0.7
    """Below this, burst nodes that hold nothing are given back to their provider."""
    preemption: bool = True
    victim_edges: int = 8
    """Edges examined for a preemption (a random sample of the candidates)."""
    max_victims: int = 64
    """At most this many sandboxes are preempted for one create."""
    k: int = 2
    require_layers: bool = False
    default_priority: int = DEFAULT_PRIORITY
    default_preemption: str = "pause"
    """Policy of sandboxes created without a task."""
    burst_max_ttl_s: float | None = 4 * 3600.0
    """Only sandboxes whose TTL is at most this go to the burst pool, so a drained burst node
    is empty (and given back) within it; None: any."""


@dataclass(frozen=True, slots=True)
class Policy:
    """A task's scheduling policy."""

    priority: int = DEFAULT_PRIORITY
    preemption: str = "pause"
    min: Amount | None = None
    """Guaranteed (reserved) capacity; None: none. ``max`` is the task's quota."""
    burst: bool = True
    """The task's creates may go to the burst pool above the threshold."""


@dataclass(frozen=True, slots=True)
class Standing:
    """A task's policy and the capacity it holds now (``active``: creating, running or paused by
    its owner — not preempted)."""

    policy: Policy
    active: Amount = field(default_factory=Amount)

    def unmet(self) -> Amount:
        """What is still reserved for the task: ``min - active``, per dimension, never below 0."""
        m = self.policy.min
        if m is None:
            return Amount()
        a = self.active
        return Amount(max(0, m.sandboxes - a.sandboxes), max(0, m.cpu_m - a.cpu_m), max(0, m.memory - a.memory))

    def guaranteed(self, want: Amount) -> bool:
        """``want`` more stays inside the task's minimum (in every dimension)."""
        m = self.policy.min
        if m is None:
            return False
        a = self.active
        return (a.sandboxes + want.sandboxes <= m.sandboxes and a.cpu_m + want.cpu_m <= m.cpu_m
                and a.memory + want.memory <= m.memory)

    def can_give(self, taken: Amount, more: Amount) -> bool:
        """Taking ``more`` (after ``taken``) from the task leaves it at or above its minimum."""
        m = self.policy.min
        if m is None:
            return True
        a = self.active
        return (a.sandboxes - taken.sandboxes - more.sandboxes >= m.sandboxes
                and a.cpu_m - taken.cpu_m - more.cpu_m >= m.cpu_m
                and a.memory - taken.memory - more.memory >= m.memory)


def reserved(standings: Iterable[Standing]) -> Amount:
    """Capacity held back for the tasks' unmet minimums."""
    n = c = m = 0  # plain sums: this runs on every create
    for st in standings:
        mn = st.policy.min
        if mn is None:
            continue
        a = st.active
        if a.sandboxes < mn.sandboxes:
            n += mn.sandboxes - a.sandboxes
        if a.cpu_m < mn.cpu_m:
            c += mn.cpu_m - a.cpu_m
        if a.memory < mn.memory:
            m += mn.memory - a.memory
    return Amount(n, c, m)


@dataclass(frozen=True, slots=True)
class Ask:
    """Who asks for room."""

    priority: int = DEFAULT_PRIORITY
    task: Hashable | None = None
    guaranteed: bool = False
    """Inside its task's minimum: may use reserved room and take any task's elastic part."""
    burst: bool = True


def ask_for(standing: Standing | None, task: Hashable | None, want: Amount, cfg: SchedConfig,
            ttl_s: float | None = None) -> Ask:
    """The ask of a create (or resume) of ``want`` in ``task``. ``ttl_s``: the sandbox's TTL; above
    ``cfg.burst_max_ttl_s`` it may not go to the burst pool (a burst node must empty in bounded time
    to be given back)."""
    short = cfg.burst_max_ttl_s is None or (ttl_s is not None and ttl_s <= cfg.burst_max_ttl_s)
    if standing is None:
        return Ask(priority=cfg.default_priority, task=task, burst=short)
    p = standing.policy
    return Ask(priority=p.priority, task=task, guaranteed=standing.guaranteed(want), burst=p.burst and short)


@dataclass(frozen=True, slots=True)
class Victim:
    """A sandbox that could make room: ``room`` is what it holds on its edge."""

    key: Hashable
    task: Hashable | None
    priority: int
    preemption: str
    room: Room

    def frees(self) -> Room:
        """What preempting it gives back on its edge: a paused sandbox keeps its slot and disk."""
        if self.preemption == "destroy":
            return self.room
        return Room(0, self.room.cpu_m, self.room.memory, 0)


def paused_room(room: Room) -> Room:
    """What a sandbox paused by preemption still holds on its edge (its slot and its disk)."""
    return Room(room.sandboxes, 0, 0, room.disk)


@dataclass(slots=True)
class Pools:
    """The edges split into the primary and the burst pool, with the primary pool's totals
    (alive and undrained edges; the threshold and the reservations are about these)."""

    primary: Sequence[EdgeView]
    burst: Sequence[EdgeView]
    capacity: Room = field(default_factory=Room)
    committed: Room = field(default_factory=Room)


def is_burst(e: EdgeView) -> bool:
    return e.labels.get(POOL_LABEL) == BURST_POOL


def split_pools(views: Iterable[EdgeView]) -> Pools:
    primary: list[EdgeView] = []
    burst: list[EdgeView] = []
    cap = used = Room()
    for v in views:
        if is_burst(v):
            burst.append(v)
            continue
        primary.append(v)
        if v.alive and not v.draining:
            cap = cap + v.capacity
            used = used + v.committed
    return Pools(primary, burst, cap, used)


def utilisation(capacity: Room, committed: Room) -> float:
    """The dominant committed share of sandboxes, cpu and memory (1.0 with no capacity)."""
    worst = 0.0
    for c, u in ((capacity.sandboxes, committed.sandboxes), (capacity.cpu_m, committed.cpu_m),
                 (capacity.memory, committed.memory)):
        if c <= 0:
            return 1.0
        f = u / c
        if f > worst:
            worst = f
    return worst


def burst_active(pools: Pools, cfg: SchedConfig) -> bool:
    return utilisation(pools.capacity, pools.committed) >= cfg.burst_threshold


def room_beyond(pools: Pools, held_back: Amount, need: Room) -> bool:
    """The primary pool's free room, less ``held_back``, still holds ``need``."""
    cap, used = pools.capacity, pools.committed
    return (cap.sandboxes - used.sandboxes - held_back.sandboxes >= need.sandboxes
            and cap.cpu_m - used.cpu_m - held_back.cpu_m >= need.cpu_m
            and cap.memory - used.memory - held_back.memory >= need.memory)


# ------------------------------------------------------------------ decisions ----


@dataclass(frozen=True, slots=True)
class Placed:
    edge: EdgeView
    burst: bool = False


@dataclass(frozen=True, slots=True)
class Preempting:
    edge: EdgeView
    victims: tuple[Victim, ...]
    burst: bool = False


@dataclass(frozen=True, slots=True)
class Refused:
    reason: str
    reserved: bool = False
    """The primary pool had room, but it is reserved for other tasks' minimums."""


Decision = Placed | Preempting | Refused
VictimsOn = Callable[[str, int | None], Iterable[Victim]]
"""``victims_on(edge_id, below)``: the sandboxes of an edge that may be preempted, least urgent
first (priority ascending, newest first within one): with ``below``, only priorities under it."""


def eligible_victim(v: Victim, ask: Ask) -> bool:
    if v.preemption == "never":
        return False
    return ask.guaranteed or v.priority < ask.priority


def pick_victims(
    edge: EdgeView, need: Room, ask: Ask, victims: Iterable[Victim], standings: Mapping[Hashable, Standing],
    cfg: SchedConfig,
) -> tuple[Victim, ...] | None:
    """The fewest sandboxes of ``edge``, taken in the order given, whose room makes ``need`` fit
    there; None if that cannot be done within ``cfg.max_victims``. Never takes a task below its
    minimum, nor a sandbox of equal or higher priority (unless the ask is inside its own
    minimum), nor one whose task says ``never``."""
    cap, used = edge.capacity, edge.committed
    if (need.sandboxes > cap.sandboxes or need.cpu_m > cap.cpu_m or need.memory > cap.memory
            or need.disk > cap.disk):
        return None
    short_n = used.sandboxes + need.sandboxes - cap.sandboxes
    short_c = used.cpu_m + need.cpu_m - cap.cpu_m
    short_m = used.memory + need.memory - cap.memory
    short_d = used.disk + need.disk - cap.disk
    if short_n <= 0 and short_c <= 0 and short_m <= 0 and short_d <= 0:
        return ()
    taken: dict[Hashable, Amount] = {}
    out: list[Victim] = []
    for v in victims:
        if not eligible_victim(v, ask):
            continue
        freed = v.frees()
        if short_n > 0 and freed.sandboxes == 0 and short_c <= 0 and short_m <= 0 and short_d <= 0:
            continue  # only a destroy frees a slot: a pause would not help
        if v.task is not None:
            st = standings.get(v.task)
            if st is not None and st.policy.min is not None:
                more = Amount(1, v.room.cpu_m, v.room.memory)
                before = taken.get(v.task, Amount())
                if not st.can_give(before, more):
                    continue
                taken[v.task] = before + more
        out.append(v)
        short_n -= freed.sandboxes
        short_c -= freed.cpu_m
        short_m -= freed.memory
        short_d -= freed.disk
        if short_n <= 0 and short_c <= 0 and short_m <= 0 and short_d <= 0:
            return tuple(out)
        if len(out) >= cfg.max_victims:
            return None
    return None


def _could_hold(e: EdgeView, demand: Demand) -> bool:
    """The edge could hold the demand were it empty enough (what preemption can make true)."""
    if not e.alive or e.draining or demand.backend not in e.backends:
        return False
    return not demand.selector or all(e.labels.get(k) == v for k, v in demand.selector.items())


def _candidates(edges: Sequence[EdgeView], demand: Demand, n: int, rng: random.Random,
                exclude: frozenset[str], require_layers: bool) -> list[EdgeView]:
    """Up to ``n`` random edges that preemption could make room on (holding the image's
    layers when any does): drawn at random first, every edge filtered when the draws come short."""
    if len(edges) > 2 * n:
        found = sample_edges(edges, demand, n, rng, exclude, ok=_could_hold, tries=2 * n + 8)
        if found is not None:
            return found
    cands = [e for e in edges if e.id not in exclude and _could_hold(e, demand)]
    if demand.layers:
        local = [e for e in cands if has_layers(e, demand.layers)]
        if local or require_layers:
            cands = local
    if len(cands) > n:
        cands = rng.sample(cands, n)
    return cands


def choose_preemption(
    edges: Sequence[EdgeView], demand: Demand, ask: Ask, victims_on: VictimsOn,
    standings: Mapping[Hashable, Standing], cfg: SchedConfig, rng: random.Random,
    exclude: frozenset[str] = frozenset(),
) -> Preempting | None:
    """The edge (of a random sample of ``cfg.victim_edges`` candidates) where the least urgent,
    fewest victims make the demand fit; None if no sampled edge can be freed."""
    cands = _candidates(edges, demand, cfg.victim_edges, rng, exclude, cfg.require_layers)
    if not cands:
        return None
    below = None if ask.guaranteed else ask.priority
    best: tuple[tuple[int, int, int], EdgeView, tuple[Victim, ...]] | None = None
    for e in cands:
        vs = pick_victims(e, demand.need, ask, victims_on(e.id, below), standings, cfg)
        if vs is None or not vs:
            continue
        destroys = sum(1 for v in vs if v.preemption == "destroy")
        score = (max(v.priority for v in vs), len(vs), destroys)
        if best is None or score < best[0]:
            best = (score, e, vs)
    if best is None:
        return None
    return Preempting(best[1], best[2])


def decide(
    demand: Demand, ask: Ask, pools: Pools, *, held_back: Amount, victims_on: VictimsOn | None,
    standings: Mapping[Hashable, Standing], cfg: SchedConfig, rng: random.Random,
    exclude: frozenset[str] = frozenset(), only: EdgeView | None = None,
) -> Decision:
    """Where a create goes (module docstring). ``held_back``: :func:`reserved` of every task
    (the ask's own task included). ``only``: the one edge that may be used (a resume: the
    sandbox cannot move). ``victims_on`` None: never preempt."""
    need = demand.need
    if only is not None:
        return _decide_on(only, demand, ask, pools, held_back, victims_on, standings, cfg)
    if ask.burst and pools.burst and burst_active(pools, cfg):
        e = place(pools.burst, demand, k=cfg.k, rng=rng, exclude=exclude, require_layers=cfg.require_layers)
        if e is not None:
            return Placed(e, burst=True)
    # inside its minimum, a create uses what was reserved for it (held_back counts it)
    held = _held_back_blocks(ask, pools, held_back, need)
    if not held:
        e = place(pools.primary, demand, k=cfg.k, rng=rng, exclude=exclude, require_layers=cfg.require_layers)
        if e is not None:
            return Placed(e)
    if cfg.preemption and victims_on is not None:
        p = choose_preemption(pools.primary, demand, ask, victims_on, standings, cfg, rng, exclude)
        if p is not None and (ask.guaranteed or _beyond_after(pools, held_back, need, p.victims)):
            return p
    return _refusal(held, pools, need, "no edge has room")


def _held_back_blocks(ask: Ask, pools: Pools, held_back: Amount, need: Room) -> bool:
    """The minimums held back for other tasks leave no room for this create (one outside its own)."""
    return (not ask.guaranteed and (held_back.sandboxes or held_back.cpu_m or held_back.memory) > 0
            and not room_beyond(pools, held_back, need))


def _refusal(held: bool, pools: Pools, need: Room, otherwise: str) -> Refused:
    if held and room_beyond(pools, Amount(), need):
        return Refused("the primary pool's free room is reserved for other tasks' minimums (elastic min)",
                       reserved=True)
    return Refused(otherwise)


def _beyond_after(pools: Pools, held_back: Amount, need: Room, victims: Sequence[Victim]) -> bool:
    freed = Room()
    for v in victims:
        freed = freed + v.frees()
    return room_beyond(Pools(pools.primary, pools.burst, pools.capacity, pools.committed - freed), held_back, need)


def _decide_on(
    e: EdgeView, demand: Demand, ask: Ask, pools: Pools, held_back: Amount, victims_on: VictimsOn | None,
    standings: Mapping[Hashable, Standing], cfg: SchedConfig,
) -> Decision:
    burst = is_burst(e)
    held = not burst and _held_back_blocks(ask, pools, held_back, demand.need)
    if not held and fits(e, demand):
        return Placed(e, burst=burst)
    if cfg.preemption and victims_on is not None and _could_hold(e, demand):
        below = None if ask.guaranteed else ask.priority
        vs = pick_victims(e, demand.need, ask, victims_on(e.id, below), standings, cfg)
        if vs and (burst or ask.guaranteed or _beyond_after(pools, held_back, demand.need, vs)):
            return Preempting(e, vs, burst=burst)
    return _refusal(held, pools, demand.need, f"edge {e.id} has no room")


# ---------------------------------------------------------------------- burst ----


@dataclass(frozen=True, slots=True)
class BurstNode:
    """A burst edge as the burst controller sees it."""

    edge_id: str
    alive: bool
    sandboxes: int
    """Sandboxes it holds (what the control plane placed there and has not seen end)."""
    capacity: Room = field(default_factory=Room)
    committed: Room = field(default_factory=Room)
    released: bool = False
    """Given back to its provider already (waiting to disappear)."""


@dataclass(frozen=True, slots=True)
class BurstPlan:
    provision: int = 0
    """Nodes to ask the provider for."""
    release: tuple[str, ...] = ()
    """Empty burst nodes to give back."""


@dataclass(frozen=True, slots=True)
class BurstSizing:
    headroom: float = 0.25
    """While the burst pool is in use, keep this share of it free (at least one node's worth)."""
    max_nodes: int = 64
    """Never more burst nodes than this (the provider's own limits apply too)."""
    node: Room = field(default_factory=Room)
    """The size of one burst node, to size requests before any has joined; empty: learn it from
    the nodes that joined (and ask for one at a time until one has)."""


def _free_nodes(n: BurstNode, node: Room) -> float:
    """A node's free room in nodes' worth (its scarcest dimension)."""
    cap, used = n.capacity, n.committed
    worst = 1.0
    for c, u, size in ((cap.sandboxes, used.sandboxes, node.sandboxes), (cap.cpu_m, used.cpu_m, node.cpu_m),
                       (cap.memory, used.memory, node.memory)):
        if size > 0:
            worst = min(worst, max(0.0, (c - u) / size))
    return worst


def burst_plan(pools: Pools, nodes: Sequence[BurstNode], pending: int, cfg: SchedConfig,
               sizing: BurstSizing = BurstSizing()) -> BurstPlan:
    """What the burst controller does now. At or above the threshold: keep ``sizing.headroom`` of
    the burst pool free (at least one node's worth), asking the provider for the nodes that are
    short. Below ``burst_release_below``: give back the nodes that hold nothing (creates stopped
    going there when the primary pool fell under the threshold, so they drain). In between:
    nothing. ``pending``: nodes asked for that have not joined yet."""
    util = utilisation(pools.capacity, pools.committed)
    live = [n for n in nodes if n.alive and not n.released]
    if util < cfg.burst_release_below:
        return BurstPlan(release=tuple(n.edge_id for n in live if n.sandboxes == 0))
    if util < cfg.burst_threshold:
        return BurstPlan()
    node = sizing.node if sizing.node != Room() else (live[0].capacity if live else Room())
    if node == Room():  # nothing known of a node's size yet: one at a time
        return BurstPlan(provision=0 if pending or live else min(1, sizing.max_nodes))
    free = sum(_free_nodes(n, node) for n in live) + pending
    want = max(1.0, sizing.headroom * (len(live) + pending))
    short = math.ceil(want - free) if want > free else 0
    return BurstPlan(provision=max(0, min(short, sizing.max_nodes - len(live) - pending)))
