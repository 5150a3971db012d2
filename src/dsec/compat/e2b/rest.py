"""E2B's REST API (the ``api`` plane) over DSec's SDK, with the caller's own project token.

An E2B API key is a DSec project token (keys.py), so creates count against that project's
quota and go through placement and edge admission like any other; the front is a client
of the control plane it is served by (``AsyncClient`` to this replica), as the
SandboxFusion API is. E2B's sandbox is a DSec sandbox labelled ``dsec.compat=e2b``; its
template, metadata and size live in labels (metadata keys are encoded to fit label keys),
its ``envVars`` in a file the create's setup writes into it (rooms.py ``ENVS_PATH``).

Answers are E2B's: JSON camelCase, errors ``{"code": <status>, "message": ...}`` with the
status the clients map (401, 404, 409, 429 + ``Retry-After``, 400), ``x-next-token`` paging.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import hashlib
import json
import logging
import re
import time
import uuid
from collections import OrderedDict
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from dsec.compat.e2b import keys
from dsec.compat.e2b.common import USER_SETUP, E2BError, _json_body, rfc3339
from dsec.compat.e2b.config import E2BConfig, E2BTemplate
from dsec.compat.e2b.rooms import ENVS_PATH
from dsec.errors import (
    AuthError,
    Backpressure,
    DsecError,
    Forbidden,
    ImageError,
    InvalidSpec,
    NotFound,
    QuotaExceeded,
    SandboxNotFound,
)

if TYPE_CHECKING:
    from dsec.compat.e2b.templates import Templates
    from dsec.sdk.client import AsyncClient, AsyncSandbox
    from dsec.spec.api import SandboxInfo

log = logging.getLogger("dsec.compat.e2b")

MiB = 1024 * 1024
COMPAT_LABEL = ("dsec.compat", "e2b")
L_TEMPLATE = "e2b/template"
L_CPU, L_MEM, L_DISK = "e2b/cpu", "e2b/memory-mb", "e2b/disk-mb"
META_PLAIN = "e2b.m/"
META_HEX = "e2b.x/"
_PLAIN_KEY = re.compile(r"^[a-z0-9][a-z0-9._-]{0,56}$")
CLIENT_ID = "dsec"
DEFAULT_TIMEOUT_S = 300
def error_response(exc: BaseException) -> JSONResponse:
    """One table: what goes wrong, as E2B's API answers it."""
    if isinstance(exc, E2BError):
        status, message, retry = exc.status, exc.message, exc.retry_after
    elif isinstance(exc, AuthError):
        status, message, retry = 401, exc.message, None
    elif isinstance(exc, Forbidden):
        status, message, retry = 403, exc.message, None
    elif isinstance(exc, SandboxNotFound | NotFound):
        status, message, retry = 404, exc.message, None
    elif isinstance(exc, QuotaExceeded):
        status, message, retry = 429, exc.message, 5.0
    elif isinstance(exc, Backpressure):
        status, message, retry = (503 if exc.http_status == 503 else 429), exc.message, float(getattr(exc, "retry_after", 1.0) or 1.0)
    elif isinstance(exc, ImageError | InvalidSpec):
        status, message, retry = 400, exc.message, None
    elif isinstance(exc, DsecError):
        status, message, retry = (exc.http_status if 400 <= exc.http_status < 600 else 500), \
            f"{exc.code}: {exc.message}", None
    else:
        log.exception("E2B API call failed", exc_info=exc)
        status, message, retry = 500, f"internal error: {type(exc).__name__}", None
    headers = {"Retry-After": str(max(1, round(retry)))} if retry is not None else None
    return JSONResponse({"code": status, "message": message}, status_code=status, headers=headers)


# ------------------------------------------------------------ metadata ----


def metadata_labels(metadata: Mapping[str, Any]) -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in metadata.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise E2BError(400, f"metadata {k!r}: keys and values must be strings")
        if len(v) > 253 or "\0" in v:
            raise E2BError(400, f"metadata {k!r}: the value is longer than 253 characters")
        if _PLAIN_KEY.match(k):
            out[META_PLAIN + k] = v
        elif len(k.encode()) * 2 <= 57:
            out[META_HEX + k.encode().hex()] = v
        else:
            raise E2BError(400, f"metadata key {k!r}: at most 57 lowercase characters (a-z 0-9 . _ -) or 28 bytes "
                                "otherwise")
    if len(out) > 56:
        raise E2BError(400, "at most 56 metadata entries")
    return out


def metadata_of(labels: Mapping[str, str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in labels.items():
        if k.startswith(META_PLAIN):
            out[k[len(META_PLAIN):]] = v
        elif k.startswith(META_HEX):
            with contextlib.suppress(ValueError, UnicodeDecodeError):
                out[bytes.fromhex(k[len(META_HEX):]).decode()] = v
    return out


# ------------------------------------------------------------ service ----


class E2BApi:
    """The REST handlers. ``control_url``: where this replica's own API answers."""

    def __init__(self, config: E2BConfig, key: bytes, control_url: Any) -> None:
        self.config = config
        self._key = key
        self._control_url = control_url
        self._clients: OrderedDict[str, AsyncClient] = OrderedDict()
        self.deadlines: dict[str, tuple[float, str]] = {}
        """E2B ``endAt`` set by ``set_timeout``/``connect`` earlier than the DSec TTL, with the token to kill by."""
        self.setups: dict[str, asyncio.Task[None]] = {}
        """Creates whose in-sandbox setup (user, envVars) is still running: envd calls wait for it."""
        self.created = 0
        self.errors = 0
        self.templates: Templates | None = None
        """The template builds (set by the front)."""

    # ------------------------------------------------------------ helpers ----

    def client(self, token: str) -> AsyncClient:
        from dsec.sdk.client import AsyncClient

        h = hashlib.sha256(token.encode()).hexdigest()
        got = self._clients.get(h)
        if got is None:
            got = AsyncClient(self._control_url(), token, timeout=120.0, lease_ahead=0)
            self._clients[h] = got
            while len(self._clients) > self.config.max_clients:
                _, old = self._clients.popitem(last=False)
                asyncio.get_running_loop().create_task(old.aclose())
        else:
            self._clients.move_to_end(h)
        return got

    async def token(self, request: Request) -> str:
        key = request.headers.get("x-api-key")
        if not key:
            auth = request.headers.get("authorization", "")
            key = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
        if not key:
            raise AuthError("no API key: send X-API-KEY: e2b_... (`dsec env e2b` prints one)")
        token = keys.dsec_token_of(key)
        await request.app.state.ctl.auth.project(token)  # 401/403 now
        return token

    def template(self, template_id: str) -> E2BTemplate:
        got = self.config.templates.get(template_id)
        if got is None:
            names = ", ".join(sorted(self.config.templates))
            raise E2BError(404, f"template '{template_id}' not found (this DSec serves {names}: ControlConfig.e2b.templates)")
        return got

    def sandbox_json(self, info: SandboxInfo, *, detail: bool = False, listed: bool = False) -> dict[str, Any]:
        labels = info.labels
        out: dict[str, Any] = {
            "templateID": labels.get(L_TEMPLATE, "base"), "sandboxID": info.id, "clientID": CLIENT_ID,
            "envdVersion": self.config.envd_version, "alias": labels.get(L_TEMPLATE, "base"),
        }
        if not listed:
            # one token for both: code-interpreter's context calls carry only the traffic token
            out["envdAccessToken"] = out["trafficAccessToken"] = keys.mint_envd_token(self._key, info.id,
                                                                                      info.project or "")
        if detail or listed:
            end = info.expires_at or (info.created_at + DEFAULT_TIMEOUT_S)
            early = self.deadlines.get(info.id)
            if early is not None:
                end = min(end, early[0])
            out.update({
                "startedAt": rfc3339(info.created_at), "endAt": rfc3339(end),
                "cpuCount": int(float(labels.get(L_CPU, "1"))), "memoryMB": int(labels.get(L_MEM, "1024")),
                "diskSizeMB": int(labels.get(L_DISK, "1024")), "metadata": metadata_of(labels),
                "state": "paused" if info.state.value == "paused" else "running",
            })
        return out

    async def _info(self, client: AsyncClient, sandbox_id: str) -> SandboxInfo:
        from dsec.control.validate import is_sandbox_id
        from dsec.spec import SandboxState

        if not is_sandbox_id(sandbox_id):
            raise E2BError(404, f"sandbox {sandbox_id!r} not found")
        info = await client.info(sandbox_id)
        if info.state in (SandboxState.STOPPED, SandboxState.STOPPING, SandboxState.LOST) \
                or info.labels.get(COMPAT_LABEL[0]) != COMPAT_LABEL[1]:
            raise E2BError(404, f"sandbox {sandbox_id} not found")
        return info

    # ------------------------------------------------------------ routes ----

    async def create(self, request: Request) -> Response:
        from dsec.spec import ImageRef, Resources, SandboxSpec

        token = await self.token(request)
        body = await _json_body(request)
        template_id = body.get("templateID") or "base"
        if not isinstance(template_id, str):
            raise E2BError(400, "templateID must be a string")
        client = self.client(token)
        built_here = False
        tpl = self.config.templates.get(template_id)
        if tpl is None:  # a template built here (templates.py), else 404
            built = await self.templates.find(client, token, template_id) if self.templates is not None else None
            if built is None:
                tpl = self.template(template_id)
            else:
                tpl, built_here = built.template, True
        timeout = body.get("timeout", DEFAULT_TIMEOUT_S)
        if not isinstance(timeout, int | float) or isinstance(timeout, bool) or timeout <= 0:
            raise E2BError(400, f"timeout must be a positive number of seconds, not {timeout!r}")
        if timeout > self.config.max_timeout_s:
            raise E2BError(400, f"timeout {timeout:g} s is longer than this server allows ({self.config.max_timeout_s:g} s)")
        metadata = body.get("metadata") or {}
        env_vars = body.get("envVars") or {}
        if not isinstance(metadata, dict) or not isinstance(env_vars, dict) \
                or not all(isinstance(k, str) and isinstance(v, str) for k, v in env_vars.items()):
            raise E2BError(400, "metadata and envVars must be objects of strings")
        base, toolkits = tpl.base, tpl.toolkits
        image = metadata.get(self.config.image_metadata_key)
        if isinstance(image, str) and image:
            base, toolkits = image, ()
        labels = {COMPAT_LABEL[0]: COMPAT_LABEL[1], L_TEMPLATE: template_id[:253], L_CPU: f"{tpl.cpu:g}",
                  L_MEM: str(tpl.memory_mb), L_DISK: str(tpl.disk_mb), **metadata_labels(metadata)}
        spec = SandboxSpec(image=ImageRef(base=base, toolkits=toolkits),
                           resources=Resources(cpu=tpl.cpu, memory=tpl.memory_mb * MiB, disk=tpl.disk_mb * MiB),
                           backend=self.config.backend)
        request_id = request.headers.get("idempotency-key") or None
        try:
            # The DSec lifetime leaves room for set_timeout to extend; E2B's own end is the front's deadline.
            ttl = min(self.config.max_timeout_s, max(float(timeout), self.config.lifetime_floor_s))
            sb = await self._create(request, client, token, spec, labels, ttl, request_id)
        except ImageError as exc:
            raise E2BError(400, f"template '{template_id}': image {base} cannot be had: {exc.message}") from None
        # The setup runs beside the answer: the sandbox's first envd call waits for it (rooms.py),
        # so a create costs what DSec's does plus the front's hop.
        task = asyncio.get_running_loop().create_task(self._setup(sb, env_vars, built_here),
                                                       name=f"e2b-setup-{sb.id}")
        self.setups[sb.id] = task
        sid = sb.id
        task.add_done_callback(lambda _t: self._setup_done(sid))
        if ttl > timeout:
            self.deadlines[sb.id] = (time.time() + float(timeout), token)
        self.created += 1
        return JSONResponse(self.sandbox_json(sb.info), status_code=201)

    async def _create(self, request: Request, client: AsyncClient, token: str, spec: Any, labels: dict[str, str],
                      ttl: float, request_id: str | None) -> AsyncSandbox:
        """The create, as the control plane this front is served by makes it: in this process
        (``control.creating.create_info``: the route's own code), not through the SDK and HTTP to itself
        (docs/PERFORMANCE.md, "E2B's clients": that hop was a third of the front's extra time)."""
        from dsec.control.creating import create_info
        from dsec.sdk.client import AsyncSandbox
        from dsec.spec.api import CreateSandbox, Lifecycle

        ctl = getattr(request.app.state, "ctl", None)
        if ctl is None:  # not on a control plane's app: as any client
            return await client.create(spec, labels=labels, ttl_s=ttl, request_id=request_id)
        who = await ctl.auth.project(token)  # cached: token() asked already
        body = CreateSandbox(spec=spec, labels=labels, lifecycle=Lifecycle(ttl_s=ttl),
                             request_id=request_id or uuid.uuid4().hex)
        return AsyncSandbox(client, await create_info(ctl, who, body))

    async def _setup(self, sb: Any, env_vars: dict[str, str], built_here: bool = False) -> None:
        from dsec.compat.e2b.templates import read_template_file, start_template

        try:
            res = await sb.exec(["/bin/sh", "-c", USER_SETUP], timeout=60)
            if res.exit_code != 0:
                raise DsecError(f"sandbox {sb.id}: its E2B setup failed: {res.stderr_text.strip()[:300]}")
            meta = await read_template_file(sb) if built_here else {}
            env_vars = {**meta.get("envs", {}), **env_vars}  # the template's ENV beneath the create's envVars
            if env_vars:  # none: no file (rooms.py reads a missing one as no envVars)
                await sb.files.write(ENVS_PATH, json.dumps(env_vars), mode=0o600, parents=True)
            if meta.get("startCmd") or meta.get("readyCmd"):
                await start_template(sb, meta, env_vars, self.config.ready_timeout_s)
        except asyncio.CancelledError:
            raise  # the sandbox's kill (or the front's stop) cancelled it: the sandbox is theirs to end
        except BaseException:
            with contextlib.suppress(Exception):
                await sb.close()
            raise

    def _drop_setup(self, sandbox_id: str) -> None:
        """The sandbox ends: its setup, running or failed, goes (a failed one stays until then)."""
        task = self.setups.pop(sandbox_id, None)
        if task is not None and not task.done():
            task.cancel()

    def _setup_done(self, sandbox_id: str) -> None:
        task = self.setups.get(sandbox_id)
        if task is not None and task.done() and (task.cancelled() or task.exception() is None):
            self.setups.pop(sandbox_id, None)  # a failed one stays: its sandbox's calls say why

    async def get(self, request: Request) -> Response:
        client = self.client(await self.token(request))
        info = await self._info(client, request.path_params["sandbox_id"])
        return JSONResponse(self.sandbox_json(info, detail=True))

    async def list(self, request: Request) -> Response:
        client = self.client(await self.token(request))
        q = request.query_params
        want: dict[str, str] = {COMPAT_LABEL[0]: COMPAT_LABEL[1]}
        if q.get("metadata"):
            want.update(metadata_labels(dict(parse_qsl(q["metadata"], keep_blank_values=True))))
        states = {s for s in ",".join(q.getlist("state")).split(",") if s} or {"running", "paused"}
        bad = states - {"running", "paused"}
        if bad:
            raise E2BError(400, f"state {sorted(bad)[0]!r}: running or paused")
        items = [i for i in await client.list(labels=want)
                 if ("paused" if i.state.value == "paused" else "running" if i.state.value in ("running", "creating")
                     else "") in states]
        if q.get("template"):
            items = [i for i in items if i.labels.get(L_TEMPLATE) == q["template"]]
        items.sort(key=lambda i: (i.created_at, i.id))
        after = q.get("nextToken")
        if after:
            try:
                ts_s, last = base64.urlsafe_b64decode(after + "=" * (-len(after) % 4)).decode().split("|", 1)
                ts = float(ts_s)
            except (ValueError, binascii.Error, UnicodeDecodeError):
                raise E2BError(400, "nextToken: not a token this server gave") from None
            items = [i for i in items if (i.created_at, i.id) > (ts, last)]
        try:
            limit = max(1, min(1000, int(q.get("limit") or 100)))
        except ValueError:
            raise E2BError(400, "limit must be an integer") from None
        page, rest = items[:limit], items[limit:]
        headers = {}
        if rest:
            last_item = page[-1]
            headers["x-next-token"] = base64.urlsafe_b64encode(
                f"{last_item.created_at!r}|{last_item.id}".encode()).decode().rstrip("=")
        return JSONResponse([self.sandbox_json(i, listed=True) for i in page], headers=headers)

    async def kill(self, request: Request) -> Response:
        client = self.client(await self.token(request))
        sid = request.path_params["sandbox_id"]
        await self._info(client, sid)
        self._drop_setup(sid)
        await client.delete(sid)
        self.deadlines.pop(sid, None)
        await request.app.state.e2b.rooms.forget(sid)
        return Response(status_code=204)

    async def set_timeout(self, request: Request) -> Response:
        token = await self.token(request)
        client = self.client(token)
        sid = request.path_params["sandbox_id"]
        info = await self._info(client, sid)
        body = await _json_body(request)
        timeout = body.get("timeout")
        if not isinstance(timeout, int | float) or isinstance(timeout, bool) or timeout < 0:
            raise E2BError(400, "timeout must be a number of seconds")
        self._deadline(info, token, float(timeout))
        return Response(status_code=204)

    def _deadline(self, info: SandboxInfo, token: str, timeout: float) -> None:
        end = time.time() + timeout
        if info.expires_at is not None and end > info.expires_at + 1.0:
            raise E2BError(400, f"sandbox {info.id} cannot live past its DSec lifetime "
                                f"({rfc3339(info.expires_at)}; the timeout given to create)")
        self.deadlines[info.id] = (end, token)

    async def reap(self, forget: Any) -> None:
        """Kill the sandboxes whose E2B timeout (set after the create) passed; runs forever."""
        while True:
            await asyncio.sleep(1.0)
            now = time.time()
            for sid, (end, token) in list(self.deadlines.items()):
                if end <= now:
                    self.deadlines.pop(sid, None)
                    self._drop_setup(sid)
                    with contextlib.suppress(Exception):
                        await self.client(token).delete(sid)
                    with contextlib.suppress(Exception):
                        await forget(sid)

    async def pause(self, request: Request) -> Response:
        client = self.client(await self.token(request))
        sid = request.path_params["sandbox_id"]
        info = await self._info(client, sid)
        if info.state.value == "paused":
            raise E2BError(409, f"sandbox {sid} is already paused")
        # through the control plane, which records the state (the SDK's handle asks the edge alone)
        await client._call("POST", f"/v1/sandboxes/{sid}/pause")
        return Response(status_code=204)

    async def connect(self, request: Request) -> Response:
        token = await self.token(request)
        client = self.client(token)
        sid = request.path_params["sandbox_id"]
        info = await self._info(client, sid)
        body = await _json_body(request, allow_empty=True)
        status = 200
        if info.state.value == "paused":
            await client._call("POST", f"/v1/sandboxes/{sid}/resume")
            info = await client.info(sid)
            status = 201
        timeout = body.get("timeout")
        if isinstance(timeout, int | float) and not isinstance(timeout, bool) and timeout > 0:
            with contextlib.suppress(E2BError):  # connect never shortens below what remains... nor fails on it
                if info.expires_at is None or time.time() + timeout <= info.expires_at:
                    current = self.deadlines.get(sid)
                    if current is None or current[0] < time.time() + timeout:
                        self._deadline(info, token, float(timeout))
        return JSONResponse(self.sandbox_json(info), status_code=status)

    async def metrics(self, request: Request) -> Response:
        client = self.client(await self.token(request))
        await self._info(client, request.path_params["sandbox_id"])
        return JSONResponse([])

    async def aclose(self) -> None:
        for c in self._clients.values():
            with contextlib.suppress(Exception):
                await c.aclose()
        self._clients.clear()
