"""The E2B front's credentials, all derived, none stored.

- **API keys.** An E2B key is a DSec project token in E2B's shape: ``e2b_`` + the hex of
  the token's bytes (E2B's JS client checks ``^e2b_[0-9a-f]+$``). The front decodes it and
  authenticates the token as any DSec client does, so a key has its token's project, scopes
  and quotas, and revoking the token revokes the key.
- **envd access tokens.** ``X-Access-Token`` of a sandbox: a ``dsec1`` token of scope
  ``e2b-envd`` for that sandbox and its project, signed with the cluster key (any replica
  checks it, no lookup). An edge refuses the scope: it opens only the front's sandbox plane,
  which then acts on that one sandbox with a data-path token of its own.
- **Signed file URLs** (``download_url``/``upload_url``): E2B's v1 signature over the path,
  operation, user, envd token and expiry (e2b ``sandbox/signature.py``).

Never logs a secret.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import time

from dsec.errors import AuthError, Forbidden
from dsec.http import auth

KEY_PREFIX = "e2b_"
ENVD_SCOPE = "e2b-envd"
ENVD_TOKEN_TTL_S = 8 * 86400.0
"""Longer than any sandbox lives (``Lifecycle.ttl_s`` stops at 7 days)."""


def api_key_of(dsec_token: str) -> str:
    """The E2B API key of a DSec project token (``dsk_...``)."""
    return KEY_PREFIX + dsec_token.encode().hex()


def dsec_token_of(api_key: str) -> str:
    """The DSec project token an E2B API key carries; AuthError (401) for anything else."""
    key = api_key.strip()
    if not key.startswith(KEY_PREFIX):
        raise AuthError("not a DSec E2B API key: expected e2b_<hex> (`dsec env e2b` prints one)")
    try:
        token = bytes.fromhex(key[len(KEY_PREFIX):]).decode()
    except (ValueError, UnicodeDecodeError):
        raise AuthError("malformed E2B API key: e2b_ must be followed by the hex of a DSec token") from None
    if not token.startswith("dsk_"):
        raise AuthError("this E2B API key does not carry a DSec project token (`dsec env e2b` prints one)")
    return token


def mint_envd_token(key: bytes, sandbox_id: str, project: str) -> str:
    token, _ = auth.mint(key, sandbox_id=sandbox_id, project=project, ttl_s=ENVD_TOKEN_TTL_S, scope=ENVD_SCOPE)
    return token


def verify_envd_token(key: bytes, token: str, sandbox_id: str | None = None) -> auth.Claims:
    """The claims of an envd access token (AuthError: malformed, forged, expired; Forbidden:
    another sandbox's)."""
    claims = auth.verify(key, token)
    if claims.scope != ENVD_SCOPE:
        raise AuthError("not an envd access token of this E2B front")
    if sandbox_id is not None and claims.sandbox_id != sandbox_id:
        raise Forbidden(f"this access token is for sandbox {claims.sandbox_id}, not {sandbox_id}",
                        sandbox_id=sandbox_id)
    return claims


def file_signature(path: str, operation: str, user: str, envd_token: str, expiration: int | None) -> str:
    """E2B's ``v1_`` file URL signature (the released client's ``get_signature``)."""
    raw = f"{path}:{operation}:{user}:{envd_token}"
    if expiration is not None:
        raw += f":{expiration}"
    digest = hashlib.sha256(raw.encode()).digest()
    return "v1_" + base64.b64encode(digest).decode().rstrip("=")


def check_file_signature(signature: str, path: str, operation: str, user: str, envd_token: str,
                         expiration: str | None) -> bool:
    exp: int | None = None
    if expiration:
        try:
            exp = int(expiration)
        except ValueError:
            return False
        if exp < time.time():
            return False
    want = file_signature(path, operation, user, envd_token, exp)
    return hmac.compare_digest(want.encode(), signature.encode())


def basic_user(authorization: str | None) -> str | None:
    """The user of ``Authorization: Basic base64("<user>:")`` (envd's way of naming it)."""
    if not authorization or not authorization.lower().startswith("basic "):
        return None
    try:
        text = base64.b64decode(authorization[6:].strip(), validate=True).decode()
    except (binascii.Error, ValueError, UnicodeDecodeError):
        return None
    user = text.split(":", 1)[0]
    return user or None
