"""Edges on other hosts: join with a bootstrap token, drain, remove; detection, lost, fencing.

Each edge is a host of its own (network namespace, state directory, image pulled from the
registry); the control plane is a real process. These run in the default suite (~1 min).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest

from dsec import ImageRef, Resources, SandboxSpec
from dsec.errors import SandboxLost
from dsec.sdk.client import AsyncSandbox

pytestmark = pytest.mark.root

SPEC = SandboxSpec(image=ImageRef(base="busybox:test"),
                   resources=Resources(cpu=0.1, memory=32 << 20, disk=8 << 20, disk_medium="memory"))


async def _create(lab: Any, n: int) -> list[Any]:
    async with lab.client() as c:
        out = [o async for o in c.create_many(SPEC, n, concurrency=4)]
    assert all(o.ok for o in out), [o.error for o in out if not o.ok]
    return [o.sandbox for o in out]


def test_join_drain_remove(lab: Any) -> None:
    lb = lab(edges=2)
    e1, e2 = lb.edges[1], lb.edges[2]
    assert e1.edge_id != e2.edge_id
    # the edge holds nothing of the control plane's but what join gave it: its own state dir
    assert (e1.state_dir / "edge.json").stat().st_mode & 0o077 == 0
    # a single-use token joins once
    tok = lb.bootstrap_token(uses=1)
    body = {"url": "http://192.0.2.1:7071"}
    r = httpx.post(f"{lb.controls[0].url}/v1/edges/join", json=body, headers={"authorization": f"Bearer {tok}"})
    assert r.status_code == 200, r.text
    joined = r.json()
    assert bytes.fromhex(joined["cluster_key"]) == lb.key and joined["control_plane_urls"] == [lb.controls[0].url]
    r = httpx.post(f"{lb.controls[0].url}/v1/edges/join", json=body, headers={"authorization": f"Bearer {tok}"})
    assert r.status_code == 401 and "used up" in r.text
    with lb.api() as c:  # the joined-but-never-started edge: dead, removable at once
        assert c.get(f"/v1/edges/{joined['edge_id']}").json()["status"] == "dead"
        assert c.delete(f"/v1/edges/{joined['edge_id']}").json()["status"] == "removed"
        tokens = c.get("/v1/edges/tokens").json()
        assert all("token" not in t or t["token"] is None for t in tokens)

    sbs = asyncio.run(_create(lb, 6))
    assert {s.info.edge_id for s in sbs} == {e1.edge_id, e2.edge_id}
    on_e1 = [s for s in sbs if s.info.edge_id == e1.edge_id]
    with lb.api() as c:
        assert c.post(f"/v1/edges/{e1.edge_id}/drain").json()["draining"] is True
        r = c.delete(f"/v1/edges/{e1.edge_id}")
        assert r.status_code == 409 and r.json()["error"]["sandboxes"] == len(on_e1)
    later = asyncio.run(_create(lb, 4))
    assert {s.info.edge_id for s in later} == {e2.edge_id}, "a draining edge gets no new sandboxes"

    async def delete(sbs: list[Any]) -> None:
        async with lb.client() as c:
            for s in sbs:
                await c.delete(s.id)

    asyncio.run(delete(on_e1))
    lb._dsec("edge", "drain", e1.edge_id, "--wait", "--timeout", "30s")  # returns: nothing left there
    with lb.api() as c:
        assert c.delete(f"/v1/edges/{e1.edge_id}").json()["status"] == "removed"
        time.sleep(2.5)  # its heartbeats are refused: it stays removed
        info = c.get(f"/v1/edges/{e1.edge_id}").json()
        assert info["status"] == "removed"
        assert e1.edge_id not in {e["id"] for e in c.get("/v1/edges").json() if e["status"] != "removed"}
    asyncio.run(delete([s for s in sbs + later if s.info.edge_id == e2.edge_id]))
    audit = lb.audit()
    assert audit["missing"] == [] and audit["unknown"] == [], audit


def test_partition_detection_lost_and_fencing(lab: Any) -> None:
    lb = lab(edges=2, edge_lost_after_s=6.0)
    e1, e2 = lb.edges[1], lb.edges[2]
    sbs = asyncio.run(_create(lb, 8))
    cut = [s for s in sbs if s.info.edge_id == e1.edge_id]
    kept = [s for s in sbs if s.info.edge_id == e2.edge_id]
    assert cut and kept
    t0 = time.monotonic()
    lb.partition(1)
    # marked dead (in ~2.8 s: the bench's edge_loss_detect_s measures it; no timing asserted here)
    lb.wait_edge(1, "dead", timeout=30)
    # placement skips it at once: every new sandbox lands on the other edge
    assert {s.info.edge_id for s in asyncio.run(_create(lb, 4))} == {e2.edge_id}

    async def states() -> dict[str, str]:
        async with lb.client() as c:
            return {s.id: (await c.info(s.id)).state.value for s in cut}

    while set(asyncio.run(states()).values()) != {"lost"}:
        assert time.monotonic() - t0 < 60, asyncio.run(states())
        time.sleep(0.2)
    with lb.api() as c:
        root = c.get("/v1/projects/root").json()
        assert root["used"]["sandboxes"] == len(kept) + 4, root  # the lost ones' quota came back

    async def use_lost() -> None:
        async with lb.client() as c:
            with pytest.raises(SandboxLost):
                await c.connect(cut[0].id)
            sb = AsyncSandbox(c, cut[0].info)  # a handle from before: its edge does not answer
            with pytest.raises(SandboxLost):
                await sb.exec("true", timeout=5)

    asyncio.run(use_lost())
    # healed: the control plane's decision wins. The edge destroys the lost sandboxes (epoch
    # check) before it gets work again, and a data-path call to one is SandboxLost from the edge.
    lb.heal(1)
    lb.wait_edge(1, "alive", timeout=15)
    assert lb.edge_info(1)["epoch"] >= 1
    left = {s["id"] for s in lb.edge_sandboxes(1)}
    assert not left & {s.id for s in cut}, left

    async def after_heal() -> None:
        async with lb.client() as c:
            with pytest.raises(SandboxLost):  # now from the edge itself: it destroyed it when fenced
                await AsyncSandbox(c, cut[0].info).exec("true", timeout=5)
            for s in kept:
                assert (await (await c.connect(s.id)).exec("echo ok")).stdout == b"ok\n"
            fresh = [o async for o in c.create_many(SPEC, 6, concurrency=3)]
            assert all(o.ok for o in fresh)
            assert e1.edge_id in {o.sandbox.info.edge_id for o in fresh if o.sandbox}  # back in placement

    asyncio.run(after_heal())
    audit = lb.audit()
    assert audit["missing"] == [] and audit["unknown"] == [] and audit["duplicate_requests"] == {}, audit
