"""The edge's function-call routes: ``POST /v1/fncall`` and ``POST /v1/fncall/batch``.

A thin layer over the edge's ``fncall`` backend (:class:`dsec.backends.fncall.backend.
FnCallBackend`): no state here. Both are hot routes, answered below FastAPI's
machinery (:mod:`dsec.http.fastroute`) like create and exec; the FastAPI routes of the same
paths answer what those pass on and document the API.

Who may call: an ``edge-admin`` token, or a token with scope ``fncall`` (minted with the
cluster key like any data-path token; ``sid`` unused). A sandbox token may not.

Answers: 200 with the call's outcome, a value or a typed failure of the call itself
(``{"ok": false, "error": {"code": "fncall_timeout", ...}}``): the request was served,
the function failed. Bad requests are HTTP errors as everywhere (422 ``invalid_spec``,
413, 429 ``backpressure`` with Retry-After, 400 ``unsupported`` when this edge runs no
fncall backend). docs/FNCALL.md, "HTTP".
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Coroutine
from typing import Annotated, Any, Protocol

from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from dsec.backends.base import UNSET, _Unset
from dsec.edge.disconnect import unless_disconnected
from dsec.errors import Forbidden, Unsupported
from dsec.http.auth import Claims
from dsec.http.fastroute import Answer, FastRequest, Handler
from dsec.spec import ImageRef
from dsec.spec.api import FnCallLease, FnCallLeaseRequest
from dsec.spec.fncall import FnCall, outcome_to_wire

MAX_BATCH = 10_000
SCOPES = ("edge-admin", "fncall")


class FnCallItem(BaseModel):
    """One call: the source and its JSON arguments (docs/FNCALL.md, "Contract")."""

    model_config = ConfigDict(extra="forbid")

    source: str
    args: list[Any] = Field(default_factory=list)
    kwargs: dict[str, Any] = Field(default_factory=dict)
    entry: str | None = None


class FnCallLimits(BaseModel):
    model_config = ConfigDict(extra="forbid")

    image: ImageRef | Annotated[str, Field(min_length=1, max_length=300)]
    """An image reference (base, workspace, toolkits) or a base layer ``NAME[:TAG]``."""
    timeout: float | None = None
    """Seconds; left out: the edge's default; ``null``: none (where the edge allows it)."""
    memory: int | None = None
    output_cap: int | None = None

    def timeout_arg(self) -> float | _Unset | None:
        return self.timeout if "timeout" in self.model_fields_set else UNSET


class FnCallRequest(FnCallLimits, FnCallItem):
    """``POST /v1/fncall``."""


class FnCallBatchRequest(FnCallLimits):
    """``POST /v1/fncall/batch``: calls on one image, run at once; one outcome per call, in order."""

    calls: Annotated[list[FnCallItem], Field(max_length=MAX_BATCH)]


class _Auth(Protocol):
    def claims_of(self, header: str | None) -> Claims: ...


class _Service(Protocol):
    edge_id: str
    url: str
    config: Any
    backends: Any


def _dumps(value: Any) -> bytes:
    try:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()
    except UnicodeEncodeError:
        # A call's value may hold lone surrogates ("\ud800": valid JSON escapes, which Python
        # reads into a str no UTF-8 can hold): escaped, the answer stays JSON and a 200.
        return json.dumps(value, separators=(",", ":"), ensure_ascii=True).encode()


def _allowed(claims: Claims) -> Claims:
    if claims.scope not in SCOPES:
        raise Forbidden("function calls need an edge-admin or fncall token (a sandbox token reaches only "
                        "its sandbox)")
    return claims


async def _caller(request: Request) -> Claims:
    # async on purpose, as the app's own dependencies: a sync one costs a thread hop
    return _allowed(request.app.state.auth.claims_of(request.headers.get("authorization")))


# Module level: with postponed annotations FastAPI resolves these names in the module's globals.
Caller = Annotated[Claims, Depends(_caller)]


def install(app: FastAPI, svc: _Service, auth: _Auth) -> dict[tuple[str, str], Handler]:
    """Add the FastAPI routes to ``app``; return the fast routes for its ``FastRoutes``."""

    def backend() -> Any:
        b = svc.backends.by_kind.get("fncall")
        if b is None:
            raise Unsupported(f"edge {svc.edge_id} does not run the fncall backend (it runs: "
                              f"{', '.join(svc.backends.by_kind) or 'none'})", operation="fncall", backend="fncall",
                              edge_id=svc.edge_id)
        return b

    async def one(body: FnCallRequest) -> bytes:
        from dsec.spec.fncall import FnCallFailed

        try:
            result = await backend().call(body.image, body.source, body.args, body.kwargs, entry=body.entry,
                                          timeout=body.timeout_arg(), memory=body.memory,
                                          output_cap=body.output_cap)
        except FnCallFailed as exc:
            return _dumps(outcome_to_wire(exc))
        return _dumps(outcome_to_wire(result))

    async def batch(body: FnCallBatchRequest) -> bytes:
        calls = [FnCall(c.source, c.args, c.kwargs, c.entry) for c in body.calls]
        outs = await backend().call_many(body.image, calls, timeout=body.timeout_arg(), memory=body.memory,
                                         output_cap=body.output_cap)
        return _dumps({"results": [outcome_to_wire(o) for o in outs]})

    async def unless_gone(receive: Callable[[], Awaitable[Any]], work: Coroutine[Any, Any, bytes]) -> bytes | None:
        # the edge's one way to drop work nobody waits for (kills the call, as exec's tree)
        return await unless_disconnected(receive, work)

    def header(req: FastRequest) -> str | None:
        raw = req.headers.get(b"authorization")
        return None if raw is None else raw.decode("latin-1")

    async def fast_one(req: FastRequest) -> Answer:
        _allowed(auth.claims_of(header(req)))
        out = await unless_gone(req.receive, one(req.model(FnCallRequest)))
        return Answer(499, b"") if out is None else Answer(200, out)

    async def fast_batch(req: FastRequest) -> Answer:
        _allowed(auth.claims_of(header(req)))
        out = await unless_gone(req.receive, batch(req.model(FnCallBatchRequest)))
        return Answer(499, b"") if out is None else Answer(200, out)

    @app.post("/v1/fncall/lease", response_model=FnCallLease, tags=["fncall"])
    async def fncall_lease(body: FnCallLeaseRequest, claims: Caller) -> FnCallLease:
        """This edge, for a client pointed at it directly (the control plane answers the
        same request by choosing an edge): its URL and a fncall token."""
        backend()  # Unsupported unless this edge runs function calls
        from dsec.http.auth import mint

        tok, exp = mint(svc.config.cluster_key, sandbox_id=f"fncall:{claims.project}", project=claims.project,
                        scope="fncall")
        return FnCallLease(edge_id=svc.edge_id, edge_url=svc.url, token=tok, expires_at=exp)

    @app.post("/v1/fncall", tags=["fncall"])
    async def fncall(body: FnCallRequest, request: Request, _c: Caller) -> Response:
        """Run one function call on a warm worker of ``image``; the outcome (value or typed failure)."""
        out = await unless_gone(request.receive, one(body))
        return Response(status_code=499) if out is None else Response(out, media_type="application/json")

    @app.post("/v1/fncall/batch", tags=["fncall"])
    async def fncall_batch(body: FnCallBatchRequest, request: Request, _c: Caller) -> Response:
        """Several calls on one image, run at once; ``{"results": [outcome, ...]}`` in order."""
        out = await unless_gone(request.receive, batch(body))
        return Response(status_code=499) if out is None else Response(out, media_type="application/json")

    return {("POST", "/v1/fncall"): fast_one, ("POST", "/v1/fncall/batch"): fast_batch}
