"""Configuration of one control-plane replica: pure data, no I/O at import.

Several replicas may share one PostgreSQL database (``database_url``); the
default is an embedded SQLite file (WAL) under ``data_dir``. The cluster key
is the HMAC key shared with every edge (hex in files and ``DSEC_CLUSTER_KEY``);
:meth:`ControlConfig.resolve_cluster_key` reads it, or creates it (0600) under
``data_dir`` when neither the config nor the environment gives one.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_serializer, field_validator

from dsec.compat.e2b.config import E2BConfig
from dsec.compat.sandboxfusion.config import SandboxFusionConfig
from dsec.http.auth import parse_key
from dsec.spec.api import NAME_PATTERN, Quota

GiB = 1024**3


def _default_data_dir() -> Path:
    env = os.environ.get("DSEC_CONTROL_DATA")
    if env:
        return Path(env)
    if os.geteuid() == 0:
        return Path("/var/lib/dsec/control")
    return Path.home() / ".local/share/dsec/control"


class _Config(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PlacementConfig(_Config):
    k: Annotated[int, Field(ge=1, le=64)] = 2
    """Power-of-k choices: sample k feasible edges, take the least committed."""
    max_attempts: Annotated[int, Field(ge=1, le=32)] = 3
    """Edges tried per create when edges refuse admission (429) or cannot be reached."""
    require_layers: bool = False
    """True: only edges that already hold every layer of the image are candidates.
    False: edges holding the layers are preferred; others may fetch them lazily."""
    retry_after_s: Annotated[float, Field(gt=0, le=3600)] = 1.0
    """Retry-After of a 429 when nothing fits."""


class SchedulingConfig(_Config):
    """The scheduler: priorities and preemption, elastic minimums, the burst pool
    (docs/CONTROL.md, "Scheduling"; the decisions are dsec.control.sched's)."""

    burst_threshold: Annotated[float, Field(gt=0, le=1)] = 0.8
    """Primary-pool utilisation (the dominant committed share of sandboxes, cpu, memory) at or
    above which creates of tasks that allow it go to edges labelled ``pool=burst``."""
    burst_release_below: Annotated[float, Field(ge=0, le=1)] = 0.7
    """Below this, burst edges that hold nothing are given back to the burst provider."""
    preemption: bool = True
    """A create that does not fit may preempt less urgent sandboxes (False: it gets the 429)."""
    victim_edges: Annotated[int, Field(ge=1, le=1024)] = 8
    """Edges examined for one preemption (a random sample of those that could hold the create)."""
    max_victims: Annotated[int, Field(ge=1, le=1000)] = 64
    default_priority: Annotated[int, Field(ge=0, le=1000)] = 200
    """Priority of sandboxes without a task, and of tasks that set none (``training``)."""
    default_preemption: Literal["pause", "destroy", "never"] = "pause"
    """Policy of sandboxes created without a task."""
    burst_max_ttl_s: Annotated[float | None, Field(gt=0)] = 4 * 3600.0
    """Only sandboxes whose TTL (``lifecycle.ttl_s``) is at most this go to the burst pool: a
    drained burst node then holds nothing after that long and goes back to its provider (the
    lifetimes' long tail would keep it up for hours). None: any TTL."""
    burst_provider: str = "static"
    """``static``: the burst pool is the edges labelled ``pool=burst`` that joined (none is started
    or stopped; an empty one is only reported as released); else ``module:factory``, called with
    ``burst_provider_options`` to build a :class:`dsec.control.burst.BurstProvider` (a cloud's)."""
    burst_provider_options: dict[str, Any] = Field(default_factory=dict)
    burst_max_nodes: Annotated[int, Field(ge=0, le=10_000)] = 16
    burst_headroom: Annotated[float, Field(ge=0, le=10)] = 0.25
    """While the burst pool is in use, keep this share of it free (at least one node's worth)."""
    burst_interval_s: Annotated[float, Field(gt=0, le=3600)] = 10.0
    """How often the watcher's leader runs the burst controller."""


class ControlConfig(_Config):
    """Everything one control-plane replica needs."""

    data_dir: Path = Field(default_factory=_default_data_dir)
    database_url: str | None = None
    """SQLAlchemy URL; default ``sqlite:///<data_dir>/control.db``. ``postgresql://...``
    (psycopg 3) lets several replicas share the state."""
    cluster_key: bytes | None = None
    """HMAC key shared with the edges (hex); default DSEC_CLUSTER_KEY, DSEC_CLUSTER_KEY_FILE
    or ``<data_dir>/cluster.key`` (created 0600 on first start)."""
    host: str = "127.0.0.1"
    port: Annotated[int, Field(ge=0, le=65535)] = 7070
    """0 picks a free port (serve_control reports it in the handle's url)."""
    public_url: str | None = None

    placement: PlacementConfig = PlacementConfig()
    scheduling: SchedulingConfig = SchedulingConfig()

    sandbox_token_ttl_s: Annotated[float, Field(gt=0, le=7 * 86400)] = 3600.0
    """Lifetime of the data-path token in each create/get answer."""
    edge_admin_token_ttl_s: Annotated[float, Field(gt=60, le=7 * 86400)] = 3600.0

    watcher: bool = True
    """Run the watcher in this replica (replicas elect one leader through a lease row)."""
    watcher_interval_s: Annotated[float, Field(gt=0, le=3600)] = 1.0
    dead_after_misses: Annotated[int, Field(ge=1, le=1000)] = 3
    dead_after_s: Annotated[float, Field(gt=0, le=3600)] = 2.5
    """An edge not heard from (heartbeat or the watcher's poll) for this long is skipped by
    placement at once (every replica checks the age on every create) and marked dead by the
    watcher. With 1 s heartbeats and polls, a dead or cut-off edge stops getting creates
    within 3 s (docs/CONTROL.md, "Detection")."""
    poll_timeout_s: Annotated[float, Field(gt=0, le=60)] = 0.8
    """The watcher's health poll of one edge gives up after this long (a miss)."""
    reconcile_interval_s: Annotated[float, Field(gt=0, le=86400)] = 10.0
    """How often each live edge's sandbox list is compared with the store."""
    edge_lost_after_s: Annotated[float, Field(gt=0)] = 300.0
    """Sandboxes of an edge not heard from for this long are declared ``lost`` (their quota and
    the edge's room return; the SDK raises ``SandboxLost``), and the edge's fencing epoch is
    raised: if it comes back, it destroys them before it gets new work (docs/CONTROL.md)."""
    replica_beat_s: Annotated[float, Field(gt=0, le=60)] = 1.0
    """How often this replica records that it is alive (the ``replicas`` table)."""
    replica_dead_after_s: Annotated[float, Field(gt=0, le=3600)] = 3.0
    """A replica silent this long is dead: the watcher finishes the creates it left half done."""
    orphan_grace_s: Annotated[float, Field(ge=0)] = 60.0
    reap_orphans: bool = True
    """Delete sandboxes an edge holds that the store does not know (older than the grace)."""
    retention_s: Annotated[float, Field(ge=0)] = 86400.0
    """Stopped and failed sandboxes stay listable (and their request ids answered) this long."""

    edge_timeout_s: Annotated[float, Field(gt=0, le=3600)] = 60.0
    """Per edge call; a create slower than this is tried on the next candidate."""
    batch_concurrency: Annotated[int, Field(ge=1, le=4096)] = 64
    db_threads: Annotated[int, Field(ge=1, le=256)] = 8
    auth_cache_s: Annotated[float, Field(ge=0, le=300)] = 2.0
    """API-token lookups are cached this long per replica; a revocation in this replica
    applies at once, in the others within this delay."""

    root_project: Annotated[str, Field(pattern=NAME_PATTERN)] = "root"
    root_quota: Quota = Quota(sandboxes=1_000_000, cpu=1_000_000.0, memory=1 << 50)
    root_storage: Annotated[int, Field(ge=0, le=1 << 60)] = 1 << 50
    """Bytes of snapshots the root project may keep (carved out to sub-projects like its quota)."""
    bootstrap_token: SecretStr | None = None
    """Admin token of the root project. Unset: one is generated on the first start."""
    admin_token_file: Path | None = None
    """Where the generated admin token is written (0600); default ``<data_dir>/admin.token``."""
    log_level: str = "warning"
    sandboxfusion: SandboxFusionConfig = SandboxFusionConfig()
    """SandboxFusion's HTTP API under ``/sandboxfusion`` (docs/COMPAT.md)."""
    e2b: E2BConfig = E2BConfig()
    """E2B's REST API and sandbox plane on this listener (docs/COMPAT.md, "E2B")."""

    @field_validator("cluster_key", mode="before")
    @classmethod
    def _key(cls, v: Any) -> bytes | None:
        return None if v is None else parse_key(v)

    @field_serializer("cluster_key")
    def _key_hex(self, v: bytes | None) -> str | None:
        return None if v is None else v.hex()

    @field_validator("bootstrap_token")
    @classmethod
    def _boot(cls, v: SecretStr | None) -> SecretStr | None:
        if v is not None and not v.get_secret_value().startswith("dsk_"):
            raise ValueError("bootstrap_token must be a dsk_ API token")
        return v

    @property
    def db_url(self) -> str:
        if self.database_url:
            return self.database_url
        return f"sqlite:///{self.data_dir / 'control.db'}"

    @property
    def token_file(self) -> Path:
        return self.admin_token_file or self.data_dir / "admin.token"

    def resolve_cluster_key(self) -> bytes:
        """The configured key, else $DSEC_CLUSTER_KEY(_FILE), else ``<data_dir>/cluster.key``."""
        if self.cluster_key is not None:
            return self.cluster_key
        if os.environ.get("DSEC_CLUSTER_KEY"):
            return parse_key(os.environ["DSEC_CLUSTER_KEY"])
        if os.environ.get("DSEC_CLUSTER_KEY_FILE"):
            return parse_key(Path(os.environ["DSEC_CLUSTER_KEY_FILE"]).read_text())
        path = self.data_dir / "cluster.key"
        if path.exists():
            return parse_key(path.read_text())
        self.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        write_secret(path, secrets.token_hex(32) + "\n")
        return parse_key(path.read_text())


def write_secret(path: Path, text: str) -> None:
    """Create ``path`` with mode 0600 from the start (never world-readable, even briefly)."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, text.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
