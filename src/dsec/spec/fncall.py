"""What a function call returns, and how it fails: pure data, nothing heavy imported.

The SDK decodes the edge's answers into these too, so this module imports only
:mod:`dsec.errors` and the standard library.

Every failure of a call is a :class:`FnCallFailed`; each kind also inherits the
builtin (or DSec error) a Python user would expect: a timeout is a
:class:`~dsec.errors.ExecTimeout` (so a ``TimeoutError``), running out of the
call's memory a ``MemoryError``. The classes live in :mod:`dsec.errors` (in its one
table of wire codes, ``ERRORS_BY_CODE``) and are re-exported here;
:data:`FNCALL_ERRORS_BY_CODE` is the subset a call's answer can carry.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from dsec.errors import (
    FnCallError,
    FnCallFailed,
    FnCallOOM,
    FnCallOutputTooLarge,
    FnCallTimeout,
    FnCallWorkerLost,
)


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


__all__ = [
    "FNCALL_ERRORS", "FNCALL_ERRORS_BY_CODE", "FnCall", "FnCallError", "FnCallFailed", "FnCallOOM",
    "FnCallOutputTooLarge", "FnCallTimeout", "FnCallWorkerLost", "FnOutcome", "FnResult", "outcome_from_wire",
    "outcome_to_wire",
]

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
