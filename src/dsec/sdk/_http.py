"""HTTP plumbing of the SDK: the connections to one base URL (:class:`Endpoint`), the error table.

Plain request/response calls to an ``http://`` URL go through the lean client
(dsec/http/client.py: ~0.1 ms a keep-alive round trip, against httpx's ~0.4 ms; SDK
create and exec latency is a benchmark target). Everything else — streams,
``https://``, a custom ``transport=`` (the unit tests' MockTransport), large
transfers, and a URL that the environment sends through a proxy (``HTTP_PROXY``
/ ``ALL_PROXY`` not bypassed by ``NO_PROXY``, as httpx reads them) — goes
through httpx. Callers cannot tell which one carried a call:
both answer with the same attributes (status_code, headers, content, json(),
text), and the lean client's failures are raised as the httpx exceptions httpx
would raise (``httpx.ConnectError``, ``httpx.ReadTimeout``, ``httpx.ReadError``).
"""

from __future__ import annotations

import base64
import json as _json
import ssl
from collections.abc import Mapping
from typing import Any, Final
from urllib.parse import quote, urlencode, urlsplit
from urllib.request import (  # type: ignore[attr-defined]  # proxy_bypass_environment: not in typeshed
    getproxies_environment,
    proxy_bypass_environment,
)

import httpx

from dsec.errors import decode_error
from dsec.http.client import NO_TIMEOUT, Answer, AnswerTimeout, ConnectFailed, EdgeHTTP, NoAnswer
from dsec.spec.api import ExecResultWire
from dsec.spec.results import ExecResult, LimitHit
from dsec.spec.unset import UNSET as UNSET  # one marker for the whole package
from dsec.spec.unset import _Unset as _Unset

Response = httpx.Response | Answer
"""An answer from either client: status_code, headers, content, json(), text."""

Timeout = float | httpx.Timeout | None | _Unset
"""A request's timeout: seconds, an httpx.Timeout, None (no timeout) or UNSET (the client's)."""


def raise_for_error(resp: Response) -> None:
    """Turn an error answer into its typed exception (dsec.errors.decode_error: the one wire format)."""
    if resp.status_code < 400:
        return
    try:
        body: Any = resp.json()
    except ValueError:
        body = resp.text[:500]
    url = resp.url if isinstance(resp, Answer) else resp.request.url
    raise decode_error(resp.status_code, body, dict(resp.headers), where=str(url))



def result_from_wire(w: ExecResultWire) -> ExecResult:
    return ExecResult(
        exit_code=w.exit_code,
        signal=w.signal,
        stdout=base64.b64decode(w.stdout_b64),
        stderr=base64.b64decode(w.stderr_b64),
        stdout_bytes=w.stdout_bytes,
        stderr_bytes=w.stderr_bytes,
        truncated=w.truncated,
        duration_s=w.duration_s,
        start_latency_s=w.start_latency_s,
        timed_out=w.timed_out,
        cpu_user_s=w.cpu_user_s,
        cpu_system_s=w.cpu_system_s,
        limit=None if w.limit is None else LimitHit(w.limit.kind, w.limit.value, w.limit.message),
    )


KEEPALIVE_EXPIRY_S = 20.0
"""Below the edge's and control plane's keep-alive timeout (30 s, edge/server.py)."""

MAX_IN_FLIGHT: Final = 2048
"""Requests in flight to one base URL (one process drives 1,000+ sandboxes on an edge)."""

CONNECT_TIMEOUT_S: Final = 10.0

_IDEMPOTENT: Final = frozenset({"GET", "HEAD", "PUT", "DELETE", "OPTIONS"})
_BODY_METHODS: Final = frozenset({"POST", "PUT", "PATCH"})
_PATH_SAFE: Final = "/:@!$&'()*+,;=%~"
"""What may stand unquoted in a path (RFC 3986 pchar; '%': already quoted)."""

_LEAN_TIMEOUTS: Final = (int, float, httpx.Timeout, _Unset, type(None))

_SSL: ssl.SSLContext | None = None


def _ssl() -> ssl.SSLContext:
    """One TLS context for every pool: building one costs tens of milliseconds."""
    global _SSL
    if _SSL is None:
        _SSL = httpx.create_ssl_context()
    return _SSL


def make_http(base_url: str, *, timeout: float, transport: httpx.AsyncBaseTransport | None = None,
              max_connections: int = MAX_IN_FLIGHT) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        base_url=base_url,
        timeout=httpx.Timeout(timeout, connect=CONNECT_TIMEOUT_S),
        # Idle connections are dropped well before the servers close them (uvicorn's
        # timeout_keep_alive is 30 s): a request written to a connection the server is
        # closing at that moment fails with ReadError, and an exec cannot be retried.
        limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections,
                            keepalive_expiry=KEEPALIVE_EXPIRY_S),
        transport=transport,
        verify=_ssl(),
    )


class Endpoint:
    """The SDK's connections to one base URL: the lean pool (plain ``http://``, no custom
    transport) and httpx for the rest, behind one :meth:`request`.

    httpx's pools are spread over ``shards`` by the caller's ``key``: httpcore's pool does
    work proportional to the requests in it on every event, so one pool with 1,000 requests
    in flight burns a core on bookkeeping. The lean pool has no such cost: one per URL.
    """

    def __init__(self, base_url: str, *, timeout: float, transport: httpx.AsyncBaseTransport | None = None,
                 headers: Mapping[str, str] | None = None, shards: int = 1,
                 max_connections: int = MAX_IN_FLIGHT) -> None:
        self.base_url = base_url.rstrip("/")
        self._timeout = timeout
        self._transport = transport
        self._headers = dict(headers or {})
        self._shards = shards
        self._per_shard = max_connections
        self._httpx: dict[int, httpx.AsyncClient] = {}
        self._lean: EdgeHTTP | None = None
        if transport is None and self.base_url.startswith("http://") and not _proxied(self.base_url):
            self._lean = EdgeHTTP(
                self.base_url, size=MAX_IN_FLIGHT, timeout=timeout, connect_timeout=CONNECT_TIMEOUT_S,
                max_idle_s=KEEPALIVE_EXPIRY_S,
                # an exec cannot be retried on a stale connection, but a TCP connect per exec
                # costs more than the rare stale one (idle ones are dropped before the server does)
                reuse_unsafe=True,
            )

    def httpx_client(self, key: str = "") -> httpx.AsyncClient:
        """The httpx client for ``key`` (its shard), made on first use."""
        shard = hash(key) % self._shards if self._shards > 1 else 0
        client = self._httpx.get(shard)
        if client is None:
            client = make_http(self.base_url, timeout=self._timeout, transport=self._transport,
                               max_connections=self._per_shard)
            client.headers.update(self._headers)
            self._httpx[shard] = client
        return client

    async def open_stream(self, method: str, path: str, *, key: str = "", **kw: Any) -> httpx.Response:
        """A streamed request (always httpx): the answer with its body unread; the caller
        closes it (``await resp.aclose()``). Not httpx's ``stream()`` context manager: that is
        an async generator of its own, and when a loop shuts down all open generators at once
        (``asyncio.run``, the sync client's close) it may be closed before the generator that
        holds it, which then fails ("generator didn't stop after athrow()")."""
        client = self.httpx_client(key)
        return await client.send(client.build_request(method, path, **kw), stream=True)

    async def request(
        self, method: str, path: str, *, key: str = "", content: Any = None, json: Any = None,
        params: Any = None, headers: Mapping[str, str] | None = None, timeout: Timeout = UNSET,
        idempotent: bool | None = None, lean: bool = True, **kw: Any,
    ) -> Response:
        """One request/response call. ``idempotent``: safe to repeat (default: by method), so a
        dead kept-alive connection is retried on a fresh one. ``lean=False``: httpx whatever the
        call (its timeout is per read, the lean client's for the whole answer: large transfers).
        Other keyword arguments are httpx's, and send the call through httpx."""
        pool = self._lean
        if (pool is None or not lean or kw or not isinstance(timeout, _LEAN_TIMEOUTS)
                or not isinstance(content, bytes | str | None) or (content is not None and json is not None)):
            if content is not None:
                kw["content"] = content
            if json is not None:
                kw["json"] = json
            if not isinstance(timeout, _Unset):
                kw["timeout"] = timeout
            return await self.httpx_client(key).request(method, path, params=params, headers=headers, **kw)
        hdrs = {**self._headers, **headers} if headers else dict(self._headers)
        body: bytes | None
        if json is not None:
            body = _json.dumps(json, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()
            hdrs.setdefault("content-type", "application/json")
        elif isinstance(content, str):
            body = content.encode()
        else:
            body = content
        if body is None and method in _BODY_METHODS:
            body = b""  # as httpx does: Content-Length: 0
        path, _, query = path.partition("?")
        if params:
            query = "&".join(q for q in (query, urlencode(params, doseq=True)) if q)
        target = quote(path, safe=_PATH_SAFE) + (f"?{query}" if query else "")
        safe = method in _IDEMPOTENT if idempotent is None else idempotent
        try:
            return await pool.request(method, target, headers=hdrs, body=body, timeout=_lean_timeout(timeout),
                                      retry_stale=safe)
        except ConnectFailed as exc:
            raise httpx.ConnectError(str(exc), request=self._request_of(method, target)) from exc
        except AnswerTimeout as exc:
            raise httpx.ReadTimeout(str(exc), request=self._request_of(method, target)) from exc
        except NoAnswer as exc:
            raise httpx.ReadError(str(exc), request=self._request_of(method, target)) from exc

    def _request_of(self, method: str, target: str) -> httpx.Request:
        return httpx.Request(method, self.base_url + target)

    async def aclose(self) -> None:
        """Close every connection; closing twice is fine."""
        clients, self._httpx = list(self._httpx.values()), {}
        for c in clients:
            await c.aclose()
        if self._lean is not None:
            await self._lean.aclose()


def _proxied(url: str) -> bool:
    """Whether httpx would send a request to ``url`` through a proxy from the environment."""
    proxies = getproxies_environment()
    if not (proxies.get("http") or proxies.get("all")):
        return False
    return not proxy_bypass_environment(urlsplit(url).hostname or "", proxies)


def _lean_timeout(timeout: Timeout) -> float | None:
    """The lean client's timeout for a request's: seconds for the whole answer, None the pool's default."""
    if isinstance(timeout, _Unset):
        return None
    if timeout is None:
        return NO_TIMEOUT
    if isinstance(timeout, httpx.Timeout):
        return NO_TIMEOUT if timeout.read is None else timeout.read
    return float(timeout)
