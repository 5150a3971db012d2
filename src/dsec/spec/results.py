"""Results of running things in a sandbox: pure data, shared by the runtime and the SDK."""

from __future__ import annotations

from dataclasses import dataclass, field


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

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    @property
    def stdout_text(self) -> str:
        return self.stdout.decode(errors="replace")

    @property
    def stderr_text(self) -> str:
        return self.stderr.decode(errors="replace")
