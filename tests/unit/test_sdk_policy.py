"""SDK unit tests of network policies, stages, pristine exec and the event log, against an
in-memory fake of the HTTP API (httpx.MockTransport), like tests/unit/test_sdk.py.

The fake only checks what the SDK sends and how it reads the answers; the behaviour
behind these calls is proven against a real edge in tests/integration/test_edge_policy.py.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from typing import Any

import httpx
import pytest

from dsec import AsyncClient, Client
from dsec.errors import InvalidSpec, SandboxStateError
from dsec.spec import FileRules, ImageRef, NetRule, NetworkPolicy, SandboxSpec, Stage

SPEC = SandboxSpec(
    image=ImageRef(base="busybox:latest"),
    network=NetworkPolicy(allow=("pypi",)),
    stages={"setup": Stage(network=NetworkPolicy(allow=("pypi",))),
            "evaluate": Stage(files=FileRules(read_only=("/workspace",)))},
    stage="setup",
)


class FakeEdge:
    """Control plane + one edge; remembers every request to the edge."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str, Any]] = []
        self.created: list[dict[str, Any]] = []
        self.stage: str | None = "setup"
        self.policy: dict[str, Any] | None = {"allow": ["pypi"], "rules": []}

    def info(self, sid: str, *, token: bool = True) -> dict[str, Any]:
        return {"id": sid, "state": "running", "edge_id": "e1", "edge_url": "http://edge.test",
                "token": "tok-1" if token else None, "created_at": time.time(), "stage": self.stage,
                "network": self.policy, "stages": ["evaluate", "setup"]}

    def handler(self, req: httpx.Request) -> httpx.Response:
        path = req.url.path
        body = json.loads(req.content) if req.content else None
        if req.url.host == "cp.test":
            if req.method == "POST" and path == "/v1/sandboxes":
                self.created.append(body)
                return httpx.Response(201, json=self.info("e1-000000000001"))
            if req.method == "DELETE":
                return httpx.Response(204)
            return httpx.Response(200, json=self.info("e1-000000000001"))
        assert req.headers["authorization"] == "Bearer tok-1"
        self.requests.append((req.method, path, body))
        tail = path.split("/", 4)[4] if path.count("/") >= 4 else ""
        if tail == "policy" and req.method == "PUT":
            if body is not None and "nosuch" in body.get("allow", []):
                return httpx.Response(422, json={"error": {"code": "invalid_spec", "field": "allow",
                                                           "message": "unknown permission 'nosuch'"}})
            self.policy = body
            return httpx.Response(200, json=self.info("e1-000000000001", token=False))
        if tail == "stage" and req.method == "POST":
            if body["stage"] not in ("setup", "evaluate"):
                return httpx.Response(422, json={"error": {"code": "invalid_spec", "field": "stage",
                                                           "message": "no such stage", "stage": body["stage"]}})
            if body["stage"] == self.stage:
                return httpx.Response(409, json={"error": {"code": "sandbox_state", "message": "stopped"}})
            self.stage = body["stage"]
            return httpx.Response(200, json=self.info("e1-000000000001", token=False))
        if tail == "network":
            return httpx.Response(200, json={"sandbox_id": "e1-000000000001", "ip": "10.213.0.7",
                                             "policy": self.policy, "stage": self.stage, "denied": 3,
                                             "recent_denied": ["192.0.2.1:80/tcp"], "detail": {"ifname": "eth0"}})
        if tail == "events":
            return httpx.Response(200, json=[{"t": 1.0, "event": "net_denied", "origin": "runtime", "count": 3}])
        if tail == "exec":
            out = base64.b64encode(json.dumps(body["pristine"]).encode()).decode()
            return httpx.Response(200, json={"exit_code": 0, "stdout_b64": out, "stderr_b64": "", "stdout_bytes": 1,
                                             "stderr_bytes": 0, "truncated": False, "duration_s": 0.0})
        return httpx.Response(404, json={"error": {"code": "dsec_error", "message": f"no route {path}"}})


def make_client(edge: FakeEdge) -> AsyncClient:
    return AsyncClient("http://cp.test", "dsk_good", transport=httpx.MockTransport(edge.handler))


def test_create_carries_network_and_stages() -> None:
    edge = FakeEdge()

    async def go() -> None:
        async with make_client(edge) as c:
            sb = await c.create(SPEC)
            assert sb.info.stage == "setup" and sb.info.network == NetworkPolicy(allow=("pypi",))
            assert sb.info.stages == ["evaluate", "setup"]

    asyncio.run(go())
    spec = edge.created[0]["spec"]
    assert spec["network"]["allow"] == ["pypi"] and spec["stage"] == "setup"
    assert spec["stages"]["evaluate"]["files"]["read_only"] == ["/workspace"]
    assert SandboxSpec.model_validate(spec) == SPEC


def test_set_policy_sends_the_policy_and_keeps_the_token() -> None:
    edge = FakeEdge()

    async def go() -> None:
        async with make_client(edge) as c:
            sb = await c.create(SPEC)
            pol = NetworkPolicy(allow=("debian",), rules=(NetRule(cidr="10.0.0.0/8", ports=("443",)),))
            info = await sb.set_policy(pol)
            assert info.network == pol and sb.info.network == pol
            assert sb.info.token == "tok-1"  # the edge sends no token to a sandbox token: ours is kept
            await sb.set_policy({"allow": ["pypi"]})  # a mapping is validated into a NetworkPolicy
            await sb.set_policy(None)
            assert sb.info.network is None
            with pytest.raises(InvalidSpec) as ei:  # refused by the edge: typed, with its field
                await sb.set_policy(NetworkPolicy(allow=("nosuch",)))
            assert ei.value.field == "allow"
            n = len(edge.requests)
            with pytest.raises(InvalidSpec):  # refused before any request
                await sb.set_policy({"allow": ["Not A Name"]})
            with pytest.raises(InvalidSpec):
                await sb.set_policy({"rules": [{"cidr": "not-an-ip"}]})
            assert len(edge.requests) == n

    asyncio.run(go())
    bodies = [b for m, p, b in edge.requests if p.endswith("/policy")]
    assert bodies[0] == {"allow": ["debian"], "rules": [{"cidr": "10.0.0.0/8", "ports": ["443"], "protocol": "tcp"}]}
    assert bodies[1] == {"allow": ["pypi"], "rules": []}
    assert bodies[2] is None  # JSON null: loopback only


def test_set_stage_network_events_and_pristine() -> None:
    edge = FakeEdge()

    async def go() -> None:
        async with make_client(edge) as c:
            sb = await c.create(SPEC)
            assert (await sb.set_stage("evaluate")).stage == "evaluate" and sb.info.stage == "evaluate"
            with pytest.raises(InvalidSpec) as ei:
                await sb.set_stage("nosuch")
            assert ei.value.stage == "nosuch"
            with pytest.raises(SandboxStateError):
                await sb.set_stage("evaluate")
            with pytest.raises(InvalidSpec):
                await sb.set_stage("Bad Name")  # never sent
            net = await sb.network()
            assert (net.ip, net.denied, net.recent_denied) == ("10.213.0.7", 3, ["192.0.2.1:80/tcp"])
            assert net.detail == {"ifname": "eth0"}
            assert (await sb.events())[0]["event"] == "net_denied"
            res = await sb.exec("python -m pytest /tests", pristine=["/tests", "/usr/bin"])
            assert json.loads(res.stdout) == ["/tests", "/usr/bin"]
            with pytest.raises(InvalidSpec, match="list of paths"):
                await sb.exec("true", pristine="/tests")  # type: ignore[arg-type]
            with pytest.raises(InvalidSpec, match="pristine"):
                await sb.exec("true", pristine=["tests"])

    asyncio.run(go())
    stages = [b["stage"] for m, p, b in edge.requests if p.endswith("/stage")]
    assert stages == ["evaluate", "nosuch", "evaluate"]


def test_sync_client_has_the_same_calls() -> None:
    edge = FakeEdge()
    with Client("http://cp.test", "dsk_good", transport=httpx.MockTransport(edge.handler)) as c:
        sb = c.create(SPEC)
        assert sb.set_policy(None).network is None
        assert sb.set_stage("evaluate").stage == "evaluate"
        assert sb.network().denied == 3
        assert sb.events()[0]["count"] == 3
        assert json.loads(sb.exec("true", pristine=["/tests"]).stdout) == ["/tests"]
