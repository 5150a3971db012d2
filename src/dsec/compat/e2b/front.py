"""The E2B front: one listener (the control plane's) for E2B's REST API and sandbox plane.

An ASGI middleware in front of the control plane's app. A request is E2B's when, in order:

1. it has ``E2b-Sandbox-Id`` (E2B's own proxy honours it on loopback): the sandbox plane,
   port from ``E2b-Sandbox-Port`` (49983 envd, 49999 code-interpreter);
2. it has an ``X-Access-Token`` that is an envd token of this front (clients 2.7-2.26 after
   ``connect``): the sandbox plane of the sandbox the token names;
3. it is ``/files`` with a ``signature`` (signed URLs carry no id): the known sandbox whose
   token makes that signature;
4. its Host is ``<port>-<sandbox id>.<domain>``: the sandbox plane;
5. its path is one of E2B's REST routes (``/sandboxes``, ``/v2/sandboxes``, ``/templates``...).

Anything else goes to DSec's own API, whose paths (``/v1/...``, ``/healthz``, ``/dashboard``,
``/sandboxfusion``) E2B's never meet. Set ``E2B_API_URL`` and ``E2B_SANDBOX_URL`` to the
control plane's URL (``dsec env e2b``).

The sandbox plane answers a gone sandbox with 502 and "... was not found", which E2B's
clients read as "not running". Streams are written frame by frame (never buffered).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno as errno_mod
import gzip
import logging
import zlib
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route, Router

from dsec.compat.e2b import envd, keys
from dsec.compat.e2b.common import E2BError
from dsec.compat.e2b.config import E2BConfig
from dsec.compat.e2b.rest import E2BApi, error_response
from dsec.compat.e2b.rooms import Room, Rooms
from dsec.compat.e2b.scope import header as _header
from dsec.compat.e2b.templates import Templates
from dsec.errors import AuthError, FileAccessError, PayloadTooLarge, SandboxNotFound

if TYPE_CHECKING:
    from connectrpc.request import Headers

log = logging.getLogger("dsec.compat.e2b")

ENVD_PORT = 49983
JUPYTER_PORT = 49999
MAX_UPLOAD = 1 << 30


class E2BFront:
    """State shared by both planes; ``app.state.e2b``."""

    def __init__(self, config: E2BConfig, ctl: Any, control_url: Any) -> None:
        from dsec.sdk.client import AsyncClient

        self.config = config
        self.key: bytes = ctl.key
        self.api = E2BApi(config, self.key, control_url)
        # Only its edge pools are used: sandbox handles made from envd tokens (rooms.py).
        self._data = AsyncClient(control_url(), "dsk_e2b-front-data-path", lease_ahead=0, timeout=120.0)
        self.rooms = Rooms(self.key, ctl.directory.url, self._data, self.api.setups)
        self.envd_apps = envd.apps(self._resolve, config.default_user)
        from dsec.compat.e2b.interpreter import Interpreter

        self.interpreter = Interpreter(self.rooms)
        self.templates = Templates(config, self.api)
        self.api.templates = self.templates
        self.rest = Router(routes=[
            Route("/sandboxes", self._wrap(self.api.create), methods=["POST"]),
            Route("/v2/sandboxes", self._wrap(self.api.create), methods=["POST"]),
            Route("/sandboxes", self._wrap(self.api.list), methods=["GET"]),
            Route("/v2/sandboxes", self._wrap(self.api.list), methods=["GET"]),
            Route("/sandboxes/{sandbox_id}", self._wrap(self.api.get), methods=["GET"]),
            Route("/sandboxes/{sandbox_id}", self._wrap(self.api.kill), methods=["DELETE"]),
            Route("/sandboxes/{sandbox_id}/timeout", self._wrap(self.api.set_timeout), methods=["POST"]),
            Route("/sandboxes/{sandbox_id}/pause", self._wrap(self.api.pause), methods=["POST"]),
            Route("/sandboxes/{sandbox_id}/connect", self._wrap(self.api.connect), methods=["POST"]),
            Route("/sandboxes/{sandbox_id}/resume", self._wrap(self.api.connect), methods=["POST"]),
            Route("/v2/sandboxes/{sandbox_id}/connect", self._wrap(self.api.connect), methods=["POST"]),
            Route("/sandboxes/{sandbox_id}/metrics", self._wrap(self.api.metrics), methods=["GET"]),
            Route("/templates/aliases/{alias}", self._wrap(self.templates.alias), methods=["GET"]),
            Route("/v3/templates", self._wrap(self.templates.request_build), methods=["POST"]),
            Route("/templates/{template_id}/files/{files_hash}", self._wrap(self.templates.file_upload),
                  methods=["GET"]),
            Route("/templates/{template_id}/files/{files_hash}", self._wrap(self.templates.put_files),
                  methods=["PUT"]),
            Route("/v2/templates/{template_id}/builds/{build_id}", self._wrap(self.templates.start_build),
                  methods=["POST"]),
            Route("/templates/{template_id}/builds/{build_id}/status", self._wrap(self.templates.status),
                  methods=["GET"]),
        ])
        self._reaper: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._reaper is None:
            self._reaper = asyncio.get_running_loop().create_task(self.api.reap(self.rooms.forget), name="e2b-reaper")

    @staticmethod
    def _wrap(handler: Any) -> Any:
        async def endpoint(request: Request) -> Response:
            try:
                return await handler(request)  # type: ignore[no-any-return]
            except Exception as exc:
                return error_response(exc)
        return endpoint

    async def _resolve(self, headers: Headers) -> Room:
        sid = headers.get("e2b-sandbox-id")
        token = headers.get("x-access-token") or headers.get("e2b-traffic-access-token")
        if not sid and token:
            sid = keys.verify_envd_token(self.key, token).sandbox_id
        if not sid:
            raise AuthError("no E2b-Sandbox-Id header and no X-Access-Token")
        return await self.rooms.get(sid, token)

    async def aclose(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(BaseException):
                await self._reaper
        for task in list(self.api.setups.values()):
            task.cancel()
        await self.templates.aclose()
        await self.rooms.aclose()
        await self.api.aclose()
        await self._data.aclose()

    # ------------------------------------------------------------ /files ----

    async def files(self, request: Request, room: Room | None) -> Response:
        q = request.query_params
        op = "read" if request.method == "GET" else "write"
        path_q = q.get("path", "")
        username = q.get("username", "")
        if room is None:
            sig = q.get("signature", "")
            room = self.rooms.by_signature(lambda r: keys.check_file_signature(
                sig, path_q, op, username, r.envd_token, q.get("signature_expiration")))
            if room is None:
                return _json_error(401, "the file URL's signature matches no sandbox this server serves")
        try:
            user = await room.user(username or None, self.config.default_user)
            if request.method == "GET":
                path = envd.abs_path(path_q, user)
                data = await room.handle.files.read(path)
                return Response(data, media_type="application/octet-stream")
            return await self._upload(request, room, user, path_q)
        except Exception as exc:
            return _files_error(exc, room.id)

    async def _upload(self, request: Request, room: Room, user: Any, path_q: str) -> Response:
        ctype = request.headers.get("content-type", "")
        written: list[dict[str, str]] = []
        if ctype.startswith("multipart/form-data"):
            form = await request.form(max_files=1000, max_fields=1000, max_part_size=MAX_UPLOAD)
            try:
                parts = [(k, v) for k, v in form.multi_items() if not isinstance(v, str)]
                if not parts:
                    raise E2BError(400, "the multipart body has no file part")
                for _, part in parts:
                    target = path_q if (path_q and len(parts) == 1) else (part.filename or "")
                    path = envd.abs_path(target, user)
                    await envd.write_as(room, user, path, await part.read())
                    written.append({"name": path.rsplit("/", 1)[-1], "type": "file", "path": path})
            finally:
                await form.close()
        else:
            if not path_q:
                raise E2BError(400, "an octet-stream upload needs the path query")
            data = await request.body()
            enc = request.headers.get("content-encoding", "").lower()
            if enc == "gzip":
                try:
                    data = gzip.decompress(data)
                except (OSError, EOFError, zlib.error) as exc:
                    raise E2BError(400, f"the gzip body does not decompress: {exc}") from None
            elif enc not in ("", "identity"):
                raise E2BError(400, f"Content-Encoding {enc!r} is not served (gzip is)")
            path = envd.abs_path(path_q, user)
            await envd.write_as(room, user, path, data)
            written.append({"name": path.rsplit("/", 1)[-1], "type": "file", "path": path})
        return JSONResponse(written)

    # ------------------------------------------------------------ dispatch ----

    async def sandbox_plane(self, scope: dict[str, Any], receive: Any, send: Any, sid: str | None,
                            port: int) -> None:
        path = scope.get("path", "")
        # code-interpreter's context calls send only E2B-Traffic-Access-Token (the API's trafficAccessToken)
        token = _header(scope, b"x-access-token") or _header(scope, b"e2b-traffic-access-token")
        if port not in (ENVD_PORT, JUPYTER_PORT):
            from dsec.compat.e2b.ports import proxy

            if not 1 <= port <= 65535:
                await _json_error(400, f"E2b-Sandbox-Port {port}: a port from 1 to 65535")(scope, receive, send)
                return
            try:  # a user's own server (ports.py): the traffic token is required, as with allow_public_traffic=False
                if not sid:
                    if not token:
                        raise AuthError("no X-Access-Token")
                    sid = keys.verify_envd_token(self.key, token).sandbox_id
                room_p = await self.rooms.get(sid, token)
                await proxy(room_p, port, scope, receive, send)
            except Exception as exc:
                await _files_error(exc, sid or "")(scope, receive, send)
            return
        room: Room | None = None
        signed = path == "/files" and b"signature=" in scope.get("query_string", b"") and not token
        if not signed:
            try:
                if not sid:
                    if not token:
                        raise AuthError("no X-Access-Token")
                    sid = keys.verify_envd_token(self.key, token).sandbox_id
                room = await self.rooms.get(sid, token)
            except Exception as exc:
                await _files_error(exc, sid or "")(scope, receive, send)
                return
        if path == "/health" and scope["method"] == "GET":
            assert room is not None
            try:  # the sandbox answers: its envd "runs"
                await room.handle.files.stat("/")
                resp: Response = Response(status_code=204 if port == ENVD_PORT else 200)
            except Exception as exc:
                resp = _files_error(exc, room.id)
            await resp(scope, receive, send)
            return
        if port == JUPYTER_PORT:
            assert room is not None
            await self.interpreter.serve(room, scope, receive, send)
            return
        if path == "/files":
            request = Request(scope, receive)
            if request.method not in ("GET", "POST"):
                await _json_error(405, "GET or POST /files")(scope, receive, send)
                return
            try:
                resp = await self.files(request, room)
            except Exception as exc:
                resp = _files_error(exc, room.id if room else "")
            await resp(scope, receive, send)
            return
        for prefix, app in self.envd_apps.items():
            if path.startswith(prefix):
                await app(scope, receive, send)
                return
        await _json_error(404, f"no envd route {path}")(scope, receive, send)


def _json_error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"code": status, "message": message}, status_code=status)


def _files_error(exc: BaseException, sandbox_id: str) -> JSONResponse:
    if isinstance(exc, SandboxNotFound):
        return _json_error(502, envd.not_running(sandbox_id))
    if isinstance(exc, FileAccessError):
        no = int(getattr(exc, "errno", 0) or 0)
        status = {errno_mod.ENOENT: 404, errno_mod.ENOSPC: 507, errno_mod.EDQUOT: 507, errno_mod.EACCES: 403,
                  errno_mod.EPERM: 403}.get(no, 400)
        return _json_error(status, exc.message)
    if isinstance(exc, PayloadTooLarge):  # the edge reads no file bigger than the sandbox's disk
        return _json_error(507, f"not enough disk space: {exc.message}")
    return error_response(exc)
