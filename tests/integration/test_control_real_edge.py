"""The control plane against a real edge agent (runtime, admission, heartbeats): the contract.

The stub edge of the other control tests stands in for logic; this module
checks the two real services agree on the wire: the edge registers itself by
heartbeat, creates go through placement to it, the sandbox token the control
plane mints is accepted by the edge, the watcher reconciles what the edge
reaps, and a refused admission becomes a 429.
"""

from __future__ import annotations

import asyncio
import base64
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import test_control_support as support

from conftest import RT_PREFIX
from dsec.errors import HostError

pytestmark = [pytest.mark.root, pytest.mark.anyio]

anyio_backend = support.anyio_backend
KEY = secrets.token_bytes(32)
SPEC: dict[str, Any] = {"image": {"base": "busybox:test"}, "resources": {"cpu": 0.5, "memory": 64 << 20, "disk": 16 << 20}}


@pytest.fixture(scope="module")
def edge_state(dsec_base: Path) -> Iterator[tuple[Path, str]]:
    from dsec.edge.testing import prepare_busybox

    name = f"{RT_PREFIX}-ctl"
    state = dsec_base / f"state-{name}"
    try:
        prepare_busybox(state)
    except HostError as exc:
        pytest.skip(f"cannot build the busybox layer: {exc}")
    yield state, name


async def test_control_plane_drives_a_real_edge(edge_state: tuple[Path, str], dsec_base: Path, tmp_path: Path) -> None:
    from dsec.control import ControlConfig, serve_control
    from dsec.edge.config import EdgeConfig
    from dsec.edge.testing import EdgeThread, leftovers

    state, name = edge_state
    ctl = await serve_control(ControlConfig(
        data_dir=tmp_path / "control", cluster_key=KEY, port=0, watcher=False, auth_cache_s=0.0,
    ))
    cfg = EdgeConfig(
        edge_id="rx", cluster_key=KEY, port=0, state_dir=state, run_dir=dsec_base / "run", runtime_name=name,
        destroy_on_shutdown=True, watchdog_interval_s=0.2, max_sandboxes=2, control_plane_url=ctl.url,
        heartbeat_interval_s=0.2,
    )
    edge = await asyncio.to_thread(lambda: EdgeThread(cfg).start())
    try:
        async with httpx.AsyncClient(base_url=ctl.url, timeout=60,
                                     headers={"authorization": f"Bearer {ctl.admin_token}"}) as c:
            for _ in range(100):  # the edge registers itself with its first heartbeat
                edges = (await c.get("/v1/edges")).json()
                if edges and edges[0]["health"]:
                    break
                await asyncio.sleep(0.05)
            assert edges and edges[0]["id"] == "rx" and edges[0]["url"] == edge.url
            assert any(ref.startswith("busybox") for ref in edges[0]["health"]["layers"])
            assert "busybox:test" in [i["ref"] for i in (await c.get("/v1/images")).json()]

            r = await c.post("/v1/sandboxes", json={"spec": SPEC, "labels": {"job": "e2e"}, "task": "t",
                                                     "request_id": "real-1", "lifecycle": {"ttl_s": 600}})
            assert r.status_code == 201, r.text
            sb = r.json()
            assert sb["id"].startswith("rx-") and sb["edge_url"] == edge.url and sb["project"] == "root"
            again = await c.post("/v1/sandboxes", json={"spec": SPEC, "labels": {"job": "e2e"}, "task": "t",
                                                         "request_id": "real-1", "lifecycle": {"ttl_s": 600}})
            assert again.json()["id"] == sb["id"]

            # the data path: straight to the edge with the token the control plane minted
            async with httpx.AsyncClient(base_url=sb["edge_url"], timeout=60,
                                         headers={"authorization": f"Bearer {sb['token']}"}) as data:
                r = await data.post(f"/v1/sandboxes/{sb['id']}/exec", json={"cmd": ["echo", "hello"]})
                assert r.status_code == 200, r.text
                assert base64.b64decode(r.json()["stdout_b64"]) == b"hello\n"
                info = (await data.get(f"/v1/sandboxes/{sb['id']}")).json()
                assert info["labels"] == {"job": "e2e"} and info["task"] == "t" and info["project"] == "root"

            # the edge's own admission (max 2 sandboxes) refuses the third: a 429, nothing leaks
            assert (await c.post("/v1/sandboxes", json={"spec": SPEC})).status_code == 201
            r = await c.post("/v1/sandboxes", json={"spec": SPEC})
            assert r.status_code == 429 and r.headers["retry-after"], r.text
            listed = (await c.get("/v1/sandboxes")).json()
            assert len(listed) == 2

            # a sandbox the edge destroys by itself is reconciled by the watcher
            await asyncio.to_thread(lambda: edge.call(edge.service.destroy(listed[1]["id"], reason="test")))
            assert await ctl.control.watcher.tick(reconcile=True)
            gone = (await c.get(f"/v1/sandboxes/{listed[1]['id']}")).json()
            assert gone["state"] == "stopped"

            # delete through the control plane reaches the edge
            assert (await c.delete(f"/v1/sandboxes/{sb['id']}")).status_code == 204
            live = await asyncio.to_thread(lambda: [s.id for s in edge.service.list()])
            assert live == []
            root = (await c.get("/v1/projects/root")).json()
            assert root["used"]["sandboxes"] == 0
    finally:
        await asyncio.to_thread(edge.stop)
        await ctl.stop()
    assert not leftovers(cfg), leftovers(cfg)


async def test_pause_fork_snapshot_and_stages_through_the_control_plane_on_a_real_edge(
    edge_state: tuple[Path, str], dsec_base: Path, tmp_path: Path
) -> None:
    from dsec.control import ControlConfig, serve_control
    from dsec.edge.config import EdgeConfig
    from dsec.edge.testing import EdgeThread, leftovers

    state, name = edge_state
    ctl = await serve_control(ControlConfig(
        data_dir=tmp_path / "control", cluster_key=KEY, port=0, watcher=False, auth_cache_s=0.0,
    ))
    cfg = EdgeConfig(
        edge_id="ry", cluster_key=KEY, port=0, state_dir=state, run_dir=dsec_base / "run", runtime_name=name,
        destroy_on_shutdown=True, watchdog_interval_s=0.2, max_sandboxes=4, control_plane_url=ctl.url,
        heartbeat_interval_s=0.2,
    )
    edge = await asyncio.to_thread(lambda: EdgeThread(cfg).start())
    try:
        async with httpx.AsyncClient(base_url=ctl.url, timeout=120,
                                     headers={"authorization": f"Bearer {ctl.admin_token}"}) as c:
            for _ in range(100):
                edges = (await c.get("/v1/edges")).json()
                if edges and edges[0]["health"]:
                    break
                await asyncio.sleep(0.05)
            stages = {"work": {}, "locked": {"files": {"read_only": ["/tmp"]}}}
            r = await c.post("/v1/tasks", json={"name": "rt", "stages": stages, "stage": "work"})
            assert r.status_code == 201, r.text
            r = await c.post("/v1/sandboxes", json={"spec": SPEC, "task": "rt"})
            assert r.status_code == 201, r.text
            sb = r.json()
            async with httpx.AsyncClient(base_url=sb["edge_url"], timeout=60,
                                         headers={"authorization": f"Bearer {sb['token']}"}) as data:
                async def run(sid: str, cmd: str) -> dict[str, Any]:
                    r = await data.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": ["sh", "-c", cmd]})
                    assert r.status_code == 200, r.text
                    return dict(r.json())

                assert (await run(sb["id"], "echo one > /tmp/a && cat /tmp/a"))["exit_code"] == 0

                # the task's stage switch reaches the real edge: /tmp is read-only now
                r = await c.post("/v1/tasks/rt/stage", json={"stage": "locked"})
                assert r.status_code == 200 and r.json()["done"] == [sb["id"]], r.text
                assert (await run(sb["id"], "echo two > /tmp/b"))["exit_code"] != 0
                r = await c.post("/v1/tasks/rt/stage", json={"stage": "work"})
                assert r.json()["done"] == [sb["id"]]

                r = await c.post("/v1/pause", params={"task": "rt"})
                assert r.json()["done"] == [sb["id"]], r.text
                assert (await c.get(f"/v1/sandboxes/{sb['id']}")).json()["state"] == "paused"
                r = await c.post("/v1/resume", params={"task": "rt"})
                assert r.json()["done"] == [sb["id"]], r.text

                r = await c.post(f"/v1/sandboxes/{sb['id']}/fork", json={"n": 2})
                assert r.status_code == 201, r.text
                kids = r.json()
                assert all(k["task"] == "rt" and k["token"] for k in kids)
                listed = {x["id"] for x in (await c.get("/v1/sandboxes", params={"task": "rt"})).json()}
                assert listed == {sb["id"], *(k["id"] for k in kids)}
                async with httpx.AsyncClient(base_url=kids[0]["edge_url"], timeout=60,
                                             headers={"authorization": f"Bearer {kids[0]['token']}"}) as kd:
                    r = await kd.post(f"/v1/sandboxes/{kids[0]['id']}/exec", json={"cmd": ["cat", "/tmp/a"]})
                    assert base64.b64decode(r.json()["stdout_b64"]) == b"one\n"

                r = await c.post(f"/v1/sandboxes/{sb['id']}/snapshot", json={"name": "rsnap"})
                assert r.status_code == 201, r.text
                snap = r.json()
                st = (await c.get("/v1/projects/root/storage")).json()
                assert st["used"] == snap["size"] > 0
                r = await c.post("/v1/sandboxes", json={"spec": {**SPEC, "image": {"base": "rsnap:latest"}}})
                assert r.status_code == 201, r.text
                user = r.json()
                r = await c.delete("/v1/snapshots/rsnap:latest")
                assert r.status_code == 409 and r.json()["error"]["code"] == "conflict"
                assert (await c.delete(f"/v1/sandboxes/{user['id']}")).status_code == 204
            assert (await c.delete("/v1/sandboxes", params={"task": "rt"})).json()["deleted"] == 3
            for _ in range(100):  # the edge releases the layer once no sandbox uses it
                r = await c.delete("/v1/snapshots/rsnap:latest")
                if r.status_code == 204:
                    break
                assert r.status_code == 409, r.text
                await asyncio.sleep(0.5)
            assert r.status_code == 204, r.text
            assert (await c.get("/v1/projects/root/storage")).json()["used"] == 0
            assert (await c.get("/v1/projects/root")).json()["used"]["sandboxes"] == 0
    finally:
        await asyncio.to_thread(edge.stop)
        await ctl.stop()
    assert not leftovers(cfg), leftovers(cfg)


async def test_a_sandbox_too_big_for_any_edge_is_refused_for_good_and_a_full_edge_says_wait(
    edge_state: tuple[Path, str], dsec_base: Path, tmp_path: Path
) -> None:
    """Issue 28: more than any edge holds even empty is a typed 422 naming what was asked and the
    largest edge's capacity, never a 429, and the SDK does not retry it; a request that only
    waits for room is still a 429 with Retry-After. Deletes say what is true."""
    import time

    import dsec
    from dsec.control import ControlConfig, serve_control
    from dsec.edge.config import EdgeConfig
    from dsec.edge.testing import EdgeThread, leftovers
    from dsec.errors import Backpressure, ExceedsCapacity, SandboxNotFound

    state, name = edge_state
    ctl = await serve_control(ControlConfig(
        data_dir=tmp_path / "control", cluster_key=KEY, port=0, watcher=False, auth_cache_s=0.0,
    ))
    cfg = EdgeConfig(
        edge_id="rz", cluster_key=KEY, port=0, state_dir=state, run_dir=dsec_base / "run", runtime_name=name,
        destroy_on_shutdown=True, watchdog_interval_s=0.2, max_sandboxes=4, cpu_capacity=2.0,
        memory_capacity=1 << 30, control_plane_url=ctl.url, heartbeat_interval_s=0.2,
    )
    edge = await asyncio.to_thread(lambda: EdgeThread(cfg).start())

    def spec(cpu: float) -> Any:
        return dsec.SandboxSpec.model_validate({**SPEC, "resources": {**SPEC["resources"], "cpu": cpu}})

    try:
        async with dsec.AsyncClient(ctl.url, ctl.admin_token) as c:
            for _ in range(100):
                if [e for e in await c.edges() if e.get("health")]:
                    break
                await asyncio.sleep(0.05)
            with pytest.raises(ExceedsCapacity) as too_big:
                await c.create(spec(99))
            e = too_big.value
            assert e.fields["status"] == 422 and not isinstance(e, Backpressure)
            assert (e.fields["asked"]["cpu"], e.fields["capacity"]["cpu"], e.fields["edge_id"]) == (99, 2, "rz")
            assert e.fields["reasons"] == ["cpu"] and e.fields["field"] == "resources.cpu"
            assert str(e).startswith("the sandbox asks for cpu 99, more than any edge can ever hold: the largest, rz,")
            # a burst hears it at once, per item, through the lease path, instead of retrying for max_wait_s
            t0 = time.monotonic()
            outs = [o async for o in c.create_many(spec(99), 3, max_wait_s=60)]
            assert time.monotonic() - t0 < 20
            assert sorted(o.index for o in outs) == [0, 1, 2]
            assert all(isinstance(o.error, ExceedsCapacity) for o in outs), [o.error for o in outs]
            # the same size once the edge is full is a wait: 429 with Retry-After, as before
            async with await c.create(spec(2)) as full:
                with pytest.raises(Backpressure) as wait:
                    await c.create(spec(0.5))
                assert not isinstance(wait.value, ExceedsCapacity)
                assert "no edge can take this sandbox now" in str(wait.value) and wait.value.fields["status"] == 429
                sid = full.id
        async with httpx.AsyncClient(base_url=ctl.url, timeout=60,
                                     headers={"authorization": f"Bearer {ctl.admin_token}"}) as h:
            r = await h.delete(f"/v1/sandboxes/{sid}")  # ended by the `async with` above
            assert r.status_code == 204 and r.headers["dsec-ended"] == "stopped (deleted)", r.headers
            for _ in range(50):  # the edge's next heartbeat reports the room the delete gave back
                r = await h.post("/v1/sandboxes", json={"spec": SPEC})
                if r.status_code != 429:
                    break
                await asyncio.sleep(0.1)
            assert r.status_code == 201, r.text
            r = await h.delete(f"/v1/sandboxes/{r.json()['id']}")
            assert r.status_code == 204 and "dsec-ended" not in r.headers  # this call stopped it
            r = await h.delete("/v1/sandboxes/rz-000000000000")
            assert r.status_code == 404 and r.json()["error"]["code"] == "sandbox_not_found"
        async with dsec.AsyncClient(ctl.url, ctl.admin_token) as c:
            with pytest.raises(SandboxNotFound):
                await c.info("rz-000000000000")
            assert [s for s in await c.list()] == []
    finally:
        await asyncio.to_thread(edge.stop)
        await ctl.stop()
    assert not leftovers(cfg), leftovers(cfg)
