"""The DSec error tree.

Every error DSec raises derives from :class:`DsecError` and, where one fits, from
the builtin exception a Python user would expect (``LookupError``,
``TimeoutError``, ``ValueError``...). Errors carry fields, not only prose, and
``code`` names them on the wire: :data:`ERRORS_BY_CODE` is the one table that
maps wire codes to classes in both directions.
"""

from __future__ import annotations

from typing import Any


def _jsonable(v: Any) -> bool:
    if v is None or isinstance(v, str | int | float | bool):
        return True
    if isinstance(v, list | tuple):
        return all(_jsonable(x) for x in v)
    if isinstance(v, dict):
        return all(isinstance(k, str) and _jsonable(x) for k, x in v.items())
    return False


class DsecError(Exception):
    """Root of every DSec error."""

    code: str = "dsec_error"

    def __init__(self, message: str, **fields: Any) -> None:
        super().__init__(message)
        self.message = message
        self.fields: dict[str, Any] = fields
        for key, value in fields.items():
            setattr(self, key, value)

    def to_wire(self) -> dict[str, Any]:
        """JSON-safe form: fields that are not plain JSON values (e.g. a partial
        ExecResult on ExecTimeout) are left out; the API sends those separately."""
        return {"code": self.code, "message": self.message,
                **{k: v for k, v in self.fields.items() if _jsonable(v)}}


class InvalidSpec(DsecError, ValueError):
    """A spec or argument is malformed; ``field`` names the offending one."""

    code = "invalid_spec"


class SandboxNotFound(DsecError, LookupError):
    code = "sandbox_not_found"

    @classmethod
    def ended(cls, sandbox_id: str, state: str, reason: str = "") -> SandboxNotFound:
        """A sandbox the control plane still remembers, but that ended (``stopped``: deleted, expired...)."""
        why = f" ({reason})" if reason else ""
        return cls(f"sandbox {sandbox_id} is {state}{why}: it no longer exists (`dsec ls` lists the running ones)",
                   sandbox_id=sandbox_id, state=state, reason=reason)


class SandboxStateError(DsecError, RuntimeError):
    """The operation is not allowed in the sandbox's current state."""

    code = "sandbox_state"


class SandboxFailed(DsecError, RuntimeError):
    """The sandbox could not be created or died; ``reason`` says why."""

    code = "sandbox_failed"


class ImageError(DsecError, RuntimeError):
    code = "image_error"


class LayerNotFound(ImageError, LookupError):
    code = "layer_not_found"


class LayerInUse(ImageError):
    code = "layer_in_use"


class ExecError(DsecError, RuntimeError):
    """A command could not be started (missing binary, bad cwd, bad user)."""

    code = "exec_error"


class ExecTimeout(DsecError, TimeoutError):
    code = "exec_timeout"


class SessionClosed(DsecError, RuntimeError):
    code = "session_closed"


class FileAccessError(DsecError, OSError):
    """A files-API request was refused or failed (traversal, not found, not a dir)."""

    code = "file_error"


class QuotaExceeded(DsecError, RuntimeError):
    code = "quota_exceeded"


class Backpressure(DsecError, RuntimeError):
    """Too busy now; retry after ``retry_after`` seconds (HTTP 429)."""

    code = "backpressure"

    def __init__(self, message: str, *, retry_after: float = 1.0, **fields: Any) -> None:
        super().__init__(message, retry_after=retry_after, **fields)


class NotFound(DsecError, LookupError):
    """A project, task, token or edge that does not exist (or is not visible to the caller)."""

    code = "not_found"


class Conflict(DsecError, RuntimeError):
    """The resource exists already or is still in use."""

    code = "conflict"


class AuthError(DsecError, PermissionError):
    """Missing, malformed, expired or revoked credentials (HTTP 401)."""

    code = "auth_error"


class Forbidden(DsecError, PermissionError):
    """Valid credentials that do not cover this resource (HTTP 403)."""

    code = "forbidden"


class PayloadTooLarge(DsecError, ValueError):
    """A request body or header section over the server's limit (HTTP 413/431)."""

    code = "too_large"


class HostError(DsecError, RuntimeError):
    """The host lacks something DSec needs (a kernel feature, a binary, privilege)."""

    code = "host_error"


ERRORS_BY_CODE: dict[str, type[DsecError]] = {
    cls.code: cls
    for cls in (
        DsecError,
        InvalidSpec,
        SandboxNotFound,
        SandboxStateError,
        SandboxFailed,
        ImageError,
        LayerNotFound,
        LayerInUse,
        ExecError,
        ExecTimeout,
        SessionClosed,
        FileAccessError,
        QuotaExceeded,
        Backpressure,
        AuthError,
        Forbidden,
        NotFound,
        Conflict,
        PayloadTooLarge,
        HostError,
    )
}


def error_from_wire(payload: dict[str, Any]) -> DsecError:
    """Rebuild the typed error that :meth:`DsecError.to_wire` produced."""
    fields = dict(payload)
    cls = ERRORS_BY_CODE.get(str(fields.pop("code", "")), DsecError)
    message = str(fields.pop("message", "unknown error"))
    return cls(message, **fields)
