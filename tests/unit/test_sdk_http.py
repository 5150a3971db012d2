"""The SDK's HTTP paths against a real uvicorn on 127.0.0.1: plain calls through the lean
client (dsec/http/client.py), streams and large transfers through httpx, and errors either way
as the SDK has always raised them (typed dsec errors, httpx's transport errors)."""

from __future__ import annotations

import asyncio
import base64
import json
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import pytest

from conftest import serve_asgi
from dsec import AsyncClient, SandboxNotFound
from dsec.http.client import Answer
from dsec.spec import ImageRef, SandboxSpec

pytestmark = pytest.mark.anyio

SPEC = SandboxSpec(image=ImageRef(base="busybox:latest"))
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class FakeService:
    """Control plane and edge in one raw ASGI app: just the routes these tests call."""

    def __init__(self) -> None:
        self.url = ""
        self.seen: list[dict[str, Any]] = []
        self.slow_first_create = 0.0
        self.creates: dict[str, int] = {}

    def info(self, sid: str) -> dict[str, Any]:
        return {"id": sid, "state": "running", "edge_id": "e1", "edge_url": self.url, "token": f"tok-{sid}",
                "created_at": time.time()}

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        method, path, query = scope["method"], scope["path"], scope["query_string"].decode()
        headers = {k.decode(): v.decode() for k, v in scope["headers"]}
        self.seen.append({"method": method, "path": path, "query": query, "headers": headers, "body": body})
        status, out, ctype = await self.route(method, path, query, body)
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", ctype.encode()), (b"content-length", str(len(out)).encode())]})
        await send({"type": "http.response.body", "body": out})

    async def route(self, method: str, path: str, query: str, body: bytes) -> tuple[int, bytes, str]:
        if method == "POST" and path == "/v1/sandboxes":
            rid = json.loads(body)["request_id"]
            self.creates[rid] = self.creates.get(rid, 0) + 1
            if self.creates[rid] == 1 and self.slow_first_create:
                await asyncio.sleep(self.slow_first_create)  # the client gives up: its answer is lost
            return 201, json.dumps(self.info("e1-000000000001")).encode(), "application/json"
        if method == "GET" and path == "/v1/sandboxes":
            return 200, json.dumps({"items": [self.info("e1-000000000001")]}).encode(), "application/json"
        if path == "/v1/sandboxes/e1-gone":
            err = {"error": {"code": "sandbox_not_found", "message": "gone", "sandbox_id": "e1-gone"}}
            return 404, json.dumps(err).encode(), "application/json"
        if path.endswith("/exec"):
            res = {"exit_code": 0, "stdout_b64": base64.b64encode(b"hi").decode(), "stderr_b64": "",
                   "stdout_bytes": 2, "stderr_bytes": 0, "truncated": False, "duration_s": 0.0}
            return 200, json.dumps(res).encode(), "application/json"
        if path.endswith("/exec/stream"):
            res = {"exit_code": 0, "stdout_b64": "", "stderr_b64": "", "stdout_bytes": 0, "stderr_bytes": 0,
                   "truncated": False, "duration_s": 0.0}
            lines = [{"kind": "stdout", "data_b64": base64.b64encode(b"hi").decode()}, {"kind": "result", "result": res}]
            return 200, b"".join(json.dumps(x).encode() + b"\n" for x in lines), "application/x-ndjson"
        if path.endswith("/files"):
            return 200, query.encode(), "application/octet-stream"
        if path.endswith("/files/tar"):
            return 200, b"tar-bytes", "application/x-tar"
        if method == "DELETE":
            return 204, b"", "application/json"
        if method == "GET" and path.startswith("/v1/sandboxes/"):
            return 200, json.dumps(self.info(path.rsplit("/", 1)[1])).encode(), "application/json"
        return 404, b'{"error": {"code": "dsec_error", "message": "no route"}}', "application/json"


@pytest.fixture
async def service() -> AsyncIterator[FakeService]:
    app = FakeService()
    async with serve_asgi(app, timeout_graceful_shutdown=2) as url:
        app.url = url
        yield app


async def test_plain_calls_take_the_lean_path_and_errors_stay_typed(service: FakeService) -> None:
    c = AsyncClient(service.url, "dsk_t")
    try:
        resp = await c._call("GET", "/v1/sandboxes/e1-000000000001")
        assert isinstance(resp, Answer)  # not an httpx.Response: the lean client carried it
        info = await c.info("e1-000000000001")
        assert info.edge_url == service.url
        assert c._http._lean is not None and c._http._lean.reused >= 1
        assert service.seen[-1]["headers"]["authorization"] == "Bearer dsk_t"

        with pytest.raises(SandboxNotFound) as err:  # the wire error format, typed as ever
            await c.info("e1-gone")
        assert err.value.fields.get("sandbox_id") == "e1-gone" and err.value.fields.get("status") == 404

        await c.list(labels={"job": "a b"}, task="t")
        assert service.seen[-1]["query"] == "label=job%3Da+b&task=t"
        assert c._http._httpx == {}  # httpx was never needed for the control plane

        sb = await c.create(SPEC)
        result = await sb.exec(["echo", "hi"], timeout=None)
        assert result.stdout == b"hi"
        sent = service.seen[-1]
        assert json.loads(sent["body"])["timeout"] is None
        assert sent["headers"]["authorization"] == f"Bearer tok-{sb.id}"
        assert await sb.files.read("/tmp/a b") == b"path=%2Ftmp%2Fa+b"
        edge = c._edge(service.url)
        assert edge._httpx == {}  # exec and file reads: lean

        assert await sb.files.download("/") == b"tar-bytes"  # large transfers and streams: httpx
        chunks = [x async for x in sb.exec_stream("echo hi")]
        assert len(chunks) == 2 and edge._httpx != {}
        await sb.close()
        assert (service.seen[-1]["method"], service.seen[-1]["path"]) == ("DELETE", f"/v1/sandboxes/{sb.id}")
    finally:
        await c.aclose()
        await c.aclose()  # closing twice is fine


async def test_a_lost_create_answer_is_retried_with_the_same_request_id(service: FakeService) -> None:
    service.slow_first_create = 1.0
    async with AsyncClient(service.url, "dsk_t", timeout=0.3) as c:
        outcomes = [o async for o in c.create_many(SPEC, 1)]
    assert [o.ok for o in outcomes] == [True]
    assert list(service.creates.values()) == [2]  # the same request_id, sent twice


async def test_transport_failures_raise_httpx_errors(service: FakeService) -> None:
    service.slow_first_create = 1.0
    async with AsyncClient(service.url, "dsk_t", timeout=0.2) as c:
        with pytest.raises(httpx.ReadTimeout):
            await c.create(SPEC)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there
    async with AsyncClient(f"http://127.0.0.1:{port}", "dsk_t") as c:
        with pytest.raises(httpx.ConnectError):
            await c.info("e1-000000000001")


async def test_a_proxy_from_the_environment_is_honoured(service: FakeService, monkeypatch: pytest.MonkeyPatch) -> None:
    """HTTP_PROXY applies as httpx applies it: the call goes through httpx and the proxy;
    NO_PROXY naming the host puts it back on the lean path, straight to the server."""
    seen: list[bytes] = []

    async def proxy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(await reader.readline())
        while (await reader.readline()) not in (b"\r\n", b""):
            pass
        body = b'{"via": "proxy"}'
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                     % (len(body), body))
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(proxy, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        monkeypatch.setenv("HTTP_PROXY", f"http://127.0.0.1:{port}")
        monkeypatch.delenv("NO_PROXY", raising=False)
        monkeypatch.delenv("no_proxy", raising=False)
        c = AsyncClient(service.url, "dsk_t")
        try:
            resp = await c._call("GET", "/healthz")
            assert isinstance(resp, httpx.Response) and resp.json() == {"via": "proxy"}
            assert seen and seen[0].startswith(f"GET {service.url}/healthz".encode())
        finally:
            await c.aclose()
        monkeypatch.setenv("NO_PROXY", "127.0.0.1")
        c = AsyncClient(service.url, "dsk_t")
        try:
            resp = await c._call("GET", "/v1/sandboxes/e1-000000000001")
            assert isinstance(resp, Answer) and len(seen) == 1
        finally:
            await c.aclose()
    finally:
        server.close()
        await server.wait_closed()


class NewerService(FakeService):
    """A control plane and edge of a later version: every answer carries fields this SDK does
    not know, at the top and nested (the image, the exec result)."""

    def info(self, sid: str) -> dict[str, Any]:
        image = {**SPEC.image.model_dump(mode="json"), "signature": "x"}
        return {**super().info(sid), "zone": "eu-1", "image": image}

    async def route(self, method: str, path: str, query: str, body: bytes) -> tuple[int, bytes, str]:
        status, out, ctype = await super().route(method, path, query, body)
        if path.endswith("/exec") and status == 200:
            out = json.dumps({**json.loads(out), "cpu_s": 0.01}).encode()
        return status, out, ctype


async def test_answers_of_a_newer_server_with_fields_this_sdk_does_not_know_are_read() -> None:
    import pydantic

    from dsec.spec.api import ExecRequest

    app = NewerService()
    async with serve_asgi(app, timeout_graceful_shutdown=2) as url:
        app.url = url
        c = AsyncClient(url, "dsk_t")
        try:
            sb = await c.create(SPEC)
            assert sb.info.edge_id == "e1" and sb.info.image is not None and sb.info.image.base == "busybox:latest"
            assert not hasattr(sb.info, "zone")  # dropped, not kept
            assert (await sb.exec(["echo", "hi"])).stdout == b"hi"
            assert [x.id for x in await c.list()] == ["e1-000000000001"]
        finally:
            await c.aclose()
    # what a server reads stays strict: an unknown field of a request is refused, naming it
    with pytest.raises(pydantic.ValidationError) as err:
        ExecRequest.model_validate_json(b'{"cmd": ["true"], "colour": "red"}')
    assert err.value.errors()[0]["type"] == "extra_forbidden" and err.value.errors()[0]["loc"] == ("colour",)
