"""Sandboxes: create (one, or a batch with per-item results), get, list, delete.

A create is three short store transactions around the edge call, never one
long one:

1. *reserve*: answer a repeated ``request_id`` from its row (or wait while the
   first call is still in flight); check the project's and the task's quota;
   choose an edge (placement.py); insert the row in state ``creating`` and
   charge the project, the task and the edge in the same transaction.
2. call the edge. It refuses (429) or cannot be reached: move the reservation
   to the next candidate (another transaction) and try again, up to
   ``placement.max_attempts`` edges; nothing left: release and answer 429.
3. *commit*: record the id the edge chose and its answer.

Counters follow the sandbox state through one table (:data:`HOLDS_QUOTA`,
:data:`HOLDS_EDGE`) and the shared transition table of ``dsec.spec``: a
:class:`Ledger` sums the deltas of a transaction and writes them once.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import logging
import random
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy.orm import Session

from dsec.control.config import ControlConfig
from dsec.control.db import PROJECTS, SANDBOXES, TASKS, Project, SandboxRow, Store, Task
from dsec.control.edges import (
    EdgeClient,
    EdgeDirectory,
    EdgeUnreachable,
    HealthCache,
    bump_edge,
    edge_of,
    load_views,
)
from dsec.control.iam import (
    Amount,
    Principal,
    ancestors,
    bump_project,
    bump_task,
    check_fits,
    check_name,
    check_task_fits,
    get_or_create_task,
    subtree_ids,
    task_limit,
)
from dsec.control.ledger import (
    LIVE,
    Ledger,
    S,
    finish_many,
    forget,
    move,
)
from dsec.control.locking import lock_one
from dsec.control.placement import (
    Demand,
    EdgeView,
    Room,
    never_fits,
    normalize_ref,
    why_nothing_fits,
)
from dsec.control.planner import LaunchPlanner, Plan, Seen
from dsec.control.sched import Placed, Preempting, is_burst
from dsec.control.scheduler import PREEMPT_ROUNDS, NeedsRoom, Scheduler
from dsec.control.stats import CreateStats
from dsec.errors import (
    Backpressure,
    DsecError,
    ExceedsCapacity,
    InvalidSpec,
    LayerNotFound,
    QuotaExceeded,
    SandboxFailed,
    SandboxNotFound,
    Unavailable,
    Unsupported,
)
from dsec.http import auth
from dsec.spec import SandboxState
from dsec.spec.api import (
    BatchItem,
    BatchResult,
    CreateBatch,
    CreateSandbox,
    FnCallLease,
    PreemptionInfo,
    SandboxInfo,
    TaskQuota,
)

log = logging.getLogger("dsec.control.sandboxes")
T = TypeVar("T")

USABLE = frozenset({S.CREATING.value, S.RUNNING.value, S.PAUSED.value})
"""States whose answers carry a data-path token."""
PERMANENT_EDGE_ERRORS = frozenset({"invalid_spec"})
"""Edge answers that another edge would give too: fail the create instead of moving on."""


_SB, _PJ, _TK = SANDBOXES, PROJECTS, TASKS
_Q_PROJECT = (
    sa.select(
        _PJ.c.name, _PJ.c.quota_sandboxes, _PJ.c.quota_cpu_m, _PJ.c.quota_memory, _PJ.c.used_sandboxes,
        _PJ.c.used_cpu_m, _PJ.c.used_memory, _PJ.c.reserved_sandboxes, _PJ.c.reserved_cpu_m, _PJ.c.reserved_memory,
    )
    .where(_PJ.c.id == sa.bindparam("pid"))
    .with_for_update()
)
_Q_PREV = sa.select(_SB.c.key).where(_SB.c.project_id == sa.bindparam("pid"), _SB.c.request_id == sa.bindparam("rid"))
_Q_TASK = (
    sa.select(
        _TK.c.id, _TK.c.quota_sandboxes, _TK.c.quota_cpu_m, _TK.c.quota_memory, _TK.c.used_sandboxes,
        _TK.c.used_cpu_m, _TK.c.used_memory, _TK.c.stages,
        _TK.c.priority, _TK.c.preemption, _TK.c.burst, _TK.c.min_sandboxes, _TK.c.min_cpu_m, _TK.c.min_memory,
        _TK.c.active_sandboxes, _TK.c.active_cpu_m, _TK.c.active_memory,  # scheduling (scheduler.py)
    )
    .where(_TK.c.project_id == sa.bindparam("pid"), _TK.c.name == sa.bindparam("name"))
    .with_for_update()
)
_INSERT = sa.insert(_SB)
_COMMIT = (
    sa.update(_SB)
    .where(_SB.c.key == sa.bindparam("k"), _SB.c.state == S.CREATING.value)
    .values(
        id=sa.bindparam("c_id"), edge_url=sa.bindparam("c_url"), created_at=sa.bindparam("c_created"),
        expires_at=sa.bindparam("c_expires"), reason=sa.bindparam("c_reason"), state=sa.bindparam("c_state"),
        updated_at=sa.bindparam("c_now"),
    )
)


def _task_stages_doc(task_stages: Any) -> dict[str, Any]:
    if not task_stages:
        return {}
    doc = task_stages if isinstance(task_stages, dict) else json.loads(task_stages)
    return doc if doc.get("stages") else {}


def inherited_stages(task_stages: Any, req: CreateSandbox) -> dict[str, Any] | None:
    """A sandbox of a task with stages, whose spec declares none, gets the task's (and starts
    in the task's current stage)."""
    if req.spec.stages:
        return None
    doc = _task_stages_doc(task_stages)
    if not doc:
        return None
    stages = doc["stages"]
    return {"stages": stages, "stage": doc.get("stage") or next(iter(stages))}


def r_stages(row: SandboxRow) -> dict[str, Any] | None:
    """The stages recorded in a reservation's spec (inherited or not: the edge gets the same)."""
    spec = row.spec or {}
    if not spec.get("stages"):
        return None
    return {"stages": spec["stages"], "stage": spec.get("stage")}


def request_hash(req: CreateSandbox, dumped: dict[str, Any] | None = None) -> str:
    body = dict(dumped) if dumped is not None else req.model_dump(mode="json")
    body.pop("request_id", None)
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


# ---------------------------------------------------------------- results ----


def too_big(need: Room, edge: EdgeView) -> ExceedsCapacity:
    """The typed refusal of a demand that no edge holds even empty (:func:`never_fits`)."""

    def figures(r: Room) -> dict[str, float]:
        return {"cpu": r.cpu_m / 1000, "memory": r.memory, "disk": r.disk, "sandboxes": r.sandboxes}

    return ExceedsCapacity.of(figures(need), figures(edge.capacity), edge_id=edge.id, cluster=True)


@dataclass(frozen=True)
class Reserved:
    key: str
    edge_id: str
    edge_url: str
    labels: dict[str, str] = field(default_factory=dict)
    task: str | None = None
    created_at: float = 0.0
    expires_at: float | None = None
    stages: dict[str, Any] | None = None
    """The task's stages (and starting stage) the sandbox inherits: its spec declares none."""
    seen: Seen | None = None
    """What the reserve transaction saw (for optimistic launches, planner.py)."""


@dataclass(frozen=True)
class Answered:
    info: SandboxInfo


@dataclass(frozen=True)
class InFlight:
    key: str


class Sandboxes:
    """The sandbox operations of one replica (all state is in the store)."""

    def __init__(self, config: ControlConfig, store: Store, key: bytes, edges: EdgeClient, directory: EdgeDirectory) -> None:
        self.config = config
        self.store = store
        self.key = key
        self.edges = edges
        self.directory = directory
        self.rng = random.Random()
        self.health = HealthCache()
        self.planner = LaunchPlanner(
            k=config.placement.k, require_layers=config.placement.require_layers, rng=self.rng
        )
        self.scheduler = Scheduler(config, store, edges, directory, self.health)
        """Priorities, preemption, elastic minimums, the burst pool (scheduler.py, sched.py)."""
        self._confirming: dict[str, asyncio.Future[SandboxInfo | None]] = {}
        """Creates answered but not yet recorded (id -> the commit): lookups by id wait for them."""
        self._background: set[asyncio.Task[Any]] = set()
        self._unsettled: dict[str, tuple[asyncio.Task[SandboxInfo] | None, Plan | None]] = {}
        """Reservations whose fate this replica lost track of (key -> the optimistic edge call
        made for it, if any): settled once the store answers again (:meth:`_settle_unsettled`)."""
        self._settling: asyncio.Task[None] | None = None
        self.on_quota: Callable[[Principal], Awaitable[bool]] | None = None
        """Asked when a create is refused for quota: hands back the project's leases held ahead
        of creates (control/leases.py); True if it did (the create is tried once more)."""
        self.on_miss: Callable[[Principal, str], Awaitable[bool]] | None = None
        """Asked when a lookup by id finds nothing: records a sandbox made under a create lease
        that its edge has not reported yet (control/leases.py); True if it did."""
        self.launcher: str | None = None
        """This replica's id, recorded on each reservation (the watcher finishes the creates of a
        replica that died: control/replicas.py)."""
        self.stats = CreateStats()
        """This replica's create outcomes (the dashboard's live figures, /metrics)."""

    # -------------------------------------------------------------- info ----

    def info(self, row: SandboxRow, project: str, *, token: bool, url: str | None = None) -> SandboxInfo:
        tok: str | None = None
        exp: float | None = None
        if token and row.id and row.state in USABLE:
            tok, exp = auth.mint(self.key, sandbox_id=row.id, project=project, ttl_s=self.config.sandbox_token_ttl_s)
        return SandboxInfo(
            id=row.id or "",
            state=SandboxState(row.state),
            edge_id=row.edge_id or "",
            edge_url=url or row.edge_url,
            token=tok,
            token_expires_at=exp,
            labels=dict(row.labels or {}),
            task=row.task_name,
            project=project,
            created_at=row.created_at,
            expires_at=row.expires_at,
            reason=row.reason,
            preemption=PreemptionInfo.model_validate(row.preemption) if row.preemption else None,
        )

    async def fresh_url(self, row_id: str, stored: str) -> str:
        """The edge's current address (edges may move between restarts), routed by the id's prefix."""
        return await self.directory.url(edge_of(row_id)) or stored

    # ------------------------------------------------------------ create ----

    def _demand(self, req: CreateSandbox) -> Demand:
        r = req.spec.resources
        return Demand(
            need=Room(1, Amount.of_resources(r).cpu_m, r.memory, r.disk),
            layers=tuple(req.spec.image.layers_top_first()),
            selector=dict(req.edge_selector),
            backend=req.spec.backend,
        )

    async def fncall_lease(self, who: Principal, image: Any = None) -> FnCallLease:
        """An edge running the fncall backend (preferring one that holds the image's layers,
        then the least loaded of two at random) and a fncall-scoped token for it."""
        loaded = await self.store.read(lambda s: load_views(s, self.health))
        cands = [(v, url) for v, url in loaded if v.alive and not v.draining and "fncall" in v.backends]
        if not cands:
            live = [v for v, _ in loaded if v.alive]
            runs = sorted({b for v in live for b in v.backends}) or ["none"]
            raise Unsupported(
                f"no live edge runs the fncall backend (the cluster's edges run: {', '.join(runs)}); add "
                "{\"kind\": \"fncall\"} to an edge's backends (docs/FNCALL.md)", operation="fncall", backend="fncall")
        refs: tuple[str, ...] = ()
        if isinstance(image, str):
            refs = (image,)
        elif image is not None and hasattr(image, "layers_top_first"):
            refs = tuple(image.layers_top_first())
        if refs:
            local = [(v, u) for v, u in cands if all(normalize_ref(r) in v.layers for r in refs)]
            cands = local or cands
        picks = self.rng.sample(cands, min(2, len(cands)))
        view, url = min(picks, key=lambda c: c[0].committed.sandboxes / max(1, c[0].capacity.sandboxes))
        ttl = self.config.sandbox_token_ttl_s
        tok, exp = auth.mint(self.key, sandbox_id=f"fncall:{who.project}", project=who.project, ttl_s=ttl,
                             scope="fncall")
        return FnCallLease(edge_id=view.id, edge_url=url, token=tok, expires_at=exp)

    @staticmethod
    def unknown_layer(views: Sequence[EdgeView], demand: Demand) -> LayerNotFound | None:
        """No live edge holds a layer of the image (and edges do report layers), nor can fetch it
        from a registry: 404 with a hint. With a registry the edge looks the name up itself."""
        if any(v.alive and v.fetches for v in views):
            return None
        known = {ref for v in views if v.alive for ref in v.layers}
        missing = [r for r in demand.layers if normalize_ref(r) not in known]
        if not known or not missing:
            return None
        return LayerNotFound(
            f"no live edge holds layer {missing[0]!r}: build or import it first "
            f"(`dsec image build`; GET /v1/images lists the layers the edges hold)",
            ref=missing[0],
            layers=missing,
        )

    def nothing_fits(self, views: Sequence[EdgeView], demand: Demand, tried: frozenset[str],
                      reason: str | None = None) -> DsecError:
        live = [v for v in views if v.alive]
        if live and not any(demand.backend in v.backends for v in live):
            runs = sorted({b for v in live for b in v.backends})
            return Unsupported(
                f"no edge runs the {demand.backend} backend (the cluster's edges run: {', '.join(runs)}); "
                "pick one of those in SandboxSpec.backend, or add the backend to an edge's configuration",
                operation="create", backend=demand.backend,
            )
        largest = never_fits(views, demand)
        if largest is not None:  # too big for every edge, even empty: waiting does not help
            return too_big(demand.need, largest)
        if reason is None or reason == "no edge has room":
            reason = why_nothing_fits(views, demand) if not tried else f"edges {sorted(tried)} refused or failed"
        retry = self.config.placement.retry_after_s
        return Backpressure(
            f"no edge can take this sandbox now ({reason}); retry after {retry:g}s",
            retry_after=retry,
            reason=reason,
        )

    def _reserve_txn(
        self, s: Session, who: Principal, req: CreateSandbox, rhash: str, demand: Demand,
        dumped: dict[str, Any] | None = None, plan: Plan | None = None, key: str | None = None,
        preempt: bool = True,
    ) -> Reserved | Answered | InFlight | NeedsRoom:
        """Check quotas, choose an edge and charge everything, in one transaction (the hot path).

        Built from Core statements prepared once: this runs for every sandbox
        of every burst. Lock order everywhere: projects, tasks, edges. Every
        refusal is raised before the first write (``checks_first``); only a
        task made on first use may precede one, and it may stay.

        ``plan``: the create's edge call already started there (planner.py): the row records
        that edge instead of choosing one, under the plan's key. ``key``: the row's key otherwise
        (the caller knows it, so a reservation whose commit went unanswered can be found).
        """
        conn = s.connection()
        now = time.time()
        p = conn.execute(_Q_PROJECT, {"pid": who.project_id}).first()  # locked first: serializes
        if p is None:  # the keys of one project, so a request_id is never reserved twice
            raise SandboxFailed(f"project {who.project!r} no longer exists", reason="project deleted")
        if req.request_id is not None:
            prev = conn.execute(_Q_PREV, {"pid": who.project_id, "rid": req.request_id}).first()
            if prev is not None:
                replayed = self._replay(s, prev.key, rhash, who)
                if replayed is not None:
                    return replayed
        t = None
        if req.task:
            t = conn.execute(_Q_TASK, {"pid": who.project_id, "name": req.task}).first()
            if t is None:
                get_or_create_task(s, who.project_id, req.task, lock=True)
                t = conn.execute(_Q_TASK, {"pid": who.project_id, "name": req.task}).one()
        want = Amount(1, demand.need.cpu_m, demand.need.memory)
        quota = Amount(p.quota_sandboxes, p.quota_cpu_m, p.quota_memory)
        used = Amount(p.used_sandboxes, p.used_cpu_m, p.used_memory)
        reserved = Amount(p.reserved_sandboxes, p.reserved_cpu_m, p.reserved_memory)
        check_fits(project=p.name, quota=quota, used=used, reserved=reserved, want=want)
        task_free: dict[str, int | None] | None = None
        if t is not None:
            tq = TaskQuota(
                sandboxes=t.quota_sandboxes, memory=t.quota_memory,
                cpu=None if t.quota_cpu_m is None else t.quota_cpu_m / 1000,
            )
            t_used = Amount(t.used_sandboxes, t.used_cpu_m, t.used_memory)
            check_task_fits(task=str(req.task), project=p.name, quota=tq, used=t_used, want=want)
            task_free = {d: None if v is None else v - t_used.get(d) - want.get(d) for d, v in task_limit(tq).items()}
        plain = True
        loaded = load_views(s, self.health) if plan is not None else []
        if plan is not None and not self.scheduler.plan_holds(s, [v for v, _ in loaded], t, want, req.lifecycle.ttl_s):
            plan = None  # the burst pool or a task's minimum is in play: the scheduler decides (and the
            key = key or uuid.uuid4().hex  # caller, seeing another edge or none, drops the optimistic sandbox)
        if plan is None:
            loaded = loaded or load_views(s, self.health)
            views = [v for v, _ in loaded]
            urls = {v.id: url for v, url in loaded}
            unknown = self.unknown_layer(views, demand)
            if unknown is not None:
                raise unknown
            got = self.scheduler.decide_txn(s, views, demand, t, want, self.rng, preempt=preempt,
                                            ttl_s=req.lifecycle.ttl_s)
            d, plain = got.decision, got.plain
            if isinstance(d, Preempting):  # nothing written: the victims go first (_create)
                return NeedsRoom(d.victims, got.ask.priority, d.edge.id)
            if not isinstance(d, Placed):
                raise self.nothing_fits(views, demand, frozenset(), reason=d.reason)
            chosen = d.edge
            key = key or uuid.uuid4().hex
        else:  # the edge call is under way: record it there (the edge has the final say on room)
            # at the edge's address now: an edge that moved makes the caller drop the plan
            urls = {v.id: u for v, u in loaded if v.id == plan.edge.id} or {plan.edge.id: plan.url}
            chosen, key = plan.edge, plan.key
        labels = {**req.spec.labels, **req.labels}
        expires = now + req.lifecycle.ttl_s
        spec = dict(dumped["spec"]) if dumped is not None else req.spec.model_dump(mode="json")
        inherit = inherited_stages(t.stages if t is not None else None, req)
        if inherit is not None:
            spec.update(inherit)
        conn.execute(_INSERT, {
            "key": key, "id": None, "edge_id": chosen.id, "edge_url": urls[chosen.id],
            "project_id": who.project_id, "task_id": t.id if t is not None else None, "task_name": req.task,
            "labels": labels, "state": S.CREATING.value, "spec": spec,
            "lifecycle": dumped["lifecycle"] if dumped is not None else req.lifecycle.model_dump(mode="json"),
            "cpu_m": demand.need.cpu_m,
            "memory": demand.need.memory, "disk": demand.need.disk, "created_at": now, "updated_at": now,
            "expires_at": expires, "request_id": req.request_id, "request_hash": rhash, "reason": "",
            "launcher": self.launcher,
            "priority": int(t.priority) if t is not None else self.scheduler.cfg.default_priority,
        })
        bump_project(s, who.project_id, want)
        if t is not None:
            bump_task(s, t.id, want)
        bump_edge(s, chosen.id, demand.need)
        seen = Seen(
            project_id=who.project_id, project_free=quota - used - reserved - want, task=req.task,
            task_free=task_free, task_has_stages=bool(t is not None and _task_stages_doc(t.stages)),
            # as the next transaction will see them: with this create's room on its edge
            views=tuple((dataclasses.replace(v, committed=v.committed + demand.need) if v.id == chosen.id else v, u)
                        for v, u in loaded if not is_burst(v)),
            plain=plain,
        )
        return Reserved(
            key=key, edge_id=chosen.id, edge_url=urls[chosen.id], labels=labels, task=req.task,
            created_at=now, expires_at=expires, stages=inherit, seen=seen,
        )

    def _replay(self, s: Session, key: str, rhash: str, who: Principal) -> Answered | InFlight | None:
        """The answer to a repeated request_id; None: its row went away since the lookup (a
        reservation dropped, a stopped sandbox past retention), so the request_id is free again.
        Read, not locked: nothing here writes it, and locking it after the project would invert
        the lock order of a delete (sandbox, then its project's counters)."""
        prev = s.get(SandboxRow, key)
        if prev is None:
            return None
        if prev.request_hash and prev.request_hash != rhash:
            raise InvalidSpec(
                f"request_id {prev.request_id!r} was used before with a different body", field="request_id"
            )
        if prev.id is None:
            if prev.state == S.CREATING.value:
                return InFlight(key=prev.key)
            # deleted while it was being created: the first answer was (or will be) a failure
            raise SandboxFailed(
                f"the create with request_id {prev.request_id!r} was cancelled", reason=prev.reason or "cancelled"
            )
        return Answered(self.info(prev, who.project, token=True))

    def _move_txn(self, s: Session, key: str, tried: frozenset[str], demand: Demand) -> Reserved | DsecError:
        """Move a reservation to the next candidate, or release it (nothing left)."""
        row = s.get(SandboxRow, key, with_for_update=True)
        if row is None or row.state != S.CREATING.value:
            return SandboxFailed("the sandbox was deleted while it was being created", reason="deleted")
        loaded = load_views(s, self.health)
        views = [v for v, _ in loaded]
        urls = {v.id: url for v, url in loaded}
        task = s.get(Task, row.task_id) if row.task_id is not None else None
        # the reservation is counted already: the task's standing and the pool include it
        ttl = float((row.lifecycle or {}).get("ttl_s") or 0) or None
        d = self.scheduler.decide_txn(s, views, demand, task, Amount(), self.rng, exclude=tried, preempt=False,
                                      ttl_s=ttl).decision
        chosen = d.edge if isinstance(d, Placed) else None
        ledger = Ledger()
        if chosen is None:
            forget(s, row, ledger)
            ledger.flush(s)
            return self.nothing_fits(views, demand, tried)
        old_edge = row.edge_id
        row.edge_id, row.edge_url = chosen.id, urls[chosen.id]
        ledger.charge(row, row.state, row.state, old_edge=old_edge)
        ledger.flush(s)
        return Reserved(
            key=row.key, edge_id=chosen.id, edge_url=row.edge_url, labels=dict(row.labels or {}),
            task=row.task_name, created_at=row.created_at, expires_at=row.expires_at, stages=r_stages(row),
        )

    def _release_txn(self, s: Session, key: str) -> None:
        row = s.get(SandboxRow, key, with_for_update=True)
        if row is not None and row.id is None:
            ledger = Ledger()
            forget(s, row, ledger)
            ledger.flush(s)

    def _commit_fast_txn(self, s: Session, r: Reserved, got: SandboxInfo, who: Principal) -> SandboxInfo | None:
        """creating -> running (or still creating): no counter moves, so one UPDATE does it."""
        if got.state not in (S.RUNNING, S.CREATING):
            return self._commit_txn(s, r.key, got, who)
        created = got.created_at or r.created_at
        expires = got.expires_at if got.expires_at is not None else r.expires_at
        url = got.edge_url or r.edge_url
        res = s.connection().execute(_COMMIT, {
            "k": r.key, "c_id": got.id, "c_url": url, "c_created": created, "c_expires": expires,
            "c_reason": got.reason, "c_state": got.state.value, "c_now": time.time(),
        })
        if res.rowcount != 1:  # deleted while we were creating it: the careful path
            return self._commit_txn(s, r.key, got, who)
        tok, exp = auth.mint(self.key, sandbox_id=got.id, project=who.project, ttl_s=self.config.sandbox_token_ttl_s)
        return SandboxInfo(
            id=got.id, state=got.state, edge_id=r.edge_id, edge_url=url, token=tok, token_expires_at=exp,
            labels=dict(r.labels), task=r.task, project=who.project, created_at=created, expires_at=expires,
            reason=got.reason, from_pool=got.from_pool, image=got.image, resources=got.resources,
            stage=got.stage, network=got.network, stages=list(got.stages),
        )

    def _commit_txn(self, s: Session, key: str, got: SandboxInfo, who: Principal) -> SandboxInfo | None:
        row = s.get(SandboxRow, key, with_for_update=True)
        if row is None:
            return None
        if row.id == got.id and (row.state in USABLE or row.state == got.state.value == S.FAILED.value):
            # the watcher's reconcile recorded it first (it listed the edge before this record):
            # the same sandbox, in the state the edge gave both (failed ones too)
            return self.info(row, who.project, token=True)
        if row.state != S.CREATING.value:  # deleted meanwhile: keep the id so the stop can finish
            row.id = got.id
            return None
        row.id = got.id
        row.edge_url = got.edge_url or row.edge_url
        row.created_at = got.created_at or row.created_at
        row.expires_at = got.expires_at if got.expires_at is not None else row.expires_at
        row.reason = got.reason
        ledger = Ledger()
        if got.state in (S.RUNNING, S.FAILED):
            move(row, got.state, ledger)
        ledger.flush(s)
        s.flush()
        return self.info(row, who.project, token=True)

    async def create(self, who: Principal, req: CreateSandbox) -> SandboxInfo:
        try:
            return await self._create_once(who, req)
        except QuotaExceeded:
            # quota held by leases ahead of creates (control/leases.py) yields to a create
            if self.on_quota is None or not await self.on_quota(who):
                raise
        return await self._create_once(who, req)

    async def _create_once(self, who: Principal, req: CreateSandbox) -> SandboxInfo:
        t0 = time.perf_counter()
        try:
            info = await self._create(who, req)
        except DsecError as exc:
            self.stats.failed(exc.code, exc.message, project=who.project, status=exc.http_status,
                              seconds=time.perf_counter() - t0)
            raise
        except Exception as exc:
            self.stats.failed("internal", type(exc).__name__, project=who.project, status=500,
                              seconds=time.perf_counter() - t0)
            raise
        self.stats.ok(time.perf_counter() - t0)
        return info

    async def _create(self, who: Principal, req: CreateSandbox) -> SandboxInfo:
        if req.task is not None:
            check_name(req.task, "task")
        demand = self._demand(req)
        dumped = req.model_dump(mode="json")  # once: the hash, the row and the edge's body share it
        rhash = request_hash(req, dumped)
        deadline = time.monotonic() + self._create_budget()
        key = uuid.uuid4().hex
        plan = self.planner.plan(who.project_id, req.task, bool(req.spec.stages), demand, key, req.request_id)
        first: asyncio.Task[SandboxInfo] | None = None
        if plan is not None:
            first = asyncio.ensure_future(self.edges.create(plan.edge.id, plan.url, self._edge_body(who, key, dumped, None)))
        preempted = 0
        while True:
            # a fresh key per try: a plan dropped below may still have its sandbox under plan.key
            rkey = plan.key if plan is not None else uuid.uuid4().hex
            try:
                r = await self.store.write_grouped(
                    partial(self._reserve_txn, who=who, req=req, rhash=rhash, demand=demand, dumped=dumped, plan=plan,
                            key=rkey, preempt=preempted < PREEMPT_ROUNDS),
                    checks_first=True,
                )
            except BaseException as exc:
                self.planner.refused(who.project_id, plan.key if plan is not None else None)
                if isinstance(exc, Unavailable):
                    # The store went away while the reservation was being written: its commit
                    # may have happened, and then nobody would launch it and its request_id
                    # would answer "in flight" until housekeeping dropped it. Settled once the
                    # store answers (the optimistic sandbox goes with it).
                    self._settle_later(rkey, first, plan)
                elif plan is not None:
                    self._spawn(self._discard(first, plan))
                raise
            if plan is not None and (
                not isinstance(r, Reserved) or r.stages is not None or r.edge_url != plan.url
            ):
                # The transaction disagrees with the plan (a replayed request_id, stages to
                # inherit, the edge moved): drop the optimistic sandbox. A reservation made stays and is launched
                # with care, under the same key, so the edge must have forgotten it first.
                self.planner.done(plan.key)
                if isinstance(r, Reserved):
                    await self._discard(first, plan)
                else:
                    self._spawn(self._discard(first, plan))
                plan = first = None
            if isinstance(r, Reserved):
                break
            if isinstance(r, Answered):
                return r.info
            if isinstance(r, NeedsRoom):  # preempt less urgent sandboxes, then reserve again
                preempted += 1
                taken = await self.scheduler.preempt(r.victims, by_priority=r.by_priority,
                                                     reason=f"a create in project {who.project}"
                                                            + (f", task {req.task}" if req.task else ""))
                if not taken:
                    preempted += 1  # nothing could be taken: one more look, then the 429
                continue
            await self._wait_in_flight(who, req, deadline)
        assert r.seen is not None
        self.planner.seen(r.seen, key=r.key)
        return await self._launch(who, req, r, demand, dumped, first=first)

    def _edge_body(self, who: Principal, key: str, dumped: dict[str, Any], stages: dict[str, Any] | None) -> dict[str, Any]:
        body = dict(dumped)
        body.pop("edge_selector", None)
        body["spec"] = dict(body["spec"])
        body["request_id"] = key  # idempotent on the edge too: a retried call makes no second sandbox
        body["project"] = who.project
        if stages is not None:
            body["spec"].update(stages)
        return body

    async def _discard(self, first: asyncio.Task[SandboxInfo] | None, plan: Plan) -> None:
        """An optimistic edge call whose create must not stand: delete what it made."""
        if first is None:
            return
        self.planner.discarded += 1
        try:
            got = await first
        except Exception:
            return  # refused or failed: nothing was made (or the watcher reaps it as an orphan)
        await self.edge_delete_quietly(plan.edge.id, plan.url, got.id)

    def _create_budget(self) -> float:
        return self.config.edge_timeout_s * self.config.placement.max_attempts + 5.0

    async def _wait_in_flight(self, who: Principal, req: CreateSandbox, deadline: float) -> None:
        """Another call with this request_id is creating it: wait until it is answered (or gone)."""
        delay = 0.01
        while time.monotonic() < deadline:
            await asyncio.sleep(delay)
            delay = min(delay * 1.5, 0.2)
            state = await self.store.read(
                lambda s: s.execute(
                    sa.select(SandboxRow.state, SandboxRow.id).where(
                        SandboxRow.project_id == who.project_id, SandboxRow.request_id == req.request_id
                    )
                ).first()
            )
            if state is None or state[0] != S.CREATING.value or state[1] is not None:
                return
        raise Backpressure(
            f"a create with request_id {req.request_id!r} is still in flight; retry to get its answer",
            retry_after=1.0,
            reason="in_flight",
        )

    async def _launch(
        self, who: Principal, req: CreateSandbox, r: Reserved, demand: Demand, dumped: dict[str, Any] | None = None,
        *, first: asyncio.Task[SandboxInfo] | None = None,
    ) -> SandboxInfo:
        """Call edges until one makes the sandbox. ``first``: the call to ``r``'s edge is already
        under way (an optimistic launch): its answer is the first attempt's."""
        tried: set[str] = set()
        transient = False  # some edge refused or did not answer: a later retry may succeed
        last: DsecError | None = None
        body: dict[str, Any] | None = None  # made when first needed: an optimistic launch sent its own
        attempts = self.config.placement.max_attempts
        done = False
        try:
            while True:
                try:
                    if first is not None:
                        call, first = first, None
                        got = await call
                    else:
                        if body is None:
                            doc = dumped if dumped is not None else req.model_dump(mode="json")
                            body = self._edge_body(who, r.key, doc, r.stages)
                        got = await self.edges.create(r.edge_id, r.edge_url, body)
                except Backpressure as exc:
                    log.info("edge %s refused %s: %s", r.edge_id, r.key, exc.fields.get("reason", exc))
                    transient, last = True, exc
                except EdgeUnreachable as exc:
                    log.warning("edge %s: %s", r.edge_id, exc)
                    transient, last = True, exc
                except DsecError as exc:
                    if exc.code in PERMANENT_EDGE_ERRORS:
                        raise
                    log.warning("edge %s failed %s: %s; trying another edge", r.edge_id, r.key, exc)
                    last = exc
                else:
                    done = True
                    return await self._commit(who, r, got)
                tried.add(r.edge_id)
                nxt: Reserved | DsecError | None = None
                if len(tried) < attempts:
                    nxt = await self.store.write_grouped(
                        partial(self._move_txn, key=r.key, tried=frozenset(tried), demand=demand)
                    )
                    if isinstance(nxt, Reserved):
                        r = nxt
                        continue
                    done = True  # _move_txn released the reservation
                if not transient and last is not None:
                    raise last  # every edge gave the same kind of answer (e.g. layer_not_found)
                retry = self.config.placement.retry_after_s
                raise Backpressure(
                    f"{len(tried)} edge(s) refused or failed this create ({', '.join(sorted(tried))}); "
                    f"retry after {retry:g}s",
                    retry_after=retry,
                    reason="edges refused",
                    edges=sorted(tried),
                )
        finally:
            if not done:
                release = asyncio.ensure_future(self.store.write_grouped(partial(self._release_txn, key=r.key)))
                release.add_done_callback(partial(self._settle_if_failed, r.key))
                with contextlib.suppress(Exception):  # the create's own error is the answer
                    await asyncio.shield(release)

    # -------------------------------------------------- lost reservations ----

    def _settle_later(self, key: str, first: asyncio.Task[SandboxInfo] | None = None,
                      plan: Plan | None = None) -> None:
        self._unsettled[key] = (first, plan)
        if self._settling is None or self._settling.done():
            self._settling = asyncio.get_running_loop().create_task(self._settle_unsettled())
            self._background.add(self._settling)
            self._settling.add_done_callback(self._background.discard)

    def _settle_if_failed(self, key: str, release: asyncio.Future[None]) -> None:
        if release.cancelled() or release.exception() is not None:
            self._settle_later(key)

    async def _settle_unsettled(self) -> None:
        """Settle the reservations this replica lost track of: a reserve whose commit went
        unanswered (the store restarted under it) and a release that could not be written.
        Nobody launches them and the client was told the create failed (a 503 it retries with
        the same request_id), so once the store answers each is released, unless the edge's
        sandbox was recorded into it meanwhile (the watcher's reconcile, by its key): then it
        stands, and the retry is answered with it. An optimistic sandbox made for a released
        reservation is deleted. Until then a retry of the request_id waits ("in flight")."""
        delay = 0.05
        while self._unsettled:
            batch = dict(self._unsettled)
            try:
                kept = await self.store.write(partial(_settle_txn, keys=sorted(batch)))
            except Exception as exc:  # the store is still away
                log.info("%d reservation(s) to settle once the store answers: %s", len(batch), exc)
                await asyncio.sleep(delay)
                delay = min(2 * delay, 1.0)
                continue
            delay = 0.05
            for key, (first, plan) in batch.items():
                if self._unsettled.get(key) == (first, plan):
                    del self._unsettled[key]
                if plan is not None and key not in kept:
                    self._spawn(self._discard(first, plan))

    async def _commit(self, who: Principal, r: Reserved, got: SandboxInfo) -> SandboxInfo:
        """Answer at once and record the id after (group-committed off the reply path).

        The reservation row already holds the quota, the edge's room and the request_id, so
        nothing can be double-booked meanwhile; lookups by id in this replica wait for the
        record (:meth:`settled`). If the replica dies before recording, the watcher's reconcile
        adopts the edge's sandbox into the reservation (``adopt_unconfirmed``) instead of
        reaping it as an orphan.
        """
        if not got.id.startswith(f"{r.edge_id}-"):
            log.warning("edge %s returned id %s without its prefix: routing needs <edge>-<hex>", r.edge_id, got.id)
        if got.state not in (S.RUNNING, S.CREATING):  # failed on the edge: the careful path, on the reply path
            return await self._commit_now(who, r, got)
        tok, exp = auth.mint(self.key, sandbox_id=got.id, project=who.project, ttl_s=self.config.sandbox_token_ttl_s)
        created = got.created_at or r.created_at
        info = SandboxInfo(
            id=got.id, state=got.state, edge_id=r.edge_id, edge_url=got.edge_url or r.edge_url, token=tok,
            token_expires_at=exp, labels=dict(r.labels), task=r.task, project=who.project, created_at=created,
            expires_at=got.expires_at if got.expires_at is not None else r.expires_at, reason=got.reason,
            from_pool=got.from_pool, image=got.image, resources=got.resources,
            stage=got.stage, network=got.network, stages=list(got.stages),
        )
        fut: asyncio.Future[SandboxInfo | None] = asyncio.ensure_future(
            self.store.write_grouped(partial(self._commit_fast_txn, r=r, got=got, who=who))
        )
        self._confirming[got.id] = fut

        def recorded(f: asyncio.Future[SandboxInfo | None]) -> None:
            self._confirming.pop(got.id, None)
            if f.cancelled():
                return
            exc = f.exception()
            if exc is not None:
                log.error("recording sandbox %s failed (the watcher adopts it): %s", got.id, exc)
            elif f.result() is None:  # deleted while it was being created: finish the job
                self._spawn(self._cleanup_deleted(r, got.id))

        fut.add_done_callback(recorded)
        return info

    async def _commit_now(self, who: Principal, r: Reserved, got: SandboxInfo) -> SandboxInfo:
        info = await self.store.write_grouped(partial(self._commit_fast_txn, r=r, got=got, who=who))
        if info is None:  # deleted while we were creating it
            await self._cleanup_deleted(r, got.id)
            raise SandboxFailed("the sandbox was deleted while it was being created", sandbox_id=got.id)
        return info

    async def _cleanup_deleted(self, r: Reserved, sandbox_id: str) -> None:
        await self.edge_delete_quietly(r.edge_id, r.edge_url, sandbox_id)
        await self.store.write(partial(self._finish_stopped_txn, sandbox_id=sandbox_id))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def recording(self) -> frozenset[str]:
        """Ids of the sandboxes whose create this replica answered and whose record is not
        written yet (the watcher leaves them to it)."""
        return frozenset(self._confirming)

    async def settled(self, sandbox_id: str | None = None) -> None:
        """Wait until creates this replica answered are recorded (one id, or all of them)."""
        futs = list(self._confirming.values()) if sandbox_id is None else \
            [f for f in (self._confirming.get(sandbox_id),) if f is not None]
        if futs:
            await asyncio.wait([asyncio.shield(f) for f in futs])

    async def drain(self) -> None:
        """At shutdown: let pending records and clean-ups finish."""
        await self.settled()
        if self._background:
            await asyncio.wait(list(self._background), timeout=10)

    async def edge_delete_quietly(self, edge_id: str, url: str, sandbox_id: str) -> bool:
        try:
            await self.edges.delete(edge_id, url, sandbox_id)
            return True
        except DsecError as exc:
            log.warning("delete of %s on edge %s failed (the watcher retries): %s", sandbox_id, edge_id, exc)
            return False

    def _finish_stopped_txn(self, s: Session, sandbox_id: str) -> None:
        row = s.execute(sa.select(SandboxRow).where(SandboxRow.id == sandbox_id).with_for_update()).scalar_one_or_none()
        if row is not None and row.state == S.STOPPING.value:
            ledger = Ledger()
            move(row, S.STOPPED, ledger)
            ledger.flush(s)

    async def create_batch(self, who: Principal, req: CreateBatch) -> BatchResult:
        sem = asyncio.Semaphore(self.config.batch_concurrency)

        async def one(i: int) -> BatchItem:
            item = CreateSandbox(
                spec=req.spec, lifecycle=req.lifecycle, labels=req.labels, task=req.task,
                request_id=f"{req.request_id}/{i}" if req.request_id is not None else None,
                edge_selector=req.edge_selector,
            )
            async with sem:
                try:
                    return BatchItem(sandbox=await self.create(who, item))
                except DsecError as exc:
                    return BatchItem(error=exc.to_wire())
                except Exception as exc:  # one item's surprise must not sink the batch
                    log.exception("batch item %d failed", i)
                    return BatchItem(error=DsecError(f"internal error: {type(exc).__name__}").to_wire())

        return BatchResult(items=list(await asyncio.gather(*(one(i) for i in range(req.count)))))

    # ---------------------------------------------------------- get/list ----

    def visible_row(
        self, s: Session, who: Principal, sandbox_id: str, *, lock: bool = False
    ) -> tuple[SandboxRow, str]:
        """The caller's sandbox ``sandbox_id`` and its project's name. ``lock``: taken for update by
        this very lookup, so a write that follows sees the state it checks (PostgreSQL: waits for a
        concurrent delete, then finds the row stopping, or gone: 404)."""

        def gone() -> SandboxNotFound:
            return SandboxNotFound(f"no sandbox {sandbox_id!r} in project {who.project!r}", sandbox_id=sandbox_id)

        q = sa.select(SandboxRow).where(SandboxRow.id == sandbox_id)
        row = lock_one(s, q, gone) if lock else s.execute(q).scalar_one_or_none()
        if row is None or (row.project_id != who.project_id and who.project_id not in ancestors(s, row.project_id)):
            raise gone()
        proj = s.get(Project, row.project_id)
        return row, proj.name if proj else ""

    async def _found(self, who: Principal, sandbox_id: str, lookup: Callable[[], Awaitable[T]]) -> T:
        """``lookup()``; on a miss, a sandbox its edge made under a create lease whose report has
        not arrived yet is recorded first (read your writes for lease creates: ``on_miss``)."""
        try:
            return await lookup()
        except SandboxNotFound:
            if self.on_miss is None or not await self.on_miss(who, sandbox_id):
                raise
        return await lookup()

    async def get(self, who: Principal, sandbox_id: str) -> SandboxInfo:
        await self.settled(sandbox_id)
        row, project = await self._found(
            who, sandbox_id, lambda: self.store.read(lambda s: self.visible_row(s, who, sandbox_id)))
        url = await self.fresh_url(sandbox_id, row.edge_url)
        return self.info(row, project, token=True, url=url)

    async def list(
        self, who: Principal, *, task: str | None, states: Sequence[str], labels: dict[str, str | None], limit: int
    ) -> list[SandboxInfo]:
        await self.settled()  # read your writes: creates answered here are listed

        def txn(s: Session) -> list[tuple[SandboxRow, str]]:
            q = (
                sa.select(SandboxRow, Project.name)
                .join(Project, Project.id == SandboxRow.project_id)
                .where(SandboxRow.project_id.in_(subtree_ids(s, who.project_id)), SandboxRow.id.is_not(None))
            )
            if task is not None:
                q = q.where(SandboxRow.task_name == task)
            q = q.where(SandboxRow.state.in_(states)) if states else q.where(SandboxRow.state != S.STOPPED.value)
            return [(row, name) for row, name in s.execute(q.order_by(SandboxRow.created_at, SandboxRow.key))]

        rows = await self.store.read(txn)
        out: list[SandboxInfo] = []
        for row, project in rows:
            if labels_match(row.labels or {}, labels):
                url = await self.fresh_url(row.id or "", row.edge_url)
                out.append(self.info(row, project, token=False, url=url))
                if len(out) >= limit:
                    break
        return out

    # ------------------------------------------------------------ delete ----

    def _stop_txn(self, s: Session, who: Principal, sandbox_id: str) -> tuple[str, str] | str:
        """The sandbox's (edge, url) once it is moved to stopping; for one that had ended
        already, how it ended (``stopped (expired)``)."""
        row, _ = self.visible_row(s, who, sandbox_id, lock=True)
        if row.state in (S.STOPPED.value, S.LOST.value):  # lost: the edge destroys it if it comes back
            return f"{row.state} ({row.reason})" if row.reason else str(row.state)
        ledger = Ledger()
        move(row, S.STOPPING, ledger, reason="deleted")
        ledger.flush(s)
        return row.edge_id or edge_of(sandbox_id), row.edge_url

    async def delete(self, who: Principal, sandbox_id: str) -> str | None:
        """Stop the sandbox (idempotent). None when this call stopped it; how it had ended
        (``stopped (expired)``, ``lost (...)``) when it had ended before."""
        await self.settled(sandbox_id)
        target = await self._found(
            who, sandbox_id, lambda: self.store.write(lambda s: self._stop_txn(s, who, sandbox_id)))
        if isinstance(target, str):
            return target
        edge_id, stored = target
        url = await self.fresh_url(sandbox_id, stored)
        if await self.edge_delete_quietly(edge_id, url, sandbox_id):
            await self.store.write(lambda s: self._finish_stopped_txn(s, sandbox_id))
        return None

    async def delete_where(
        self, who: Principal, *, task: str | None, labels: dict[str, str | None], states: Sequence[str], everything: bool
    ) -> int:
        if task is None and not labels and not states and not everything:
            raise InvalidSpec("give a task, labels or a state to delete by (or all=true)", field="task")
        await self.settled()

        def txn(s: Session) -> list[tuple[str, str, str]]:
            q = sa.select(SandboxRow).where(
                SandboxRow.project_id.in_(subtree_ids(s, who.project_id)),
                SandboxRow.state.in_(tuple(states) if states else LIVE),
            )
            if task is not None:
                q = q.where(SandboxRow.task_name == task)
            ledger = Ledger()
            out: list[tuple[str, str, str]] = []
            for row in s.execute(q.with_for_update()).scalars():
                if not labels_match(row.labels or {}, labels) or row.state in (S.STOPPED.value, S.LOST.value):
                    continue
                move(row, S.STOPPING, ledger, reason="deleted")
                out.append((row.id or "", row.edge_id or "", row.edge_url))
            ledger.flush(s)
            return out

        victims = await self.store.write(txn)
        sem = asyncio.Semaphore(64)

        async def one(sandbox_id: str, edge_id: str, stored: str) -> str | None:
            if not sandbox_id:  # still being created: its create sees 'stopping' and cleans up
                return None
            async with sem:
                url = await self.fresh_url(sandbox_id, stored)
                return sandbox_id if await self.edge_delete_quietly(edge_id, url, sandbox_id) else None

        gone = [x for x in await asyncio.gather(*(one(*v) for v in victims)) if x]

        for i in range(0, len(gone), 500):
            chunk = gone[i : i + 500]
            await self.store.write(partial(finish_many, ids=chunk))
        return len(victims)


def _settle_txn(s: Session, keys: Sequence[str]) -> set[str]:
    """Release the reservations among ``keys`` that are still only reservations; returns the
    keys whose row holds a sandbox (recorded meanwhile: it stands)."""
    kept: set[str] = set()
    ledger = Ledger()
    for key in keys:
        row = s.get(SandboxRow, key, with_for_update=True)
        if row is None:
            continue
        if row.id is not None:
            kept.add(key)
            continue
        log.warning("released reservation %s (request_id %r): its create failed while the store was away",
                    key, row.request_id)
        forget(s, row, ledger)
    ledger.flush(s)
    return kept


def parse_label_filters(values: Sequence[str]) -> dict[str, str | None]:
    """``k=v`` (equal) or ``k`` (present) -> {k: v or None}."""
    out: dict[str, str | None] = {}
    for v in values:
        k, eq, val = v.partition("=")
        if not k or len(k) > 63 or len(val) > 253 or "\0" in v:
            raise InvalidSpec(f"label filter {v[:80]!r}: use key=value or key", field="label")
        out[k] = val if eq else None
    return out


def labels_match(labels: dict[str, Any], want: dict[str, str | None]) -> bool:
    return all((k in labels) if v is None else labels.get(k) == v for k, v in want.items())
