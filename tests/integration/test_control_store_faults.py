"""The control plane when its PostgreSQL goes away at the worst moments.

A create whose reservation commits while the store's answer is lost: settled, not waited out.

When PostgreSQL restarts (or the network to it breaks) during the reservation's COMMIT, the
replica cannot know whether the row landed: it answers 503 ``unavailable`` and the SDK retries
with the same request_id. A row that did land used to be nobody's: no one launched it, the
retry waited on it as "in flight", and only housekeeping dropped it (twice the create budget,
~70 s). Now the replica settles it as soon as the store answers: released (its quota back, an
optimistic sandbox made for it deleted), so the retry makes the sandbox at once. Nothing lost,
nothing duplicated, nothing leaked (docs/CONTROL.md, "Failover").

A connection lost in the middle of a group commit (several callers' transactions in one): a
503 for every caller, which clients retry, never a 500 (the calls after the lost one used to
fail with ``PendingRollbackError``, an internal error).

The faults are real and happen every time: a real PostgreSQL behind :class:`pgcut.CommitCutter`,
which lets the reservation's COMMIT through and drops the connection before its answer (or
drops it at a given statement). The edge is a real edge agent. The watcher is off: nothing but
the replica itself settles the row.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import test_control_support as support
from pgcut import CommitCutter

from conftest import RT_PREFIX
from dsec.errors import HostError

pytestmark = [pytest.mark.root, pytest.mark.anyio]

anyio_backend = support.anyio_backend
pg_cluster = support.pg_cluster
KEY = secrets.token_bytes(32)
SPEC: dict[str, Any] = {"image": {"base": "busybox:test"},
                        "resources": {"cpu": 0.1, "memory": 32 << 20, "disk": 8 << 20, "disk_medium": "memory"}}


@pytest.fixture(scope="module")
def edge_state(dsec_base: Path) -> Iterator[tuple[Path, str]]:
    from dsec.edge.testing import prepare_busybox

    name = f"{RT_PREFIX}-amb"
    state = dsec_base / f"state-{name}"
    try:
        prepare_busybox(state)
    except HostError as exc:
        pytest.skip(f"cannot build the busybox layer: {exc}")
    yield state, name


@pytest.fixture
def cut_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[CommitCutter, str, Any]]:
    """(the cutter, its database URL for the control plane, a direct psycopg connection)."""
    import psycopg

    pg: support.PgCluster = request.getfixturevalue("pg_cluster")
    made = support.database_url("postgresql", request, tmp_path)
    db = next(made).split("/")[3].split("?")[0]
    cutter = CommitCutter(pg.base, pg.port, tmp_path / "pgcut").start()
    direct = psycopg.connect(host=str(pg.base), port=pg.port, user="postgres", dbname=db, autocommit=True)
    try:
        yield cutter, cutter.url(db), direct
    finally:
        direct.close()
        cutter.stop()
        next(made, None)


async def until(pred: Callable[[], Any], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not await asyncio.to_thread(pred):
        assert time.monotonic() < deadline, f"never: {what}"
        await asyncio.sleep(0.1)


async def test_a_reservation_whose_commit_went_unanswered_is_settled_at_once(
    edge_state: tuple[Path, str], dsec_base: Path, tmp_path: Path, cut_store: tuple[CommitCutter, str, Any],
) -> None:
    from dsec.control import ControlConfig, serve_control
    from dsec.edge.config import EdgeConfig
    from dsec.edge.testing import EdgeThread, leftovers

    cutter, url, direct = cut_store
    state, name = edge_state
    ctl = await serve_control(ControlConfig(
        data_dir=tmp_path / "control", database_url=url, cluster_key=KEY, port=0, watcher=False, auth_cache_s=0.0,
        edge_timeout_s=10.0,  # a create budget of 35 s: a retry left waiting on the row would get a 429
    ))
    cfg = EdgeConfig(
        edge_id="ra", cluster_key=KEY, port=0, state_dir=state, run_dir=dsec_base / "run", runtime_name=name,
        destroy_on_shutdown=True, max_sandboxes=16, control_plane_url=ctl.url, heartbeat_interval_s=0.2,
    )
    edge = await asyncio.to_thread(lambda: EdgeThread(cfg).start())

    def rows() -> list[tuple[Any, ...]]:
        return list(direct.execute("SELECT request_id, id, state FROM sandboxes ORDER BY created_at").fetchall())

    def used() -> int:
        return int(direct.execute("SELECT used_sandboxes FROM projects WHERE name = 'root'").fetchone()[0])

    def on_edge() -> set[str]:
        return {s.id for s in edge.service.list() if s.project is not None}

    try:
        async with httpx.AsyncClient(base_url=ctl.url, timeout=120,
                                     headers={"authorization": f"Bearer {ctl.admin_token}"}) as c:
            for _ in range(200):  # the edge registers itself with its first heartbeat
                edges = (await c.get("/v1/edges")).json()
                if edges and edges[0]["health"]:
                    break
                await asyncio.sleep(0.05)

            async def create(request_id: str | None) -> httpx.Response:
                return await c.post("/v1/sandboxes", json={"spec": SPEC, "request_id": request_id})

            # 1. the careful path (the planner has seen nothing yet): cut before any edge call
            cutter.arm()
            r = await create("amb-1")
            assert r.status_code == 503 and r.json()["error"]["code"] == "unavailable", r.text
            assert cutter.cut.is_set(), "the reservation committed; the replica never heard so"
            r = await create("amb-1")  # the SDK's retry: its sandbox now, not "in flight" for a minute
            assert r.status_code == 201, r.text
            first = r.json()

            # 2. back to back, so the replica trusts its view: the edge call starts beside the
            # reservation (optimistic launch), and the sandbox it made must go with the row
            r = await create("warm")
            assert r.status_code == 201, r.text
            cutter.arm()
            r = await create("amb-2")
            assert r.status_code == 503, r.text
            assert cutter.cut.is_set()
            r = await create("amb-2")
            assert r.status_code == 201, r.text
            second = r.json()

            # 3. no request_id: nobody retries it, and its quota must not stay taken
            cutter.arm()
            r = await create(None)
            assert r.status_code == 503, r.text
            assert cutter.cut.is_set()

            await until(lambda: all(i is not None for _, i, _ in rows()), "every reservation settled")
            got = rows()
            assert sorted(str(rid) for rid, _, _ in got) == ["amb-1", "amb-2", "warm"], got  # one per request id
            assert {st for _, _, st in got} == {"running"}, got
            live = {i for _, i, _ in got}
            assert {first["id"], second["id"]} <= live
            assert used() == 3
            await until(lambda: on_edge() == live, "the edge holds exactly the store's sandboxes")
            for sb in (first, second):  # and they work
                async with httpx.AsyncClient(base_url=sb["edge_url"], timeout=60,
                                             headers={"authorization": f"Bearer {sb['token']}"}) as data:
                    r = await data.post(f"/v1/sandboxes/{sb['id']}/exec", json={"cmd": ["true"]})
                    assert r.status_code == 200 and r.json()["exit_code"] == 0, r.text

            assert (await c.delete("/v1/sandboxes", params={"all": "true"})).json()["deleted"] == 3
            await until(lambda: not on_edge(), "the edge emptied")
            assert used() == 0
    finally:
        await asyncio.to_thread(edge.stop)
        await ctl.stop()
    assert not leftovers(cfg), leftovers(cfg)


async def test_a_connection_lost_in_a_group_commit_is_a_503_for_every_call(
    cut_store: tuple[CommitCutter, str, Any],
) -> None:
    import sqlalchemy as sa

    from dsec.control.db import Store
    from dsec.errors import Unavailable

    cutter, url, _ = cut_store
    store = Store(url, threads=2)
    try:
        def plain(s: Any) -> int:
            return int(s.execute(sa.text("SELECT 2")).scalar_one())

        def marked(s: Any) -> int:
            return int(s.execute(sa.text("SELECT 1 AS cut_here")).scalar_one())

        assert await store.write_grouped(plain) == 2
        cutter.arm(at="statement", marker=b"cut_here")
        # one group: each call in its own savepoint, the second one's statement loses the connection
        got = await asyncio.gather(*(store.write_grouped(f) for f in (plain, marked, plain)), return_exceptions=True)
        assert cutter.cut.is_set()
        assert all(isinstance(g, Unavailable) for g in got), got
        assert await store.write_grouped(plain) == 2  # and the next write has a connection again
    finally:
        store.close()
