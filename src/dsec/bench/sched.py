"""``dsec bench sched``: a day of a DSec cell, simulated with the control plane's own scheduling code.

A discrete-event simulation of 160 edges of 190 cores (the DSec paper's cell: ~30K cores,
~250 TB of RAM), a day of mixed tasks — training rollouts with elastic minimums and
maximums, evaluations that burst at 5,000 creates/s, background jobs — with lifetimes
log-normal at p50 17 min / p99 3 h, a peak of ~380K concurrent sandboxes, and a burst pool
of cloud nodes that boot in 90 s.

What is **real** (imported and called as the control plane and the edges call it):

- quota checks: :func:`dsec.control.iam.check_fits` (the project) and
  :func:`~dsec.control.iam.check_task_fits` (the task's maximum);
- scheduling: :func:`dsec.control.sched.decide` — the burst threshold, the elastic
  minimums (:func:`~dsec.control.sched.reserved`), preemption (victims chosen by
  :func:`~dsec.control.sched.pick_victims`), resumes of preempted sandboxes
  (``decide(..., only=edge)``) — and :func:`~dsec.control.sched.burst_plan`;
- placement: :func:`dsec.control.placement.place` (power-of-2 choices);
- each edge's final admission: :class:`dsec.edge.admission.Admission` (its budgets, and
  ``suspend``/``unsuspend`` of sandboxes paused by preemption).

What is **simulated**: time, arrivals, lifetimes, and the bookkeeping the store does for
the control plane (the counters a reserve transaction bumps); burst nodes booting. There
is no store: the decision code is pure, so the simulation runs it without a database.

The checks are independent of the code they check: after every change of an edge's
admission the simulation compares its books with the budgets (``sim_overcommit_violations``),
and after every preemption it compares each victim's task with its minimum, and counts a
create refused while inside its task's minimum (``sim_min_guarantee_violations``).
"""

from __future__ import annotations

import dataclasses
import gc
import heapq
import math
import random
import time
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field
from typing import Any

from dsec.control.iam import Amount, check_fits, check_task_fits
from dsec.control.placement import Demand, EdgeView, Room
from dsec.control.sched import (
    BURST_POOL,
    POOL_LABEL,
    PRIORITIES,
    BurstNode,
    BurstSizing,
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
    reserved,
    utilisation,
)
from dsec.edge.admission import Admission, Budgets
from dsec.errors import Backpressure, QuotaExceeded
from dsec.spec import Resources
from dsec.spec.api import TaskQuota

GiB = 1024**3
Say = Callable[[str], None]

# ------------------------------------------------------------------ the cell ----

EDGES = 160
CORES = 190
EDGE_BUDGETS = Budgets(
    sandboxes=4000,  # the paper's stable operating point is >= 3,200 containers per node
    cpu=CORES * 8.0,  # the edge's default cpu overcommit (EdgeConfig: CPU_OVERCOMMIT)
    memory=int(250e12 / EDGES * 0.9),  # 250 TB over 160 nodes, 90 % of it for sandboxes (MEMORY_FRACTION)
    disk=16 * 1024 * GiB,
)
BURST_MAX_NODES = 24
"""The cloud quota of the burst pool: 15 % of the primary pool."""
BURST_BOOT_S = 90.0
LIFE_MEDIAN_S = 17 * 60.0
LIFE_SIGMA = math.log(3 * 3600 / LIFE_MEDIAN_S) / 2.326348  # p99 = 3 h
MEAN_LIFE_S = LIFE_MEDIAN_S * math.exp(LIFE_SIGMA**2 / 2)
EVAL_RATE = 5000.0
"""Creates per second of an evaluation run (the paper's peak)."""
TICK_S = 10.0
"""The burst controller's period (the watcher's, in the control plane)."""
SAMPLE_S = 60.0
RESUME_FIRST_S = 60.0
RESUME_MAX_S = 600.0


@dataclass(frozen=True)
class Size:
    name: str
    res: Resources
    room: Room
    amount: Amount
    demand: Demand


def _size(name: str, cpu: float, mem_gib: float, disk_gib: int) -> Size:
    res = Resources(cpu=cpu, memory=int(mem_gib * GiB), disk=disk_gib * GiB)
    room = Room(1, round(cpu * 1000), res.memory, res.disk)
    return Size(name, res, room, Amount(1, room.cpu_m, room.memory), Demand(need=room))


SIZES = {  # memory-bound, as in the paper (~90 % of sandboxes use <= 5 % of the cpu they ask for)
    "S": _size("S", 0.25, 0.5, 2),
    "M": _size("M", 0.5, 0.7, 4),
    "L": _size("L", 1.0, 1.4, 8),
    "XL": _size("XL", 2.0, 2.8, 16),
}


@dataclass(frozen=True)
class TaskSpec:
    """One job of the day. ``peak``: its target concurrency at the day's peak, ``base`` the share
    of it it keeps outside the peak (rollouts follow :func:`load`); ``runs``: evaluation-style
    one-shot runs ``(hour, sandboxes)`` created at :data:`EVAL_RATE`."""

    name: str
    project: str
    priority: str
    preemption: str
    burst: bool
    size: str
    peak: int = 0
    base: float = 0.06
    min: int = 0
    max: int | None = None
    runs: tuple[tuple[float, int], ...] = ()
    ttl_h: float = 4.0
    """Its sandboxes' TTL (the edge ends them then): only those of at most
    ``SchedConfig.burst_max_ttl_s`` (4 h) may go to the burst pool."""
    start_h: float = 0.0
    """The job starts then (nothing before; its ``runs`` may fill it at once)."""


def _eval_runs(every_h: float, first_h: float, sizes: tuple[int, ...]) -> tuple[tuple[float, int], ...]:
    out = []
    h, i = first_h, 0
    while h < 24.0:
        out.append((h, sizes[i % len(sizes)]))
        h += every_h
        i += 1
    return tuple(out)


DAY: tuple[TaskSpec, ...] = (
    # elastic: at the top of the peak, with the evaluations, they ask for a little more than the
    # cell (primary and burst) holds: their creates above min are refused or preempted first
    TaskSpec("rollouts-math", "rl-a", "training", "pause", True, "S", peak=127_000, min=30_000, max=150_000),
    TaskSpec("rollouts-code", "rl-a", "training", "pause", True, "M", peak=88_000, min=20_000, max=108_000),
    TaskSpec("rollouts-web", "rl-b", "training", "pause", True, "S", peak=94_000, min=20_000, max=114_000),
    TaskSpec("swe-agent", "rl-b", "training", "pause", True, "L", peak=22_000, min=5_000, max=28_000, ttl_h=8.0),
    TaskSpec("background", "batch", "background", "destroy", True, "M", peak=52_000, base=0.4, max=80_000),
    TaskSpec("indexing", "batch", "background", "pause", False, "XL", peak=6_000, base=1.0, max=10_000),
    # a job that starts on the full cell at 14:45: its minimum is guaranteed (12K at 5,000/s, taking
    # other tasks' elastic part), what it asks above it is best effort
    TaskSpec("rollouts-late", "rl-b", "training", "pause", True, "M", peak=16_000, base=1.0, min=12_000,
             max=20_000, start_h=14.75, runs=((14.75, 12_000),)),
    TaskSpec("evals", "eval", "evaluation", "never", False, "M",
             runs=_eval_runs(1.5, 0.0, (16_000, 24_000, 32_000, 8_000))),
    TaskSpec("leaderboard", "eval", "evaluation", "never", False, "L", runs=_eval_runs(3.0, 1.25, (4_000,))),
)
PROJECT_QUOTA = {  # caps (carved from the root), not reservations: together they exceed the cell
    "rl-a": 260_000, "rl-b": 165_000, "batch": 100_000, "eval": 80_000,
}
PEAK_H = 15.0
PEAK_WIDTH_H = 1.4


def load(hour: float, base: float) -> float:
    """A job's share of its peak concurrency at ``hour``: ``base`` all day, and a peak at 15:00
    (a Gaussian, 1.4 h wide). With the paper's lifetimes the day (``DAY``) makes ~5.6M creates
    and ~375K concurrent sandboxes at the peak (the paper: ~3M a day, 380K at the peak)."""
    return base + (1.0 - base) * math.exp(-((hour - PEAK_H) ** 2) / (2 * PEAK_WIDTH_H**2))


# ------------------------------------------------------------ the simulation ----

RUNNING, PREEMPTED, GONE = 0, 1, 2


class _Box:
    __slots__ = ("backoff", "edge", "end", "sid", "state", "task")

    def __init__(self, sid: int, edge: _Edge, task: _Task, end: float) -> None:
        self.sid = sid
        self.edge = edge
        self.task = task
        self.state = RUNNING
        self.end = end
        self.backoff = RESUME_FIRST_S


class _Edge:
    __slots__ = ("adm", "burst", "id", "idx", "pos", "released", "victims", "view")

    def __init__(self, idx: int, eid: str, burst: bool, pos: int) -> None:
        self.idx = idx
        self.id = eid
        self.burst = burst
        self.pos = pos
        labels = {POOL_LABEL: BURST_POOL} if burst else {}
        b = EDGE_BUDGETS
        self.view = EdgeView(id=eid, capacity=Room(b.sandboxes, round(b.cpu * 1000), b.memory, b.disk),
                             committed=Room(), labels=labels)
        self.adm = Admission(b)
        self.victims: dict[int, dict[int, _Box]] = {}
        """priority -> running sandboxes (insertion order = age) that a preemption may take."""
        self.released = False


class _Project:
    __slots__ = ("name", "quota", "used")

    def __init__(self, name: str, sandboxes: int) -> None:
        self.name = name
        cap = EDGE_BUDGETS
        self.quota = Amount(sandboxes, round(cap.cpu * 1000) * EDGES, cap.memory * EDGES)
        self.used = Amount()


class _Task:
    __slots__ = ("key", "policy", "prio", "project", "quota", "size", "spec", "ttl_s", "used")

    def __init__(self, spec: TaskSpec, project: _Project) -> None:
        self.spec = spec
        self.key = spec.name
        self.project = project
        self.size = SIZES[spec.size]
        self.quota = TaskQuota(sandboxes=spec.max)
        mn = self.size.amount * spec.min if spec.min else None
        self.policy = Policy(priority=PRIORITIES[spec.priority], preemption=spec.preemption, min=mn, burst=spec.burst)
        self.prio = self.policy.priority
        self.used = Amount()
        self.ttl_s = spec.ttl_h * 3600.0


@dataclass
class SimResult:
    window_h: float
    wall_s: float = 0.0
    creates: int = 0
    attempts: int = 0
    refused: int = 0
    refused_reserved: int = 0
    quota_refusals: int = 0
    edge_refusals: int = 0
    burst_creates: int = 0
    preemptions_pause: int = 0
    preemptions_destroy: int = 0
    resumes: int = 0
    resume_refusals: int = 0
    overcommit_violations: int = 0
    min_violations: int = 0
    util_samples: list[float] = field(default_factory=list)
    concurrent_peak: int = 0
    burst_nodes_peak: int = 0
    burst_provisioned: int = 0
    burst_at_start: int = 0
    burst_released: int = 0
    per_second: dict[int, int] = field(default_factory=dict)
    hist_us: list[int] = field(default_factory=lambda: [0] * 100_001)
    warm: int = 0
    warm_s: float = 0.0
    guaranteed: int = 0
    """Creates inside their task's minimum."""
    guaranteed_preempting: int = 0
    """... of which made room by preempting."""
    min_reached: dict[str, float] = field(default_factory=dict)
    """Jobs that started in the window: seconds from their start until they held their minimum."""
    place_max_cpu_s: float = 0.0
    """The longest decision in CPU time (its wall time may include the machine's other work)."""
    cpu_s: float = 0.0
    """CPU seconds of the simulated window (the machine may be shared: wall time varies)."""

    def place_ms(self, p: float) -> float:
        total = sum(self.hist_us)
        if not total:
            return 0.0
        want = p / 100.0 * total
        acc = 0
        for us, n in enumerate(self.hist_us):
            acc += n
            if acc >= want:
                return us / 1000.0
        return 100.0


class Cell:
    """The simulated cell: edges with their admission, the control plane's books, the tasks."""

    def __init__(self, *, seed: int, cfg: SchedConfig, tasks: tuple[TaskSpec, ...] = DAY,
                 scale: float = 1.0, load: float = 1.0) -> None:
        """``scale``: the cell and its load shrunk alike (edges, jobs, quotas, the burst pool, the
        evaluation rate): 1.0 is the paper's cell; the tests run a 40th of it. ``load``: the jobs'
        concurrency (and their maximums and projects' quotas) times this, the cell unchanged."""
        self.rng = random.Random(seed)
        self.place_rng = random.Random(seed + 1)
        self.cfg = cfg
        self.scale = scale
        edges = max(1, round(EDGES * scale))
        self.burst_max = max(1, round(BURST_MAX_NODES * scale))
        self.eval_rate = EVAL_RATE * scale
        if scale != 1.0 or load != 1.0:
            tasks = tuple(dataclasses.replace(
                t, peak=round(t.peak * scale * load), min=round(t.min * scale),
                max=None if t.max is None else round(t.max * scale * load),
                runs=tuple((h, max(1, round(c * scale))) for h, c in t.runs)) for t in tasks)
        self.edges: list[_Edge] = [_Edge(i, f"e{i:03d}", False, i) for i in range(edges)]
        self.by_id: dict[str, _Edge] = {e.id: e for e in self.edges}
        self.pools = Pools(primary=[e.view for e in self.edges], burst=[])
        self.pools.capacity = Room(*(x * edges for x in (
            self.edges[0].view.capacity.sandboxes, self.edges[0].view.capacity.cpu_m,
            self.edges[0].view.capacity.memory, self.edges[0].view.capacity.disk)))
        self.projects = {name: _Project(name, round(n * scale * load)) for name, n in PROJECT_QUOTA.items()}
        self.tasks = {t.name: _Task(t, self.projects[t.project]) for t in tasks}
        self.standings: dict[Hashable, Standing] = {
            t.key: Standing(t.policy) for t in self.tasks.values()}
        self.min_keys = [t.key for t in self.tasks.values() if t.policy.min is not None]
        self.boxes: dict[int, _Box] = {}
        self.next_sid = 0
        self.heap: list[tuple[float, int, int, Any]] = []
        self.seq = 0
        self.pending_nodes = 0
        self.t_start = 0.0
        self.res = SimResult(window_h=0.0)
        self.counting = False

    # ---------------------------------------------------------- bookkeeping ----

    def _push(self, t: float, kind: int, obj: Any) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, obj))

    def _commit(self, e: _Edge, delta: Room, sign: int) -> None:
        """The control plane's counter of an edge (the store's ``committed_*``), and the pool's total."""
        v = e.view
        c = v.committed
        if sign > 0:
            nc = Room(c.sandboxes + delta.sandboxes, c.cpu_m + delta.cpu_m, c.memory + delta.memory, c.disk + delta.disk)
        else:
            nc = Room(c.sandboxes - delta.sandboxes, c.cpu_m - delta.cpu_m, c.memory - delta.memory, c.disk - delta.disk)
        e.view = EdgeView(v.id, v.capacity, nc, v.layers, v.labels, v.draining, v.alive, v.backends, v.fetches)
        if e.burst:
            self.pools.burst[e.pos] = e.view  # type: ignore[index]
        else:
            self.pools.primary[e.pos] = e.view  # type: ignore[index]
            self.pools.committed = self.pools.committed + delta if sign > 0 else self.pools.committed - delta
        cap = v.capacity
        if nc.sandboxes > cap.sandboxes or nc.cpu_m > cap.cpu_m or nc.memory > cap.memory or nc.disk > cap.disk:
            self.res.overcommit_violations += 1

    def _check_edge(self, e: _Edge) -> None:
        """The edge's own books against its budgets (independent of the decision code)."""
        u, b = e.adm.real, e.adm.budgets
        if u.sandboxes > b.sandboxes or u.cpu > b.cpu + 1e-6 or u.memory > b.memory or u.disk > b.disk:
            self.res.overcommit_violations += 1

    def _active(self, task: _Task, delta: Amount, sign: int) -> None:
        st = self.standings[task.key]
        self.standings[task.key] = Standing(st.policy, st.active + delta if sign > 0 else st.active - delta)

    def _used(self, task: _Task, delta: Amount, sign: int) -> None:
        if sign > 0:
            task.used = task.used + delta
            task.project.used = task.project.used + delta
        else:
            task.used = task.used - delta
            task.project.used = task.project.used - delta

    def victims_on(self, edge_id: str, below: int | None) -> Iterator[Victim]:
        e = self.by_id[edge_id]
        n = 0
        for prio in sorted(e.victims):
            if below is not None and prio >= below:
                return
            boxes = e.victims[prio]
            for sid in reversed(boxes):
                b = boxes[sid]
                t = b.task
                yield Victim(sid, t.key, prio, t.policy.preemption, t.size.room)
                n += 1
                if n >= VICTIM_SCAN:
                    return

    # -------------------------------------------------------------- creates ----

    def create(self, task: _Task, now: float, life: float, tries: int = 0) -> bool:
        res = self.res
        size = task.size
        want = size.amount
        t0 = time.perf_counter()
        c0 = time.thread_time()
        try:  # the control plane's quota checks: the project, then the task's maximum
            p = task.project
            check_fits(project=p.name, quota=p.quota, used=p.used, reserved=Amount(), want=want)
            check_task_fits(task=task.key, project=p.name, quota=task.quota, used=task.used, want=want)
        except QuotaExceeded:
            if self.counting:
                res.quota_refusals += 1
                res.attempts += 1
            return False
        st = self.standings[task.key]
        ask = ask_for(st, task.key, want, self.cfg, task.ttl_s)
        held = reserved(self.standings[k] for k in self.min_keys)
        d = decide(size.demand, ask, self.pools, held_back=held, victims_on=self.victims_on,
                   standings=self.standings, cfg=self.cfg, rng=self.place_rng)
        dt = time.perf_counter() - t0
        dc = time.thread_time() - c0
        if self.counting:
            res.attempts += 1
            us = int(dt * 1e6)
            res.hist_us[us if us < 100_000 else 100_000] += 1
            if dc > res.place_max_cpu_s:
                res.place_max_cpu_s = dc
        if isinstance(d, Refused):
            if self.counting:
                res.refused += 1
                res.refused_reserved += d.reserved
                if ask.guaranteed:
                    res.min_violations += 1
            if tries < 3 and task.spec.runs:  # an evaluation's client backs off and retries (create_many)
                self._push(now + 2.0**tries, RETRY, (task, life, tries + 1))
            return False
        e = self.by_id[d.edge.id]
        if isinstance(d, Preempting):
            self._preempt(d.victims, now)
        try:
            e.adm.check(size.res)  # the edge's admission has the last word
        except Backpressure:
            res.edge_refusals += 1
            return False
        sid = self.next_sid
        self.next_sid += 1
        e.adm.reserve(str(sid), size.res)
        self._check_edge(e)
        life = min(life, task.ttl_s)  # the edge's watchdog ends it at its TTL
        box = _Box(sid, e, task, now + life)
        self.boxes[sid] = box
        e.victims.setdefault(task.prio, {})[sid] = box
        self._commit(e, size.room, 1)
        self._used(task, want, 1)
        self._active(task, want, 1)
        self._push(now + life, DEPART, box)
        if self.counting:
            res.creates += 1
            res.burst_creates += e.burst
            sec = int(now)
            res.per_second[sec] = res.per_second.get(sec, 0) + 1
            if ask.guaranteed:
                res.guaranteed += 1
                res.guaranteed_preempting += isinstance(d, Preempting)
            m = task.policy.min
            if (m is not None and task.key not in res.min_reached and task.spec.start_h * 3600.0 > self.t_start
                    and self.standings[task.key].active.sandboxes >= m.sandboxes):
                res.min_reached[task.key] = now - task.spec.start_h * 3600.0
        else:
            res.warm += 1
        return True

    def _preempt(self, victims: tuple[Victim, ...], now: float) -> None:
        hit: set[_Task] = set()
        for v in victims:
            b = self.boxes[v.key]  # type: ignore[index]
            e, t = b.edge, b.task
            del e.victims[t.prio][b.sid]
            hit.add(t)
            room = t.size.room
            if v.preemption == "destroy":
                b.state = GONE
                e.adm.release(str(b.sid))
                self._commit(e, room, -1)
                self._used(t, t.size.amount, -1)
                self._active(t, t.size.amount, -1)
                del self.boxes[b.sid]
                if self.counting:
                    self.res.preemptions_destroy += 1
            else:
                b.state = PREEMPTED
                e.adm.suspend(str(b.sid))
                self._commit(e, room - paused_room(room), -1)
                self._active(t, t.size.amount, -1)
                b.backoff = RESUME_FIRST_S
                self._push(now + self.rng.expovariate(1.0 / RESUME_FIRST_S), RESUME, b)
                if self.counting:
                    self.res.preemptions_pause += 1
            self._check_edge(e)
        for t in hit:  # the guarantee, checked apart from the code that chose the victims
            m = t.policy.min
            if m is not None:
                a = self.standings[t.key].active
                if a.sandboxes < m.sandboxes or a.cpu_m < m.cpu_m or a.memory < m.memory:
                    self.res.min_violations += 1

    def depart(self, b: _Box) -> None:
        if b.state == GONE:
            return
        e, t = b.edge, b.task
        room = t.size.room
        e.adm.release(str(b.sid))
        if b.state == RUNNING:
            del e.victims[t.prio][b.sid]
            self._commit(e, room, -1)
            self._active(t, t.size.amount, -1)
        else:
            self._commit(e, paused_room(room), -1)
        self._used(t, t.size.amount, -1)
        b.state = GONE
        del self.boxes[b.sid]

    def resume(self, b: _Box, now: float) -> None:
        """The owner resumes a preempted sandbox: the same decision, on its own edge only."""
        if b.state != PREEMPTED or now >= b.end:
            return
        t, e = b.task, b.edge
        want = t.size.amount
        st = self.standings[t.key]
        ask = ask_for(st, t.key, want, self.cfg, t.ttl_s)
        held = reserved(self.standings[k] for k in self.min_keys)
        d = decide(t.size.demand, ask, self.pools, held_back=held, victims_on=self.victims_on,
                   standings=self.standings, cfg=self.cfg, rng=self.place_rng, only=e.view)
        if not isinstance(d, Refused):
            if isinstance(d, Preempting):
                self._preempt(d.victims, now)
            try:
                e.adm.unsuspend(str(b.sid))
            except Backpressure:
                self.res.edge_refusals += 1
                d = Refused("edge")
            else:
                self._check_edge(e)
                room = t.size.room
                self._commit(e, room - paused_room(room), 1)
                self._active(t, want, 1)
                b.state = RUNNING
                e.victims.setdefault(t.prio, {})[b.sid] = b
                if self.counting:
                    self.res.resumes += 1
                return
        if self.counting:
            self.res.resume_refusals += 1
        b.backoff = min(b.backoff * 2, RESUME_MAX_S)
        self._push(now + b.backoff, RESUME, b)

    # ---------------------------------------------------------------- burst ----

    def burst_tick(self, now: float) -> None:
        nodes = [BurstNode(e.id, True, e.view.committed.sandboxes, e.view.capacity, e.view.committed)
                 for e in self._burst_edges()]
        plan = burst_plan(self.pools, nodes, self.pending_nodes, self.cfg,
                          BurstSizing(max_nodes=self.burst_max, node=self.edges[0].view.capacity))
        for _ in range(plan.provision):
            self.pending_nodes += 1
            self._push(now + BURST_BOOT_S, NODE_UP, None)
        for eid in plan.release:
            e = self.by_id[eid]
            if e.view.committed.sandboxes == 0:  # the provider gives back only an empty node
                self._remove_burst(e)
                self.res.burst_released += 1

    def _warm_burst(self) -> None:
        nodes = [BurstNode(e.id, True, e.view.committed.sandboxes, e.view.capacity, e.view.committed)
                 for e in self._burst_edges()]
        plan = burst_plan(self.pools, nodes, 0, self.cfg,
                          BurstSizing(max_nodes=self.burst_max, node=self.edges[0].view.capacity))
        for _ in range(plan.provision):
            self.pending_nodes += 1
            self.node_up()

    def _burst_edges(self) -> list[_Edge]:
        return [self.by_id[v.id] for v in self.pools.burst]

    def node_up(self) -> None:
        self.pending_nodes -= 1
        idx = len(self.by_id)
        e = _Edge(idx, f"b{idx:03d}", True, len(self.pools.burst))
        self.by_id[e.id] = e
        self.pools.burst.append(e.view)  # type: ignore[attr-defined]
        if self.counting:
            self.res.burst_provisioned += 1
        else:
            self.res.burst_at_start += 1
        self.res.burst_nodes_peak = max(self.res.burst_nodes_peak, len(self.pools.burst))

    def _remove_burst(self, e: _Edge) -> None:
        burst: list[EdgeView] = self.pools.burst  # type: ignore[assignment]
        last = burst.pop()
        if last.id != e.id:
            burst[e.pos] = last
            self.by_id[last.id].pos = e.pos
        e.released = True
        del self.by_id[e.id]

    # ------------------------------------------------------------------ day ----

    def run(self, start_h: float, hours: float, say: Say) -> SimResult:
        res = self.res
        res.window_h = hours
        t_start, t_end = start_h * 3600.0, (start_h + hours) * 3600.0
        self.t_start = t_start
        rng = self.rng
        mu = math.log(LIFE_MEDIAN_S)
        wall0 = time.perf_counter()
        # the rollouts already running at the window's start (an M/G/inf population: Poisson
        # many, each with a length-biased lifetime of which a uniform part is left)
        warm = 0
        for task in self.tasks.values():
            if not task.spec.peak:
                continue
            n = _poisson(rng, task.spec.peak * load(start_h, task.spec.base)) if start_h >= task.spec.start_h else 0
            for i in range(n):
                life = rng.lognormvariate(mu + LIFE_SIGMA**2, LIFE_SIGMA) * rng.random()
                warm += self.create(task, t_start, life)
                if i % 2000 == 0:  # a warm cell has the burst nodes it needs up already
                    self._warm_burst()
            self._push(self._next_arrival(task, t_start), ARRIVE, task)
        for task in self.tasks.values():
            for hour, count in task.spec.runs:
                if start_h <= hour < start_h + hours:
                    self._push(hour * 3600.0, EVAL, (task, count))
        self._push(t_start + TICK_S, TICK, None)
        self._push(t_start, SAMPLE, None)
        say(f"warm start: {warm:,} sandboxes running at {start_h:05.2f} h "
            f"({time.perf_counter() - wall0:.1f} s)")
        self.counting = True
        # the simulated world (hundreds of thousands of sandbox objects) lives in this process; the
        # control plane keeps it in its store. Left to the cyclic GC, its scans of that world would
        # show up as 100 ms "decisions": freeze what exists now, as a long-lived service would.
        gc.collect()
        gc.freeze()
        gc.disable()  # the world's objects form no cycles; its growth would trigger full scans
        res.warm_s = time.perf_counter() - wall0
        cpu0 = time.process_time()
        heap = self.heap
        pop = heapq.heappop
        next_say = wall0 + 30.0
        while heap:
            now, _, kind, obj = pop(heap)
            if now >= t_end:
                break
            if kind == DEPART:
                self.depart(obj)
            elif kind == ARRIVE:
                task = obj
                self.create(task, now, rng.lognormvariate(mu, LIFE_SIGMA))
                self._push(self._next_arrival(task, now), ARRIVE, task)
            elif kind == EVAL:
                task, left = obj
                self.create(task, now, rng.lognormvariate(mu, LIFE_SIGMA))
                if left > 1:
                    self._push(now + 1.0 / self.eval_rate, EVAL, (task, left - 1))
            elif kind == RETRY:
                task, life, tries = obj
                self.create(task, now, life, tries)
            elif kind == RESUME:
                self.resume(obj, now)
            elif kind == TICK:
                self.burst_tick(now)
                self._push(now + TICK_S, TICK, None)
            elif kind == NODE_UP:
                self.node_up()
            elif kind == SAMPLE:
                res.util_samples.append(utilisation(self.pools.capacity, self.pools.committed))
                res.concurrent_peak = max(res.concurrent_peak, len(self.boxes))
                self._push(now + SAMPLE_S, SAMPLE, None)
                if time.perf_counter() > next_say:
                    next_say = time.perf_counter() + 30.0
                    say(f"  {now / 3600:05.2f} h: {len(self.boxes):,} sandboxes, primary "
                        f"{res.util_samples[-1]:.0%}, {len(self.pools.burst)} burst nodes, {res.creates:,} creates "
                        f"({time.perf_counter() - wall0:.0f} s)")
        res.wall_s = time.perf_counter() - wall0
        res.cpu_s = time.process_time() - cpu0
        gc.enable()
        gc.unfreeze()
        return res

    def _next_arrival(self, task: _Task, now: float) -> float:
        start = task.spec.start_h * 3600.0
        if now < start:
            return start
        return now + self.rng.expovariate(self._rate(task, now))

    def _rate(self, task: _Task, now: float) -> float:
        """Arrivals per second that hold the task at its target (Little's law)."""
        return max(task.spec.peak * load(now / 3600.0 % 24.0, task.spec.base) / MEAN_LIFE_S, 1e-6)


VICTIM_SCAN = 256
"""Victims listed per edge for one decision (the control plane's query has the same limit)."""
DEPART, ARRIVE, EVAL, RETRY, RESUME, TICK, NODE_UP, SAMPLE = range(8)


def _poisson(rng: random.Random, lam: float) -> int:
    if lam > 50:
        return max(0, round(rng.gauss(lam, math.sqrt(lam))))
    n, p, target = 0, 1.0, math.exp(-lam)
    while True:
        p *= rng.random()
        if p <= target:
            return n
        n += 1


def results(res: SimResult, *, edges: int, start_h: float) -> dict[str, Any]:
    """The bench's keys (docs/PERFORMANCE.md)."""
    peak_s = max(res.per_second.values()) if res.per_second else 0
    return {
        "sim_window_h": res.window_h,
        "sim_window_start_h": start_h,
        "sim_edges": edges,
        "sim_edge_cores": CORES,
        "sim_concurrent_peak": res.concurrent_peak,
        "sim_creates": res.creates,
        "sim_creates_peak_per_s": peak_s,
        "sim_create_attempts": res.attempts,
        "sim_refused": res.refused,
        "sim_refused_reserved": res.refused_reserved,
        "sim_quota_refusals": res.quota_refusals,
        "sim_edge_refusals": res.edge_refusals,
        "sim_place_p50_ms": round(res.place_ms(50), 3),
        "sim_place_p99_ms": round(res.place_ms(99), 3),
        "sim_place_p999_ms": round(res.place_ms(99.9), 3),
        "sim_place_max_ms": round(res.place_ms(100), 3),
        "sim_place_max_cpu_ms": round(res.place_max_cpu_s * 1000, 3),
        "sim_overcommit_violations": res.overcommit_violations,
        "sim_min_guarantee_violations": res.min_violations,
        "sim_guaranteed_creates": res.guaranteed,
        "sim_guaranteed_creates_preempting": res.guaranteed_preempting,
        **{f"sim_min_reached_s_{k.replace('-', '_')}": round(v, 1) for k, v in sorted(res.min_reached.items())},
        "sim_preemptions": res.preemptions_pause + res.preemptions_destroy,
        "sim_preemptions_pause": res.preemptions_pause,
        "sim_preemptions_destroy": res.preemptions_destroy,
        "sim_resumes": res.resumes,
        "sim_resume_refusals": res.resume_refusals,
        "sim_burst_creates_frac": round(res.burst_creates / res.creates, 4) if res.creates else 0.0,
        "sim_burst_nodes_peak": res.burst_nodes_peak,
        "sim_burst_nodes_at_start": res.burst_at_start,
        "sim_burst_nodes_provisioned": res.burst_provisioned,
        "sim_burst_nodes_released": res.burst_released,
        "sim_utilisation_mean": round(sum(res.util_samples) / len(res.util_samples), 4) if res.util_samples else 0.0,
        "sim_utilisation_max": round(max(res.util_samples), 4) if res.util_samples else 0.0,
        "sim_wall_s": round(res.wall_s, 1),
        "sim_warm_start_s": round(res.warm_s, 1),
        "sim_cpu_s": round(res.cpu_s, 1),
        "sim_cpu_us_per_create": round(res.cpu_s / res.creates * 1e6, 1) if res.creates else 0.0,
    }


def run(*, quick: bool = False, seed: int = 1, say: Say = print, hours: float | None = None,
        start_h: float | None = None, scale: float = 1.0, load: float = 1.0) -> dict[str, Any]:
    """The whole day (00:00-24:00), or with ``quick`` the busiest hour (14:30-15:30, with the
    peak's evaluation run of 32K sandboxes at 5,000/s)."""
    if hours is None:
        hours = 1.0 if quick else 24.0
    if start_h is None:
        start_h = 14.5 if quick else 0.0
    cell = Cell(seed=seed, cfg=SchedConfig(), scale=scale, load=load)
    edges = len(cell.edges)
    say(f"dsec bench sched: {edges} edges x {CORES} cores, {hours:g} h from {start_h:05.2f} h, seed {seed}")
    res = cell.run(start_h, hours, say)
    return results(res, edges=edges, start_h=start_h)
