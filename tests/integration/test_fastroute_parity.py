"""The fast routes (dsec/http/fastroute.py) answer as the FastAPI routes do, on the real servers.

Every request is sent twice: as it is, which the fast route answers, and with a
harmless query string (``?via=fastapi``), which FastRoutes hands on to FastAPI
(FastAPI ignores a query parameter it does not know). The two answers must
agree: status, the whole error body, and Retry-After / WWW-Authenticate. A spy
in place of the FastRoutes' inner app records what it handed on, so a test
also knows which path answered each request.

Control plane: a real replica with stub edges, on SQLite and PostgreSQL.
Edge: a real edge (runtime ``<prefix>-efast``) on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import json
import re
import secrets
import socket
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
import test_control_support as support
from test_control_support import SPEC as CONTROL_SPEC
from test_control_support import cluster

from conftest import edge_config, pid_alive, running_edge, wait_until
from dsec.edge.testing import EdgeThread
from dsec.http.auth import mint
from dsec.http.fastroute import FastRoutes
from dsec.http.limits import JSON_BODY_LIMIT

anyio_backend = support.anyio_backend
pg_cluster = support.pg_cluster
db_url = support.db_url

KEY = secrets.token_bytes(32)
EDGE_SPEC: dict[str, Any] = {"image": {"base": "busybox:test"},
                             "resources": {"cpu": 0.25, "memory": 64 << 20, "disk": 16 << 20}}
VIA = "via=fastapi"
COMPARED_HEADERS = ("retry-after", "www-authenticate", "content-type")


# ------------------------------------------------------------- machinery ----


class Spy:
    """Stands in for the FastRoutes' inner app (FastAPI's stack): records every POST
    FastRoutes hands on (the tests' own GETs and DELETEs are not the point), then passes
    it along."""

    def __init__(self, app: Any) -> None:
        node = app.middleware_stack  # built by the app's first request
        while node is not None and not isinstance(node, FastRoutes):
            node = getattr(node, "app", None)
        assert node is not None, "no FastRoutes in the app's middleware stack"
        self.inner = node.app
        node.app = self
        self.passed: list[str] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            qs = scope.get("query_string", b"").decode()
            self.passed.append(scope["path"] + (f"?{qs}" if qs else ""))
        await self.inner(scope, receive, send)


def chunked(n: int, chunk: int = 1 << 20) -> Callable[[], Iterator[bytes]]:
    """A body of ``n`` bytes sent chunked (no Content-Length): the limit is met while reading."""

    def gen() -> Iterator[bytes]:
        yield b'{"cmd": "'
        left = n
        while left > 0:
            yield b"x" * min(chunk, left)
            left -= chunk
        yield b'"}'

    return gen


@dataclass(frozen=True)
class Declared:
    """A body only declared (Content-Length), never sent: BodyLimit refuses it on the header."""

    size: int


def send_declared(base_url: str, path: str, headers: list[tuple[str, str]], size: int) -> httpx.Response:
    """The request head alone, on a raw socket (httpx would send the body and, refused early,
    lose the answer to the connection's reset)."""
    u = urlsplit(base_url)
    head = [f"POST {path} HTTP/1.1", f"host: {u.netloc}", f"content-length: {size}", "connection: close",
            *(f"{k}: {v}" for k, v in headers)]
    with socket.create_connection((u.hostname, u.port), timeout=30) as s:
        s.sendall(("\r\n".join(head) + "\r\n\r\n").encode("latin-1"))
        raw = b""
        while chunk := s.recv(65536):
            raw += chunk
    top, _, body = raw.partition(b"\r\n\r\n")
    status, *lines = top.decode("latin-1").split("\r\n")
    fields = [tuple(x.strip() for x in line.split(":", 1)) for line in lines]
    return httpx.Response(int(status.split()[1]), headers=fields, content=body)


@dataclass
class Req:
    """One request of a case. ``served``: who answers the plain request (without the query
    string): ``fast`` (the fast route), ``fastapi`` (FastRoutes hands it on) or ``limit``
    (BodyLimit refuses it before either sees it)."""

    path: str
    body: Any = None
    """JSON-encoded unless bytes, a function making a chunked body, or :class:`Declared`."""
    headers: list[tuple[str, str]] = field(default_factory=list)
    ctype: str | None = "application/json"
    served: str = "fast"
    expect: tuple[Any, ...] = ()
    """``(status, code[, field[, text in the message]])`` the answer must have, both paths."""

    def all_headers(self) -> list[tuple[str, str]]:
        return self.headers + ([("content-type", self.ctype)] if self.ctype is not None else [])

    def kwargs(self, *, aio: bool = False) -> dict[str, Any]:
        headers = self.all_headers()
        if callable(self.body):
            content: Any = self.body()
            if aio:
                content = _aiter(content)
        elif isinstance(self.body, bytes):
            content = self.body
        else:
            content = json.dumps(self.body).encode()
        return {"headers": headers, "content": content}


async def _aiter(it: Iterator[bytes]) -> AsyncIterator[bytes]:
    for x in it:
        yield x


def with_query(path: str) -> str:
    return f"{path}{'&' if '?' in path else '?'}{VIA}"


def send_sync(c: httpx.Client, req: Req, path: str) -> httpx.Response:
    if isinstance(req.body, Declared):
        return send_declared(str(c.base_url), path, req.all_headers(), req.body.size)
    return c.post(path, **req.kwargs())


async def send_async(c: httpx.AsyncClient, req: Req, path: str) -> httpx.Response:
    if isinstance(req.body, Declared):
        return await asyncio.to_thread(send_declared, str(c.base_url), path, req.all_headers(), req.body.size)
    return await c.post(path, **req.kwargs(aio=True))


def differences(fast: httpx.Response, slow: httpx.Response) -> list[str]:
    """How the fast path's answer differs from FastAPI's (empty: alike)."""
    out = []
    if fast.status_code != slow.status_code:
        out.append(f"status {fast.status_code} != {slow.status_code}")
    for h in COMPARED_HEADERS:
        if fast.headers.get(h) != slow.headers.get(h):
            out.append(f"{h}: {fast.headers.get(h)!r} != {slow.headers.get(h)!r}")
    if "location" in slow.headers or "location" in fast.headers:
        a, b = urlsplit(fast.headers.get("location", "")), urlsplit(slow.headers.get("location", ""))
        if a.path != b.path:
            out.append(f"location {a.path!r} != {b.path!r}")
    if slow.status_code >= 400 or fast.status_code >= 400:
        try:
            fb, sb = fast.json(), slow.json()
        except ValueError:
            fb, sb = fast.text, slow.text
        if fb != sb:
            out.append(f"body {fb!r} != {sb!r}")
    return out


def check_served(spy: Spy, req: Req, before: int) -> list[str]:
    """The plain request went the way the case says, the queried one to FastAPI."""
    seen = spy.passed[before:]
    want = {"fast": [], "fastapi": [req.path]}.get(req.served, [])
    if req.served != "limit":
        want = [*want, with_query(req.path)]
    return [] if seen == want else [f"handed on to FastAPI: {seen}, expected {want}"]


def unexpected(r: httpx.Response, req: Req) -> list[str]:
    """How the answer misses the case's ``expect`` (alike but wrong is still wrong)."""
    if not req.expect:
        return []
    e = r.json().get("error", {}) if r.headers.get("content-type") == "application/json" else {}
    got = (r.status_code, e.get("code"), e.get("field"), e.get("message", ""))
    status, code, *rest = req.expect
    bad = got[:2] != (status, code) or (len(rest) > 0 and got[2] != rest[0]) or (len(rest) > 1 and rest[1] not in got[3])
    return [f"expected {req.expect}, got {got}"] if bad else []


def error(r: httpx.Response) -> dict[str, Any]:
    body = r.json()
    assert set(body) == {"error"}, body
    return dict(body["error"])


# ----------------------------------------------------------- control plane ----


def control_cases(cl: Any, token: str, small: str) -> dict[str, Req]:
    """Bad creates on the control plane. ``token``: the admin's; ``small``: a project at its quota."""
    admin = [("authorization", f"Bearer {token}")]
    good = {"spec": CONTROL_SPEC}
    sandbox_token, _ = mint(cl.key, sandbox_id="e1-000000000000", project="root")
    edge_admin, _ = mint(cl.key, sandbox_id="*", project="*", scope="edge-admin")
    p = "/v1/sandboxes"
    return {
        "no authorization": Req(p, good, expect=(401, "auth_error")),
        "basic auth": Req(p, good, [("authorization", "Basic eDp5")], expect=(401, "auth_error")),
        "bearer without a token": Req(p, good, [("authorization", "Bearer")]),
        "malformed token": Req(p, good, [("authorization", "Bearer garbage")], expect=(401, "auth_error")),
        "forged project token": Req(p, good, [("authorization", "Bearer dsk_forged")], expect=(401, "auth_error")),
        "an edge's sandbox token": Req(p, good, [("authorization", f"Bearer {sandbox_token}")]),
        "an edge-admin token": Req(p, good, [("authorization", f"Bearer {edge_admin}")]),
        "two authorization headers, the first bad": Req(
            p, good, [("authorization", "Bearer dsk_forged"), *admin], expect=(401, "auth_error")),
        "malformed JSON": Req(p, b'{"spec": {"image": ', admin, served="fastapi", expect=(422, "invalid_spec")),
        "malformed JSON, no token": Req(p, b"{not json", served="fastapi"),
        "empty body": Req(p, b"", admin, served="fastapi"),
        "JSON with a byte-order mark": Req(p, b'\xef\xbb\xbf{"spec": {"image": {}}}', admin, served="fastapi"),
        "wrong shape": Req(p, {"spec": {"image": {}}}, admin, expect=(422, "invalid_spec", "spec.image.base")),
        "wrong shape, no token": Req(p, {"spec": {"image": {}}}, expect=(401, "auth_error")),
        "a list": Req(p, [1, 2], admin),
        "null": Req(p, None, admin),
        "negative cpu": Req(p, {"spec": {**CONTROL_SPEC, "resources": {"cpu": -1}}}, admin,
                            expect=(422, "invalid_spec", "spec.resources.cpu")),
        "negative memory": Req(p, {"spec": {**CONTROL_SPEC, "resources": {"memory": -5}}}, admin,
                               expect=(422, "invalid_spec", "spec.resources.memory")),
        "cpu NaN": Req(p, b'{"spec": {"image": {"base": "busybox:test"}, "resources": {"cpu": NaN}}}', admin),
        "unknown field": Req(p, {"spec": CONTROL_SPEC, "colour": "red"}, admin),
        "bad task name": Req(p, {"spec": CONTROL_SPEC, "task": "Bad Task!"}, admin),
        "unknown image": Req(p, {"spec": {**CONTROL_SPEC, "image": {"base": "nosuchlayer:1"}}}, admin,
                             expect=(404, "layer_not_found", None, "`dsec image build`")),
        "over the project's quota": Req(p, good, [("authorization", f"Bearer {small}")],
                                        expect=(403, "quota_exceeded")),
        "no content type": Req(p, {"spec": {"image": {}}}, admin, ctype=None, served="fastapi"),
        "text/plain": Req(p, {"spec": {"image": {}}}, admin, ctype="text/plain", served="fastapi"),
        "json with a charset": Req(p, {"spec": {"image": {}}}, admin, ctype="application/json; charset=utf-8"),
        "trailing slash": Req(p + "/", {"spec": {"image": {}}}, admin, served="fastapi"),
        "over 16 MiB, declared": Req(p, Declared(JSON_BODY_LIMIT + 1), admin, served="limit",
                                     expect=(413, "too_large")),
        "over 16 MiB, chunked": Req(p, chunked(JSON_BODY_LIMIT), admin, expect=(413, "too_large")),
    }


async def control_mismatches(c: httpx.AsyncClient, spy: Spy, cases: dict[str, Req]) -> list[str]:
    out = []
    for name, req in cases.items():
        before = len(spy.passed)
        fast = await send_async(c, req, req.path)
        slow = await send_async(c, req, with_query(req.path))
        out += [f"{name}: {d}" for d in differences(fast, slow) + check_served(spy, req, before) + unexpected(fast, req)]
        if 200 <= fast.status_code < 300 or 200 <= slow.status_code < 300:
            out.append(f"{name}: accepted ({fast.status_code} / {slow.status_code}): {fast.text[:200]}")
    return out


@pytest.mark.anyio
async def test_control_plane_refuses_bad_creates_alike(db_url: str, tmp_path: Path) -> None:
    async with cluster(db_url, tmp_path) as cl:
        spy = Spy(cl.handle.app)
        small = await cl.project("small", sandboxes=1)
        anon = httpx.AsyncClient(base_url=cl.url, timeout=60)
        cl.clients.append(anon)
        assert (await anon.post("/v1/sandboxes", json={"spec": CONTROL_SPEC},
                                headers={"authorization": f"Bearer {small}"})).status_code == 201
        mismatches = await control_mismatches(anon, spy, control_cases(cl, cl.admin_token, small))

        # every edge refuses: 429 with Retry-After on both paths
        cl.edges[0].refuse_all = True
        busy = {"full": Req("/v1/sandboxes", {"spec": CONTROL_SPEC}, [("authorization", f"Bearer {cl.admin_token}")])}
        mismatches += await control_mismatches(anon, spy, busy)
        r = await anon.post("/v1/sandboxes", **busy["full"].kwargs(aio=True))
        assert r.status_code == 429 and error(r)["code"] == "backpressure" and r.headers["retry-after"], r.text
        cl.edges[0].refuse_all = False

        assert not mismatches, "the fast route and FastAPI answered differently:\n  " + "\n  ".join(mismatches)
        assert len(cl.edges[0].live_ids()) == 1  # only the small project's sandbox was made


@pytest.mark.anyio
async def test_control_plane_creates_on_both_paths(db_url: str, tmp_path: Path) -> None:
    async with cluster(db_url, tmp_path) as cl:
        spy = Spy(cl.handle.app)
        c = cl.client()
        before = len(spy.passed)
        fast = await c.post("/v1/sandboxes", json={"spec": CONTROL_SPEC, "labels": {"via": "fast"}})
        slow = await c.post(f"/v1/sandboxes?{VIA}", json={"spec": CONTROL_SPEC, "labels": {"via": "fastapi"}})
        assert (fast.status_code, slow.status_code) == (201, 201), (fast.text, slow.text)
        assert spy.passed[before:] == [f"/v1/sandboxes?{VIA}"]
        assert fast.headers["content-type"] == slow.headers["content-type"] == "application/json"
        a, b = fast.json(), slow.json()
        assert set(a) == set(b) and a["id"] != b["id"]
        for info, via in ((a, "fast"), (b, "fastapi")):
            got = await c.get(f"/v1/sandboxes/{info['id']}")
            assert got.status_code == 200 and got.json()["labels"] == {"via": via}, got.text
        assert cl.edges[0].live_ids() == {a["id"], b["id"]}
        for info in (a, b):
            assert (await c.delete(f"/v1/sandboxes/{info['id']}")).status_code == 204
        assert not cl.edges[0].live_ids()


# ------------------------------------------------------------------ edge ----


@pytest.fixture(scope="module")
def edge(dsec_base: Path) -> Iterator[EdgeThread]:
    with running_edge(edge_config(dsec_base, "efast", "ef", KEY, watchdog_interval_s=0.2, max_sandboxes=3)) as e:
        yield e


@pytest.fixture(scope="module")
def api(edge: EdgeThread) -> Iterator[httpx.Client]:
    with edge.client() as c:
        assert c.get("/metrics").status_code == 200  # builds the app's middleware stack
        yield c


@pytest.fixture(scope="module")
def spy(edge: EdgeThread, api: httpx.Client) -> Spy:
    return Spy(edge.handle.server.config.app)


@pytest.fixture(scope="module")
def sandbox(api: httpx.Client) -> Iterator[str]:
    r = api.post("/v1/sandboxes", json={"spec": EDGE_SPEC})
    assert r.status_code == 201, r.text
    sid = str(r.json()["id"])
    try:
        yield sid
    finally:
        api.delete(f"/v1/sandboxes/{sid}")


def edge_cases(admin_token: str, sid: str) -> dict[str, Req]:
    """Bad creates and execs on the edge; ``sid``: a live sandbox."""
    admin = [("authorization", f"Bearer {admin_token}")]
    own = [("authorization", f"Bearer {mint(KEY, sandbox_id=sid, project='')[0]}")]
    other = [("authorization", f"Bearer {mint(KEY, sandbox_id='ef-000000000001', project='')[0]}")]
    forged = [("authorization", f"Bearer {mint(secrets.token_bytes(32), sandbox_id='*', project='', scope='edge-admin')[0]}")]
    expired = [("authorization", f"Bearer {mint(KEY, sandbox_id=sid, project='', ttl_s=-5)[0]}")]
    good = {"spec": EDGE_SPEC}
    c, x = "/v1/sandboxes", f"/v1/sandboxes/{sid}/exec"
    true = {"cmd": "true"}
    return {
        "create: no authorization": Req(c, good, expect=(401, "auth_error")),
        "create: basic auth": Req(c, good, [("authorization", "Basic eDp5")], expect=(401, "auth_error")),
        "create: malformed token": Req(c, good, [("authorization", "Bearer garbage")]),
        "create: forged token": Req(c, good, forged, expect=(401, "auth_error", None, "signature")),
        "create: a sandbox token": Req(c, good, own, expect=(403, "forbidden")),
        "create: two authorization headers, the first bad": Req(
            c, good, [("authorization", "Bearer garbage"), *admin], expect=(401, "auth_error")),
        "create: malformed JSON": Req(c, b'{"spec": {"image": ', admin, served="fastapi",
                                      expect=(422, "invalid_spec")),
        "create: malformed JSON, no token": Req(c, b"{not json", served="fastapi"),
        "create: empty body": Req(c, b"", admin, served="fastapi"),
        "create: JSON with a byte-order mark": Req(c, b'\xef\xbb\xbf{"spec": {"image": {}}}', admin,
                                                   served="fastapi"),
        "create: wrong shape": Req(c, {"spec": {"image": {}}}, admin, expect=(422, "invalid_spec", "spec.image.base")),
        "create: wrong shape, no token": Req(c, {"spec": {"image": {}}}),
        "create: a list": Req(c, [1, 2], admin),
        "create: negative cpu": Req(c, {"spec": {**EDGE_SPEC, "resources": {"cpu": -1}}}, admin,
                                    expect=(422, "invalid_spec", "spec.resources.cpu")),
        "create: negative memory": Req(c, {"spec": {**EDGE_SPEC, "resources": {"memory": -5}}}, admin,
                                       expect=(422, "invalid_spec", "spec.resources.memory")),
        "create: unknown field": Req(c, {"spec": {**EDGE_SPEC, "colour": "red"}}, admin),
        "create: an id of another edge": Req(c, {**good, "id": "zz-123456789abc"}, admin),
        "create: unknown image": Req(c, {"spec": {**EDGE_SPEC, "image": {"base": "nosuchlayer:1"}}}, admin,
                                     expect=(404, "layer_not_found", None, "`dsec image ls`")),
        "create: more cpu than the edge has": Req(c, {"spec": {**EDGE_SPEC, "resources": {"cpu": 256}}}, admin,
                                                  expect=(422, "exceeds_capacity")),
        "create: no content type": Req(c, {"spec": {"image": {}}}, admin, ctype=None, served="fastapi"),
        "create: text/plain": Req(c, {"spec": {"image": {}}}, admin, ctype="text/plain", served="fastapi"),
        "create: trailing slash": Req(c + "/", {"spec": {"image": {}}}, admin, served="fastapi"),
        "create: over 16 MiB, declared": Req(c, Declared(JSON_BODY_LIMIT + 1), admin, served="limit",
                                             expect=(413, "too_large")),
        "create: over 16 MiB, chunked": Req(c, chunked(JSON_BODY_LIMIT), admin, expect=(413, "too_large")),
        "exec: no authorization": Req(x, true, expect=(401, "auth_error")),
        "exec: basic auth": Req(x, true, [("authorization", "Basic eDp5")]),
        "exec: malformed token": Req(x, true, [("authorization", "Bearer garbage")]),
        "exec: forged token": Req(x, true, forged),
        "exec: expired token": Req(x, true, expired, expect=(401, "auth_error", None, "expired")),
        "exec: another sandbox's token": Req(x, true, other, expect=(403, "forbidden")),
        "exec: two authorization headers, the first another sandbox's": Req(
            x, true, [*other, *own], expect=(403, "forbidden")),
        "exec: unknown sandbox": Req("/v1/sandboxes/ef-000000000000/exec", true, admin,
                                     expect=(404, "sandbox_not_found")),
        "exec: malformed JSON": Req(x, b'{"cmd": ', own, served="fastapi"),
        "exec: malformed JSON, another sandbox's token": Req(x, b"{", other, served="fastapi",
                                                             expect=(422, "invalid_spec")),
        "exec: a lone surrogate": Req(x, b'{"cmd": ["echo", "\\ud800"]}', own, served="fastapi",
                                      expect=(422, "invalid_spec", "cmd")),
        "exec: wrong shape": Req(x, {"cmd": 5}, own, expect=(422, "invalid_spec", "cmd")),
        "exec: wrong shape, another sandbox's token": Req(x, {"cmd": 5}, other, expect=(403, "forbidden")),
        "exec: no command": Req(x, {}, own),
        "exec: zero timeout": Req(x, {"cmd": "true", "timeout": 0}, own),
        "exec: bad stdin": Req(x, {"cmd": "true", "stdin_b64": "!!"}, own),
        "exec: relative cwd": Req(x, {"cmd": "true", "cwd": "relative"}, own),
        "exec: missing binary": Req(x, {"cmd": ["/no/such/binary"]}, own, expect=(400, "exec_error")),
        "exec: no content type": Req(x, true, own, ctype=None, served="fastapi"),
        "exec: empty sandbox id": Req("/v1/sandboxes//exec", true, admin, served="fastapi"),
        "exec: trailing slash": Req(x + "/", true, own, served="fastapi"),
        "exec: over 16 MiB, declared": Req(x, Declared(JSON_BODY_LIMIT + 1), own, served="limit"),
        "exec: over 16 MiB, chunked": Req(x, chunked(JSON_BODY_LIMIT), own, expect=(413, "too_large")),
    }


@pytest.mark.root
@pytest.mark.parametrize("case", list(edge_cases("", "ef-x")))
def test_edge_refuses_bad_input_alike(edge: EdgeThread, api: httpx.Client, spy: Spy, sandbox: str,
                                      case: str) -> None:
    req = edge_cases(edge.admin_token(), sandbox)[case]
    before = len(spy.passed)
    with httpx.Client(base_url=edge.url, timeout=60) as c:
        fast = send_sync(c, req, req.path)
        slow = send_sync(c, req, with_query(req.path))
    made = [x["id"] for x in api.get("/v1/sandboxes").json() if x["id"] != sandbox]
    for sid in made:  # so one failure does not fail the next cases too
        api.delete(f"/v1/sandboxes/{sid}")
    problems = differences(fast, slow) + check_served(spy, req, before) + unexpected(fast, req)
    assert not problems, problems
    assert not 200 <= fast.status_code < 300 and fast.status_code < 500, fast.text
    if fast.status_code == 401:
        assert fast.headers["www-authenticate"] == 'Bearer realm="dsec-edge"'
    assert "content-length" in fast.headers
    assert not made, f"sandboxes made: {made}"


@pytest.mark.root
def test_edge_refuses_a_create_when_full_alike(edge: EdgeThread, api: httpx.Client, spy: Spy, sandbox: str) -> None:
    made = [api.post("/v1/sandboxes", json={"spec": EDGE_SPEC}) for _ in range(2)]  # 3 of max_sandboxes=3
    try:
        assert all(r.status_code == 201 for r in made), [r.text for r in made]
        req = Req("/v1/sandboxes", {"spec": EDGE_SPEC}, [("authorization", f"Bearer {edge.admin_token()}")])
        before = len(spy.passed)
        fast = api.post(req.path, **req.kwargs())
        slow = api.post(with_query(req.path), **req.kwargs())
        assert fast.status_code == 429 and error(fast)["code"] == "backpressure", fast.text
        assert fast.headers["retry-after"] == "1"
        problems = differences(fast, slow) + check_served(spy, req, before)
        assert not problems, problems
    finally:
        for r in made:
            if r.status_code == 201:
                api.delete(f"/v1/sandboxes/{r.json()['id']}")


@pytest.mark.root
def test_edge_creates_and_execs_on_both_paths(edge: EdgeThread, api: httpx.Client, spy: Spy) -> None:
    before = len(spy.passed)
    fast = api.post("/v1/sandboxes", json={"spec": EDGE_SPEC, "labels": {"via": "fast"}})
    slow = api.post(f"/v1/sandboxes?{VIA}", json={"spec": EDGE_SPEC, "labels": {"via": "fastapi"}})
    made = [r.json()["id"] for r in (fast, slow) if r.status_code == 201]
    try:
        assert (fast.status_code, slow.status_code) == (201, 201), (fast.text, slow.text)
        assert spy.passed[before:] == [f"/v1/sandboxes?{VIA}"]
        a, b = fast.json(), slow.json()
        assert set(a) == set(b) and a["state"] == b["state"] == "running"
        assert (a["labels"], b["labels"]) == ({"via": "fast"}, {"via": "fastapi"})
        for info in (a, b):
            sb = {"authorization": f"Bearer {info['token']}"}
            before = len(spy.passed)
            outs = [api.post(f"/v1/sandboxes/{info['id']}/exec{q}", json={"cmd": "true"}, headers=sb)
                    for q in ("", f"?{VIA}")]
            assert spy.passed[before:] == [f"/v1/sandboxes/{info['id']}/exec?{VIA}"]
            for r in outs:
                assert r.status_code == 200 and r.json()["exit_code"] == 0, r.text
                assert r.headers["content-type"] == "application/json"
            assert set(outs[0].json()) == set(outs[1].json())
            echo = api.post(f"/v1/sandboxes/{info['id']}/exec", json={"cmd": ["echo", "hi"]}, headers=sb)
            assert echo.json()["stdout_b64"] == "aGkK"
    finally:
        for sid in made:
            assert api.delete(f"/v1/sandboxes/{sid}").status_code == 204
    live = {x["id"] for x in api.get("/v1/sandboxes").json()}
    assert not live & set(made), live


def cancelled(api: httpx.Client) -> float:
    m = re.search(r'^dsec_edge_execs_total\{kind="exec",outcome="cancelled"\} (\S+)$', api.get("/metrics").text, re.M)
    return float(m.group(1)) if m else 0.0


@pytest.mark.root
@pytest.mark.parametrize("query", ["", f"?{VIA}"], ids=["fast", "fastapi"])
def test_exec_client_gone_kills_the_command(edge: EdgeThread, api: httpx.Client, spy: Spy, query: str) -> None:
    sid = api.post("/v1/sandboxes", json={"spec": EDGE_SPEC}).json()["id"]
    try:
        rt = edge.service.backends.get("container")
        n0, before = cancelled(api), len(spy.passed)
        t0 = time.monotonic()
        with edge.client(timeout=1.0) as c, pytest.raises(httpx.ReadTimeout):
            c.post(f"/v1/sandboxes/{sid}/exec{query}", json={"cmd": "sleep 30"})
        assert spy.passed[before:] == ([f"/v1/sandboxes/{sid}/exec{query}"] if query else [])
        # the client went away: the command's process tree is killed, the sandbox lives
        assert wait_until(lambda: len(rt.cgroups.pids(sid)) == 1, timeout=5), rt.cgroups.pids(sid)
        assert time.monotonic() - t0 < 10
        assert wait_until(lambda: cancelled(api) == n0 + 1, timeout=5), (n0, cancelled(api))
        ended = [e for e in api.get(f"/v1/sandboxes/{sid}/events").json() if e["event"] == "exec_ended"]
        assert len(ended) == 1 and ended[0]["cancelled"] is True and ended[0]["signal"] == 9, ended
        assert not pid_alive(ended[0]["pid"])  # the sleep itself, not only its cgroup entry
        r = api.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": ["echo", "alive"]})
        assert r.json()["stdout_b64"] == "YWxpdmUK"
    finally:
        api.delete(f"/v1/sandboxes/{sid}")
