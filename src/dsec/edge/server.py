"""Run edges under uvicorn: one per process (``python -m dsec.edge``) or several in one
asyncio process (``dsec up``, benchmarks with 3 edges) through :func:`serve_edge`.

``serve_edge`` binds the socket first (port 0 gives a free port, reported in
the handle's ``url``), starts the service (so a startup failure raises here,
not inside uvicorn, which would ``sys.exit``), then serves without installing
signal handlers or touching logging configuration: the embedding process
owns both.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Generator
from dataclasses import dataclass, field

import uvicorn

from dsec.edge.app import create_app
from dsec.edge.config import EdgeConfig
from dsec.edge.service import EdgeService
from dsec.http.limits import LimitedHttpToolsProtocol


class _EmbeddedServer(uvicorn.Server):
    """uvicorn.Server that leaves signal handling to the process that embeds it."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


@dataclass
class ServerHandle:
    url: str
    config: EdgeConfig
    service: EdgeService
    server: uvicorn.Server
    task: asyncio.Task[None]
    _stopped: bool = field(default=False, repr=False)

    @property
    def edge_id(self) -> str:
        return self.config.edge_id

    async def stop(self, *, destroy_all: bool | None = None) -> None:
        """Stop serving, then stop the edge. Sandboxes survive (re-adopted by the next edge
        on the same directories) unless ``destroy_all`` or the config's
        ``destroy_on_shutdown``. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        self.server.should_exit = True
        try:
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
        finally:
            await self.service.stop(destroy_all=destroy_all)


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto must be IPPROTO_TCP: asyncio sets TCP_NODELAY on accepted sockets only then, and
    # without it a response written in two parts waits ~40 ms for a delayed ACK.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


async def serve_edge(config: EdgeConfig, *, log_level: str = "warning", access_log: bool = False) -> ServerHandle:
    """Start one edge in this event loop and return once it accepts requests."""
    sock = _bind(config.host, config.port)
    port = sock.getsockname()[1]
    if config.port != port:
        config = config.model_copy(update={"port": port})
    service = EdgeService(config)
    try:
        await service.start()
    except BaseException:
        sock.close()
        with contextlib.suppress(Exception):
            await service.stop()
        raise
    app = create_app(config, service=service)
    uv_config = uvicorn.Config(
        app, lifespan="off", log_level=log_level, log_config=None, access_log=access_log,
        timeout_graceful_shutdown=3, timeout_keep_alive=30, backlog=4096,
        http=LimitedHttpToolsProtocol,  # bounded request heads (dsec/http/limits.py)
        ws="websockets-sansio",  # terminals and streamed stdin (edge/terminals.py)
    )
    server = _EmbeddedServer(uv_config)
    task = asyncio.create_task(server.serve(sockets=[sock]), name=f"dsec-edge-{config.edge_id}")
    try:
        while not server.started and not task.done():
            await asyncio.sleep(0.005)
    except BaseException:  # cancelled (Ctrl-C) while the HTTP server starts: undo the edge
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        sock.close()
        with contextlib.suppress(Exception):
            await service.stop()
        raise
    if task.done():
        sock.close()
        await service.stop()
        exc = task.exception()
        raise RuntimeError(f"edge {config.edge_id}: the HTTP server did not start") from exc
    return ServerHandle(url=config.base_url, config=config, service=service, server=server, task=task)
