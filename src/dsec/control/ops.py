"""Operations on live sandboxes through the control plane: pause/resume (one or a group),
fork, snapshots (with the storage quota) and stages.

The control plane does the bookkeeping the edges cannot: quotas (a fork is charged
for its children before the edge makes any; a snapshot holds storage from the
moment it is asked for), ownership (a group pause only touches the caller's
sandboxes, never another project's with the same task name), and the store's
picture (paused at once, children listed and routable by id). Edges do the work;
group calls go to each edge once (chunks of ids), concurrently.

Every multi-step operation is reserve -> edge call -> settle, like a create: a
refusal happens before the edge is asked, a failed edge call releases the
reservation, and a reservation whose settle never came (a crash) is dropped by
the watcher (``_housekeeping_txn``), whose orphan reaper then removes children an
edge made for it.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

from dsec.control.db import EdgeRow, Project, SandboxRow, SnapshotRow, Store, Task
from dsec.control.edges import EdgeClient, edge_of
from dsec.control.errors import Conflict, NotFound
from dsec.control.iam import (
    Amount,
    Principal,
    check_fits,
    check_storage_fits,
    check_task_fits,
    find_task,
    lock_project,
    quota_of,
    reserved_of,
    subtree_ids,
    task_quota_of,
    used_of,
)
from dsec.control.ledger import Ledger, finish_many, move
from dsec.control.locking import lock_one
from dsec.control.placement import normalize_ref
from dsec.control.sandboxes import Sandboxes, labels_match
from dsec.errors import DsecError, InvalidSpec, LayerInUse, SandboxPreempted, SandboxStateError
from dsec.spec import ImageRef, SandboxState, can_move
from dsec.spec.api import (
    ForkRequest,
    GroupResult,
    PauseReport,
    SandboxInfo,
    SnapshotInfo,
    SnapshotRequest,
)
from dsec.spec.control import StorageInfo, StoredSnapshot

log = logging.getLogger("dsec.control.ops")

S = SandboxState
GROUP_CHUNK = 200
"""Ids per group call to one edge (they travel in the query string)."""
SNAP_HOLDS = ("creating", "ready", "deleting")
"""Snapshot row states that hold storage."""


@dataclass(frozen=True)
class _Target:
    sandbox_id: str
    edge_id: str
    url: str
    project: str


@dataclass(frozen=True)
class _ForkPlan:
    keys: list[str]
    edge_id: str
    url: str
    project: str


@dataclass(frozen=True)
class _SnapPlan:
    key: str
    edge_id: str
    url: str
    project: str
    held: int


def _image_refs(spec: dict[str, Any]) -> set[str]:
    try:
        img = ImageRef.model_validate(spec.get("image") or {})
    except Exception:
        return set()
    return {normalize_ref(r) for r in img.layers_top_first()}


class Operations:
    def __init__(self, sandboxes: Sandboxes) -> None:
        self.sb = sandboxes
        self.store: Store = sandboxes.store
        self.edges: EdgeClient = sandboxes.edges

    # ------------------------------------------------------------ helpers ----

    def _target_txn(self, s: Session, who: Principal, sandbox_id: str) -> _Target:
        row, project = self.sb.visible_row(s, who, sandbox_id)
        return _Target(sandbox_id, row.edge_id or edge_of(sandbox_id), row.edge_url, project)

    async def _target(self, who: Principal, sandbox_id: str) -> _Target:
        await self.sb.settled(sandbox_id)
        t = await self.store.read(lambda s: self._target_txn(s, who, sandbox_id))
        url = await self.sb.fresh_url(sandbox_id, t.url)
        return _Target(t.sandbox_id, t.edge_id, url, t.project)

    def _set_states_txn(self, s: Session, ids: Sequence[str], target: SandboxState) -> None:
        """The edge said these sandboxes are now ``target`` (running <-> paused: no counter moves)."""
        ledger = Ledger()
        for i in range(0, len(ids), 500):
            for row in s.execute(
                sa.select(SandboxRow).where(SandboxRow.id.in_(ids[i : i + 500])).with_for_update()
            ).scalars():
                if row.state != target.value and can_move(SandboxState(row.state), target):
                    move(row, target, ledger)
        ledger.flush(s)

    # ------------------------------------------------------- pause/resume ----

    async def pause(self, who: Principal, sandbox_id: str) -> PauseReport:
        t = await self._target(who, sandbox_id)
        rep = await self.edges.pause(t.edge_id, t.url, sandbox_id)
        await self.store.write(partial(self._set_states_txn, ids=[sandbox_id], target=S.PAUSED))
        return rep

    async def resume(self, who: Principal, sandbox_id: str) -> SandboxInfo:
        await self.sb.settled(sandbox_id)
        if await self.sb.scheduler.resume(who, sandbox_id, self.sb.rng):  # paused by preemption: room first
            return await self.sb.get(who, sandbox_id)
        t = await self._target(who, sandbox_id)
        await self.edges.resume(t.edge_id, t.url, sandbox_id)
        await self.store.write(partial(self._set_states_txn, ids=[sandbox_id], target=S.RUNNING))
        return await self.sb.get(who, sandbox_id)

    def _select_txn(
        self, s: Session, who: Principal, *, task: str | None, labels: dict[str, str | None],
        ids: Sequence[str], states: Iterable[str],
    ) -> list[tuple[str, str, str]]:
        q = sa.select(SandboxRow.id, SandboxRow.edge_id, SandboxRow.edge_url, SandboxRow.labels).where(
            SandboxRow.project_id.in_(subtree_ids(s, who.project_id)),
            SandboxRow.id.is_not(None),
            SandboxRow.state.in_(tuple(states)),
        )
        if task is not None:
            q = q.where(SandboxRow.task_name == task)
        if ids:
            q = q.where(SandboxRow.id.in_(list(ids)))
        return [
            (str(r.id), r.edge_id or edge_of(str(r.id)), r.edge_url)
            for r in s.execute(q)
            if labels_match(r.labels or {}, labels)
        ]

    async def group(
        self, who: Principal, op: str, *, task: str | None, labels: dict[str, str | None], ids: Sequence[str]
    ) -> GroupResult:
        """Pause or resume every sandbox of the caller's selected by task / labels / ids: one call
        per edge (in chunks), all edges at once; outcomes per sandbox."""
        if task is None and not labels and not ids:
            raise InvalidSpec(f"say which sandboxes to {op}: a task, labels or ids", field="task")
        t0 = time.monotonic()
        await self.sb.settled()
        live = (S.RUNNING.value, S.PAUSED.value)
        rows = await self.store.read(
            lambda s: self._select_txn(s, who, task=task, labels=labels, ids=ids, states=live)
        )
        out = GroupResult()
        found = {r[0] for r in rows}
        for sid in dict.fromkeys(ids):
            if sid not in found:
                out.errors[sid] = {
                    "code": "sandbox_not_found",
                    "message": f"no running or paused sandbox {sid!r} in project {who.project!r}",
                    "sandbox_id": sid,
                }
        by_edge: dict[str, tuple[str, list[str]]] = {}
        for sid, edge_id, url in rows:
            by_edge.setdefault(edge_id, (url, []))[1].append(sid)

        async def one_edge(edge_id: str, stored: str, sids: list[str]) -> None:
            url = await self.sb.directory.url(edge_id) or stored
            for i in range(0, len(sids), GROUP_CHUNK):
                chunk = sids[i : i + GROUP_CHUNK]
                try:
                    res = await self.edges.group(edge_id, url, op, chunk)
                except DsecError as exc:
                    for sid in chunk:
                        out.errors[sid] = exc.to_wire()
                    continue
                out.done.extend(res.done)
                out.skipped.extend(res.skipped)
                out.errors.update(res.errors)
                missing = set(chunk) - set(res.done) - set(res.skipped) - set(res.errors)
                for sid in missing:  # the edge no longer has it (the watcher will mark it stopped)
                    out.errors[sid] = {"code": "sandbox_not_found", "message": f"edge {edge_id} has no {sid}",
                                       "sandbox_id": sid}

        await asyncio.gather(*(one_edge(e, u, sids) for e, (u, sids) in by_edge.items()))
        if op == "resume":  # those paused by preemption resume only where the scheduler finds them room
            held = [sid for sid, err in out.errors.items() if err.get("code") == SandboxPreempted.code]
            sem = asyncio.Semaphore(16)

            async def again(sid: str) -> None:
                async with sem:
                    try:
                        await self.sb.scheduler.resume(who, sid, self.sb.rng)
                    except DsecError as exc:
                        out.errors[sid] = exc.to_wire()
                        return
                out.errors.pop(sid, None)
                out.done.append(sid)

            await asyncio.gather(*(again(sid) for sid in held))
        target = S.PAUSED if op == "pause" else S.RUNNING
        settled = out.done + out.skipped
        if settled:
            await self.store.write(partial(self._set_states_txn, ids=settled, target=target))
        out.seconds = time.monotonic() - t0
        return out

    # --------------------------------------------------------------- fork ----

    def _fork_reserve_txn(self, s: Session, who: Principal, sandbox_id: str, req: ForkRequest) -> _ForkPlan:
        """Charge the children to the parent's project and task, or refuse before anything is made.
        The parent is locked as it is looked up: a concurrent delete either comes first (409, or
        404 once its row is gone) or waits until the reservation is made."""
        row, project = self.sb.visible_row(s, who, sandbox_id, lock=True)
        if row.state not in (S.RUNNING.value, S.PAUSED.value):
            raise SandboxStateError(
                f"sandbox {sandbox_id} is {row.state}: only a running or paused sandbox can be forked",
                sandbox_id=sandbox_id, state=row.state,
            )
        p = lock_project(s, row.project_id)
        want = Amount(req.n, row.cpu_m * req.n, row.memory * req.n)
        check_fits(project=p.name, quota=quota_of(p), used=used_of(p), reserved=reserved_of(p), want=want)
        task_id: int | None = None
        if row.task_id is not None:
            t = s.execute(
                sa.select(Task).where(Task.id == row.task_id).with_for_update().execution_options(populate_existing=True)
            ).scalar_one_or_none()
            if t is not None:  # gone meanwhile: the children get no task (its delete clears the parent's too)
                check_task_fits(task=t.name, project=p.name, quota=task_quota_of(t), used=used_of(t), want=want)
                task_id = t.id
        now = time.time()
        life = req.lifecycle.model_dump(mode="json") if req.lifecycle is not None else dict(row.lifecycle or {})
        ttl = float(life.get("ttl_s") or 3600.0)
        labels = dict(req.labels) if req.labels is not None else dict(row.labels or {})
        ledger = Ledger()
        keys: list[str] = []
        for _ in range(req.n):
            child = SandboxRow(
                key=uuid.uuid4().hex, id=None, edge_id=row.edge_id, edge_url=row.edge_url,
                project_id=row.project_id, task_id=task_id, task_name=row.task_name, labels=labels,
                state=S.CREATING.value, spec=dict(row.spec), lifecycle=life, cpu_m=row.cpu_m,
                memory=row.memory, disk=row.disk, created_at=now, updated_at=now, expires_at=now + ttl,
                request_id=None, request_hash="", reason=f"fork of {sandbox_id}",
            )
            s.add(child)
            ledger.charge(child, None, S.CREATING.value)
            keys.append(child.key)
        s.flush()
        ledger.flush(s)
        return _ForkPlan(keys, row.edge_id or edge_of(sandbox_id), row.edge_url, project)

    def _fork_settle_txn(
        self, s: Session, keys: list[str], kids: list[SandboxInfo], project: str
    ) -> tuple[list[SandboxInfo], list[str]]:
        """Give the reservations the children's ids; returns the answers and children nobody wants."""
        ledger = Ledger()
        out: list[SandboxInfo] = []
        doomed: list[str] = []
        rows = {r.key: r for r in s.execute(
            sa.select(SandboxRow).where(SandboxRow.key.in_(keys)).with_for_update()
        ).scalars()}
        for key, kid in zip(keys, kids, strict=False):
            row = rows.get(key)
            if row is None or row.state != S.CREATING.value:  # deleted (or dropped) meanwhile
                if row is not None:
                    row.id = kid.id
                doomed.append(kid.id)
                continue
            row.id = kid.id
            row.edge_url = kid.edge_url or row.edge_url
            row.created_at = kid.created_at or row.created_at
            row.expires_at = kid.expires_at if kid.expires_at is not None else row.expires_at
            if kid.image is not None:
                row.spec = {**row.spec, "image": kid.image.model_dump(mode="json")}
            row.reason = ""
            if kid.state in (S.RUNNING, S.PAUSED, S.FAILED):
                move(row, kid.state, ledger)
            out.append(self.sb.info(row, project, token=True))
        for key in keys[len(kids):]:  # fewer children than asked: give the rest back
            row = rows.get(key)
            if row is not None and row.id is None:
                ledger.charge(row, row.state, None)
                s.delete(row)
        doomed.extend(k.id for k in kids[len(keys):])
        ledger.flush(s)
        return out, doomed

    def _release_txn(self, s: Session, keys: list[str]) -> None:
        ledger = Ledger()
        for row in s.execute(
            sa.select(SandboxRow).where(SandboxRow.key.in_(keys), SandboxRow.id.is_(None)).with_for_update()
        ).scalars():
            ledger.charge(row, row.state, None)
            s.delete(row)
        ledger.flush(s)

    async def fork(self, who: Principal, sandbox_id: str, req: ForkRequest) -> list[SandboxInfo]:
        await self.sb.settled(sandbox_id)
        plan = await self.store.write(lambda s: self._fork_reserve_txn(s, who, sandbox_id, req))
        url = await self.sb.fresh_url(sandbox_id, plan.url)
        try:
            kids = await self.edges.fork(plan.edge_id, url, sandbox_id, req)
        except BaseException:
            await asyncio.shield(self.store.write(partial(self._release_txn, keys=plan.keys)))
            raise
        infos, doomed = await self.store.write(
            partial(self._fork_settle_txn, keys=plan.keys, kids=kids, project=plan.project)
        )
        for sid in doomed:
            await self.sb.edge_delete_quietly(plan.edge_id, url, sid)
        if doomed:
            await self.store.write(partial(finish_many, ids=doomed))
        return infos

    # ---------------------------------------------------------- snapshots ----

    def _snap_reserve_txn(self, s: Session, who: Principal, sandbox_id: str) -> _SnapPlan:
        """Hold storage for the snapshot before anything is frozen: the sandbox's disk limit (the
        upper cannot outgrow it) or what is left, whichever is less; refuse when nothing is left.
        The sandbox is locked as it is looked up, as for a fork."""
        row, project = self.sb.visible_row(s, who, sandbox_id, lock=True)
        if row.state not in (S.RUNNING.value, S.PAUSED.value):
            raise SandboxStateError(
                f"sandbox {sandbox_id} is {row.state}: only a running or paused sandbox can be snapshotted",
                sandbox_id=sandbox_id, state=row.state,
            )
        p = lock_project(s, row.project_id)
        available = p.quota_storage - p.used_storage - p.reserved_storage
        if available <= 0:
            check_storage_fits(project=p.name, quota=p.quota_storage, used=p.used_storage,
                               reserved=p.reserved_storage, want=max(1, row.disk))
        held = max(1, min(row.disk, available))
        now = time.time()
        key = uuid.uuid4().hex
        s.add(SnapshotRow(
            key=key, project_id=p.id, edge_id=row.edge_id or edge_of(sandbox_id), sandbox_id=sandbox_id,
            state="creating", digest=None, ref="", size=held, parents=[], info=None, created_at=now, updated_at=now,
        ))
        p.used_storage += held
        s.flush()
        return _SnapPlan(key, row.edge_id or edge_of(sandbox_id), row.edge_url, project, held)

    def _snap_release_txn(self, s: Session, key: str) -> None:
        row = s.get(SnapshotRow, key, with_for_update=True)
        if row is None:
            return
        p = lock_project(s, row.project_id)
        p.used_storage -= row.size
        s.delete(row)

    def _snap_settle_txn(self, s: Session, key: str, got: SnapshotInfo) -> StoredSnapshot | DsecError:
        """Charge what the snapshot really takes; over the quota: release and say so (the caller
        removes the layer from the edge)."""
        row = s.get(SnapshotRow, key, with_for_update=True)
        if row is None:  # the watcher drops reservations older than an hour (_housekeeping_txn)
            return Conflict("the snapshot's reservation was dropped before the edge finished it: take it again",
                            key=key)
        p = lock_project(s, row.project_id)
        dup = s.execute(
            sa.select(SnapshotRow).where(
                SnapshotRow.project_id == row.project_id, SnapshotRow.edge_id == row.edge_id,
                SnapshotRow.digest == got.digest, SnapshotRow.key != key,
            )
        ).scalar_one_or_none()
        if dup is not None:  # the same content again: one layer, charged once
            p.used_storage -= row.size
            s.delete(row)
            return self._stored(dup, p.name)
        extra = got.size - row.size
        if extra > 0 and p.used_storage + p.reserved_storage + extra > p.quota_storage:
            p.used_storage -= row.size
            s.delete(row)
            s.flush()
            try:
                check_storage_fits(project=p.name, quota=p.quota_storage, used=p.used_storage,
                                   reserved=p.reserved_storage, want=got.size)
            except DsecError as exc:
                return exc
        p.used_storage += extra
        row.size = got.size
        row.state = "ready"
        row.digest = got.digest
        row.ref = got.ref
        row.parents = list(got.parents)
        row.info = got.model_dump(mode="json")
        row.updated_at = time.time()
        e = s.get(EdgeRow, row.edge_id, with_for_update=True)
        if e is not None and e.health is not None:  # placement knows the edge holds it before its next report
            layers = list(e.health.get("layers") or [])
            e.health = {**e.health, "layers": layers + [x for x in (got.digest, got.ref) if x not in layers]}
        s.flush()
        return self._stored(row, p.name)

    @staticmethod
    def _stored(row: SnapshotRow, project: str) -> StoredSnapshot:
        data = dict(row.info or {})
        data.update(project=project, edge_id=row.edge_id)
        return StoredSnapshot.model_validate(data)

    async def snapshot(self, who: Principal, sandbox_id: str, req: SnapshotRequest) -> StoredSnapshot:
        await self.sb.settled(sandbox_id)
        plan = await self.store.write(lambda s: self._snap_reserve_txn(s, who, sandbox_id))
        url = await self.sb.fresh_url(sandbox_id, plan.url)
        try:
            got = await self.edges.snapshot(plan.edge_id, url, sandbox_id, req)
        except BaseException:
            await asyncio.shield(self.store.write(partial(self._snap_release_txn, key=plan.key)))
            raise
        res = await self.store.write(partial(self._snap_settle_txn, key=plan.key, got=got))
        if isinstance(res, DsecError):
            if not await self._digest_held(plan.edge_id, got.digest):
                try:
                    await self.edges.delete_snapshot(plan.edge_id, url, got.digest)
                except DsecError as exc:
                    log.warning("snapshot %s over quota, and its removal from edge %s failed: %s",
                                got.digest, plan.edge_id, exc)
            raise res
        return res

    async def _digest_held(self, edge_id: str, digest: str) -> bool:
        return bool(await self.store.read(lambda s: s.execute(
            sa.select(SnapshotRow.key).where(SnapshotRow.edge_id == edge_id, SnapshotRow.digest == digest).limit(1)
        ).first()))

    async def snapshots(self, who: Principal) -> list[StoredSnapshot]:
        def txn(s: Session) -> list[StoredSnapshot]:
            rows = s.execute(
                sa.select(SnapshotRow, Project.name).join(Project, Project.id == SnapshotRow.project_id)
                .where(SnapshotRow.project_id.in_(subtree_ids(s, who.project_id)), SnapshotRow.state == "ready")
                .order_by(SnapshotRow.created_at)
            ).all()
            return [self._stored(r, name) for r, name in rows]

        return await self.store.read(txn)

    def _find_snapshot(self, s: Session, who: Principal, ref: str) -> SnapshotRow:
        """The newest ready snapshot called ``ref``, else one being deleted (the caller says 409)."""
        want = normalize_ref(ref)
        rows = s.execute(
            sa.select(SnapshotRow).where(
                SnapshotRow.project_id.in_(subtree_ids(s, who.project_id)),
                SnapshotRow.state.in_(("ready", "deleting")),
                sa.or_(SnapshotRow.digest == ref, SnapshotRow.ref == ref, SnapshotRow.ref == want),
            ).order_by(sa.case((SnapshotRow.state == "ready", 0), else_=1), SnapshotRow.created_at.desc())
        ).scalars().all()
        if not rows:
            raise NotFound(f"no snapshot {ref!r} in project {who.project!r} (`dsec snapshot ls` lists them)", ref=ref)
        return rows[0]

    def _users(self, s: Session, snap: SnapshotRow) -> tuple[list[str], list[str]]:
        """Live sandboxes started from the snapshot, and snapshots taken over it."""
        names = {snap.digest or "", normalize_ref(snap.ref)} - {""}
        users = [
            str(r.id or r.key) for r in s.execute(
                sa.select(SandboxRow.id, SandboxRow.key, SandboxRow.spec).where(
                    SandboxRow.edge_id == snap.edge_id,
                    SandboxRow.state.in_((S.CREATING.value, S.RUNNING.value, S.PAUSED.value, S.STOPPING.value)),
                )
            )
            if _image_refs(r.spec or {}) & names
        ]
        above = [
            r.ref or str(r.digest) for r in s.execute(
                sa.select(SnapshotRow).where(SnapshotRow.edge_id == snap.edge_id, SnapshotRow.key != snap.key)
            ).scalars()
            if snap.digest in (r.parents or [])
        ]
        return users, above

    def _delete_check_txn(self, s: Session, who: Principal, ref: str) -> tuple[str, str, str, bool]:
        found = self._find_snapshot(s, who, ref)
        # locked after the lookup (which may match several rows): a concurrent delete of the same
        # snapshot either finished (404) or is under way (409), and only one of them asks the edge
        snap = lock_one(s, sa.select(SnapshotRow).where(SnapshotRow.key == found.key),
                        lambda: NotFound(f"no snapshot {ref!r} in project {who.project!r}", ref=ref))
        if snap.state != "ready":
            raise Conflict(f"snapshot {ref} is {snap.state}: another call is deleting it", ref=ref, state=snap.state)
        users, above = self._users(s, snap)
        if users:
            raise Conflict(
                f"snapshot {snap.ref} is used by {len(users)} sandbox(es) ({', '.join(users[:5])}): "
                f"delete them first", ref=snap.ref, sandboxes=users[:100],
            )
        if above:
            raise Conflict(
                f"snapshot {snap.ref} is beneath other snapshots ({', '.join(above[:5])}): delete those first",
                ref=snap.ref, snapshots=above[:100],
            )
        snap.state = "deleting"
        shared = s.execute(
            sa.select(SnapshotRow.key).where(
                SnapshotRow.edge_id == snap.edge_id, SnapshotRow.digest == snap.digest, SnapshotRow.key != snap.key
            ).limit(1)
        ).first() is not None
        return snap.key, snap.edge_id, str(snap.digest), shared

    def _delete_done_txn(self, s: Session, key: str, *, gone: bool) -> None:
        row = s.get(SnapshotRow, key, with_for_update=True)
        if row is None:
            return
        if not gone:
            row.state = "ready"
            return
        p = lock_project(s, row.project_id)
        p.used_storage -= row.size
        s.delete(row)

    async def delete_snapshot(self, who: Principal, ref: str) -> None:
        key, edge_id, digest, shared = await self.store.write(lambda s: self._delete_check_txn(s, who, ref))
        try:
            if not shared:  # another project keeps the same layer: only our claim goes
                url = await self.sb.directory.url(edge_id)
                if url is None:
                    raise NotFound(f"edge {edge_id} holding snapshot {ref} is not registered", edge_id=edge_id)
                await self.edges.delete_snapshot(edge_id, url, digest)
        except LayerInUse as exc:
            await self.store.write(partial(self._delete_done_txn, key=key, gone=False))
            raise Conflict(f"snapshot {ref} is in use on edge {edge_id}: {exc}", ref=ref,
                           holders=exc.fields.get("holders")) from None
        except BaseException:
            await asyncio.shield(self.store.write(partial(self._delete_done_txn, key=key, gone=False)))
            raise
        await self.store.write(partial(self._delete_done_txn, key=key, gone=True))

    async def storage(self, who: Principal, project: str) -> StorageInfo:
        from dsec.control.iam import visible_project

        def txn(s: Session) -> StorageInfo:
            p = visible_project(s, who, project)
            n = s.execute(
                sa.select(sa.func.count()).select_from(SnapshotRow).where(SnapshotRow.project_id == p.id)
            ).scalar_one()
            return StorageInfo(
                project=p.name, quota=p.quota_storage, used=p.used_storage, reserved=p.reserved_storage,
                available=max(0, p.quota_storage - p.used_storage - p.reserved_storage), snapshots=int(n),
            )

        return await self.store.read(txn)

    # ------------------------------------------------------------- stages ----

    def _stage_txn(self, s: Session, who: Principal, task: str, stage: str) -> list[tuple[str, str, str]]:
        t = find_task(s, who, task, lock=True)  # a concurrent delete of the task: 404, never a 500
        doc = t.stages or {}
        stages = doc.get("stages") or {}
        if stage not in stages:
            known = ", ".join(sorted(stages)) or "none declared"
            raise InvalidSpec(
                f"task {task!r} has no stage {stage!r} (its stages: {known}); declare it with POST /v1/tasks",
                field="stage", task=task, stages=sorted(stages),
            )
        t.stages = {**doc, "stage": stage}  # sandboxes created from now on start in it
        rows = s.execute(
            sa.select(SandboxRow.id, SandboxRow.edge_id, SandboxRow.edge_url).where(
                SandboxRow.task_id == t.id, SandboxRow.id.is_not(None),
                SandboxRow.state.in_((S.RUNNING.value, S.PAUSED.value)),
            )
        ).all()
        return [(str(r.id), r.edge_id or edge_of(str(r.id)), r.edge_url) for r in rows]

    async def set_task_stage(self, who: Principal, task: str, stage: str) -> GroupResult:
        """Switch every running or paused sandbox of the task to ``stage`` (one edge call each,
        64 at a time); outcomes per sandbox. The task remembers it for sandboxes made later."""
        t0 = time.monotonic()
        await self.sb.settled()
        rows = await self.store.write(lambda s: self._stage_txn(s, who, task, stage))
        out = GroupResult()
        sem = asyncio.Semaphore(64)

        async def one(sid: str, edge_id: str, stored: str) -> None:
            async with sem:
                try:
                    url = await self.sb.fresh_url(sid, stored)
                    await self.edges.set_stage(edge_id, url, sid, stage)
                    out.done.append(sid)
                except DsecError as exc:
                    out.errors[sid] = exc.to_wire()

        await asyncio.gather(*(one(*r) for r in rows))
        out.seconds = time.monotonic() - t0
        return out

    async def set_stage(self, who: Principal, sandbox_id: str, stage: str) -> SandboxInfo:
        t = await self._target(who, sandbox_id)
        await self.edges.set_stage(t.edge_id, t.url, sandbox_id, stage)
        return await self.sb.get(who, sandbox_id)
