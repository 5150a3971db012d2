"""SDK unit tests against an in-memory fake of the HTTP API (httpx.MockTransport).

The fake is only for the SDK's own logic (error table, retries, token refresh,
sync derivation); end-to-end behaviour is proven against real services in
tests/e2e.
"""

from __future__ import annotations

import asyncio
import base64
import inspect
import json
import time
from typing import Any

import httpx
import pytest

import dsec
from dsec import AsyncClient, Client
from dsec.errors import AuthError, Backpressure, ExecTimeout, QuotaExceeded, SandboxNotFound
from dsec.sdk.client import AsyncFiles, AsyncSandbox, AsyncSession
from dsec.sdk.leases import AsyncLease
from dsec.sdk.sync import Files, Lease, Sandbox, Session
from dsec.spec import ImageRef, SandboxSpec

SPEC = SandboxSpec(image=ImageRef(base="busybox:latest"))


class FakeCluster:
    """Control plane + one edge, enough to exercise the SDK's control flow."""

    def __init__(self) -> None:
        self.sandboxes: dict[str, dict[str, Any]] = {}
        self.refuse_next = 0
        self.fail_every: int | None = None
        self.creates = 0
        self.token_version = 0
        self.seen_request_ids: dict[str, str] = {}

    def info(self, sid: str) -> dict[str, Any]:
        return {"id": sid, "state": "running", "edge_id": "e1", "edge_url": "http://edge.test",
                "token": f"tok-{sid}-{self.token_version}", "created_at": time.time()}

    def handler(self, req: httpx.Request) -> httpx.Response:
        path = req.url.path
        if req.url.host == "cp.test":
            if req.headers.get("authorization") != "Bearer dsk_good":
                return httpx.Response(401, json={"error": {"code": "auth_error", "message": "bad token"}})
            if req.method == "POST" and path == "/v1/sandboxes":
                body = json.loads(req.content)
                rid = body.get("request_id")
                if rid in self.seen_request_ids:
                    return httpx.Response(201, json=self.info(self.seen_request_ids[rid]))
                if self.refuse_next > 0:
                    self.refuse_next -= 1
                    return httpx.Response(429, headers={"retry-after": "0.01"},
                                          json={"error": {"code": "backpressure", "message": "busy", "retry_after": 0.01}})
                self.creates += 1
                if self.fail_every and self.creates % self.fail_every == 0:
                    return httpx.Response(403, json={"error": {"code": "quota_exceeded", "message": "over quota", "limit": 3}})
                sid = f"e1-{self.creates:012x}"
                self.sandboxes[sid] = {}
                if rid:
                    self.seen_request_ids[rid] = sid
                return httpx.Response(201, json=self.info(sid))
            if req.method == "GET" and path.startswith("/v1/sandboxes/"):
                sid = path.rsplit("/", 1)[1]
                if sid not in self.sandboxes:
                    return httpx.Response(404, json={"error": {"code": "sandbox_not_found", "message": "gone", "sandbox_id": sid}})
                return httpx.Response(200, json=self.info(sid))
            if req.method == "DELETE" and path.startswith("/v1/sandboxes/"):
                sid = path.rsplit("/", 1)[1]
                if self.sandboxes.pop(sid, None) is None:
                    return httpx.Response(404, json={"error": {"code": "sandbox_not_found", "message": "gone"}})
                return httpx.Response(204)
        if req.url.host == "edge.test":
            sid = path.split("/")[3]
            want = f"Bearer tok-{sid}-{self.token_version}"
            if req.headers.get("authorization") != want:
                return httpx.Response(401, json={"error": {"code": "auth_error", "message": "token expired"}})
            if path.endswith("/exec"):
                body = json.loads(req.content)
                timed_out = "timeout" if body["cmd"] == "sleep 100" else None
                out = base64.b64encode(f"ran {body['cmd']}".encode()).decode()
                return httpx.Response(200, json={"exit_code": None if timed_out else 0, "signal": 9 if timed_out else None,
                                                 "stdout_b64": out, "stderr_b64": "", "stdout_bytes": 3,
                                                 "stderr_bytes": 0, "truncated": False, "duration_s": 0.01,
                                                 "timed_out": timed_out})
            if path.endswith("/files"):
                return httpx.Response(200, content=b"file-bytes")
        return httpx.Response(404, json={"error": {"code": "dsec_error", "message": f"no route {path}"}})


def make_client(cluster: FakeCluster, token: str = "dsk_good") -> AsyncClient:
    return AsyncClient("http://cp.test", token, transport=httpx.MockTransport(cluster.handler))


def test_public_api_is_explicit() -> None:
    assert dsec.__all__ == sorted(dsec.__all__)
    assert {"AsyncClient", "Client", "Sandbox", "SandboxSpec", "ExecResult", "Backpressure"} <= set(dsec.__all__)
    for name in dsec.__all__:
        assert hasattr(dsec, name), name


@pytest.mark.parametrize(("sync_cls", "async_cls"), [(Client, AsyncClient), (Sandbox, AsyncSandbox),
                                                       (Session, AsyncSession), (Files, AsyncFiles),
                                                       (Lease, AsyncLease)])
def test_sync_mirrors_async(sync_cls: type, async_cls: type) -> None:
    for name, fn in inspect.getmembers(async_cls, predicate=inspect.isfunction):
        if name.startswith("_") or not (inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn)):
            continue
        assert hasattr(sync_cls, name), f"{sync_cls.__name__} lacks {name}"
        assert inspect.signature(getattr(sync_cls, name)) == inspect.signature(fn), name


def test_no_token_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DSEC_TOKEN", raising=False)
    with pytest.raises(AuthError, match="DSEC_TOKEN"):
        AsyncClient("http://cp.test")


def test_errors_come_back_typed() -> None:
    cluster = FakeCluster()

    async def go() -> None:
        async with make_client(cluster, token="dsk_bad") as c:
            with pytest.raises(AuthError):
                await c.create(SPEC)
        async with make_client(cluster) as c:
            with pytest.raises(SandboxNotFound) as ei:
                await c.connect("e1-000000000999")
            assert ei.value.sandbox_id == "e1-000000000999"
            cluster.fail_every = 1
            with pytest.raises(QuotaExceeded) as qe:
                await c.create(SPEC)
            assert qe.value.limit == 3
            assert isinstance(qe.value, dsec.DsecError)

    asyncio.run(go())


def test_create_many_honours_backpressure_and_reports_failures() -> None:
    cluster = FakeCluster()
    cluster.refuse_next = 5
    cluster.fail_every = 4

    async def go() -> list[Any]:
        async with make_client(cluster) as c:
            return [o async for o in c.create_many(SPEC, 12, concurrency=4)]

    outcomes = asyncio.run(go())
    assert sorted(o.index for o in outcomes) == list(range(12))
    failed = [o for o in outcomes if not o.ok]
    assert failed and all(isinstance(o.error, QuotaExceeded) for o in failed)
    assert len([o for o in outcomes if o.ok]) == 12 - len(failed)
    assert cluster.refuse_next == 0  # every refusal was retried


def test_create_many_gives_up_on_persistent_backpressure() -> None:
    cluster = FakeCluster()
    cluster.refuse_next = 10**6

    async def go() -> list[Any]:
        async with make_client(cluster) as c:
            return [o async for o in c.create_many(SPEC, 3, max_wait_s=0.2)]

    outcomes = asyncio.run(go())
    assert len(outcomes) == 3 and all(isinstance(o.error, Backpressure) for o in outcomes)


def test_create_many_reports_an_unexpected_failure_and_finishes() -> None:
    """An item whose create fails with something unexpected (here an answer that is no
    SandboxInfo) is that item's error: the burst goes on and ends (it used to wait forever)."""
    cluster = FakeCluster()

    def handler(req: httpx.Request) -> httpx.Response:
        if req.method == "POST" and req.url.path == "/v1/sandboxes" and json.loads(req.content)["request_id"].endswith("-1"):
            return httpx.Response(201, json={"not": "a sandbox"})
        return cluster.handler(req)

    async def go() -> list[Any]:
        async with AsyncClient("http://cp.test", "dsk_good", transport=httpx.MockTransport(handler)) as c:
            return [o async for o in c.create_many(SPEC, 4, concurrency=2, lease=False)]

    outcomes = asyncio.run(asyncio.wait_for(go(), 60))
    assert sorted(o.index for o in outcomes) == [0, 1, 2, 3]
    failed = [o for o in outcomes if not o.ok]
    assert [o.index for o in failed] == [1] and "validation error" in str(failed[0].error)


def test_exec_refreshes_an_expired_token_and_raises_timeouts() -> None:
    cluster = FakeCluster()

    async def go() -> None:
        async with make_client(cluster) as c:
            sb = await c.create(SPEC)
            cluster.token_version += 1  # the edge no longer accepts the old token
            res = await sb.exec("echo hi")
            assert res.stdout == b"ran echo hi" and res.exit_code == 0
            with pytest.raises(ExecTimeout) as ei:
                await sb.exec("sleep 100", timeout=1)
            assert ei.value.result.signal == 9
            await sb.close()
            await sb.close()  # idempotent
            assert sb.id not in cluster.sandboxes

    asyncio.run(go())


def test_sync_client_drives_the_same_api() -> None:
    cluster = FakeCluster()
    with Client("http://cp.test", "dsk_good", transport=httpx.MockTransport(cluster.handler)) as c:
        with c.create(SPEC) as sb:
            assert isinstance(sb, Sandbox)
            assert sb.exec(["true"]).stdout == b"ran ['true']"
            assert sb.files.read("/etc/hostname") == b"file-bytes"
        assert not cluster.sandboxes
        outcomes = list(c.create_many(SPEC, 3))
        assert all(isinstance(o.sandbox, Sandbox) for o in outcomes)
