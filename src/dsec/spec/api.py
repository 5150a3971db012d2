"""Wire models shared by the SDK, the control plane and the edge agent.

Pure data. The HTTP contract (paths, auth, status codes) is in docs/API.md;
these models are its bodies. Errors travel as ``{"error": DsecError.to_wire()}``
with the status from :data:`STATUS_BY_CODE`.
"""

from __future__ import annotations

import posixpath
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from dsec.errors import ERRORS_BY_CODE
from dsec.spec import (
    ImageRef,
    MiB,
    NetworkPolicy,
    Resources,
    SandboxSpec,
    SandboxState,
    drop_unknown,
)
from dsec.spec.results import LimitKind

_LABEL_KEY = re.compile(r"^[a-z0-9]([a-z0-9._/-]{0,62})$")


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _lenient(cls, data: object, info: ValidationInfo) -> object:
        return drop_unknown(cls, data, info)  # under LENIENT: a newer peer's fields are dropped


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
    auto_pause_s: Annotated[float | None, Field(gt=0)] = None
    """Pause after this long with no activity (None: the edge's default, which is never
    unless configured). Any later request resumes it. Paused time counts toward the
    TTL and the idle timeout (docs/SNAPSHOTS.md)."""


class CreateSandbox(_Wire):
    """Body of ``POST /v1/sandboxes`` (control plane) and of the edge's create."""

    spec: SandboxSpec
    lifecycle: Lifecycle = Lifecycle()
    labels: dict[str, str] = Field(default_factory=dict)
    task: str | None = None
    request_id: Annotated[str | None, Field(max_length=128)] = None
    """Client-chosen idempotency key: the same key creates at most one sandbox."""
    edge_selector: dict[str, str] = Field(default_factory=dict)
    """Placement: only edges whose labels include all of these (control plane only)."""

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
    request_id: Annotated[str | None, Field(max_length=123)] = None
    """Item ``i`` is created with the key ``<request_id>/<i>``: a retried batch creates no extra sandbox.
    At most 123 characters, so that every item's key fits a create's 128 (``/<i>``, i < 1000)."""
    edge_selector: dict[str, str] = Field(default_factory=dict)

    @field_validator("labels")
    @classmethod
    def _labels(cls, v: dict[str, str]) -> dict[str, str]:
        return _check_labels(v)


class PreemptionInfo(_Wire):
    """How the scheduler preempted a sandbox (``SandboxInfo.preemption``; docs/CONTROL.md,
    "Scheduling"). ``pause``: it is paused, its memory in swap, and ``resume`` brings it back
    when its edge has room; ``destroy``: it is gone (its task allows that)."""

    at: float
    action: Literal["pause", "destroy"]
    by_priority: int
    """The priority of the create (or resume) that needed its room."""
    priority: int
    """Its own priority when it was preempted."""
    reason: str = ""


class Preempt(_Wire):
    """Body of the edge's ``POST /v1/sandboxes/{id}/preempt`` (edge-admin: the control plane's
    scheduler): ``pause`` (memory to swap, no longer counted; only a resume wakes it) or
    ``destroy``."""

    action: Literal["pause", "destroy"] = "pause"
    by_priority: Annotated[int | None, Field(ge=0, le=1000)] = None
    reason: Annotated[str, Field(max_length=300)] = ""


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
    from_pool: bool = False
    """The edge served this create from a warm pool."""
    image: ImageRef | None = None
    resources: Resources | None = None
    stage: str | None = None
    """The stage in force now (``set_stage``); None: the sandbox has no stages or never entered one."""
    network: NetworkPolicy | None = None
    """The network policy in force now (the stage's, or the last ``set_policy``); None: loopback only."""
    stages: list[str] = Field(default_factory=list)
    """Names of the stages this sandbox can be switched to."""
    backend: str = "container"
    """The execution backend running it (``SandboxSpec.backend``)."""
    request_id: str | None = None
    """Edge answers only: the key its create carried (the control plane's reservation key),
    so the control plane matches a sandbox whose create answer it never recorded exactly."""
    epoch: int | None = None
    """Edge answers only: the edge's fencing epoch when the sandbox was made (docs/CONTROL.md,
    "Fencing"); a fence at a higher epoch destroys it."""
    preemption: PreemptionInfo | None = None
    """Control-plane answers: set while the sandbox is paused by preemption, or when preemption
    destroyed it."""


class EdgeCreateSandbox(CreateSandbox):
    """Body of the edge's ``POST /v1/sandboxes`` (control plane -> edge).

    ``id`` may be left out: the edge then picks ``<edge-id>-<12 hex>`` and may
    serve the create from a warm pool (a pooled sandbox already has its id).
    ``request_id`` makes the create idempotent on the edge too.
    """

    id: Annotated[str | None, Field(max_length=63)] = None
    project: Annotated[str | None, Field(max_length=253)] = None


class CreateLease(_Wire):
    """Body of ``POST /v1/leases``: the right to create ``count`` sandboxes of one spec directly
    on edges, for ``lease_ttl_s`` (docs/CONTROL.md, "Create leases"). The quota is charged when
    granted; what is not used is returned when the lease is released or expires."""

    spec: SandboxSpec
    count: Annotated[int, Field(ge=1, le=100_000)]
    lifecycle: Lifecycle = Lifecycle()
    labels: dict[str, str] = Field(default_factory=dict)
    task: str | None = None
    request_id: Annotated[str | None, Field(max_length=128)] = None
    """A retried grant with the same key answers the same leases (no second charge)."""
    edge_selector: dict[str, str] = Field(default_factory=dict)
    lease_ttl_s: Annotated[float, Field(gt=0, le=300)] = 30.0
    """How long the edges honour the leases."""
    ahead: bool = False
    """A lease held ahead of creates not asked for yet (the SDK's ``create``): granted whole or
    not at all (429), only while it takes at most half of the quota left, and handed back when
    a create of the project is refused for quota."""

    @field_validator("labels")
    @classmethod
    def _labels(cls, v: dict[str, str]) -> dict[str, str]:
        return _check_labels(v)


class EdgeLease(_Wire):
    """One edge's part of a grant: ``slots`` creates there with ``token`` (scope ``lease``)."""

    lease_id: str
    edge_id: str
    edge_url: str
    slots: int
    token: str


class LeaseGrant(_Wire):
    """Answer of ``POST /v1/leases``. ``body`` is what every sandbox is made from: send it as is
    (the token binds its hash). ``short`` sandboxes were not granted; ``error`` says why (the
    wire form of a ``quota_exceeded`` or ``backpressure``)."""

    id: str
    expires_at: float
    body: dict[str, Any]
    leases: list[EdgeLease]
    short: int = 0
    error: dict[str, Any] | None = None


class LeaseCreate(_Wire):
    """Body of the edge's ``POST /v1/leases/{lease_id}/sandboxes`` (lease token): ``count``
    sandboxes of ``body``, item ``i`` keyed ``<request_id>/<i>`` (a retried call makes none twice)."""

    body: dict[str, Any]
    count: Annotated[int, Field(ge=1, le=1000)]
    request_id: Annotated[str, Field(min_length=1, max_length=120)]


class LeaseReportItem(_Wire):
    """One sandbox made under a lease, as the control plane records it."""

    key: str
    """The lease slot it used (the control plane's reservation key)."""
    id: str
    state: SandboxState
    created_at: float
    expires_at: float | None = None
    reason: str = ""


class LeaseReport(_Wire):
    """Edge -> control plane (``POST /v1/edges/{id}/leases/report``, edge-admin): sandboxes made
    under leases, so the control plane records them at once (the watcher's reconcile would
    find them too, later)."""

    items: list[LeaseReportItem]


class LeaseReleased(_Wire):
    """Answer of ``DELETE /v1/leases/{grant_id}`` (control plane) and of the edge's
    ``DELETE /v1/leases/{lease_id}``: sandboxes made under it, and what was returned."""

    made: int = 0
    returned: int = 0
    pending: list[str] = Field(default_factory=list)
    """Parts whose edge could not be told (they close when they expire)."""
    sandboxes: list[LeaseReportItem] = Field(default_factory=list)


class AbandonLease(_Wire):
    """Body of ``POST /v1/leases/{grant_id}/abandon``: the SDK does not know what became of a
    chunk it sent to this part's edge (docs/CONTROL.md, "Create leases"). ``held``: the slot keys
    (``SandboxInfo.request_id`` of the edge's answers) of every sandbox the SDK got under this part;
    every other slot is given up, and whatever the edge made under one is destroyed."""

    lease_id: Annotated[str, Field(min_length=1, max_length=24)]
    held: Annotated[list[Annotated[str, Field(max_length=32)]], Field(max_length=100_000)] = Field(
        default_factory=list)
    request_id: Annotated[str, Field(min_length=1, max_length=128)]
    """A retried abandon (another replica, a lost answer) with the same key and ``held`` is answered
    the same decision; the same key with another ``held`` is a 422."""


class LeaseAbandoned(_Wire):
    """Answer of ``POST /v1/leases/{grant_id}/abandon``: the part is closed; ``kept`` slots stay
    the SDK's, ``returned`` reservations were dropped (their quota is back), ``stopped``: sandboxes
    the edge had made (and reported) under slots given up, being destroyed there."""

    lease_id: str
    kept: int
    returned: int
    stopped: list[str] = Field(default_factory=list)
    edge_told: bool = False
    """The edge answered the revocation (else it learns by its lease's expiry, and what it made
    meanwhile is destroyed when it reports or is reconciled)."""
    replayed: bool = False


class BatchItem(_Wire):
    sandbox: SandboxInfo | None = None
    error: dict[str, Any] | None = None


class BatchResult(_Wire):
    items: list[BatchItem]


def _check_pristine(v: list[str]) -> list[str]:
    if len(v) > 64:
        raise ValueError("at most 64 pristine paths")
    for p in v:
        if not p.startswith("/") or "\0" in p or len(p) > 4096:
            raise ValueError(f"pristine path {p!r} must be absolute (start with /)")
        if posixpath.normpath(p) != p.rstrip("/") and p != "/":
            raise ValueError(f"pristine path {p!r} is not normalised: write {posixpath.normpath(p)!r}")
        if p == "/":
            raise ValueError("pristine path '/' would hide the whole sandbox; name the directories to restore")
    return v


def _check_utf8(v: Any) -> Any:
    """A string must have a UTF-8 form: argv, environment and paths are bytes to the kernel,
    and JSON can spell a lone surrogate (``"\\ud800"``), which has none."""
    items = [*v, *v.values()] if isinstance(v, dict) else v if isinstance(v, list) else [v]
    for s in items:
        if isinstance(s, str) and not s.isascii():
            try:
                s.encode()
            except UnicodeEncodeError:
                raise ValueError("a string has a character with no UTF-8 form (a lone surrogate)") from None
    return v


class ExecRequest(_Wire):
    cmd: list[str] | str
    env: dict[str, str] = Field(default_factory=dict)
    cwd: str = "/"
    user: int | str = 0
    stdin_b64: str | None = None
    timeout: Annotated[float | None, Field(gt=0)] = 600.0
    idle_timeout: Annotated[float | None, Field(gt=0)] = None
    pristine: list[str] = Field(default_factory=list)
    """Paths the command sees as they are in the image layers, whatever the sandbox did to
    them (evaluation integrity: an agent that edited /tests or replaced /bin/sh cannot
    change the verdict). Other paths are the sandbox's own."""
    output_cap: Annotated[int | None, Field(ge=1024, le=64 * MiB)] = None
    """Bytes kept of the head and of the tail of each output stream, for this command. None:
    the result keeps the sandbox's ``output_cap``, and ``/exec/stream`` carries everything.
    Given: the result keeps this much, and the stream sends the head as produced, then the
    tail at the end with the bytes dropped between them in ``dropped_bytes``."""

    @field_validator("pristine")
    @classmethod
    def _pristine(cls, v: list[str]) -> list[str]:
        return _check_pristine(_check_utf8(v))

    @field_validator("cmd", "env", "cwd", "user")
    @classmethod
    def _utf8(cls, v: Any) -> Any:
        return _check_utf8(v)


class LimitHitWire(_Wire):
    """:class:`dsec.spec.results.LimitHit` on the wire: the limit that ended a command."""

    kind: LimitKind
    value: int | float
    """Bytes (memory, disk_full, output_cap), a count (pids) or seconds (timeouts)."""
    message: str
    """One line: which limit, its value, how to raise it."""


class ExecResultWire(_Wire):
    exit_code: int | None = None
    signal: int | None = None
    stdout_b64: str
    stderr_b64: str
    stdout_bytes: int
    stderr_bytes: int
    truncated: bool
    duration_s: float
    timed_out: str | None = None
    limit: LimitHitWire | None = None
    """Set when a sandbox limit ended the command (or cut its output): see ``ExecResult.limit``."""
    start_latency_s: float = 0.0
    """From the edge's request to the command's execve."""
    cpu_user_s: float = 0.0
    """CPU time of the command and the children it waited for (rusage), user mode."""
    cpu_system_s: float = 0.0


class StreamChunk(_Wire):
    """One NDJSON line of ``/exec/stream``: output as produced, then the result."""

    kind: Literal["stdout", "stderr", "result", "error"]
    data_b64: str | None = None
    result: ExecResultWire | None = None
    error: dict[str, Any] | None = None
    dropped_bytes: int | None = None
    """Output bytes of this stream left out before this chunk: only with an ``output_cap``
    in the request, on the chunk that carries the tail. A slow reader loses nothing (the
    command waits for it)."""


class SandboxStats(_Wire):
    """Answer of ``GET /v1/sandboxes/{id}/stats``: what a sandbox uses now, beside its limits."""

    id: str
    state: SandboxState
    cpu_s: float
    """CPU time (user + system) of the sandbox's processes alive now, in seconds. Two reads give
    its CPU use between them (a process that ended in between no longer counts)."""
    cpu_limit: float
    """Cores (``Resources.cpu``)."""
    memory_bytes: int
    memory_limit: int
    disk_bytes: int
    """Bytes its writable layer holds."""
    disk_limit: int
    pids: int
    pids_limit: int


class SetStage(_Wire):
    """Body of ``POST /v1/sandboxes/{id}/stage``."""

    stage: Annotated[str, Field(pattern=r"^[a-z][a-z0-9_-]{0,62}$")]
    """One of the stages declared in the sandbox's spec."""


class NetworkInfo(_Wire):
    """Answer of ``GET /v1/sandboxes/{id}/network``."""

    sandbox_id: str
    ip: str | None = None
    """The sandbox's address on the edge's sandbox subnet; None: loopback only."""
    policy: NetworkPolicy | None = None
    """In force now; None: no network at all."""
    stage: str | None = None
    denied: int = 0
    """Packets refused by the policy since the sandbox started (or was re-adopted)."""
    recent_denied: list[str] = Field(default_factory=list)
    """Destinations of the latest refused attempts, newest last (``ip:port/proto``)."""
    detail: dict[str, Any] = Field(default_factory=dict)
    """Anything else the runtime reports (counters per rule, resolved addresses, ...)."""


class SessionOpen(_Wire):
    """Optional body of ``POST /v1/sandboxes/{id}/sessions``."""

    env: dict[str, str] = Field(default_factory=dict)
    cwd: str = "/"
    user: int | str = 0


class SessionOpened(_Wire):
    session_id: str


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


class PauseReport(_Wire):
    """Answer of ``POST /v1/sandboxes/{id}/pause``."""

    id: str
    state: SandboxState
    freeze_s: float
    """Seconds until every process was frozen."""
    seconds: float
    """The whole pause, reclaim included."""
    memory_before: int | None = None
    """Bytes the sandbox held in RAM when frozen (its memory cgroup)."""
    memory_after: int | None = None
    """... and after its memory went to swap."""
    swapped: int | None = None


class SnapshotRequest(_Wire):
    """Body of ``POST /v1/sandboxes/{id}/snapshot``."""

    name: Annotated[str | None, Field(pattern=r"^[a-z0-9][a-z0-9._-]{0,127}$")] = None
    """Default ``snap-<sandbox id>``."""
    tag: Annotated[str | None, Field(pattern=r"^[A-Za-z0-9._-]{1,128}$")] = None
    """Default ``latest`` when a name is given, else a UTC timestamp."""
    exclude: Annotated[list[Annotated[str, Field(min_length=1, max_length=4096)]], Field(max_length=256)] = Field(
        default_factory=list)
    """``/abs/path`` (and below; globs allowed) or a bare name matched at any depth (``*.pyc``)."""


class SnapshotInfo(_Wire):
    """A snapshot layer (``kind`` is ``snapshot``); start sandboxes with ``ImageRef(base=ref or digest)``."""

    digest: str
    name: str
    tag: str
    ref: str
    kind: str
    size: int
    """Bytes of the EROFS image."""
    created_at: float
    parents: list[str]
    """Its lineage, top first: the layers it was taken over."""
    sandbox_id: str | None = None
    bytes: int | None = None
    """File data packed (before compression)."""
    frozen_s: float | None = None
    """Seconds the sandbox was frozen while its writable layer was copied out."""
    seconds: float | None = None
    collapsed: int | None = None
    """Snapshot layers beneath it that were merged into it (a long chain collapsed)."""


class ForkRequest(_Wire):
    """Body of ``POST /v1/sandboxes/{id}/fork``."""

    n: Annotated[int, Field(ge=1, le=1000)]
    exclude: Annotated[list[Annotated[str, Field(min_length=1, max_length=4096)]], Field(max_length=256)] = Field(
        default_factory=list)
    lifecycle: Lifecycle | None = None
    """Default: the parent's TTL, idle timeout and auto-pause, counted from the fork."""
    labels: dict[str, str] | None = None
    """Default: the parent's labels."""

    @field_validator("labels")
    @classmethod
    def _labels(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        return None if v is None else _check_labels(v)


class GroupResult(_Wire):
    """Answer of a group pause or resume: sandbox ids done, skipped (already there), failed."""

    done: list[str] = Field(default_factory=list)
    skipped: list[str] = Field(default_factory=list)
    errors: dict[str, dict[str, Any]] = Field(default_factory=dict)
    """Sandbox id -> ``{"code", "message", ...}`` as in error bodies."""
    seconds: float = 0.0


class FnCallLeaseRequest(_Wire):
    """Where may this caller send function calls for ``image`` (``POST /v1/fncall/lease``)?"""

    image: ImageRef | str | None = None


class FnCallLease(_Wire):
    """An edge that runs the fncall backend and a token (scope ``fncall``) to call it with:
    the SDK sends calls straight there until ``expires_at`` (the control plane is never on
    a call's path)."""

    edge_id: str
    edge_url: str
    token: str
    expires_at: float


class EdgeHealth(_Wire):
    """An edge's health report (register, heartbeat, the watcher's poll). Unknown fields are
    ignored: during a rolling upgrade a newer edge reports more than an older control plane
    reads, and must not be taken for dead because of it."""

    model_config = ConfigDict(extra="ignore")

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
    pool_targets: dict[str, int] = Field(default_factory=dict)
    """Configured size of each warm pool (``pools`` holds the ready count)."""
    host: dict[str, float] = Field(default_factory=dict)
    """Node use: cpu_util (0..1 since the last report), load1, cpu_cores, memory_total,
    memory_available, disk_total, disk_free (bytes, of the edge's state directory),
    store_total, store_free (bytes, of the disk holding writable layers)."""
    paused: int = 0
    """Sandboxes paused now (they count in ``sandboxes`` and in the committed resources)."""
    healthy: bool = True
    """False while the node's host state is broken in a way the edge could not repair
    (``problems`` says what); the edge repairs what it can by itself (``repairs``)."""
    problems: list[str] = Field(default_factory=list)
    """What is wrong on the node, each naming exactly what and where (a layer that is not
    mounted and why it cannot be, a cgroup directory that cannot be made, ...)."""
    repairs: list[str] = Field(default_factory=list)
    """The latest host-state repairs the edge made (``<UTC time> <what>``), oldest first."""
    runtime: str = ""
    """The name of the edge's runtime, which names its host resources (cgroups
    ``dsec/<runtime>``, the run directory ``<run_dir>/<runtime>``)."""
    backends: dict[str, list[str]] = Field(default_factory=lambda: {"container": list[str]()})
    """The execution backends this edge runs, each with the operations it offers
    (:class:`dsec.backends.base.Capability` values); placement honours ``SandboxSpec.backend``."""
    backend_facts: dict[str, dict[str, str]] = Field(default_factory=dict)
    """What some backends run on, by kind: the microVM backend's accelerator (``vm_accel``:
    ``kvm`` or ``tcg``, and ``vm_accel_reason``), QEMU build and guest kernel."""
    epoch: int = 0
    """The highest fence this edge has applied (docs/CONTROL.md, "Fencing"): a control plane
    whose record of the edge has a higher epoch fences it before placing anything there."""
    boot_id: str = ""
    """Changes every time the edge process starts: create leases name the run of the edge they
    were granted for, and an edge refuses those of an earlier run (it forgot their books)."""
    registry: str = ""
    """The registry this edge loads layers it does not hold from ("" : none): placement may send
    it sandboxes whose layers it lacks (docs/IMAGES.md, "Registry layers on an edge")."""


# Error code -> HTTP status, read off the error classes (each carries its ``http_status``;
# dsec.errors.encode_error / decode_error are the wire format).
STATUS_BY_CODE: dict[str, int] = {code: cls.http_status for code, cls in ERRORS_BY_CODE.items()}


# ---------------------------------------------------------------------------
# Control plane: IAM, tasks, edges, images (docs/CONTROL.md)

NAME_PATTERN = r"^[a-z0-9][a-z0-9._-]{0,62}$"
"""Projects and tasks: lowercase letters, digits and . _ - (max 63), like label keys."""
EDGE_ID_PATTERN = r"^[a-z][a-z0-9]{0,7}$"
"""Edge ids prefix sandbox ids (``<edge>-<12 hex>``), so they carry no '-'."""


class Quota(_Wire):
    """A project's share: concurrent sandboxes, cores, bytes of memory (all concrete)."""

    sandboxes: Annotated[int, Field(ge=0, le=10**9)]
    cpu: Annotated[float, Field(ge=0, le=10**9)]
    """Cores (the sum of ``Resources.cpu`` of running sandboxes); kept exact to 1/1000."""
    memory: Annotated[int, Field(ge=0, le=1 << 60)]


class TaskQuota(_Wire):
    """A task's ceiling inside its project; ``None`` leaves a dimension to the project."""

    sandboxes: Annotated[int | None, Field(ge=0, le=10**9)] = None
    cpu: Annotated[float | None, Field(ge=0, le=10**9)] = None
    memory: Annotated[int | None, Field(ge=0, le=1 << 60)] = None


class CreateProject(_Wire):
    """Body of ``POST /v1/projects``: the quota is carved out of the parent's."""

    name: Annotated[str, Field(pattern=NAME_PATTERN)]
    parent: Annotated[str | None, Field(pattern=NAME_PATTERN)] = None
    """Default: the caller's project."""
    quota: Quota


class UpdateProject(_Wire):
    """Body of ``PATCH /v1/projects/{name}`` (only an ancestor's token may change it)."""

    quota: Quota


class ProjectInfo(_Wire):
    name: str
    parent: str | None
    quota: Quota
    used: Quota
    """Held by this project's own sandboxes (creating or running)."""
    reserved: Quota
    """Carved out by the child projects (the sum of their quotas)."""
    created_at: float


class CreateToken(_Wire):
    """Body of ``POST /v1/tokens``: a token for the caller's project or a descendant."""

    project: Annotated[str | None, Field(pattern=NAME_PATTERN)] = None
    name: Annotated[str, Field(max_length=128)] = ""


class TokenInfo(_Wire):
    id: str
    project: str
    name: str = ""
    created_at: float
    revoked_at: float | None = None
    token: str | None = None
    """The secret itself: only in the answer of ``POST /v1/tokens`` (stored hashed)."""


class CreateTask(_Wire):
    name: Annotated[str, Field(pattern=NAME_PATTERN)]
    quota: TaskQuota = TaskQuota()


class TaskInfo(_Wire):
    name: str
    project: str
    quota: TaskQuota
    used: Quota
    created_at: float


class DeleteResult(_Wire):
    deleted: int


class DrainEdge(_Wire):
    draining: bool = True


class EdgeInfo(_Wire):
    id: str
    url: str
    status: Literal["alive", "dead", "fencing", "removed"]
    """``alive``: placement uses it; ``dead``: unreachable (no answer for the detection bound),
    placement skips it; ``fencing``: back after its sandboxes were declared lost, not used until it
    has destroyed them; ``removed``: ``dsec edge rm`` (its reports are refused until it joins again)."""
    draining: bool
    last_seen: float | None = None
    registered_at: float
    health: EdgeHealth | None = None
    """The last report (heartbeat or the watcher's poll)."""
    committed: Quota
    """What the control plane has placed there (creating, running, stopping)."""
    epoch: int = 0
    """The control plane's fencing epoch for this edge: raised each time its sandboxes are
    declared lost (docs/CONTROL.md, "Fencing")."""
    lost_at: float | None = None
    """When its sandboxes were last declared lost."""


class EdgeJoin(_Wire):
    """Body of ``POST /v1/edges/join`` (``Authorization: Bearer dsb_...``, an edge bootstrap token)."""

    edge_id: Annotated[str | None, Field(pattern=EDGE_ID_PATTERN)] = None
    """The id this edge asks for; None: the control plane picks a free one."""
    url: Annotated[str, Field(max_length=512)]
    """Where the control plane and SDKs will reach the edge (``http://HOST:PORT``)."""
    labels: dict[str, str] = Field(default_factory=dict)


class EdgeJoined(_Wire):
    """The answer to a join: everything the edge needs to run in this cluster."""

    edge_id: str
    cluster_key: str
    """The cluster's HMAC key (hex): the edge checks sandbox tokens with it and signs its reports."""
    control_plane_urls: list[str]
    """Every control-plane address the edge may report to (it fails over among them)."""
    epoch: int = 0
    """The edge starts at this fencing epoch."""


class CreateEdgeToken(_Wire):
    """Body of ``POST /v1/edges/tokens``: a bootstrap token that lets new edges join."""

    ttl_s: Annotated[float, Field(gt=0, le=30 * 86400)] = 3600.0
    uses: Annotated[int | None, Field(ge=1, le=100_000)] = 1
    """How many joins it allows; None: any number until it expires or is revoked."""
    name: Annotated[str, Field(max_length=128)] = ""


class EdgeTokenInfo(_Wire):
    id: str
    name: str = ""
    created_at: float
    expires_at: float
    uses: int | None = None
    used: int = 0
    revoked_at: float | None = None
    token: str | None = None
    """The secret (``dsb_...``): only in the answer of ``POST /v1/edges/tokens`` (stored hashed)."""


class Fence(_Wire):
    """Body of the edge's ``POST /v1/fence``: destroy every sandbox made before ``epoch``."""

    epoch: Annotated[int, Field(ge=0)]


class FenceResult(_Wire):
    epoch: int
    """The edge's epoch after the call (a fence below it changes nothing)."""
    destroyed: list[str] = Field(default_factory=list)


class LayerInfo(_Wire):
    """``GET /v1/images``: a layer reference, the edges that hold it, and where it is in a
    registry the edges load layers from (``<registry>/<repo>``; "" when it is not there)."""

    ref: str
    edges: list[str]
    registry: str = ""


class Whoami(_Wire):
    project: str
    token_id: str
    projects: list[str]
    """The caller's project and its descendants."""


class AttachOpen(_Wire):
    """First message (JSON text) of the WebSocket ``/v1/sandboxes/{id}/attach``: start a
    command on a terminal (``tty``) or with streamed stdin, or attach to a named terminal.

    After it, the client sends binary frames (input) and JSON text frames (``{"resize":
    {"rows": R, "cols": C}}``, ``{"eof": true}``, ``{"signal": "INT"}``, ``{"detach":
    true}``); the edge sends ``{"attached": ...}`` first, then binary frames whose first
    byte is the stream (1 stdout — all of a terminal's output —, 2 stderr), and
    ``{"exit": {"exit_code": ..., "signal": ...}}`` or ``{"error": {...}}`` last."""

    cmd: list[str] | str | None = None
    """None: the sandbox's shell (bash when the image has it, else sh). A string runs under ``sh -c``."""
    env: dict[str, str] = Field(default_factory=dict)
    cwd: str = "/"
    user: int | str = 0
    tty: bool = True
    rows: Annotated[int, Field(ge=1, le=10_000)] = 24
    cols: Annotated[int, Field(ge=1, le=10_000)] = 80
    name: Annotated[str | None, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")] = None
    """A named terminal outlives the connection: a client that goes away (or detaches)
    leaves it running, and attaching to the name again replays its recent screen output.
    Terminals only (``tty``)."""

    @field_validator("cmd", "env", "cwd", "user")
    @classmethod
    def _utf8(cls, v: Any) -> Any:
        return _check_utf8(v)


class TerminalInfo(_Wire):
    """One named terminal of a sandbox (``GET /v1/sandboxes/{id}/terminals``)."""

    name: str
    pid: int
    cmd: list[str]
    started_at: float
    attached: int
    """Clients attached now."""
