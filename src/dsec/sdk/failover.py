"""Several control-plane replicas behind one client: a call a replica cannot answer goes to the next.

``AsyncClient("http://cp1:7070,http://cp2:7070")`` (or ``DSEC_URL`` with commas)
keeps one :class:`~dsec.sdk._http.Endpoint` per replica and sends every call to
the replica that answered last. A call whose replica cannot be reached, dies
mid-answer, or answers 502/503/504 (a replica without its store) is sent to the
next replica when it is safe to send again:

- reads and deletes (``GET``, ``HEAD``, ``PUT``, ``DELETE``): always;
- a ``POST`` only when the caller says it is ``idempotent`` — the SDK's creates
  are, because they carry a ``request_id`` the control plane de-duplicates
  across replicas (the same id on another replica answers the same sandbox, or
  waits for it), so a failed-over create is never made twice.

Each replica is tried once per round, for up to ``rounds`` rounds with a short
pause between them (a replica being replaced, a store restarting); then the last
error is raised. Never retries a call that got a real answer (4xx, 500).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

import httpx

from dsec.http.client import AnswerTimeout
from dsec.sdk._http import Endpoint, Response

log = logging.getLogger("dsec.sdk.failover")

_SAFE = frozenset({"GET", "HEAD", "PUT", "DELETE", "OPTIONS"})
_RETRY_STATUS = frozenset({502, 503, 504})


def split_urls(url: str) -> list[str]:
    """``"http://a:7070, http://b:7070"`` -> the replicas' base URLs (no trailing slash)."""
    return [u.strip().rstrip("/") for u in url.split(",") if u.strip()]


class Replicas:
    """The Endpoint interface (``request``, ``open_stream``, ``aclose``) over several replicas."""

    def __init__(self, urls: Sequence[str], *, rounds: int = 3, pause_s: float = 0.5, **endpoint: Any) -> None:
        if not urls:
            raise ValueError("no control-plane URL")
        self.endpoints = [Endpoint(u, **endpoint) for u in urls]
        self.rounds = rounds
        self.pause_s = pause_s
        self._current = 0
        self.failovers = 0
        """How many times a call moved to another replica (tests, benchmarks)."""

    @property
    def base_url(self) -> str:
        return self.endpoints[self._current].base_url

    async def request(self, method: str, path: str, *, idempotent: bool | None = None, **kw: Any) -> Response:
        safe = method in _SAFE if idempotent is None else idempotent
        if len(self.endpoints) == 1:
            return await self.endpoints[0].request(method, path, idempotent=idempotent, **kw)
        last: BaseException | None = None
        tries = len(self.endpoints) * (self.rounds if safe else 1)
        for attempt in range(tries):
            i = (self._current + attempt) % len(self.endpoints)
            if attempt and attempt % len(self.endpoints) == 0:
                await asyncio.sleep(self.pause_s)
            ep = self.endpoints[i]
            try:
                resp = await ep.request(method, path, idempotent=idempotent, **kw)
            except (httpx.TransportError, AnswerTimeout, OSError) as exc:
                if not safe and not isinstance(exc, httpx.ConnectError):
                    raise  # the call may have happened: not ours to repeat
                last = exc
                log.info("control plane %s: %s %s failed (%r); trying another replica", ep.base_url, method, path, exc)
                continue
            if resp.status_code in _RETRY_STATUS and safe and attempt < tries - 1:
                last = None
                log.info("control plane %s answered %d to %s %s; trying another replica", ep.base_url,
                         resp.status_code, method, path)
                continue
            if i != self._current:
                self.failovers += 1
                self._current = i
            return resp
        assert last is not None or tries
        if last is None:  # every replica answered 5xx: give the caller the last answer's error
            return await self.endpoints[self._current].request(method, path, idempotent=idempotent, **kw)
        raise last

    async def open_stream(self, method: str, path: str, *, key: str = "", **kw: Any) -> httpx.Response:
        return await self.endpoints[self._current].open_stream(method, path, key=key, **kw)

    def httpx_client(self, key: str = "") -> httpx.AsyncClient:
        return self.endpoints[self._current].httpx_client(key)

    async def aclose(self) -> None:
        for ep in self.endpoints:
            await ep.aclose()
