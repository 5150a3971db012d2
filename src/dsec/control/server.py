"""Run a control-plane replica inside the current event loop (for ``dsec up`` and tests).

``handle = await serve_control(config)`` starts the store, the watcher and a
uvicorn server, and returns once it accepts connections; ``handle.url`` is
where it listens (``port=0`` picks a free port); ``await handle.stop()``
shuts it down. Signals are left to the caller (several servers may share one
process), unlike ``uvicorn.run``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Generator
from typing import TYPE_CHECKING

import uvicorn
from fastapi import FastAPI

from dsec.control.app import create_app
from dsec.control.config import ControlConfig
from dsec.control.service import Control
from dsec.errors import HostError
from dsec.http.limits import LimitedHttpToolsProtocol

if TYPE_CHECKING:
    from dsec.compat.sandboxfusion.listener import Listener


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield  # the embedding program owns SIGINT/SIGTERM


class ControlHandle:
    def __init__(self, control: Control, app: FastAPI, server: uvicorn.Server, task: asyncio.Task[None], url: str) -> None:
        self.control = control
        self.app = app
        self.server = server
        self._task = task
        self.url = url
        self.sandboxfusion_listener: Listener | None = None
        """The token-free SandboxFusion listener, when configured (compat/sandboxfusion/listener.py)."""

    @property
    def admin_token(self) -> str | None:
        """The admin token made by this start (first start without a configured one), else None."""
        return self.control.admin_token

    async def stop(self, timeout: float = 10.0) -> None:
        listener, self.sandboxfusion_listener = self.sandboxfusion_listener, None
        if listener is not None:
            await listener.stop()  # before the app: its calls use the app's service and store
        if self._task.done():
            await self.control.stop()
            return
        self.server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self._task), timeout)
        except TimeoutError:
            self.server.force_exit = True
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._task, 5.0)
        finally:
            await self.control.stop()

    async def wait(self) -> None:
        """Until the server stops (by stop() or a fatal error)."""
        await asyncio.shield(self._task)


async def serve_control(config: ControlConfig) -> ControlHandle:
    control = Control(config)
    await control.start()  # migrations and bootstrap: errors reach the caller directly
    try:
        app = create_app(config, control=control)
        uv = uvicorn.Config(
            app, host=config.host, port=config.port, log_level=config.log_level, access_log=False,
            lifespan="on", timeout_graceful_shutdown=5,
            # longer than the SDK keeps an idle connection (sdk/_http.py KEEPALIVE_EXPIRY_S),
            # so a client never writes to a connection the server is closing
            timeout_keep_alive=30,
            http=LimitedHttpToolsProtocol,  # bounded request heads (dsec/http/limits.py)
        )
        server = _Server(uv)
        task = asyncio.create_task(server.serve(), name="dsec-control-http")
        while not server.started:
            if task.done():
                exc = task.exception()
                raise HostError(f"control plane HTTP server did not start on {config.host}:{config.port}: {exc or 'see the log'}")
            await asyncio.sleep(0.01)
    except BaseException:
        await control.stop()
        raise
    sock = server.servers[0].sockets[0].getsockname()
    url = config.public_url or f"http://{sock[0]}:{sock[1]}"
    # This replica itself, for what it calls on itself (the SandboxFusion API's creates)
    local = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(sock[0], sock[0])
    app.state.local_url = f"http://[{local}]:{sock[1]}" if ":" in local else f"http://{local}:{sock[1]}"
    control.url = url.rstrip("/")
    handle = ControlHandle(control, app, server, task, url.rstrip("/"))
    sf = config.sandboxfusion
    if sf.enabled and sf.listener.enabled:
        from dsec.compat.sandboxfusion.listener import start_listener

        try:
            handle.sandboxfusion_listener = await start_listener(app.state.sandboxfusion, control.db,
                                                                 sf.listener, app.state.local_url)
        except BaseException:
            await handle.stop()
            raise
    return handle
