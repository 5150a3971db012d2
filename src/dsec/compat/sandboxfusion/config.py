"""Settings of the SandboxFusion-compatible API (``ControlConfig.sandboxfusion``). Pure data."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

MiB = 1024 * 1024


class SandboxFusionConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    """Serve ``<prefix>/run_code``, ``<prefix>/run_jupyter`` and ``<prefix>/v1/ping``."""
    prefix: Annotated[str, Field(pattern=r"^(/[a-z0-9][a-z0-9_.-]*)+$")] = "/sandboxfusion"
    suite: Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9.-]*$")] = "bookworm"
    """The tag of the toolchain layers (``tc-base:<suite>``, ``tc-<language>:<suite>``)."""
    backend: Annotated[str, Field(pattern=r"^[a-z][a-z0-9_-]{0,31}$")] = "container"
    cpu: Annotated[float, Field(gt=0, le=256)] = 1.0
    """Cores of each request's sandbox (a CFS quota: compile and run get one core)."""
    default_memory_mb: Annotated[int, Field(ge=16, le=1 << 20)] = 1024
    """The memory limit of a request that gives none (``memory_limit_MB`` -1 or left out)."""
    max_memory_mb: Annotated[int, Field(ge=16, le=1 << 20)] = 16384
    """A larger ``memory_limit_MB`` is refused (422); a smaller one than 16 gets 16."""
    disk_mb: Annotated[int, Field(ge=16, le=1 << 20)] = 1024
    pids: Annotated[int, Field(ge=16, le=1 << 20)] = 512
    output_cap: Annotated[int, Field(ge=1024, le=64 * MiB)] = 1 * MiB
    """Bytes of each stage's stdout and stderr sent back (SandboxFusion sends up to 1 MiB)."""
    max_timeout_s: Annotated[float, Field(gt=0, le=86400)] = 3600.0
    """Longer ``compile_timeout`` / ``run_timeout`` / ``total_timeout`` are refused (422)."""
    ceiling: Annotated[int, Field(ge=1, le=100_000)] = 512
    """At most this many sandboxes in flight for this API per control-plane replica; fewer
    when the cluster refuses creates (compat/window.py)."""
    queue_timeout_s: Annotated[float, Field(gt=0, le=3600)] = 10.0
    """How long a request may wait for room before it is answered 504 (which both verl and
    the sandbox-fusion client retry). 10 s is the margin verl's client allows above the
    compile and run timeouts before it gives up on a request."""
    max_waiting: Annotated[int, Field(ge=0, le=1_000_000)] = 4096
    """Requests waiting for room beyond this are answered 504 at once."""
