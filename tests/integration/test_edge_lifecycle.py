"""Lifecycle on a real edge: TTL and idle expiry by the watchdog, re-adoption after an
edge restart (TTL metadata intact, pool members kept), and the heartbeat to a
control plane (a stand-in app here)."""

from __future__ import annotations

import asyncio
import re
import secrets
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from conftest import edge_config, wait_until
from dsec.edge.config import EdgeConfig, PoolConfig
from dsec.edge.testing import EdgeThread, leftovers
from dsec.http.auth import verify
from dsec.spec import ImageRef, Resources
from dsec.spec.api import EdgeHealth

pytestmark = pytest.mark.root

MiB = 1 << 20
KEY = secrets.token_bytes(32)
RES = {"cpu": 0.25, "memory": 64 * MiB, "disk": 16 * MiB}
SPEC = {"image": {"base": "busybox:test"}, "resources": RES}


def _config(dsec_base: Path, suffix: str, edge_id: str, **kw: Any) -> EdgeConfig:
    return edge_config(dsec_base, suffix, edge_id, KEY, watchdog_interval_s=0.1, **kw)


@pytest.fixture(scope="module")
def edge(dsec_base: Path) -> Iterator[EdgeThread]:
    cfg = _config(dsec_base, "elife", "lf")
    with EdgeThread(cfg) as e:
        yield e
    assert not leftovers(cfg), leftovers(cfg)


def create(api: httpx.Client, **extra: Any) -> dict[str, Any]:
    r = api.post("/v1/sandboxes", json={"spec": SPEC, **extra})
    assert r.status_code == 201, r.text
    return dict(r.json())


def kinds(api: httpx.Client, sid: str) -> list[str]:
    return [e["event"] for e in api.get(f"/v1/sandboxes/{sid}/events").json()]


def test_ttl_expiry(edge: EdgeThread) -> None:
    rt = edge.service.backends.get("container")
    with edge.client() as api:
        info = create(api, lifecycle={"ttl_s": 1.0})
        sid = info["id"]
        assert info["expires_at"] == pytest.approx(info["created_at"] + 1.0)
        assert sid in rt.sandboxes
        assert wait_until(lambda: sid not in rt.sandboxes, timeout=5)
        assert time.time() >= info["expires_at"]
        gone = api.get(f"/v1/sandboxes/{sid}").json()
        assert (gone["state"], gone["reason"]) == ("stopped", "ttl_expired")
        events = api.get(f"/v1/sandboxes/{sid}/events").json()
        expired = next(e for e in events if e["event"] == "ttl_expired")
        assert expired["ttl_s"] == 1.0
        assert events[-1] == {**events[-1], "event": "destroyed", "reason": "ttl_expired"}
        r = api.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "true"})
        assert r.status_code == 404 and r.json()["error"]["reason"] == "ttl_expired"
        assert "ttl_expired" in r.json()["error"]["message"]
        assert 'dsec_edge_expirations_total{reason="ttl"} 1.0' in api.get("/metrics").text
        assert not leftovers(edge.config)


def test_idle_timeout_counts_exec_files_and_running_commands(edge: EdgeThread) -> None:
    rt = edge.service.backends.get("container")
    with edge.client() as api:
        sid = create(api, lifecycle={"ttl_s": 60, "idle_timeout_s": 0.8})["id"]
        try:
            # activity of every kind keeps it: exec, file calls, a session
            steps = [
                lambda: api.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "true"}),
                lambda: api.put(f"/v1/sandboxes/{sid}/files", params={"path": "/f"}, content=b"x"),
                lambda: api.get(f"/v1/sandboxes/{sid}/files/stat", params={"path": "/f"}),
                lambda: api.post(f"/v1/sandboxes/{sid}/sessions"),
            ]
            for step in steps:
                time.sleep(0.5)
                assert step().status_code in (200, 204)
            # a command running longer than the idle timeout is activity too
            r = api.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "sleep 1.5; echo done"})
            assert r.status_code == 200 and r.json()["exit_code"] == 0
            assert sid in rt.sandboxes
            t0 = time.monotonic()
            assert wait_until(lambda: sid not in rt.sandboxes, timeout=5)
            assert 0.5 <= time.monotonic() - t0 <= 2.5
            assert "idle_expired" in kinds(api, sid)
            assert api.get(f"/v1/sandboxes/{sid}").json()["reason"] == "idle_expired"
        finally:
            api.delete(f"/v1/sandboxes/{sid}")


def test_restart_readopts_with_ttl_and_pool(dsec_base: Path) -> None:
    cfg = _config(dsec_base, "erst", "rs", destroy_on_shutdown=False, pool_refill_per_s=50,
                  pools=[PoolConfig(image=ImageRef(base="busybox:test"), resources=Resources(**RES), size=1)])
    first = EdgeThread(cfg).start()
    second: EdgeThread | None = None
    try:
        with first.client() as api:
            keep = create(api, lifecycle={"ttl_s": 300, "idle_timeout_s": 120}, labels={"run": "7"}, task="job")
            short = create(api, lifecycle={"ttl_s": 2.0})
            api.put(f"/v1/sandboxes/{keep['id']}/files", params={"path": "/state.txt"}, content=b"survives")
        pool = first.service.pools.pools[0]
        assert wait_until(lambda: len(pool.ready) == 1, timeout=10)
        pooled = pool.ready[0]
        init_pid = first.service.backends.get("container").sandboxes[keep["id"]].init_pid
        first.stop()  # no destroy: sandboxes outlive the edge

        assert init_pid in first.service.backends.get("container").cgroups.pids(keep["id"])
        second = EdgeThread(cfg).start()
        svc = second.service
        assert set(svc.backends.get("container").reconciled["adopted"]) == {keep["id"], short["id"], pooled}
        with second.client() as api:
            again = api.get(f"/v1/sandboxes/{keep['id']}").json()
            for k in ("expires_at", "created_at", "labels", "task"):
                assert again[k] == keep[k], k
            r = api.post(f"/v1/sandboxes/{keep['id']}/exec", json={"cmd": "cat /state.txt"})
            assert r.json()["stdout_b64"] == "c3Vydml2ZXM="  # "survives"
            assert "adopted" in kinds(api, keep["id"])
            assert list(svc.pools.pools[0].ready) == [pooled]  # re-adopted, not re-made
            assert {x["id"] for x in api.get("/v1/sandboxes").json()} == {keep["id"], short["id"]}
            health = api.get("/v1/health").json()
            assert health["sandboxes"] == 2 and health["pools"] == {svc.pools.pools[0].name: 1}
            # the TTL set before the restart is enforced by the new edge
            assert wait_until(lambda: short["id"] not in svc.backends.get("container").sandboxes, timeout=5)
            assert api.get(f"/v1/sandboxes/{short['id']}").json()["reason"] == "ttl_expired"
            assert keep["id"] in svc.backends.get("container").sandboxes
    finally:
        if second is not None:
            second.stop(destroy_all=True)
        else:
            # the first edge kept its sandboxes: a throwaway edge on the same dirs removes them
            EdgeThread(cfg).start().stop(destroy_all=True)
    assert not leftovers(cfg), leftovers(cfg)


class _FakeControlPlane:
    """Answers register/heartbeat like the control plane; forgets the edge once (404)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, EdgeHealth, str]] = []
        self.forgot = False
        app = FastAPI()

        @app.post("/v1/edges/register")
        async def register(request: Request) -> JSONResponse:
            return self._record("register", request, await request.body())

        @app.post("/v1/edges/{edge_id}/heartbeat")
        async def heartbeat(edge_id: str, request: Request) -> JSONResponse:
            if not self.forgot:
                self.forgot = True
                return JSONResponse({"error": {"code": "not_found", "message": "unknown edge"}}, status_code=404)
            return self._record("heartbeat", request, await request.body())

        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_config=None, lifespan="off"))
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=lambda: self.loop.run_until_complete(self.server.serve()), daemon=True)

    def _record(self, kind: str, request: Request, body: bytes) -> JSONResponse:
        token = request.headers["authorization"].removeprefix("Bearer ")
        claims = verify(KEY, token)
        self.calls.append((kind, EdgeHealth.model_validate_json(body), claims.scope))
        return JSONResponse({})

    def __enter__(self) -> str:
        self.thread.start()
        assert wait_until(lambda: self.server.started, timeout=10)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def test_heartbeat_registers_and_reports(dsec_base: Path) -> None:
    fake = _FakeControlPlane()
    with fake as cp_url:
        cfg = _config(dsec_base, "ehb", "hb", control_plane_url=cp_url, heartbeat_interval_s=0.1,
                      labels={"zone": "a"})
        with EdgeThread(cfg) as e:
            assert wait_until(lambda: [c[0] for c in fake.calls][:3] == ["register", "register", "heartbeat"],
                              timeout=10), fake.calls
        _kind, health, scope = fake.calls[0]
        assert scope == "edge-admin"
        assert (health.edge_id, health.url, health.labels) == ("hb", e.url, {"zone": "a"})
        assert health.cpu_capacity > 0 and re.match(r"^http://127\.0\.0\.1:\d+$", health.url)
    assert not leftovers(cfg)
