"""A stand-in edge for control-plane throughput benches: it answers at once and makes nothing.

`dsec bench cluster` measures what the control plane can place, account and answer per
second. A real edge makes a sandbox in ~2 ms of its own CPU (docs/PERFORMANCE.md), so on a
2-core machine a handful of real edges would saturate the host long before the control
plane; this stand-in speaks the edge-admin API the control plane uses (create, get, list,
delete, health; the lease routes of docs/CONTROL.md "Create leases") over real HTTP on
loopback, checks the bearer tokens with the cluster key as an edge does, keeps its
sandboxes in a dict, registers with the control plane and heartbeats like an edge.

It is **not** an edge: no runtime, no admission beyond a count, no data path. Every figure
it takes part in says so (``edge_kind = "in-process stand-in"``). Never used outside
benches. The HTTP side is a bare asyncio protocol on httptools (the parser uvicorn uses),
so the stand-in costs the bench little CPU per request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
from collections.abc import Callable
from typing import Any

import httptools

from dsec.edge.leases import LeaseBook, LeaseReporter
from dsec.errors import DsecError, encode_error
from dsec.http import auth
from dsec.spec import SandboxState
from dsec.spec.api import (
    BatchItem,
    BatchResult,
    EdgeCreateSandbox,
    LeaseCreate,
    LeaseReleased,
    SandboxInfo,
)

_REASONS = {200: b"OK", 201: b"Created", 204: b"No Content", 400: b"Bad Request", 401: b"Unauthorized",
            403: b"Forbidden", 404: b"Not Found", 409: b"Conflict", 422: b"Unprocessable Entity",
            429: b"Too Many Requests", 500: b"Internal Server Error"}
_BIG = 1 << 50



ROUTES: frozenset[tuple[str, str]] = frozenset({
    ("POST", "/v1/sandboxes"), ("GET", "/v1/sandboxes"), ("GET", "/v1/sandboxes/{}"), ("DELETE", "/v1/sandboxes/{}"),
    ("GET", "/v1/health"), ("POST", "/v1/leases/{}/sandboxes"), ("DELETE", "/v1/leases/{}"),
})
"""The edge routes the stand-in answers (:meth:`StandInEdge.handle`), each one the real edge's
too (tests/integration/test_standin_contract.py)."""

class StandInEdge:
    """One stand-in edge. ``await start()`` listens on loopback; ``register(control_url)``
    starts its heartbeat."""

    def __init__(self, edge_id: str, key: bytes, *, layers: list[str], heartbeat_s: float = 0.5) -> None:
        self.edge_id = edge_id
        self.key = key
        self.layers = layers
        self.heartbeat_s = heartbeat_s
        self.url = ""
        self.sandboxes: dict[str, dict[str, Any]] = {}
        self.by_request: dict[str, str] = {}
        self.requests = 0
        self.leases = LeaseBook(edge_id, key, make=self._make_leased, report=None)
        self.reports: LeaseReporter | None = None
        self._claims: dict[str, auth.Claims] = {}
        self._server: asyncio.AbstractServer | None = None
        self._beat: asyncio.Task[None] | None = None

    # ------------------------------------------------------------- state --

    def _info(self, sid: str, body: dict[str, Any], project: str | None) -> dict[str, Any]:
        now = time.time()
        life = body.get("lifecycle") or {}
        ttl = float(life.get("ttl_s", 3600.0))
        return {"id": sid, "state": "running", "edge_id": self.edge_id, "edge_url": self.url, "token": None,
                "labels": {**(body.get("spec") or {}).get("labels", {}), **body.get("labels", {})},
                "task": body.get("task"), "project": project, "created_at": now, "expires_at": now + ttl}

    def _create(self, body: dict[str, Any]) -> dict[str, Any]:
        rid = body.get("request_id")
        if rid is not None and rid in self.by_request and self.by_request[rid] in self.sandboxes:
            return self.sandboxes[self.by_request[rid]]
        sid = f"{self.edge_id}-{secrets.token_hex(6)}"
        info = self._info(sid, body, body.get("project"))
        self.sandboxes[sid] = info
        if rid is not None:
            self.by_request[rid] = sid
        return info

    async def _make_leased(self, req: EdgeCreateSandbox) -> SandboxInfo:
        rid = req.request_id or ""
        known = self.by_request.get(rid)
        if known is not None and known in self.sandboxes:
            info = self.sandboxes[known]
        else:
            sid = f"{self.edge_id}-{secrets.token_hex(6)}"
            now = time.time()
            info = {"id": sid, "state": "running", "edge_id": self.edge_id, "edge_url": self.url, "token": None,
                    "labels": dict(req.labels), "task": req.task, "project": req.project, "created_at": now,
                    "expires_at": now + req.lifecycle.ttl_s, "request_id": rid}
            self.sandboxes[sid] = info
            self.by_request[rid] = sid
        tok, exp = auth.mint(self.key, sandbox_id=info["id"], project=req.project or "", ttl_s=3600.0)
        return SandboxInfo(**{**info, "state": SandboxState.RUNNING, "token": tok, "token_expires_at": exp})

    def health(self) -> dict[str, Any]:
        return {"edge_id": self.edge_id, "url": self.url, "sandboxes": len(self.sandboxes),
                "capacity_sandboxes": 10_000_000, "cpu_committed": 0.0, "cpu_capacity": float(_BIG),
                "memory_committed": 0, "memory_capacity": _BIG, "disk_committed": 0, "disk_capacity": _BIG,
                "layers": self.layers, "runtime": f"standin-{self.edge_id}",
                "backends": {"container": ["exec", "files"]}, "boot_id": self.leases.boot_id}

    # -------------------------------------------------------------- HTTP --

    def _claims_of(self, headers: dict[bytes, bytes]) -> auth.Claims | None:
        raw = headers.get(b"authorization", b"").decode("latin-1")
        scheme, _, tok = raw.partition(" ")
        if scheme.lower() != "bearer" or not tok:
            raise DsecError("missing bearer token")
        hit = self._claims.get(tok)
        if hit is not None and hit.expires_at >= time.time():
            return hit
        if tok.startswith(auth.PREFIX + ".") and '"scp":"lease"' in auth._unb64(tok.split(".")[1]).decode(errors="replace"):
            return None  # a lease token: the lease book checks it
        claims = auth.verify(self.key, tok)
        if len(self._claims) > 10_000:
            self._claims.clear()
        self._claims[tok] = claims
        return claims

    async def handle(self, method: str, path: str, headers: dict[bytes, bytes], body: bytes) -> tuple[int, bytes]:
        self.requests += 1
        try:
            claims = self._claims_of(headers)
            parts = path.split("?", 1)[0].strip("/").split("/")
            if parts[:2] == ["v1", "leases"] and len(parts) == 4 and parts[3] == "sandboxes" and method == "POST":
                tok = headers.get(b"authorization", b"").decode("latin-1").partition(" ")[2].strip()
                req = LeaseCreate.model_validate_json(body)
                made = await self.leases.create(parts[2], tok, req.body, req.count, req.request_id)
                items = [BatchItem(error=m.to_wire()) if isinstance(m, DsecError) else BatchItem(sandbox=m) for m in made]
                return 200, BatchResult(items=items).model_dump_json().encode()
            if parts[:2] == ["v1", "leases"] and len(parts) == 3 and method == "DELETE":
                _admin(claims)
                done = await self.leases.revoke(parts[2])
                return 200, LeaseReleased(made=len(done), sandboxes=done).model_dump_json().encode()
            if parts[:2] == ["v1", "sandboxes"]:
                if len(parts) == 2 and method == "POST":
                    _admin(claims)
                    return 201, json.dumps(self._create(json.loads(body))).encode()
                if len(parts) == 2 and method == "GET":
                    _admin(claims)
                    return 200, json.dumps(list(self.sandboxes.values())).encode()
                if len(parts) == 3 and method == "GET":
                    info = self.sandboxes.get(parts[2])
                    return (200, json.dumps(info).encode()) if info else (404, _not_found(parts[2]))
                if len(parts) == 3 and method == "DELETE":
                    self.sandboxes.pop(parts[2], None)
                    return 204, b""
            if parts == ["v1", "health"]:
                return 200, json.dumps(self.health()).encode()
            return 404, b'{"error":{"code":"not_found","message":"no such route on a stand-in edge"}}'
        except DsecError as exc:
            status, wire, _ = encode_error(exc)
            return status, json.dumps(wire).encode()

    async def start(self, host: str = "127.0.0.1") -> StandInEdge:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Protocol(self.handle), host, 0)
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://{host}:{port}"
        return self

    async def register(self, control_url: str, report_urls: list[str] | None = None) -> None:
        """Register now, then heartbeat every ``heartbeat_s`` (health reports, as an edge does);
        sandboxes made under leases are reported to ``report_urls`` (default: ``control_url``)."""
        import httpx

        self.reports = LeaseReporter(report_urls or [control_url], edge_id=self.edge_id, cluster_key=self.key)
        self.leases.report = self.reports.add
        self.reports.start()

        tok, _ = auth.mint(self.key, sandbox_id=f"edge:{self.edge_id}", project="", ttl_s=86400.0, scope="edge-admin")
        hdr = {"authorization": f"Bearer {tok}"}
        async with httpx.AsyncClient(timeout=10.0) as h:
            r = await h.post(f"{control_url}/v1/edges/register", json=self.health(), headers=hdr)
            r.raise_for_status()

        async def beat() -> None:
            async with httpx.AsyncClient(timeout=10.0) as h:
                while True:
                    await asyncio.sleep(self.heartbeat_s)
                    with contextlib.suppress(httpx.HTTPError):
                        await h.post(f"{control_url}/v1/edges/{self.edge_id}/heartbeat", json=self.health(),
                                     headers=hdr)

        self._beat = asyncio.create_task(beat())

    async def stop(self) -> None:
        if self.reports is not None:
            await self.reports.stop()
        if self._beat is not None:
            self._beat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._beat
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


def _admin(claims: auth.Claims | None) -> None:
    if claims is None or claims.scope != "edge-admin":
        from dsec.errors import Forbidden

        raise Forbidden("this call needs an edge-admin token")


def _not_found(sid: str) -> bytes:
    return json.dumps({"error": {"code": "sandbox_not_found", "message": f"no sandbox {sid}", "sandbox_id": sid}}).encode()


Handler = Callable[[str, str, dict[bytes, bytes], bytes], Any]


class _Protocol(asyncio.Protocol):
    """HTTP/1.1 keep-alive, one request at a time per connection (what the clients send)."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self._headers: dict[bytes, bytes] = {}
        self._body: list[bytes] = []
        self._url = b""
        self._queue: asyncio.Queue[tuple[str, str, dict[bytes, bytes], bytes, bool]] = asyncio.Queue()
        self._worker: asyncio.Task[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is not an asyncio.Transport subclass
        self._worker = asyncio.ensure_future(self._serve())

    def connection_lost(self, exc: Exception | None) -> None:
        if self._worker is not None:
            self._worker.cancel()

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            if self.transport is not None:
                self.transport.close()

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.setdefault(name.lower(), value)

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        method = self.parser.get_method().decode()
        self._queue.put_nowait((method, self._url.decode("latin-1"), self._headers, b"".join(self._body),
                                self.parser.should_keep_alive()))
        self._headers, self._body, self._url = {}, [], b""

    async def _serve(self) -> None:
        while True:
            method, path, headers, body, keep = await self._queue.get()
            try:
                status, out = await self.handler(method, path, headers, body)
            except Exception as exc:  # a bug in the stand-in: say so, keep serving
                status, out = 500, json.dumps({"error": {"code": "dsec_error", "message": repr(exc)}}).encode()
            if self.transport is None or self.transport.is_closing():
                return
            head = b"HTTP/1.1 %d %s\r\ncontent-length: %d\r\n" % (status, _REASONS.get(status, b"?"), len(out))
            if out:
                head += b"content-type: application/json\r\n"
            if not keep:
                head += b"connection: close\r\n"
            self.transport.write(head + b"\r\n" + out)
            if not keep:
                self.transport.close()
                return
