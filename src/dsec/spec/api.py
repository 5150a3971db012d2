"""Wire models shared by the SDK, the control plane and the edge agent.

Pure data. The HTTP contract (paths, auth, status codes) is in docs/API.md;
these models are its bodies. Errors travel as ``{"error": DsecError.to_wire()}``
with the status from :data:`STATUS_BY_CODE`.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from dsec.spec import SandboxSpec, SandboxState

_LABEL_KEY = re.compile(r"^[a-z0-9]([a-z0-9._/-]{0,62})$")


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _check_labels(v: dict[str, str]) -> dict[str, str]:
    if len(v) > 64:
        raise ValueError("at most 64 labels")
    for k, val in v.items():
        if not _LABEL_KEY.match(k):
            raise ValueError(f"label key {k!r}: lowercase letters, digits and . _ / - (max 63)")
        if len(val) > 253 or "\0" in val:
            raise ValueError(f"label {k!r}: value too long or contains NUL")
    return v


class Lifecycle(_Wire):
    ttl_s: Annotated[float, Field(gt=0, le=7 * 86400)] = 3600.0
    """Maximum lifetime; the edge destroys the sandbox after it."""
    idle_timeout_s: Annotated[float | None, Field(gt=0)] = None
    """Destroy after this long with no exec or file activity (None: never)."""


class CreateSandbox(_Wire):
    """Body of ``POST /v1/sandboxes`` (control plane) and of the edge's create."""

    spec: SandboxSpec
    lifecycle: Lifecycle = Lifecycle()
    labels: dict[str, str] = Field(default_factory=dict)
    task: str | None = None
    request_id: Annotated[str | None, Field(max_length=128)] = None
    """Client-chosen idempotency key: the same key creates at most one sandbox."""

    @field_validator("labels")
    @classmethod
    def _labels(cls, v: dict[str, str]) -> dict[str, str]:
        return _check_labels(v)


class CreateBatch(_Wire):
    """Body of ``POST /v1/sandboxes/batch``: ``count`` sandboxes of one spec."""

    spec: SandboxSpec
    count: Annotated[int, Field(ge=1, le=1000)]
    lifecycle: Lifecycle = Lifecycle()
    labels: dict[str, str] = Field(default_factory=dict)
    task: str | None = None
    request_id: Annotated[str | None, Field(max_length=128)] = None

    @field_validator("labels")
    @classmethod
    def _labels(cls, v: dict[str, str]) -> dict[str, str]:
        return _check_labels(v)


class SandboxInfo(_Wire):
    id: str
    state: SandboxState
    edge_id: str
    edge_url: str
    """Where exec and file traffic goes (the data path)."""
    token: str | None = None
    """Short-lived bearer token scoped to this sandbox, for the edge."""
    token_expires_at: float | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    task: str | None = None
    project: str | None = None
    created_at: float
    expires_at: float | None = None
    reason: str = ""


class BatchItem(_Wire):
    sandbox: SandboxInfo | None = None
    error: dict[str, Any] | None = None


class BatchResult(_Wire):
    items: list[BatchItem]


class ExecRequest(_Wire):
    cmd: list[str] | str
    env: dict[str, str] = Field(default_factory=dict)
    cwd: str = "/"
    user: int | str = 0
    stdin_b64: str | None = None
    timeout: Annotated[float | None, Field(gt=0)] = 600.0
    idle_timeout: Annotated[float | None, Field(gt=0)] = None


class ExecResultWire(_Wire):
    exit_code: int | None
    signal: int | None
    stdout_b64: str
    stderr_b64: str
    stdout_bytes: int
    stderr_bytes: int
    truncated: bool
    duration_s: float
    timed_out: str | None = None


class StreamChunk(_Wire):
    """One NDJSON line of ``/exec/stream``: output as produced, then the result."""

    kind: Literal["stdout", "stderr", "result", "error"]
    data_b64: str | None = None
    result: ExecResultWire | None = None
    error: dict[str, Any] | None = None


class SessionRun(_Wire):
    command: str
    timeout: Annotated[float | None, Field(gt=0)] = 600.0


class FileEntry(_Wire):
    path: str
    name: str
    type: str
    size: int
    mode: int
    uid: int
    gid: int
    mtime: float
    target: str | None = None


class EdgeHealth(_Wire):
    edge_id: str
    url: str
    sandboxes: int
    capacity_sandboxes: int
    cpu_committed: float
    cpu_capacity: float
    memory_committed: int
    memory_capacity: int
    disk_committed: int
    disk_capacity: int
    layers: list[str] = Field(default_factory=list)
    """Digests (and name:tag refs) of the layers this edge holds."""
    pools: dict[str, int] = Field(default_factory=dict)
    draining: bool = False
    labels: dict[str, str] = Field(default_factory=dict)


# The one table from error code to HTTP status (the SDK maps back with ERRORS_BY_CODE).
STATUS_BY_CODE: dict[str, int] = {
    "invalid_spec": 422,
    "sandbox_not_found": 404,
    "layer_not_found": 404,
    "sandbox_state": 409,
    "layer_in_use": 409,
    "sandbox_failed": 410,
    "exec_error": 400,
    "exec_timeout": 408,
    "session_closed": 410,
    "file_error": 400,
    "quota_exceeded": 403,
    "backpressure": 429,
    "auth_error": 401,
    "forbidden": 403,
    "image_error": 400,
    "host_error": 503,
    "dsec_error": 500,
}
