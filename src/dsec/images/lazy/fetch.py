"""Fetching byte ranges of registry blobs: the :class:`RangeFetcher` door and its httpx default.

The lazy loader needs one thing from a registry: "GET bytes [start, end) of blob D
in repo R at registry U, with these headers". :class:`RangeFetcher` is that door,
so the registry client (dsec.images.registry: token auth, mirrors) can be plugged
in without this package knowing it. :class:`HttpxRangeFetcher` is the plain
implementation: one kept-alive connection pool per process, shared by every layer,
with many requests in flight at once (HTTP/1.1 has no usable pipelining; concurrency
over a pool of kept-alive connections gives the same overlap).

Never retries and never verifies: the engine does both (it owns the retry budget
and the chunk table). Runs under whatever async library the caller runs (httpx
detects trio or asyncio).
"""

from __future__ import annotations

from typing import Protocol

import httpx


class FetchError(Exception):
    """A range could not be fetched. ``retryable`` is False when asking again cannot
    help (4xx other than 408/429: the blob is gone or access is denied)."""

    def __init__(self, message: str, *, status: int = 0, retryable: bool = True) -> None:
        super().__init__(message)
        self.status = status
        self.retryable = retryable


class RangeFetcher(Protocol):
    async def fetch_range(
        self, registry: str, repo: str, digest: str, start: int, end: int, headers: dict[str, str]
    ) -> bytes:
        """Bytes ``[start, end)`` of blob ``digest``; raise :class:`FetchError` on failure."""
        ...

    async def aclose(self) -> None: ...


class HttpxRangeFetcher:
    """``GET /v2/<repo>/blobs/<digest>`` with ``Range: bytes=start-(end-1)``."""

    def __init__(
        self,
        *,
        max_connections: int = 16,
        connect_timeout_s: float = 2.0,
        read_timeout_s: float = 10.0,
        verify: bool = True,
    ) -> None:
        self._client = httpx.AsyncClient(
            limits=httpx.Limits(
                max_connections=max_connections,
                max_keepalive_connections=max_connections,
                keepalive_expiry=60.0,
            ),
            timeout=httpx.Timeout(read_timeout_s, connect=connect_timeout_s, pool=read_timeout_s),
            follow_redirects=True,  # a registry may redirect blob GETs to its storage
            verify=verify,
        )

    async def fetch_range(
        self, registry: str, repo: str, digest: str, start: int, end: int, headers: dict[str, str]
    ) -> bytes:
        url = f"{registry}/v2/{repo}/blobs/{digest}"
        hdrs = {**headers, "Range": f"bytes={start}-{end - 1}"}
        try:
            resp = await self._client.get(url, headers=hdrs)
        except httpx.HTTPError as exc:
            raise FetchError(f"GET {url} [{start}, {end}): {type(exc).__name__}: {exc}") from exc
        body = resp.content
        if resp.status_code == 206:
            if len(body) != end - start:
                raise FetchError(f"GET {url}: {len(body)} bytes for a range of {end - start}", status=206)
            return body
        if resp.status_code == 200 and start == 0 and len(body) == end:
            return body  # a server that ignores Range, for a range that is the whole blob
        retryable = resp.status_code >= 500 or resp.status_code in (200, 408, 429)
        raise FetchError(
            f"GET {url} [{start}, {end}): HTTP {resp.status_code}", status=resp.status_code, retryable=retryable
        )

    async def aclose(self) -> None:
        await self._client.aclose()


__all__ = ["FetchError", "HttpxRangeFetcher", "RangeFetcher"]
