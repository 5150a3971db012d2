"""Placement: which edge gets a new sandbox. Pure functions, no I/O.

Two steps (docs/CONTROL.md has the measurements behind the choice):

1. Filter: live, not draining, runs the sandbox's backend, labels match the request's ``edge_selector``,
   enough free room in every dimension (sandbox count, cpu, memory, disk).
   "Committed" is the larger of what the edge last reported and what the
   control plane itself has placed there since (so a burst does not overfill
   an edge between two health reports). Edges that already hold every layer
   of the image form the first tier; then edges with a registry (which load
   the layers lazily); the others only when no edge has a registry at all
   (their answer, ``layer_not_found``, then says what is missing).
2. Choose with power-of-k choices: sample k feasible edges at random and take
   the one whose dominant committed fraction after placement is lowest.

The edge still has the final say (its admission may refuse with 429); the
caller then excludes it and asks again, up to ``max_attempts`` edges.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from dsec.spec.api import EdgeHealth

DIGEST_PREFIX = "sha256:"


@dataclass(frozen=True, slots=True)
class Room:
    """A vector of (sandboxes, millicores, memory bytes, disk bytes)."""

    sandboxes: int = 0
    cpu_m: int = 0
    memory: int = 0
    disk: int = 0

    def __add__(self, o: Room) -> Room:
        return Room(self.sandboxes + o.sandboxes, self.cpu_m + o.cpu_m, self.memory + o.memory, self.disk + o.disk)

    def __sub__(self, o: Room) -> Room:
        return Room(self.sandboxes - o.sandboxes, self.cpu_m - o.cpu_m, self.memory - o.memory, self.disk - o.disk)

    def max_with(self, o: Room) -> Room:
        return Room(
            max(self.sandboxes, o.sandboxes), max(self.cpu_m, o.cpu_m),
            max(self.memory, o.memory), max(self.disk, o.disk),
        )

    def items(self) -> tuple[tuple[str, int], ...]:
        return (("sandboxes", self.sandboxes), ("cpu", self.cpu_m), ("memory", self.memory), ("disk", self.disk))


@dataclass(frozen=True, slots=True)
class EdgeView:
    """What placement knows about one edge."""

    id: str
    capacity: Room
    committed: Room
    layers: frozenset[str] = frozenset()
    labels: Mapping[str, str] = field(default_factory=dict)
    draining: bool = False
    alive: bool = True
    backends: frozenset[str] = frozenset({"container"})
    """The execution backends the edge runs (its health report's ``backends``)."""
    fetches: bool = False
    """The edge loads layers it lacks from a registry (its health report's ``registry``)."""

    def free(self) -> Room:
        return self.capacity - self.committed


@dataclass(frozen=True, slots=True)
class Demand:
    need: Room
    layers: tuple[str, ...] = ()
    selector: Mapping[str, str] = field(default_factory=dict)
    backend: str = "container"


def room_of_health(h: EdgeHealth) -> tuple[Room, Room]:
    """(capacity, committed) from an edge's health report."""
    cap = Room(h.capacity_sandboxes, round(h.cpu_capacity * 1000), h.memory_capacity, h.disk_capacity)
    used = Room(h.sandboxes, round(h.cpu_committed * 1000), h.memory_committed, h.disk_committed)
    return cap, used


def normalize_ref(ref: str) -> str:
    """``name`` means ``name:latest`` (as in the layer store); digests stay as they are."""
    if ref.startswith(DIGEST_PREFIX) or ":" in ref:
        return ref
    return f"{ref}:latest"


def layer_set(refs: Iterable[str]) -> frozenset[str]:
    return frozenset(normalize_ref(r) for r in refs)


def has_layers(edge: EdgeView, layers: Sequence[str]) -> bool:
    return all(normalize_ref(r) in edge.layers for r in layers)


def fits(edge: EdgeView, demand: Demand) -> bool:
    if not edge.alive or edge.draining or demand.backend not in edge.backends:
        return False
    if demand.selector and any(edge.labels.get(k) != v for k, v in demand.selector.items()):
        return False
    cap, used, need = edge.capacity, edge.committed, demand.need  # spelled out: this runs per edge per create
    return (
        used.sandboxes + need.sandboxes <= cap.sandboxes
        and used.cpu_m + need.cpu_m <= cap.cpu_m
        and used.memory + need.memory <= cap.memory
        and used.disk + need.disk <= cap.disk
    )


def load_after(edge: EdgeView, demand: Demand) -> float:
    """Dominant committed fraction of the edge once this demand is placed (lower is better)."""
    cap, used, need = edge.capacity, edge.committed, demand.need
    worst = 0.0
    for c, a in (
        (cap.sandboxes, used.sandboxes + need.sandboxes),
        (cap.cpu_m, used.cpu_m + need.cpu_m),
        (cap.memory, used.memory + need.memory),
        (cap.disk, used.disk + need.disk),
    ):
        if c > 0:
            f = a / c
            if f > worst:
                worst = f
        elif a > 0:
            return float("inf")
    return worst


def feasible(edges: Iterable[EdgeView], demand: Demand, *, require_layers: bool = False) -> list[EdgeView]:
    """Edges that can hold the demand: those holding its layers if any fits, else those that
    can fetch them from a registry, else (no registry anywhere) all that fit."""
    fit = [e for e in edges if fits(e, demand)]
    if not demand.layers:
        return fit
    local = [e for e in fit if has_layers(e, demand.layers)]
    if local or require_layers:
        return local
    fetching = [e for e in fit if e.fetches]
    return fetching or fit


def choose_power_of_k(cands: Sequence[EdgeView], demand: Demand, k: int, rng: random.Random) -> EdgeView:
    sample = cands if len(cands) <= k else rng.sample(list(cands), k)
    return min(sample, key=lambda e: (load_after(e, demand), e.id))


def choose_least_loaded(cands: Sequence[EdgeView], demand: Demand, rng: random.Random) -> EdgeView:
    return min(cands, key=lambda e: (load_after(e, demand), e.id))


def choose_best_fit(cands: Sequence[EdgeView], demand: Demand, rng: random.Random) -> EdgeView:
    """The tightest fit: the edge left fullest (classic bin packing)."""
    return max(cands, key=lambda e: (load_after(e, demand), e.id))


def choose_random(cands: Sequence[EdgeView], demand: Demand, rng: random.Random) -> EdgeView:
    return rng.choice(list(cands))


Chooser = Callable[[Sequence[EdgeView], Demand, random.Random], EdgeView]


def power_of(k: int) -> Chooser:
    def choose(cands: Sequence[EdgeView], demand: Demand, rng: random.Random) -> EdgeView:
        return choose_power_of_k(cands, demand, k, rng)

    return choose


STRATEGIES: dict[str, Chooser] = {
    "power-of-2": power_of(2),
    "best-fit": choose_best_fit,
    "random": choose_random,
    "least-loaded": choose_least_loaded,
}


SAMPLE_FIRST_ABOVE = 16
"""With more edges than this, :func:`place` samples edges before it filters them all."""


def sample_edges(
    edges: Sequence[EdgeView], demand: Demand, k: int, rng: random.Random, exclude: frozenset[str], *,
    ok: Callable[[EdgeView, Demand], bool], tries: int,
) -> list[EdgeView] | None:
    """k distinct edges, drawn uniformly at random in at most ``tries`` draws, that are not
    excluded, pass ``ok`` and hold the demand's layers (when it names any); None when the draws
    did not find k of them (the caller then filters every edge). The draws follow a random
    permutation, so the k found are a uniformly random k-subset of the edges that qualify, as
    ``rng.sample([...qualifying...], k)`` would be."""
    n = len(edges)
    seen: set[int] = set()
    found: list[EdgeView] = []
    draw = rng.random
    for _ in range(tries):
        i = int(draw() * n)  # uniform over 0..n-1 (cheaper than randrange)
        if i in seen:
            continue
        seen.add(i)
        e = edges[i]
        if e.id in exclude or not ok(e, demand):
            continue
        if demand.layers and not has_layers(e, demand.layers):
            continue  # the first tier holds the layers; the others are the fallback's business
        found.append(e)
        if len(found) == k:
            return found
    return None


def _sample_feasible(
    edges: Sequence[EdgeView], demand: Demand, k: int, rng: random.Random, exclude: frozenset[str],
) -> list[EdgeView] | None:
    """k distinct edges drawn uniformly from the first tier of :func:`feasible` by testing random
    edges (a few draws when most fit), or None (:func:`sample_edges`)."""
    return sample_edges(edges, demand, k, rng, exclude, ok=fits, tries=3 * k + 8)


def place(
    edges: Iterable[EdgeView], demand: Demand, *, k: int = 2, rng: random.Random | None = None,
    exclude: frozenset[str] = frozenset(), require_layers: bool = False,
) -> EdgeView | None:
    """The edge to try next, or None when nothing (not yet excluded) can hold the demand.

    Power-of-k over :func:`feasible`'s tier. With many edges, k feasible ones are first looked
    for by random draws (cheap when most edges have room: a create looks at ~k edges, not at
    all of them); when the draws come short, every edge is filtered, as before."""
    rng = rng or random.Random()
    if isinstance(edges, Sequence) and len(edges) > SAMPLE_FIRST_ABOVE:
        picked = _sample_feasible(edges, demand, k, rng, exclude)
        if picked is not None:
            return min(picked, key=lambda e: (load_after(e, demand), e.id))
    cands = feasible((e for e in edges if e.id not in exclude), demand, require_layers=require_layers)
    if not cands:
        return None
    return choose_power_of_k(cands, demand, k, rng)


def never_fits(edges: Iterable[EdgeView], demand: Demand) -> EdgeView | None:
    """When no registered edge that could run the demand (its backend, its selector; alive or
    not, draining or not: those may come back) could hold it even empty, the edge that comes
    closest (the smallest largest shortfall ratio): the demand is too big for this cluster and
    waiting does not help. None when some edge is big enough, or none could run it at all
    (other answers cover that)."""
    closest: tuple[float, str, EdgeView] | None = None
    for e in edges:
        if demand.backend not in e.backends or any(e.labels.get(k) != v for k, v in demand.selector.items()):
            continue
        worst = 0.0
        for (_, c), (_, n) in zip(e.capacity.items(), demand.need.items(), strict=True):
            if n > c:
                worst = max(worst, n / c if c > 0 else float("inf"))
        if worst == 0.0:
            return None
        if closest is None or (worst, e.id) < closest[:2]:
            closest = (worst, e.id, e)
    return closest[2] if closest is not None else None


def why_nothing_fits(edges: Sequence[EdgeView], demand: Demand) -> str:
    """A short human reason for a 429 (which filter removed the edges)."""
    if not edges:
        return "no edges registered"
    alive = [e for e in edges if e.alive]
    if not alive:
        return "no live edges"
    open_ = [e for e in alive if not e.draining]
    if not open_:
        return "every live edge is draining"
    open_ = [e for e in open_ if demand.backend in e.backends]
    if not open_:
        return f"no live edge runs the {demand.backend} backend"
    sel = [e for e in open_ if all(e.labels.get(k) == v for k, v in demand.selector.items())]
    if not sel:
        return f"no live edge matches the edge_selector {dict(demand.selector)}"
    short: dict[str, int] = {}
    for e in sel:
        free = e.free()
        for (dim, f), (_, n) in zip(free.items(), demand.need.items(), strict=True):
            if f < n:
                short[dim] = short.get(dim, 0) + 1
    if short:
        parts = ", ".join(f"{dim} on {n}" for dim, n in sorted(short.items()))
        return f"no edge has room (short of {parts} of {len(sel)} edges)"
    return "no edge holds the image layers"
