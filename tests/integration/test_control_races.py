"""A row that goes away (or changes) between a transaction's lookup and its lock: typed answers, never a 500.

Each race is made to happen, not hoped for. A second connection opens a transaction
that changes the row (a concurrent delete, a state change, an insert of the same key)
and keeps it open; the API call is sent; the change commits while the call waits:

- PostgreSQL (READ COMMITTED): the change is committed once ``pg_stat_activity`` shows
  the call waiting for a lock, and the test checks which statement it waits in — the
  lock that follows its lookup. That is the interleaving the fuzz hit by chance
  (``NoResultFound`` from ``POST /v1/tasks/{name}/stage``).
- SQLite: a write transaction takes the whole database at ``BEGIN IMMEDIATE``, so the
  call queues there (the test checks it has not answered) and its lookup sees the
  committed change. The same choreography, in the only order SQLite allows, and the
  same answer.

Two windows have no lock to order them (a read between two plain statements); those
are made by deleting the row inside the call's own transaction, right after its
lookup.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
import test_control_support as support
from sqlalchemy.orm import Session
from test_control_support import SPEC, Cluster, GiB, cluster

from dsec.control import iam
from dsec.control.db import SandboxRow, make_engine
from dsec.control.sandboxes import Answered, InFlight, Sandboxes
from dsec.http import auth
from dsec.spec.api import EdgeHealth

pytestmark = pytest.mark.anyio

anyio_backend = support.anyio_backend
pg_cluster = support.pg_cluster
db_url = support.db_url


# ------------------------------------------------------------- machinery ----


class Held:
    """A second connection's open write transaction: its row locks (and, on SQLite, the
    database) are held until :meth:`commit`."""

    def __init__(self, url: str) -> None:
        self.engine = make_engine(url, pool_size=1).execution_options(dsec_write=True)
        self.conn: sa.Connection | None = None

    async def begin(self, *statements: tuple[str, dict[str, Any]]) -> None:
        def run() -> None:
            self.conn = self.engine.connect()
            self.conn.begin()
            for sql, params in statements:
                self.conn.execute(sa.text(sql), params)

        await asyncio.to_thread(run)

    async def commit(self) -> None:
        if self.conn is not None:
            conn, self.conn = self.conn, None
            await asyncio.to_thread(lambda: (conn.commit(), conn.close()))

    async def close(self) -> None:
        if self.conn is not None:
            conn, self.conn = self.conn, None
            await asyncio.to_thread(lambda: (conn.rollback(), conn.close()))
        self.engine.dispose()


async def query(url: str, sql: str, **params: Any) -> list[Any]:
    """One statement on a connection of its own, committed; its rows (if it returns any)."""
    def run() -> list[Any]:
        engine = make_engine(url, pool_size=1).execution_options(dsec_write=True)
        try:
            with engine.begin() as conn:
                res = conn.execute(sa.text(sql), params)
                return list(res.all()) if res.returns_rows else []
        finally:
            engine.dispose()

    return await asyncio.to_thread(run)


async def waiting_statement(url: str, timeout: float = 15.0) -> str:
    """PostgreSQL: the statement of the session of this database that waits for a lock."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rows = await query(url, "SELECT query FROM pg_stat_activity WHERE datname = current_database() "
                                "AND wait_event_type = 'Lock' AND pid <> pg_backend_pid()")
        if rows:
            return str(rows[0][0])
        await asyncio.sleep(0.02)
    raise AssertionError("the call never waited for a lock")


async def race(
    url: str, change: list[tuple[str, dict[str, Any]]], call: Callable[[], Awaitable[httpx.Response]],
    *, waits_in: tuple[str, ...],
) -> httpx.Response:
    """Run ``call`` while ``change`` is held by another transaction; commit the change once the call
    waits for it (PostgreSQL: in a statement containing every string of ``waits_in``)."""
    held = Held(url)
    try:
        await held.begin(*change)
        pending = asyncio.ensure_future(call())
        try:
            if url.startswith("sqlite"):
                await asyncio.sleep(0.3)
                assert not pending.done(), "the call did not queue behind the held write"
            else:
                stmt = await waiting_statement(url)
                assert all(w in stmt for w in waits_in), f"the call waits in {stmt!r}, not after its lookup"
            await held.commit()
        except BaseException:
            await held.close()
            pending.cancel()
            raise
        r = await asyncio.wait_for(pending, 30)
    finally:
        await held.close()
    assert r.status_code < 500, f"{r.status_code}: {r.text}"
    return r


def err(r: httpx.Response) -> dict[str, Any]:
    body = r.json()
    assert "error" in body, body
    return dict(body["error"])


async def make(cl: Cluster, c: httpx.AsyncClient, **kw: Any) -> dict[str, Any]:
    """A running sandbox, returned once its id is in the database. A create is answered before
    its id is recorded (off the reply path; lookups by id in the replica wait for it), so a
    statement by id on a connection of the test's own could otherwise find no row: the race's
    change would match nothing, the record would land after it, and the call would succeed."""
    r = await c.post("/v1/sandboxes", json={"spec": kw.pop("spec", SPEC), **kw})
    assert r.status_code == 201, r.text
    await cl.control.sandboxes.settled(r.json()["id"])
    return dict(r.json())


async def used(c: httpx.AsyncClient, project: str = "root") -> dict[str, Any]:
    r = await c.get(f"/v1/projects/{project}")
    assert r.status_code == 200, r.text
    return dict(r.json()["used"])


LOCKS_SANDBOX = ("FOR UPDATE", "FROM sandboxes")


# ------------------------------------------------------ tasks and stages ----


async def test_stage_of_a_task_deleted_before_its_lock_is_404(db_url: str, tmp_path: Path) -> None:
    """The fuzz's 500: POST /v1/tasks/{name}/stage with the task deleted between lookup and FOR UPDATE."""
    async with cluster(db_url, tmp_path) as cl:
        c = cl.client()
        stages = {"a": {}, "b": {"files": {"hidden": ["/tests"]}}}
        assert (await c.post("/v1/tasks", json={"name": "job", "stages": stages, "stage": "a"})).status_code == 201
        r = await race(db_url, [("DELETE FROM tasks WHERE name = 'job'", {})],
                       lambda: c.post("/v1/tasks/job/stage", json={"stage": "b"}),
                       waits_in=("FOR UPDATE", "FROM tasks"))
        assert r.status_code == 404 and err(r)["code"] == "not_found" and err(r)["task"] == "job", r.text


async def test_concurrent_creates_of_one_task_both_succeed(db_url: str, tmp_path: Path) -> None:
    """Creating a task is PUT-like: the second of two concurrent creates sets the first one's quota
    (it used to fail on the unique name: IntegrityError, 500)."""
    async with cluster(db_url, tmp_path) as cl:
        c = cl.client()
        (root_id,), = await query(db_url, "SELECT id FROM projects WHERE name = 'root'")
        insert = ("INSERT INTO tasks (project_id, name, created_at, used_sandboxes, used_cpu_m, used_memory) "
                  "VALUES (:pid, 'job', 0, 0, 0, 0)", {"pid": root_id})
        r = await race(db_url, [insert], lambda: c.post("/v1/tasks", json={"name": "job", "quota": {"sandboxes": 3}}),
                       waits_in=("INSERT INTO tasks",))
        assert r.status_code == 201 and r.json()["quota"]["sandboxes"] == 3, r.text
        assert (await c.get("/v1/tasks/job")).json()["quota"]["sandboxes"] == 3
        assert len(await query(db_url, "SELECT id FROM tasks WHERE name = 'job'")) == 1


async def test_first_use_of_a_task_made_and_deleted_meanwhile_is_409(
    db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A create's task made on first use: its insert lost to a concurrent one that is gone again by the
    time it looks (there is no lock to order that window: the insert is made to lose)."""
    monkeypatch.setattr(iam, "add_new", lambda s, row: False)
    async with cluster(db_url, tmp_path) as cl:
        c = cl.client()
        r = await c.post("/v1/sandboxes", json={"spec": SPEC, "task": "fresh"})
        assert r.status_code == 409 and err(r)["code"] == "conflict" and err(r)["task"] == "fresh", r.text
        assert cl.edges[0].creates == 0 and (await used(c))["sandboxes"] == 0


# ------------------------------------------------------------- sandboxes ----


async def test_delete_of_a_sandbox_whose_row_is_dropped_meanwhile_is_404(db_url: str, tmp_path: Path) -> None:
    """DELETE of a stopped sandbox while retention removes its row (it used to be NoResultFound)."""
    async with cluster(db_url, tmp_path) as cl:
        c = cl.client()
        sb = await make(cl, c)
        assert (await c.delete(f"/v1/sandboxes/{sb['id']}")).status_code == 204
        r = await race(db_url, [("DELETE FROM sandboxes WHERE id = :id", {"id": sb["id"]})],
                       lambda: c.delete(f"/v1/sandboxes/{sb['id']}"), waits_in=LOCKS_SANDBOX)
        assert r.status_code == 404 and err(r)["code"] == "sandbox_not_found", r.text


@pytest.mark.parametrize("op", ["fork", "snapshot"])
async def test_fork_or_snapshot_of_a_sandbox_deleted_meanwhile_is_409(db_url: str, tmp_path: Path, op: str) -> None:
    """The sandbox is moved to stopping (a concurrent DELETE) after the call found it running: the
    state is checked on the locked row, so nothing is reserved and the edge is not asked."""
    async with cluster(db_url, tmp_path) as cl:
        c = cl.client()
        sb = await make(cl, c)
        body = {"n": 2} if op == "fork" else {"name": "snap"}
        r = await race(db_url, [("UPDATE sandboxes SET state = 'stopping' WHERE id = :id", {"id": sb["id"]})],
                       lambda: c.post(f"/v1/sandboxes/{sb['id']}/{op}", json=body), waits_in=LOCKS_SANDBOX)
        assert r.status_code == 409 and err(r)["code"] == "sandbox_state" and err(r)["state"] == "stopping", r.text
        edge = cl.edges[0]
        assert edge.forks == 0 and edge.snapshots == {}
        assert (await used(c))["sandboxes"] == 1  # no children charged
        st = (await c.get("/v1/projects/root/storage")).json()
        assert st["used"] == 0 and st["snapshots"] == 0


@pytest.mark.parametrize("op", ["fork", "snapshot"])
async def test_fork_or_snapshot_of_a_sandbox_whose_row_is_gone_is_404(db_url: str, tmp_path: Path, op: str) -> None:
    async with cluster(db_url, tmp_path) as cl:
        c = cl.client()
        sb = await make(cl, c)
        body = {"n": 1} if op == "fork" else {}
        r = await race(db_url, [("DELETE FROM sandboxes WHERE id = :id", {"id": sb["id"]})],
                       lambda: c.post(f"/v1/sandboxes/{sb['id']}/{op}", json=body), waits_in=LOCKS_SANDBOX)
        assert r.status_code == 404 and err(r)["code"] == "sandbox_not_found", r.text
        assert cl.edges[0].forks == 0 and cl.edges[0].snapshots == {}


async def test_replayed_request_id_whose_row_is_dropped_meanwhile_creates_anew(
    db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The row a repeated request_id named is removed (retention) between the lookup of the key and the
    read of the row (two plain statements: the row is deleted in the call's own transaction, between
    them). It used to be an AssertionError (500); the request_id is free again, so the create goes on."""
    real = Sandboxes._replay

    def replay_after_retention(self: Sandboxes, s: Session, key: str, rhash: str, who: iam.Principal
                               ) -> Answered | InFlight | None:
        s.execute(sa.delete(SandboxRow).where(SandboxRow.key == key))
        return real(self, s, key, rhash, who)

    async with cluster(db_url, tmp_path) as cl:
        c = cl.client()
        first = await make(cl, c, request_id="once")
        assert (await c.delete(f"/v1/sandboxes/{first['id']}")).status_code == 204
        monkeypatch.setattr(Sandboxes, "_replay", replay_after_retention)
        again = await make(cl, c, request_id="once")
        assert again["id"] != first["id"] and again["state"] == "running"


# ------------------------------------------------------------- snapshots ----


async def _snapshot(cl: Cluster, c: httpx.AsyncClient) -> dict[str, Any]:
    sb = await make(cl, c)
    r = await c.post(f"/v1/sandboxes/{sb['id']}/snapshot", json={"name": "snap"})
    assert r.status_code == 201, r.text
    return dict(r.json())


async def test_delete_of_a_snapshot_deleted_meanwhile_is_404(db_url: str, tmp_path: Path) -> None:
    """Another DELETE of the same snapshot finished between this one's lookup and its write (it used to
    update a row that was gone: StaleDataError, 500)."""
    async with cluster(db_url, tmp_path) as cl:
        c = cl.client()
        snap = await _snapshot(cl, c)
        r = await race(db_url, [("DELETE FROM snapshots WHERE digest = :d", {"d": snap["digest"]})],
                       lambda: c.delete("/v1/snapshots/snap:latest"), waits_in=("FOR UPDATE", "FROM snapshots"))
        assert r.status_code == 404 and err(r)["code"] == "not_found", r.text
        assert snap["digest"] in cl.edges[0].snapshots  # nobody asked the edge (the row was removed by hand)


async def test_delete_of_a_snapshot_being_deleted_is_409(db_url: str, tmp_path: Path) -> None:
    """Two DELETEs of one snapshot: only the first asks the edge; the second is a conflict."""
    async with cluster(db_url, tmp_path) as cl:
        c = cl.client()
        snap = await _snapshot(cl, c)
        r = await race(db_url, [("UPDATE snapshots SET state = 'deleting' WHERE digest = :d", {"d": snap["digest"]})],
                       lambda: c.delete("/v1/snapshots/snap:latest"), waits_in=("FOR UPDATE", "FROM snapshots"))
        assert r.status_code == 409 and err(r)["code"] == "conflict" and err(r)["state"] == "deleting", r.text
        assert snap["digest"] in cl.edges[0].snapshots


async def test_snapshot_whose_reservation_is_dropped_while_the_edge_works_is_409(db_url: str, tmp_path: Path) -> None:
    """The watcher drops the snapshot's reservation (older than an hour) while the edge is still
    making it: the settle finds no row. It answered a 500 (a bare DsecError); now a conflict, and the
    layer nobody holds is removed from the edge."""
    async with cluster(db_url, tmp_path) as cl:
        c = cl.client()
        sb = await make(cl, c)
        edge = cl.edges[0]
        edge.snapshot_delay_s = 3.0  # time enough to drop the reservation, even on a loaded machine
        call = asyncio.ensure_future(c.post(f"/v1/sandboxes/{sb['id']}/snapshot", json={"name": "snap"}))
        for _ in range(200):
            if await query(db_url, "SELECT key FROM snapshots WHERE state = 'creating'"):
                break
            await asyncio.sleep(0.01)
        else:
            raise AssertionError("the snapshot was never reserved")
        # the edge is still at work: the reservation is as old as the watcher drops, and dropped
        await query(db_url, "UPDATE snapshots SET updated_at = 0 WHERE state = 'creating'")
        watcher = cl.control.watcher
        assert watcher is not None
        await cl.control.store.write(watcher._housekeeping_txn)
        r = await call
        assert r.status_code == 409 and err(r)["code"] == "conflict", r.text
        assert edge.snapshots == {}
        st = (await c.get("/v1/projects/root/storage")).json()
        assert st["used"] == 0 and st["snapshots"] == 0


# ------------------------------------------------------ projects, tokens ----


async def test_update_or_delete_of_a_project_deleted_meanwhile_is_404(db_url: str, tmp_path: Path) -> None:
    async with cluster(db_url, tmp_path) as cl:
        c = cl.client()
        await cl.project("a")
        await cl.project("b")
        for name, call in [
            ("a", lambda: c.patch("/v1/projects/a", json={"quota": {"sandboxes": 1, "cpu": 1, "memory": GiB}})),
            ("b", lambda: c.delete("/v1/projects/b")),
        ]:
            (pid,), = await query(db_url, "SELECT id FROM projects WHERE name = :n", n=name)
            r = await race(db_url, [("DELETE FROM api_tokens WHERE project_id = :p", {"p": pid}),
                                    ("DELETE FROM projects WHERE id = :p", {"p": pid})],
                           call, waits_in=("FOR UPDATE", "FROM projects"))
            assert r.status_code == 404 and err(r)["code"] == "not_found", r.text


async def test_concurrent_creates_of_one_project_name_are_409(db_url: str, tmp_path: Path) -> None:
    """The name is checked free, then another create of it commits first (it used to be an
    IntegrityError on the unique name: 500)."""
    async with cluster(db_url, tmp_path) as cl:
        c = cl.client()
        (root_id,), = await query(db_url, "SELECT id FROM projects WHERE name = 'root'")
        cols = ("quota_sandboxes", "quota_cpu_m", "quota_memory", "used_sandboxes", "used_cpu_m", "used_memory",
                "reserved_sandboxes", "reserved_cpu_m", "reserved_memory", "quota_storage", "used_storage",
                "reserved_storage")
        insert = (f"INSERT INTO projects (name, parent_id, created_at, {', '.join(cols)}) "
                  f"VALUES ('p', :root, 0, {', '.join('0' for _ in cols)})", {"root": root_id})
        body = {"name": "p", "quota": {"sandboxes": 1, "cpu": 1, "memory": GiB}}
        r = await race(db_url, [insert], lambda: c.post("/v1/projects", json=body),
                       waits_in=("FOR UPDATE", "FROM projects"))
        assert r.status_code == 409 and err(r)["code"] == "conflict" and err(r)["project"] == "p", r.text
        root = (await c.get("/v1/projects/root")).json()
        assert root["reserved"]["sandboxes"] == 0  # the refused create carved nothing out


async def test_revoke_of_a_token_deleted_meanwhile_is_404(db_url: str, tmp_path: Path) -> None:
    """A token removed with its project while being revoked (it used to be StaleDataError: 500)."""
    async with cluster(db_url, tmp_path) as cl:
        c = cl.client()
        await cl.project("a")
        r = await c.post("/v1/tokens", json={"project": "a", "name": "x"})
        assert r.status_code == 201, r.text
        tid = r.json()["id"]
        r = await race(db_url, [("DELETE FROM api_tokens WHERE id = :t", {"t": tid})],
                       lambda: c.delete(f"/v1/tokens/{tid}"), waits_in=("FOR UPDATE", "FROM api_tokens"))
        assert r.status_code == 404 and err(r)["code"] == "not_found" and err(r)["token_id"] == tid, r.text


async def test_token_for_a_project_deleted_meanwhile_is_404(db_url: str, tmp_path: Path) -> None:
    """The project is found, then deleted before the token's insert (it used to be the foreign key's
    IntegrityError: 500)."""
    async with cluster(db_url, tmp_path) as cl:
        c = cl.client()
        await cl.project("a")
        (pid,), = await query(db_url, "SELECT id FROM projects WHERE name = 'a'")
        r = await race(db_url, [("DELETE FROM api_tokens WHERE project_id = :p", {"p": pid}),
                                ("DELETE FROM projects WHERE id = :p", {"p": pid})],
                       lambda: c.post("/v1/tokens", json={"project": "a", "name": "late"}),
                       waits_in=("INSERT INTO api_tokens",))
        assert r.status_code == 404 and err(r)["code"] == "not_found", r.text


# ----------------------------------------------------------------- edges ----


async def test_drain_of_an_edge_removed_meanwhile_is_404(db_url: str, tmp_path: Path) -> None:
    async with cluster(db_url, tmp_path) as cl:
        c = cl.client()
        r = await race(db_url, [("DELETE FROM edges WHERE id = 'e1'", {})],
                       lambda: c.post("/v1/edges/e1/drain", json={"draining": True}),
                       waits_in=("FOR UPDATE", "FROM edges"))
        assert r.status_code == 404 and err(r)["code"] == "not_found" and err(r)["edge_id"] == "e1", r.text


async def test_concurrent_registrations_of_one_edge_both_succeed(db_url: str, tmp_path: Path) -> None:
    """A retried register racing the first one (it used to be an IntegrityError on the edge id: 500)."""
    async with cluster(db_url, tmp_path) as cl:
        tok, _ = auth.mint(cl.key, sandbox_id="*", project="*", scope="edge-admin")
        c = cl.client(tok)
        health = EdgeHealth(edge_id="e9", url="http://127.0.0.1:9/", sandboxes=0, capacity_sandboxes=4,
                            cpu_committed=0, cpu_capacity=4, memory_committed=0, memory_capacity=4 * GiB,
                            disk_committed=0, disk_capacity=4 * GiB)
        insert = ("INSERT INTO edges (id, url, registered_at, status, misses, draining, committed_sandboxes, "
                  "committed_cpu_m, committed_memory, committed_disk) "
                  "VALUES ('e9', 'http://127.0.0.1:8', 0, 'alive', 0, :f, 0, 0, 0, 0)", {"f": False})
        r = await race(db_url, [insert], lambda: c.post("/v1/edges/register", content=health.model_dump_json(),
                                                        headers={"content-type": "application/json"}),
                       waits_in=("INSERT INTO edges",))
        assert r.status_code == 200 and r.json()["id"] == "e9" and r.json()["url"] == "http://127.0.0.1:9", r.text
        assert await query(db_url, "SELECT url FROM edges WHERE id = 'e9'") == [("http://127.0.0.1:9",)]

