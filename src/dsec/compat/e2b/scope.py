"""Reading an ASGI request's scope: the E2B front and its middleware both route on headers."""

from __future__ import annotations

from typing import Any


def header(scope: dict[str, Any], name: bytes) -> str | None:
    """The first value of header ``name`` (lower-case bytes, as ASGI gives them), or None."""
    for k, v in scope.get("headers", ()):
        if k == name:
            return str(v.decode("latin-1"))
    return None


__all__ = ["header"]
