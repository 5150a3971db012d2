"""FastRoutes (dsec/http/fastroute.py) on its own: which requests it answers, which it hands on,
how it reads bodies, and how errors come out. Called as an ASGI app with hand-made
scope/receive/send, and once behind BodyLimit on a real uvicorn on 127.0.0.1 (real
chunking, a real client going away)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from conftest import serve_asgi
from dsec.errors import AuthError, Backpressure, DsecError, SandboxNotFound
from dsec.http.fastroute import Answer, FastRequest, FastRoutes
from dsec.http.limits import BodyLimit

pytestmark = pytest.mark.anyio

EXEC = "/v1/sandboxes/{}/exec"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class Cmd(BaseModel):
    model_config = ConfigDict(extra="forbid")
    cmd: list[str]
    timeout: float = Field(default=1.0, gt=0)


# ------------------------------------------------------------- machinery ----


class Inner:
    """The app behind FastRoutes (FastAPI's place): records what reaches it, answers 299."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, bytes]] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        body = b""
        if scope["type"] == "http":
            while True:
                m = await receive()
                body += m.get("body", b"")
                if not m.get("more_body"):
                    break
        self.seen.append((scope["type"], scope.get("path", ""), body))
        if scope["type"] == "http":
            await send({"type": "http.response.start", "status": 299, "headers": []})
            await send({"type": "http.response.body", "body": b"inner"})


@dataclass
class Handlers:
    calls: list[FastRequest] = field(default_factory=list)
    raise_: Exception | None = None

    async def create(self, req: FastRequest) -> Answer:
        self.calls.append(req)
        if self.raise_ is not None:
            raise self.raise_
        return Answer(201, json.dumps({"made": req.json}).encode())

    async def exec(self, req: FastRequest) -> Answer:
        self.calls.append(req)
        body = req.model(Cmd)
        return Answer(200, json.dumps({"id": req.params[0], "cmd": body.cmd}).encode(), ((b"x-id", req.params[0].encode()),))


def errors(exc: Exception) -> Answer | None:
    """Like an app's exception handlers: DsecErrors and validation errors, nothing else."""
    if isinstance(exc, DsecError):
        status = {"auth_error": 401, "sandbox_not_found": 404, "backpressure": 429}.get(exc.code, 400)
        headers = ((b"retry-after", b"3"),) if status == 429 else ()
        return Answer(status, json.dumps({"error": exc.to_wire()}).encode(), headers)
    if isinstance(exc, (ValidationError, RequestValidationError)):
        first = exc.errors()[0]
        body = {"error": {"code": "invalid_spec", "loc": list(first["loc"]), "type": first["type"]}}
        return Answer(422, json.dumps(body).encode())
    return None


def make(handlers: Handlers, inner: Inner) -> FastRoutes:
    return FastRoutes(inner, errors=errors, routes={
        ("POST", "/v1/sandboxes"): handlers.create,
        ("POST", EXEC): handlers.exec,
    })


@dataclass
class Reply:
    status: int
    headers: dict[bytes, bytes]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


async def call(app: Any, path: str = "/v1/sandboxes", *, method: str = "POST", body: bytes | list[bytes] = b"{}",
               headers: list[tuple[bytes, bytes]] | None = None, query: bytes = b"",
               then: list[dict[str, Any]] | None = None, whole: bool = True) -> Reply | None:
    """One request; ``body`` as one message or a list of chunks (``whole=False``: more was
    to come); ``then``: what receive gives after the body (default: the client going away).
    None: no answer was sent."""
    chunks = body if isinstance(body, list) else [body]
    messages: list[dict[str, Any]] = [
        {"type": "http.request", "body": c, "more_body": i < len(chunks) - 1 or not whole}
        for i, c in enumerate(chunks)
    ]
    messages += then if then is not None else [{"type": "http.disconnect"}]
    scope = {"type": "http", "method": method, "path": path, "query_string": query, "root_path": "",
             "headers": headers if headers is not None else [(b"content-type", b"application/json")]}
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        if not messages:
            await asyncio.sleep(3600)  # a client that neither sends nor leaves
        return messages.pop(0)

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app(scope, receive, send)
    if not sent:
        return None
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"], sent
    return Reply(sent[0]["status"], dict(sent[0]["headers"]), sent[1]["body"])


@pytest.fixture
def handlers() -> Handlers:
    return Handlers()


@pytest.fixture
def inner() -> Inner:
    return Inner()


@pytest.fixture
def app(handlers: Handlers, inner: Inner) -> FastRoutes:
    return make(handlers, inner)


# --------------------------------------------------------------- matching ----


@pytest.mark.parametrize("path", ["/v1/sandboxes/abc/exec", "/v1/sandboxes/e1-0123456789ab/exec"])
async def test_a_path_of_the_shape_is_answered_with_its_parameter(app: FastRoutes, handlers: Handlers, inner: Inner,
                                                                  path: str) -> None:
    r = await call(app, path, body=b'{"cmd": ["true"]}')
    assert r is not None and r.status == 200, r
    sid = path.split("/")[3]
    assert r.json() == {"id": sid, "cmd": ["true"]} and r.headers[b"x-id"] == sid.encode()
    assert r.headers[b"content-type"] == b"application/json" and r.headers[b"content-length"] == b"%d" % len(r.body)
    assert [c.params for c in handlers.calls] == [(sid,)] and inner.seen == []


@pytest.mark.parametrize(("method", "path"), [
    ("POST", "/v1/sandboxes//exec"),  # an empty parameter
    ("POST", "/v1/sandboxes/abc/exec/stream"),  # longer
    ("POST", "/v1/sandboxes/abc/exec/"),  # a trailing slash (FastAPI redirects it)
    ("POST", "/v1/sandboxes/abc"),
    ("POST", "/v1/sandboxez/abc/exec"),
    ("POST", "//v1/sandboxes/abc/exec"),
    ("POST", "/v1/sandboxes/"),
    ("POST", "/v1//sandboxes"),
    ("POST", "v1/sandboxes"),
    ("GET", "/v1/sandboxes/abc/exec"),
    ("GET", "/v1/sandboxes"),
    ("PUT", "/v1/sandboxes"),
])
async def test_anything_else_goes_on_to_the_app(app: FastRoutes, handlers: Handlers, inner: Inner, method: str,
                                                path: str) -> None:
    r = await call(app, path, method=method, body=b'{"cmd": ["true"]}')
    assert r is not None and (r.status, r.body) == (299, b"inner")
    assert handlers.calls == [] and inner.seen == [("http", path, b'{"cmd": ["true"]}')]


async def test_a_literal_route_matches_exactly(app: FastRoutes, handlers: Handlers) -> None:
    r = await call(app, "/v1/sandboxes", body=b'{"a": 1}')
    assert r is not None and (r.status, r.json()) == (201, {"made": {"a": 1}})
    assert handlers.calls[0].params == ()


async def test_a_query_string_goes_on_to_the_app(app: FastRoutes, handlers: Handlers, inner: Inner) -> None:
    r = await call(app, "/v1/sandboxes/abc/exec", body=b'{"cmd": ["true"]}', query=b"via=fastapi")
    assert r is not None and r.status == 299
    assert handlers.calls == [] and inner.seen == [("http", "/v1/sandboxes/abc/exec", b'{"cmd": ["true"]}')]


@pytest.mark.parametrize("ctype", [None, b"text/plain", b"application/x-www-form-urlencoded",
                                   b"application/vnd.api+json", b"application/jsonx", b""])
async def test_a_body_not_typed_json_goes_on_to_the_app(app: FastRoutes, handlers: Handlers, inner: Inner,
                                                        ctype: bytes | None) -> None:
    # FastAPI decides those (it refuses a body without a JSON content type; +json it parses)
    headers = [] if ctype is None else [(b"content-type", ctype)]
    r = await call(app, body=b'{"a": 1}', headers=headers)
    assert r is not None and r.status == 299
    assert handlers.calls == [] and inner.seen == [("http", "/v1/sandboxes", b'{"a": 1}')]


@pytest.mark.parametrize("ctype", [b"application/json", b"application/json; charset=utf-8", b"Application/JSON",
                                   b" application/json ;charset=utf-8"])
async def test_json_with_parameters_or_any_case_is_answered(app: FastRoutes, handlers: Handlers, inner: Inner,
                                                            ctype: bytes) -> None:
    r = await call(app, body=b'{"a": 1}', headers=[(b"content-type", ctype)])
    assert r is not None and r.status == 201 and inner.seen == []


async def test_the_first_of_a_repeated_header_counts(app: FastRoutes, handlers: Handlers, inner: Inner) -> None:
    # as Starlette's headers.get, which FastAPI's HTTPBearer and body parsing read
    r = await call(app, body=b"{}", headers=[(b"authorization", b"Bearer first"), (b"authorization", b"Bearer second"),
                                             (b"content-type", b"application/json")])
    assert r is not None and r.status == 201
    assert handlers.calls[0].headers[b"authorization"] == b"Bearer first"
    assert handlers.calls[0].bearer() == "first"
    await call(app, body=b"{}", headers=[(b"content-type", b"text/plain"), (b"content-type", b"application/json")])
    assert len(handlers.calls) == 1 and len(inner.seen) == 1  # text/plain came first: FastAPI's


async def test_other_scopes_go_on_to_the_app(app: FastRoutes, inner: Inner) -> None:
    async def nothing() -> dict[str, Any]:
        return {"type": "lifespan.startup"}

    async def drop(message: dict[str, Any]) -> None:
        pass

    await app({"type": "lifespan"}, nothing, drop)
    await app({"type": "websocket", "path": "/v1/sandboxes", "query_string": b"", "headers": []}, nothing, drop)
    assert [t for t, _, _ in inner.seen] == ["lifespan", "websocket"]


@pytest.mark.parametrize(("header", "token"), [
    (b"Bearer abc", "abc"), (b"bearer abc", "abc"), (b"BEARER  abc ", "abc"), (b"Bearer", None), (b"Bearer ", None),
    (b"Basic eDp5", None), (b"abc", None), (b"", None), (None, None),
])
async def test_bearer_reads_the_token_as_fastapis_http_bearer(app: FastRoutes, handlers: Handlers,
                                                              header: bytes | None, token: str | None) -> None:
    headers = [(b"content-type", b"application/json")]
    if header is not None:
        headers.append((b"authorization", header))
    await call(app, headers=headers)
    assert handlers.calls[0].bearer() == token


# ------------------------------------------------------------------ bodies ----


async def test_a_body_in_several_chunks_is_read_whole(app: FastRoutes, handlers: Handlers) -> None:
    r = await call(app, "/v1/sandboxes/abc/exec", body=[b'{"cm', b"", b'd": ["ec', b'ho", "hi"]', b"}"])
    assert r is not None and r.status == 200, r
    assert r.json() == {"id": "abc", "cmd": ["echo", "hi"]}


async def test_after_the_body_receive_tells_when_the_client_goes_away(app: FastRoutes, handlers: Handlers) -> None:
    await call(app, body=[b"{", b"}"], then=[{"type": "http.disconnect"}])
    assert await handlers.calls[0].receive() == {"type": "http.disconnect"}


async def test_a_client_gone_during_the_body_gets_no_answer(handlers: Handlers, inner: Inner) -> None:
    app = make(handlers, inner)
    r = await call(app, body=[b'{"a": 1}'], then=[{"type": "http.disconnect"}], whole=False)
    assert r is None and handlers.calls == [] and inner.seen == []


async def test_body_limit_answers_413_whatever_the_app_makes_of_it() -> None:
    # FastAPI turns an error while reading a body into a 400; past the limit the client gets 413
    async def app(scope: Any, receive: Any, send: Any) -> None:
        status, body = 200, b"read"
        try:
            while (await receive()).get("more_body"):
                pass
        except DsecError:
            status, body = 400, b"There was an error parsing the body"
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": body})

    r = await call(BodyLimit(app, limit=10), body=[b"12345", b"67890", b"1"])
    assert r is not None and r.status == 413 and r.json()["error"]["code"] == "too_large", r
    r = await call(BodyLimit(app, limit=10), body=[b"12345", b"67890"])
    assert r is not None and (r.status, r.body) == (200, b"read")  # at the limit: the app's own answer


@pytest.mark.parametrize("body", [b"", b"{not json", b'{"a": 1', b"\xef\xbb\xbf{}", '{"a": 1}'.encode("utf-16"),
                                  b'{"cmd": ["\\ud800"]}', b"{} {}"])
async def test_a_body_pydantic_cannot_parse_goes_on_to_the_app_whole(app: FastRoutes, handlers: Handlers,
                                                                     inner: Inner, body: bytes) -> None:
    # FastAPI answers it from the same bytes (its parser takes some of these: a BOM, UTF-16)
    half = len(body) // 2
    r = await call(app, body=[body[:half], body[half:]])
    assert r is not None and r.status == 299
    assert handlers.calls == [] and inner.seen == [("http", "/v1/sandboxes", body)]


async def test_the_body_is_parsed_not_validated_until_the_handler_asks(app: FastRoutes, handlers: Handlers) -> None:
    r = await call(app, body=b'{"n": 1e400, "big": 100000000000000000000000, "s": "\\u00e9", "x": null}')
    assert r is not None and r.status == 201
    assert handlers.calls[0].json == {"n": float("inf"), "big": 10**23, "s": "é", "x": None}


# ------------------------------------------------------------------ errors ----


@pytest.mark.parametrize(("exc", "status", "code"), [
    (AuthError("who are you"), 401, "auth_error"),
    (SandboxNotFound("no such sandbox", sandbox_id="abc"), 404, "sandbox_not_found"),
    (Backpressure("busy", retry_after=3.0), 429, "backpressure"),
])
async def test_a_dsec_error_is_answered_by_the_errors_callback(handlers: Handlers, inner: Inner, exc: DsecError,
                                                               status: int, code: str) -> None:
    handlers.raise_ = exc
    r = await call(make(handlers, inner))
    assert r is not None and r.status == status and r.json()["error"]["code"] == code
    assert r.json()["error"]["message"] == exc.message
    assert (r.headers.get(b"retry-after") == b"3") == (status == 429)
    assert inner.seen == []


async def test_a_pydantic_validation_error_is_answered_by_the_errors_callback(handlers: Handlers,
                                                                             inner: Inner) -> None:
    with pytest.raises(ValidationError) as caught:
        Cmd.model_validate({"cmd": "true"})
    handlers.raise_ = caught.value
    r = await call(make(handlers, inner))
    assert r is not None and r.status == 422 and r.json()["error"] == {"code": "invalid_spec", "loc": ["cmd"],
                                                                       "type": "list_type"}


@pytest.mark.parametrize(("body", "loc", "type_"), [
    (b'{"cmd": "true"}', ["body", "cmd"], "list_type"),
    (b'{"cmd": ["true"], "timeout": 0}', ["body", "timeout"], "greater_than"),
    (b'{"cmd": ["true"], "colour": "red"}', ["body", "colour"], "extra_forbidden"),
    (b"[1, 2]", ["body"], "model_attributes_type"),  # FastAPI validates with from_attributes
    (b"null", ["body"], "model_attributes_type"),
])
async def test_the_wrong_shape_is_a_request_validation_error_as_fastapis(app: FastRoutes, body: bytes,
                                                                        loc: list[str], type_: str) -> None:
    r = await call(app, "/v1/sandboxes/abc/exec", body=body)
    assert r is not None and r.status == 422 and r.json()["error"] == {"code": "invalid_spec", "loc": loc, "type": type_}


async def test_an_exception_the_callback_does_not_render_propagates(handlers: Handlers, inner: Inner) -> None:
    handlers.raise_ = RuntimeError("a bug")
    app = make(handlers, inner)
    sent: list[Any] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"{}"}

    async def send(message: Any) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/sandboxes", "query_string": b"",
             "headers": [(b"content-type", b"application/json")]}
    with pytest.raises(RuntimeError, match="a bug"):
        await app(scope, receive, send)
    assert sent == [] and inner.seen == []  # the app's catch-all (ServerErrorMiddleware) answers it


# ------------------------------------------------- behind BodyLimit, served ----


@dataclass
class Served:
    url: str
    handlers: Handlers
    inner: Inner
    gone: asyncio.Event


@pytest.fixture
async def served() -> AsyncIterator[Served]:
    """FastRoutes inside BodyLimit (as the apps install them), on a real uvicorn; the exec
    handler waits for the client to go away."""
    handlers, inner, gone = Handlers(), Inner(), asyncio.Event()

    async def wait_exec(req: FastRequest) -> Answer:
        handlers.calls.append(req)
        while (await req.receive())["type"] != "http.disconnect":
            pass
        gone.set()
        return Answer(499, b"")

    fast = FastRoutes(inner, errors=errors, routes={("POST", "/v1/sandboxes"): handlers.create,
                                                    ("POST", EXEC): wait_exec})
    async with serve_asgi(BodyLimit(fast, limit=1 << 20)) as url:
        yield Served(url, handlers, inner, gone)


def urlsplit_host_port(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


async def chunks(*parts: bytes) -> AsyncIterator[bytes]:
    for p in parts:
        yield p
        await asyncio.sleep(0.01)  # separate writes: separate ASGI messages


async def test_served_a_chunked_body_is_read_whole(served: Served) -> None:
    async with httpx.AsyncClient(base_url=served.url) as c:
        r = await c.post("/v1/sandboxes", content=chunks(b'{"a": ', b"[1, ", b"2]}"),
                         headers={"content-type": "application/json"})
    assert r.status_code == 201 and r.json() == {"made": {"a": [1, 2]}}
    assert served.inner.seen == []


async def test_served_a_body_over_the_limit_is_413_declared_or_streamed(served: Served) -> None:
    big = b'{"a": "' + b"x" * (1 << 20) + b'"}'
    async with httpx.AsyncClient(base_url=served.url) as c:
        streamed = await c.post("/v1/sandboxes", content=chunks(big[: 1 << 19], big[1 << 19 :]),
                                headers={"content-type": "application/json"})
    assert streamed.status_code == 413 and streamed.json()["error"]["code"] == "too_large", streamed.text
    # declared only, never sent: refused on the header
    r, w = await asyncio.open_connection(*urlsplit_host_port(served.url))
    try:
        w.write(b"POST /v1/sandboxes HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\n\r\n" % len(big))
        head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 10)
    finally:
        w.close()
    assert head.startswith(b"HTTP/1.1 413 "), head
    assert served.handlers.calls == [] and served.inner.seen == []


async def test_served_the_handler_hears_the_client_go_away(served: Served) -> None:
    async with httpx.AsyncClient(base_url=served.url, timeout=0.3) as c:
        with pytest.raises(httpx.ReadTimeout):
            await c.post("/v1/sandboxes/abc/exec", json={"cmd": ["sleep", "30"]})
    await asyncio.wait_for(served.gone.wait(), 5)
    assert [r.params for r in served.handlers.calls] == [("abc",)]
