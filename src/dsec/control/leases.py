"""Create leases: one control-plane call grants the right to create N sandboxes directly on edges.

A create through the control plane costs it a request, two store transactions and an edge
call per sandbox (sandboxes.py): ~2-4 ms of its CPU, so a replica on a small machine
answers a few hundred creates a second. A burst (an RL job asking for thousands of
sandboxes of one spec) needs the same decisions once, not N times: is it within quota,
which edges have room. A grant (``POST /v1/leases``) makes them in one transaction:

1. lock the project (and task) as a create does, replay a repeated ``request_id``;
2. count how many of the ``count`` fit the project's and the task's quota, and split them
   over edges with room (power-of-k on chunks, placement.py), at most what fits;
3. per edge part: a ``create_leases`` row, and one **reservation per slot**: a sandbox row in
   state ``creating`` keyed ``<lease id><slot:08x>``, charged to the project, the task and
   the edge exactly like a create's reservation;
4. answer one signed token per part (``dsec.http.auth.mint_lease``: lease, project, edge, slots,
   the hash of the create body, expiry). The SDK sends the body and the token straight to
   the edge (edge/leases.py), which makes each sandbox under a slot's key.

Afterwards, per sandbox, the control plane does no work on the create path: the edge reports
what it made (``POST /v1/edges/{id}/leases/report``, batched), and each report fills its
slot's reservation (creating -> running, no counter moves: the reservation held the quota
already). If reports are lost, the watcher's reconcile finds the sandboxes on the edge and
fills the reservations by their keys (``adopt_by_key``). Counters therefore never need lease
arithmetic: every unused slot is a reservation row, and the recount sees it.

A lease ends by release (``DELETE /v1/leases/{grant}``: the SDK when its burst is done), by
revocation (its API token revoked), or by expiry (``expires_at`` + :data:`EXPIRY_GRACE_S`,
swept by every replica). Release and revocation first tell each edge (``DELETE
/v1/leases/{id}``, which answers what the lease made once the creates in flight finish and
refuses any more), record what it made, then drop the unused reservations: their quota
returns at once. An edge that cannot be told keeps its part until expiry (the edge refuses
an expired lease by its own clock; the grace covers clock skew and reports in flight). A
report that comes after its reservation was dropped (it was made just before the expiry, and
reported late) is recorded as a sandbox of its own, charged then: the quota may then be
overdrawn by that many for as long as they live, which is logged.

Edge failure: an edge that dies holds its unused slots until the lease expires (or the
watcher declares the edge lost and stops its sandboxes); the SDK creates the rest through the
control plane's own path, which places them elsewhere. When it dies (or is cut off) with a
chunk in flight, the SDK cannot know what the edge made of it, so it **abandons** the part
(``POST /v1/leases/{grant}/abandon``, :meth:`Leases.abandon`) naming the slots it holds: one
transaction, the part's row locked, closes the part, turns every other unused slot into a
``stopped`` row without id (quota back), moves every other reported sandbox to ``stopping``
(deleted on the edge). A report that comes later under a given-up slot goes into that row
(:meth:`Leases._into_row`: never charged) and the reconcile deletes the sandbox; one the edge
only lists is matched to the row by its key and deleted (watcher.py). The control plane's
decision wins, as with fencing: nothing made under a given-up slot lives, or is charged. The
SDK then creates those items through the control plane. The decision is stored with the part:
a retried abandon (same request id and held slots, any replica) is answered the same.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import time
import uuid
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import sqlalchemy as sa
from fastapi import APIRouter, Depends, Request, Response
from sqlalchemy.orm import Session

from dsec.control.db import SANDBOXES, CreateLeaseRow, EdgeRow, SandboxRow
from dsec.control.edges import EdgeUnreachable, bump_edge, edge_of, load_views
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
    task_limit,
)
from dsec.control.ledger import HOLDS_QUOTA, Ledger, finish_many, move
from dsec.control.placement import Demand, EdgeView, Room, feasible, place
from dsec.control.sandboxes import (
    _Q_PROJECT,
    _Q_TASK,
    Sandboxes,
    inherited_stages,
)
from dsec.edge.leases import SLOT_HEX, slot_key
from dsec.errors import Backpressure, DsecError, InvalidSpec, LeaseInvalid, NotFound, QuotaExceeded
from dsec.http import auth
from dsec.spec import Resources, SandboxState
from dsec.spec.api import (
    AbandonLease,
    CreateLease,
    EdgeLease,
    LeaseAbandoned,
    LeaseGrant,
    LeaseReleased,
    LeaseReport,
    LeaseReportItem,
    TaskQuota,
)

log = logging.getLogger("dsec.control.leases")

S = SandboxState
EXPIRY_GRACE_S = 10.0
"""A lease is closed this long after it expires (edges' clock skew, reports in flight)."""
SWEEP_EVERY_S = 2.0
_UNLIMITED = 1 << 62
AHEAD = "ahead"
"""``create_leases.reason`` of an active lease held ahead of creates (it yields to a create)."""
MAX_PARTS = 64
"""Edges one grant is spread over, at most."""
ABANDON_TELL_S = 3.0
"""How long an abandon waits for the part's edge to answer its revocation (an edge that does not
answer learns by its lease's expiry; the decision is made already)."""

_SB = SANDBOXES
class _EncodedJSON(sa.types.TypeDecorator[Any]):
    """A JSON column's value already encoded (text): bound as it is, typed JSON."""

    impl = sa.JSON
    cache_ok = True

    def bind_processor(self, dialect: sa.Dialect) -> None:
        return None


_JSON_COLS = ("spec", "labels", "lifecycle")
_SLOT_COLS = ("key", "id", "edge_id", "edge_url", "project_id", "task_id", "task_name", "labels", "state", "spec",
              "lifecycle", "cpu_m", "memory", "disk", "created_at", "updated_at", "expires_at", "request_id",
              "request_hash", "reason", "launcher", "priority")
"""The columns a slot's reservation sets (the others take their defaults)."""
_INSERT_SLOTS = sa.insert(_SB).values(
    {c: sa.bindparam(c, type_=_EncodedJSON() if c in _JSON_COLS else _SB.c[c].type) for c in _SLOT_COLS}
)
"""The slots' reservations: their JSON columns bound as text made once per grant (SQLAlchemy
would encode the same documents again for every row: most of a grant's time)."""
_FILL = (
    sa.update(_SB)
    .where(_SB.c.key == sa.bindparam("k"), _SB.c.id.is_(None), _SB.c.state == S.CREATING.value)
    .values(id=sa.bindparam("c_id"), created_at=sa.bindparam("c_created"),
            expires_at=sa.bindparam("c_expires"), state=sa.bindparam("c_state"), updated_at=sa.bindparam("c_now"),
            reason="")
)


def _insert_slots(conn: sa.Connection, parts: list[tuple[dict[str, Any], list[str]]]) -> None:
    """The slots' reservations (per part: the columns its rows share, and their keys), in this
    transaction: ``COPY`` on PostgreSQL (a few µs a row against ~60 for a batched INSERT), the
    batched INSERT elsewhere."""
    if conn.dialect.name != "postgresql" or sum(len(k) for _, k in parts) < 64:
        conn.execute(_INSERT_SLOTS, [{**common, "key": key} for common, keys in parts for key in keys])
        return
    cols = [c for c in _SLOT_COLS if c != "key"]
    raw = conn.connection.driver_connection  # psycopg's, inside the session's transaction
    assert raw is not None
    with raw.cursor() as cur, cur.copy(f"COPY {_SB.name} (key, {', '.join(cols)}) FROM STDIN") as cp:
        for common, keys in parts:
            tail = [common[c] for c in cols]
            for key in keys:
                cp.write_row([key, *tail])


def grant_id_of(request_id: str | None) -> str:
    """A grant's id: derived from its request_id (so a retry finds it), else random."""
    if request_id is None:
        return uuid.uuid4().hex
    return hashlib.sha256(request_id.encode()).hexdigest()[:32]


def _times(room: Room, n: int) -> Room:
    return Room(room.sandboxes * n, room.cpu_m * n, room.memory * n, room.disk * n)


def how_many_fit(free: Amount, want: Amount, limit: int) -> int:
    """The most copies of ``want`` that ``free`` holds (at most ``limit``)."""
    n = limit
    for have, need in ((free.sandboxes, want.sandboxes), (free.cpu_m, want.cpu_m), (free.memory, want.memory)):
        if need > 0:
            n = min(n, max(0, have // need))
    return n


def split(views: Sequence[EdgeView], demand: Demand, n: int, *, k: int, rng: Any, require_layers: bool,
          max_parts: int = MAX_PARTS) -> dict[str, int]:
    """How many of ``n`` sandboxes go to which edge: power-of-k choices on chunks (the view of
    each chosen edge takes its chunk before the next choice), chunks halving when nothing
    holds one. At most ``max_parts`` edges; less than ``n`` when room runs out. Pure."""
    by_id = {v.id: v for v in views}
    cands = feasible(views, demand, require_layers=require_layers)
    chunk = max(1, math.ceil(n / max(1, 2 * len(cands))))
    out: dict[str, int] = {}
    left = n
    while left > 0:
        c = min(chunk, left)
        pool = [v for v in by_id.values() if v.id in out] if len(out) >= max_parts else list(by_id.values())
        chosen = place(pool, dataclasses.replace(demand, need=_times(demand.need, c)), k=k, rng=rng,
                       require_layers=require_layers)
        if chosen is None:
            if c == 1:
                break
            chunk = max(1, c // 2)
            continue
        out[chosen.id] = out.get(chosen.id, 0) + c
        by_id[chosen.id] = dataclasses.replace(chosen, committed=chosen.committed + _times(demand.need, c))
        left -= c
    return out


def _give_back(s: Session, lease: CreateLeaseRow, gone: Sequence[Any]) -> int:
    """What dropped slot reservations of ``lease`` held (rows of task_id, cpu_m, memory, disk)
    returns to the project, the tasks and the edge; returns how many."""
    if not gone:
        return 0
    n = len(gone)
    cpu, mem, disk = sum(g[1] for g in gone), sum(g[2] for g in gone), sum(g[3] for g in gone)
    bump_project(s, lease.project_id, Amount(-n, -cpu, -mem))
    by_task: dict[int, Amount] = {}
    for task_id, c, m, _ in gone:
        if task_id is not None:
            by_task[task_id] = by_task.get(task_id, Amount()) + Amount(1, c, m)
    for task_id, a in sorted(by_task.items()):
        bump_task(s, task_id, Amount() - a)
    bump_edge(s, lease.edge_id, Room(-n, -cpu, -mem, -disk))
    return n


def held_digest(held: Sequence[str]) -> str:
    """The digest of an abandon's kept slots (a retried abandon must keep the same ones)."""
    return hashlib.sha256("\n".join(sorted(set(held))).encode()).hexdigest()


def _boot_ids(s: Session, edge_ids: Sequence[str]) -> dict[str, str]:
    """The run of each edge, from its last health report (a lease names it: edge/leases.py)."""
    q = sa.select(EdgeRow.id, EdgeRow.health["boot_id"].as_string()).where(EdgeRow.id.in_(list(edge_ids)))
    return {eid: boot or "" for eid, boot in s.execute(q)}


@dataclasses.dataclass(frozen=True)
class _Part:
    lease_id: str
    edge_id: str
    edge_url: str
    slots: int
    boot_id: str = ""


@dataclasses.dataclass(frozen=True)
class _Abandoned:
    lease_id: str
    edge_id: str
    kept: int
    returned: int
    stopped: list[str]
    replayed: bool


@dataclasses.dataclass(frozen=True)
class _Granted:
    grant_id: str
    expires_at: float
    body: dict[str, Any]
    parts: list[_Part]
    short: int
    error: dict[str, Any] | None


class Leases:
    """The lease operations of one replica (all state is in the store)."""

    def __init__(self, sandboxes: Sandboxes) -> None:
        self.sb = sandboxes
        self.config = sandboxes.config
        self.store = sandboxes.store
        self.key = sandboxes.key
        self.edges = sandboxes.edges
        self._sweeper: asyncio.Task[None] | None = None
        self.granted = 0
        self.reported = 0
        self.returned = 0
        self.abandoned = 0
        """Lease parts this replica abandoned at the SDK's request (not counting replays)."""

    # ------------------------------------------------------------- grant --

    async def yield_ahead(self, who: Principal) -> bool:
        """A create of the project was refused for quota: hand back its leases held ahead of
        creates (their edges stop honouring them, what they made is recorded, the rest returns).
        True if any quota came back."""
        parts = await self.store.read(lambda s: [(r.id, r.edge_id) for r in s.execute(
            sa.select(CreateLeaseRow).where(CreateLeaseRow.project_id == who.project_id,
                                            CreateLeaseRow.state == "active", CreateLeaseRow.reason == AHEAD)
        ).scalars()])
        if not parts:
            return False
        got = await self._revoke(parts, reason="yielded its slots to a create")
        return got.returned > 0

    async def grant(self, who: Principal, req: CreateLease) -> LeaseGrant:
        if req.task is not None:
            check_name(req.task, "task")
        r = req.spec.resources
        demand = Demand(need=Room(1, Amount.of_resources(r).cpu_m, r.memory, r.disk),
                        layers=tuple(req.spec.image.layers_top_first()), selector=dict(req.edge_selector),
                        backend=req.spec.backend)
        try:
            got = await self.store.write(partial(self._grant_txn, who=who, req=req, demand=demand))
        except QuotaExceeded:
            if req.ahead or not await self.yield_ahead(who):
                raise
            got = await self.store.write(partial(self._grant_txn, who=who, req=req, demand=demand))
        self.granted += sum(p.slots for p in got.parts)
        digest = auth.body_hash(got.body)
        ttl = max(1.0, got.expires_at - time.time())
        leases = []
        for p in got.parts:
            tok, _ = auth.mint_lease(self.key, lease_id=p.lease_id, project=who.project, edge_id=p.edge_id,
                                     boot_id=p.boot_id, slots=p.slots, body_digest=digest, ttl_s=ttl)
            leases.append(EdgeLease(lease_id=p.lease_id, edge_id=p.edge_id, edge_url=p.edge_url, slots=p.slots,
                                    token=tok))
        return LeaseGrant(id=got.grant_id, expires_at=got.expires_at, body=got.body, leases=leases, short=got.short,
                          error=got.error)

    def _grant_txn(self, s: Session, who: Principal, req: CreateLease, demand: Demand) -> _Granted:
        conn = s.connection()
        now = time.time()
        p = conn.execute(_Q_PROJECT, {"pid": who.project_id}).first()  # locked first, as a create
        if p is None:
            raise NotFound(f"project {who.project!r} no longer exists", project=who.project)
        gid = grant_id_of(req.request_id)
        t = None
        if req.task:
            t = conn.execute(_Q_TASK, {"pid": who.project_id, "name": req.task}).first()
            if t is None:
                get_or_create_task(s, who.project_id, req.task, lock=True)
                t = conn.execute(_Q_TASK, {"pid": who.project_id, "name": req.task}).one()
        dumped = req.model_dump(mode="json")
        spec = dict(dumped["spec"])
        inherit = inherited_stages(t.stages if t is not None else None, req)  # type: ignore[arg-type]
        if inherit is not None:
            spec.update(inherit)
        body = {"spec": spec, "lifecycle": dumped["lifecycle"], "labels": dumped["labels"], "task": req.task,
                "project": who.project}
        if req.request_id is not None:
            prev = s.execute(sa.select(CreateLeaseRow).where(
                CreateLeaseRow.project_id == who.project_id, CreateLeaseRow.grant_id == gid)).scalars().all()
            if prev:
                return self._replayed(s, prev, body, req)
        want = Amount(1, demand.need.cpu_m, demand.need.memory)
        quota = Amount(p.quota_sandboxes, p.quota_cpu_m, p.quota_memory)
        used = Amount(p.used_sandboxes, p.used_cpu_m, p.used_memory)
        reserved = Amount(p.reserved_sandboxes, p.reserved_cpu_m, p.reserved_memory)
        n = how_many_fit(quota - used - reserved, want, req.count)
        t_used = None
        tq = None
        if t is not None:
            tq = TaskQuota(sandboxes=t.quota_sandboxes, memory=t.quota_memory,
                           cpu=None if t.quota_cpu_m is None else t.quota_cpu_m / 1000)
            t_used = Amount(t.used_sandboxes, t.used_cpu_m, t.used_memory)
            limits = task_limit(tq)
            t_free = Amount(*(_UNLIMITED if v is None else v - t_used.get(d) for d, v in limits.items()))
            n = min(n, how_many_fit(t_free, want, req.count))
        if req.ahead:  # whole, at most half of what is left, and it yields to a create refused for quota
            free_units = how_many_fit(quota - used - reserved, want, _UNLIMITED)
            if t is not None and t_used is not None and tq is not None:
                limits = task_limit(tq)
                t_free = Amount(*(_UNLIMITED if v is None else v - t_used.get(d) for d, v in limits.items()))
                free_units = min(free_units, how_many_fit(t_free, want, _UNLIMITED))
            if 2 * req.count > free_units:
                raise Backpressure(f"no lease ahead of creates: {req.count} sandboxes would take more than half of "
                                   f"the {free_units} the quota has left", retry_after=5.0, reason="quota")
        error: DsecError | None = None
        if n < req.count:  # the quota's own words for what was not granted
            try:
                check_fits(project=p.name, quota=quota, used=used, reserved=reserved, want=want * req.count)
                if t is not None and tq is not None and t_used is not None:
                    check_task_fits(task=str(req.task), project=p.name, quota=tq, used=t_used, want=want * req.count)
            except QuotaExceeded as exc:
                error = exc
            if n == 0:
                assert error is not None
                raise error
        loaded = load_views(s, self.sb.health)
        views = [v for v, _ in loaded]
        urls = {v.id: u for v, u in loaded}
        # the scheduler's say: which pool, and never the room held back for tasks' minimums (scheduler.py)
        views, n = self.sb.scheduler.lease_room_txn(s, views, t, want, n, req.lifecycle.ttl_s)
        alloc = split(views, demand, n, k=self.config.placement.k, rng=self.sb.rng,
                      require_layers=self.config.placement.require_layers) if n else {}
        placed = sum(alloc.values())
        if req.ahead and placed < req.count:
            raise Backpressure(f"no lease ahead of creates: edges have room for {placed} of {req.count} now",
                               retry_after=5.0, reason="no room for all")
        if placed == 0:
            unknown = self.sb.unknown_layer(views, demand)
            raise unknown if unknown is not None else self.sb.nothing_fits(views, demand, frozenset())
        if placed < n:
            retry = self.config.placement.retry_after_s
            error = Backpressure(f"edges have room for {placed} of the {n} sandboxes asked for now; retry the rest "
                                 f"after {retry:g}s", retry_after=retry, reason="no room for all")
        expires = now + req.lease_ttl_s
        labels = {**req.spec.labels, **req.labels}
        as_text = {"spec": json.dumps(spec), "labels": json.dumps(labels), "lifecycle": json.dumps(dumped["lifecycle"])}
        parts: list[_Part] = []
        rows: list[tuple[dict[str, Any], list[str]]] = []  # per part: the columns they share, their keys
        boots = _boot_ids(s, list(alloc))
        for edge_id, slots in sorted(alloc.items()):
            lid = uuid.uuid4().hex[:24]
            s.add(CreateLeaseRow(id=lid, grant_id=gid, project_id=who.project_id, token_id=who.token_id,
                                 request_id=req.request_id, edge_id=edge_id, granted=slots, body=body, state="active",
                                 created_at=now, expires_at=expires, closed_at=None, reason=AHEAD if req.ahead else ""))
            parts.append(_Part(lid, edge_id, urls[edge_id], slots, boots.get(edge_id, "")))
            common = {
                "id": None, "edge_id": edge_id, "edge_url": urls[edge_id], "project_id": who.project_id,
                "task_id": t.id if t is not None else None, "task_name": req.task, "labels": as_text["labels"],
                "state": S.CREATING.value, "spec": as_text["spec"], "lifecycle": as_text["lifecycle"],
                "cpu_m": demand.need.cpu_m, "memory": demand.need.memory, "disk": demand.need.disk,
                "created_at": now, "updated_at": now, "expires_at": now + req.lifecycle.ttl_s, "request_id": None,
                "request_hash": "", "reason": f"lease {lid}", "launcher": None,
                "priority": int(t.priority) if t is not None else self.sb.scheduler.cfg.default_priority,
            }
            rows.append((common, [slot_key(lid, i) for i in range(slots)]))
            bump_edge(s, edge_id, _times(demand.need, slots))
        _insert_slots(conn, rows)
        bump_project(s, who.project_id, want * placed)
        if t is not None:
            bump_task(s, t.id, want * placed)
        s.flush()
        return _Granted(gid, expires, body, parts, req.count - placed, error.to_wire() if error else None)

    @staticmethod
    def _replayed(s: Session, prev: Sequence[CreateLeaseRow], body: dict[str, Any], req: CreateLease) -> _Granted:
        if any(auth.body_hash(r.body) != auth.body_hash(body) for r in prev):
            raise InvalidSpec(f"request_id {req.request_id!r} was used before for a lease of another body",
                              field="request_id")
        if any(r.state != "active" for r in prev):
            raise LeaseInvalid(f"the lease granted for request_id {req.request_id!r} has ended "
                               f"({prev[0].reason or 'closed'}): ask with a new request_id",
                               lease_id=prev[0].grant_id, reason="ended")
        urls = dict(s.execute(sa.select(EdgeRow.id, EdgeRow.url).where(
            EdgeRow.id.in_([r.edge_id for r in prev]))).all())
        boots = _boot_ids(s, [r.edge_id for r in prev])
        parts = [_Part(r.id, r.edge_id, urls.get(r.edge_id, ""), r.granted, boots.get(r.edge_id, ""))
                 for r in sorted(prev, key=lambda r: r.id)]
        return _Granted(prev[0].grant_id, prev[0].expires_at, prev[0].body, parts,
                        max(0, req.count - sum(r.granted for r in prev)), None)

    # ------------------------------------------------------------ report --

    async def report(self, edge_id: str, report: LeaseReport) -> int:
        """Record sandboxes an edge made under leases (idempotent); returns how many were new."""
        if not report.items:
            return 0
        n = await self.store.write(partial(self._report_txn, edge_id=edge_id, items=report.items))
        self.reported += n
        return n

    def _report_txn(self, s: Session, edge_id: str, items: Sequence[LeaseReportItem]) -> int:
        now = time.time()
        # A light read first: what is recorded already (a report repeated, the revocation's list
        # of what a lease made) is not locked. The rest is locked in key order (two reports of
        # overlapping slots, from two replicas, never wait for each other in a cycle).
        seen: dict[str, str | None] = {}
        keys = sorted({it.key for it in items})
        started: set[str] = set()
        """Recorded with this id while the edge was still making it (the reconcile listed it then)."""
        for i in range(0, len(keys), 500):
            for k, sid, state in s.execute(sa.select(SandboxRow.key, SandboxRow.id, SandboxRow.state)
                                           .where(SandboxRow.key.in_(keys[i:i + 500]))):
                seen[k] = sid
                if state == S.CREATING.value and sid is not None:
                    started.add(k)
        want = {it.key: it.id for it in items}
        done = {it.key for it in items if it.state in (S.RUNNING, S.PAUSED)}
        todo = [k for k in keys if seen.get(k, "") != want[k] or (k in started and k in done)]
        rows: dict[str, tuple[str | None, str]] = {}
        for i in range(0, len(todo), 500):
            for k, sid, state in s.execute(
                sa.select(SandboxRow.key, SandboxRow.id, SandboxRow.state)
                .where(SandboxRow.key.in_(todo[i:i + 500])).order_by(SandboxRow.key).with_for_update()
            ):
                rows[k] = (sid, state)
        items = [it for it in items if seen.get(it.key, "") != it.id or (it.key in started and it.key in done)]
        fills: list[dict[str, Any]] = []
        odd: list[LeaseReportItem] = []
        ripe = Ledger()
        for it in items:
            sb = it
            if not sb.id.startswith(f"{edge_id}-"):
                log.warning("edge %s reported sandbox %s of another edge: ignored", edge_id, sb.id)
                continue
            have = rows.get(it.key)
            if have is not None and have[0] == sb.id:
                if have[1] == S.CREATING.value and sb.state in (S.RUNNING, S.PAUSED):  # made since: the edge's word
                    row = s.get(SandboxRow, it.key)
                    assert row is not None
                    move(row, sb.state, ripe)
                continue  # recorded already (a repeated report, or the reconcile was first)
            if have is not None and have[0] is None and have[1] == S.CREATING.value and sb.state in (
                    S.RUNNING, S.CREATING, S.PAUSED):
                fills.append({"k": it.key, "c_id": sb.id, "c_created": sb.created_at, "c_expires": sb.expires_at,
                              "c_state": sb.state.value, "c_now": now})
            else:
                odd.append(it)
        if fills:
            s.connection().execute(_FILL, fills)
        ripe.flush(s)
        for it in odd:
            self._record_odd(s, edge_id, it, rows.get(it.key), now)
        return len(fills) + len(odd)

    def _record_odd(self, s: Session, edge_id: str, it: LeaseReportItem, have: tuple[str | None, str] | None,
                    now: float) -> None:
        """A report that does not simply fill its reservation: the reservation was dropped
        (the lease ended first), deleted meanwhile, given up by an abandon, or the sandbox
        already failed."""
        sb = it
        ledger = Ledger()
        if have is not None and have[0] is None:
            self._into_row(s, s.get(SandboxRow, it.key), sb, ledger)
            return
        if s.execute(sa.select(SandboxRow.key).where(SandboxRow.id == sb.id)).first() is not None:
            return
        # locked: an abandon of this part (which writes a row for every slot it gives up) and this
        # report go one after the other: the report finds the abandon's row, or the abandon this one
        lease = s.get(CreateLeaseRow, it.key[: -SLOT_HEX], with_for_update=True)
        if lease is None or lease.edge_id != edge_id:
            log.warning("edge %s reported sandbox %s under unknown lease slot %s: left to the reconcile",
                        edge_id, sb.id, it.key)
            return
        slot = s.get(SandboxRow, it.key, with_for_update=True) if have is None else None
        if slot is not None and slot.id in (None, sb.id):  # written while we waited for the lock
            if slot.id is None:
                self._into_row(s, slot, sb, ledger)
            return
        res = Resources.model_validate(lease.body["spec"]["resources"])
        amount = Amount.of_resources(res)
        task_id = None
        if lease.body.get("task"):
            task_id = get_or_create_task(s, lease.project_id, lease.body["task"], lock=False).id
        url = s.execute(sa.select(EdgeRow.url).where(EdgeRow.id == edge_id)).scalar_one_or_none() or ""
        row = SandboxRow(  # under its slot's key when free: an abandon of the part finds it there
            key=it.key if slot is None and have is None else uuid.uuid4().hex, id=sb.id, edge_id=edge_id,
            edge_url=url, project_id=lease.project_id, task_id=task_id, task_name=lease.body.get("task"),
            labels={**(lease.body["spec"].get("labels") or {}), **(lease.body.get("labels") or {})},
            state=S.CREATING.value, spec=lease.body["spec"], lifecycle=lease.body["lifecycle"], cpu_m=amount.cpu_m,
            memory=res.memory, disk=res.disk, created_at=sb.created_at, updated_at=now, expires_at=sb.expires_at,
            request_id=None, request_hash="", reason=f"lease {lease.id} (reported after it ended)", launcher=None,
        )
        s.add(row)
        ledger.charge(row, None, S.CREATING.value)
        if sb.state is not S.CREATING:
            move(row, sb.state if sb.state is not S.STOPPED else S.STOPPED, ledger)
        ledger.flush(s)
        log.warning("edge %s reported %s after lease %s ended: recorded and charged to project #%d (its quota "
                    "may be overdrawn by it while it lives)", edge_id, sb.id, lease.id, lease.project_id)

    @staticmethod
    def _into_row(s: Session, row: SandboxRow | None, sb: LeaseReportItem, ledger: Ledger) -> None:
        """The sandbox goes into its slot's row, which is no reservation waiting for it any more:
        deleted meanwhile (stopping) or given up by an abandon (stopped). The row keeps the id and
        its state; the reconcile then deletes the sandbox on its edge (the store says it has ended)."""
        assert row is not None
        row.id = sb.id
        row.created_at = sb.created_at
        if row.state == S.CREATING.value and sb.state in (S.FAILED, S.STOPPED):
            move(row, sb.state, ledger, reason=sb.reason or "failed on the edge")
        ledger.flush(s)

    async def adopt(self, who: Principal, sandbox_id: str) -> bool:
        """A sandbox id the store does not know: if its edge made it under a lease of the caller's
        (its request id is a slot key) and has not reported it yet, record it now. Lookups by id
        right after a lease create (another replica, or before the report) then find it."""
        edge_id = edge_of(sandbox_id)
        url = await self.sb.directory.url(edge_id)
        if url is None:
            return False
        try:
            sb = await self.edges.get(edge_id, url, sandbox_id)
        except DsecError:
            return False
        key = sb.request_id or ""
        if len(key) != 24 + SLOT_HEX or sb.project is None:
            return False
        lease_project = await self.store.read(lambda s: s.execute(
            sa.select(CreateLeaseRow.project_id).where(CreateLeaseRow.id == key[:-SLOT_HEX])).scalar_one_or_none())
        if lease_project is None or (lease_project != who.project_id and not await self.store.read(
                lambda s: who.project_id in ancestors(s, lease_project))):
            return False
        await self.report(edge_id, LeaseReport(items=[LeaseReportItem(
            key=key, id=sb.id, state=sb.state, created_at=sb.created_at, expires_at=sb.expires_at, reason=sb.reason)]))
        return True

    # ----------------------------------------------------- release/close --

    async def release(self, who: Principal, grant_id: str) -> LeaseReleased:
        """The SDK is done with a grant: tell its edges, record what they made, return the rest."""
        parts = await self.store.read(lambda s: [
            (r.id, r.edge_id) for r in s.execute(sa.select(CreateLeaseRow).where(
                CreateLeaseRow.grant_id == grant_id, CreateLeaseRow.project_id == who.project_id)).scalars()
            if r.state == "active"] or self._known(s, who, grant_id))
        return await self._revoke(parts, reason="released")

    @staticmethod
    def _known(s: Session, who: Principal, grant_id: str) -> list[tuple[str, str]]:
        if s.execute(sa.select(CreateLeaseRow.id).where(
                CreateLeaseRow.grant_id == grant_id, CreateLeaseRow.project_id == who.project_id)).first() is None:
            raise NotFound(f"no lease {grant_id!r} in project {who.project!r}", lease_id=grant_id)
        return []

    async def revoke_for_token(self, token_id: str) -> None:
        """A revoked API token's leases end with it."""
        parts = await self.store.read(lambda s: [(r.id, r.edge_id) for r in s.execute(
            sa.select(CreateLeaseRow).where(CreateLeaseRow.token_id == token_id, CreateLeaseRow.state == "active")
        ).scalars()])
        if parts:
            await self._revoke(parts, reason="revoked (its API token was revoked)")

    async def _revoke(self, parts: Sequence[tuple[str, str]], *, reason: str) -> LeaseReleased:
        out = LeaseReleased()
        if not parts:
            return out

        async def one(lease_id: str, edge_id: str) -> tuple[str, list[LeaseReportItem] | None]:
            url = await self.sb.directory.url(edge_id)
            if url is None:
                return lease_id, None
            try:
                return lease_id, await self.edges.revoke_lease(edge_id, url, lease_id)
            except (EdgeUnreachable, DsecError) as exc:
                log.warning("revoking lease %s on edge %s failed (it ends when it expires): %s", lease_id, edge_id, exc)
                return lease_id, None

        told = await asyncio.gather(*(one(lid, eid) for lid, eid in parts))
        by_edge = dict(parts)
        closable: list[str] = []
        for lease_id, made in told:
            if made is None:
                out.pending.append(lease_id)
                continue
            if made:
                await self.report(by_edge[lease_id], LeaseReport(items=made))
            out.made += len(made)
            out.sandboxes.extend(made)
            closable.append(lease_id)
        if closable:
            out.returned = await self.store.write(partial(self._close_txn, lease_ids=closable, reason=reason))
            self.returned += out.returned
        return out

    def _close_txn(self, s: Session, lease_ids: Sequence[str], reason: str) -> int:
        """Close these leases: drop their unused slots' reservations (the quota returns)."""
        now = time.time()
        returned = 0
        leases = s.execute(sa.select(CreateLeaseRow).where(CreateLeaseRow.id.in_(list(lease_ids)),
                                                           CreateLeaseRow.state == "active")
                           .order_by(CreateLeaseRow.id).with_for_update()).scalars().all()
        for lease in leases:
            lo, hi = slot_key(lease.id, 0), lease.id + "f" * SLOT_HEX
            gone = s.execute(
                sa.delete(SandboxRow).where(SandboxRow.key >= lo, SandboxRow.key <= hi, SandboxRow.id.is_(None),
                                            SandboxRow.state == S.CREATING.value)
                .returning(SandboxRow.task_id, SandboxRow.cpu_m, SandboxRow.memory, SandboxRow.disk)
            ).all()
            returned += _give_back(s, lease, gone)
            lease.state, lease.closed_at, lease.reason = "closed", now, reason
        return returned

    # ----------------------------------------------------------- abandon --

    async def abandon(self, who: Principal, grant_id: str, req: AbandonLease) -> LeaseAbandoned:
        """The SDK does not know what became of a chunk it sent to this part's edge: the part ends
        and every slot the SDK does not hold is given up, whatever the edge did or will do (the
        control plane's decision wins, as when it fences an edge). One transaction decides; then
        the edge is told (as a release does: what it made is recorded), and the sandboxes it made
        under slots given up are destroyed there. Idempotent (``request_id`` and ``held``)."""
        got = await self.store.write(partial(self._abandon_txn, who=who, grant_id=grant_id, req=req,
                                             digest=held_digest(req.held)))
        held = set(req.held)
        doomed = list(got.stopped)
        told = False
        url = await self.sb.directory.url(got.edge_id)
        if url is not None:
            try:
                made = await asyncio.wait_for(self.edges.revoke_lease(got.edge_id, url, got.lease_id), ABANDON_TELL_S)
            except (EdgeUnreachable, DsecError, TimeoutError) as exc:
                log.warning("abandoned lease %s: edge %s not told (%r): what it makes meanwhile is destroyed when "
                            "it reports or is reconciled", got.lease_id, got.edge_id, exc)
            else:
                told = True
                if made:
                    await self.report(got.edge_id, LeaseReport(items=made))  # into the abandon's rows
                doomed += [it.id for it in made if it.key not in held and it.id not in doomed]
        if doomed and told and url is not None:  # an edge that did not answer: the reconcile, once it is back
            await self._destroy(got.edge_id, url, doomed)
        if not got.replayed:
            self.abandoned += 1
            log.warning("lease %s on edge %s abandoned by the client: %d slot(s) kept, %d reservation(s) returned, "
                        "%d sandbox(es) nobody holds to destroy (%s)", got.lease_id, got.edge_id, got.kept,
                        got.returned, len(doomed), "done" if told else "the edge did not answer: when it is back")
        return LeaseAbandoned(lease_id=got.lease_id, kept=got.kept, returned=got.returned, stopped=got.stopped,
                              edge_told=told, replayed=got.replayed)

    async def _destroy(self, edge_id: str, url: str, ids: Sequence[str]) -> None:
        """Delete these sandboxes on their edge (those the store says are stopping finish); what
        fails is left to the reconcile, which deletes on the edge what the store says has ended."""
        sem = asyncio.Semaphore(16)

        async def one(sandbox_id: str) -> str | None:
            async with sem:
                try:
                    await asyncio.wait_for(self.edges.delete(edge_id, url, sandbox_id), ABANDON_TELL_S * 2)
                    return sandbox_id
                except (DsecError, TimeoutError) as exc:
                    log.warning("delete of %s on edge %s failed (the reconcile retries): %r", sandbox_id, edge_id, exc)
                    return None

        gone = [x for x in await asyncio.gather(*(one(i) for i in ids)) if x]
        if gone:
            await self.store.write(partial(finish_many, ids=gone))

    def _abandon_txn(self, s: Session, who: Principal, grant_id: str, req: AbandonLease, digest: str) -> _Abandoned:
        """The decision, in one transaction, with the part's row locked (a late report of one of
        its slots waits for it, or went first: ``_record_odd``). Per slot not in ``held``:

        - a reservation (no sandbox reported) becomes a row ``stopped`` with no id: its quota and
          room return now, and a sandbox the edge reports or lists under that key later goes into
          it, still stopped, and is deleted there (``_into_row``; the watcher's reconcile);
        - a reported sandbox moves to ``stopping`` (quota back) and is deleted on its edge;
        - a slot with no row (its reservation was dropped when the lease expired) gets the same
          stopped row, so a report after the end is not recorded as a live sandbox of its own.

        Slots in ``held`` are left as they are: reservations the edge's report fills, or sandboxes."""
        lease = s.execute(sa.select(CreateLeaseRow).where(
            CreateLeaseRow.id == req.lease_id, CreateLeaseRow.grant_id == grant_id,
            CreateLeaseRow.project_id == who.project_id).with_for_update()).scalar_one_or_none()
        if lease is None:
            raise NotFound(f"no lease part {req.lease_id!r} of grant {grant_id!r} in project {who.project!r}",
                           lease_id=req.lease_id)
        prev = lease.abandon
        if prev is not None:
            if prev.get("held") == digest:
                return _Abandoned(lease.id, lease.edge_id, int(prev["kept"]), int(prev["returned"]),
                                  list(prev["stopped"]), True)
            if prev.get("request_id") == req.request_id:
                raise InvalidSpec(f"request_id {req.request_id!r} abandoned lease part {lease.id} keeping other slots "
                                  "before", field="request_id")
            raise LeaseInvalid(f"lease part {lease.id} was abandoned before, keeping {prev['kept']} other slot(s)",
                               lease_id=lease.id, reason="abandoned")
        held = set(req.held)
        for key in sorted(held):
            if not (len(key) == len(lease.id) + SLOT_HEX and key.startswith(lease.id)
                    and all(c in "0123456789abcdef" for c in key[-SLOT_HEX:]) and int(key[-SLOT_HEX:], 16) < lease.granted):
                raise InvalidSpec(f"held: {key[:40]!r} is no slot of lease part {lease.id}", field="held")
        now = time.time()
        why = f"lease {lease.id} abandoned by its client (it never got this sandbox): destroyed"
        rows = s.execute(
            sa.select(SandboxRow.key, SandboxRow.id, SandboxRow.state)
            .where(SandboxRow.key >= slot_key(lease.id, 0), SandboxRow.key <= lease.id + "f" * SLOT_HEX)
            .order_by(SandboxRow.key).with_for_update()
        ).all()
        have = {k for k, _, _ in rows}
        unused = [k for k, sid, state in rows if k not in held and sid is None and state == S.CREATING.value]
        made = [k for k, sid, state in rows
                if k not in held and sid is not None and state in HOLDS_QUOTA | {S.FAILED.value}]
        missing = [k for k in (slot_key(lease.id, i) for i in range(lease.granted)) if k not in have and k not in held]
        gone: list[Any] = []
        for i in range(0, len(unused), 500):
            gone += s.execute(
                sa.update(_SB).where(_SB.c.key.in_(unused[i:i + 500]), _SB.c.id.is_(None),
                                     _SB.c.state == S.CREATING.value)
                .values(state=S.STOPPED.value, reason=why, updated_at=now)
                .returning(_SB.c.task_id, _SB.c.cpu_m, _SB.c.memory, _SB.c.disk)
            ).all()
        returned = _give_back(s, lease, gone)
        stopped: list[str] = []
        ledger = Ledger()
        for i in range(0, len(made), 500):
            for row in s.execute(sa.select(SandboxRow).where(SandboxRow.key.in_(made[i:i + 500]))
                                 .order_by(SandboxRow.key)).scalars():
                move(row, S.STOPPING, ledger, reason=why)
                stopped.append(str(row.id))
        ledger.flush(s)
        if missing:
            _insert_slots(s.connection(), [(self._ended_slot(s, lease, why, now), missing)])
        if lease.state == "active":
            lease.state, lease.closed_at, lease.reason = "closed", now, "abandoned"
        lease.abandon = {"request_id": req.request_id, "held": digest, "kept": len(held), "returned": returned,
                         "stopped": stopped, "at": now}
        return _Abandoned(lease.id, lease.edge_id, len(held), returned, stopped, False)

    def _ended_slot(self, s: Session, lease: CreateLeaseRow, why: str, now: float) -> dict[str, Any]:
        """The columns of a slot's row that holds nothing (``stopped``, no id) for ``lease``."""
        body = lease.body
        res = Resources.model_validate(body["spec"]["resources"])
        task_id = get_or_create_task(s, lease.project_id, body["task"], lock=False).id if body.get("task") else None
        url = s.execute(sa.select(EdgeRow.url).where(EdgeRow.id == lease.edge_id)).scalar_one_or_none() or ""
        labels = {**(body["spec"].get("labels") or {}), **(body.get("labels") or {})}
        return {
            "id": None, "edge_id": lease.edge_id, "edge_url": url, "project_id": lease.project_id, "task_id": task_id,
            "task_name": body.get("task"), "labels": json.dumps(labels), "state": S.STOPPED.value,
            "spec": json.dumps(body["spec"]), "lifecycle": json.dumps(body["lifecycle"]),
            "cpu_m": Amount.of_resources(res).cpu_m, "memory": res.memory, "disk": res.disk,
            "created_at": lease.created_at, "updated_at": now, "expires_at": now, "request_id": None,
            "request_hash": "", "reason": why, "launcher": None, "priority": self.sb.scheduler.cfg.default_priority,
        }

    # ------------------------------------------------------------ expiry --

    async def sweep(self) -> int:
        """Close the leases past their expiry and grace (any replica may; row locks make it once)."""
        cutoff = time.time() - EXPIRY_GRACE_S
        ids = await self.store.read(lambda s: list(s.execute(
            sa.select(CreateLeaseRow.id).where(CreateLeaseRow.state == "active", CreateLeaseRow.expires_at < cutoff)
            .limit(1000)).scalars()))
        if not ids:
            return 0
        n = await self.store.write(partial(self._close_txn, lease_ids=ids, reason="expired"))
        self.returned += n
        return n

    def start(self) -> None:
        async def loop() -> None:
            while True:
                await asyncio.sleep(SWEEP_EVERY_S)
                try:
                    await self.sweep()
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    log.warning("lease sweep failed (will retry): %s", exc)

        self._sweeper = asyncio.create_task(loop(), name="dsec-control-lease-sweep")

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
            self._sweeper = None


# ---------------------------------------------------------------- routes ----


def router(caller: Callable[..., Any], edge_admin: Callable[..., Any]) -> APIRouter:
    """``POST /v1/leases``, ``DELETE /v1/leases/{grant_id}``, ``POST /v1/leases/{grant_id}/abandon``
    (project tokens) and ``POST /v1/edges/{edge_id}/leases/report`` (edge-admin)."""
    r = APIRouter(tags=["leases"])
    project = Depends(caller)  # defaults, not annotations: annotations here are strings (PEP 563)
    edge = Depends(edge_admin)

    def leases_of(request: Request) -> Leases:
        got: Leases = request.app.state.ctl.leases
        return got

    @r.post("/v1/leases", status_code=201, response_model=LeaseGrant)
    async def create_lease(request: Request, body: CreateLease, who: Principal = project) -> Response:
        """Grant the right to create ``count`` sandboxes of one spec directly on edges (one signed
        token per edge part; docs/CONTROL.md, "Create leases"). Quota is charged now; the unused
        part returns on release or expiry. Grants what fits: ``short`` and ``error`` say what not."""
        from dsec.control import validate

        validate.finite(body.model_dump(mode="python"))
        validate.text(body.request_id, "request_id", max_len=128)
        grant = await leases_of(request).grant(who, body)
        return Response(grant.model_dump_json(), status_code=201, media_type="application/json")

    @r.delete("/v1/leases/{grant_id}", response_model=LeaseReleased)
    async def release_lease(request: Request, grant_id: str, who: Principal = project) -> LeaseReleased:
        """Done with a grant: its edges stop honouring it, what it made is recorded, the rest of
        its quota returns. Idempotent."""
        from dsec.control import validate

        validate.text(grant_id, "grant_id", max_len=64)
        return await leases_of(request).release(who, grant_id)

    @r.post("/v1/leases/{grant_id}/abandon", response_model=LeaseAbandoned)
    async def abandon_lease(request: Request, grant_id: str, body: AbandonLease,
                            who: Principal = project) -> LeaseAbandoned:
        """The SDK does not know what became of creates it sent to one part's edge (no answer): the
        part ends, the slots it does not hold (``held``: their keys) are given up, and whatever the
        edge made under them is destroyed (docs/CONTROL.md, "Create leases"). Idempotent."""
        from dsec.control import validate

        validate.text(grant_id, "grant_id", max_len=64)
        validate.text(body.lease_id, "lease_id", max_len=24)
        validate.text(body.request_id, "request_id", max_len=128)
        return await leases_of(request).abandon(who, grant_id, body)

    @r.post("/v1/edges/{edge_id}/leases/report")
    async def lease_report(request: Request, edge_id: str, body: LeaseReport,
                           _: Any = edge) -> dict[str, int]:
        """An edge's sandboxes made under leases (batched): each fills its slot's reservation."""
        from dsec.control import validate

        # what PostgreSQL would refuse from deep inside the transaction (a 500) is a 4xx here
        validate.edge_id_in_path(edge_id)
        validate.finite(body.model_dump(mode="python"))
        for i, item in enumerate(body.items):
            validate.text(item.key, f"items.{i}.key", max_len=32)
            validate.text(item.id, f"items.{i}.id", max_len=63)
            if "\x00" in item.reason:  # a reason may span lines; PostgreSQL refuses only NUL
                raise InvalidSpec(f"items.{i}.reason: no NUL characters", field=f"items.{i}.reason")
        return {"recorded": await leases_of(request).report(edge_id, body)}

    return r
