"""The control plane's HTTP API against a real server, stub edges, and both stores.

Every test taking ``db_url`` runs twice: on the embedded SQLite and on a
throwaway PostgreSQL cluster (see test_control_support.py).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import test_control_support as support
from test_control_support import SPEC, GiB, MiB, cluster

from dsec.http import auth

pytestmark = pytest.mark.anyio

# fixtures of the support module, bound here so pytest finds them
anyio_backend = support.anyio_backend
pg_cluster = support.pg_cluster
db_url = support.db_url


def err(r: httpx.Response) -> dict[str, Any]:
    body = r.json()
    assert "error" in body, body
    return dict(body["error"])


async def create(c: httpx.AsyncClient, **kw: Any) -> httpx.Response:
    return await c.post("/v1/sandboxes", json={"spec": SPEC, **kw})


# --------------------------------------------------------------------- IAM ----


async def test_nested_projects_carve_quota_and_tokens_see_only_their_subtree(db_url: str, tmp_path: Path) -> None:
    async with cluster(db_url, tmp_path) as cl:
        admin = cl.client()
        team_tok = await cl.project("team", sandboxes=4, cpu=4, memory=4 * GiB)
        other_tok = await cl.project("other", sandboxes=4, cpu=4, memory=4 * GiB)
        team, other = cl.client(team_tok), cl.client(other_tok)

        # team carves 3 of its 4 sandboxes into a child, then a grandchild out of the child
        r = await team.post("/v1/projects", json={"name": "team-a", "quota": {"sandboxes": 3, "cpu": 3, "memory": 3 * GiB}})
        assert r.status_code == 201, r.text
        r = await team.post("/v1/projects", json={"name": "team-a1", "parent": "team-a",
                                                  "quota": {"sandboxes": 3, "cpu": 1, "memory": GiB}})
        assert r.status_code == 201
        r = await team.post("/v1/projects", json={"name": "team-b", "quota": {"sandboxes": 2, "cpu": 1, "memory": GiB}})
        assert r.status_code == 403
        e = err(r)
        assert e["code"] == "quota_exceeded" and e["resource"] == "sandboxes" and e["project"] == "team"
        assert e["limit"] == 4 and e["reserved"] == 3 and e["available"] == 1

        # the parent's own sandboxes count against what is left after the carve: 1
        assert (await create(team)).status_code == 201
        r = await create(team)
        assert r.status_code == 403 and err(r)["code"] == "quota_exceeded"

        # the grandchild can use its own quota, and the team token sees it (its subtree)
        a1 = cl.client(await cl.project("team-a1-ci", sandboxes=1, cpu=1, memory=GiB, parent="team-a1", token=team_tok))
        r = await create(a1)
        assert r.status_code == 201
        sub_id = r.json()["id"]
        assert r.json()["project"] == "team-a1-ci"
        assert sub_id in [s["id"] for s in (await team.get("/v1/sandboxes")).json()]
        assert (await team.get(f"/v1/sandboxes/{sub_id}")).status_code == 200

        # ...but another project sees nothing of it: not in lists, not by id, cannot delete it
        assert (await other.get("/v1/sandboxes")).json() == []
        r = await other.get(f"/v1/sandboxes/{sub_id}")
        assert r.status_code == 404 and err(r)["code"] == "sandbox_not_found"
        assert (await other.delete(f"/v1/sandboxes/{sub_id}")).status_code == 404
        assert (await other.delete("/v1/sandboxes", params={"all": "true"})).json() == {"deleted": 0}
        assert {p["name"] for p in (await other.get("/v1/projects")).json()} == {"other"}
        assert (await other.get("/v1/projects/team")).status_code == 404
        r = await other.post("/v1/tokens", json={"project": "team"})
        assert r.status_code == 404
        # a child token cannot raise its own quota; the parent can, within its own
        r = await a1.patch("/v1/projects/team-a1-ci", json={"quota": {"sandboxes": 9, "cpu": 9, "memory": GiB}})
        assert r.status_code == 403 and err(r)["code"] == "forbidden"
        r = await admin.patch("/v1/projects/team", json={"quota": {"sandboxes": 2, "cpu": 4, "memory": 4 * GiB}})
        assert r.status_code == 403 and err(r)["code"] == "quota_exceeded"  # it has carved out 3
        info = {p["name"]: p for p in (await admin.get("/v1/projects")).json()}
        assert info["team"]["used"]["sandboxes"] == 1 and info["team"]["reserved"]["sandboxes"] == 3
        assert info["team-a1"]["reserved"]["sandboxes"] == 1 and info["team-a1-ci"]["used"]["sandboxes"] == 1
        assert info["root"]["reserved"]["sandboxes"] == 8
        me = (await team.get("/v1/whoami")).json()
        assert me["project"] == "team" and set(me["projects"]) == {"team", "team-a", "team-a1", "team-a1-ci"}


async def test_tokens_revocation_and_credentials(db_url: str, tmp_path: Path) -> None:
    async with cluster(db_url, tmp_path) as cl:
        admin = cl.client()
        r = await admin.post("/v1/tokens", json={"name": "ci"})
        assert r.status_code == 201
        tok = r.json()
        assert tok["token"].startswith("dsk_") and tok["project"] == "root"
        listed = (await admin.get("/v1/tokens")).json()
        assert tok["id"] in [t["id"] for t in listed] and all(t["token"] is None for t in listed)
        user = cl.client(tok["token"])
        assert (await user.get("/v1/sandboxes")).status_code == 200
        assert (await admin.delete(f"/v1/tokens/{tok['id']}")).status_code == 204
        assert (await admin.delete(f"/v1/tokens/{tok['id']}")).status_code == 204  # idempotent
        r = await user.get("/v1/sandboxes")
        assert r.status_code == 401 and err(r)["code"] == "auth_error" and "revoked" in err(r)["message"]

        anon = httpx.AsyncClient(base_url=cl.url)
        cl.clients.append(anon)
        r = await anon.get("/v1/sandboxes")
        assert r.status_code == 401 and err(r)["code"] == "auth_error"
        r = await anon.get("/v1/sandboxes", headers={"authorization": "Bearer dsk_forged"})
        assert r.status_code == 401
        # a sandbox token is for the data path on one edge, not for the control plane
        sb = (await create(admin)).json()
        r = await anon.get("/v1/sandboxes", headers={"authorization": f"Bearer {sb['token']}"})
        assert r.status_code == 403 and err(r)["code"] == "forbidden"
        # edges register with an edge-admin token only
        r = await admin.post("/v1/edges/register", json=cl.edges[0].health().model_dump(mode="json"))
        assert r.status_code == 401
        forged, _ = auth.mint(b"k" * 32, sandbox_id="*", project="*", scope="edge-admin")
        r = await anon.post("/v1/edges/register", json=cl.edges[0].health().model_dump(mode="json"),
                            headers={"authorization": f"Bearer {forged}"})
        assert r.status_code == 401 and "signature" in err(r)["message"]
        # a newer edge's report with a field this control plane does not know is still taken
        # (a rolling upgrade must not make edges look dead), and the field is not kept
        edge = cl.edges[0]
        tok, _ = auth.mint(edge.key, sandbox_id="*", project="*", scope="edge-admin")
        newer = {**edge.health().model_dump(mode="json"), "gpus_free": 3}
        r = await anon.post("/v1/edges/register", json=newer, headers={"authorization": f"Bearer {tok}"})
        assert r.status_code == 200, r.text
        assert "gpus_free" not in json.dumps((await admin.get("/v1/edges")).json())
        # edges are listed for the root project (and edge-admin tokens), not for other projects
        assert (await admin.get("/v1/edges")).status_code == 200
        r = await cl.client(await cl.project("p")).get("/v1/edges")
        assert r.status_code == 403


# --------------------------------------------------------------- sandboxes ----


async def test_create_get_list_delete_and_the_data_path_token(db_url: str, tmp_path: Path) -> None:
    async with cluster(db_url, tmp_path, edges=[{}, {}]) as cl:
        c = cl.client()
        r = await create(c, labels={"job": "a", "split": "train"}, task="t1", lifecycle={"ttl_s": 600})
        assert r.status_code == 201, r.text
        sb = r.json()
        assert sb["state"] == "running" and sb["task"] == "t1" and sb["project"] == "root"
        edge = next(e for e in cl.edges if e.edge_id == sb["edge_id"])
        assert sb["id"].startswith(f"{edge.edge_id}-") and sb["edge_url"] == edge.url
        claims = auth.verify(cl.key, sb["token"])  # the edge checks this without a round trip
        assert claims.sandbox_id == sb["id"] and claims.scope == "sandbox" and claims.project == "root"
        assert sb["expires_at"] - sb["created_at"] == pytest.approx(600, abs=1)

        got = (await c.get(f"/v1/sandboxes/{sb['id']}")).json()
        assert got["id"] == sb["id"] and got["token"] and got["token_expires_at"] >= sb["token_expires_at"]
        await create(c, labels={"job": "b"})
        assert len((await c.get("/v1/sandboxes")).json()) == 2
        assert [s["id"] for s in (await c.get("/v1/sandboxes", params={"label": "job=a"})).json()] == [sb["id"]]
        assert len((await c.get("/v1/sandboxes", params={"label": "split"})).json()) == 1
        assert [s["id"] for s in (await c.get("/v1/sandboxes", params={"task": "t1"})).json()] == [sb["id"]]
        assert (await c.get("/v1/sandboxes", params={"state": "stopped"})).json() == []
        assert (await c.get("/v1/tasks/t1")).json()["used"]["sandboxes"] == 1

        assert (await c.delete(f"/v1/sandboxes/{sb['id']}")).status_code == 204
        assert sb["id"] not in edge.sandboxes
        assert (await c.delete(f"/v1/sandboxes/{sb['id']}")).status_code == 204  # idempotent
        gone = (await c.get(f"/v1/sandboxes/{sb['id']}")).json()
        assert gone["state"] == "stopped" and gone["token"] is None and gone["reason"] == "deleted"
        assert [s["id"] for s in (await c.get("/v1/sandboxes", params={"state": "stopped"})).json()] == [sb["id"]]
        assert (await c.get("/v1/tasks/t1")).json()["used"]["sandboxes"] == 0
        assert (await c.delete("/v1/sandboxes/e1-000000000000")).status_code == 404


async def test_delete_by_task_and_label(db_url: str, tmp_path: Path) -> None:
    async with cluster(db_url, tmp_path) as cl:
        c = cl.client()
        r = await c.post("/v1/sandboxes/batch", json={"spec": SPEC, "count": 5, "task": "job", "labels": {"k": "v"}})
        assert all(i["sandbox"] for i in r.json()["items"])
        await create(c, labels={"k": "w"})
        await create(c, labels={"k": "w"})
        r = await c.delete("/v1/sandboxes")
        assert r.status_code == 422 and err(r)["field"] == "task"  # no accidental delete-everything
        assert (await c.delete("/v1/sandboxes", params={"label": "k=w"})).json() == {"deleted": 2}
        assert len(cl.edges[0].live_ids()) == 5
        r = await c.delete("/v1/tasks/job")
        assert r.json() == {"deleted": 5}
        assert cl.edges[0].live_ids() == set()
        assert (await c.get("/v1/tasks/job")).status_code == 404
        root = (await c.get("/v1/projects/root")).json()
        assert root["used"]["sandboxes"] == 0 and root["used"]["cpu"] == 0
        edges = (await c.get("/v1/edges")).json()
        assert edges[0]["committed"]["sandboxes"] == 0


async def test_task_quota_caps_creates(db_url: str, tmp_path: Path) -> None:
    async with cluster(db_url, tmp_path) as cl:
        c = cl.client()
        r = await c.post("/v1/tasks", json={"name": "small", "quota": {"sandboxes": 2, "memory": 600 * MiB}})
        assert r.status_code == 201 and r.json()["quota"]["sandboxes"] == 2
        assert (await create(c, task="small")).status_code == 201
        assert (await create(c, task="small")).status_code == 201
        r = await create(c, task="small")
        assert r.status_code == 403
        e = err(r)
        assert e["code"] == "quota_exceeded" and e["task"] == "small" and e["resource"] in ("sandboxes", "memory")
        assert (await create(c, task="other")).status_code == 201  # the project itself still has room
        assert [t["name"] for t in (await c.get("/v1/tasks")).json()] == ["small", "other"]
        r = await create(c, task="Bad Name")
        assert r.status_code == 422 and err(r)["field"] == "task"


async def test_idempotent_create_sequential_and_in_flight(db_url: str, tmp_path: Path) -> None:
    async with cluster(db_url, tmp_path, edges=[{"create_delay_s": 0.5}]) as cl:
        c = cl.client()
        edge = cl.edges[0]
        # three calls with one key while the first is still in flight: one sandbox, one answer
        rs = await asyncio.gather(*(create(c, request_id="req-1") for _ in range(3)))
        assert [r.status_code for r in rs] == [201, 201, 201], [r.text for r in rs]
        assert len({r.json()["id"] for r in rs}) == 1
        assert len(edge.live_ids()) == 1 and edge.creates == 1
        # a retry after the answer was lost (e.g. a client timeout) gets the same sandbox again
        first = rs[0].json()
        again = await create(c, request_id="req-1")
        assert again.status_code == 201 and again.json()["id"] == first["id"] and again.json()["token"]
        assert edge.creates == 1
        # the client gave up mid-flight: its retry still gets the one sandbox
        with pytest.raises(httpx.ReadTimeout):
            await c.post("/v1/sandboxes", json={"spec": SPEC, "request_id": "req-2"}, timeout=0.1)
        r = await create(c, request_id="req-2")
        assert r.status_code == 201
        await asyncio.sleep(0.1)
        assert len(edge.live_ids()) == 2 and edge.creates == 2
        # the same key with another body is a client bug, not a silent replay
        r = await create(c, request_id="req-1", labels={"x": "y"})
        assert r.status_code == 422 and err(r)["field"] == "request_id"
        # keys are per project: another project may use the same one
        p = cl.client(await cl.project("p"))
        r = await create(p, request_id="req-1")
        assert r.status_code == 201 and r.json()["id"] != first["id"]


async def test_batch_reports_per_item_failures(db_url: str, tmp_path: Path) -> None:
    async with cluster(db_url, tmp_path, edges=[{"capacity_sandboxes": 50}]) as cl:
        c = cl.client(await cl.project("p", sandboxes=7, cpu=100, memory=100 * GiB))
        r = await c.post("/v1/sandboxes/batch", json={"spec": SPEC, "count": 10, "task": "b", "request_id": "batch-1"})
        assert r.status_code == 200, r.text
        items = r.json()["items"]
        ok = [i["sandbox"] for i in items if i["sandbox"]]
        bad = [i["error"] for i in items if i["error"]]
        assert len(ok) == 7 and len(bad) == 3
        assert all(e["code"] == "quota_exceeded" and e["resource"] == "sandboxes" for e in bad)
        assert len({s["id"] for s in ok}) == 7
        # retrying the batch with its key creates nothing new: created items answer again
        r = await c.post("/v1/sandboxes/batch", json={"spec": SPEC, "count": 10, "task": "b", "request_id": "batch-1"})
        again = [i["sandbox"]["id"] for i in r.json()["items"] if i["sandbox"]]
        assert set(again) == {s["id"] for s in ok}
        assert len(cl.edges[0].live_ids()) == 7
        # a bad batch is refused as a whole before anything happens
        r = await c.post("/v1/sandboxes/batch", json={"spec": SPEC, "count": 0})
        assert r.status_code == 422 and err(r)["field"] == "count"


async def test_backpressure_when_nothing_fits(db_url: str, tmp_path: Path) -> None:
    async with cluster(db_url, tmp_path, edges=[{"capacity_sandboxes": 2}, {"capacity_sandboxes": 1}]) as cl:
        c = cl.client()
        for _ in range(3):
            assert (await create(c)).status_code == 201
        r = await create(c)
        assert r.status_code == 429
        assert int(r.headers["retry-after"]) >= 1
        e = err(r)
        assert e["code"] == "backpressure" and e["retry_after"] > 0 and "sandboxes" in e["reason"]
        # a batch that overflows: the items that fit are created, the rest say backpressure
        await c.delete("/v1/sandboxes", params={"all": "true"})
        r = await c.post("/v1/sandboxes/batch", json={"spec": SPEC, "count": 5})
        codes = sorted((i["error"] or {}).get("code", "ok") for i in r.json()["items"])
        assert codes == ["backpressure", "backpressure", "ok", "ok", "ok"]
        # too big for any edge: never a silent drop, and not a "retry later" either: 422
        # exceeds_capacity, with what was short (issue 28: a request that can never fit)
        await c.delete("/v1/sandboxes", params={"all": "true"})
        big = {**SPEC, "resources": {"cpu": 1, "memory": 128 * GiB}}
        r = await c.post("/v1/sandboxes", json={"spec": big})
        assert r.status_code == 422 and err(r)["code"] == "exceeds_capacity", r.text
        assert "memory" in err(r)["reasons"] and "retry-after" not in r.headers
        # no edge at all
        for e_ in (await c.get("/v1/edges")).json():
            await c.post(f"/v1/edges/{e_['id']}/drain")
        r = await create(c)
        assert r.status_code == 429 and "draining" in err(r)["reason"]


async def test_refused_admission_is_placed_elsewhere(db_url: str, tmp_path: Path) -> None:
    edges = [{"edge_id": "ea", "refuse_all": True}, {"edge_id": "eb", "refuse_all": True}, {"edge_id": "ec"}]
    async with cluster(db_url, tmp_path, edges=edges) as cl:
        c = cl.client()
        ea, eb, ec = cl.edges
        for _ in range(6):
            r = await create(c)
            assert r.status_code == 201 and r.json()["edge_id"] == "ec", r.text
        assert ea.refusals + eb.refusals >= 1  # power-of-2 sampled a refusing edge at least once
        assert ea.live_ids() == eb.live_ids() == set()
        listed = {e["id"]: e["committed"]["sandboxes"] for e in (await c.get("/v1/edges")).json()}
        assert listed == {"ea": 0, "eb": 0, "ec": 6}  # refused reservations moved with the create
        # every edge refuses: 429 after max_attempts edges, reservation released
        ec.refuse_all = True
        r = await create(c)
        assert r.status_code == 429 and err(r)["reason"] == "edges refused"
        assert (await c.get("/v1/projects/root")).json()["used"]["sandboxes"] == 6


async def test_placement_spreads_skips_drained_and_honours_selector(db_url: str, tmp_path: Path) -> None:
    edges = [{"edge_id": "ea", "labels": {"zone": "x"}}, {"edge_id": "eb", "labels": {"zone": "y"}}]
    async with cluster(db_url, tmp_path, edges=edges) as cl:
        c = cl.client()
        r = await c.post("/v1/sandboxes/batch", json={"spec": SPEC, "count": 20})
        per_edge = {"ea": 0, "eb": 0}
        for i in r.json()["items"]:
            per_edge[i["sandbox"]["edge_id"]] += 1
        assert per_edge["ea"] >= 8 and per_edge["eb"] >= 8, per_edge  # k=2 of 2: least loaded
        r = await c.post("/v1/sandboxes", json={"spec": SPEC, "edge_selector": {"zone": "y"}})
        assert r.json()["edge_id"] == "eb"
        r = await c.post("/v1/edges/eb/drain", json={"draining": True})
        assert r.status_code == 200 and r.json()["draining"] is True
        for _ in range(3):
            assert (await create(c)).json()["edge_id"] == "ea"
        r = await c.post("/v1/sandboxes", json={"spec": SPEC, "edge_selector": {"zone": "y"}})
        assert r.status_code == 429
        await c.post("/v1/edges/eb/drain", json={"draining": False})
        r = await c.post("/v1/sandboxes", json={"spec": SPEC, "edge_selector": {"zone": "y"}})
        assert r.status_code == 201
        assert (await c.post("/v1/edges/nope/drain")).status_code == 404


async def test_bad_input_is_a_4xx_with_the_field(db_url: str, tmp_path: Path) -> None:
    async with cluster(db_url, tmp_path) as cl:
        c = cl.client()
        cases: list[tuple[Any, str]] = [
            ({"spec": {"image": {"base": "busybox:test"}, "resources": {"cpu": 0}}}, "spec.resources.cpu"),
            ({"spec": {"image": {"base": "Not A Ref"}}}, "spec.image.base"),
            ({"spec": SPEC, "labels": {"BAD KEY": "v"}}, "labels"),
            ({"spec": SPEC, "lifecycle": {"ttl_s": -1}}, "lifecycle.ttl_s"),
            ({"spec": SPEC, "surprise": 1}, "surprise"),
            ({}, "spec"),
        ]
        for body, field in cases:
            r = await c.post("/v1/sandboxes", json=body)
            assert r.status_code == 422, (body, r.text)
            e = err(r)
            assert e["code"] == "invalid_spec" and e["field"] == field, (body, e)
        r = await c.post("/v1/sandboxes", content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 422 and err(r)["code"] == "invalid_spec"
        r = await c.post("/v1/sandboxes", json={"spec": {"image": {"base": "nosuchimage:1"}}})
        assert r.status_code == 404 and err(r)["code"] == "layer_not_found" and "dsec image" in err(r)["message"]
        r = await c.get("/v1/sandboxes", params={"state": "sleepy"})
        assert r.status_code == 422 and err(r)["field"] == "state.0"
        r = await c.get("/v1/sandboxes/" + "x" * 300)
        assert r.status_code == 404
        r = await c.post("/v1/projects", json={"name": "UPPER", "quota": {"sandboxes": 1, "cpu": 1, "memory": 1}})
        assert r.status_code == 422 and err(r)["field"] == "name"
        r = await c.post("/v1/projects", json={"name": "p", "quota": {"sandboxes": -1, "cpu": 1, "memory": 1}})
        assert r.status_code == 422 and err(r)["field"] == "quota.sandboxes"
        r = await c.post("/v1/projects", json={"name": "p", "parent": "ghost", "quota": {"sandboxes": 1, "cpu": 1, "memory": 1}})
        assert r.status_code == 404 and err(r)["code"] == "not_found"
        assert (await c.post("/v1/projects", json={"name": "p", "quota": {"sandboxes": 1, "cpu": 1, "memory": 1}})).status_code == 201
        r = await c.post("/v1/projects", json={"name": "p", "quota": {"sandboxes": 1, "cpu": 1, "memory": 1}})
        assert r.status_code == 409 and err(r)["code"] == "conflict"
        r = await c.get("/v1/nowhere")
        assert r.status_code == 404 and err(r)["code"] == "not_found"
        assert (await c.get("/openapi.json")).status_code == 200
        assert (await c.get("/healthz")).json()["ok"] is True
