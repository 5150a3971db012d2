"""The edge agent's HTTP API (docs/API.md, "Edge agent"), a thin layer over EdgeService.

Auth: every ``/v1`` call carries ``Authorization: Bearer <dsec1 token>``,
checked with the cluster key and no round trip (:mod:`dsec.http.auth`). Creating,
listing and the health report need an ``edge-admin`` token; a sandbox token
reaches only its own sandbox. ``/metrics`` is open (scrapers carry no token).

Errors: every DsecError becomes ``{"error": {...}}`` with its class's
``http_status`` through :func:`dsec.errors.encode_error` (429 with
``Retry-After``, 401 with ``WWW-Authenticate``);
malformed input is a 422 ``invalid_spec`` naming the field. Bad input never
yields a 500.

Answers are serialised straight from the pydantic models (no second
validation pass): the create and exec paths are latency-critical.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Sequence
from typing import Annotated, Any, TypeVar

from fastapi import Body, Depends, FastAPI, Query, Request, WebSocket
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import TypeAdapter, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import HTTPConnection

from dsec.backends.base import FileInfo, command_line
from dsec.edge.config import EdgeConfig
from dsec.edge.disconnect import unless_disconnected
from dsec.edge.service import EdgeService, error_body, result_to_wire, wire_value
from dsec.edge.terminals import TerminalHub, serve_terminal
from dsec.errors import AuthError, DsecError, Forbidden, InvalidSpec, encode_error
from dsec.http.auth import Claims, check_sandbox, verify
from dsec.http.fastroute import Answer, FastRequest, FastRoutes, answer_of
from dsec.http.limits import BodyLimit, read_body
from dsec.spec import NetworkPolicy
from dsec.spec.api import (
    AttachOpen,
    EdgeCreateSandbox,
    EdgeHealth,
    ExecRequest,
    ExecResultWire,
    Fence,
    FenceResult,
    FileEntry,
    ForkRequest,
    GroupResult,
    NetworkInfo,
    PauseReport,
    Preempt,
    SandboxInfo,
    SandboxStats,
    SessionOpen,
    SessionOpened,
    SessionRun,
    SetStage,
    SnapshotInfo,
    SnapshotRequest,
    TerminalInfo,
)

log = logging.getLogger("dsec.edge.app")
T = TypeVar("T")

MAX_BODY_BYTES = 1 << 30
"""The largest file or tar body the edge reads (and never more than a sandbox's disk quota)."""
JSON = "application/json"
NDJSON = "application/x-ndjson"
_INFO_LIST = TypeAdapter(list[SandboxInfo])
_ENTRY_LIST = TypeAdapter(list[FileEntry])
_SNAP_LIST = TypeAdapter(list[SnapshotInfo])
_TOKEN_CACHE_MAX = 20000


def _json(model: Any, status: int = 200) -> Response:
    return Response(model.model_dump_json(), status_code=status, media_type=JSON)


def _entry(info: FileInfo) -> FileEntry:
    return FileEntry(path=info.path, name=info.name, type=info.type, size=info.size, mode=info.mode,
                     uid=info.uid, gid=info.gid, mtime=info.mtime, target=info.target)


_UNION_TAG = re.compile(r"^([a-z_-]+\[.*\]|str|int|float|bool|bytes|none|list|dict)$")


def _field_of(loc: Sequence[Any]) -> str:
    """``("body", "spec", "resources", "cpu")`` -> ``spec.resources.cpu``; union member
    tags pydantic puts in the path (``list[str]``) are not fields and are dropped."""
    parts = [str(p) for p in loc]
    if parts and parts[0] in ("body", "query", "path", "header"):
        parts = parts[1:]
    return ".".join(p for p in parts if not _UNION_TAG.match(p)) or "body"


def _validation_response(errors: Sequence[Any]) -> JSONResponse:
    details = [
        {"field": _field_of(e.get("loc", ())), "message": str(e.get("msg", "")), "type": str(e.get("type", ""))}
        for e in errors
    ]
    first = details[0] if details else {"field": "body", "message": "invalid request"}
    body = {"error": {
        "code": "invalid_spec",
        "message": f"{first['field']}: {first['message']}",
        "field": first["field"],
        "errors": details[:20],
    }}
    return JSONResponse(body, status_code=422)


def _error_response(exc: DsecError) -> JSONResponse:
    status, body, headers = encode_error(exc, default=wire_value, realm="dsec-edge")
    return JSONResponse(body, status_code=status, headers=headers)


class _Auth:
    """Verifies bearer tokens; a verified token is cached (signature checked once)."""

    def __init__(self, key: bytes) -> None:
        self.key = key
        self._cache: dict[str, Claims] = {}

    def claims(self, request: HTTPConnection) -> Claims:
        return self.claims_of(request.headers.get("authorization"))

    def claims_of(self, header: str | None) -> Claims:
        if not header:
            raise AuthError("missing Authorization: Bearer <token> (a dsec1 token from the control plane)")
        scheme, _, token = header.strip().partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise AuthError("Authorization must be 'Bearer <token>'")
        hit = self._cache.get(token)
        if hit is not None:
            if hit.expires_at >= time.time():
                return hit
            self._cache.pop(token, None)
        claims = verify(self.key, token)
        if len(self._cache) >= _TOKEN_CACHE_MAX:
            self._cache.clear()
        self._cache[token] = claims
        return claims


def _auth(request: HTTPConnection) -> _Auth:
    auth: _Auth = request.app.state.auth
    return auth


# async on purpose: FastAPI runs a sync dependency in a worker thread (a thread hop per request).
async def _admin(request: Request) -> Claims:
    return _must_be_admin(_auth(request).claims(request))


def _must_be_admin(claims: Claims) -> Claims:
    if claims.scope != "edge-admin":
        raise Forbidden("this call needs an edge-admin token (sandbox tokens reach only their sandbox)")
    return claims


async def _for_sandbox(sandbox_id: str, request: Request) -> Claims:
    claims = _auth(request).claims(request)
    check_sandbox(claims, sandbox_id)
    return claims


# Module level: with postponed annotations FastAPI resolves these names in the module's globals.
Admin = Annotated[Claims, Depends(_admin)]
Owner = Annotated[Claims, Depends(_for_sandbox)]
FilePath = Annotated[str, Query(alias="path", min_length=1, max_length=4096)]
Uid = Annotated[int, Query(ge=0, lt=65536)]
Mode = Annotated[str, Query(pattern=r"^0?o?[0-7]{1,4}$")]
Name = Annotated[str, Query(min_length=1, max_length=4096)]
Labels = Annotated[list[str], Query()]
Ids = Annotated[list[str], Query(max_length=10000)]


def create_app(config: EdgeConfig, *, service: EdgeService | None = None) -> FastAPI:
    """The edge's ASGI app. Its lifespan starts and stops the service (and so the backends)
    unless the caller passes a service it already started (``serve_edge`` does)."""
    svc = service or EdgeService(config)
    auth = _Auth(config.cluster_key)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        owned = not svc.started
        if owned:
            await svc.start()
        try:
            yield
        finally:
            if owned:
                await svc.stop()

    app = FastAPI(
        title=f"DSec edge {config.edge_id}",
        version="1",
        lifespan=lifespan,
        description="Node agent: sandboxes on this node, the data path (exec, sessions, files), health, metrics.",
    )
    app.state.edge = svc
    app.state.auth = auth

    # The rollout's hot routes, below FastAPI's machinery (dsec/http/fastroute.py); the FastAPI
    # routes of the same name below answer what these pass on, and document the API.
    def header(req: FastRequest) -> str | None:
        raw = req.headers.get(b"authorization")
        return None if raw is None else raw.decode("latin-1")

    async def fast_create(req: FastRequest) -> Answer:
        _must_be_admin(auth.claims_of(header(req)))
        info = await svc.create(req.model(EdgeCreateSandbox))
        return Answer(201, info.model_dump_json().encode())

    async def fast_exec(req: FastRequest) -> Answer:
        sandbox_id = req.params[0]
        check_sandbox(auth.claims_of(header(req)), sandbox_id)
        result = await unless_disconnected(req.receive, svc.exec(sandbox_id, req.model(ExecRequest)))
        if result is None:
            return Answer(499, b"")  # client closed the request (nginx's code)
        return Answer(200, result_to_wire(result).model_dump_json().encode())

    from dsec.spec.api import BatchItem, BatchResult, LeaseCreate, LeaseReleased

    async def lease_create(lease_id: str, token: str | None, body: LeaseCreate) -> Answer:
        made = await svc.leases.create(lease_id, token, body.body, body.count, body.request_id)
        items = [BatchItem(error=error_body(m)["error"]) if isinstance(m, DsecError) else BatchItem(sandbox=m)
                 for m in made]
        return Answer(200, BatchResult(items=items).model_dump_json().encode())

    async def fast_lease_create(req: FastRequest) -> Answer:
        # the lease token is checked (signature, scope, edge, expiry) before the body is read
        svc.leases.authenticate(req.params[0], req.bearer())
        return await lease_create(req.params[0], req.bearer(), req.model(LeaseCreate))

    def fast_error(exc: Exception) -> Answer | None:
        # the exception handlers below, for what a fast route raises; the rest goes to _unexpected
        if isinstance(exc, DsecError):
            return answer_of(_error_response(exc))
        if isinstance(exc, (RequestValidationError, ValidationError)):
            return answer_of(_validation_response(exc.errors()))
        return None

    from dsec.edge import fncall_routes  # POST /v1/fncall and /v1/fncall/batch (docs/FNCALL.md)

    app.add_middleware(FastRoutes, errors=fast_error, routes={
        ("POST", "/v1/sandboxes"): fast_create,
        ("POST", "/v1/sandboxes/{}/exec"): fast_exec,
        ("POST", "/v1/leases/{}/sandboxes"): fast_lease_create,
        **fncall_routes.install(app, svc, auth),
    })
    # JSON bodies stop at 16 MiB; file bodies are capped by the sandbox's quota (read_body).
    # Added last, so it is outside the fast routes too.
    app.add_middleware(BodyLimit, exempt=("/files", "/files/append", "/files/tar"))

    # ------------------------------------------------------------ errors --

    @app.exception_handler(DsecError)
    async def _dsec_error(_req: Request, exc: DsecError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _request_invalid(_req: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_response(exc.errors())

    @app.exception_handler(ValidationError)
    async def _model_invalid(_req: Request, exc: ValidationError) -> JSONResponse:
        return _validation_response(exc.errors())

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_req: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return JSONResponse({"error": {"code": code, "message": str(exc.detail)}}, status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(_req: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error")
        return JSONResponse({"error": {"code": "dsec_error", "message": f"edge internal error: {exc!r}"}}, status_code=500)

    # ------------------------------------------------------- sandboxes --

    @app.post("/v1/sandboxes", status_code=201, response_model=SandboxInfo, tags=["sandboxes"])
    async def create_sandbox(body: EdgeCreateSandbox, _c: Admin) -> Response:
        return _json(await svc.create(body), 201)

    @app.get("/v1/sandboxes", response_model=list[SandboxInfo], tags=["sandboxes"])
    async def list_sandboxes(
        _c: Admin,
        label: Labels = [],  # noqa: B006 - FastAPI copies defaults
        task: str | None = None,
        state: str | None = None,
    ) -> Response:
        labels: dict[str, str] = {}
        for item in label:
            k, sep, v = item.partition("=")
            if not sep or not k:
                raise InvalidSpec(f"label filter {item!r} must be key=value", field="label")
            labels[k] = v
        return Response(_INFO_LIST.dump_json(svc.list(labels=labels, task=task, state=state)), media_type=JSON)

    @app.get("/v1/sandboxes/{sandbox_id}", response_model=SandboxInfo, tags=["sandboxes"])
    async def get_sandbox(sandbox_id: str, claims: Owner) -> Response:
        return _json(svc.get(sandbox_id, with_token=claims.scope == "edge-admin"))

    @app.delete("/v1/sandboxes/{sandbox_id}", status_code=204, tags=["sandboxes"])
    async def delete_sandbox(sandbox_id: str, _c: Owner) -> Response:
        await svc.destroy(sandbox_id, reason="deleted")
        return Response(status_code=204)

    @app.get("/v1/sandboxes/{sandbox_id}/stats", response_model=SandboxStats, tags=["sandboxes"])
    async def sandbox_stats(sandbox_id: str, _c: Owner) -> Response:
        return _json(await svc.stats(sandbox_id))

    @app.get("/v1/sandboxes/{sandbox_id}/events", tags=["sandboxes"])
    async def sandbox_events(sandbox_id: str, _c: Owner) -> Response:
        return Response(json.dumps(svc.event_log(sandbox_id), default=str), media_type=JSON)

    # ------------------------------------------- network policy, stages --

    @app.put("/v1/sandboxes/{sandbox_id}/policy", response_model=SandboxInfo, tags=["policy"])
    async def set_policy(sandbox_id: str, _c: Owner,
                         body: Annotated[NetworkPolicy | None, Body()] = None) -> Response:
        """Replace the network policy atomically; ``null`` (or no body): loopback only."""
        return _json(await svc.set_policy(sandbox_id, body))

    @app.post("/v1/sandboxes/{sandbox_id}/stage", response_model=SandboxInfo, tags=["policy"])
    async def set_stage(sandbox_id: str, body: SetStage, _c: Owner) -> Response:
        return _json(await svc.set_stage(sandbox_id, body.stage))

    @app.get("/v1/sandboxes/{sandbox_id}/network", response_model=NetworkInfo, tags=["policy"])
    async def sandbox_network(sandbox_id: str, _c: Owner) -> Response:
        return _json(svc.network_info(sandbox_id))

    # ------------------------------------------------------------ exec --

    @app.post("/v1/sandboxes/{sandbox_id}/exec", response_model=ExecResultWire, tags=["exec"])
    async def exec_command(sandbox_id: str, body: ExecRequest, request: Request, _c: Owner) -> Response:
        result = await unless_disconnected(request.receive, svc.exec(sandbox_id, body))
        if result is None:
            return Response(status_code=499)  # client closed the request (nginx's code)
        return _json(result_to_wire(result))

    @app.post("/v1/sandboxes/{sandbox_id}/exec/stream", tags=["exec"],
              responses={200: {"content": {NDJSON: {}}, "description": "StreamChunk lines, the last one result/error"}})
    async def exec_stream(sandbox_id: str, body: ExecRequest, _c: Owner) -> StreamingResponse:
        lines = await svc.exec_stream(sandbox_id, body)
        return StreamingResponse(lines, media_type=NDJSON, headers={"Cache-Control": "no-store"})

    @app.post("/v1/sandboxes/{sandbox_id}/sessions", response_model=SessionOpened, tags=["sessions"])
    async def open_session(sandbox_id: str, _c: Owner, body: SessionOpen | None = None) -> Response:
        sid = await svc.open_session(sandbox_id, body or SessionOpen())
        return _json(SessionOpened(session_id=sid))

    @app.post("/v1/sandboxes/{sandbox_id}/sessions/{session_id}/run", response_model=ExecResultWire, tags=["sessions"])
    async def session_run(sandbox_id: str, session_id: str, body: SessionRun, _c: Owner) -> Response:
        return _json(result_to_wire(await svc.session_run(sandbox_id, session_id, body)))

    @app.delete("/v1/sandboxes/{sandbox_id}/sessions/{session_id}", status_code=204, tags=["sessions"])
    async def close_session(sandbox_id: str, session_id: str, _c: Owner) -> Response:
        await svc.close_session(sandbox_id, session_id)
        return Response(status_code=204)

    # ------------------------------------------------------- terminals --

    terminals = TerminalHub(svc.backend)
    app.state.terminals = terminals

    @app.websocket("/v1/sandboxes/{sandbox_id}/attach")
    async def attach(websocket: WebSocket, sandbox_id: str) -> None:
        """A terminal or a command with streamed stdin (protocol: :class:`AttachOpen`)."""
        await websocket.accept()
        try:
            check_sandbox(_auth(websocket).claims(websocket), sandbox_id)
            req = AttachOpen.model_validate_json(await websocket.receive_text())
            svc.ready_for_exec(sandbox_id)
            term, new = await terminals.open(sandbox_id, req)
        except (DsecError, ValidationError) as exc:
            body = error_body(exc) if isinstance(exc, DsecError) else json.loads(
                bytes(_validation_response(exc.errors()).body))
            with contextlib.suppress(Exception):
                await websocket.send_text(json.dumps(body))
                await websocket.close(code=1008)
            return
        svc.events.add(sandbox_id, "terminal_attached", name=term.name, pid=term.proc.pid, new=new, tty=term.tty,
                       cmd=command_line(term.argv))
        with svc.activity(sandbox_id):
            await serve_terminal(websocket, term, new=new)
        if term.exit is None:
            svc.events.add(sandbox_id, "terminal_left", name=term.name, pid=term.proc.pid,
                           still_running=term.name is not None)
        else:
            svc.events.add(sandbox_id, "terminal_ended", name=term.name, pid=term.proc.pid,
                           exit_code=term.exit["exit_code"], signal=term.exit["signal"])

    @app.get("/v1/sandboxes/{sandbox_id}/terminals", response_model=list[TerminalInfo], tags=["exec"])
    async def list_terminals(sandbox_id: str, _c: Owner) -> Response:
        svc.record(sandbox_id)
        return JSONResponse([t.model_dump() for t in terminals.list(sandbox_id)])

    # ------------------------------------------- pause, snapshots, fork --

    def _group_query(ids: Sequence[str], label: Sequence[str], task: str | None) -> dict[str, Any]:
        labels: dict[str, str] = {}
        for item in label:
            k, sep, v = item.partition("=")
            if not sep or not k:
                raise InvalidSpec(f"label filter {item!r} must be key=value", field="label")
            labels[k] = v
        return {"ids": list(ids) or None, "labels": labels or None, "task": task}

    @app.post("/v1/sandboxes/{sandbox_id}/pause", response_model=PauseReport, tags=["pause"])
    async def pause_sandbox(sandbox_id: str, _c: Owner) -> Response:
        return _json(await svc.pause(sandbox_id))

    @app.post("/v1/sandboxes/{sandbox_id}/preempt", response_model=PauseReport, tags=["pause"])
    async def preempt_sandbox(sandbox_id: str, _c: Admin, body: Preempt) -> Response:
        """The control plane's scheduler pauses it to make room (``destroy``: removes it): its cpu
        and memory stop counting; only a resume brings it back (docs/CONTROL.md, "Scheduling")."""
        if body.action == "destroy":
            await svc.evict(sandbox_id, by_priority=body.by_priority, reason=body.reason)
            return Response(status_code=204)
        return _json(await svc.preempt(sandbox_id, by_priority=body.by_priority, reason=body.reason))

    @app.post("/v1/sandboxes/{sandbox_id}/resume", response_model=SandboxInfo, tags=["pause"])
    async def resume_sandbox(sandbox_id: str, c: Owner) -> Response:
        if sandbox_id in svc.preempted and c.scope != "edge-admin":
            svc.preempted.gate(sandbox_id)  # its room is the scheduler's to give back: the control plane resumes it
        return _json(await svc.resume(sandbox_id))

    @app.post("/v1/pause", response_model=GroupResult, tags=["pause"])
    async def pause_group(_c: Admin, id: Ids = [], label: Labels = [],  # noqa: B006
                          task: str | None = None) -> Response:
        return _json(await svc.pause_where(**_group_query(id, label, task)))

    @app.post("/v1/resume", response_model=GroupResult, tags=["pause"])
    async def resume_group(_c: Admin, id: Ids = [], label: Labels = [],  # noqa: B006
                           task: str | None = None) -> Response:
        return _json(await svc.resume_where(**_group_query(id, label, task)))

    @app.post("/v1/sandboxes/{sandbox_id}/snapshot", status_code=201, response_model=SnapshotInfo, tags=["snapshots"])
    async def snapshot_sandbox(sandbox_id: str, _c: Admin, body: SnapshotRequest | None = None) -> Response:
        # Admin only: snapshots count against the project's storage quota and forks
        # against its sandbox quota, which the control plane checks before asking here.
        return _json(await svc.snapshot(sandbox_id, body or SnapshotRequest()), 201)

    @app.post("/v1/sandboxes/{sandbox_id}/fork", status_code=201, response_model=list[SandboxInfo], tags=["snapshots"])
    async def fork_sandbox(sandbox_id: str, body: ForkRequest, _c: Admin) -> Response:
        return Response(_INFO_LIST.dump_json(await svc.fork(sandbox_id, body)), status_code=201, media_type=JSON)

    @app.get("/v1/snapshots", response_model=list[SnapshotInfo], tags=["snapshots"])
    async def list_snapshots(_c: Admin) -> Response:
        return Response(_SNAP_LIST.dump_json(await asyncio.to_thread(svc.list_snapshots)), media_type=JSON)

    @app.delete("/v1/snapshots/{ref:path}", status_code=204, tags=["snapshots"])
    async def delete_snapshot(ref: str, _c: Admin) -> Response:
        await asyncio.to_thread(svc.delete_snapshot, ref)
        return Response(status_code=204)

    # ----------------------------------------------------------- files --

    @app.get("/v1/sandboxes/{sandbox_id}/files", tags=["files"],
             responses={200: {"content": {"application/octet-stream": {}}}})
    async def read_file(sandbox_id: str, path: FilePath, _c: Owner) -> Response:
        data = await svc.files(sandbox_id, lambda fs: fs.read(path))
        svc.note_copy(sandbox_id, "copy_out", path, len(data))
        return Response(data, media_type="application/octet-stream")

    def _body_limit(sandbox_id: str) -> int:
        """No body bigger than the sandbox's disk quota is worth reading: it could not
        be written. Unknown sandboxes get the edge-wide cap (the route then 404s)."""
        try:
            disk = int(svc.record(sandbox_id).spec.resources.disk)
        except Exception:
            return MAX_BODY_BYTES
        return min(MAX_BODY_BYTES, disk + (1 << 20))

    @app.put("/v1/sandboxes/{sandbox_id}/files", status_code=204, tags=["files"])
    async def write_file(sandbox_id: str, path: FilePath, request: Request, _c: Owner,
                         mode: Mode = "644",
                         user: Uid = 0,
                         parents: bool = False) -> Response:
        perm = int(mode.replace("o", ""), 8)
        data = await read_body(request, _body_limit(sandbox_id), what="file")
        await svc.files(sandbox_id, lambda fs: fs.write(path, data, mode=perm, user=user, make_parents=parents))
        svc.note_copy(sandbox_id, "copy_in", path, len(data))
        return Response(status_code=204)

    @app.post("/v1/sandboxes/{sandbox_id}/files/append", status_code=204, tags=["files"])
    async def append_file(sandbox_id: str, path: FilePath, request: Request, _c: Owner,
                          user: Uid = 0) -> Response:
        data = await read_body(request, _body_limit(sandbox_id), what="appended data")
        await svc.files(sandbox_id, lambda fs: fs.append(path, data, user=user))
        return Response(status_code=204)

    @app.get("/v1/sandboxes/{sandbox_id}/files/list", response_model=list[FileEntry], tags=["files"])
    async def list_files(sandbox_id: str, path: FilePath, _c: Owner) -> Response:
        infos = await svc.files(sandbox_id, lambda fs: fs.list(path))
        return Response(_ENTRY_LIST.dump_json([_entry(i) for i in infos]), media_type=JSON)

    @app.get("/v1/sandboxes/{sandbox_id}/files/stat", response_model=FileEntry, tags=["files"])
    async def stat_file(sandbox_id: str, path: FilePath, _c: Owner) -> Response:
        return _json(_entry(await svc.files(sandbox_id, lambda fs: fs.stat(path))))

    @app.post("/v1/sandboxes/{sandbox_id}/files/mkdir", status_code=204, tags=["files"])
    async def make_dir(sandbox_id: str, path: FilePath, _c: Owner, parents: bool = False,
                       user: Uid = 0) -> Response:
        await svc.files(sandbox_id, lambda fs: fs.mkdir(path, parents=parents, user=user))
        return Response(status_code=204)

    @app.delete("/v1/sandboxes/{sandbox_id}/files", status_code=204, tags=["files"])
    async def remove_file(sandbox_id: str, path: FilePath, _c: Owner, recursive: bool = False) -> Response:
        await svc.files(sandbox_id, lambda fs: fs.remove(path, recursive=recursive))
        return Response(status_code=204)

    @app.post("/v1/sandboxes/{sandbox_id}/files/rename", status_code=204, tags=["files"])
    async def rename_file(sandbox_id: str, _c: Owner,
                          src: Name,
                          dst: Name) -> Response:
        await svc.files(sandbox_id, lambda fs: fs.rename(src, dst))
        return Response(status_code=204)

    @app.put("/v1/sandboxes/{sandbox_id}/files/tar", tags=["files"])
    async def upload_tar(sandbox_id: str, path: FilePath, request: Request, _c: Owner,
                         user: Uid = 0) -> Response:
        # a tar is larger than what it unpacks to (headers, padding): twice the quota
        data = await read_body(request, 2 * _body_limit(sandbox_id), what="tar upload")
        entries = await svc.files(sandbox_id, lambda fs: fs.upload(path, data, user=user))
        svc.note_copy(sandbox_id, "copy_in", path, len(data), entries=entries, tar=True)
        return JSONResponse({"entries": entries})

    @app.get("/v1/sandboxes/{sandbox_id}/files/tar", tags=["files"],
             responses={200: {"content": {"application/x-tar": {}}}})
    async def download_tar(sandbox_id: str, path: FilePath, _c: Owner) -> Response:
        data = await svc.files(sandbox_id, lambda fs: fs.download(path))
        svc.note_copy(sandbox_id, "copy_out", path, len(data), tar=True)
        return Response(data, media_type="application/x-tar")

    # ---------------------------------------------------- health, metrics --

    @app.post("/v1/leases/{lease_id}/sandboxes", response_model=BatchResult, tags=["leases"])
    async def create_under_lease(lease_id: str, body: LeaseCreate, request: Request) -> Response:
        """Sandboxes under a create lease (its token, scope ``lease``, from the control plane's
        ``POST /v1/leases``): ``count`` of the lease's body, item ``i`` keyed ``<request_id>/<i>``;
        per item the sandbox (with its token) or the error (docs/CONTROL.md, "Create leases")."""
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        tok = token.strip() if scheme.lower() == "bearer" else None
        svc.leases.authenticate(lease_id, tok)
        answer = await lease_create(lease_id, tok, body)
        return Response(answer.body, status_code=answer.status, media_type=JSON)

    @app.delete("/v1/leases/{lease_id}", response_model=LeaseReleased, tags=["leases"])
    async def revoke_lease(lease_id: str, _c: Admin) -> Response:
        """No more creates under this lease (control plane only); answers what it made, once the
        creates in flight are done. Idempotent."""
        made = await svc.leases.revoke(lease_id)
        return _json(LeaseReleased(made=len(made), sandboxes=made))

    @app.get("/v1/health", response_model=EdgeHealth, tags=["edge"])
    async def health(_c: Admin) -> Response:
        return _json(svc.health())

    @app.post("/v1/fence", response_model=FenceResult, tags=["edge"])
    async def fence(body: Fence, _c: Admin) -> Response:
        """Destroy every sandbox made for the control plane before ``epoch`` (it declared them
        lost while it could not reach this edge). The epoch only goes up: idempotent."""
        return _json(await svc.fence(body.epoch))

    @app.get("/metrics", tags=["edge"], responses={200: {"content": {"text/plain": {}}}})
    async def metrics() -> Response:
        return Response(svc.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app
