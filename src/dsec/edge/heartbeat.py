"""Register with the control plane and report health every second or so.

The edge authenticates with an edge-admin token it mints from the cluster key
(``sandbox_id`` = ``edge:<edge_id>``). The control plane being down is
normal: failures are logged (once per outage) and retried; nothing on the
edge waits for it (admission, TTL and the data path work without it).

Several control-plane URLs (replicas) may be given: a report that cannot be
delivered is sent to the next one, and the edge stays with whichever answers.
The answer carries the control plane's fencing epoch for this edge; one above
the edge's own means sandboxes here were declared lost while the edge was cut
off, and ``on_epoch`` (the service's fence) destroys them before anything else.
A removed edge's reports are refused (403): logged once, retried slowly.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

import httpx

from dsec.edge.loop import BackgroundLoop
from dsec.http.auth import mint

if TYPE_CHECKING:
    from dsec.spec.api import EdgeHealth

log = logging.getLogger("dsec.edge.heartbeat")


class Heartbeat(BackgroundLoop):
    task_name = "dsec-edge-heartbeat"

    def __init__(self, health: Callable[[], EdgeHealth], urls: str | Sequence[str], *, edge_id: str,
                 cluster_key: bytes, interval: float,
                 on_epoch: Callable[[int], Awaitable[Any]] | None = None) -> None:
        self.health = health
        self.edge_id = edge_id
        self.cluster_key = cluster_key
        self.interval = interval
        self.urls = [u.rstrip("/") for u in ([urls] if isinstance(urls, str) else urls)]
        if not self.urls:
            raise ValueError("a heartbeat needs at least one control-plane URL")
        self._current = 0
        self.on_epoch = on_epoch
        self.registered = False
        self.removed = False
        self.beats = 0
        self.failures = 0

    @property
    def url(self) -> str:
        """The control-plane URL reports go to now."""
        return self.urls[self._current]

    def _headers(self) -> dict[str, str]:
        token, _ = mint(self.cluster_key, sandbox_id=f"edge:{self.edge_id}", project="", ttl_s=300.0, scope="edge-admin")
        return {"authorization": f"Bearer {token}", "content-type": "application/json"}

    async def beat(self, http: httpx.AsyncClient) -> None:
        body = self.health().model_dump_json()
        if not self.registered:
            resp = await http.post(f"{self.url}/v1/edges/register", content=body, headers=self._headers())
        else:
            resp = await http.post(f"{self.url}/v1/edges/{self.edge_id}/heartbeat", content=body,
                                   headers=self._headers())
            if resp.status_code == 404:  # the control plane forgot us (new store): register again
                self.registered = False
                await self.beat(http)
                return
        if resp.status_code == 403:
            if not self.removed:
                log.error("the control plane at %s refuses this edge's reports: %s", self.url, resp.text[:300])
            self.removed = True
            return
        resp.raise_for_status()
        self.registered = True
        self.removed = False
        await self._check_epoch(resp)

    async def _check_epoch(self, resp: httpx.Response) -> None:
        try:
            epoch = int(resp.json().get("epoch", 0))
        except (ValueError, TypeError, AttributeError):
            return
        if self.on_epoch is not None and epoch > self.health().epoch:
            log.warning("the control plane declared this edge's sandboxes lost (epoch %d): fencing", epoch)
            await self.on_epoch(epoch)

    async def _run(self) -> None:
        interval = self.interval
        async with httpx.AsyncClient(timeout=httpx.Timeout(max(2.0, interval * 2), connect=min(2.0, interval * 2))) as http:
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
                    if len(self.urls) > 1 and not isinstance(exc, httpx.HTTPStatusError):
                        self._current = (self._current + 1) % len(self.urls)  # the next replica
                        if self.failures % len(self.urls):
                            continue  # at once, until every replica was tried
                await asyncio.sleep(interval * (5 if self.removed else 1))
