"""Configuration of one edge agent: pure data, no I/O.

Budgets left as ``None`` are derived from the machine when the edge starts
(:func:`dsec.edge.admission.resolve_budgets`), so this module never probes
the host. The cluster key travels as hex (environment or file) and is bytes
here.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    field_serializer,
    field_validator,
    model_validator,
)

from dsec.backends.registry import (
    BackendConfig,
    ContainerConfig,
    FnCallConfig,
    GVisorConfig,
    NetworkConfig,
    Permission,
)
from dsec.http.auth import parse_key
from dsec.spec import ImageRef, Resources

__all__ = ["BackendConfig", "ContainerConfig", "EdgeConfig", "FnCallConfig", "GVisorConfig", "NetworkConfig",
           "Permission", "PoolConfig", "RegistryConfig"]

EDGE_ID_RE = re.compile(r"^[a-z][a-z0-9]{0,7}$")
_RUNTIME_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,31}$")
_POOL_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:+-]{0,127}$")

CPU_OVERCOMMIT = 8.0
"""Default cpu budget per host core: ~90% of sandboxes use <=5% of what they request."""
MEMORY_FRACTION = 0.9
"""Default memory budget: this share of the host's RAM (memory is the scarce resource)."""
BYTES_PER_SANDBOX_SLOT = 8 * 1024 * 1024
"""Default sandbox-count budget: one sandbox per this much host RAM (cap: the uid ranges)."""


class _Config(BaseModel):
    model_config = ConfigDict(extra="forbid")


_CONTAINER_KEYS = ("zram_size", "reclaim_method", "uppers_path", "network")


class PoolConfig(_Config):
    """Keep ``size`` sandboxes of this image and resources ready on the edge."""

    image: ImageRef
    resources: Resources = Resources()
    size: Annotated[int, Field(ge=0, le=10000)] = 4
    backend: str = "container"
    """The backend whose sandboxes it keeps (one of the edge's ``backends``)."""
    name: str | None = None
    """Shown in metrics and in the health report; derived from image and resources if unset."""

    @field_validator("name")
    @classmethod
    def _name(cls, v: str | None) -> str | None:
        if v is not None and not _POOL_NAME_RE.match(v):
            raise ValueError(f"pool name {v!r}: letters, digits and . _ : + - (max 128)")
        return v

    def display_name(self) -> str:
        if self.name:
            return self.name
        r = self.resources
        layers = ("" if self.backend == "container" else f"{self.backend}:") + "+".join(self.image.layers_top_first()[::-1])
        return f"{layers}/{r.cpu:g}cpu/{r.memory // (1024 * 1024)}MiB/{r.disk // (1024 * 1024)}MiBdisk"


class RegistryConfig(_Config):
    """The OCI registry an edge loads layers it does not hold from (docs/IMAGES.md,
    "Registry layers on an edge"). A ``name:tag`` missing from the edge's store is looked
    up as ``<url>/<namespace>/<name>:<tag>`` (``<url>/<name>:<tag>`` without a namespace)."""

    url: str
    """``http(s)://host[:port]`` of the registry (no ``/v2``)."""
    namespace: str = ""
    """Repository prefix of DSec layers in the registry, e.g. ``dsec/layers``."""
    username: str | None = None
    password_file: Path | None = None
    """File holding the password or token for basic auth / the token server (never inline)."""
    verify_tls: bool = True
    lazy: bool = True
    """Mount registry layers without downloading them (one FUSE process per node, chunks
    fetched on first read); false: pull the whole layer on first use."""
    cache_dir: Path | None = None
    """Chunk cache of the lazy loader; default ``<state_dir>/chunks``."""
    cache_limit_bytes: Annotated[int, Field(ge=64 << 20)] = 20 << 30
    read_deadline_s: Annotated[float, Field(gt=0, le=3600)] = 30.0
    """A read of a chunk the registry does not deliver fails with EIO after this long."""
    fetch_attempts: Annotated[int, Field(ge=1, le=20)] = 4
    timeout_s: Annotated[float, Field(gt=0, le=600)] = 30.0
    """Per-request timeout of manifest/config/token requests."""
    refresh_interval_s: Annotated[float, Field(gt=0, le=3600)] = 20.0
    """How often attached layers get fresh auth headers (bearer tokens expire)."""

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        if not re.match(r"^https?://[^/\s]+/?$", v):
            raise ValueError(f"registry url must be http(s)://host[:port], got {v!r}")
        return v.rstrip("/")

    @field_validator("namespace")
    @classmethod
    def _namespace(cls, v: str) -> str:
        v = v.strip("/")
        if v and not re.match(r"^[a-z0-9]+(?:[._-][a-z0-9]+)*(?:/[a-z0-9]+(?:[._-][a-z0-9]+)*)*$", v):
            raise ValueError(f"registry namespace {v!r} is not a valid repository path (lowercase a-z 0-9 . _ - /)")
        return v


class EdgeConfig(_Config):
    """Everything one edge agent needs. ``python -m dsec.edge --config FILE`` reads it as JSON."""

    edge_id: str
    """Short name of this edge, also the prefix of its sandbox ids (``e1-3fa2b9c0d1e2``)."""
    cluster_key: bytes
    """HMAC key shared with the control plane (hex in files and DSEC_CLUSTER_KEY)."""
    url: str | None = None
    """Base URL the control plane and SDKs reach this edge at; default http://host:port."""
    host: str = "127.0.0.1"
    port: Annotated[int, Field(ge=0, le=65535)] = 7071
    """0 picks a free port (serve_edge reports it in the handle's url)."""
    state_dir: Path = Path("/var/lib/dsec")
    """Records (``sandboxes/<runtime>``) and the layer store (``layers``)."""
    run_dir: Path = Path("/run/dsec")
    """Node-wide: several edges on one machine must share it (uid ranges are claimed here)."""
    runtime_name: str | None = None
    """Names every host resource of the runtime (cgroups, run directory, records, network
    objects); default ``edge-<edge_id>``. Claimed host-wide at start: a second edge with the
    same name on this host is refused."""
    labels: dict[str, str] = Field(default_factory=dict)

    max_sandboxes: Annotated[int | None, Field(ge=0)] = None
    cpu_capacity: Annotated[float | None, Field(ge=0)] = None
    """Cores that requested sandbox cpu may add up to; default 8 x host cores."""
    memory_capacity: Annotated[int | None, Field(ge=0)] = None
    """Bytes; default 90% of host RAM."""
    disk_capacity: Annotated[int | None, Field(ge=0)] = None
    """Bytes of writable-layer quota (``Resources.disk`` of sandboxes on the disk medium) the
    edge may commit; default (the free space of state_dir at start - ``disk_reserve``) x
    ``disk_overcommit``. Memory-medium layers count against memory (their tmpfs pages are)."""
    disk_reserve: Annotated[int | None, Field(ge=0)] = None
    """Bytes of the node's disk kept free: a create is refused (``Backpressure``, reason
    ``disk``) while the writable-layer store has less; default max(1 GiB, 5 % of the disk)."""
    disk_overcommit: Annotated[float, Field(gt=0, le=1000)] = 1.0
    """Disk quotas may add up to this many times the disk: 1.0 guarantees every sandbox can
    fill its quota; agents rarely do, so dense nodes raise it (the reserve still guards the disk)."""


    backends: list[BackendConfig] = Field(default_factory=lambda: list[BackendConfig]([ContainerConfig()]))
    """The execution backends this edge runs, one per kind (``kind`` picks the member:
    docs/BACKENDS.md). Each is built and started with the edge; the edge advertises them
    and places a sandbox on the one its ``SandboxSpec.backend`` names. The container
    backend's settings (zram, network, writable-layer store) live in its member; for
    compatibility they are also accepted at the top level and moved there."""

    pools: list[PoolConfig] = Field(default_factory=list)
    pool_refill_per_s: Annotated[float, Field(gt=0, le=10000)] = 20.0
    """Rate limit of background pool creates (token bucket, burst = max(1, rate / 4))."""
    pool_refill_concurrency: Annotated[int, Field(ge=1, le=64)] = 2

    watchdog_interval_s: Annotated[float, Field(gt=0, le=3600)] = 1.0
    """How often TTL and idle timeouts are checked."""
    tombstones: Annotated[int, Field(ge=0, le=1_000_000)] = 4096
    """Event logs of this many destroyed sandboxes are kept (GET .../events after the end)."""
    destroy_on_shutdown: bool = False
    """False: sandboxes outlive an edge restart and are re-adopted. True for tests and `dsec up`."""

    auto_pause_s: Annotated[float | None, Field(gt=0)] = None
    """Pause a sandbox after this long without requests, unless its create says otherwise
    (``lifecycle.auto_pause_s``); None: never."""

    host_check_interval_s: Annotated[float, Field(gt=0, le=3600)] = 2.0
    """How often the edge checks the host state its runtime stands on (layer mounts, cgroup
    directories, the /dev skeleton, the writable-layer store, network tables, the spawner)
    and repairs what vanished; what it cannot repair makes it unhealthy (docs/EDGE.md,
    "Self-check")."""
    audit_interval_s: Annotated[float, Field(gt=0, le=3600)] = 2.0
    """How often denied network attempts, OOM kills, pids-limit hits and full disks are
    collected into event logs and metrics (they are also checked after every exec)."""

    registry: RegistryConfig | None = None
    """Where layers this edge does not hold come from; None: only the local store."""

    control_plane_url: str | None = None
    """Where to register and report health: one control-plane URL, or several separated by
    commas (replicas: the edge fails over among them)."""
    heartbeat_interval_s: Annotated[float, Field(gt=0, le=3600)] = 1.0
    """How often health is reported: the control plane stops placing on an edge it has not heard
    from for ``dead_after_s`` (2.5 s), so this stays well below it."""
    retry_after_s: Annotated[float, Field(gt=0, le=3600)] = 1.0
    """Retry-After of a 429 when admission refuses for lack of room."""

    @model_validator(mode="before")
    @classmethod
    def _legacy_container_keys(cls, data: Any) -> Any:
        """Top-level ``network``, ``zram_size``, ``reclaim_method``, ``uppers_path`` (older
        configs) go into the container backend's member."""
        if not isinstance(data, dict) or not any(k in data for k in _CONTAINER_KEYS):
            return data
        data = dict(data)
        moved = {k: data.pop(k) for k in _CONTAINER_KEYS if k in data}
        backends = [dict(b) if isinstance(b, dict) else b.model_dump() for b in data.get("backends") or [{"kind": "container"}]]
        for b in backends:
            if b.get("kind", "container") == "container":
                clash = sorted(k for k in moved if k in b)
                if clash:
                    raise ValueError(f"{', '.join(clash)} given both at the top level and in the container backend; "
                                     "keep them in `backends`")
                b.update(moved)
                break
        else:
            raise ValueError(f"{', '.join(sorted(moved))} configure the container backend, which `backends` leaves out")
        data["backends"] = backends
        return data

    @field_validator("backends")
    @classmethod
    def _one_per_kind(cls, v: list[BackendConfig]) -> list[BackendConfig]:
        kinds = [b.kind for b in v]
        if not kinds:
            raise ValueError("an edge needs at least one backend")
        if "fncall" in kinds and "container" not in kinds:
            raise ValueError("the fncall backend runs its workers in container sandboxes: list the container "
                             "backend too")
        dup = sorted({k for k in kinds if kinds.count(k) > 1})
        if dup:
            raise ValueError(f"backend {', '.join(dup)} listed twice; one entry per kind")
        return v

    @model_validator(mode="after")
    def _pools_of_configured_backends(self) -> EdgeConfig:
        kinds = {b.kind for b in self.backends}
        for p in self.pools:
            if p.backend not in kinds or p.backend == "fncall":
                raise ValueError(f"pool {p.display_name()!r}: backend {p.backend!r} is not one this edge runs "
                                 f"sandboxes with ({', '.join(sorted(kinds - {'fncall'}))})")
        return self

    @property
    def control_plane_urls(self) -> list[str]:
        """``control_plane_url`` split into its replicas' URLs."""
        return [u.strip().rstrip("/") for u in (self.control_plane_url or "").split(",") if u.strip()]

    @property
    def container(self) -> ContainerConfig | None:
        """The container backend's settings (None: this edge does not run it)."""
        return next((b for b in self.backends if isinstance(b, ContainerConfig)), None)

    @property
    def network(self) -> NetworkConfig | None:
        """Sandbox networking (the container backend's): None when it is not configured."""
        c = self.container
        return None if c is None else c.network

    @field_validator("edge_id")
    @classmethod
    def _edge_id(cls, v: str) -> str:
        if not EDGE_ID_RE.match(v):
            raise ValueError(f"edge_id {v!r} must match {EDGE_ID_RE.pattern} (it prefixes sandbox ids)")
        return v

    @field_validator("runtime_name")
    @classmethod
    def _runtime_name(cls, v: str | None) -> str | None:
        if v is not None and not _RUNTIME_NAME_RE.match(v):
            raise ValueError(f"runtime_name {v!r} must match {_RUNTIME_NAME_RE.pattern}")
        return v

    @field_validator("cluster_key", mode="before")
    @classmethod
    def _key(cls, v: Any) -> bytes:
        return parse_key(v)

    @field_serializer("cluster_key")
    def _key_hex(self, v: bytes) -> str:
        return v.hex()

    @model_validator(mode="after")
    def _unique_pools(self) -> EdgeConfig:
        names = [p.display_name() for p in self.pools]
        if len(names) != len(set(names)):
            raise ValueError("two pools have the same name; give them distinct `name`s")
        return self

    @property
    def runtime(self) -> str:
        return self.runtime_name or f"edge-{self.edge_id}"

    @property
    def base_url(self) -> str:
        return (self.url or f"http://{self.host}:{self.port}").rstrip("/")

    @classmethod
    def from_env(cls, **overrides: Any) -> EdgeConfig:
        """Fill ``cluster_key`` from DSEC_CLUSTER_KEY (hex) or DSEC_CLUSTER_KEY_FILE when not given."""
        data = dict(overrides)
        if "cluster_key" not in data:
            if os.environ.get("DSEC_CLUSTER_KEY"):
                data["cluster_key"] = os.environ["DSEC_CLUSTER_KEY"]
            elif os.environ.get("DSEC_CLUSTER_KEY_FILE"):
                data["cluster_key"] = Path(os.environ["DSEC_CLUSTER_KEY_FILE"]).read_text().strip()
        return cls.model_validate(data)
