"""Input checks the wire models cannot express, done before anything reaches the store.

PostgreSQL refuses NUL characters in text and non-finite numbers in JSON, and
enforces column lengths that SQLite ignores; a request carrying them must be
a 4xx on both stores, never a 500 from deep inside a transaction.
"""

from __future__ import annotations

import math
import re
from typing import Any

from dsec.control.errors import NotFound
from dsec.errors import InvalidSpec, SandboxNotFound
from dsec.spec.api import EDGE_ID_PATTERN, NAME_PATTERN

_NAME = re.compile(NAME_PATTERN)
_EDGE = re.compile(EDGE_ID_PATTERN)
_SANDBOX_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
_TOKEN_ID = re.compile(r"^tok_[0-9a-f]{1,32}$")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def sandbox_id(value: str) -> str:
    if not _SANDBOX_ID.match(value):
        raise SandboxNotFound(f"no sandbox {value[:70]!r}", sandbox_id=value[:63])
    return value


def is_sandbox_id(value: str) -> bool:
    return bool(_SANDBOX_ID.match(value))


def name_in_path(value: str, what: str) -> str:
    if not _NAME.match(value):
        raise NotFound(f"no {what} {value[:70]!r}", **{what: value[:63]})
    return value


def token_id(value: str) -> str:
    if not _TOKEN_ID.match(value):
        raise NotFound(f"no token {value[:70]!r}", token_id=value[:40])
    return value


def edge_id_in_path(value: str) -> str:
    if not _EDGE.match(value):
        raise NotFound(f"no edge {value[:70]!r}", edge_id=value[:16])
    return value


def name_filter(value: str | None, field: str) -> str | None:
    if value is not None and not _NAME.match(value):
        raise InvalidSpec(f"{field} {value[:70]!r}: lowercase letters, digits and . _ - (max 63)", field=field)
    return value


def text(value: str | None, field: str, *, max_len: int) -> str | None:
    """Printable text that fits its column."""
    if value is None:
        return None
    if len(value) > max_len or _CONTROL.search(value):
        raise InvalidSpec(f"{field}: at most {max_len} printable characters", field=field)
    return value


def finite(data: Any, field: str = "") -> None:
    """No inf/NaN anywhere (they cannot be stored as JSON, nor compared sensibly)."""
    if isinstance(data, float) and not math.isfinite(data):
        raise InvalidSpec(f"{field or 'body'}: must be a finite number", field=field or "body")
    if isinstance(data, dict):
        for k, v in data.items():
            finite(v, f"{field}.{k}" if field else str(k))
    elif isinstance(data, list | tuple):
        for i, v in enumerate(data):
            finite(v, f"{field}.{i}" if field else str(i))
