"""What a function call returns, and how it fails: pure data, nothing heavy imported.

The SDK decodes the edge's answers into these too, so this module imports only
:mod:`dsec.errors` and the standard library.

Every failure of a call is a :class:`FnCallFailed`; each kind also inherits the
builtin (or DSec error) a Python user would expect: a timeout is a
:class:`~dsec.errors.ExecTimeout` (so a ``TimeoutError``), running out of the
call's memory a ``MemoryError``. :data:`FNCALL_ERRORS_BY_CODE` maps their wire
codes to the classes (``dsec.errors.ERRORS_BY_CODE`` is a fixed table of the
core classes and does not list these).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from dsec.errors import DsecError, ExecTimeout, SandboxFailed


@dataclass(frozen=True, slots=True)
class FnResult:
    """A call that returned: its JSON ``value`` and what it printed."""

    value: Any
    stdout: str = ""
    stderr: str = ""
    duration_s: float = 0.0
    """From the pool's (or the SDK's) request to the answer."""
    run_s: float = 0.0
    """The call's own code: from its first statement to its return."""
    worker: str = ""
    """The worker sandbox that ran it."""

    def to_wire(self) -> dict[str, Any]:
        return {"ok": True, "value": self.value, "stdout": self.stdout, "stderr": self.stderr,
                "duration_s": self.duration_s, "run_s": self.run_s, "worker": self.worker}

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> FnResult:
        return cls(value=d.get("value"), stdout=str(d.get("stdout", "")), stderr=str(d.get("stderr", "")),
                   duration_s=float(d.get("duration_s", 0.0)), run_s=float(d.get("run_s", 0.0)),
                   worker=str(d.get("worker", "")))


@dataclass(frozen=True, slots=True)
class FnCall:
    """One call of a batch (``call_many``): the source and its arguments."""

    source: str
    args: Sequence[Any] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    entry: str | None = None
    """The function to call (default ``main`` when the source defines it)."""


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


FNCALL_ERRORS: tuple[type[FnCallFailed], ...] = (
    FnCallFailed, FnCallError, FnCallTimeout, FnCallOOM, FnCallOutputTooLarge, FnCallWorkerLost,
)
FNCALL_ERRORS_BY_CODE: dict[str, type[FnCallFailed]] = {cls.code: cls for cls in FNCALL_ERRORS}

FnOutcome = FnResult | FnCallFailed
"""One item of a batch: a result, or the call's typed failure (returned, not raised)."""


def outcome_to_wire(outcome: FnOutcome) -> dict[str, Any]:
    """One call's answer as JSON: ``{"ok": true, "value": ...}`` or ``{"ok": false, "error": {...}}``."""
    if isinstance(outcome, FnResult):
        return outcome.to_wire()
    return {"ok": False, "error": outcome.to_wire()}


def outcome_from_wire(d: Mapping[str, Any]) -> FnOutcome:
    if d.get("ok"):
        return FnResult.from_wire(d)
    err = dict(d.get("error") or {})
    cls = FNCALL_ERRORS_BY_CODE.get(str(err.pop("code", "")), FnCallFailed)
    message = str(err.pop("message", "function call failed"))
    return cls(message, **err)
