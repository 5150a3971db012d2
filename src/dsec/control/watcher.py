"""The watcher: keeps the store's picture of the edges and their sandboxes true.

One replica at a time runs it (a lease row in the store elects the leader;
another replica takes over when the lease lapses). Each round it:

- polls every edge's ``GET /v1/health``; an edge that misses
  ``dead_after_misses`` polls in a row, or is not heard from (poll or
  heartbeat) for ``dead_after_s``, is marked dead (placement skips it, and
  every replica already skips an edge whose last report is that old), and one
  that answers again is alive again;
- fences an edge that comes back after its sandboxes were declared lost:
  ``POST /v1/fence`` with the edge's epoch makes it destroy everything it made
  before, and only then does placement use it again (docs/CONTROL.md, "Fencing");
- finishes the creates of a replica that stopped beating (control/replicas.py):
  the reservation's edge is asked for the sandbox under the reservation's key
  (made then, or the one already made) and the answer is recorded;
- every ``reconcile_interval_s``, compares each live edge's sandbox list with
  the store: sandboxes the edge no longer has are marked stopped (their quota
  returns), deletions that did not reach the edge are retried, and sandboxes
  the edge holds for a project but the store does not know (a create whose
  answer was lost) are deleted after ``orphan_grace_s`` — at once when the
  key it was made under names a row that has ended without it (deleted while
  in flight, a lease slot its SDK abandoned);
- declares the sandboxes of an edge not heard from for ``edge_lost_after_s``
  ``lost`` (quota returned, the edge's epoch raised),
  drops reservations whose create never finished, forgets stopped sandboxes
  after ``retention_s``, and now and then recomputes every counter from the
  sandbox rows (so a drift cannot last).

It never blocks the event loop (store work runs in the store's threads) and
never lets one failing edge stop the round.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from dsec.control import replicas
from dsec.control.config import ControlConfig
from dsec.control.db import EdgeRow, Lease, Project, SandboxRow, SnapshotRow, Store, Task
from dsec.control.edges import (
    EdgeClient,
    EdgeDirectory,
    EdgeRemoved,
    needs_fence,
    record_health_txn,
)
from dsec.control.ledger import HOLDS_EDGE, HOLDS_QUOTA, LIVE, Ledger, finish_many, forget, move
from dsec.control.membership import declare_lost
from dsec.errors import DsecError
from dsec.spec import SandboxState, can_move
from dsec.spec.api import EdgeHealth, SandboxInfo

log = logging.getLogger("dsec.control.watcher")

S = SandboxState
LEASE = "watcher"
RECOUNT_EVERY_S = 60.0
CLOCK_SKEW_S = 5.0
"""How far an edge's clock may be off the control plane's without misreading what its times mean
(a TTL expiry reported as "gone"); tests/cluster/test_faults.py runs edges 2 s ahead and behind."""


class Watcher:
    def __init__(
        self, config: ControlConfig, store: Store, edges: EdgeClient, directory: EdgeDirectory,
        *, create_budget_s: float,
    ) -> None:
        self.config = config
        self.store = store
        self.edges = edges
        self.directory = directory
        self.holder = uuid.uuid4().hex
        self.create_budget_s = create_budget_s
        self._reconciled: dict[str, float] = {}
        self._recounted = 0.0
        self.rounds = 0
        self.fenced: list[tuple[str, int, list[str]]] = []
        """(edge, epoch, sandboxes destroyed) of the fences this watcher applied (tests, bench)."""
        self.on_tick: Callable[[], Awaitable[None]] | None = None
        """Run at the end of each round this replica leads (the burst controller, burst.py)."""
        self.recording: Callable[[], frozenset[str]] = frozenset
        """Ids of the sandboxes whose create this replica answered and is recording now
        (``Sandboxes.recording``): the reconcile leaves them to that record."""

    @property
    def lease_ttl(self) -> float:
        return max(3 * self.config.watcher_interval_s, 5.0)

    async def run(self) -> None:
        while True:
            started = time.monotonic()
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("watcher round failed")
            await asyncio.sleep(max(0.0, self.config.watcher_interval_s - (time.monotonic() - started)))

    async def release(self) -> None:
        def txn(s: Session) -> None:
            s.execute(sa.update(Lease).where(Lease.name == LEASE, Lease.holder == self.holder).values(expires_at=0.0))

        with contextlib.suppress(Exception):
            await self.store.write(txn)

    # ---------------------------------------------------------------- round ----

    async def tick(self, *, reconcile: bool = False) -> bool:
        """One round; False when another replica holds the lease. ``reconcile``: list every edge now."""
        if not await self.store.write(self._lease_txn):
            return False
        self.rounds += 1
        edges = await self.store.read(
            lambda s: [(e.id, e.url) for e in s.execute(
                sa.select(EdgeRow).where(EdgeRow.status != "removed").order_by(EdgeRow.id)).scalars()]
        )
        polls = await asyncio.gather(*(self._poll(eid, url) for eid, url in edges))
        alive, fence = await self.store.write(lambda s: self._record_polls_txn(s, polls))
        if fence:
            await asyncio.gather(*(self.fence(eid, url, epoch) for eid, url, epoch in fence))
        await self.finish_orphaned_creates()
        now = time.time()
        due = [
            (eid, url) for eid, url in alive
            if reconcile or now - self._reconciled.get(eid, 0.0) >= self.config.reconcile_interval_s
        ]
        await asyncio.gather(*(self.reconcile(eid, url) for eid, url in due))
        await self.store.write(self._housekeeping_txn)
        if now - self._recounted >= RECOUNT_EVERY_S:
            self._recounted = now
            await self.store.write(recount_txn)
        if self.on_tick is not None:
            await self.on_tick()
        return True

    def _lease_txn(self, s: Session) -> bool:
        now = time.time()
        lease = s.get(Lease, LEASE, with_for_update=True)
        if lease is None:
            try:
                with s.begin_nested():
                    s.add(Lease(name=LEASE, holder=self.holder, expires_at=now + self.lease_ttl))
            except IntegrityError:
                return False
            return True
        if lease.holder == self.holder or lease.expires_at < now:
            if lease.holder != self.holder:
                log.info("watcher lease taken over by %s", self.holder)
            lease.holder = self.holder
            lease.expires_at = now + self.lease_ttl
            return True
        return False

    async def _poll(self, edge_id: str, url: str) -> tuple[str, EdgeHealth | None, str]:
        try:
            # the whole call, connecting included: a host cut off answers nothing, not even a refusal
            async with asyncio.timeout(self.config.poll_timeout_s):
                h = await self.edges.health(edge_id, url, timeout=self.config.poll_timeout_s)
        except TimeoutError:
            return edge_id, None, f"no answer in {self.config.poll_timeout_s:g}s"
        except DsecError as exc:
            return edge_id, None, str(exc)
        except Exception as exc:  # a garbled answer counts as a miss
            return edge_id, None, f"{type(exc).__name__}: {exc}"
        if h.edge_id != edge_id:
            return edge_id, None, f"answered as edge {h.edge_id!r}"
        return edge_id, h, ""

    def _record_polls_txn(
        self, s: Session, polls: Sequence[tuple[str, EdgeHealth | None, str]]
    ) -> tuple[list[tuple[str, str]], list[tuple[str, str, int]]]:
        """Returns the edges alive (to reconcile) and those to fence (edge, url, epoch)."""
        alive: list[tuple[str, str]] = []
        fence: list[tuple[str, str, int]] = []
        now = time.time()
        for edge_id, health, err in polls:
            if health is not None:
                try:
                    info = record_health_txn(s, health)
                except EdgeRemoved:
                    continue
                except DsecError as exc:
                    log.warning("edge %s sent an unusable health report: %s", edge_id, exc)
                    continue
                self.directory.put(edge_id, info.url)
                if info.status == "fencing":
                    fence.append((edge_id, info.url, info.epoch))
                else:
                    alive.append((edge_id, info.url))
                continue
            e = s.get(EdgeRow, edge_id, with_for_update=True)
            if e is None or e.status == "removed":
                continue
            e.misses += 1
            silent = e.last_seen is None or now - e.last_seen > self.config.dead_after_s
            if e.status != "dead" and (e.misses >= self.config.dead_after_misses or silent):
                e.status = "dead"
                log.warning("edge %s is dead: %d missed polls, last heard from %s ago: %s", edge_id, e.misses,
                            "never" if e.last_seen is None else f"{now - e.last_seen:.1f}s", err)
        return alive, fence

    # -------------------------------------------------------------- fencing ----

    async def fence(self, edge_id: str, url: str, epoch: int) -> bool:
        """Make the edge destroy what it made before ``epoch`` (sandboxes declared lost), then
        let placement use it again. The edge refuses nothing here: the control plane's word wins."""
        try:
            res = await self.edges.fence(edge_id, url, epoch)
        except DsecError as exc:
            log.warning("cannot fence edge %s at epoch %d (next round tries again): %s", edge_id, epoch, exc)
            return False
        log.warning("edge %s fenced at epoch %d: %d sandbox(es) it still held destroyed", edge_id, res.epoch,
                    len(res.destroyed))
        self.fenced.append((edge_id, res.epoch, list(res.destroyed)))

        def txn(s: Session) -> None:
            e = s.get(EdgeRow, edge_id, with_for_update=True)
            if e is not None and e.status == "fencing" and not needs_fence(e, res.epoch):
                e.status = "alive"
                if e.health is not None:
                    e.health = {**e.health, "epoch": res.epoch}
                e.last_seen = time.time()

        await self.store.write(txn)
        return True

    # ---------------------------------------------------- orphaned creates ----

    async def finish_orphaned_creates(self, *, limit: int = 256) -> int:
        """Reservations whose launching replica stopped beating: ask their edge for the sandbox
        under the reservation's key (the edge de-duplicates by it: the one the dead replica made,
        or a new one) and record it; a refusal releases the reservation (the client's retry places
        it again). Returns how many were settled."""
        dead_after = self.config.replica_dead_after_s

        def find(s: Session) -> list[tuple[SandboxRow, str, str]]:
            live = replicas.live_replicas(s, dead_after_s=dead_after)
            q = (sa.select(SandboxRow, Project.name, EdgeRow.url)
                 .join(Project, Project.id == SandboxRow.project_id)
                 .join(EdgeRow, EdgeRow.id == SandboxRow.edge_id)
                 .where(SandboxRow.id.is_(None), SandboxRow.state == S.CREATING.value,
                        SandboxRow.launcher.is_not(None), SandboxRow.updated_at < time.time() - 1.0,
                        EdgeRow.status == "alive")
                 .order_by(SandboxRow.created_at).limit(limit * 4))
            return [(r, p, u) for r, p, u in s.execute(q) if r.launcher not in live][:limit]

        orphans = await self.store.read(find)
        if not orphans:
            return 0
        sem = asyncio.Semaphore(32)

        async def one(row: SandboxRow, project: str, url: str) -> bool:
            body = {"spec": row.spec, "lifecycle": row.lifecycle, "labels": dict(row.labels or {}),
                    "task": row.task_name, "request_id": row.key, "project": project}
            async with sem:
                try:
                    got = await self.edges.create(str(row.edge_id), url, body)
                except DsecError as exc:
                    if getattr(exc, "maybe_done", False) or exc.code == "host_error":
                        return False  # unreachable: the next round (or the edge's loss) settles it
                    log.warning("finishing create %s of a dead replica on edge %s: refused (%s); released",
                                row.key, row.edge_id, exc)
                    await self.store.write(lambda s: _release_txn(s, row.key))
                    return True
            await self.store.write(lambda s: _record_txn(s, row.key, got))
            log.warning("finished create %s of a dead replica: sandbox %s on edge %s", row.key, got.id, row.edge_id)
            return True

        done = await asyncio.gather(*(one(r, p, u) for r, p, u in orphans))
        return sum(done)

    # ------------------------------------------------------------ reconcile ----

    async def reconcile(self, edge_id: str, url: str) -> None:
        listed_at = time.time()  # before the listing: a row recorded since may be missing from it
        try:
            listing = await self.edges.list(edge_id, url)
        except Exception as exc:
            log.warning("cannot list the sandboxes of edge %s: %s", edge_id, exc)
            return
        self._reconciled[edge_id] = time.time()
        on_edge = {sb.id: sb for sb in listing}
        recording = self.recording()  # after the listing: every create it shows was answered before
        doomed = await self.store.write(lambda s: self._reconcile_txn(s, edge_id, on_edge, listed_at, recording))
        if not doomed:
            return
        sem = asyncio.Semaphore(32)

        async def kill(sandbox_id: str) -> str | None:
            async with sem:
                try:
                    await self.edges.delete(edge_id, url, sandbox_id)
                    return sandbox_id
                except DsecError as exc:
                    log.warning("watcher: delete of %s on edge %s failed: %s", sandbox_id, edge_id, exc)
                    return None

        gone = [x for x in await asyncio.gather(*(kill(i) for i in doomed)) if x]
        if gone:
            await self.store.write(lambda s: finish_many(s, gone))

    def _reconcile_txn(
        self, s: Session, edge_id: str, on_edge: dict[str, SandboxInfo], listed_at: float | None = None,
        recording: frozenset[str] = frozenset(),
    ) -> list[str]:
        """Apply what the edge holds to the store; returns ids to delete on the edge.

        ``listed_at``: when the listing was asked for. A row changed since (a create recorded
        after the edge answered the listing) is not judged missing from it: the edge made the
        sandbox after its list was taken, and calling it gone would stop a live sandbox (and
        the next round would delete it on the edge as "stopped in the store").

        ``recording``: sandboxes whose create this replica answered and is recording now (the
        record is group-committed after the answer): left to that record.

        A sandbox the store does not know yet, made under a reservation's key, is recorded into
        that reservation at once. When it is younger than ``orphan_grace_s`` this is the race
        between the listing and the sandbox's own record, and harmless: a create's answer
        being recorded by another replica (or by this one after ``recording`` was read), or an
        edge's lease report still on its way (edges batch them every 50 ms) — that record then
        finds the same sandbox recorded and changes nothing (``Sandboxes._commit_txn``,
        ``Leases.report``); logged at info. Older, the answer was lost (its replica died, the
        reports failed): a warning."""
        now = time.time()
        ledger = Ledger()
        doomed: list[str] = []
        # Judged on a light read first (key, id, state, times: no JSON, no ORM objects, no locks),
        # then only the rows to change are locked, loaded and judged again as they are now: an
        # edge holds thousands of sandboxes, and loading them all costs ~0.1 ms each per round.
        light = s.execute(
            sa.select(SandboxRow.key, SandboxRow.id, SandboxRow.state, SandboxRow.updated_at)
            .where(SandboxRow.edge_id == edge_id, SandboxRow.id.is_not(None), SandboxRow.state.in_(LIVE))
        ).all()
        known = {r.id for r in light}
        touch = [r.key for r in light if _needs_change(r.state, r.updated_at, on_edge.get(r.id or ""), listed_at)]
        rows: list[SandboxRow] = []
        for i in range(0, len(touch), 500):
            rows += s.execute(
                sa.select(SandboxRow).where(SandboxRow.key.in_(touch[i:i + 500]), SandboxRow.id.is_not(None),
                                            SandboxRow.state.in_(LIVE)).order_by(SandboxRow.key).with_for_update()
            ).scalars().all()
        for row in rows:
            assert row.id is not None
            there = on_edge.get(row.id)
            if row.state == S.STOPPING.value:
                if there is None or there.state == S.STOPPED:
                    move(row, S.STOPPED, ledger)
                else:
                    doomed.append(row.id)
            elif there is None and listed_at is not None and row.updated_at >= listed_at:
                continue  # too new for this listing: the next round judges it
            elif there is None or there.state == S.STOPPED:
                # the edge's clock set expires_at: allow for a few seconds of skew between the two
                expired = row.expires_at is not None and now >= row.expires_at - CLOCK_SKEW_S
                why = "expired (ttl)" if expired else f"gone from edge {edge_id} (idle timeout or destroyed there)"
                move(row, S.STOPPED, ledger, reason=there.reason if there is not None and there.reason else why)
            elif there.state == S.FAILED and row.state != S.FAILED.value:
                move(row, S.FAILED, ledger, reason=there.reason or "failed on the edge")
            elif there.state in (S.RUNNING, S.PAUSED) and can_move(SandboxState(row.state), there.state):
                move(row, there.state, ledger)  # creating -> running, running <-> paused: the edge's word
        ledger.flush(s)
        unknown = [sid for sid in on_edge if sid not in known]
        stopped: set[str] = set()
        live_since: set[str] = set()
        for i in range(0, len(unknown), 500):
            # In the store after all, read now: ended (stopped, lost) -> deleted on the edge below;
            # live -> its row got its id since the light read (a report or a create's record
            # committed in between, under PostgreSQL's read committed): not ours to judge, the next
            # round knows it. (Taking every id found for an ended one deleted such live sandboxes.)
            for sid, state in s.execute(sa.select(SandboxRow.id, SandboxRow.state).where(
                    SandboxRow.id.in_(unknown[i : i + 500]))):
                (live_since if state in LIVE else stopped).add(str(sid))
        pending: list[tuple[SandboxRow, str]] = []
        ended: dict[str, SandboxRow] = {}
        if unknown:  # reservations by the keys the edge names (a lease has thousands on one edge)
            keys = sorted({on_edge[sid].request_id or "" for sid in unknown} - {""})
            pending = self._unconfirmed(s, edge_id, keys=keys) if keys else []
            ended = self._ended(s, edge_id, keys) if keys else {}
            named = {row.key for row, _ in pending}
            if any(on_edge[sid].created_at < now - self.config.orphan_grace_s
                   and (on_edge[sid].request_id or "") not in named for sid in unknown):
                pending = self._unconfirmed(s, edge_id)  # matching by resemblance needs them all
        for sid in unknown:
            sb = on_edge[sid]
            if sb.state == S.STOPPED or sid in live_since or sid in recording:
                continue
            if sid in stopped:  # the store says stopped or lost, the edge still has it
                doomed.append(sid)
            elif sb.request_id and sb.request_id in ended:
                # made for a create that had ended without it (deleted while in flight, or a lease
                # slot its client gave up): the row takes its id, and it is destroyed
                row = ended.pop(sb.request_id)
                row.id, row.created_at = sid, sb.created_at
                doomed.append(sid)
                log.warning("edge %s: %s was made under %s, which had ended (%s): deleting it", edge_id, sid,
                            sb.request_id, row.reason)
            elif sb.request_id and adopt_by_key(pending, sb, ledger):
                age = now - sb.created_at
                if age < self.config.orphan_grace_s:
                    log.info("edge %s: recorded %s into its reservation %s ahead of its own record (made %.1f s "
                             "ago: its create's answer or the edge's lease report was still on its way, and finds "
                             "it recorded; a harmless race)", edge_id, sid, sb.request_id, age)
                else:
                    log.warning("edge %s: recorded %s into its reservation %s (made %.0f s ago: its create's answer "
                                "or lease report was lost)", edge_id, sid, sb.request_id, age)
            elif sb.created_at < now - self.config.orphan_grace_s and adopt_unconfirmed(pending, sb, ledger):
                log.warning("edge %s: adopted %s into its create's reservation (the answer was never recorded)",
                            edge_id, sid)
            elif self.config.reap_orphans and sb.project is not None and sb.created_at < now - self.config.orphan_grace_s:
                # a project's sandbox nobody knows: a create whose answer was lost
                log.warning("edge %s holds orphan %s (project %s): deleting it", edge_id, sid, sb.project)
                doomed.append(sid)
        ledger.flush(s)
        _recount_edge(s, edge_id)
        return doomed

    @staticmethod
    def _ended(s: Session, edge_id: str, keys: Sequence[str]) -> dict[str, SandboxRow]:
        """Rows of these keys on this edge that never got a sandbox and hold nothing any more
        (``stopping`` or ``stopped``: deleted while their create was in flight, lease slots
        given up by an abandon): a sandbox the edge made under one must not live."""
        out: dict[str, SandboxRow] = {}
        for i in range(0, len(keys), 500):
            for row in s.execute(
                sa.select(SandboxRow).where(SandboxRow.key.in_(list(keys[i:i + 500])), SandboxRow.edge_id == edge_id,
                                            SandboxRow.id.is_(None),
                                            SandboxRow.state.in_((S.STOPPING.value, S.STOPPED.value)))
                .order_by(SandboxRow.key).with_for_update()
            ).scalars():
                out[row.key] = row
        return out

    @staticmethod
    def _unconfirmed(s: Session, edge_id: str, *, keys: Sequence[str] | None = None) -> list[tuple[SandboxRow, str]]:
        """Reservations on this edge whose create never recorded an id (``keys``: only these),
        with their project names."""
        out: list[tuple[SandboxRow, str]] = []
        chunks = [None] if keys is None else [list(keys[i:i + 500]) for i in range(0, len(keys), 500)]
        for chunk in chunks:
            q = (sa.select(SandboxRow, Project.name).join(Project, Project.id == SandboxRow.project_id)
                 .where(SandboxRow.edge_id == edge_id, SandboxRow.id.is_(None), SandboxRow.state == S.CREATING.value))
            if chunk is not None:
                q = q.where(SandboxRow.key.in_(chunk))
            out += [(row, name) for row, name in s.execute(
                q.order_by(SandboxRow.created_at).with_for_update(of=SandboxRow))]
        return out

    # --------------------------------------------------------- housekeeping ----

    def _housekeeping_txn(self, s: Session) -> None:
        now = time.time()
        ledger = Ledger()
        lost_before = now - self.config.edge_lost_after_s
        for e in s.execute(
            sa.select(EdgeRow).where(EdgeRow.status == "dead", EdgeRow.last_seen < lost_before).with_for_update()
        ).scalars():
            if e.lost_at is not None and e.lost_at >= (e.last_seen or 0.0):
                continue  # declared already for this outage
            n = declare_lost(s, e, f"edge {e.id} unreachable for {self.config.edge_lost_after_s:g}s: declared lost "
                             "(destroyed there if the edge comes back)", now)
            log.warning("edge %s lost: %d sandbox(es) declared lost, epoch now %d", e.id, n, e.epoch)
        stale = now - 2 * self.create_budget_s
        for row in s.execute(
            sa.select(SandboxRow)
            .where(SandboxRow.id.is_(None), SandboxRow.updated_at < stale, SandboxRow.state.in_(LIVE))
            .with_for_update()
        ).scalars():
            log.warning("dropping reservation %s: its create never finished", row.key)
            forget(s, row, ledger)
        ledger.flush(s)
        for snap in s.execute(
            sa.select(SnapshotRow).where(SnapshotRow.state == "creating", SnapshotRow.updated_at < now - 3600.0)
            .with_for_update()
        ).scalars():  # a snapshot whose answer never came (the control plane died): its storage returns
            log.warning("dropping snapshot reservation %s of sandbox %s: it never finished", snap.key, snap.sandbox_id)
            s.execute(sa.update(Project).where(Project.id == snap.project_id)
                      .values(used_storage=Project.used_storage - snap.size))
            s.delete(snap)
        if self.config.retention_s >= 0:
            s.execute(
                sa.delete(SandboxRow).where(
                    SandboxRow.state == S.STOPPED.value, SandboxRow.updated_at < now - self.config.retention_s
                )
            )


def _needs_change(state: str, updated_at: float, there: SandboxInfo | None, listed_at: float | None) -> bool:
    """Whether the reconcile's judgement of a row (``Watcher._reconcile_txn``) would change it
    or delete it on the edge, from what the light read saw."""
    if state == S.STOPPING.value:
        return True
    if there is None:
        return listed_at is None or updated_at < listed_at
    if there.state in (S.STOPPED, S.FAILED):
        return state != there.state.value
    return there.state in (S.RUNNING, S.PAUSED) and can_move(SandboxState(state), there.state)


def adopt_by_key(pending: list[tuple[SandboxRow, str]], sb: SandboxInfo, ledger: Ledger) -> bool:
    """The edge made ``sb`` for the create whose reservation key its request carried: record
    it at once (exact, unlike :func:`adopt_unconfirmed`'s resemblance after a grace)."""
    for i, (row, _project) in enumerate(pending):
        if row.key != sb.request_id:
            continue
        _fill(row, sb, ledger)
        del pending[i]
        return True
    return False


def _fill(row: SandboxRow, sb: SandboxInfo, ledger: Ledger) -> None:
    row.id = sb.id
    row.edge_url = sb.edge_url or row.edge_url
    row.created_at = sb.created_at
    row.expires_at = sb.expires_at if sb.expires_at is not None else row.expires_at
    if sb.state in (S.RUNNING, S.PAUSED, S.FAILED):
        move(row, sb.state, ledger)


def _record_txn(s: Session, key: str, got: SandboxInfo) -> None:
    """A finished orphaned create: the reservation gets its sandbox (unless recorded meanwhile)."""
    row = s.get(SandboxRow, key, with_for_update=True)
    if row is None or row.id is not None or row.state != S.CREATING.value:
        return
    ledger = Ledger()
    _fill(row, got, ledger)
    ledger.flush(s)


def _release_txn(s: Session, key: str) -> None:
    row = s.get(SandboxRow, key, with_for_update=True)
    if row is not None and row.id is None:
        ledger = Ledger()
        forget(s, row, ledger)
        ledger.flush(s)


def adopt_unconfirmed(pending: list[tuple[SandboxRow, str]], sb: SandboxInfo, ledger: Ledger) -> bool:
    """A sandbox the edge holds that no row names, older than the orphan grace: if a reservation
    on that edge asked for exactly it (project, task, labels, resources, made after the
    reservation), it is that create's sandbox whose answer was never recorded (the replica
    died after answering): record it instead of reaping it. Identical reservations are
    interchangeable, so the first match is as good as any."""
    for i, (row, project) in enumerate(pending):
        if project != sb.project or row.task_name != sb.task or dict(row.labels or {}) != dict(sb.labels):
            continue
        if sb.resources is not None and (sb.resources.memory != row.memory or sb.resources.disk != row.disk):
            continue
        if sb.created_at < row.created_at - 5.0:
            continue
        if sb.request_id and sb.request_id != row.key:
            continue  # the edge says which create made it: another reservation's
        _fill(row, sb, ledger)
        del pending[i]
        return True
    return False


# ---------------------------------------------------------------- recount ----


_SUSPENDED = sa.and_(SandboxRow.preempted_at.is_not(None),
                     SandboxRow.state.not_in((S.CREATING.value, S.RUNNING.value)))
"""Rows paused by preemption (and what follows until a resume): no cpu and memory held (sandboxes.held_room)."""


def _held(col: Any, *, suspended: bool) -> Any:
    """``sum(col)``, leaving out rows paused by preemption when ``suspended`` (cpu and memory)."""
    if not suspended:
        return sa.func.coalesce(sa.func.sum(col), 0)
    return sa.func.coalesce(sa.func.sum(sa.case((_SUSPENDED, 0), else_=col)), 0)


def _sums(s: Session, key: Any, states: frozenset[str], *, disk: bool = False,
          suspended: bool = False) -> dict[Any, tuple[int, ...]]:
    """Per ``key``: count, cpu, memory (and disk) of the rows in ``states``; ``suspended``: what
    they hold on their edge or in their task's active capacity (preempted rows hold no cpu or memory;
    nor count, for the active capacity)."""
    count: Any = sa.func.count()
    if suspended and not disk:  # a task's active capacity: a preempted sandbox counts for nothing
        count = sa.func.coalesce(sa.func.sum(sa.case((_SUSPENDED, 0), else_=1)), 0)
    cols: list[Any] = [key, count, _held(SandboxRow.cpu_m, suspended=suspended),
                       _held(SandboxRow.memory, suspended=suspended)]
    if disk:
        cols.append(sa.func.coalesce(sa.func.sum(SandboxRow.disk), 0))
    q = sa.select(*cols).where(SandboxRow.state.in_(tuple(states)), key.is_not(None)).group_by(key)
    return {r[0]: tuple(int(x) for x in r[1:]) for r in s.execute(q)}


def _recount_edge(s: Session, edge_id: str) -> None:
    e = s.get(EdgeRow, edge_id, with_for_update=True)
    if e is None:
        return
    q = sa.select(
        sa.func.count(), _held(SandboxRow.cpu_m, suspended=True), _held(SandboxRow.memory, suspended=True),
        sa.func.coalesce(sa.func.sum(SandboxRow.disk), 0),
    ).where(SandboxRow.edge_id == edge_id, SandboxRow.state.in_(tuple(HOLDS_EDGE)))
    n, cpu, mem, disk = (int(x) for x in s.execute(q).one())
    e.committed_sandboxes, e.committed_cpu_m, e.committed_memory, e.committed_disk = n, cpu, mem, disk


def recount_txn(s: Session) -> int:
    """Recompute every counter from the sandbox rows; returns how many rows were off."""
    fixed = 0
    projects = s.execute(sa.select(Project).order_by(Project.id).with_for_update()).scalars().all()
    used = _sums(s, SandboxRow.project_id, HOLDS_QUOTA)
    reserved: dict[int, tuple[int, int, int]] = {}
    storage_used = {
        pid: int(n) for pid, n in s.execute(
            sa.select(SnapshotRow.project_id, sa.func.coalesce(sa.func.sum(SnapshotRow.size), 0))
            .group_by(SnapshotRow.project_id)
        )
    }
    storage_reserved: dict[int, int] = {}
    for p in projects:
        if p.parent_id is not None:
            r = reserved.get(p.parent_id, (0, 0, 0))
            reserved[p.parent_id] = (r[0] + p.quota_sandboxes, r[1] + p.quota_cpu_m, r[2] + p.quota_memory)
            storage_reserved[p.parent_id] = storage_reserved.get(p.parent_id, 0) + p.quota_storage
    for p in projects:
        su, sr = storage_used.get(p.id, 0), storage_reserved.get(p.id, 0)
        if (p.used_storage, p.reserved_storage) != (su, sr):
            log.warning("project %s storage counters drifted: %s -> %s", p.name,
                        (p.used_storage, p.reserved_storage), (su, sr))
            fixed += 1
            p.used_storage, p.reserved_storage = su, sr
    for p in projects:
        u = used.get(p.id, (0, 0, 0))
        r = reserved.get(p.id, (0, 0, 0))
        now_vals = (p.used_sandboxes, p.used_cpu_m, p.used_memory, p.reserved_sandboxes, p.reserved_cpu_m, p.reserved_memory)
        if now_vals != (*u, *r):
            log.warning("project %s counters drifted: %s -> %s", p.name, now_vals, (*u, *r))
            fixed += 1
            p.used_sandboxes, p.used_cpu_m, p.used_memory = u
            p.reserved_sandboxes, p.reserved_cpu_m, p.reserved_memory = r
    tasks = s.execute(sa.select(Task).order_by(Task.id).with_for_update()).scalars().all()
    tused = _sums(s, SandboxRow.task_id, HOLDS_QUOTA)
    tactive = _sums(s, SandboxRow.task_id, HOLDS_QUOTA, suspended=True)
    for t in tasks:
        u = tused.get(t.id, (0, 0, 0))
        if (t.used_sandboxes, t.used_cpu_m, t.used_memory) != u:
            fixed += 1
            t.used_sandboxes, t.used_cpu_m, t.used_memory = u
        a = tactive.get(t.id, (0, 0, 0))
        if (t.active_sandboxes, t.active_cpu_m, t.active_memory) != a:
            log.warning("task %s active capacity drifted: %s -> %s", t.name,
                        (t.active_sandboxes, t.active_cpu_m, t.active_memory), a)
            fixed += 1
            t.active_sandboxes, t.active_cpu_m, t.active_memory = a
    eused = _sums(s, SandboxRow.edge_id, HOLDS_EDGE, disk=True, suspended=True)
    for e in s.execute(sa.select(EdgeRow).order_by(EdgeRow.id).with_for_update()).scalars():
        u = eused.get(e.id, (0, 0, 0, 0))
        if (e.committed_sandboxes, e.committed_cpu_m, e.committed_memory, e.committed_disk) != u:
            fixed += 1
            e.committed_sandboxes, e.committed_cpu_m, e.committed_memory, e.committed_disk = u
    return fixed
