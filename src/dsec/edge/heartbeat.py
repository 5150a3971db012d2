"""Register with the control plane and report health every few seconds.

The edge authenticates with an edge-admin token it mints from the cluster key
(``sandbox_id`` = ``edge:<edge_id>``). The control plane being down is
normal: failures are logged (once per outage) and retried; nothing on the
edge waits for it (admission, TTL and the data path work without it).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import httpx

from dsec.auth import mint
from dsec.edge.loop import BackgroundLoop

if TYPE_CHECKING:
    from dsec.spec.api import EdgeHealth

log = logging.getLogger("dsec.edge.heartbeat")


class Heartbeat(BackgroundLoop):
    task_name = "dsec-edge-heartbeat"

    def __init__(self, health: Callable[[], EdgeHealth], url: str, *, edge_id: str, cluster_key: bytes,
                 interval: float) -> None:
        self.health = health
        self.edge_id = edge_id
        self.cluster_key = cluster_key
        self.interval = interval
        self.url = url.rstrip("/")
        self.registered = False
        self.beats = 0
        self.failures = 0

    def _headers(self) -> dict[str, str]:
        token, _ = mint(self.cluster_key, sandbox_id=f"edge:{self.edge_id}", project="", ttl_s=300.0, scope="edge-admin")
        return {"authorization": f"Bearer {token}", "content-type": "application/json"}

    async def beat(self, http: httpx.AsyncClient) -> None:
        body = self.health().model_dump_json()
        edge_id = self.edge_id
        if not self.registered:
            resp = await http.post(f"{self.url}/v1/edges/register", content=body, headers=self._headers())
            resp.raise_for_status()
            self.registered = True
            return
        resp = await http.post(f"{self.url}/v1/edges/{edge_id}/heartbeat", content=body, headers=self._headers())
        if resp.status_code == 404:  # the control plane forgot us (new store): register again
            self.registered = False
            await self.beat(http)
            return
        resp.raise_for_status()

    async def _run(self) -> None:
        interval = self.interval
        async with httpx.AsyncClient(timeout=httpx.Timeout(10.0, connect=5.0)) as http:
            while True:
                try:
                    await self.beat(http)
                    if self.failures:
                        log.warning("control plane %s reachable again", self.url)
                    self.failures = 0
                    self.beats += 1
                except (httpx.HTTPError, OSError) as exc:
                    if self.failures == 0:
                        log.warning("control plane %s unreachable: %r (will keep trying)", self.url, exc)
                    self.failures += 1
                    self.registered = self.registered and not isinstance(exc, httpx.HTTPStatusError)
                await asyncio.sleep(interval if self.failures == 0 else min(interval, 2.0))
