"""The DSec error tree.

Every error DSec raises derives from :class:`DsecError` and, where one fits, from
the builtin exception a Python user would expect (``LookupError``,
``TimeoutError``, ``ValueError``...). Errors carry fields, not only prose, and
``code`` names them on the wire and ``http_status`` is their HTTP status:
:data:`ERRORS_BY_CODE` is the one table that maps wire codes to classes in both
directions, and :func:`encode_error` / :func:`decode_error` are the one wire format
(edge, control plane, SDK and the CLI's lean client use them).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, ClassVar


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
    http_status: ClassVar[int] = 500

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
    http_status: ClassVar[int] = 422


class ExceedsCapacity(InvalidSpec):
    """The sandbox asks for more than an edge holds in all, even empty: it can never be placed
    there, and waiting does not help (a full edge answers ``Backpressure`` instead). From the
    control plane: no edge that could run it (its backend, its ``edge_selector``) is big
    enough. Fields: ``asked`` and ``capacity`` (``{"cpu": cores, "memory": bytes, "disk":
    bytes, "sandboxes": n}``: the request, and the whole capacity of the largest such edge),
    ``edge_id`` (that edge), ``reasons`` (the dimensions short: ``cpu``, ``memory``, ``disk``,
    ``count``), ``field``. Ask for at most ``capacity``, or add a larger edge."""

    code = "exceeds_capacity"
    http_status: ClassVar[int] = 422

    DIMENSIONS: ClassVar[tuple[tuple[str, str], ...]] = (
        ("cpu", "cpu"), ("memory", "memory"), ("disk", "disk"), ("count", "sandboxes"))

    @classmethod
    def of(cls, asked: Mapping[str, float], capacity: Mapping[str, float], *, edge_id: str,
           cluster: bool, what: str = "the sandbox", **fields: Any) -> ExceedsCapacity:
        """The error for a request ``asked`` over ``capacity`` (same keys: cpu in cores, memory
        and disk in bytes, sandboxes); ``cluster``: said by the control plane of every edge
        (the largest is ``edge_id``), else by edge ``edge_id`` of itself; ``what`` asks;
        ``fields``: more fields (``reason`` defaults to the first of ``reasons``)."""
        reasons = [r for r, k in cls.DIMENSIONS if float(asked.get(k, 0)) > float(capacity.get(k, 0)) + 1e-9]
        wants = ", ".join(_amount(k, asked.get(k, 0)) for r, k in cls.DIMENSIONS if r in reasons and k != "sandboxes")
        has = ", ".join(_amount(k, capacity.get(k, 0)) for _, k in cls.DIMENSIONS[:3])
        if "count" in reasons:
            wants = ", ".join(x for x in (wants, f"{int(asked.get('sandboxes', 1))} sandbox slot(s)") if x)
            has += f", {int(capacity.get('sandboxes', 0))} sandboxes"
        where = (f"more than any edge can ever hold: the largest, {edge_id}, has {has} in all" if cluster
                 else f"more than {f'edge {edge_id}' if edge_id else 'this edge'} can ever hold: it has {has} in all")
        first = next((k for r, k in cls.DIMENSIONS if r in reasons), "cpu")
        return cls(f"{what} asks for {wants}, {where}; ask for at most that "
                   f"(SandboxSpec.resources; `dsec run/create --cpu/--memory/--disk`) or add a larger edge",
                   **{"asked": dict(asked), "capacity": dict(capacity), "edge_id": edge_id, "reasons": reasons,
                      "reason": reasons[0] if reasons else "",
                      "field": f"resources.{first}" if first != "sandboxes" else "resources", **fields})


def _amount(key: str, value: float) -> str:
    """``cpu 99``, ``memory 3.5 GiB``: one figure of a request or a capacity, as a person reads it."""
    if key in ("memory", "disk"):
        n = float(value)
        for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
            if n >= size:
                return f"{key} {n / size:.3g} {unit}"
        return f"{key} {int(n)} B"
    return f"{key} {float(value):g}"


class SandboxNotFound(DsecError, LookupError):
    code = "sandbox_not_found"
    http_status: ClassVar[int] = 404

    @classmethod
    def ended(cls, sandbox_id: str, state: str, reason: str = "") -> SandboxNotFound:
        """A sandbox the control plane still remembers, but that ended (``stopped``: deleted, expired...)."""
        why = f" ({reason})" if reason else ""
        return cls(f"sandbox {sandbox_id} is {state}{why}: it no longer exists (`dsec ls` lists the running ones)",
                   sandbox_id=sandbox_id, state=state, reason=reason)


class SandboxLost(SandboxNotFound):
    """The control plane lost the sandbox's edge (unreachable for longer than its bound) and
    declared the sandbox lost: its quota was returned, and the edge destroys it when it comes
    back (its state there is not to be trusted). Fields: ``sandbox_id``, ``edge_id``,
    ``reason``. Create another sandbox; a ``SandboxNotFound`` handler catches this too."""

    code = "sandbox_lost"
    http_status: ClassVar[int] = 410


class SandboxStateError(DsecError, RuntimeError):
    """The operation is not allowed in the sandbox's current state."""

    code = "sandbox_state"
    http_status: ClassVar[int] = 409


class SandboxPreempted(SandboxStateError):
    """The scheduler paused the sandbox to make room for more urgent work (its memory is in
    swap; docs/CONTROL.md, "Scheduling"). A request does not wake it: ``resume()`` (through the
    control plane) brings it back when its edge has room, and the SDK does that once by itself
    before it raises this. Fields: ``sandbox_id``, ``by_priority``, ``retry_after`` (seconds,
    when a resume was refused for lack of room)."""

    code = "sandbox_preempted"
    http_status: ClassVar[int] = 409


class SandboxEvicted(SandboxNotFound):
    """The scheduler destroyed the sandbox to make room for more urgent work (its task's
    preemption policy is ``destroy``). Fields: ``sandbox_id``, ``by_priority``. Create another;
    a ``SandboxNotFound`` handler catches this too."""

    code = "sandbox_evicted"
    http_status: ClassVar[int] = 410


class SandboxFailed(DsecError, RuntimeError):
    """The sandbox could not be created or died; ``reason`` says why."""

    code = "sandbox_failed"
    http_status: ClassVar[int] = 410


class ImageError(DsecError, RuntimeError):
    code = "image_error"
    http_status: ClassVar[int] = 400


class LayerNotFound(ImageError, LookupError):
    code = "layer_not_found"
    http_status: ClassVar[int] = 404


class LayerInUse(ImageError):
    code = "layer_in_use"
    http_status: ClassVar[int] = 409


class LayerUnavailable(ImageError, ConnectionError):
    """A layer this node does not hold cannot be fetched now: its registry is unreachable,
    refused, or this node has no registry configured (``digest``, ``registry``, ``status``:
    0 when nothing answered). A create that needs such a layer is refused with it; another
    edge that holds the layer can take the sandbox."""

    code = "layer_unavailable"
    http_status: ClassVar[int] = 503


class ExecError(DsecError, RuntimeError):
    """A command could not be started (missing binary, bad cwd, bad user)."""

    code = "exec_error"
    http_status: ClassVar[int] = 400


class ExecTimeout(DsecError, TimeoutError):
    code = "exec_timeout"
    http_status: ClassVar[int] = 408


class SessionClosed(DsecError, RuntimeError):
    code = "session_closed"
    http_status: ClassVar[int] = 410


class FileAccessError(DsecError, OSError):
    """A files-API request was refused or failed (traversal, not found, not a dir)."""

    code = "file_error"
    http_status: ClassVar[int] = 400


class QuotaExceeded(DsecError, RuntimeError):
    code = "quota_exceeded"
    http_status: ClassVar[int] = 403


class Backpressure(DsecError, RuntimeError):
    """Too busy now; retry after ``retry_after`` seconds (HTTP 429)."""

    code = "backpressure"
    http_status: ClassVar[int] = 429

    def __init__(self, message: str, *, retry_after: float = 1.0, **fields: Any) -> None:
        super().__init__(message, retry_after=retry_after, **fields)


class Unavailable(Backpressure):
    """The service cannot answer now (its store is unreachable, e.g. a database restart):
    retry after ``retry_after`` seconds (HTTP 503). A ``Backpressure`` handler retries it too."""

    code = "unavailable"
    http_status: ClassVar[int] = 503


class NotFound(DsecError, LookupError):
    """A project, task, token or edge that does not exist (or is not visible to the caller)."""

    code = "not_found"
    http_status: ClassVar[int] = 404


class Conflict(DsecError, RuntimeError):
    """The resource exists already or is still in use."""

    code = "conflict"
    http_status: ClassVar[int] = 409


class LeaseInvalid(DsecError, RuntimeError):
    """A create lease the edge will not honour (any more): ``reason`` is ``expired``,
    ``revoked``, ``used up``, ``unknown`` (granted for an earlier run of the edge), ``wrong
    body``, ``ended`` (a grant replayed after it was released) or ``abandoned`` (a part its
    client abandoned before, keeping other slots). Ask the control plane for a fresh lease (the
    SDK does)."""

    code = "lease_invalid"
    http_status: ClassVar[int] = 409


class AuthError(DsecError, PermissionError):
    """Missing, malformed, expired or revoked credentials (HTTP 401)."""

    code = "auth_error"
    http_status: ClassVar[int] = 401


class Forbidden(DsecError, PermissionError):
    """Valid credentials that do not cover this resource (HTTP 403)."""

    code = "forbidden"
    http_status: ClassVar[int] = 403


class PayloadTooLarge(DsecError, ValueError):
    """A request body or header section over the server's limit (HTTP 413/431)."""

    code = "too_large"
    http_status: ClassVar[int] = 413


class Unsupported(DsecError, NotImplementedError):
    """The sandbox's backend does not offer this operation (``operation``, ``backend``):
    a client error, decided before any work is done. Pick a backend that does
    (``SandboxSpec.backend``; ``GET /v1/edges`` lists what each edge offers)."""

    code = "unsupported"
    http_status: ClassVar[int] = 400

    @classmethod
    def operation(cls, op: str, *, backend: str, **fields: Any) -> Unsupported:
        return cls(f"the {backend} backend does not support {op}; create the sandbox on a backend "
                   "that does (SandboxSpec.backend)", operation=op, backend=backend, **fields)


class FnCallFailed(DsecError):
    """A function call did not return a value. Fields: ``stdout``, ``stderr`` (what it
    printed, capped), ``worker`` (the worker sandbox), ``duration_s``."""

    code = "fncall_failed"
    http_status: ClassVar[int] = 500


class FnCallError(FnCallFailed, RuntimeError):
    """The call's code raised: ``exc_type`` (e.g. ``ValueError``, ``numpy.linalg.LinAlgError``),
    ``exc_message`` (``str()`` of the exception; ``message`` is ``"<exc_type>: <exc_message>"``)
    and ``traceback`` (the call's own frames only); or its process ended without returning
    (``exc_type`` ``ProcessExit`` with ``exit_code``, or ``Signal`` with ``signal``)."""

    code = "fncall_error"
    http_status: ClassVar[int] = 422
    exc_type: str
    exc_message: str
    traceback: str


class FnCallTimeout(FnCallFailed, ExecTimeout):
    """The call ran longer than its ``timeout`` (seconds): it and every process it started were killed."""

    code = "fncall_timeout"
    http_status: ClassVar[int] = 408


class FnCallOOM(FnCallFailed, MemoryError):
    """The call ran out of memory: its ``memory`` cap (bytes on top of the warm template;
    a ``MemoryError`` inside the call) or, killed by the kernel, the worker's memory limit."""

    code = "fncall_oom"
    http_status: ClassVar[int] = 422


class FnCallOutputTooLarge(FnCallFailed, ValueError):
    """The call's stdout or stderr, or its JSON result (``what``), went past ``output_cap``
    bytes; a call over the cap on stdout or stderr is killed there."""

    code = "fncall_output_too_large"
    http_status: ClassVar[int] = 422


class FnCallWorkerLost(FnCallFailed, SandboxFailed):
    """The worker running the call died or stopped answering (``reason``); the pool starts
    another. The call may have run partly: retry it if it is idempotent."""

    code = "fncall_worker_lost"
    http_status: ClassVar[int] = 503


class HostError(DsecError, RuntimeError):
    """The host lacks something DSec needs (a kernel feature, a binary, privilege)."""

    code = "host_error"
    http_status: ClassVar[int] = 503


ERRORS_BY_CODE: dict[str, type[DsecError]] = {
    cls.code: cls
    for cls in (
        DsecError,
        InvalidSpec,
        ExceedsCapacity,
        SandboxNotFound,
        SandboxLost,
        SandboxStateError,
        SandboxPreempted,
        SandboxEvicted,
        SandboxFailed,
        ImageError,
        LayerNotFound,
        LayerInUse,
        LayerUnavailable,
        ExecError,
        ExecTimeout,
        SessionClosed,
        FileAccessError,
        QuotaExceeded,
        Backpressure,
        Unavailable,
        AuthError,
        Forbidden,
        NotFound,
        Conflict,
        LeaseInvalid,
        PayloadTooLarge,
        Unsupported,
        HostError,
        FnCallFailed,
        FnCallError,
        FnCallTimeout,
        FnCallOOM,
        FnCallOutputTooLarge,
        FnCallWorkerLost,
    )
}


def error_from_wire(payload: dict[str, Any]) -> DsecError:
    """Rebuild the typed error that :meth:`DsecError.to_wire` produced."""
    fields = dict(payload)
    cls = ERRORS_BY_CODE.get(str(fields.pop("code", "")), DsecError)
    message = str(fields.pop("message", "unknown error"))
    return cls(message, **fields)


def encode_error(exc: DsecError, *, default: Callable[[Any], Any] = str,
                 realm: str | None = None) -> tuple[int, dict[str, Any], dict[str, str]]:
    """``(status, body, headers)`` of the HTTP answer for ``exc``: the body is
    ``{"error": {"code", "message", fields...}}``; fields that are not plain JSON go
    through ``default`` (the edge sends a partial ExecResult in its wire form); 429
    carries ``Retry-After``, and 401 ``WWW-Authenticate`` with ``realm`` when given."""
    body = exc.to_wire()
    for key, value in exc.fields.items():
        if key not in body:
            body[key] = default(value)
    headers: dict[str, str] = {}
    status = exc.http_status
    if status in (429, 503):
        retry = float(exc.fields.get("retry_after", 1.0) or 1.0)
        headers["Retry-After"] = str(max(1, math.ceil(retry)))
    elif status == 401 and realm is not None:
        headers["WWW-Authenticate"] = f'Bearer realm="{realm}"'
    return status, {"error": body}, headers


def decode_error(status: int, body: Any, headers: Mapping[str, str] | None = None, *, where: str = "") -> DsecError:
    """The typed error of an HTTP answer with ``status`` ≥ 400 and its JSON ``body``
    (``None`` when it was not JSON): the class its ``code`` names, with its fields,
    ``status`` and a ``retry_after`` from the header when the body has none."""
    headers = {k.lower(): v for k, v in (headers or {}).items()}
    retry = _retry_after(headers)
    if not (isinstance(body, dict) and isinstance(body.get("error"), dict)):
        text = str(body)[:500] if body is not None else ""
        if status == 401:
            return AuthError(f"unauthorized: {text}", status=401)
        if status == 429:
            return Backpressure(f"busy: {text}", retry_after=retry, status=429)
        return DsecError(f"HTTP {status}{f' from {where}' if where else ''}: {text}", status=status)
    payload = dict(body["error"])
    payload.setdefault("status", status)
    if status in (429, 503) and "retry_after" not in payload:
        payload["retry_after"] = retry
    return error_from_wire(payload)


def _retry_after(headers: Mapping[str, str]) -> float:
    try:
        return float(headers.get("retry-after", "1"))
    except ValueError:
        return 1.0
