"""The scheduler's side that touches the store and the edges (the decisions are sched.py's).

- Inside a create's reserve transaction (sandboxes.py): :meth:`Scheduler.decide_txn` loads what
  :func:`dsec.control.sched.decide` needs — the task's policy and standing, the minimums still
  held back, the victims an edge holds (one indexed query per examined edge, and only when
  nothing fits) — and returns its decision. It writes nothing.
- A decision to preempt is carried out **before** the create is reserved again, in its own
  transaction (:meth:`Scheduler.preempt`): the victims are locked and re-checked (still running
  or paused, not preempted yet), moved (paused by preemption: they keep their slot and disk on
  their edge, not their cpu and memory; or ``stopping``), the events recorded; then the edges are
  told (``POST /v1/sandboxes/{id}/preempt``), so the room is free on the edge when the create
  arrives. A pause an edge refuses is undone. The create then reserves as usual; if someone
  else took the freed room meanwhile it tries once more, then answers the 429.
- Resumes of preempted sandboxes (:meth:`Scheduler.resume`): the same decision on the sandbox's
  own edge (it cannot move), its room charged back before the edge takes its memory back.
- Tasks' scheduling fields (:meth:`Scheduler.set_task_txn`), events and status for the API.

Lock order as everywhere: a transaction here locks sandbox rows (by key), then the counters
their ledger moves (projects, tasks, edges, each in id order).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

from dsec.control.config import ControlConfig
from dsec.control.db import SANDBOXES, TASKS, Project, SandboxRow, SchedEventRow, Store, Task
from dsec.control.edges import EdgeClient, EdgeDirectory, HealthCache, load_views, record_health_txn
from dsec.control.errors import Conflict
from dsec.control.iam import Amount, Principal, subtree_ids, task_sched_fields, visible_project
from dsec.control.ledger import Ledger, amount_of, finish_many, move, room_of
from dsec.control.placement import Demand, EdgeView
from dsec.control.sched import (
    Ask,
    Decision,
    Placed,
    Policy,
    Preempting,
    Refused,
    SchedConfig,
    Standing,
    Victim,
    ask_for,
    burst_active,
    decide,
    is_burst,
    reserved,
    split_pools,
    utilisation,
)
from dsec.errors import Backpressure, DsecError, Forbidden, SandboxNotFound, SandboxPreempted
from dsec.spec import SandboxState
from dsec.spec.api import Quota
from dsec.spec.control import CreateTaskBody, PoolStatus, SchedEvent, SchedStatus, TaskDetail

log = logging.getLogger("dsec.control.scheduler")

S = SandboxState
VICTIM_SCAN = 256
"""Victims listed per examined edge (the simulator lists as many)."""
MINS_TRUSTED_S = 1.0
"""How long a replica trusts "no task has a minimum" before it looks again."""
PREEMPT_ROUNDS = 2
"""A create preempts at most this many times before it answers the 429."""

_SB, _TK = SANDBOXES, TASKS
_Q_VICTIMS = (
    sa.select(_SB.c.key, _SB.c.task_id, _SB.c.priority, _SB.c.cpu_m, _SB.c.memory, _SB.c.disk, _TK.c.preemption)
    .select_from(_SB.outerjoin(_TK, _TK.c.id == _SB.c.task_id))
    .where(
        _SB.c.edge_id == sa.bindparam("edge"), _SB.c.state.in_((S.RUNNING.value, S.PAUSED.value)),
        _SB.c.id.is_not(None), _SB.c.preempted_at.is_(None), _SB.c.priority < sa.bindparam("below"),
    )
    .order_by(_SB.c.priority, _SB.c.created_at.desc())
    .limit(VICTIM_SCAN)
)
_Q_MINS = sa.select(
    _TK.c.id, _TK.c.priority, _TK.c.preemption, _TK.c.burst, _TK.c.min_sandboxes, _TK.c.min_cpu_m,
    _TK.c.min_memory, _TK.c.active_sandboxes, _TK.c.active_cpu_m, _TK.c.active_memory,
).where(_TK.c.min_sandboxes.is_not(None))
_Q_ANY_MIN = sa.select(_TK.c.id).where(_TK.c.min_sandboxes.is_not(None)).limit(1)


def sched_config(config: ControlConfig) -> SchedConfig:
    sc, pc = config.scheduling, config.placement
    return SchedConfig(
        burst_threshold=sc.burst_threshold, burst_release_below=sc.burst_release_below, preemption=sc.preemption,
        victim_edges=sc.victim_edges, max_victims=sc.max_victims, k=pc.k, require_layers=pc.require_layers,
        default_priority=sc.default_priority, default_preemption=sc.default_preemption,
        burst_max_ttl_s=sc.burst_max_ttl_s,
    )


def policy_of(t: Any) -> Policy:
    """A task's policy from its row (ORM or Core: the same column names)."""
    mn = None
    if t.min_sandboxes is not None:
        mn = Amount(int(t.min_sandboxes), int(t.min_cpu_m or 0), int(t.min_memory or 0))
    return Policy(priority=int(t.priority), preemption=str(t.preemption), min=mn, burst=bool(t.burst))


def standing_of(t: Any) -> Standing:
    return Standing(policy_of(t), Amount(int(t.active_sandboxes), int(t.active_cpu_m), int(t.active_memory)))


@dataclass(frozen=True)
class NeedsRoom:
    """A reserve transaction's answer when the create fits only by preempting ``victims``."""

    victims: tuple[Victim, ...]
    by_priority: int
    edge_id: str


@dataclass(frozen=True)
class Eviction:
    sandbox_id: str
    key: str
    edge_id: str
    url: str
    action: str
    prev_state: str
    by_priority: int
    reason: str


@dataclass(frozen=True)
class Decided:
    decision: Decision
    ask: Ask
    held_back: Amount
    plain: bool
    """An ordinary placement on the primary pool, below the burst threshold, with no minimum held
    back: what an optimistic launch (planner.py) may guess by itself."""


class Scheduler:
    def __init__(self, config: ControlConfig, store: Store, edges: EdgeClient, directory: EdgeDirectory,
                 health: HealthCache) -> None:
        self.config = config
        self.cfg = sched_config(config)
        self.store = store
        self.edges = edges
        self.directory = directory
        self.health = health
        self._mins: tuple[float, bool] = (float("-inf"), True)
        self.preempted = 0
        """Sandboxes this replica preempted (paused or destroyed) since it started."""
        self.resumed = 0

    # ------------------------------------------------- in a reserve transaction ----

    def _any_min(self, s: Session) -> bool:
        at, any_min = self._mins
        now = time.monotonic()
        if now - at > MINS_TRUSTED_S:
            any_min = s.connection().execute(_Q_ANY_MIN).first() is not None
            self._mins = (now, any_min)
        return any_min

    def held_back_txn(self, s: Session) -> tuple[Amount, dict[Hashable, Standing]]:
        """The minimums still held back, and the standings of the tasks that have one."""
        if not self._any_min(s):
            return Amount(), {}
        standings: dict[Hashable, Standing] = {r.id: standing_of(r) for r in s.connection().execute(_Q_MINS)}
        return reserved(standings.values()), standings

    def victims_txn(self, s: Session, edge_id: str, below: int | None) -> list[Victim]:
        rows = s.connection().execute(_Q_VICTIMS, {"edge": edge_id, "below": 1001 if below is None else below})
        dflt = self.cfg.default_preemption
        return [Victim(r.key, r.task_id, int(r.priority), r.preemption or dflt, _room(r)) for r in rows]

    def decide_txn(
        self, s: Session, views: Sequence[EdgeView], demand: Demand, task: Any, want: Amount, rng: random.Random,
        *, exclude: frozenset[str] = frozenset(), only: EdgeView | None = None, preempt: bool = True,
        ttl_s: float | None = None,
    ) -> Decided:
        """``task``: the create's task row (with the scheduling columns) or None; ``ttl_s``: the
        sandbox's TTL (the burst pool takes only short ones)."""
        held, standings = self.held_back_txn(s)
        standing = None
        if task is not None:
            standing = standings.get(task.id) or standing_of(task)
        ask = ask_for(standing, task.id if task is not None else None, want, self.cfg, ttl_s)
        pools = split_pools(views)
        victims = partial(self.victims_txn, s) if preempt and self.cfg.preemption else None
        d = decide(demand, ask, pools, held_back=held, victims_on=victims, standings=standings, cfg=self.cfg,
                   rng=rng, exclude=exclude, only=only)
        plain = (isinstance(d, Placed) and not d.burst and held == Amount()
                 and not (pools.burst and burst_active(pools, self.cfg)))
        return Decided(d, ask, held, plain)

    def lease_room_txn(self, s: Session, views: Sequence[EdgeView], task: Any, want: Amount, n: int,
                       ttl_s: float | None = None) -> tuple[list[EdgeView], int]:
        """The edges a create lease may put its ``n`` slots on, and how many it may have: a lease never
        preempts; it uses the burst pool above the threshold (when the task may burst and a burst edge
        has room), the primary pool otherwise, and never the room held back for other tasks' minimums."""
        held, standings = self.held_back_txn(s)
        standing = None
        if task is not None:
            standing = standings.get(task.id) or standing_of(task)
        ask = ask_for(standing, task.id if task is not None else None, want * n, self.cfg, ttl_s)
        pools = split_pools(views)
        if ask.burst and pools.burst and burst_active(pools, self.cfg):
            roomy = [v for v in pools.burst if v.alive and not v.draining and v.free().memory > 0]
            if roomy:
                return roomy, n
        if not ask.guaranteed and held != Amount():
            cap, used = pools.capacity, pools.committed
            free = Amount(cap.sandboxes - used.sandboxes, cap.cpu_m - used.cpu_m, cap.memory - used.memory) - held
            fit = n
            for have, need in ((free.sandboxes, want.sandboxes), (free.cpu_m, want.cpu_m),
                               (free.memory, want.memory)):
                if need > 0:
                    fit = min(fit, max(0, have // need))
            n = fit
        return list(pools.primary), n

    def plan_holds(self, s: Session, views: Sequence[EdgeView], task: Any, want: Amount,
                   ttl_s: float | None = None) -> bool:
        """An optimistic launch's edge (planner.py: a primary edge chosen from a recent view) is what
        the scheduler would accept now: no minimum held back against this create, and the burst
        pool not in use for it."""
        held, standings = self.held_back_txn(s)
        standing = None
        if task is not None:
            standing = standings.get(task.id) or standing_of(task)
        ask = ask_for(standing, task.id if task is not None else None, want, self.cfg, ttl_s)
        if held != Amount() and not ask.guaranteed:
            return False
        if not ask.burst or not any(is_burst(v) for v in views):
            return True
        return not burst_active(split_pools(views), self.cfg)

    # ----------------------------------------------------------- preemption ----

    def preempt_txn(self, s: Session, victims: Sequence[Victim], *, by_priority: int, reason: str) -> list[Eviction]:
        """Move the victims still there (running or paused, not preempted yet) and record it."""

        keys = sorted(str(v.key) for v in victims)
        action = {str(v.key): ("destroy" if v.preemption == "destroy" else "pause") for v in victims}
        now = time.time()
        ledger = Ledger()
        out: list[Eviction] = []
        rows = s.execute(sa.select(SandboxRow).where(SandboxRow.key.in_(keys)).order_by(SandboxRow.key)
                         .with_for_update()).scalars().all()
        for row in rows:
            if row.id is None or row.preempted_at is not None or row.state not in (S.RUNNING.value, S.PAUSED.value):
                continue  # changed since the decision: this one is not taken
            act = action[row.key]
            info = {"at": now, "action": act, "by_priority": by_priority, "priority": row.priority, "reason": reason}
            prev = row.state
            if act == "pause":
                row.preempted_at = now  # first: the ledger charges the room a preempted sandbox keeps
                if row.state == S.RUNNING.value:
                    move(row, S.PAUSED, ledger)
                else:  # paused by its owner: same state, less held
                    ledger.charge(row, row.state, row.state, was_preempted=False)
                row.reason = f"preempted: paused for a priority-{by_priority} create"
            else:
                move(row, S.STOPPING, ledger, reason=f"preempted: destroyed for a priority-{by_priority} create")
            row.preemption = info
            row.updated_at = now
            s.add(SchedEventRow(at=now, project_id=row.project_id, task_name=row.task_name, sandbox_id=row.id,
                                kind="preempted", detail=info))
            out.append(Eviction(row.id, row.key, row.edge_id or "", row.edge_url, act, prev, by_priority, reason))
        ledger.flush(s)
        return out

    def _undo_txn(self, s: Session, ev: Eviction, why: str) -> None:
        """An edge refused the preemption pause: the sandbox is as it was (running, or paused by its owner)."""

        row = s.execute(sa.select(SandboxRow).where(SandboxRow.key == ev.key).with_for_update()).scalar_one_or_none()
        if row is None or row.preempted_at is None or row.state != S.PAUSED.value:
            return
        ledger = Ledger()
        if ev.prev_state == S.RUNNING.value:
            move(row, S.RUNNING, ledger)  # clears the mark, takes its cpu and memory back
        else:
            row.preempted_at = None
            ledger.charge(row, row.state, row.state, was_preempted=True)
        row.preemption = None
        row.reason = ""
        s.add(SchedEventRow(at=time.time(), project_id=row.project_id, task_name=row.task_name, sandbox_id=row.id,
                            kind="resumed", detail={"priority": row.priority, "reason": f"preemption undone: {why}"}))
        ledger.flush(s)

    async def preempt(self, victims: Sequence[Victim], *, by_priority: int, reason: str) -> int:
        """Carry out a preemption; returns how many victims it took (0: the create should decide again)."""
        evs = await self.store.write(partial(self.preempt_txn, victims=victims, by_priority=by_priority,
                                             reason=reason))
        done = await asyncio.gather(*(self._tell_edge(ev) for ev in evs))
        n = sum(done)
        self.preempted += n
        # the edges' reports still count the victims until their next heartbeat, and placement
        # trusts the larger of a report and its own books: ask them now, so the room shows at once
        touched = {ev.edge_id: ev.url for ev, ok in zip(evs, done, strict=True) if ok}
        await asyncio.gather(*(self._refresh(eid, url) for eid, url in touched.items()))
        return n

    async def _refresh(self, edge_id: str, stored: str) -> None:
        url = await self.directory.url(edge_id) or stored
        try:
            h = await self.edges.health(edge_id, url, timeout=self.config.poll_timeout_s)
            if h.edge_id == edge_id:
                await self.store.write(lambda s: record_health_txn(s, h))
        except Exception as exc:  # the next heartbeat brings it: the create may find less room meanwhile
            log.info("preemption: could not refresh edge %s's report: %s", edge_id, exc)

    async def _tell_edge(self, ev: Eviction) -> bool:
        url = await self.directory.url(ev.edge_id) or ev.url
        try:
            await self.edges.preempt(ev.edge_id, url, ev.sandbox_id, action=ev.action, by_priority=ev.by_priority,
                                     reason=ev.reason)
        except SandboxNotFound:
            return True  # gone meanwhile: its room is free (the reconcile records that it stopped)
        except DsecError as exc:
            if ev.action == "destroy":  # it is stopping in the store: the watcher deletes it again
                log.warning("preemption: destroying %s on edge %s failed (the watcher retries): %s",
                            ev.sandbox_id, ev.edge_id, exc)
                return False
            log.warning("preemption: edge %s refused to pause %s: %s", ev.edge_id, ev.sandbox_id, exc)
            await self.store.write(partial(self._undo_txn, ev=ev, why=exc.message))
            return False
        if ev.action == "destroy":

            await self.store.write(partial(finish_many, ids=[ev.sandbox_id]))
        return True

    # --------------------------------------------------------------- resume ----

    def _resume_txn(self, s: Session, who: Principal, sandbox_id: str, rng: random.Random,
                    ) -> tuple[str, str] | NeedsRoom | None:
        """Charge a preempted sandbox's room back if the scheduler finds it room on its edge:
        (edge id, url); NeedsRoom: only by preempting; None: it is not preempted (a plain resume)."""

        row = _visible(s, who, sandbox_id)
        if row.preempted_at is None:
            return None
        if row.state != S.PAUSED.value:
            raise SandboxPreempted(f"sandbox {sandbox_id} is {row.state}", sandbox_id=sandbox_id)
        task = s.get(Task, row.task_id, with_for_update=True) if row.task_id is not None else None
        views = [v for v, _ in load_views(s, self.health)]
        mine = next((v for v in views if v.id == row.edge_id), None)
        if mine is None or not mine.alive:
            raise Backpressure(f"sandbox {sandbox_id}'s edge {row.edge_id} is not available to resume it now",
                               retry_after=self.config.placement.retry_after_s, reason="preempted",
                               sandbox_id=sandbox_id)
        # the view already counts what the sandbox keeps there (its slot and disk): ask for the rest
        need = room_of(row)
        demand = Demand(need=type(need)(0, need.cpu_m, need.memory, 0))
        d = self.decide_txn(s, views, demand, task, amount_of(row), rng, only=mine).decision
        if isinstance(d, Refused):
            raise SandboxPreempted(
                f"sandbox {sandbox_id} was paused to make room for more urgent work and cannot resume yet: "
                f"{d.reason}; retry later", sandbox_id=sandbox_id, reason=d.reason,
                by_priority=(row.preemption or {}).get("by_priority"),
                retry_after=self.config.placement.retry_after_s)
        if isinstance(d, Preempting):
            pr = int(task.priority) if task is not None else self.cfg.default_priority
            return NeedsRoom(d.victims, pr, mine.id)
        ledger = Ledger()
        move(row, S.RUNNING, ledger)  # its cpu and memory are held again (the edge's resume follows)
        row.reason = ""
        s.add(SchedEventRow(at=time.time(), project_id=row.project_id, task_name=row.task_name, sandbox_id=row.id,
                            kind="resumed", detail={"priority": row.priority}))
        ledger.flush(s)
        return row.edge_id or "", row.edge_url

    def _repreempt_txn(self, s: Session, sandbox_id: str, info: dict[str, Any]) -> None:
        """The edge would not take the sandbox's memory back: it stays preempted."""

        row = s.execute(sa.select(SandboxRow).where(SandboxRow.id == sandbox_id).with_for_update()).scalar_one_or_none()
        if row is None or row.state != S.RUNNING.value:
            return
        ledger = Ledger()
        row.preempted_at = float(info.get("at") or time.time())
        move(row, S.PAUSED, ledger)
        row.preemption = info
        ledger.flush(s)

    async def resume(self, who: Principal, sandbox_id: str, rng: random.Random) -> bool:
        """Resume a sandbox paused by preemption; False if it is not one (the caller resumes it
        plainly). Raises SandboxPreempted (with ``retry_after``) when there is no room for it yet."""
        for _ in range(PREEMPT_ROUNDS + 1):
            got = await self.store.write(partial(self._resume_txn, who=who, sandbox_id=sandbox_id, rng=rng))
            if got is None:
                return False
            if isinstance(got, NeedsRoom):
                await self.preempt(got.victims, by_priority=got.by_priority, reason=f"resume of {sandbox_id}")
                continue
            edge_id, stored = got
            url = await self.directory.url(edge_id) or stored
            info = await self.store.read(lambda s: s.execute(
                sa.select(SandboxRow.preemption).where(SandboxRow.id == sandbox_id)).scalar())
            try:
                await self.edges.resume(edge_id, url, sandbox_id)
            except Backpressure as exc:
                await self.store.write(partial(self._repreempt_txn, sandbox_id=sandbox_id, info=dict(info or {})))
                raise SandboxPreempted(
                    f"sandbox {sandbox_id} cannot resume yet: its edge has no room ({exc.message})",
                    sandbox_id=sandbox_id, retry_after=exc.fields.get("retry_after", 1.0)) from None
            self.resumed += 1
            return True
        raise SandboxPreempted(f"sandbox {sandbox_id} cannot resume yet: its room keeps being taken; retry later",
                               sandbox_id=sandbox_id, retry_after=self.config.placement.retry_after_s)

    # ----------------------------------------------------------------- tasks ----

    def set_task_txn(self, s: Session, who: Principal, body: CreateTaskBody) -> TaskDetail:
        """``POST /v1/tasks``: the task (iam.create_task) and its scheduling fields."""
        from dsec.control import iam

        target = who
        proper_ancestor = who.is_root
        if body.project is not None and body.project != who.project:
            p = visible_project(s, who, body.project)
            target = Principal(project_id=p.id, project=p.name, token_id=who.token_id, is_root=False)
            proper_ancestor = True
        prio = body.priority_value()
        if ((prio is not None and prio > self.cfg.default_priority) or body.min is not None) and not proper_ancestor:
            raise Forbidden(
                "a task's priority above training and its minimum are set by a token of an ancestor project "
                f"(or the root's), as quotas are: ask one for project {target.project!r}", project=target.project)
        detail = iam.create_task(s, target, body.name, body.quota, stages=body.stages, stage=body.stage)
        t = iam.find_task(s, target, body.name, lock=True)
        if prio is not None:
            t.priority = prio
        if body.preemption is not None:
            t.preemption = body.preemption
        if body.burst is not None:
            t.burst = body.burst
        if body.min is not None:
            new = Amount.of_quota(body.min)
            if new == Amount():
                t.min_sandboxes = t.min_cpu_m = t.min_memory = None
            else:
                self._check_min(s, t, new, target.project)
                t.min_sandboxes, t.min_cpu_m, t.min_memory = new.sandboxes, new.cpu_m, new.memory
            self._mins = (float("-inf"), True)
        s.flush()
        return detail.model_copy(update=task_sched_fields(t))

    def _check_min(self, s: Session, t: Task, new: Amount, project: str) -> None:
        """A minimum fits in the task's max, in its project's quota, and — with every other task's
        minimum — in the primary pool's capacity (alive, undrained edges)."""
        over = [d for d, lim in (("sandboxes", t.quota_sandboxes), ("cpu", t.quota_cpu_m), ("memory", t.quota_memory))
                if lim is not None and new.get(d) > lim]
        if over:
            raise Conflict(f"task {t.name!r}: its min is above its max (quota) in {over[0]}", task=t.name,
                           resource=over[0])
        p = s.get(Project, t.project_id)
        if p is not None:
            q = Amount(p.quota_sandboxes, p.quota_cpu_m, p.quota_memory)
            if new.exceeds(q):
                raise Conflict(f"task {t.name!r}: its min is above project {project!r}'s quota in "
                               f"{new.exceeds(q)[0]}", task=t.name, resource=new.exceeds(q)[0])
        others = Amount()
        for r in s.execute(sa.select(Task).where(Task.min_sandboxes.is_not(None), Task.id != t.id)).scalars():
            others = others + Amount(int(r.min_sandboxes or 0), int(r.min_cpu_m or 0), int(r.min_memory or 0))
        pools = split_pools(v for v, _ in load_views(s, self.health))
        cap = Amount(pools.capacity.sandboxes, pools.capacity.cpu_m, pools.capacity.memory)
        short = (others + new).exceeds(cap)
        if short:
            d = short[0]
            raise Conflict(
                f"task {t.name!r}: the minimums would reserve more {d} than the primary pool has "
                f"({_shown(d, (others + new).get(d))} of {_shown(d, cap.get(d))}; others hold "
                f"{_shown(d, others.get(d))})", task=t.name, resource=d, capacity=_shown(d, cap.get(d)),
                reserved=_shown(d, others.get(d)), requested=_shown(d, new.get(d)))

    # ---------------------------------------------------------- what it did ----

    async def events(self, who: Principal, *, task: str | None = None, since: float | None = None,
                     limit: int = 100) -> list[SchedEvent]:
        def txn(s: Session) -> list[SchedEvent]:
            names = {p.id: p.name for p in s.execute(
                sa.select(Project).where(Project.id.in_(subtree_ids(s, who.project_id)))).scalars()}
            cond: Any = SchedEventRow.project_id.in_(list(names))
            if who.is_root:
                cond = sa.or_(cond, SchedEventRow.project_id.is_(None))
            q = sa.select(SchedEventRow).where(cond)
            if task is not None:
                q = q.where(SchedEventRow.task_name == task)
            if since is not None:
                q = q.where(SchedEventRow.at > since)
            rows = s.execute(q.order_by(SchedEventRow.id.desc()).limit(limit)).scalars().all()
            return [_event(r, names) for r in reversed(rows)]

        return await self.store.read(txn)

    async def status(self, who: Principal) -> SchedStatus:
        def txn(s: Session) -> SchedStatus:
            views = [v for v, _ in load_views(s, self.health)]
            pools = split_pools(views)
            held, _ = self.held_back_txn(s)
            live_burst = [v for v in pools.burst if v.alive and not v.draining]
            bc = _sum_rooms(v.capacity for v in live_burst)
            bu = _sum_rooms(v.committed for v in live_burst)
            n = s.execute(sa.select(sa.func.count()).select_from(SandboxRow).where(
                SandboxRow.project_id.in_(subtree_ids(s, who.project_id)), SandboxRow.preempted_at.is_not(None),
                SandboxRow.state == S.PAUSED.value)).scalar_one()
            return SchedStatus(
                utilisation=round(utilisation(pools.capacity, pools.committed), 4),
                burst_threshold=self.cfg.burst_threshold,
                burst_active=bool(live_burst) and burst_active(pools, self.cfg),
                primary=PoolStatus(edges=sum(1 for v in pools.primary if v.alive and not v.draining),
                                   capacity=_quota(pools.capacity), committed=_quota(pools.committed)),
                burst=PoolStatus(edges=len(live_burst), capacity=_quota(bc), committed=_quota(bu)),
                reserved=held.to_quota(), preempted=int(n), provider=self.config.scheduling.burst_provider,
            )

        return await self.store.read(txn)


def _room(r: Any) -> Any:
    from dsec.control.placement import Room

    return Room(1, int(r.cpu_m), int(r.memory), int(r.disk))


def _sum_rooms(rooms: Iterable[Any]) -> Any:
    from dsec.control.placement import Room

    total = Room()
    for r in rooms:
        total = total + r
    return total


def _quota(r: Any) -> Quota:
    return Quota(sandboxes=max(0, r.sandboxes), cpu=max(0, r.cpu_m) / 1000, memory=max(0, r.memory))


def _shown(dim: str, v: int) -> float | int:
    return v / 1000 if dim == "cpu" else v


def _visible(s: Session, who: Principal, sandbox_id: str) -> SandboxRow:
    from dsec.control.iam import ancestors

    row = s.execute(sa.select(SandboxRow).where(SandboxRow.id == sandbox_id).with_for_update()).scalar_one_or_none()
    if row is None or (row.project_id != who.project_id and who.project_id not in ancestors(s, row.project_id)):
        raise SandboxNotFound(f"no sandbox {sandbox_id!r} in project {who.project!r}", sandbox_id=sandbox_id)
    return row


def _event(r: SchedEventRow, names: dict[int, str]) -> SchedEvent:
    d = dict(r.detail or {})
    return SchedEvent(
        id=r.id, at=r.at, kind=r.kind,  # type: ignore[arg-type]
        project=names.get(r.project_id) if r.project_id is not None else None,
        task=r.task_name, sandbox_id=r.sandbox_id, action=d.pop("action", None), priority=d.pop("priority", None),
        by_priority=d.pop("by_priority", None), reason=str(d.pop("reason", "") or ""), detail=d,
    )

