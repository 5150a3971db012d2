"""A small discrete-event simulation of placement strategies (figures in docs/CONTROL.md).

Edges of three sizes; sandboxes arrive as a Poisson stream with a mix of
sizes and log-normal lifetimes (median 17 min, p99 ~4.5 h, as in the DSec
paper); each placement uses the real functions of placement.py on a view of
the edges that is either exact or refreshed only every ``staleness``
decisions (several API replicas, or heartbeats lagging behind a burst). The
edge admits against the truth: a choice made on a stale view may be refused,
and the create then tries the next candidate (up to ``max_attempts`` edges),
as the control plane does.

    python -m dsec.control.placement_sim [--edges 100 --arrivals 60000 --json]

Reported per strategy: imbalance (mean over samples of the spread, max minus
mean, of the edges' dominant utilisation), its coefficient of variation,
the hottest edge seen, rejected creates and refusals, and edges probed per
decision.
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import json
import math
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

from dsec.control.placement import STRATEGIES, Demand, EdgeView, Room, feasible, fits

GiB = 1024**3

EDGE_SIZES = (  # (weight, sandboxes, millicores, memory, disk): small, medium, large nodes
    (0.5, 1000, 128_000, 128 * GiB, 1024 * GiB),
    (0.3, 2000, 256_000, 256 * GiB, 2048 * GiB),
    (0.2, 4000, 512_000, 512 * GiB, 4096 * GiB),
)
DEMANDS = (  # (weight, millicores, memory, disk)
    (0.70, 1000, 1 * GiB, 2 * GiB),
    (0.20, 2000, 4 * GiB, 8 * GiB),
    (0.08, 4000, 8 * GiB, 16 * GiB),
    (0.02, 8000, 32 * GiB, 32 * GiB),
)
LIFETIME_MEDIAN_S = 17 * 60.0
LIFETIME_SIGMA = 1.2


@dataclass(frozen=True)
class SimResult:
    strategy: str
    staleness: int
    placed: int
    rejected: int
    refusals: int
    imbalance: float
    cv: float
    hottest: float
    probes_per_decision: float
    seconds: float

    def row(self) -> str:
        return (
            f"{self.strategy:<13} {self.staleness:>5} {self.imbalance:>9.3f} {self.cv:>6.3f} {self.hottest:>7.3f} "
            f"{self.rejected:>8} {self.refusals:>8} {self.probes_per_decision:>6.1f}"
        )


HEADER = f"{'strategy':<13} {'stale':>5} {'imbalance':>9} {'cv':>6} {'hottest':>7} {'rejected':>8} {'refusals':>8} {'probes':>6}"


def _pick(rng: random.Random, table: Sequence[tuple[float, ...]]) -> tuple[float, ...]:
    x = rng.random()
    for row in table:
        x -= row[0]
        if x <= 0:
            return row
    return table[-1]


def _dominant(e: EdgeView) -> float:
    return max(c / cap for (_, c), (_, cap) in zip(e.committed.items(), e.capacity.items(), strict=True) if cap)


def _with(e: EdgeView, committed: Room) -> EdgeView:
    return EdgeView(e.id, e.capacity, committed, e.layers, e.labels, e.draining, e.alive, e.backends)


def make_edges(n: int, rng: random.Random) -> list[EdgeView]:
    out = []
    for i in range(n):
        _, count, cpu, mem, disk = _pick(rng, EDGE_SIZES)
        out.append(EdgeView(id=f"e{i}", capacity=Room(int(count), int(cpu), int(mem), int(disk)), committed=Room()))
    return out


def simulate(
    strategy: str, *, edges: int = 40, arrivals: int = 20_000, load: float = 0.85, staleness: int = 0,
    seed: int = 1, max_attempts: int = 3,
) -> SimResult:
    """Run one strategy; the same seed gives every strategy the same edges and arrivals."""
    choose = STRATEGIES[strategy]
    started = time.perf_counter()
    rng_world = random.Random(seed)
    rng_choice = random.Random(seed + 1)
    truth = make_edges(edges, rng_world)
    index = {e.id: i for i, e in enumerate(truth)}
    mean_mem = sum(w * m for w, _, m, _ in DEMANDS)
    mean_life = LIFETIME_MEDIAN_S * math.exp(LIFETIME_SIGMA**2 / 2)
    total_mem = sum(e.capacity.memory for e in truth)
    rate = load * total_mem / (mean_mem * mean_life)  # arrivals per second at the offered load

    view = list(truth)
    departures: list[tuple[float, int, Room]] = []
    now = 0.0
    placed = rejected = refusals = probes = decisions = 0
    spreads: list[float] = []
    cvs: list[float] = []
    hottest = 0.0
    warmup = arrivals // 5
    for n in range(arrivals):
        now += rng_world.expovariate(rate)
        while departures and departures[0][0] <= now:
            _, i, need = heapq.heappop(departures)
            e = truth[i]
            truth[i] = _with(e, e.committed - need)
            if staleness == 0:
                view[i] = truth[i]
        _, cpu, mem, disk = _pick(rng_world, DEMANDS)
        life = rng_world.lognormvariate(math.log(LIFETIME_MEDIAN_S), LIFETIME_SIGMA)
        demand = Demand(need=Room(1, int(cpu), int(mem), int(disk)))
        if staleness and n % staleness == 0:
            view = list(truth)
        tried: set[str] = set()
        ok = False
        for _attempt in range(max_attempts):
            cands = feasible((e for e in view if e.id not in tried), demand)
            if not cands:
                break
            decisions += 1
            probes += len(cands) if strategy in ("best-fit", "least-loaded") else min(len(cands), 2 if strategy == "power-of-2" else 1)
            chosen = choose(cands, demand, rng_choice)
            i = index[chosen.id]
            if not fits(truth[i], demand):  # the edge's admission has the last word
                refusals += 1
                tried.add(chosen.id)
                continue
            truth[i] = _with(truth[i], truth[i].committed + demand.need)
            if staleness == 0:
                view[i] = truth[i]
            heapq.heappush(departures, (now + life, i, demand.need))
            ok = True
            break
        if n >= warmup:
            placed += ok
            rejected += not ok
            if n % 50 == 0:
                utils = [_dominant(e) for e in truth]
                mean = statistics.fmean(utils)
                spreads.append(max(utils) - mean)
                cvs.append(statistics.pstdev(utils) / mean if mean else 0.0)
                hottest = max(hottest, max(utils))
    return SimResult(
        strategy=strategy, staleness=staleness, placed=placed, rejected=rejected, refusals=refusals,
        imbalance=statistics.fmean(spreads) if spreads else 0.0, cv=statistics.fmean(cvs) if cvs else 0.0,
        hottest=hottest, probes_per_decision=probes / max(decisions, 1), seconds=time.perf_counter() - started,
    )


def compare(
    *, edges: int = 40, arrivals: int = 20_000, load: float = 0.85, staleness: Sequence[int] = (0, 50),
    seed: int = 1, strategies: Sequence[str] = ("power-of-2", "best-fit", "random", "least-loaded"),
) -> list[SimResult]:
    return [
        simulate(s, edges=edges, arrivals=arrivals, load=load, staleness=st, seed=seed)
        for st in staleness
        for s in strategies
    ]


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m dsec.control.placement_sim")
    ap.add_argument("--edges", type=int, default=100)
    ap.add_argument("--arrivals", type=int, default=60_000)
    ap.add_argument("--load", type=float, default=0.85, help="offered memory load (fraction of the cluster)")
    ap.add_argument("--staleness", type=int, nargs="*", default=[0, 50, 500])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    results = compare(edges=a.edges, arrivals=a.arrivals, load=a.load, staleness=a.staleness, seed=a.seed)
    if a.json:
        print(json.dumps([dataclasses.asdict(r) for r in results], indent=1))
        return
    print(f"{a.edges} edges, {a.arrivals} arrivals, offered load {a.load:.0%} of memory, seed {a.seed}")
    print(HEADER)
    for r in results:
        print(r.row())


if __name__ == "__main__":
    main()
