"""The control plane's HTTP API (docs/API.md "Control plane", docs/CONTROL.md).

Thin: every route authenticates, validates and hands over to service.py.
Errors leave as ``{"error": exc.to_wire()}`` with the status of
``dsec.spec.api.STATUS_BY_CODE``; a 429 carries ``Retry-After``; a malformed
request is a 422 ``invalid_spec`` naming the offending field. Bad input never
produces a 5xx.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import Body, Depends, FastAPI, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, ConfigDict
from starlette.exceptions import HTTPException as StarletteHTTPException

from dsec.compat.sandboxfusion import routes as sandboxfusion_routes
from dsec.control import dashboard, iam, validate
from dsec.control import edges as edges_mod
from dsec.control.catalog import RegistryCatalog
from dsec.control.config import ControlConfig
from dsec.control.creating import check_create as _check_create
from dsec.control.creating import create_info
from dsec.control.iam import Principal
from dsec.control.membership import router as membership_router
from dsec.control.sandboxes import parse_label_filters
from dsec.control.service import Control
from dsec.errors import AuthError, DsecError, Forbidden, InvalidSpec, encode_error
from dsec.http import ENDED_HEADER
from dsec.http.fastroute import Answer, FastRequest, FastRoutes, answer_of
from dsec.http.limits import BodyLimit
from dsec.spec import SandboxState
from dsec.spec.api import (
    BatchResult,
    CreateBatch,
    CreateSandbox,
    CreateToken,
    DeleteResult,
    DrainEdge,
    EdgeHealth,
    EdgeInfo,
    FnCallLease,
    FnCallLeaseRequest,
    ForkRequest,
    GroupResult,
    LayerInfo,
    PauseReport,
    ProjectInfo,
    SandboxInfo,
    SnapshotRequest,
    TokenInfo,
    Whoami,
)
from dsec.spec.control import (
    CreateProjectBody,
    CreateTaskBody,
    SchedEvent,
    SchedStatus,
    SetStageBody,
    StorageInfo,
    StoredSnapshot,
    TaskDetail,
    UpdateProjectBody,
)

log = logging.getLogger("dsec.control.app")

_bearer = HTTPBearer(auto_error=False, description="A project API token (dsk_...) or, for edges, an edge-admin dsec1 token")
Bearer = Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]


class ErrorBody(BaseModel):
    model_config = ConfigDict(extra="allow")
    code: str
    message: str


class ErrorEnvelope(BaseModel):
    error: ErrorBody


_ERRORS: dict[int | str, dict[str, Any]] = {
    s: {"model": ErrorEnvelope} for s in (401, 403, 404, 409, 422, 429)
}


def error_response(exc: DsecError) -> JSONResponse:
    status, body, headers = encode_error(exc)
    return JSONResponse(body, status_code=status, headers=headers)


def _field_of(loc: tuple[Any, ...] | list[Any]) -> str:
    parts = [str(p) for p in loc]
    if parts and parts[0] in ("body", "query", "path", "header"):
        parts = parts[1:]
    return ".".join(parts) or "body"


def validation_response(errors: Sequence[Any]) -> JSONResponse:
    details = [
        {"field": _field_of(e.get("loc", ())), "message": str(e.get("msg", "")), "type": str(e.get("type", ""))}
        for e in errors
    ]
    first = details[0] if details else {"field": "body", "message": "invalid request"}
    return error_response(InvalidSpec(f"{first['field']}: {first['message']}", field=first["field"], errors=details[:20]))


# -------------------------------------------------------------- auth ----


def _ctl(request: Request) -> Control:
    ctl: Control = request.app.state.ctl
    return ctl


async def ctl_of(request: Request) -> Control:
    # async on purpose: FastAPI runs a plain-def dependency in a worker thread, per request
    return _ctl(request)


Ctl = Annotated[Control, Depends(ctl_of)]


def _token(cred: HTTPAuthorizationCredentials | None) -> str:
    return _required(None if cred is None else cred.credentials)


def _required(token: str | None) -> str:
    if not token:
        raise AuthError("missing credentials: send 'Authorization: Bearer dsk_...'")
    return token


async def caller(request: Request, cred: Bearer) -> Principal:
    return await _ctl(request).auth.project(_token(cred))


async def edge_admin(request: Request, cred: Bearer) -> str:
    return _ctl(request).auth.edge_admin(_token(cred)).scope


async def operator(request: Request, cred: Bearer) -> str:
    """The root project's token, or an edge-admin token."""
    tok = _token(cred)
    ctl = _ctl(request)
    if tok.startswith("dsec1."):
        ctl.auth.edge_admin(tok)
        return "edge-admin"
    who = await ctl.auth.project(tok)
    if not who.is_root:
        raise Forbidden("edges are managed with the root project's token or an edge-admin token")
    return who.project


Who = Annotated[Principal, Depends(caller)]


EdgeAdmin = Annotated[str, Depends(edge_admin)]


Operator = Annotated[str, Depends(operator)]


_SPEC_EXAMPLE = {"image": {"base": "busybox:latest"}, "resources": {"cpu": 0.5, "memory": 268435456}}
CreateBody = Annotated[CreateSandbox, Body(openapi_examples={
    "minimal": {"summary": "one sandbox", "value": {"spec": _SPEC_EXAMPLE}},
    "labelled": {"summary": "in a task, with labels and an idempotency key", "value": {
        "spec": _SPEC_EXAMPLE, "labels": {"job": "demo"}, "task": "demo", "request_id": "demo-0",
        "lifecycle": {"ttl_s": 900, "idle_timeout_s": 300}}},
})]
BatchBody = Annotated[CreateBatch, Body(openapi_examples={
    "four": {"summary": "four sandboxes of one spec", "value": {"spec": _SPEC_EXAMPLE, "count": 4, "task": "demo"}},
})]


async def _create(ctl: Control, who: Principal, body: CreateSandbox) -> str:
    # serialized here: FastAPI would validate the answer against its model once more
    return (await create_info(ctl, who, body)).model_dump_json()


def _check_health(body: EdgeHealth) -> None:
    validate.finite(body.model_dump(mode="python"))
    validate.text(body.url, "url", max_len=512)


async def _close_compat(app: FastAPI) -> None:
    service = getattr(app.state, "sandboxfusion", None)
    if service is not None:
        await service.aclose()
    front = getattr(app.state, "e2b", None)
    if front is not None:
        app.state.e2b = None
        await front.aclose()


def create_app(config: ControlConfig, *, control: Control | None = None) -> FastAPI:
    """The ASGI app. Without ``control`` its lifespan starts (and stops) one from ``config``."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if control is not None:
            app.state.ctl = control
            try:
                yield
            finally:
                await _close_compat(app)
            return
        ctl = Control(config)
        await ctl.start()
        app.state.ctl = ctl
        try:
            yield
        finally:
            await _close_compat(app)
            await ctl.stop()

    app = FastAPI(
        title="DSec control plane",
        version="1",
        description="Projects, tokens, tasks, sandboxes and edges. See docs/API.md and docs/CONTROL.md.",
        lifespan=lifespan,
        responses=_ERRORS,
    )
    # Creates, below FastAPI's machinery (dsec/http/fastroute.py): the FastAPI route of the same
    # name answers what this passes on, and documents the API.
    async def fast_create(req: FastRequest) -> Answer:
        ctl: Control = app.state.ctl
        who = await ctl.auth.project(_required(req.bearer()))
        return Answer(201, (await _create(ctl, who, req.model(CreateSandbox))).encode())

    def fast_error(exc: Exception) -> Answer | None:
        # the exception handlers below, for what a fast route raises; the rest goes to _bug (500)
        if isinstance(exc, DsecError):
            return answer_of(error_response(exc))
        if isinstance(exc, RequestValidationError):
            return answer_of(validation_response(exc.errors()))
        return None

    app.add_middleware(FastRoutes, errors=fast_error, routes={("POST", "/v1/sandboxes"): fast_create})
    # SandboxFusion's HTTP API under /sandboxfusion (dsec/compat/sandboxfusion, docs/COMPAT.md)
    app.state.sandboxfusion = sandboxfusion_routes.install(app, config.sandboxfusion)
    app.add_middleware(BodyLimit)  # JSON bodies stop at 16 MiB (dsec/http/limits.py), fast routes too
    if config.e2b.enabled:  # outermost: E2B's uploads are not JSON (dsec/compat/e2b, docs/COMPAT.md)
        from dsec.compat.e2b.middleware import E2BMiddleware

        app.add_middleware(E2BMiddleware, config=config.e2b)
    app.include_router(membership_router(operator))  # /v1/edges/join, tokens, GET/DELETE /v1/edges/{id}

    # ------------------------------------------------------------ errors ----

    @app.exception_handler(DsecError)
    async def _dsec_error(request: Request, exc: DsecError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_response(exc.errors())

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if exc.status_code == 404 else "dsec_error"
        return JSONResponse(
            {"error": {"code": code, "message": str(exc.detail), "status": exc.status_code}},
            status_code=exc.status_code,
            headers=getattr(exc, "headers", None),
        )

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return JSONResponse(
            {"error": {"code": "dsec_error", "message": f"internal error: {type(exc).__name__}"}}, status_code=500
        )

    # ------------------------------------------------------------ health ----

    @app.get("/healthz", tags=["meta"])
    async def healthz(ctl: Ctl) -> dict[str, Any]:
        return await ctl.healthz()

    @app.get("/v1/whoami", tags=["meta"])
    async def whoami(ctl: Ctl, who: Who) -> Whoami:
        names = await ctl.db.read(lambda s: [p.name for p in iam.list_projects(s, who)])
        return Whoami(project=who.project, token_id=who.token_id, projects=names)

    # --------------------------------------------------------- sandboxes ----

    @app.post("/v1/sandboxes", status_code=201, response_model=SandboxInfo, tags=["sandboxes"])
    async def create_sandbox(ctl: Ctl, who: Who, body: CreateBody) -> Response:
        return Response(await _create(ctl, who, body), status_code=201, media_type="application/json")

    from dsec.control.leases import router as leases_router  # here: it imports the edge's slot keys

    app.include_router(leases_router(caller, edge_admin))  # /v1/leases, lease reports (docs/CONTROL.md)

    @app.post("/v1/fncall/lease", response_model=FnCallLease, tags=["fncall"])
    async def fncall_lease(ctl: Ctl, who: Who, body: FnCallLeaseRequest) -> FnCallLease:
        """An edge that runs function calls and a token for it (the SDK's ``fncall`` asks once
        and then calls the edge directly; docs/FNCALL.md)."""
        return await ctl.sandboxes.fncall_lease(who, body.image)

    @app.post("/v1/sandboxes/batch", tags=["sandboxes"])
    async def create_batch(ctl: Ctl, who: Who, body: BatchBody) -> BatchResult:
        _check_create(body)
        return await ctl.sandboxes.create_batch(who, body)

    @app.get("/v1/sandboxes", tags=["sandboxes"])
    async def list_sandboxes(
        ctl: Ctl,
        who: Who,
        label: Annotated[list[str], Query(description="k=v (equal) or k (present); repeatable")] = [],  # noqa: B006
        task: Annotated[str | None, Query(max_length=63)] = None,
        state: Annotated[list[SandboxState], Query(description="default: every state but stopped")] = [],  # noqa: B006
        limit: Annotated[int, Query(ge=1, le=100_000)] = 10_000,
    ) -> list[SandboxInfo]:
        return await ctl.sandboxes.list(
            who, task=validate.name_filter(task, "task"), states=[s.value for s in state], labels=parse_label_filters(label), limit=limit
        )

    @app.get("/v1/sandboxes/{sandbox_id}", tags=["sandboxes"])
    async def get_sandbox(ctl: Ctl, who: Who, sandbox_id: str) -> SandboxInfo:
        return await ctl.sandboxes.get(who, validate.sandbox_id(sandbox_id))

    @app.delete("/v1/sandboxes/{sandbox_id}", status_code=204, response_class=Response, tags=["sandboxes"])
    async def delete_sandbox(ctl: Ctl, who: Who, sandbox_id: str) -> Response:
        """Stop and destroy the sandbox (idempotent: 204 again for one that had ended, with
        ``Dsec-Ended`` saying how it ended, e.g. ``stopped (expired)``); 404 for an unknown id."""
        ended = await ctl.sandboxes.delete(who, validate.sandbox_id(sandbox_id))
        if ended is not None:
            return Response(status_code=204, headers={ENDED_HEADER: ended.encode("ascii", "replace").decode()})
        return Response(status_code=204)

    @app.delete("/v1/sandboxes", tags=["sandboxes"])
    async def delete_sandboxes(
        ctl: Ctl,
        who: Who,
        label: Annotated[list[str], Query()] = [],  # noqa: B006
        task: Annotated[str | None, Query(max_length=63)] = None,
        state: Annotated[list[SandboxState], Query()] = [],  # noqa: B006
        all: Annotated[bool, Query(description="every sandbox of the caller's projects")] = False,
    ) -> DeleteResult:
        n = await ctl.sandboxes.delete_where(
            who, task=validate.name_filter(task, "task"), labels=parse_label_filters(label), states=[s.value for s in state], everything=all
        )
        return DeleteResult(deleted=n)

    # ------------------------------------------- pause, snapshots, forks ----

    @app.post("/v1/sandboxes/{sandbox_id}/pause", tags=["sandboxes"])
    async def pause_sandbox(ctl: Ctl, who: Who, sandbox_id: str) -> PauseReport:
        """Freeze the sandbox and push its memory to swap (409 sandbox_state if paused already)."""
        return await ctl.ops.pause(who, validate.sandbox_id(sandbox_id))

    @app.post("/v1/sandboxes/{sandbox_id}/resume", tags=["sandboxes"])
    async def resume_sandbox(ctl: Ctl, who: Who, sandbox_id: str) -> SandboxInfo:
        return await ctl.ops.resume(who, validate.sandbox_id(sandbox_id))

    async def _group(ctl: Control, who: Principal, op: str, task: str | None, label: list[str],
                     ids: list[str]) -> GroupResult:
        for i in ids:
            if not validate.is_sandbox_id(i):
                raise InvalidSpec(f"id {i[:70]!r} is not a sandbox id", field="id")
        return await ctl.ops.group(who, op, task=validate.name_filter(task, "task"),
                                   labels=parse_label_filters(label), ids=ids)

    @app.post("/v1/pause", tags=["sandboxes"])
    async def pause_group(
        ctl: Ctl, who: Who,
        task: Annotated[str | None, Query(max_length=63)] = None,
        label: Annotated[list[str], Query(description="k=v (equal) or k (present); repeatable")] = [],  # noqa: B006
        id: Annotated[list[str], Query(description="sandbox ids; repeatable")] = [],  # noqa: B006
    ) -> GroupResult:
        """Pause every running sandbox of the caller's selected by task / labels / ids, one call per
        edge, all edges at once. Already paused ones are ``skipped``; failures are per sandbox."""
        return await _group(ctl, who, "pause", task, label, id)

    @app.post("/v1/resume", tags=["sandboxes"])
    async def resume_group(
        ctl: Ctl, who: Who,
        task: Annotated[str | None, Query(max_length=63)] = None,
        label: Annotated[list[str], Query()] = [],  # noqa: B006
        id: Annotated[list[str], Query()] = [],  # noqa: B006
    ) -> GroupResult:
        return await _group(ctl, who, "resume", task, label, id)

    @app.post("/v1/sandboxes/{sandbox_id}/snapshot", status_code=201, tags=["snapshots"])
    async def snapshot_sandbox(
        ctl: Ctl, who: Who, sandbox_id: str, body: SnapshotRequest | None = None
    ) -> StoredSnapshot:
        """Pack the sandbox's disk changes into a snapshot layer owned by its project. Counts
        against the project's storage quota (403 quota_exceeded, nothing kept, when over)."""
        req = body or SnapshotRequest()
        for x in req.exclude:
            validate.text(x, "exclude", max_len=4096)
        return await ctl.ops.snapshot(who, validate.sandbox_id(sandbox_id), req)

    @app.post("/v1/sandboxes/{sandbox_id}/fork", status_code=201, tags=["snapshots"])
    async def fork_sandbox(ctl: Ctl, who: Who, sandbox_id: str, body: ForkRequest) -> list[SandboxInfo]:
        """``n`` children with the parent's disk now, charged to the parent's project and task
        like creates (403 quota_exceeded before anything is made), all or nothing."""
        validate.finite(body.model_dump(mode="python"))
        for x in body.exclude:
            validate.text(x, "exclude", max_len=4096)
        return await ctl.ops.fork(who, validate.sandbox_id(sandbox_id), body)

    @app.post("/v1/sandboxes/{sandbox_id}/stage", tags=["sandboxes"])
    async def set_sandbox_stage(ctl: Ctl, who: Who, sandbox_id: str, body: SetStageBody) -> SandboxInfo:
        """Switch one sandbox to one of its declared stages (the edge applies it)."""
        return await ctl.ops.set_stage(who, validate.sandbox_id(sandbox_id), body.stage)

    @app.get("/v1/snapshots", tags=["snapshots"])
    async def list_snapshots(ctl: Ctl, who: Who) -> list[StoredSnapshot]:
        """Snapshots of the caller's project and its descendants."""
        return await ctl.ops.snapshots(who)

    @app.delete("/v1/snapshots/{ref:path}", status_code=204, response_class=Response, tags=["snapshots"])
    async def delete_snapshot(ctl: Ctl, who: Who, ref: str) -> Response:
        """Remove a snapshot (its ref or digest); 409 conflict while a sandbox or another snapshot uses it."""
        validate.text(ref, "ref", max_len=300)
        await ctl.ops.delete_snapshot(who, ref)
        return Response(status_code=204)

    # ------------------------------------------------------------- tasks ----

    @app.post("/v1/tasks", status_code=201, tags=["tasks"])
    async def create_task(ctl: Ctl, who: Who, body: CreateTaskBody) -> TaskDetail:
        """Make a task (or set its quota and, when given, its stages). Sandboxes of the task whose
        spec declares no stages inherit the task's, starting in its current stage."""
        if body.stages is not None:
            validate.finite(body.model_dump(mode="python"))
            validate.text(repr(body.model_dump(mode="json")), "stages", max_len=1 << 20)
        if body.min is not None:
            validate.finite(body.min.model_dump(mode="python"))
        return await ctl.db.write(lambda s: ctl.sandboxes.scheduler.set_task_txn(s, who, body))

    # -------------------------------------------------------- scheduling ----

    @app.get("/v1/sched", tags=["scheduling"])
    async def sched_status(ctl: Ctl, who: Who) -> SchedStatus:
        """The scheduler's picture now: the primary pool's utilisation against the burst threshold,
        both pools, the capacity held back for tasks' minimums, the caller's preempted sandboxes."""
        return await ctl.sandboxes.scheduler.status(who)

    @app.get("/v1/sched/events", tags=["scheduling"])
    async def sched_events(
        ctl: Ctl, who: Who, task: Annotated[str | None, Query(max_length=63)] = None,
        since: Annotated[float | None, Query(ge=0, le=1e12)] = None,
        limit: Annotated[int, Query(ge=1, le=10_000)] = 100,
    ) -> list[SchedEvent]:
        """What the scheduler did to the caller's sandboxes (preempted: paused or destroyed, and
        by which priority; resumed), oldest first, after ``since``; the root project's token also
        sees the burst pool's events."""
        return await ctl.sandboxes.scheduler.events(who, task=validate.name_filter(task, "task"), since=since,
                                                    limit=limit)

    @app.get("/v1/tasks", tags=["tasks"])
    async def list_tasks(ctl: Ctl, who: Who) -> list[TaskDetail]:
        return await ctl.db.read(lambda s: iam.list_tasks(s, who))

    @app.get("/v1/tasks/{name}", tags=["tasks"])
    async def get_task(ctl: Ctl, who: Who, name: str) -> TaskDetail:
        validate.name_in_path(name, "task")
        return await ctl.db.read(lambda s: iam.task_info(s, who, name))

    @app.post("/v1/tasks/{name}/stage", tags=["tasks"])
    async def set_task_stage(ctl: Ctl, who: Who, name: str, body: SetStageBody) -> GroupResult:
        """Switch every running or paused sandbox of the task to one of the task's stages (fanned
        out to the edges); sandboxes made later start in it. Outcomes per sandbox."""
        validate.name_in_path(name, "task")
        return await ctl.ops.set_task_stage(who, name, body.stage)

    @app.delete("/v1/tasks/{name}", tags=["tasks"])
    async def delete_task(ctl: Ctl, who: Who, name: str) -> DeleteResult:
        """Delete the task's sandboxes, then the task."""
        validate.name_in_path(name, "task")
        await ctl.db.read(lambda s: iam.find_task(s, who, name))
        n = await ctl.sandboxes.delete_where(who, task=name, labels={}, states=[], everything=False)

        def txn(s: Any) -> None:
            t = iam.find_task(s, who, name)
            s.delete(t)

        await ctl.db.write(txn)
        return DeleteResult(deleted=n)

    # ---------------------------------------------------------- projects ----

    @app.post("/v1/projects", status_code=201, tags=["iam"])
    async def create_project(ctl: Ctl, who: Who, body: CreateProjectBody) -> ProjectInfo:
        return await ctl.db.write(lambda s: iam.create_project(s, who, body.name, body.parent, body.quota))

    @app.get("/v1/projects", tags=["iam"])
    async def list_projects(ctl: Ctl, who: Who) -> list[ProjectInfo]:
        return await ctl.db.read(lambda s: iam.list_projects(s, who))

    @app.get("/v1/projects/{name}", tags=["iam"])
    async def get_project(ctl: Ctl, who: Who, name: str) -> ProjectInfo:
        validate.name_in_path(name, "project")
        return await ctl.db.read(lambda s: iam.project_info(s, iam.visible_project(s, who, name)))

    @app.patch("/v1/projects/{name}", tags=["iam"])
    async def update_project(ctl: Ctl, who: Who, name: str, body: UpdateProjectBody) -> ProjectInfo:
        validate.name_in_path(name, "project")
        return await ctl.db.write(lambda s: iam.update_project(s, who, name, body.quota))

    @app.get("/v1/projects/{name}/storage", tags=["iam"])
    async def project_storage(ctl: Ctl, who: Who, name: str) -> StorageInfo:
        """Snapshot storage of a project: quota, held by its snapshots, carved out to children (bytes)."""
        validate.name_in_path(name, "project")
        return await ctl.ops.storage(who, name)

    @app.delete("/v1/projects/{name}", status_code=204, response_class=Response, tags=["iam"])
    async def delete_project(ctl: Ctl, who: Who, name: str) -> Response:
        validate.name_in_path(name, "project")
        await ctl.db.write(lambda s: iam.delete_project(s, who, name))
        ctl.auth.forget_all()  # its tokens are gone
        return Response(status_code=204)

    # ------------------------------------------------------------ tokens ----

    @app.post("/v1/tokens", status_code=201, tags=["iam"])
    async def create_token(ctl: Ctl, who: Who, body: CreateToken) -> TokenInfo:
        validate.text(body.name, "name", max_len=128)
        return await ctl.db.write(lambda s: iam.create_token(s, who, body.project, body.name))

    @app.get("/v1/tokens", tags=["iam"])
    async def list_tokens(ctl: Ctl, who: Who) -> list[TokenInfo]:
        return await ctl.db.read(lambda s: iam.list_tokens(s, who))

    @app.delete("/v1/tokens/{token_id}", status_code=204, response_class=Response, tags=["iam"])
    async def revoke_token(ctl: Ctl, who: Who, token_id: str) -> Response:
        validate.token_id(token_id)
        h = await ctl.db.write(lambda s: iam.revoke_token(s, who, token_id))
        ctl.auth.forget(h)
        await ctl.leases.revoke_for_token(token_id)  # its create leases end with it
        return Response(status_code=204)

    # ------------------------------------------------------------ images ----

    catalog = RegistryCatalog()

    @app.get("/v1/images", tags=["images"])
    async def list_images(ctl: Ctl, who: Who) -> list[LayerInfo]:
        """Layers the live edges hold, and those in the registries they load from (listed
        anonymously, cached 30 s): everything a create can name."""
        held, registries = await ctl.db.read(edges_mod.layers_txn)
        out = {i.ref: i for i in held}
        for url in registries:
            listing = await catalog.listing(url)
            for ref, where in listing.refs.items():
                got = out.get(ref)
                if got is None:
                    out[ref] = LayerInfo(ref=ref, edges=[], registry=where)
                elif not got.registry:
                    out[ref] = got.model_copy(update={"registry": where})
        return [out[r] for r in sorted(out)]

    # ------------------------------------------------------------- edges ----

    @app.post("/v1/edges/register", tags=["edges"])
    async def register_edge(
        ctl: Ctl, body: EdgeHealth, _: EdgeAdmin
    ) -> EdgeInfo:
        _check_health(body)
        info = await ctl.db.write(lambda s: edges_mod.record_health_txn(s, body))
        ctl.directory.put(info.id, info.url)
        return info

    @app.post("/v1/edges/{edge_id}/heartbeat", tags=["edges"])
    async def heartbeat(
        ctl: Ctl, edge_id: str, body: EdgeHealth, _: EdgeAdmin
    ) -> EdgeInfo:
        if body.edge_id != edge_id:
            raise InvalidSpec(f"the report is from edge {body.edge_id!r}, the path names {edge_id!r}", field="edge_id")
        _check_health(body)
        info = await ctl.db.write(lambda s: edges_mod.record_health_txn(s, body))
        ctl.directory.put(info.id, info.url)
        return info

    @app.get("/v1/edges", tags=["edges"])
    async def list_edges(ctl: Ctl, _: Operator) -> list[EdgeInfo]:
        return await ctl.db.read(edges_mod.list_edges_txn)

    @app.post("/v1/edges/{edge_id}/drain", tags=["edges"])
    async def drain_edge(
        ctl: Ctl, edge_id: str, _: Operator, body: DrainEdge | None = None
    ) -> EdgeInfo:
        validate.edge_id_in_path(edge_id)
        draining = True if body is None else body.draining
        return await ctl.db.write(lambda s: edges_mod.drain_txn(s, edge_id, draining))

    app.include_router(dashboard.router(operator))  # /dashboard/, /v1/admin/*, /metrics (docs/DASHBOARD.md)
    return app

