"""The backend layer as the edge and the control plane see it: capabilities advertised,
placement by ``SandboxSpec.backend``, ``Unsupported`` for what a backend or an edge lacks
(a 400, never a 500), the typed edge part of records, and the single fork.

Real edges (uvicorn on 127.0.0.1, the real container backend) and a real all-in-one."""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from conftest import edge_config, in_process_cluster, running_edge
from dsec.backends.base import Backend, BackendBase, Capabilities, Capability, EdgeMeta, check_spec
from dsec.errors import Unsupported
from dsec.spec import ImageRef, SandboxSpec, Stage

pytestmark = pytest.mark.root

KEY = secrets.token_bytes(32)
RES: dict[str, Any] = {"cpu": 0.5, "memory": 128 << 20, "disk": 32 << 20}
SPEC: dict[str, Any] = {"image": {"base": "busybox:test"}, "resources": RES}


@pytest.fixture(scope="module")
def edge(dsec_base: Path) -> Iterator[Any]:
    cfg = edge_config(dsec_base, "ebk", "bk", KEY, watchdog_interval_s=0.2)
    with running_edge(cfg) as e:
        yield e


def err(r: httpx.Response) -> dict[str, Any]:
    body: dict[str, Any] = r.json()["error"]
    return body


def test_the_container_runtime_satisfies_the_protocol(edge: Any) -> None:
    rt = edge.service.backends.get("container")
    assert isinstance(rt, Backend)
    assert rt.capabilities.kind == "container"
    assert {Capability.EXEC, Capability.FORK, Capability.PAUSE, Capability.NETWORK} <= rt.capabilities.ops


def test_health_advertises_the_backends_and_their_operations(edge: Any) -> None:
    h = httpx.get(f"{edge.url}/v1/health", headers=edge.admin_headers()).json()
    assert set(h["backends"]) == {"container"}
    assert {"exec", "sessions", "files", "fork", "snapshot", "pause", "pty"} <= set(h["backends"]["container"])
    assert "fncall" not in h["backends"]["container"]


def test_a_backend_the_edge_does_not_run_is_a_400_naming_what_it_runs(edge: Any) -> None:
    spec = {**SPEC, "backend": "gvisor"}
    with httpx.Client(base_url=edge.url, headers=edge.admin_headers(), timeout=30) as c:
        r = c.post("/v1/sandboxes", json={"spec": spec})
        assert r.status_code == 400, r.text
        e = err(r)
        assert e["code"] == "unsupported" and e["backend"] == "gvisor" and "container" in e["message"]
        assert not edge.service.backends.get("container").sandboxes  # nothing half-made
        r = c.post("/v1/sandboxes", json={"spec": {**SPEC, "backend": "Not A Name"}})
        assert r.status_code == 422 and err(r)["code"] == "invalid_spec", r.text


def test_records_keep_a_typed_edge_part_and_old_records_are_read(edge: Any) -> None:
    with httpx.Client(base_url=edge.url, headers=edge.admin_headers(), timeout=30) as c:
        r = c.post("/v1/sandboxes", json={"spec": SPEC, "labels": {"k": "v"}, "task": "t1",
                                          "lifecycle": {"ttl_s": 120, "idle_timeout_s": 60}})
        assert r.status_code == 201, r.text
        sid = r.json()["id"]
        try:
            rec = edge.service.backends.get("container").get(sid)
            assert isinstance(rec.edge, EdgeMeta)
            assert rec.edge.labels == {"k": "v"} and rec.edge.task == "t1" and rec.edge.idle_timeout_s == 60
            assert rec.edge.expires_at is not None and rec.edge.expires_at - rec.edge.created_at == 120
            saved = json.loads((Path(edge.config.state_dir) / "sandboxes" / edge.config.runtime / f"{sid}.json")
                               .read_text())
            assert saved["backend"] == "container" and saved["edge"]["task"] == "t1" and "meta" not in saved
            assert r.json()["backend"] == "container"
        finally:
            assert c.delete(f"/v1/sandboxes/{sid}").status_code == 204


def test_fork_children_start_in_the_parents_current_stage(edge: Any) -> None:
    """The one fork (the backend's): children get the stage in force now, not the one the
    parent was created in (the edge's old copy of fork got this wrong)."""
    spec = {**SPEC, "stages": {"setup": {}, "rollout": {"files": {"read_only": ["/etc"]}}}, "stage": "setup"}
    with httpx.Client(base_url=edge.url, headers=edge.admin_headers(), timeout=60) as c:
        r = c.post("/v1/sandboxes", json={"spec": spec, "labels": {"job": "f"}})
        assert r.status_code == 201, r.text
        sid = r.json()["id"]
        kids: list[str] = []
        try:
            assert c.post(f"/v1/sandboxes/{sid}/stage", json={"stage": "rollout"}).status_code == 200
            r = c.post(f"/v1/sandboxes/{sid}/fork", json={"n": 2})
            assert r.status_code == 201, r.text
            kids = [k["id"] for k in r.json()]
            for k in r.json():
                assert k["stage"] == "rollout" and k["labels"] == {"job": "f"} and k["token"]
                run = c.post(f"/v1/sandboxes/{k['id']}/exec", json={"cmd": "touch /etc/x"}).json()
                assert run["exit_code"] != 0  # the stage's read-only /etc binds the child too
            events = c.get(f"/v1/sandboxes/{kids[0]}/events").json()
            kinds = [ev["event"] for ev in events]
            assert "forked" in kinds and "created" in kinds
        finally:
            for k in kids:
                c.delete(f"/v1/sandboxes/{k}")
            c.delete(f"/v1/sandboxes/{sid}")


class _ExecOnly(BackendBase):
    """A stand-in with only EXEC declared: what BackendBase refuses for it."""

    kind = "execonly"

    def __init__(self) -> None:
        self.name = "x"
        self.capabilities = Capabilities(kind="execonly", ops=frozenset({Capability.SANDBOXES, Capability.EXEC}))


def test_backend_base_refuses_what_is_not_declared() -> None:
    import asyncio

    b = _ExecOnly()
    for coro in (b.fork("s", 1), b.pause("s"), b.snapshot_info("s"), b.set_stage("s", "x"),
                 b.open_session("s"), b.start_tty("s", ["sh"], size=__import__("dsec").backends.base.TtySize())):
        with pytest.raises(Unsupported) as ei:
            asyncio.run(coro)
        assert ei.value.backend == "execonly" and ei.value.http_status == 400
    with pytest.raises(Unsupported):
        b.files("s")
    spec = SandboxSpec(image=ImageRef(base="b"), stages={"a": Stage()})
    with pytest.raises(Unsupported) as ei:
        check_spec(b.capabilities, spec)
    assert ei.value.operation == "stages"


def test_control_plane_places_by_backend_and_refuses_an_unknown_one() -> None:
    from dsec import InvalidSpec

    async def go(h: Any) -> None:
        async with h.client() as c:
            with pytest.raises(Unsupported) as ei:
                await c.create(SandboxSpec(image=ImageRef(base="busybox"), backend="gvisor"))
            assert ei.value.backend == "gvisor" and "container" in str(ei.value)
            sb = await c.create(SandboxSpec(image=ImageRef(base="busybox")))
            try:
                assert sb.info.backend == "container"
                assert (await sb.exec("echo ok")).stdout == b"ok\n"
            finally:
                await sb.close()
            with pytest.raises((InvalidSpec, ValueError)):
                SandboxSpec(image=ImageRef(base="busybox"), backend="../x")
            with pytest.raises(Unsupported) as ei:  # no edge of this cluster runs function calls
                await c.fncall("busybox", "1")
            assert ei.value.backend == "fncall" and "container" in str(ei.value)

    with in_process_cluster("dsec-test-backends-") as h:
        h.run(go(h))


def test_legacy_container_settings_move_into_the_backend_list(dsec_base: Path) -> None:
    from dsec.edge.config import ContainerConfig, EdgeConfig

    c = EdgeConfig(edge_id="e1", cluster_key=KEY, zram_size=1 << 20, reclaim_method="pageout")
    assert c.backends == [ContainerConfig(zram_size=1 << 20, reclaim_method="pageout")]
    assert c.network is None and c.container is not None
    again = EdgeConfig.model_validate_json(c.model_dump_json())
    assert again.backends == c.backends
    with pytest.raises(ValueError, match="both at the top level"):
        EdgeConfig(edge_id="e1", cluster_key=KEY, zram_size=1, backends=[{"kind": "container", "zram_size": 2}])
    with pytest.raises(ValueError, match="listed twice"):
        EdgeConfig(edge_id="e1", cluster_key=KEY, backends=[{"kind": "container"}, {"kind": "container"}])
    with pytest.raises(ValueError):
        EdgeConfig(edge_id="e1", cluster_key=KEY, backends=[{"kind": "nosuch"}])
