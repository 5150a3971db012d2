"""Pure data describing sandboxes: no I/O, nothing heavy imported.

Sizes are bytes, times are seconds. Every model forbids unknown fields so a typo
is an error, not a silently ignored setting.
"""

from __future__ import annotations

import enum
import re
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, field_validator

_LAYER_REF = re.compile(r"^(sha256:[0-9a-f]{64}|[a-z0-9][a-z0-9._-]{0,127}(:[A-Za-z0-9._-]{1,128})?)$")


def _check_ref(value: str) -> str:
    if not _LAYER_REF.match(value):
        raise ValueError(
            f"{value!r} is not a layer reference: use NAME[:TAG] (lowercase name) or sha256:<64 hex>"
        )
    return value


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ImageRef(_Model):
    """The three kinds of read-only layers under a sandbox's writable upper."""

    base: str
    workspace: str | None = None
    toolkits: tuple[str, ...] = ()

    @field_validator("base", "workspace")
    @classmethod
    def _ref(cls, v: str | None) -> str | None:
        return None if v is None else _check_ref(v)

    @field_validator("toolkits")
    @classmethod
    def _refs(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if len(v) > 8:
            raise ValueError("at most 8 toolkit layers")
        return tuple(_check_ref(x) for x in v)

    def layers_top_first(self) -> list[str]:
        """Overlay order: toolkits (last given is topmost), workspace, base."""
        out = list(reversed(self.toolkits))
        if self.workspace:
            out.append(self.workspace)
        out.append(self.base)
        return out


MiB = 1024 * 1024


class Resources(_Model):
    """Per-sandbox limits. Defaults suit an agent editing a repo and running tests."""

    cpu: Annotated[float, Field(gt=0, le=256)] = 1.0
    """CPU quota in cores (CFS quota/period)."""
    cpu_weight: Annotated[int, Field(ge=2, le=262144)] = 1024
    """Relative weight under contention (cgroup v1 cpu.shares)."""
    memory: Annotated[int, Field(ge=16 * MiB, le=1 << 40)] = 1024 * MiB
    """Hard memory limit; includes the writable layer's pages (it is tmpfs)."""
    pids: Annotated[int, Field(ge=8, le=1 << 20)] = 512
    disk: Annotated[int, Field(ge=1 * MiB, le=1 << 40)] = 1024 * MiB
    """Quota of the writable layer."""
    nofile: Annotated[int, Field(ge=16, le=1 << 20)] = 4096


class SandboxSpec(_Model):
    image: ImageRef
    resources: Resources = Resources()
    env: dict[str, str] = Field(default_factory=dict)
    labels: dict[str, str] = Field(default_factory=dict)
    output_cap: Annotated[int, Field(ge=1024, le=64 * MiB)] = 256 * 1024
    """Bytes kept from the head and from the tail of each output stream."""

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        for k, val in v.items():
            if not k or "=" in k or "\0" in k or "\0" in val:
                raise ValueError(f"bad environment variable {k!r}: names need no '=' or NUL")
        return v


class SandboxState(enum.StrEnum):
    CREATING = "creating"
    RUNNING = "running"
    STOPPING = "stopping"
    STOPPED = "stopped"
    FAILED = "failed"
    PAUSED = "paused"
    """Frozen, its memory pushed to swap; any exec, file or session call resumes it."""


# The only legal moves; the runtime and the reconciler both reason from this table.
TRANSITIONS: dict[SandboxState, frozenset[SandboxState]] = {
    SandboxState.CREATING: frozenset({SandboxState.RUNNING, SandboxState.FAILED, SandboxState.STOPPING}),
    SandboxState.RUNNING: frozenset({SandboxState.PAUSED, SandboxState.STOPPING, SandboxState.FAILED}),
    SandboxState.PAUSED: frozenset({SandboxState.RUNNING, SandboxState.STOPPING, SandboxState.FAILED}),
    SandboxState.STOPPING: frozenset({SandboxState.STOPPED, SandboxState.FAILED}),
    SandboxState.FAILED: frozenset({SandboxState.STOPPING}),
    SandboxState.STOPPED: frozenset(),
}


def can_move(src: SandboxState, dst: SandboxState) -> bool:
    return dst in TRANSITIONS[src]


__all__ = [
    "TRANSITIONS",
    "ImageRef",
    "MiB",
    "Resources",
    "SandboxSpec",
    "SandboxState",
    "can_move",
]
