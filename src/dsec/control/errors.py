"""Control-plane errors that dsec.errors has no class for yet.

Their codes are in dsec.spec.api.STATUS_BY_CODE (404, 409); until the SDK's
table gains classes for them, a client rebuilds them as plain DsecError with
the same code and fields.
"""

from __future__ import annotations

from dsec.errors import DsecError


class NotFound(DsecError, LookupError):
    """A project, task, token or edge that does not exist (or is not visible to the caller)."""

    code = "not_found"


class Conflict(DsecError, RuntimeError):
    """The resource exists already or is still in use."""

    code = "conflict"
