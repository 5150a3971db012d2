"""Control-plane errors: defined in dsec.errors (one table for the wire), re-exported here."""

from __future__ import annotations

from dsec.errors import Conflict, NotFound

__all__ = ["Conflict", "NotFound"]
