"""Machinery for the control-plane tests: a stub edge, a throwaway PostgreSQL, the cluster harness.

- :class:`StubEdge` is a real HTTP server (FastAPI + uvicorn on loopback)
  speaking the edge agent's admin API (create, delete, list, health) with
  configurable capacity, layers, labels, refusals and delays. It is a test
  double for the control plane's logic only: the lead's end-to-end tests run
  against real edges.
- ``pg_cluster`` initdb's a PostgreSQL cluster in a temp dir as the
  ``postgres`` user, listening on a unix socket there, and removes it at the
  end of the session; skips with the reason when it cannot.
- ``db_url`` is parametrized over SQLite and PostgreSQL (a fresh database per
  test), so every test that takes it runs on both stores.
- :func:`cluster` starts a control plane (``serve_control``) plus stub edges
  that register themselves, and yields a :class:`Cluster` with an admin client.

Other test modules import the fixtures from here (pytest finds fixtures in a
module's namespace).
"""

from __future__ import annotations

import asyncio
import contextlib
import glob
import os
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

from conftest import serve_asgi
from dsec.http import auth
from dsec.spec.api import EdgeHealth, SandboxInfo

MiB = 1024 * 1024
GiB = 1024 * MiB
BASE_LAYER = "busybox:test"
SPEC: dict[str, Any] = {"image": {"base": BASE_LAYER}, "resources": {"cpu": 1, "memory": 256 * MiB, "disk": 64 * MiB}}


# --------------------------------------------------------------- stub edge ----


@dataclass
class StubEdge:
    """A fake edge agent with a real HTTP API (the admin half of docs/API.md "Edge agent")."""

    edge_id: str
    key: bytes
    capacity_sandboxes: int = 100
    cpu_capacity: float = 64.0
    memory_capacity: int = 64 * GiB
    disk_capacity: int = 64 * GiB
    layers: list[str] = field(default_factory=lambda: [BASE_LAYER])
    labels: dict[str, str] = field(default_factory=dict)
    refuse: int = 0
    """Refuse this many creates (429 backpressure) before admitting again."""
    refuse_all: bool = False
    create_delay_s: float = 0.0
    fail_health: bool = False
    sandboxes: dict[str, dict[str, Any]] = field(default_factory=dict)
    by_request: dict[str, str] = field(default_factory=dict)
    creates: int = 0
    refusals: int = 0
    deletes: int = 0
    forks: int = 0
    snapshots: dict[str, dict[str, Any]] = field(default_factory=dict)
    """digest -> SnapshotInfo as JSON (the snapshot layers this edge holds)."""
    snapshot_size: int = 4 * MiB
    """Bytes of every snapshot image this edge makes."""
    snapshot_delay_s: float = 0.0
    """How long each snapshot takes (the edge answers after it)."""
    stage_calls: list[tuple[str, str]] = field(default_factory=list)
    fail_stage: set[str] = field(default_factory=set)
    url: str = ""
    epoch: int = 0
    """The stub's fencing epoch: sandboxes record the one they were made in; POST /v1/fence drops older ones."""
    fences: list[int] = field(default_factory=list)
    _served: contextlib.AsyncExitStack | None = None

    # -- what the edge holds --

    def committed(self) -> tuple[int, float, int, int]:
        live = [s for s in self.sandboxes.values() if s["info"]["state"] != "stopped"]
        return (
            len(live),
            sum(s["cpu"] for s in live),
            sum(s["memory"] for s in live),
            sum(s["disk"] for s in live),
        )

    def health(self) -> EdgeHealth:
        n, cpu, mem, disk = self.committed()
        return EdgeHealth(
            edge_id=self.edge_id, url=self.url, sandboxes=n, capacity_sandboxes=self.capacity_sandboxes,
            cpu_committed=cpu, cpu_capacity=self.cpu_capacity, memory_committed=mem,
            memory_capacity=self.memory_capacity, disk_committed=disk, disk_capacity=self.disk_capacity,
            layers=list(self.layers), labels=dict(self.labels), epoch=self.epoch,
        )

    def _make(self, body: dict[str, Any]) -> dict[str, Any]:
        r = body["spec"].get("resources", {})
        sid = f"{self.edge_id}-{secrets.token_hex(6)}"
        now = time.time()
        ttl = float((body.get("lifecycle") or {}).get("ttl_s", 3600.0))
        info = SandboxInfo(
            id=sid, state="running", edge_id=self.edge_id, edge_url=self.url, labels=body.get("labels", {}),
            task=body.get("task"), project=body.get("project"), created_at=now, expires_at=now + ttl,
            image=body["spec"]["image"], request_id=body.get("request_id"), epoch=self.epoch,
        ).model_dump(mode="json")
        self.sandboxes[sid] = {"cpu": float(r.get("cpu", 1.0)), "memory": int(r.get("memory", 1024 * MiB)),
                               "disk": int(r.get("disk", 1024 * MiB)), "info": info, "spec": body["spec"]}
        return info

    def live_ids(self) -> set[str]:
        return {k for k, v in self.sandboxes.items() if v["info"]["state"] != "stopped"}

    def drop(self, sandbox_id: str) -> None:
        """The sandbox ends on the edge by itself (TTL, idle timeout, crash)."""
        self.sandboxes.pop(sandbox_id, None)

    def adopt_orphan(self, *, project: str = "root", age_s: float = 3600.0) -> str:
        """A sandbox the control plane never heard of (a create whose answer was lost)."""
        sid = f"{self.edge_id}-{secrets.token_hex(6)}"
        now = time.time()
        self.sandboxes[sid] = {
            "cpu": 1.0, "memory": 64 * MiB, "disk": 1 * MiB,
            "info": {"id": sid, "state": "running", "edge_id": self.edge_id, "edge_url": self.url,
                     "labels": {}, "project": project, "created_at": now - age_s, "expires_at": now + 3600},
        }
        return sid

    # -- the HTTP API --

    def _check(self, request: Request) -> JSONResponse | None:
        h = request.headers.get("authorization", "")
        try:
            claims = auth.verify(self.key, h.removeprefix("Bearer "))
        except Exception as exc:
            return JSONResponse({"error": {"code": "auth_error", "message": str(exc)}}, status_code=401)
        if claims.scope != "edge-admin":
            return JSONResponse({"error": {"code": "forbidden", "message": "edge-admin only"}}, status_code=403)
        return None

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/v1/health")
        async def health(request: Request) -> Response:
            if (bad := self._check(request)) is not None:
                return bad
            if self.fail_health:
                return JSONResponse({"error": {"code": "host_error", "message": "sick"}}, status_code=503)
            return JSONResponse(self.health().model_dump(mode="json"))

        @app.post("/v1/sandboxes")
        async def create(request: Request) -> Response:
            if (bad := self._check(request)) is not None:
                return bad
            body = await request.json()
            self.creates += 1
            rid = body.get("request_id")
            if rid and rid in self.by_request and self.by_request[rid] in self.sandboxes:
                return JSONResponse(self.sandboxes[self.by_request[rid]]["info"], status_code=201)
            if self.create_delay_s:
                await asyncio.sleep(self.create_delay_s)
            r = body["spec"].get("resources", {})
            cpu, mem, disk = float(r.get("cpu", 1.0)), int(r.get("memory", 1024 * MiB)), int(r.get("disk", 1024 * MiB))
            n, ccpu, cmem, cdisk = self.committed()
            reason = None
            if self.refuse_all or self.refuse > 0:
                self.refuse = max(0, self.refuse - 1)
                reason = "count"
            elif n + 1 > self.capacity_sandboxes:
                reason = "count"
            elif ccpu + cpu > self.cpu_capacity:
                reason = "cpu"
            elif cmem + mem > self.memory_capacity:
                reason = "memory"
            elif cdisk + disk > self.disk_capacity:
                reason = "disk"
            if reason is not None:
                self.refusals += 1
                return JSONResponse(
                    {"error": {"code": "backpressure", "message": f"edge full ({reason})", "reason": reason, "retry_after": 1.0}},
                    status_code=429, headers={"Retry-After": "1"},
                )
            base = body["spec"]["image"]["base"]
            if self.layers and base not in self.layers and f"{base}:latest" not in self.layers:
                return JSONResponse(
                    {"error": {"code": "layer_not_found", "message": f"no layer {base}", "ref": base}}, status_code=404
                )
            info = self._make(body)
            sid = info["id"]
            if rid:
                self.by_request[rid] = sid
            return JSONResponse(info, status_code=201)

        @app.post("/v1/fence")
        async def fence(request: Request) -> Response:
            if (bad := self._check(request)) is not None:
                return bad
            epoch = int((await request.json())["epoch"])
            self.fences.append(epoch)
            self.epoch = max(self.epoch, epoch)
            doomed = [k for k, v in self.sandboxes.items()
                      if v["info"].get("project") is not None and (v["info"].get("epoch") or 0) < self.epoch]
            for k in doomed:
                self.sandboxes.pop(k)
            return JSONResponse({"epoch": self.epoch, "destroyed": doomed})

        @app.get("/v1/sandboxes")
        async def listing(request: Request) -> Response:
            if (bad := self._check(request)) is not None:
                return bad
            return JSONResponse([s["info"] for s in self.sandboxes.values()])

        @app.get("/v1/sandboxes/{sid}")
        async def get(request: Request, sid: str) -> Response:
            if (bad := self._check(request)) is not None:
                return bad
            if sid not in self.sandboxes:
                return JSONResponse({"error": {"code": "sandbox_not_found", "message": sid}}, status_code=404)
            return JSONResponse(self.sandboxes[sid]["info"])

        @app.delete("/v1/sandboxes/{sid}")
        async def delete(request: Request, sid: str) -> Response:
            if (bad := self._check(request)) is not None:
                return bad
            self.deletes += 1
            self.sandboxes.pop(sid, None)
            return Response(status_code=204)

        def _state_error(sid: str, state: str) -> JSONResponse:
            return JSONResponse({"error": {"code": "sandbox_state", "message": f"{sid} is {state}",
                                           "sandbox_id": sid, "state": state}}, status_code=409)

        def _missing(sid: str) -> JSONResponse:
            return JSONResponse({"error": {"code": "sandbox_not_found", "message": sid, "sandbox_id": sid}},
                                status_code=404)

        @app.post("/v1/sandboxes/{sid}/pause")
        async def pause(request: Request, sid: str) -> Response:
            if (bad := self._check(request)) is not None:
                return bad
            if sid not in self.sandboxes:
                return _missing(sid)
            info = self.sandboxes[sid]["info"]
            if info["state"] != "running":
                return _state_error(sid, info["state"])
            info["state"] = "paused"
            return JSONResponse({"id": sid, "state": "paused", "freeze_s": 0.001, "seconds": 0.002})

        @app.post("/v1/sandboxes/{sid}/resume")
        async def resume(request: Request, sid: str) -> Response:
            if (bad := self._check(request)) is not None:
                return bad
            if sid not in self.sandboxes:
                return _missing(sid)
            info = self.sandboxes[sid]["info"]
            if info["state"] != "paused":
                return _state_error(sid, info["state"])
            info["state"] = "running"
            return JSONResponse(info)

        @app.post("/v1/{op}")
        async def group(request: Request, op: str) -> Response:
            if (bad := self._check(request)) is not None:
                return bad
            if op not in ("pause", "resume"):
                return _missing(op)
            ids = request.query_params.getlist("id")
            want, need = ("paused", "running") if op == "pause" else ("running", "paused")
            out: dict[str, Any] = {"done": [], "skipped": [], "errors": {}, "seconds": 0.001}
            for sid in ids:
                if sid not in self.sandboxes:
                    out["errors"][sid] = {"code": "sandbox_not_found", "message": sid}
                    continue
                info = self.sandboxes[sid]["info"]
                if info["state"] == want:
                    out["skipped"].append(sid)
                elif info["state"] == need:
                    info["state"] = want
                    out["done"].append(sid)
                else:
                    out["errors"][sid] = {"code": "sandbox_state", "message": info["state"]}
            return JSONResponse(out)

        @app.post("/v1/sandboxes/{sid}/snapshot")
        async def snapshot(request: Request, sid: str) -> Response:
            if (bad := self._check(request)) is not None:
                return bad
            if sid not in self.sandboxes:
                return _missing(sid)
            body = await request.json() if await request.body() else {}
            if self.snapshot_delay_s:
                await asyncio.sleep(self.snapshot_delay_s)
            name = body.get("name") or f"snap-{sid}"
            tag = body.get("tag") or "latest"
            digest = "sha256:" + secrets.token_hex(32)
            base = self.sandboxes[sid]["spec"]["image"]["base"]
            info = {"digest": digest, "name": name, "tag": tag, "ref": f"{name}:{tag}", "kind": "snapshot",
                    "size": self.snapshot_size, "created_at": time.time(), "parents": [base], "sandbox_id": sid}
            self.snapshots[digest] = info
            self.layers.append(f"{name}:{tag}")
            return JSONResponse(info, status_code=201)

        @app.get("/v1/snapshots")
        async def snapshots(request: Request) -> Response:
            if (bad := self._check(request)) is not None:
                return bad
            return JSONResponse(list(self.snapshots.values()))

        @app.delete("/v1/snapshots/{ref:path}")
        async def delete_snapshot(request: Request, ref: str) -> Response:
            if (bad := self._check(request)) is not None:
                return bad
            snap = self.snapshots.get(ref) or next((x for x in self.snapshots.values() if x["ref"] == ref), None)
            if snap is None:
                return JSONResponse({"error": {"code": "layer_not_found", "message": ref}}, status_code=404)
            users = [k for k, v in self.sandboxes.items() if v["spec"]["image"]["base"] in (snap["ref"], snap["digest"])]
            if users:
                return JSONResponse({"error": {"code": "layer_in_use", "message": "in use", "holders": users}},
                                    status_code=409)
            del self.snapshots[snap["digest"]]
            if snap["ref"] in self.layers:
                self.layers.remove(snap["ref"])
            return Response(status_code=204)

        @app.post("/v1/sandboxes/{sid}/fork")
        async def fork(request: Request, sid: str) -> Response:
            if (bad := self._check(request)) is not None:
                return bad
            if sid not in self.sandboxes:
                return _missing(sid)
            parent = self.sandboxes[sid]
            if parent["info"]["state"] not in ("running", "paused"):
                return _state_error(sid, parent["info"]["state"])
            body = await request.json()
            n = int(body["n"])
            if self.committed()[0] + n > self.capacity_sandboxes:
                self.refusals += 1
                return JSONResponse({"error": {"code": "backpressure", "message": "edge full (count)",
                                               "reason": "count", "retry_after": 1.0}},
                                    status_code=429, headers={"Retry-After": "1"})
            self.forks += 1
            digest = "sha256:" + secrets.token_hex(32)
            spec = {**parent["spec"], "image": {"base": digest}}
            pinfo = parent["info"]
            kids = [self._make({"spec": spec, "labels": body.get("labels") or pinfo["labels"], "task": pinfo["task"],
                                "project": pinfo["project"], "lifecycle": body.get("lifecycle") or {}})
                    for _ in range(n)]
            return JSONResponse(kids, status_code=201)

        @app.post("/v1/sandboxes/{sid}/stage")
        async def stage(request: Request, sid: str) -> Response:
            if (bad := self._check(request)) is not None:
                return bad
            if sid not in self.sandboxes:
                return _missing(sid)
            name = (await request.json())["stage"]
            if name not in (self.sandboxes[sid]["spec"].get("stages") or {}) or sid in self.fail_stage:
                return JSONResponse({"error": {"code": "invalid_spec", "message": f"no stage {name}",
                                               "field": "stage"}}, status_code=422)
            self.stage_calls.append((sid, name))
            self.sandboxes[sid]["spec"]["stage"] = name
            return JSONResponse(self.sandboxes[sid]["info"])

        return app

    async def start(self) -> StubEdge:
        self._served = contextlib.AsyncExitStack()
        self.url = await self._served.enter_async_context(serve_asgi(self.app()))
        return self

    async def stop(self) -> None:
        if self._served is not None:
            await self._served.aclose()
            self._served = None

    async def register(self, control_url: str) -> None:
        tok, _ = auth.mint(self.key, sandbox_id="*", project="*", scope="edge-admin")
        async with httpx.AsyncClient() as c:
            r = await c.post(f"{control_url}/v1/edges/register", content=self.health().model_dump_json(),
                             headers={"authorization": f"Bearer {tok}", "content-type": "application/json"})
            assert r.status_code == 200, r.text

    async def heartbeat(self, control_url: str) -> None:
        tok, _ = auth.mint(self.key, sandbox_id="*", project="*", scope="edge-admin")
        async with httpx.AsyncClient() as c:
            r = await c.post(f"{control_url}/v1/edges/{self.edge_id}/heartbeat", content=self.health().model_dump_json(),
                             headers={"authorization": f"Bearer {tok}", "content-type": "application/json"})
            assert r.status_code == 200, r.text


# -------------------------------------------------------------- postgresql ----


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _pg_bin() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if found:
        return Path(found[-1]).parent
    which = shutil.which("initdb")
    return Path(which).parent if which else None


@dataclass
class PgCluster:
    base: Path
    port: int

    def url(self, db: str) -> str:
        return f"postgresql+psycopg://postgres@/{db}?host={self.base}&port={self.port}"

    def psql(self, sql: str) -> None:
        import psycopg

        with psycopg.connect(host=str(self.base), port=self.port, user="postgres", dbname="postgres", autocommit=True) as c:
            c.execute(sql)  # type: ignore[arg-type]


@pytest.fixture(scope="session")
def pg_cluster() -> Iterator[PgCluster]:
    bindir = _pg_bin()
    if bindir is None:
        pytest.skip("PostgreSQL binaries not installed (scripts/setup.sh installs the `postgresql` package)")
    if os.geteuid() != 0 or shutil.which("runuser") is None:
        pytest.skip("the PostgreSQL fixture runs initdb as the postgres user: needs root and runuser")
    try:
        import pwd

        pw = pwd.getpwnam("postgres")
    except KeyError:
        pytest.skip("no postgres system user (install the `postgresql` package)")
    base = Path(tempfile.mkdtemp(prefix="dsec-pg-"))
    os.chown(base, pw.pw_uid, pw.pw_gid)
    port = _free_port()
    run = ["runuser", "-u", "postgres", "--"]
    started = False
    try:
        subprocess.run([*run, str(bindir / "initdb"), "-D", str(base / "data"), "--auth=trust", "-U", "postgres",
                        "-E", "UTF8", "--no-sync"], check=True, capture_output=True)
        opts = (f"-k {base} -p {port} -c listen_addresses='' -c fsync=off -c synchronous_commit=off "
                f"-c full_page_writes=off -c max_connections=200")
        subprocess.run([*run, str(bindir / "pg_ctl"), "-D", str(base / "data"), "-o", opts, "-l",
                        str(base / "log"), "-w", "-t", "30", "start"], check=True, capture_output=True)
        started = True
        yield PgCluster(base=base, port=port)
    except subprocess.CalledProcessError as exc:
        log = (base / "log").read_text() if (base / "log").exists() else ""
        pytest.fail(f"cannot start PostgreSQL: {exc.stderr.decode(errors='replace')} {log}")
    finally:
        if started:
            subprocess.run([*run, str(bindir / "pg_ctl"), "-D", str(base / "data"), "-m", "immediate", "-w", "stop"],
                           capture_output=True)
        shutil.rmtree(base, ignore_errors=True)


def database_url(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh, empty store of this kind for one test."""
    if kind == "sqlite":
        yield f"sqlite:///{tmp_path / 'control.db'}"
        return
    pg: PgCluster = request.getfixturevalue("pg_cluster")
    name = f"dsec_{secrets.token_hex(4)}"
    pg.psql(f"CREATE DATABASE {name}")
    try:
        yield pg.url(name)
    finally:
        pg.psql(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    yield from database_url(request.param, request, tmp_path)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


# ----------------------------------------------------------------- cluster ----


@dataclass
class Cluster:
    url: str
    admin_token: str
    key: bytes
    handle: Any
    edges: list[StubEdge]
    clients: list[httpx.AsyncClient] = field(default_factory=list)

    @property
    def control(self) -> Any:
        return self.handle.control

    def client(self, token: str | None = None) -> httpx.AsyncClient:
        c = httpx.AsyncClient(base_url=self.url, timeout=30.0,
                              headers={"authorization": f"Bearer {token or self.admin_token}"})
        self.clients.append(c)
        return c

    async def tick(self, *, reconcile: bool = True) -> None:
        assert await self.control.watcher.tick(reconcile=reconcile)

    async def project(self, name: str, *, sandboxes: int = 10, cpu: float = 10, memory: int = 10 * GiB,
                      parent: str | None = None, token: str | None = None) -> str:
        """Make a project; returns a fresh token of it."""
        c = self.client(token)
        r = await c.post("/v1/projects", json={"name": name, "parent": parent,
                                               "quota": {"sandboxes": sandboxes, "cpu": cpu, "memory": memory}})
        assert r.status_code == 201, r.text
        r = await c.post("/v1/tokens", json={"project": name})
        assert r.status_code == 201, r.text
        return str(r.json()["token"])


@contextlib.asynccontextmanager
async def cluster(db_url: str, tmp_path: Path, *, edges: list[dict[str, Any]] | None = None,
                  **config: Any) -> AsyncIterator[Cluster]:
    from dsec.control import ControlConfig, serve_control

    key = secrets.token_bytes(32)
    stubs = [StubEdge(edge_id=spec.pop("edge_id", f"e{i + 1}"), key=key, **spec)
             for i, spec in enumerate(dict(e) for e in (edges if edges is not None else [{}]))]
    for s in stubs:
        await s.start()
    cfg = ControlConfig.model_validate({
        "data_dir": tmp_path / "control", "database_url": db_url, "cluster_key": key.hex(), "port": 0,
        "watcher": False, "auth_cache_s": 0.0, "edge_timeout_s": 5.0, **config,
    })
    handle = await serve_control(cfg)
    try:
        token = handle.admin_token or (tmp_path / "control" / "admin.token").read_text().strip()
        for s in stubs:
            await s.register(handle.url)
        cl = Cluster(url=handle.url, admin_token=token, key=key, handle=handle, edges=stubs)
        try:
            yield cl
        finally:
            for c in cl.clients:
                await c.aclose()
    finally:
        await handle.stop()
        for s in stubs:
            await s.stop()


# A module of helpers: a trivial test so a run of this file alone says something.
@pytest.mark.anyio
async def test_stub_edge_speaks_the_edge_admin_api() -> None:
    key = secrets.token_bytes(32)
    edge = await StubEdge("e9", key, capacity_sandboxes=1).start()
    try:
        tok, _ = auth.mint(key, sandbox_id="*", project="*", scope="edge-admin")
        async with httpx.AsyncClient(base_url=edge.url, headers={"authorization": f"Bearer {tok}"}) as c:
            assert (await c.get("/v1/health")).json()["edge_id"] == "e9"
            r = await c.post("/v1/sandboxes", json={"spec": SPEC, "project": "p"})
            assert r.status_code == 201 and r.json()["id"].startswith("e9-")
            r2 = await c.post("/v1/sandboxes", json={"spec": SPEC})
            assert r2.status_code == 429 and r2.json()["error"]["reason"] == "count"
            assert (await c.delete(f"/v1/sandboxes/{r.json()['id']}")).status_code == 204
            bad = await httpx.AsyncClient(base_url=edge.url).get("/v1/health")
            assert bad.status_code == 401
    finally:
        await edge.stop()
