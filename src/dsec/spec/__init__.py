"""Pure data describing sandboxes: no I/O, nothing heavy imported.

Sizes are bytes, times are seconds. Every model forbids unknown fields so a typo
is an error, not a silently ignored setting.
"""

from __future__ import annotations

import enum
import ipaddress
import posixpath
import re
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

_LAYER_REF = re.compile(r"^(sha256:[0-9a-f]{64}|[a-z0-9][a-z0-9._-]{0,127}(:[A-Za-z0-9._-]{1,128})?)$")


def _check_ref(value: str) -> str:
    if not _LAYER_REF.match(value):
        raise ValueError(
            f"{value!r} is not a layer reference: use NAME[:TAG] (lowercase name) or sha256:<64 hex>"
        )
    return value


LENIENT = {"lenient": True}
"""Validation context for bodies a *newer* peer may have written (the SDK reading a control
plane's or an edge's answers): fields this version does not know are dropped instead of
refused, so a server can add fields without breaking older clients. Requests the servers
read are still strict (an unknown field there is a typo, answered with a 422 naming it)."""


def drop_unknown(model: type[BaseModel], data: object, info: ValidationInfo) -> object:
    """The ``mode="before"`` step of every wire model: under :data:`LENIENT`, keep only the
    fields ``model`` knows (by name or alias)."""
    if isinstance(data, dict) and info.context and info.context.get("lenient"):
        fields = model.model_fields
        if any(k not in fields for k in data):
            known = set(fields) | {f.alias for f in fields.values() if f.alias}
            return {k: v for k, v in data.items() if k in known}
    return data


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _lenient(cls, data: object, info: ValidationInfo) -> object:
        return drop_unknown(cls, data, info)


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
    """Hard memory limit. With ``disk_medium="memory"`` it also holds the writable layer's
    files (they are tmpfs pages); with ``"disk"`` (the default) written files are ordinary,
    reclaimable page cache of the node's disk."""
    pids: Annotated[int, Field(ge=8, le=1 << 20)] = 512
    disk: Annotated[int, Field(ge=1 * MiB, le=1 << 40)] = 1024 * MiB
    """Hard quota of the writable layer: writes past it fail with ENOSPC/EDQUOT."""
    disk_medium: Literal["disk", "memory"] = "disk"
    """Where the writable layer lives. ``"disk"`` (default): on the node's disk under a hard
    quota of ``disk`` bytes; file data is page cache, reclaimable, and does not count against
    ``memory`` beyond what the kernel keeps cached. ``"memory"``: a tmpfs of ``disk`` bytes,
    for small, short-lived sandboxes; every byte written is charged to ``memory`` (a sandbox
    that writes more than its memory limit allows is OOM-killed, not given ENOSPC)."""
    nofile: Annotated[int, Field(ge=16, le=1 << 20)] = 4096


_PERMISSION_NAME = re.compile(r"^[a-z][a-z0-9_-]{0,62}$")
_PORTS = re.compile(r"^([0-9]{1,5})(-([0-9]{1,5}))?$")


class NetRule(_Model):
    """A raw allow rule: destination network, ports, protocol."""

    cidr: str
    """An IPv4/IPv6 address or CIDR, e.g. ``10.0.0.0/8`` or ``2001:db8::1``."""
    ports: tuple[str, ...] = ()
    """Ports or ranges (``"443"``, ``"8000-8100"``); empty means every port."""
    protocol: Literal["tcp", "udp", "any"] = "tcp"

    @field_validator("cidr")
    @classmethod
    def _cidr(cls, v: str) -> str:
        try:
            return str(ipaddress.ip_network(v, strict=False))
        except ValueError:
            raise ValueError(f"{v!r} is not an IP address or CIDR (e.g. 10.0.0.0/8, 192.0.2.1)") from None

    @field_validator("ports")
    @classmethod
    def _ports(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for p in v:
            m = _PORTS.match(str(p))
            lo, hi = (int(m.group(1)), int(m.group(3) or m.group(1))) if m else (0, -1)
            if not m or not (1 <= lo <= hi <= 65535):
                raise ValueError(f"port {p!r}: use N or LO-HI with 1 <= LO <= HI <= 65535")
        return tuple(str(p) for p in v)


class NetworkPolicy(_Model):
    """What a sandbox may reach. Everything else is refused (TCP reset / ICMP
    prohibited), and some destinations are refused whatever the policy says:
    other sandboxes, the host, the platform's own services, link-local and
    metadata addresses (docs/SECURITY.md, "Network")."""

    allow: tuple[str, ...] = ()
    """Named permissions defined in the edge's configuration (``pkgs``, ``dns``, ...)."""
    rules: tuple[NetRule, ...] = ()

    @field_validator("allow")
    @classmethod
    def _names(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for name in v:
            if not _PERMISSION_NAME.match(name):
                raise ValueError(f"permission name {name!r} must match {_PERMISSION_NAME.pattern}")
        return v


def _check_path(p: str) -> str:
    if not p.startswith("/") or "\0" in p:
        raise ValueError(f"path {p!r} must be absolute (start with /)")
    norm = posixpath.normpath(p)
    if norm.startswith("//"):
        norm = "/" + norm.lstrip("/")
    if norm != p.rstrip("/") and not (p == "/" and norm == "/"):
        raise ValueError(f"path {p!r} is not normalised: write {norm!r}")
    return norm


class FileRules(_Model):
    """File access bound with Landlock on every process started in the sandbox;
    root inside cannot lift it. The deepest rule that covers a path wins."""

    read_only: tuple[str, ...] = ()
    hidden: tuple[str, ...] = ()
    """Neither readable nor writable (names may still be listed in a listable parent)."""
    writable: tuple[str, ...] = ()
    default: Literal["rw", "ro"] = "rw"
    """Access to paths no rule names."""

    @field_validator("read_only", "hidden", "writable")
    @classmethod
    def _paths(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if len(v) > 64:
            raise ValueError("at most 64 paths per list")
        return tuple(_check_path(p) for p in v)

    @model_validator(mode="after")
    def _disjoint(self) -> FileRules:
        seen: dict[str, str] = {}
        for kind in ("read_only", "hidden", "writable"):
            for p in getattr(self, kind):
                if p in seen and seen[p] != kind:
                    raise ValueError(f"path {p!r} is both {seen[p]} and {kind}")
                seen[p] = kind
        return self

    @property
    def unrestricted(self) -> bool:
        return self.default == "rw" and not (self.read_only or self.hidden)


_STAGE_NAME = re.compile(r"^[a-z][a-z0-9_-]{0,62}$")


class Stage(_Model):
    """A named policy object: what a sandbox may reach and touch during one stage of a task."""

    network: NetworkPolicy | None = None
    """None: loopback only."""
    files: FileRules = FileRules()


class SandboxSpec(_Model):
    image: ImageRef
    resources: Resources = Resources()
    env: dict[str, str] = Field(default_factory=dict)
    labels: dict[str, str] = Field(default_factory=dict)
    output_cap: Annotated[int, Field(ge=1024, le=64 * MiB)] = 256 * 1024
    """Bytes kept from the head and from the tail of each output stream."""
    network: NetworkPolicy | None = None
    """None: loopback only (the default). Ignored when ``stage`` is set: the stage's own applies."""
    stages: dict[str, Stage] = Field(default_factory=dict)
    """Named stages this sandbox can be switched between (``set_stage``)."""
    stage: str | None = None
    """The stage the sandbox starts in; must name one of ``stages``."""
    backend: Annotated[str, Field(pattern=r"^[a-z][a-z0-9_-]{0,31}$")] = "container"
    """Which execution backend runs it (``container``, ``gvisor``...): placement picks an edge
    that runs it; an operation the backend lacks is refused with ``Unsupported``."""

    @model_validator(mode="after")
    def _stage_known(self) -> SandboxSpec:
        for name in self.stages:
            if not _STAGE_NAME.match(name):
                raise ValueError(f"stage name {name!r} must match {_STAGE_NAME.pattern}")
        if self.stage is not None and self.stage not in self.stages:
            known = ", ".join(sorted(self.stages)) or "none declared"
            raise ValueError(f"stage {self.stage!r} is not one of the declared stages ({known})")
        return self

    def effective_network(self) -> NetworkPolicy | None:
        """The network policy in force at creation."""
        return self.stages[self.stage].network if self.stage is not None else self.network

    def effective_files(self) -> FileRules:
        return self.stages[self.stage].files if self.stage is not None else FileRules()

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
    LOST = "lost"
    """The control plane lost its edge (unreachable past the configured bound): its quota
    returned, and the edge destroys it if it ever comes back (fencing). Only the control
    plane uses this state; an edge never does."""


# The only legal moves; the runtime and the reconciler both reason from this table.
TRANSITIONS: dict[SandboxState, frozenset[SandboxState]] = {
    SandboxState.CREATING: frozenset({SandboxState.RUNNING, SandboxState.FAILED, SandboxState.STOPPING,
                                      SandboxState.LOST}),
    SandboxState.RUNNING: frozenset({SandboxState.PAUSED, SandboxState.STOPPING, SandboxState.FAILED,
                                     SandboxState.LOST}),
    SandboxState.PAUSED: frozenset({SandboxState.RUNNING, SandboxState.STOPPING, SandboxState.FAILED,
                                    SandboxState.LOST}),
    SandboxState.STOPPING: frozenset({SandboxState.STOPPED, SandboxState.FAILED}),
    SandboxState.FAILED: frozenset({SandboxState.STOPPING, SandboxState.LOST}),
    SandboxState.STOPPED: frozenset(),
    SandboxState.LOST: frozenset(),
}


def can_move(src: SandboxState, dst: SandboxState) -> bool:
    return dst in TRANSITIONS[src]


__all__ = [
    "TRANSITIONS",
    "FileRules",
    "ImageRef",
    "MiB",
    "NetRule",
    "NetworkPolicy",
    "Resources",
    "SandboxSpec",
    "SandboxState",
    "Stage",
    "can_move",
]
