"""Pause/resume, forks, snapshots (storage quota) and task stages through the control plane.

Real control plane over HTTP, stub edges speaking the edge's pause/snapshot/fork/stage
API, both stores (``db_url`` runs each test on SQLite and on PostgreSQL).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import test_control_support as support
from test_control_support import SPEC, GiB, MiB, cluster

from dsec.control.watcher import recount_txn

pytestmark = pytest.mark.anyio

anyio_backend = support.anyio_backend
pg_cluster = support.pg_cluster
db_url = support.db_url


def err(r: httpx.Response) -> dict[str, Any]:
    body = r.json()
    assert "error" in body, body
    return dict(body["error"])


async def make(c: httpx.AsyncClient, **kw: Any) -> dict[str, Any]:
    r = await c.post("/v1/sandboxes", json={"spec": kw.pop("spec", SPEC), **kw})
    assert r.status_code == 201, r.text
    return dict(r.json())


async def states(c: httpx.AsyncClient, **params: Any) -> dict[str, str]:
    r = await c.get("/v1/sandboxes", params={"state": ["running", "paused", "creating"], **params})
    assert r.status_code == 200, r.text
    return {x["id"]: x["state"] for x in r.json()}


async def storage(c: httpx.AsyncClient, project: str) -> dict[str, Any]:
    r = await c.get(f"/v1/projects/{project}/storage")
    assert r.status_code == 200, r.text
    return dict(r.json())


# ------------------------------------------------------------ pause/resume ----


async def test_group_pause_and_resume_by_task_fan_out_and_touch_only_the_callers_sandboxes(
    db_url: str, tmp_path: Path
) -> None:
    async with cluster(db_url, tmp_path, edges=[{}, {}]) as cl:
        a = cl.client(await cl.project("a"))
        b = cl.client(await cl.project("b"))
        mine = [await make(a, task="job") for _ in range(4)]
        theirs = await make(b, task="job")  # same task name, another project
        assert {x["edge_id"] for x in mine} <= {"e1", "e2"}

        r = await a.post("/v1/sandboxes/" + mine[0]["id"] + "/pause")
        assert r.status_code == 200 and r.json()["state"] == "paused"
        assert (await states(a))[mine[0]["id"]] == "paused"  # at once, not after a watcher poll

        r = await a.post("/v1/pause", params={"task": "job"})
        assert r.status_code == 200, r.text
        res = r.json()
        assert sorted(res["done"]) == sorted(x["id"] for x in mine[1:])
        assert res["skipped"] == [mine[0]["id"]] and res["errors"] == {}
        assert set((await states(a, task="job")).values()) == {"paused"}
        assert (await states(b))[theirs["id"]] == "running"
        edge_of_theirs = next(e for e in cl.edges if theirs["id"] in e.sandboxes)
        assert edge_of_theirs.sandboxes[theirs["id"]]["info"]["state"] == "running"

        # a group naming an id that is not the caller's: reported for that id, the others done
        r = await a.post("/v1/resume", params={"id": [mine[0]["id"], theirs["id"]]})
        res = r.json()
        assert res["done"] == [mine[0]["id"]]
        assert res["errors"][theirs["id"]]["code"] == "sandbox_not_found"

        r = await a.post("/v1/resume", params={"task": "job"})
        assert sorted(r.json()["done"]) == sorted(x["id"] for x in mine[1:])
        assert set((await states(a, task="job")).values()) == {"running"}

        r = await a.post(f"/v1/sandboxes/{mine[0]['id']}/resume")
        assert r.status_code == 409 and err(r)["code"] == "sandbox_state"
        r = await a.post("/v1/pause")
        assert r.status_code == 422 and err(r)["code"] == "invalid_spec"
        r = await b.post(f"/v1/sandboxes/{mine[0]['id']}/pause")
        assert r.status_code == 404


# --------------------------------------------------------------------- fork ----


async def test_fork_children_are_recorded_counted_listed_and_deletable(db_url: str, tmp_path: Path) -> None:
    async with cluster(db_url, tmp_path) as cl:
        tok = await cl.project("p", sandboxes=5, cpu=5, memory=5 * GiB)
        c = cl.client(tok)
        parent = await make(c, task="tree", labels={"run": "1"})
        edge = cl.edges[0]

        r = await c.post(f"/v1/sandboxes/{parent['id']}/fork", json={"n": 3})
        assert r.status_code == 201, r.text
        kids = r.json()
        assert len(kids) == 3 and all(k["token"] and k["task"] == "tree" for k in kids)
        assert all(k["labels"] == {"run": "1"} and k["project"] == "p" for k in kids)
        proj = (await c.get("/v1/projects/p")).json()
        assert proj["used"]["sandboxes"] == 4 and proj["used"]["cpu"] == 4
        task = (await c.get("/v1/tasks/tree")).json()
        assert task["used"]["sandboxes"] == 4
        listed = await states(c, task="tree")
        assert set(listed) == {parent["id"], *(k["id"] for k in kids)}
        got = await c.get(f"/v1/sandboxes/{kids[0]['id']}")  # routable by id
        assert got.status_code == 200 and got.json()["edge_url"] == edge.url

        # 2 more would exceed 5 sandboxes: refused with the typed error before the edge forks
        forks_before = edge.forks
        r = await c.post(f"/v1/sandboxes/{parent['id']}/fork", json={"n": 2})
        assert r.status_code == 403, r.text
        e = err(r)
        assert e["code"] == "quota_exceeded" and e["resource"] == "sandboxes" and e["requested"] == 2
        assert edge.forks == forks_before and len(edge.live_ids()) == 4
        assert (await c.get("/v1/projects/p")).json()["used"]["sandboxes"] == 4

        # the task's own ceiling applies to forks too
        r = await c.post("/v1/tasks", json={"name": "tree", "quota": {"sandboxes": 4}})
        assert r.status_code == 201
        r = await c.post(f"/v1/sandboxes/{parent['id']}/fork", json={"n": 1})
        assert r.status_code == 403 and err(r)["task"] == "tree"

        # the edge refuses (full): nothing stays charged
        r = await c.post("/v1/tasks", json={"name": "tree", "quota": {}})
        edge.capacity_sandboxes = 4
        r = await c.post(f"/v1/sandboxes/{parent['id']}/fork", json={"n": 1})
        assert r.status_code == 429, r.text
        assert (await c.get("/v1/projects/p")).json()["used"]["sandboxes"] == 4

        r = await c.delete("/v1/sandboxes", params={"task": "tree"})
        assert r.json()["deleted"] == 4
        assert edge.live_ids() == set()
        assert (await c.get("/v1/projects/p")).json()["used"]["sandboxes"] == 0
        assert await cl.control.store.write(recount_txn) == 0


# ---------------------------------------------------------------- snapshots ----


async def test_snapshots_are_listed_counted_against_storage_and_refused_when_over(
    db_url: str, tmp_path: Path
) -> None:
    async with cluster(db_url, tmp_path) as cl:
        admin = cl.client()
        r = await admin.post("/v1/projects", json={"name": "p", "quota": {
            "sandboxes": 10, "cpu": 10, "memory": 10 * GiB, "storage": 10 * MiB}})
        assert r.status_code == 201, r.text
        assert (await storage(admin, "root"))["reserved"] == 10 * MiB
        tok = (await admin.post("/v1/tokens", json={"project": "p"})).json()["token"]
        c = cl.client(tok)
        edge = cl.edges[0]
        sb = await make(c)

        r = await c.post(f"/v1/sandboxes/{sb['id']}/snapshot", json={"name": "configured"})
        assert r.status_code == 201, r.text
        snap = r.json()
        assert snap["ref"] == "configured:latest" and snap["project"] == "p" and snap["edge_id"] == "e1"
        st = await storage(c, "p")
        assert st["used"] == 4 * MiB and st["available"] == 6 * MiB and st["snapshots"] == 1
        listed = (await c.get("/v1/snapshots")).json()
        assert [x["ref"] for x in listed] == ["configured:latest"]
        assert (await admin.get("/v1/snapshots")).json()[0]["project"] == "p"  # an ancestor sees it

        # a snapshot bigger than what is left: typed refusal, and nothing kept on the edge or in the store
        edge.snapshot_size = 8 * MiB
        r = await c.post(f"/v1/sandboxes/{sb['id']}/snapshot", json={"name": "big"})
        assert r.status_code == 403, r.text
        e = err(r)
        assert e["code"] == "quota_exceeded" and e["resource"] == "storage" and e["requested"] == 8 * MiB
        assert [x["ref"] for x in edge.snapshots.values()] == ["configured:latest"]
        assert (await storage(c, "p"))["used"] == 4 * MiB
        assert len((await c.get("/v1/snapshots")).json()) == 1

        # a sandbox started from it holds it: deleting is a typed conflict until the sandbox goes
        user = await make(c, spec={**SPEC, "image": {"base": "configured:latest"}})
        r = await c.delete("/v1/snapshots/configured:latest")
        assert r.status_code == 409 and err(r)["code"] == "conflict" and err(r)["sandboxes"] == [user["id"]]
        assert len(edge.snapshots) == 1
        assert (await c.delete(f"/v1/sandboxes/{user['id']}")).status_code == 204
        r = await c.delete("/v1/snapshots/configured:latest")
        assert r.status_code == 204, r.text
        assert edge.snapshots == {} and (await storage(c, "p"))["used"] == 0
        r = await c.delete("/v1/snapshots/configured:latest")
        assert r.status_code == 404 and err(r)["code"] == "not_found"

        # no storage left at all: refused before the edge packs anything
        r = await admin.patch("/v1/projects/p", json={"quota": {"sandboxes": 10, "cpu": 10, "memory": 10 * GiB,
                                                                 "storage": 0}})
        assert r.status_code == 200, r.text
        r = await c.post(f"/v1/sandboxes/{sb['id']}/snapshot")
        assert r.status_code == 403 and err(r)["resource"] == "storage"
        assert edge.snapshots == {}
        assert await cl.control.store.write(recount_txn) == 0


async def test_storage_quota_is_carved_from_the_parent(db_url: str, tmp_path: Path) -> None:
    async with cluster(db_url, tmp_path) as cl:
        admin = cl.client()
        q = {"sandboxes": 4, "cpu": 4, "memory": 4 * GiB}
        assert (await admin.post("/v1/projects", json={"name": "team", "quota": {**q, "storage": 100 * MiB}})).status_code == 201
        tok = (await admin.post("/v1/tokens", json={"project": "team"})).json()["token"]
        team = cl.client(tok)
        small = {"sandboxes": 1, "cpu": 1, "memory": GiB}
        r = await team.post("/v1/projects", json={"name": "team-a", "quota": {**small, "storage": 60 * MiB}})
        assert r.status_code == 201
        r = await team.post("/v1/projects", json={"name": "team-b", "quota": {**small, "storage": 60 * MiB}})
        assert r.status_code == 403
        e = err(r)
        assert e["resource"] == "storage" and e["available"] == 40 * MiB and e["project"] == "team"
        r = await team.post("/v1/projects", json={"name": "team-b", "quota": small})  # storage 0
        assert r.status_code == 201
        # a PATCH without storage keeps it; shrinking the parent below what it carved out is refused
        assert (await team.patch("/v1/projects/team-a", json={"quota": small})).status_code == 200
        assert (await storage(team, "team-a"))["quota"] == 60 * MiB
        r = await admin.patch("/v1/projects/team", json={"quota": {**q, "storage": 50 * MiB}})
        assert r.status_code == 403 and err(r)["resource"] == "storage"
        assert (await team.delete("/v1/projects/team-a")).status_code == 204
        assert (await storage(team, "team"))["reserved"] == 0
        assert await cl.control.store.write(recount_txn) == 0


# ------------------------------------------------------------------- stages ----

STAGES = {
    "setup": {"network": {"allow": ["pypi"]}, "files": {"writable": ["/workspace"]}},
    "rollout": {"files": {"hidden": ["/tests"]}},
    "evaluate": {"files": {"read_only": ["/workspace"]}},
}


async def test_task_stages_are_inherited_and_switched_for_every_sandbox(db_url: str, tmp_path: Path) -> None:
    async with cluster(db_url, tmp_path, edges=[{}, {}]) as cl:
        c = cl.client(await cl.project("p"))
        r = await c.post("/v1/tasks", json={"name": "job", "stages": STAGES, "stage": "setup"})
        assert r.status_code == 201, r.text
        assert set(r.json()["stages"]) == set(STAGES) and r.json()["stage"] == "setup"

        sbs = [await make(c, task="job") for _ in range(3)]
        own = {**SPEC, "stages": {"only": {}}, "stage": "only"}
        mine = await make(c, task="job", spec=own)  # declares its own: keeps them
        where = {sid: e for e in cl.edges for sid in e.sandboxes}
        for sb in sbs:
            spec = where[sb["id"]].sandboxes[sb["id"]]["spec"]
            assert set(spec["stages"]) == set(STAGES) and spec["stage"] == "setup"
        assert set(where[mine["id"]].sandboxes[mine["id"]]["spec"]["stages"]) == {"only"}

        r = await c.post("/v1/tasks/job/stage", json={"stage": "rollout"})
        assert r.status_code == 200, r.text
        res = r.json()
        assert sorted(res["done"]) == sorted(x["id"] for x in sbs)
        assert list(res["errors"]) == [mine["id"]] and res["errors"][mine["id"]]["code"] == "invalid_spec"
        calls = [call for e in cl.edges for call in e.stage_calls]
        assert sorted(calls) == sorted((x["id"], "rollout") for x in sbs)

        # sandboxes made after the switch start in the task's current stage
        late = await make(c, task="job")
        assert where.get(late["id"]) is None
        late_edge = next(e for e in cl.edges if late["id"] in e.sandboxes)
        assert late_edge.sandboxes[late["id"]]["spec"]["stage"] == "rollout"
        assert (await c.get("/v1/tasks/job")).json()["stage"] == "rollout"

        r = await c.post("/v1/tasks/job/stage", json={"stage": "deploy"})
        assert r.status_code == 422
        e = err(r)
        assert e["code"] == "invalid_spec" and e["field"] == "stage" and e["stages"] == sorted(STAGES)
        r = await c.post("/v1/tasks/nope/stage", json={"stage": "setup"})
        assert r.status_code == 404
        r = await c.post("/v1/tasks", json={"name": "bad", "stages": STAGES, "stage": "deploy"})
        assert r.status_code == 422

        # one sandbox through the control plane
        r = await c.post(f"/v1/sandboxes/{sbs[0]['id']}/stage", json={"stage": "evaluate"})
        assert r.status_code == 200, r.text
        assert cl.edges[0].stage_calls[-1:] + cl.edges[1].stage_calls[-1:]


# ---------------------------------------------------------------- SDK / CLI ----


async def test_sdk_and_cli_use_the_control_plane_routes(db_url: str, tmp_path: Path, monkeypatch: Any) -> None:
    import asyncio

    from click.testing import CliRunner

    import dsec
    from dsec.cli.main import main
    from dsec.errors import DsecError, QuotaExceeded

    async with cluster(db_url, tmp_path) as cl:
        async with dsec.AsyncClient(cl.url, cl.admin_token) as admin:
            await admin.create_project("p", quota={"sandboxes": 3, "cpu": 3, "memory": 3 * GiB, "storage": 8 * MiB})
            tok = (await admin.create_token(project="p")).token
        assert tok is not None
        spec = dsec.SandboxSpec.model_validate(SPEC)
        async with dsec.AsyncClient(cl.url, tok) as c:
            sb = await c.create(spec, task="t")
            kids = await sb.fork(1)
            assert len(kids) == 1 and (await c.info(kids[0].id)).task == "t"
            with pytest.raises(QuotaExceeded):
                await sb.fork(2)
            res = await c.pause_where(task="t")
            assert sorted(res.done) == sorted([sb.id, kids[0].id])
            res = await c.resume_where(ids=[sb.id])
            assert res.done == [sb.id]
            snap = await sb.snapshot(name="s1")
            assert getattr(snap, "project", None) == "p"
            assert [x.ref for x in await c.snapshots()] == ["s1:latest"]

            env = {"DSEC_URL": cl.url, "DSEC_TOKEN": tok}
            runner = CliRunner()
            r = await asyncio.to_thread(runner.invoke, main, ["snapshot", "ls", "--json"], env=env)
            assert r.exit_code == 0, r.output
            assert "s1:latest" in r.output
            r = await asyncio.to_thread(runner.invoke, main, ["snapshot", sb.id, "--name", "s2"], env=env)
            assert r.exit_code == 0, r.output
            assert "s2:latest" in r.output
            r = await asyncio.to_thread(runner.invoke, main, ["snapshot", "rm", "s2:latest"], env=env)
            assert r.exit_code == 0, r.output

            await c.delete_snapshot("s1:latest")
            assert await c.snapshots() == []
            with pytest.raises(DsecError) as info:
                await c.delete_snapshot("s1:latest")
            assert info.value.code == "not_found"
            await c.delete_task("t")
            envadmin = {"DSEC_URL": cl.url, "DSEC_TOKEN": cl.admin_token}
            r = await asyncio.to_thread(runner.invoke, main, [
                "project", "create", "q", "--quota", "sandboxes=1,cpu=1,memory=1G,storage=1G"], env=envadmin)
            assert r.exit_code == 0, r.output
            assert (await storage(cl.client(), "q"))["quota"] == GiB
