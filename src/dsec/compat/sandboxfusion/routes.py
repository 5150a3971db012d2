"""The HTTP face of the SandboxFusion-compatible API, mounted on the control plane's app.

Routes, under ``config.prefix`` (default ``/sandboxfusion``)::

    POST <prefix>/<token>/run_code      POST <prefix>/run_code      (token in Authorization)
    POST <prefix>/<token>/run_jupyter   POST <prefix>/run_jupyter
    GET  <prefix>/<token>/v1/ping       GET  <prefix>/v1/ping       -> "pong", no token needed

SandboxFusion's clients send no credentials, so the project API token may sit in the
path: users point ``SANDBOX_FUSION_ENDPOINT`` (or verl's ``sandbox_fusion.url``) at
``http://HOST:7070/sandboxfusion/<dsk_ token>`` (``.../run_code`` for verl). Answers are
SandboxFusion's: HTTP 200 with the status in the body for anything that ran or could not
run; 422 for a body SandboxFusion would refuse; 401/403 for a bad token; 504 (with
``Retry-After``) when no sandbox was free within ``queue_timeout_s``.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Annotated, TypeVar

from fastapi import FastAPI, Header, Request
from fastapi.responses import JSONResponse

from dsec.compat.sandboxfusion.config import SandboxFusionConfig
from dsec.compat.sandboxfusion.models import (
    RunCodeRequest,
    RunCodeResponse,
    RunJupyterRequest,
    RunJupyterResponse,
    RunStatus,
)
from dsec.compat.sandboxfusion.service import Busy, SandboxFusion
from dsec.errors import AuthError, DsecError

R = TypeVar("R")

log = logging.getLogger("dsec.compat.sandboxfusion")

TAG = "sandboxfusion"
Auth = Annotated[str | None, Header(include_in_schema=False)]
"""``Authorization: Bearer dsk_...`` (module level: FastAPI resolves annotations from here)."""



def busy_response(exc: Busy) -> JSONResponse:
    """No sandbox within the wait: 504 with ``Retry-After``, what verl and the client retry."""
    return JSONResponse({"detail": str(exc)}, status_code=504,
                        headers={"Retry-After": str(max(1, round(exc.retry_after)))})


async def answer(call: Awaitable[R], failed: Callable[..., R], what: str) -> R | JSONResponse:
    """A run_code / run_jupyter call as SandboxFusion's server answers it: its answer; 504 when
    no sandbox was free; a ``DsecError`` (limits past the service's, with the field) raised for
    the app's handler; anything else a ``SandboxError`` answer, never a 500 (whose log line would
    carry the path, and so the token)."""
    try:
        return await call
    except Busy as exc:
        return busy_response(exc)
    except DsecError:
        raise
    except Exception as exc:
        log.exception("%s failed", what)
        return failed(status=RunStatus.SandboxError, message=f"internal error: {type(exc).__name__}")

def install(app: FastAPI, config: SandboxFusionConfig) -> SandboxFusion | None:
    """Add the routes to ``app`` and return the service behind them (None when disabled).
    The caller closes it (``await service.aclose()``) when the app stops."""
    if not config.enabled:
        return None
    service = SandboxFusion(config)
    p = config.prefix

    async def token_of(request: Request, path_token: str | None, authorization: str | None) -> str:
        token = path_token
        if not token and authorization and authorization.lower().startswith("bearer "):
            token = authorization[7:].strip()
        if not token:
            raise AuthError(f"no API token: use {p}/<token>/run_code (SandboxFusion's clients send no "
                            "credentials) or send 'Authorization: Bearer dsk_...'")
        await request.app.state.ctl.auth.project(token)  # 401/403 now, before anything runs
        return token

    def control_url(request: Request) -> str:
        local: str | None = getattr(request.app.state, "local_url", None)
        return local or str(request.base_url).rstrip("/")

    async def ping() -> str:
        return "pong"

    async def ping_path(token: str) -> str:  # the parameter declares {token} in the OpenAPI document
        return "pong"

    app.get(f"{p}/v1/ping", tags=[TAG], summary="SandboxFusion: liveness")(ping)
    app.get(p + "/{token}/v1/ping", tags=[TAG], summary="SandboxFusion: liveness")(ping_path)

    async def run_code(request: Request, body: RunCodeRequest, token: str | None,
                       authorization: str | None) -> RunCodeResponse | JSONResponse:
        tok = await token_of(request, token, authorization)
        return await answer(service.run_code(control_url(request), tok, body), RunCodeResponse,
                            f"run_code ({body.language})")

    async def run_jupyter(request: Request, body: RunJupyterRequest, token: str | None,
                          authorization: str | None) -> RunJupyterResponse | JSONResponse:
        tok = await token_of(request, token, authorization)
        return await answer(service.run_jupyter(control_url(request), tok, body), RunJupyterResponse, "run_jupyter")

    @app.post(f"{p}/run_code", tags=[TAG], response_model=RunCodeResponse,
              summary="SandboxFusion: run code in a fresh sandbox (token in Authorization)")
    async def run_code_header(request: Request, body: RunCodeRequest,
                              authorization: Auth = None) -> RunCodeResponse | JSONResponse:
        return await run_code(request, body, None, authorization)

    @app.post(p + "/{token}/run_code", tags=[TAG], response_model=RunCodeResponse,
              summary="SandboxFusion: run code in a fresh sandbox")
    async def run_code_path(request: Request, token: str, body: RunCodeRequest) -> RunCodeResponse | JSONResponse:
        return await run_code(request, body, token, None)

    @app.post(f"{p}/run_jupyter", tags=[TAG], response_model=RunJupyterResponse,
              summary="SandboxFusion: run cells in one IPython kernel (token in Authorization)")
    async def run_jupyter_header(request: Request, body: RunJupyterRequest,
                                 authorization: Auth = None) -> RunJupyterResponse | JSONResponse:
        return await run_jupyter(request, body, None, authorization)

    @app.post(p + "/{token}/run_jupyter", tags=[TAG], response_model=RunJupyterResponse,
              summary="SandboxFusion: run cells in one IPython kernel")
    async def run_jupyter_path(request: Request, token: str,
                               body: RunJupyterRequest) -> RunJupyterResponse | JSONResponse:
        return await run_jupyter(request, body, token, None)

    return service
