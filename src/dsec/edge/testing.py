"""An edge on a private event loop in a background thread, for synchronous callers
(tests, notebooks, scripts that drive the edge with a sync HTTP client).

    with EdgeThread(config) as edge:
        httpx.post(f"{edge.url}/v1/sandboxes", headers=edge.admin_headers(), ...)

Stopping waits for the edge to finish (the runtime closed, sandboxes kept or
destroyed as asked). Never used by the edge itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import httpx

from dsec.edge.config import EdgeConfig
from dsec.http.auth import mint

T = TypeVar("T")


class EdgeThread:
    def __init__(self, config: EdgeConfig, *, log_level: str = "warning") -> None:
        self.config = config
        self.log_level = log_level
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._main, name=f"edge-{config.edge_id}", daemon=True)
        self._ready = threading.Event()
        self.handle: Any = None
        self._service: Any = None
        self.url = ""

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def start(self) -> EdgeThread:
        from dsec.edge.server import serve_edge

        self._thread.start()
        self.handle = self.call(serve_edge(self.config, log_level=self.log_level))
        self.url = self.handle.url
        self._service = self.handle.service
        return self

    @property
    def service(self) -> Any:
        """The EdgeService (still readable after stop, e.g. its runtime's cgroups)."""
        return self._service

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 120.0) -> T:
        """Run ``coro`` on the edge's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self, *, destroy_all: bool | None = None) -> None:
        if self.handle is not None:
            try:
                self.call(self.handle.stop(destroy_all=destroy_all))
            finally:
                self.handle = None
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
        if not self.loop.is_running() and not self.loop.is_closed():
            self.loop.close()

    def __enter__(self) -> EdgeThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- tokens --

    def admin_token(self, ttl_s: float = 3600.0) -> str:
        token, _ = mint(self.config.cluster_key, sandbox_id="*", project="", ttl_s=ttl_s, scope="edge-admin")
        return token

    def admin_headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.admin_token()}"}

    def sandbox_headers(self, sandbox_id: str, ttl_s: float = 3600.0) -> dict[str, str]:
        token, _ = mint(self.config.cluster_key, sandbox_id=sandbox_id, project="", ttl_s=ttl_s)
        return {"authorization": f"Bearer {token}"}

    def client(self, *, admin: bool = True, timeout: float = 60.0) -> httpx.Client:
        """A sync client of this edge (admin token unless ``admin=False``)."""
        return http_client(self.url, headers=self.admin_headers() if admin else None, timeout=timeout)


def http_client(url: str, *, headers: dict[str, str] | None = None, timeout: float = 60.0) -> httpx.Client:
    """httpx's sync transport leaves Nagle on; a request sent as headers then body then
    waits ~40 ms for the server's delayed ACK. TCP_NODELAY avoids that."""
    transport = httpx.HTTPTransport(socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)])
    return httpx.Client(base_url=url, headers=headers, timeout=timeout, transport=transport)


def prepare_busybox(state_dir: Path, *, name: str = "busybox", tag: str = "test") -> str:
    """Build the busybox base layer into ``<state_dir>/layers`` (once); returns its digest."""
    from dsec.errors import LayerNotFound
    from dsec.images import LocalLayerStore, build_busybox

    store = LocalLayerStore(Path(state_dir) / "layers")
    try:
        try:
            return store.resolve(f"{name}:{tag}").digest
        except LayerNotFound:
            return build_busybox(store, name=name, tag=tag).digest
    finally:
        store.close()


def leftovers(config: EdgeConfig) -> list[str]:
    """What the edge's runtime still holds on the host: cgroups, records, uid slots."""
    name = config.runtime
    out = []
    for hier in Path("/sys/fs/cgroup").iterdir():
        d = hier / "dsec" / name
        if d.is_dir():
            kids = [p.name for p in d.iterdir() if p.is_dir()]
            if kids:
                out.append(f"cgroups {d}: {kids}")
    records = Path(config.state_dir) / "sandboxes" / name
    if records.is_dir():
        out += [f"record {p}" for p in records.glob("*.json")]
    slots = Path(config.run_dir) / "uid-slots"
    if slots.is_dir():
        for f in slots.iterdir():
            with contextlib.suppress(OSError):
                if f.read_text().split()[:1] == [name]:
                    out.append(f"uid slot {f}")
    return out
