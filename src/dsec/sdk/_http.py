"""HTTP plumbing of the SDK: one pooled httpx client per base URL, the error table."""

from __future__ import annotations

import base64
import ssl
from typing import Any

import httpx

from dsec.errors import AuthError, Backpressure, DsecError, error_from_wire
from dsec.spec.api import ExecResultWire
from dsec.spec.results import ExecResult


def raise_for_error(resp: httpx.Response) -> None:
    """Turn an error answer into the typed exception of dsec.errors (the one table)."""
    if resp.status_code < 400:
        return
    payload: dict[str, Any] | None = None
    try:
        body = resp.json()
        if isinstance(body, dict) and isinstance(body.get("error"), dict):
            payload = body["error"]
    except ValueError:
        pass
    if payload is None:
        text = resp.text[:500]
        if resp.status_code == 401:
            raise AuthError(f"unauthorized: {text}", status=401)
        if resp.status_code == 429:
            raise Backpressure(f"busy: {text}", retry_after=_retry_after(resp), status=429)
        raise DsecError(f"HTTP {resp.status_code} from {resp.request.url}: {text}", status=resp.status_code)
    payload.setdefault("status", resp.status_code)
    if resp.status_code == 429 and "retry_after" not in payload:
        payload["retry_after"] = _retry_after(resp)
    raise error_from_wire(payload)


def _retry_after(resp: httpx.Response) -> float:
    try:
        return float(resp.headers.get("retry-after", "1"))
    except ValueError:
        return 1.0


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
        start_latency_s=0.0,
        timed_out=w.timed_out,
    )


KEEPALIVE_EXPIRY_S = 20.0
"""Below the edge's and control plane's keep-alive timeout (30 s, edge/server.py)."""

_SSL: ssl.SSLContext | None = None


def _ssl() -> ssl.SSLContext:
    """One TLS context for every pool: building one costs tens of milliseconds."""
    global _SSL
    if _SSL is None:
        _SSL = httpx.create_ssl_context()
    return _SSL


def make_http(base_url: str, *, timeout: float, transport: httpx.AsyncBaseTransport | None = None,
              max_connections: int = 2048) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        base_url=base_url,
        timeout=httpx.Timeout(timeout, connect=10.0),
        # Idle connections are dropped well before the servers close them (uvicorn's
        # timeout_keep_alive is 30 s): a request written to a connection the server is
        # closing at that moment fails with ReadError, and an exec cannot be retried.
        limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections,
                            keepalive_expiry=KEEPALIVE_EXPIRY_S),
        transport=transport,
        verify=_ssl(),
    )
