"""``UNSET``: an argument left out, so its default applies (``None`` means "none", e.g. no
timeout). One marker for the whole package: the SDK and the backends take the same."""

from __future__ import annotations

from typing import Final


class _Unset:
    def __repr__(self) -> str:
        return "UNSET"


UNSET: Final = _Unset()
"""Marks an argument left out (the default applies); ``None`` means "none"."""

__all__ = ["UNSET", "_Unset"]
