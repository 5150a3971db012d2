"""A token-free SandboxFusion listener for clients that cannot send one (SkyRL's verifier).

SkyRL takes bare host names and posts to ``http://<host>:8080/run_code``, with nowhere to
put a DSec token. This listener serves SandboxFusion's routes at the root of a port of its
own::

    POST /run_code   POST /run_jupyter   GET /v1/ping

and runs every call as the project named in its config (``[sandboxfusion.listener]
project``), through the same service as the control plane's ``/sandboxfusion`` routes. It is
off by default; on, it binds loopback unless told otherwise, and answers only peers inside
``allow`` (403 for others): whoever reaches it spends that project's quota, so it must stay
on a network the operator trusts.

It holds one API token of that project, minted when the first call needs it (so the
project may be made after ``dsec up``), named :data:`TOKEN_NAME`, kept in memory only and
revoked when the listener stops; one left by a crash is revoked at the next mint. The
token never leaves this process: it only authenticates the service's own calls to the
control plane.

Must never answer a peer outside ``allow``, and never run a call under any other project.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import time
from collections.abc import Generator
from typing import TYPE_CHECKING, Any

from dsec.compat.sandboxfusion.config import ListenerConfig
from dsec.compat.sandboxfusion.models import (
    RunCodeRequest,
    RunCodeResponse,
    RunJupyterRequest,
    RunJupyterResponse,
    RunStatus,
)
from dsec.errors import DsecError, HostError, NotFound

if TYPE_CHECKING:
    import uvicorn
    from fastapi import FastAPI

    from dsec.compat.sandboxfusion.service import SandboxFusion
    from dsec.control.db import Store

log = logging.getLogger("dsec.compat.sandboxfusion")

TOKEN_NAME = "sandboxfusion-listener"


def allowed(peer: str | None, allow: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]) -> bool:
    """Whether a peer address (as the server saw it) is inside one of ``allow``."""
    if not peer:
        return False
    try:
        addr = ipaddress.ip_address(peer.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return any(addr.version == net.version and addr in net for net in allow)


class ProjectToken:
    """The listener's token of its project: minted on first use, revoked by :meth:`revoke`."""

    def __init__(self, store: Store, project: str) -> None:
        self.store = store
        self.project = project
        self._secret: str | None = None
        self._id: str | None = None
        self._lock = asyncio.Lock()

    async def get(self) -> str:
        secret = self._secret
        if secret is not None:
            return secret
        async with self._lock:
            if self._secret is not None:
                return self._secret
            token_id, minted = await self.store.write(self._mint)
            self._id, self._secret = token_id, minted
            log.info("sandboxfusion listener: token %s of project %r minted", token_id, self.project)
            return minted

    def _mint(self, s: Any) -> tuple[str, str]:
        import sqlalchemy as sa

        from dsec.control.db import ApiToken, Project
        from dsec.control.iam import new_token_id, new_token_secret
        from dsec.http.auth import hash_api_token

        p = s.execute(sa.select(Project).where(Project.name == self.project)).scalar_one_or_none()
        if p is None:
            raise NotFound(f"no project {self.project!r} (the SandboxFusion listener's `project`): "
                           f"make it with `dsec project create {self.project}`", project=self.project)
        now = time.time()
        for stale in s.execute(sa.select(ApiToken).where(ApiToken.project_id == p.id, ApiToken.name == TOKEN_NAME,
                                                         ApiToken.revoked_at.is_(None))).scalars():
            stale.revoked_at = now  # left by a listener that did not stop cleanly
        secret = new_token_secret()
        tok = ApiToken(id=new_token_id(), project_id=p.id, hash=hash_api_token(secret), name=TOKEN_NAME,
                       created_at=now)
        s.add(tok)
        return tok.id, secret

    async def revoke(self) -> None:
        token_id, self._secret, self._id = self._id, None, None
        if token_id is None:
            return

        def revoke(s: Any) -> None:
            import sqlalchemy as sa

            from dsec.control.db import ApiToken

            s.execute(sa.update(ApiToken).where(ApiToken.id == token_id, ApiToken.revoked_at.is_(None))
                      .values(revoked_at=time.time()))

        await self.store.write(revoke)
        log.info("sandboxfusion listener: token %s revoked", token_id)


def create_listener_app(service: SandboxFusion, token: ProjectToken, config: ListenerConfig,
                        control_url: str) -> FastAPI:
    """The listener's ASGI app: SandboxFusion's routes at the root, peers checked against ``allow``."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse

    from dsec.compat.sandboxfusion.routes import answer
    from dsec.control.app import error_response

    app = FastAPI(title="DSec: SandboxFusion (token-free listener)", version="1")
    nets = config.networks()

    @app.middleware("http")
    async def check_peer(request: Request, call_next: Any) -> Any:
        peer = request.client.host if request.client else None
        if not allowed(peer, nets):
            return JSONResponse({"detail": f"{peer} is not allowed here (the listener's `allow`)"}, status_code=403)
        return await call_next(request)

    @app.exception_handler(DsecError)
    async def _dsec_error(request: Request, exc: DsecError) -> JSONResponse:
        return error_response(exc)

    @app.get("/v1/ping")
    async def ping() -> str:
        return "pong"

    @app.post("/run_code", response_model=RunCodeResponse)
    async def run_code(body: RunCodeRequest) -> RunCodeResponse | JSONResponse:
        try:
            tok = await token.get()
        except DsecError as exc:
            return RunCodeResponse(status=RunStatus.SandboxError, message=exc.message)
        return await answer(service.run_code(control_url, tok, body), RunCodeResponse,
                            f"listener run_code ({body.language})")

    @app.post("/run_jupyter", response_model=RunJupyterResponse)
    async def run_jupyter(body: RunJupyterRequest) -> RunJupyterResponse | JSONResponse:
        try:
            tok = await token.get()
        except DsecError as exc:
            return RunJupyterResponse(status=RunStatus.SandboxError, message=exc.message)
        return await answer(service.run_jupyter(control_url, tok, body), RunJupyterResponse, "listener run_jupyter")

    return app


class Listener:
    """A running listener (:func:`start_listener`); :meth:`stop` ends it and revokes its token."""

    def __init__(self, server: uvicorn.Server, task: asyncio.Task[None], token: ProjectToken, url: str) -> None:
        self.server = server
        self._task = task
        self.token = token
        self.url = url

    async def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self._task), timeout)
        except TimeoutError:
            self.server.force_exit = True
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._task, 5.0)
        finally:
            await self.token.revoke()


async def start_listener(service: SandboxFusion, store: Store, config: ListenerConfig, control_url: str) -> Listener:
    """Serve the listener on ``config.host:config.port`` in the running loop."""
    import uvicorn

    from dsec.http.limits import LimitedHttpToolsProtocol

    token = ProjectToken(store, config.project or "")
    app = create_listener_app(service, token, config, control_url)

    class _Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Generator[None, None, None]:
            yield  # the embedding program owns the signals

    server = _Server(uvicorn.Config(app, host=config.host, port=config.port, log_level="warning",
                                    access_log=False, lifespan="off", timeout_keep_alive=30,
                                    http=LimitedHttpToolsProtocol))
    task = asyncio.create_task(server.serve(), name="dsec-sandboxfusion-listener")
    while not server.started:
        if task.done():
            exc = task.exception()
            raise HostError(f"the SandboxFusion listener did not start on {config.host}:{config.port}: "
                            f"{exc or 'the address is in use or not ours (see the log)'}")
        await asyncio.sleep(0.01)
    sock = server.servers[0].sockets[0].getsockname()
    host = f"[{sock[0]}]" if ":" in sock[0] else sock[0]
    return Listener(server, task, token, f"http://{host}:{sock[1]}")
