"""Results of running things in a sandbox: pure data, shared by the runtime and the SDK."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final, Literal

LimitKind = Literal["memory", "pids", "timeout", "idle_timeout", "output_cap", "disk_full"]

_HOW_TO_RAISE: Final[dict[str, str]] = {
    "memory": "--memory / Resources.memory",
    "pids": "--pids / Resources.pids",
    "timeout": "--timeout / timeout=",
    "idle_timeout": "idle_timeout=",
    "output_cap": "--output-cap / SandboxSpec.output_cap",
    "disk_full": "--disk / Resources.disk",
}


def _size(n: float) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            v = n / (1 << shift)
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.1f} {unit}"
    return f"{n:.0f} B"


def limit_message(kind: LimitKind, value: float) -> str:
    """The one line shown for a limit hit: which limit, its value, how to raise it."""
    how = _HOW_TO_RAISE[kind]
    if kind == "memory":
        what = f"killed by the memory limit ({_size(value)})"
    elif kind == "pids":
        what = f"the pids limit ({value:.0f} processes) refused a fork"
    elif kind == "timeout":
        what = f"killed by the timeout ({value:g} s)"
    elif kind == "idle_timeout":
        what = f"killed by the idle timeout (no output for {value:g} s)"
    elif kind == "output_cap":
        what = f"output beyond the output cap ({_size(value)} of head and of tail per stream) was cut from the result"
    else:
        what = f"the writable layer is full (disk quota {_size(value)})"
    return f"dsec: {what}: raise it with {how}"


@dataclass(frozen=True, slots=True)
class LimitHit:
    """A sandbox limit that ended a command, or cut its result short (``output_cap``).

    ``kind``: ``"memory"`` (the OOM killer, inside the sandbox's memory limit), ``"pids"``
    (a fork refused at the pids limit), ``"timeout"``, ``"idle_timeout"``, ``"output_cap"``,
    ``"disk_full"`` (the writable layer at its quota). ``value`` is the limit in force: bytes
    for memory, disk_full and output_cap, a count for pids, seconds for the timeouts.
    ``message`` is one line for a person: which limit, its value, how to raise it.
    """

    kind: LimitKind
    value: float
    message: str

    @classmethod
    def of(cls, kind: LimitKind, value: float) -> LimitHit:
        return cls(kind, value, limit_message(kind, value))


@dataclass(slots=True)
class ExecResult:
    """What a finished command did. ``exit_code`` is None when a signal ended it."""

    exit_code: int | None
    signal: int | None
    stdout: bytes
    stderr: bytes
    stdout_bytes: int
    stderr_bytes: int
    truncated: bool
    duration_s: float
    start_latency_s: float
    timed_out: str | None = None
    """None, "timeout" (overall) or "idle_timeout" (no output for too long)."""
    cpu_user_s: float = 0.0
    cpu_system_s: float = 0.0
    extra: dict[str, object] = field(default_factory=dict)
    limit: LimitHit | None = None
    """The limit that ended the command (or cut its output), judged by the runtime from
    kernel evidence after the command: the sandbox's OOM-kill counter grew and the command
    died by SIGKILL (``memory``); its pids-limit counter grew and the command failed
    (``pids``); the writable layer was full when the failed command ended (``disk_full``);
    its timeouts (``timeout``, ``idle_timeout``, also in ``timed_out``); output past
    ``output_cap`` (``output_cap``, also in ``truncated``). When several apply, the first
    of that order after the timeouts wins. None: no limit was involved, e.g. a plain
    ``exit 1``. ``exit_code``/``signal`` stay what the command did."""

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    @property
    def stdout_text(self) -> str:
        return self.stdout.decode(errors="replace")

    @property
    def stderr_text(self) -> str:
        return self.stderr.decode(errors="replace")
