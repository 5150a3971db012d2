"""Signed, short-lived tokens for the data path.

The control plane mints a token scoped to one sandbox; the edge checks it with
the shared key and no round trip. Format: ``dsec1.<payload b64url>.<hmac b64url>``
where the payload is compact JSON ``{"sid", "prj", "exp", "scp"}`` and the MAC
is HMAC-SHA256 over ``dsec1.<payload>``. Project API tokens are different:
random strings stored hashed by the control plane (see dsec.control).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import math
import secrets
import time
from dataclasses import dataclass

from dsec.errors import AuthError, Forbidden, LeaseInvalid

PREFIX = "dsec1"


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def parse_key(value: object) -> bytes:
    """A cluster key from hex text or bytes; at least 16 bytes."""
    if isinstance(value, bytes | bytearray):
        key = bytes(value)
    elif isinstance(value, str):
        try:
            key = bytes.fromhex(value.strip())
        except ValueError:
            raise ValueError("cluster_key must be hex (e.g. `python -c 'import secrets; print(secrets.token_hex(32))'`)") from None
    else:
        raise ValueError("cluster_key must be hex text or bytes")
    if len(key) < 16:
        raise ValueError("cluster_key must be at least 16 bytes (32 hex digits)")
    return key


def new_key() -> bytes:
    return secrets.token_bytes(32)


@dataclass(frozen=True, slots=True)
class Claims:
    sandbox_id: str
    project: str
    expires_at: float
    scope: str  # "sandbox" (data path) or "edge-admin" (control plane -> edge)


def mint(key: bytes, *, sandbox_id: str, project: str, ttl_s: float = 3600.0, scope: str = "sandbox") -> tuple[str, float]:
    exp = time.time() + ttl_s
    payload = _b64(json.dumps({"sid": sandbox_id, "prj": project, "exp": round(exp, 3), "scp": scope},
                              separators=(",", ":")).encode())
    body = f"{PREFIX}.{payload}"
    mac = _b64(hmac.new(key, body.encode(), hashlib.sha256).digest())
    return f"{body}.{mac}", exp


def verify(key: bytes, token: str, *, now: float | None = None) -> Claims:
    """Check signature and expiry; raises AuthError with the reason."""
    parts = token.split(".")
    if len(parts) != 3 or parts[0] != PREFIX:
        raise AuthError("malformed token: expected a dsec1 token from the control plane")
    body = f"{parts[0]}.{parts[1]}"
    want = hmac.new(key, body.encode(), hashlib.sha256).digest()
    try:
        got = _unb64(parts[2])
        data = json.loads(_unb64(parts[1]))
    except (ValueError, json.JSONDecodeError):
        raise AuthError("malformed token") from None
    if not hmac.compare_digest(want, got):
        raise AuthError("token signature does not verify (wrong cluster key or tampered token)")
    if float(data.get("exp", 0)) < (time.time() if now is None else now):
        raise AuthError("token expired: ask the control plane for a fresh one (GET /v1/sandboxes/{id})")
    return Claims(str(data["sid"]), str(data["prj"]), float(data["exp"]), str(data.get("scp", "sandbox")))


@dataclass(frozen=True, slots=True)
class LeaseClaims:
    """What a create lease lets its holder do (docs/CONTROL.md, "Create leases")."""

    lease_id: str
    project: str
    edge_id: str
    slots: int
    """How many sandboxes it may create, at most."""
    body_hash: str
    """SHA-256 of the canonical JSON of the create body every sandbox of the lease is made from."""
    issued_at: float
    expires_at: float
    boot_id: str
    """The run of the edge it was granted for (``EdgeHealth.boot_id``)."""


def body_hash(body: dict[str, object]) -> str:
    """The hash a lease binds its create body by (canonical JSON: sorted keys, no spaces)."""
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def mint_lease(key: bytes, *, lease_id: str, project: str, edge_id: str, boot_id: str, slots: int,
               body_digest: str, ttl_s: float) -> tuple[str, float]:
    """A ``lease``-scoped dsec1 token: up to ``slots`` creates of one body on one edge until it expires."""
    now = time.time()
    exp = now + ttl_s
    payload = _b64(json.dumps({"sid": f"lease:{lease_id}", "prj": project, "exp": round(exp, 3), "scp": "lease",
                               "edge": edge_id, "boot": boot_id, "n": slots, "h": body_digest, "iat": round(now, 3)},
                              separators=(",", ":")).encode())
    body = f"{PREFIX}.{payload}"
    return f"{body}.{_b64(hmac.new(key, body.encode(), hashlib.sha256).digest())}", exp


def verify_lease(key: bytes, token: str, *, now: float | None = None) -> LeaseClaims:
    """Check a lease token's signature and scope (AuthError / Forbidden), then its expiry
    (:class:`LeaseInvalid` ``expired``: the holder asks for a fresh lease, not a fresh login)."""
    claims = verify(key, token, now=-math.inf)  # the signature here; the expiry below, as a lease error
    if claims.scope != "lease" or not claims.sandbox_id.startswith("lease:"):
        raise Forbidden("this call needs a create-lease token (POST /v1/leases on the control plane)")
    data = json.loads(_unb64(token.split(".")[1]))
    try:
        lease = LeaseClaims(claims.sandbox_id[len("lease:"):], claims.project, str(data["edge"]), int(data["n"]),
                            str(data["h"]), float(data["iat"]), claims.expires_at, str(data["boot"]))
    except (KeyError, TypeError, ValueError):
        raise AuthError("malformed lease token") from None
    if lease.expires_at < (time.time() if now is None else now):
        raise LeaseInvalid(f"lease {lease.lease_id} expired: ask the control plane for a new one (POST /v1/leases)",
                           lease_id=lease.lease_id, reason="expired")
    return lease


def check_sandbox(claims: Claims, sandbox_id: str) -> None:
    if claims.scope == "edge-admin":
        return
    if claims.scope != "sandbox" or claims.sandbox_id != sandbox_id:
        raise Forbidden(f"this token is for sandbox {claims.sandbox_id}, not {sandbox_id}", sandbox_id=sandbox_id)


def hash_api_token(token: str) -> str:
    """Project API tokens are stored as SHA-256 (they are 256-bit random, so no KDF is needed)."""
    return hashlib.sha256(token.encode()).hexdigest()
