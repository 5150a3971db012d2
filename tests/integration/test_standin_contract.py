"""The stand-in edges are tied to the real one: every route they answer is a route of the
real edge (same method, same path shape), and what they answer parses as the real API's
models. A route renamed or removed on the edge fails here, not in a bench that measures a
stand-in nobody can reach any more."""

from __future__ import annotations

import re
import secrets
from pathlib import Path
from typing import Any

import pytest

from conftest import edge_config

pytestmark = pytest.mark.root
KEY = secrets.token_bytes(32)


def _shape(path: str) -> str:
    return re.sub(r"\{[^}]*\}", "{}", path)


def _routes(app: Any) -> set[tuple[str, str]]:
    out = {(m, _shape(r.path)) for r in app.routes for m in (getattr(r, "methods", None) or ())}
    for mw in getattr(app, "user_middleware", ()):
        out |= {(m, _shape(p)) for (m, p) in (mw.kwargs.get("routes") or {})}
    return out


@pytest.fixture(scope="module")
def real_routes(dsec_base: Path) -> set[tuple[str, str]]:
    from dsec.edge.app import create_app

    return _routes(create_app(edge_config(dsec_base, "contract", "ct", KEY)))


def test_the_bench_stand_in_answers_only_routes_of_the_real_edge(real_routes: set[tuple[str, str]]) -> None:
    from dsec.bench.standin import ROUTES

    assert ("POST", "/v1/sandboxes") in real_routes  # the probe reads the real table
    assert ROUTES - real_routes == set()


def test_the_test_stub_edge_answers_only_routes_of_the_real_edge(real_routes: set[tuple[str, str]]) -> None:
    from test_control_support import StubEdge

    stub = _routes(StubEdge("st", KEY).app()) - {("HEAD", p) for _, p in real_routes} - {("GET", "/openapi.json"),
                                                                                        ("GET", "/docs"), ("HEAD", "/docs"),
                                                                                        ("GET", "/redoc"), ("HEAD", "/redoc"),
                                                                                        ("GET", "/docs/oauth2-redirect"),
                                                                                        ("HEAD", "/docs/oauth2-redirect"),
                                                                                        ("HEAD", "/openapi.json")}
    generic = {r for r in stub if r[1] == "/v1/{}"}  # the stub's one handler for the group operations
    assert stub - generic - real_routes == set()
    assert generic <= {("POST", "/v1/{}")} and any(m == "POST" and re.fullmatch(r"/v1/[a-z_]+", p)
                                                   for m, p in real_routes)


def test_what_the_bench_stand_in_answers_parses_as_the_real_api() -> None:
    import asyncio
    import json

    from dsec.bench.standin import StandInEdge
    from dsec.http import auth
    from dsec.spec.api import EdgeHealth, SandboxInfo

    async def run() -> None:
        edge = StandInEdge("si", KEY, layers=[])
        tok, _ = auth.mint(KEY, sandbox_id="edge:si", project="", ttl_s=60, scope="edge-admin")
        hdr = {b"authorization": f"Bearer {tok}".encode()}
        body = json.dumps({"spec": {"image": {"base": "busybox:test"}}, "request_id": "contract-1"}).encode()
        status, out = await edge.handle("POST", "/v1/sandboxes", hdr, body)
        assert status == 201, out
        SandboxInfo.model_validate_json(out)
        status, out = await edge.handle("GET", "/v1/sandboxes", hdr, b"")
        assert status == 200 and [SandboxInfo.model_validate(x) for x in json.loads(out)]
        status, out = await edge.handle("GET", "/v1/health", hdr, b"")
        assert status == 200
        EdgeHealth.model_validate_json(out)

    asyncio.run(run())
