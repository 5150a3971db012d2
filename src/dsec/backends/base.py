"""The backend layer: what every execution backend offers the edge.

The edge (``dsec.edge``) knows only this module. A backend is one folder under
``dsec/backends/`` (``container``, ``gvisor``, ``fncall``...) with a class that
satisfies :class:`Backend` and a pydantic config member of
:data:`dsec.edge.config.BackendConfig`. An operation a backend does not offer is
refused with :class:`dsec.errors.Unsupported` (HTTP 400, never a 500), decided
from its :class:`Capabilities` before any work is done.

What is here:

- :class:`Capability` / :class:`Capabilities`: the flags a backend declares (and
  an edge advertises to the control plane, which places by them).
- :class:`EdgeMeta`: the edge's typed part of a sandbox record (owner, labels,
  lifecycle, pool membership). Backends store it with their record and never
  read it.
- :class:`SandboxRecord`: the backend-neutral record every backend keeps per
  sandbox; a backend subclasses it for its own fields (the container backend's
  ``ContainerRecord`` adds its uid slot, layers, init process and network).
- :class:`Backend`: the protocol. :class:`BackendBase` gives every optional
  operation a default that raises :class:`Unsupported`, so a new backend
  implements only what it declares.

docs/BACKENDS.md walks through adding a backend.
"""

from __future__ import annotations

import asyncio
import builtins
import enum
import fcntl
import shlex
import struct
import termios
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import (
    TYPE_CHECKING,
    Any,
    BinaryIO,
    ClassVar,
    Protocol,
    TypedDict,
    runtime_checkable,
)

from dsec.errors import DsecError, InvalidSpec, Unsupported
from dsec.spec import NetworkPolicy, SandboxSpec, SandboxState
from dsec.spec.unset import UNSET as UNSET  # one marker for the whole package
from dsec.spec.unset import _Unset as _Unset

if TYPE_CHECKING:
    from dsec.images.layer import Layer
    from dsec.spec.results import ExecResult

OutputCallback = Callable[[str, bytes], "asyncio.Future[None] | None"]
"""Called with ("stdout"|"stderr", chunk) as output is produced. A consumer that cannot take
more returns a future: the backend stops reading the command's output until it is done.
Nothing is dropped."""




def command_line(cmd: str | Sequence[str], limit: int = 512) -> str:
    """A command as a shell would read it, for an event log: at most ``limit`` characters."""
    text = cmd if isinstance(cmd, str) else shlex.join(cmd)
    return text if len(text) <= limit else text[: limit - 1] + "…"


@dataclass(frozen=True, slots=True)
class TtySize:
    """A terminal's size in character cells."""

    rows: int = 24
    cols: int = 80

    def __post_init__(self) -> None:
        if not (1 <= self.rows <= 10_000 and 1 <= self.cols <= 10_000):
            raise InvalidSpec(f"terminal size {self.rows}x{self.cols}: rows and cols must be 1..10000",
                              field="tty")


def set_tty_size(master: int, size: TtySize) -> None:
    """Resize a terminal from its master (the foreground group gets SIGWINCH)."""
    fcntl.ioctl(master, termios.TIOCSWINSZ, struct.pack("HHHH", size.rows, size.cols, 0, 0))


class Capability(enum.StrEnum):
    """One operation family a backend may offer. The wire names are these values."""

    SANDBOXES = "sandboxes"
    """create / destroy / get / list (every sandbox backend)."""
    EXEC = "exec"
    """Run a command to completion or streamed (argv or shell, env, cwd, user, stdin, timeouts)."""
    SESSIONS = "sessions"
    """Persistent shell sessions."""
    PTY = "pty"
    """Terminals (``dsec shell``, attach)."""
    FILES = "files"
    """Read, write, list, copy in and out."""
    PAUSE = "pause"
    """Freeze and reclaim memory; resume."""
    SNAPSHOT = "snapshot"
    """Pack the writable layer into a layer."""
    FORK = "fork"
    """N children from a sandbox's disk now."""
    NETWORK = "network"
    """Network policies beyond loopback (named permissions)."""
    STAGES = "stages"
    """Per-stage file rules (Landlock) and network policy."""
    PRISTINE = "pristine"
    """Commands that see chosen paths as the image shipped them."""
    FNCALL = "fncall"
    """Function calls served by warm interpreters (no sandbox per call)."""


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What one backend offers. ``require`` turns a missing one into :class:`Unsupported`."""

    kind: str
    ops: frozenset[Capability]
    isolation: str = ""
    """One line for operators: what stands between a sandbox and the host."""

    def supports(self, op: Capability) -> bool:
        return op in self.ops

    def require(self, op: Capability, *, what: str | None = None) -> None:
        if op not in self.ops:
            raise Unsupported.operation(what or op.value, backend=self.kind)

    def names(self) -> list[str]:
        return sorted(c.value for c in self.ops)


@dataclass(slots=True)
class EdgeMeta:
    """The edge's part of a sandbox record: who owns it and how long it may live.

    Backends keep it with their record (so it survives an edge restart) and never
    read it. ``pool`` is set while the sandbox waits, ready, in a warm pool;
    ``from_pool`` names the pool it was claimed from."""

    labels: dict[str, str] = field(default_factory=dict)
    task: str | None = None
    project: str | None = None
    request_id: str | None = None
    created_at: float | None = None
    ttl_s: float | None = None
    expires_at: float | None = None
    idle_timeout_s: float | None = None
    auto_pause_s: float | None = None
    pool: str | None = None
    pooled_at: float | None = None
    from_pool: str | None = None
    epoch: int | None = None
    """The edge's fencing epoch when the sandbox was made (a fence above it destroys it)."""

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name in self.__slots__:
            value = getattr(self, name)
            if value is not None and value != {}:
                out[name] = value
        return out

    @classmethod
    def from_json(cls, d: Mapping[str, Any] | None) -> EdgeMeta:
        """Read a saved record's edge part; keys this version does not know are dropped."""
        if not d:
            return cls()

        def num(key: str) -> float | None:
            v = d.get(key)
            return None if v is None else float(v)

        def text(key: str) -> str | None:
            v = d.get(key)
            return None if v is None else str(v)

        return cls(
            labels={str(k): str(v) for k, v in (d.get("labels") or {}).items()},
            task=text("task"), project=text("project"), request_id=text("request_id"),
            created_at=num("created_at"), ttl_s=num("ttl_s"), expires_at=num("expires_at"),
            idle_timeout_s=num("idle_timeout_s"), auto_pause_s=num("auto_pause_s"),
            pool=text("pool"), pooled_at=num("pooled_at"), from_pool=text("from_pool"),
            epoch=None if d.get("epoch") is None else int(d["epoch"]),
        )

    @classmethod
    def lifecycle(cls, created_at: float, ttl_s: float, idle_timeout_s: float | None,
                  auto_pause_s: float | None = None, **rest: Any) -> EdgeMeta:
        return cls(created_at=created_at, ttl_s=ttl_s, expires_at=created_at + ttl_s,
                   idle_timeout_s=idle_timeout_s, auto_pause_s=auto_pause_s, **rest)


@dataclass(slots=True)
class SandboxRecord:
    """What every backend keeps per sandbox. Backends subclass it for their own fields."""

    id: str
    state: SandboxState
    spec: SandboxSpec
    created_at: float
    reason: str = ""
    edge: EdgeMeta = field(default_factory=EdgeMeta)
    events: list[dict[str, Any]] = field(default_factory=list)
    stage: str | None = None
    """The stage in force once ``set_stage`` switched it (None: ``spec.stage``)."""

    backend: ClassVar[str] = ""

    @property
    def current_stage(self) -> str | None:
        return self.stage or self.spec.stage

    def current_policy(self) -> NetworkPolicy | None:
        """The network policy in force (None: loopback only)."""
        return None

    def layer_stack(self) -> tuple[str, ...]:
        """The layer digests it runs on, top first (empty: none of the node's layers)."""
        return ()


@dataclass(frozen=True, slots=True)
class HostFinding:
    """Something wrong with a backend's host state, found by its ``heal`` or on the way of
    a create: what (``kind``), exactly where (``message``), and whether it was repaired."""

    kind: str
    """e.g. cgroup, layer_mount, skeleton, uppers, spawner, network, directory, claim."""
    message: str
    repaired: bool
    at: float = field(default_factory=time.time)


@dataclass(frozen=True, slots=True)
class DiskRoom:
    """What is left in a sandbox's writable layer under its quota (-1: cannot tell)."""

    bytes_free: int
    inodes_free: int
    full: bool


@dataclass(frozen=True, slots=True)
class Usage:
    """What a sandbox uses now (``dsec top``)."""

    memory_bytes: int = 0
    pids: int = 0
    cpu_s: float = 0.0
    disk_bytes: int = 0


@dataclass(slots=True)
class GroupOutcome:
    """Result of a group pause or resume: per sandbox, done, skipped (already there) or failed."""

    done: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    """Already in the wanted state (paused for a pause, running for a resume)."""
    errors: dict[str, DsecError] = field(default_factory=dict)
    seconds: float = 0.0


class ProcessHandle(Protocol):
    """A process started in a sandbox by ``start_process`` / ``start_tty``. ``exited``
    resolves to its exit (``exit_code``, ``signal`` attributes) once it is reaped.

    A backend whose ``pid`` is not a host pid (a VM's guest pid) also gives the handle
    ``signal_job(sig)``: the edge's terminals then signal through it, never with the host's
    ``killpg``."""

    pid: int
    exited: asyncio.Future[Any]

    def kill(self, *, tree: bool = True) -> None: ...


class ShellSession(Protocol):
    """A persistent shell in a sandbox (``open_session``): state (cwd, variables) carries
    from one command to the next."""

    id: str

    async def run(self, command: str, *, timeout: float | None = ..., output_cap: int = ...) -> ExecResult: ...

    async def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class FileInfo:
    path: str
    name: str
    type: str  # "file", "dir", "symlink", "other"
    size: int
    mode: int
    uid: int
    gid: int
    mtime: float
    target: str | None = None



class NetworkFacts(TypedDict, total=False):
    """A networked sandbox's network as its backend knows it (:meth:`Backend.network_info`)."""

    ip: str | None
    ifname: str | None
    gateway: str
    policy: dict[str, object] | None
    """The policy in force, as JSON."""
    denied_packets: int
    """Refused attempts so far (as of the last :meth:`Backend.collect_denied`)."""
    denied_recent: list[str]
    """The latest refused destinations."""


class ReclaimFigures(Protocol):
    """What a pause pushed out of RAM (bytes)."""

    @property
    def before(self) -> int: ...
    @property
    def after(self) -> int: ...
    @property
    def swapped(self) -> int: ...


class PauseOutcome(Protocol):
    """What :meth:`Backend.pause` did."""

    @property
    def freeze_s(self) -> float:
        """Seconds until every process was frozen."""
        ...
    @property
    def seconds(self) -> float: ...
    @property
    def reclaim(self) -> ReclaimFigures | None:
        """None: nothing pushed out (skipped, resumed meanwhile, or not this backend's way)."""
        ...


class PackedBytes(Protocol):
    @property
    def bytes(self) -> int: ...


class SnapshotOutcome(Protocol):
    """What :meth:`Backend.snapshot_info` made: the layer and the packing figures."""

    @property
    def layer(self) -> Layer: ...
    @property
    def stats(self) -> PackedBytes: ...
    @property
    def frozen_s(self) -> float: ...
    @property
    def seconds(self) -> float: ...
    @property
    def collapsed(self) -> Sequence[str]: ...


class Files(Protocol):
    """A sandbox's files as the host reaches them, confined to its root (and to its stage's
    rules unless the platform asks): what :meth:`Backend.files` returns."""

    def read(self, path: str, *, max_bytes: int = ...) -> bytes: ...
    def stat(self, path: str) -> FileInfo: ...
    def exists(self, path: str) -> bool: ...
    def list(self, path: str = "/") -> list[FileInfo]: ...
    def write(self, path: str, data: bytes, *, mode: int = 0o644, user: int = 0,
              make_parents: bool = False) -> None: ...
    def append(self, path: str, data: bytes, *, user: int = 0) -> None: ...
    def mkdir(self, path: str, *, parents: bool = False, mode: int = 0o755, user: int = 0) -> None: ...
    def remove(self, path: str, *, recursive: bool = False) -> None: ...
    def rename(self, src: str, dst: str) -> None: ...
    def download(self, path: str = "/", *, max_bytes: int = ...) -> bytes: ...
    def download_to(self, path: str, out: BinaryIO, *, max_bytes: int | None = None) -> None: ...
    def upload(self, path: str, tar_data: bytes | BinaryIO, *, user: int = 0, max_bytes: int = 1 << 32) -> int: ...


@runtime_checkable
class Backend(Protocol):
    """One execution backend on one edge. Everything the edge calls.

    Records are the backend's: ``sandboxes`` maps id to record for every sandbox it
    holds (any state). ``last_activity`` holds monotonic stamps of the last data-path
    use (the edge reads it for idle timeouts). Blocking work runs in threads or
    helper processes, never on the event loop."""

    name: str
    capabilities: Capabilities
    last_activity: dict[str, float]
    reconciled: dict[str, builtins.list[str]]
    wake_gate: Callable[[str], None] | None
    """Asked before a paused sandbox is woken (it raises to keep it paused): :class:`BackendBase`."""

    @property
    def sandboxes(self) -> Mapping[str, SandboxRecord]: ...
    @property
    def host_repairs(self) -> Sequence[HostFinding]: ...
    @property
    def host_problems(self) -> Sequence[HostFinding]:
        """What the last :meth:`heal` found wrong and could not repair (empty: healthy)."""
        ...
    @property
    def repair_counts(self) -> Mapping[str, int]:
        """Repairs made since start, by kind."""
        ...

    async def start(self) -> None: ...
    async def close(self, *, destroy_all: bool = True) -> None: ...

    # sandboxes
    async def create(self, spec: SandboxSpec, *, sandbox_id: str | None = None,
                     edge: EdgeMeta | None = None) -> SandboxRecord: ...
    async def destroy(self, sandbox_id: str) -> bool: ...
    def get(self, sandbox_id: str) -> SandboxRecord: ...
    def list(self) -> Sequence[SandboxRecord]: ...
    def update(self, sandbox_id: str, *, spec: SandboxSpec | None = None,
               edge: EdgeMeta | None = None) -> SandboxRecord: ...
    def wake(self, sandbox_id: str) -> bool: ...

    # data path
    async def exec(self, sandbox_id: str, cmd: str | Sequence[str], *, env: Mapping[str, str] | None = None,
                   cwd: str = "/", user: int | str = 0, stdin: bytes | None = None,
                   timeout: float | None = None, idle_timeout: float | None = None,
                   on_output: OutputCallback | None = None, output_cap: int | None = None,
                   pristine: Sequence[str] = ()) -> ExecResult: ...
    async def open_session(self, sandbox_id: str, *, env: Mapping[str, str] | None = None,
                           cwd: str = "/", user: int | str = 0) -> ShellSession: ...
    async def start_process(self, sandbox_id: str, argv: Sequence[str], *, stdin: int, stdout: int, stderr: int,
                            env: Mapping[str, str] | None = None, cwd: str = "/",
                            user: int | str = 0) -> ProcessHandle:
        """A command with the caller's fds (streamed stdin: attach); returns a process handle
        (``pid``, ``kill()``, ``wait()``)."""
    async def start_tty(self, sandbox_id: str, argv: Sequence[str], *, size: TtySize,
                        env: Mapping[str, str] | None = None, cwd: str = "/",
                        user: int | str = 0) -> tuple[ProcessHandle, int]:
        """A command on a new terminal: (process handle, the terminal's master fd)."""
    def files(self, sandbox_id: str) -> Files: ...
    def usage(self, sandbox_id: str) -> Usage: ...

    # pause, snapshots, forks
    async def pause(self, sandbox_id: str, *, reclaim: bool = True) -> PauseOutcome: ...
    async def resume(self, sandbox_id: str) -> SandboxRecord: ...
    async def pause_many(self, sandbox_ids: Sequence[str], *, reclaim: bool = True) -> GroupOutcome: ...
    async def resume_many(self, sandbox_ids: Sequence[str]) -> GroupOutcome: ...
    async def snapshot_info(self, sandbox_id: str, *, name: str | None = None, tag: str | None = None,
                            exclude: Sequence[str] = ()) -> SnapshotOutcome: ...
    async def fork(self, sandbox_id: str, children: int | Sequence[str], *, edges: Sequence[EdgeMeta] | None = None,
                   exclude: Sequence[str] = ()) -> Sequence[SandboxRecord]: ...

    # policy
    async def set_policy(self, sandbox_id: str, policy: NetworkPolicy | None) -> SandboxRecord: ...
    async def set_stage(self, sandbox_id: str, name: str) -> SandboxRecord: ...
    def network_info(self, sandbox_id: str) -> NetworkFacts | None: ...
    async def collect_denied(self) -> dict[str, int]: ...

    # host
    async def heal(self, *, repair: bool = True) -> builtins.list[HostFinding]: ...
    def check_limits(self, rec: SandboxRecord) -> None: ...
    def disk_room(self, rec: SandboxRecord) -> DiskRoom | None: ...
    def store_space(self) -> tuple[int, int] | None: ...
    def release_layer(self, digest: str) -> None:
        """Drop the backend's idle pin of a layer now (before the layer is deleted)."""
        ...


class BackendBase:
    """Defaults for the optional operations: each raises :class:`Unsupported` naming the
    backend. A backend subclasses this and overrides what its capabilities declare."""

    kind: ClassVar[str] = ""
    name: str
    capabilities: Capabilities
    wake_gate: Callable[[str], None] | None = None
    """Set by the edge: called with the id before a paused sandbox is woken by a request (or
    resumed); it raises to keep the sandbox paused (one paused by preemption: edge/preempt.py)."""

    host_problems: Sequence[HostFinding] = ()
    repair_counts: Mapping[str, int] = MappingProxyType({})

    def release_layer(self, digest: str) -> None:
        """Nothing pinned by default."""

    def _unsupported(self, op: str) -> Unsupported:
        return Unsupported.operation(op, backend=self.kind)

    def wake(self, sandbox_id: str) -> bool:
        return False

    async def open_session(self, sandbox_id: str, *, env: Mapping[str, str] | None = None,
                           cwd: str = "/", user: int | str = 0) -> ShellSession:
        raise self._unsupported("sessions")

    def files(self, sandbox_id: str) -> Files:
        raise self._unsupported("files")

    async def start_process(self, sandbox_id: str, argv: Sequence[str], *, stdin: int, stdout: int, stderr: int,
                            env: Mapping[str, str] | None = None, cwd: str = "/",
                            user: int | str = 0) -> ProcessHandle:
        raise self._unsupported("streamed stdin (attach)")

    async def start_tty(self, sandbox_id: str, argv: Sequence[str], *, size: TtySize,
                        env: Mapping[str, str] | None = None, cwd: str = "/",
                        user: int | str = 0) -> tuple[ProcessHandle, int]:
        raise self._unsupported("terminals")

    async def pause(self, sandbox_id: str, *, reclaim: bool = True) -> PauseOutcome:
        raise self._unsupported("pause")

    async def resume(self, sandbox_id: str) -> SandboxRecord:
        raise self._unsupported("resume")

    async def pause_many(self, sandbox_ids: Sequence[str], *, reclaim: bool = True) -> GroupOutcome:
        raise self._unsupported("pause")

    async def resume_many(self, sandbox_ids: Sequence[str]) -> GroupOutcome:
        raise self._unsupported("resume")

    async def snapshot_info(self, sandbox_id: str, *, name: str | None = None, tag: str | None = None,
                            exclude: Sequence[str] = ()) -> SnapshotOutcome:
        raise self._unsupported("snapshot")

    async def fork(self, sandbox_id: str, children: int | Sequence[str], *, edges: Sequence[EdgeMeta] | None = None,
                   exclude: Sequence[str] = ()) -> Sequence[SandboxRecord]:
        raise self._unsupported("fork")

    async def set_policy(self, sandbox_id: str, policy: NetworkPolicy | None) -> SandboxRecord:
        raise self._unsupported("network policy")

    async def set_stage(self, sandbox_id: str, name: str) -> SandboxRecord:
        raise self._unsupported("stages")

    def network_info(self, sandbox_id: str) -> NetworkFacts | None:
        return None

    async def collect_denied(self) -> dict[str, int]:
        return {}

    async def heal(self, *, repair: bool = True) -> list[HostFinding]:
        return []

    def check_limits(self, rec: SandboxRecord) -> None:
        return None

    def disk_room(self, rec: SandboxRecord) -> DiskRoom | None:
        return None

    def store_space(self) -> tuple[int, int] | None:
        return None


def check_spec(caps: Capabilities, spec: SandboxSpec) -> None:
    """Refuse a create whose spec needs what the backend does not offer (before any work)."""
    if (spec.effective_network() is not None or any(st.network is not None for st in spec.stages.values())):
        caps.require(Capability.NETWORK, what="network policies")
    if spec.stages:
        caps.require(Capability.STAGES, what="stages")
