"""Optimistic launch (dsec/control/planner.py): the edge call starts before the reservation
commits, and the transaction still decides. Real control plane, real HTTP stub edges, real
store (SQLite and PostgreSQL)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
import test_control_support as support
from test_control_support import SPEC, cluster

from dsec.control.db import PROJECTS

pytestmark = pytest.mark.anyio

anyio_backend = support.anyio_backend
pg_cluster = support.pg_cluster
db_url = support.db_url


async def create(c: httpx.AsyncClient, **kw: Any) -> httpx.Response:
    return await c.post("/v1/sandboxes", json={"spec": SPEC, **kw})


async def until(cond: Any, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


async def test_creates_after_the_first_start_on_the_edge_at_once(db_url: str, tmp_path: Path) -> None:
    async with cluster(db_url, tmp_path, edges=[{}, {}]) as cl:
        c = cl.client()
        planner = cl.control.sandboxes.planner
        first = await create(c)
        assert first.status_code == 201, first.text
        assert planner.launched == 0  # nothing seen yet: the careful path
        ids = {first.json()["id"]}
        for _ in range(6):
            r = await create(c, labels={"n": "x"})
            assert r.status_code == 201, r.text
            ids.add(r.json()["id"])
        assert planner.launched == 6 and planner.discarded == 0
        # every launch is one sandbox on one edge, recorded and charged like a careful one
        assert sum(e.creates for e in cl.edges) == 7
        assert set().union(*(e.live_ids() for e in cl.edges)) == ids
        listed = (await c.get("/v1/sandboxes", params={"label": "n=x"})).json()
        assert len(listed) == 6 and all(s["state"] == "running" for s in listed)
        assert (await c.get("/v1/projects/root")).json()["used"]["sandboxes"] == 7


async def test_quota_used_behind_the_planners_back_is_still_enforced(db_url: str, tmp_path: Path) -> None:
    async with cluster(db_url, tmp_path) as cl:
        token = await cl.project("team", sandboxes=5)
        c = cl.client(token)
        planner = cl.control.sandboxes.planner
        assert (await create(c)).status_code == 201
        # another replica fills the quota: this one's view is now wrong
        await cl.control.db.write(
            lambda s: s.execute(sa.update(PROJECTS).where(PROJECTS.c.name == "team").values(used_sandboxes=5))
        )
        r = await create(c)
        assert r.status_code == 403 and r.json()["error"]["code"] == "quota_exceeded", r.text
        assert planner.launched == 1 and planner.discarded == 1
        edge = cl.edges[0]
        await until(lambda: len(edge.live_ids()) == 1)  # the optimistic sandbox is gone again
        # and the next create is not optimistic: the refusal is remembered
        assert (await create(c)).status_code == 403
        assert planner.launched == 1 and edge.creates == 2


async def test_near_the_quota_the_careful_path_refuses_before_the_edge_sees_anything(
    db_url: str, tmp_path: Path
) -> None:
    async with cluster(db_url, tmp_path) as cl:
        token = await cl.project("small", sandboxes=2)
        c = cl.client(token)
        assert (await create(c)).status_code == 201
        assert (await create(c)).status_code == 201
        r = await create(c)
        assert r.status_code == 403 and r.json()["error"]["resource"] == "sandboxes"
        assert cl.edges[0].creates == 2  # no sandbox made only to be dropped


async def test_task_stages_set_meanwhile_reach_the_sandbox(db_url: str, tmp_path: Path) -> None:
    stages = {"rollout": {"files": {"hidden": ["/tests"]}}, "evaluate": {"files": {"read_only": ["/workspace"]}}}
    async with cluster(db_url, tmp_path) as cl:
        c = cl.client()
        planner = cl.control.sandboxes.planner
        edge = cl.edges[0]
        assert (await create(c, task="job")).status_code == 201  # the planner sees a task without stages
        r = await c.post("/v1/tasks", json={"name": "job", "stages": stages, "stage": "rollout"})
        assert r.status_code in (200, 201), r.text
        r = await create(c, task="job")
        assert r.status_code == 201, r.text
        sid = r.json()["id"]
        # the optimistic sandbox (made without the stages) was dropped, the one answered has them
        assert planner.launched == 1 and planner.discarded == 1
        spec = edge.sandboxes[sid]["spec"]
        assert set(spec["stages"]) == set(stages) and spec["stage"] == "rollout"
        await until(lambda: len(edge.live_ids()) == 2)
        # the planner now knows the task has stages: no more optimism for its stage-less specs
        assert (await create(c, task="job")).status_code == 201
        assert planner.launched == 1


async def test_an_edge_refusing_an_optimistic_create_sends_it_elsewhere(db_url: str, tmp_path: Path) -> None:
    async with cluster(db_url, tmp_path, edges=[{}, {}]) as cl:
        c = cl.client()
        planner = cl.control.sandboxes.planner
        first = (await create(c)).json()
        idle = next(e for e in cl.edges if e.edge_id != first["edge_id"])
        idle.refuse = 1  # power-of-2 over two edges plans on the emptier one: it refuses once
        r = await create(c)
        assert r.status_code == 201, r.text
        assert planner.launched == 1 and idle.refusals == 1
        assert r.json()["edge_id"] == first["edge_id"] and not idle.live_ids()
        assert (await c.get("/v1/projects/root")).json()["used"]["sandboxes"] == 2


async def test_a_burst_past_the_quota_leaves_exactly_the_quota(db_url: str, tmp_path: Path) -> None:
    async with cluster(db_url, tmp_path, edges=[{}, {}]) as cl:
        token = await cl.project("burst", sandboxes=12, cpu=1000, memory=1 << 40)
        c = cl.client(token)
        planner = cl.control.sandboxes.planner
        assert (await create(c)).status_code == 201  # the planner has seen the project
        rs = await asyncio.gather(*(create(c) for _ in range(30)))
        codes = sorted(r.status_code for r in rs)
        assert codes.count(201) == 11 and codes.count(403) == 19, [r.text[:150] for r in rs if r.status_code != 201]
        assert planner.launched >= 1
        live = lambda: set().union(*(e.live_ids() for e in cl.edges))  # noqa: E731
        await until(lambda: len(live()) == 12)  # dropped optimistic sandboxes are gone
        listed = {s["id"] for s in (await c.get("/v1/sandboxes")).json()}
        assert listed == live()
        info = (await c.get("/v1/projects/burst")).json()
        assert info["used"]["sandboxes"] == 12
