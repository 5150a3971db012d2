"""The node runtime of the container backend: create, exec, destroy, reconcile.

One ``ContainerRuntime`` per node (one per ``name`` on a test machine). It owns
the native spawner, the sandboxes' cgroups, uid ranges and records, and the
node's layer mounts. It never forks sandboxes itself (the spawner does) and
never blocks the event loop on a sandbox: kernel work that can take long runs
in the spawner or in short thread-pool calls.

Crash safety: a record is written before any host resource is made, and every
resource is named after the sandbox, so ``start()`` after a SIGKILL re-adopts
running sandboxes whose init survived and destroys everything else (see
docs/RUNTIME.md, "Reconcile").
"""

from __future__ import annotations

import asyncio
import builtins
import collections
import contextlib
import dataclasses
import itertools
import json
import logging
import os
import re
import secrets
import signal
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Final

from dsec.backends.base import (
    UNSET,
    BackendBase,
    Capabilities,
    Capability,
    DiskRoom,
    EdgeMeta,
    GroupOutcome,
    HostFinding,
    OutputCallback,
    SandboxRecord,
    TtySize,
    Usage,
    _Unset,
    check_spec,
    command_line,
)
from dsec.backends.common import cgroupfs
from dsec.backends.common.command import UID_RANGE, check_argv, command_env, user_ids
from dsec.backends.common.fdio import set_done as _set_done
from dsec.backends.common.layers import SharedLayers
from dsec.backends.common.layers import stack as stack_layers
from dsec.backends.common.names import ID_RE, NAME_RE
from dsec.backends.common.output import check_exec, check_timed_out, collect, start_piped
from dsec.backends.container import cgroups, claims, wire
from dsec.backends.container import limits as limit_evidence
from dsec.backends.container import pause as pausing
from dsec.backends.container import snapshot as snapshots
from dsec.backends.container import stages as staging
from dsec.backends.container.fsops import SandboxFiles
from dsec.backends.container.network import Lease, NetworkConfig, NetworkManager
from dsec.backends.container.sandbox import LiveSandbox, RecordView
from dsec.backends.container.sessions import Session
from dsec.backends.container.spawner import ChildExit, Spawner, SpawnError
from dsec.backends.container.uppers import UpperStore, UpperUsage
from dsec.backends.container.zram import ZramStats, ZramSwap
from dsec.errors import (
    DsecError,
    ExecError,
    HostError,
    InvalidSpec,
    LayerNotFound,
    SandboxFailed,
    SandboxNotFound,
    SandboxStateError,
)
from dsec.images.layer import Layer, LayerKind
from dsec.images.mounts import IDLE_PIN_GRACE_S
from dsec.spec import ImageRef, NetworkPolicy, SandboxSpec, SandboxState, can_move
from dsec.spec.results import ExecResult, LimitHit

log = logging.getLogger("dsec.runtime")

UID_FIRST_BASE: Final = 1 << 24  # well above any host account
UID_SLOTS: Final = 60000
CLAIM_PREFIX: Final = ".claim-"
"""A uid slot's file staged before it is linked into place (``.claim-<pid>-<sandbox id>``)."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
LAYER_RELEASE_GRACE_S: Final = IDLE_PIN_GRACE_S
"""A layer's pin outlives its last sandbox this long (a create/destroy loop pays no index write)."""
LAYER_REMOVAL_POLL_S: Final = 1.0
"""How often an idle, still mounted layer is looked up in the store: a removed one is unmounted."""



@dataclass(slots=True, kw_only=True)
class ContainerRecord(SandboxRecord):
    """The container backend's record: the neutral part plus its uid slot, layers, init
    process and network."""

    slot: int = -1
    layers: list[str] = field(default_factory=list)
    init_pid: int = 0
    init_start: int = 0
    net: dict[str, Any] | None = None
    """Its network when it has one beyond loopback: slot, ip, ifname, policy (JSON)."""
    disk_full: bool = False
    """Its writable layer was full when last looked at (:meth:`ContainerRuntime.disk_room`);
    not saved: it only tells the next command's limit verdict where it started from."""

    backend: ClassVar[str] = "container"

    @property
    def uid_base(self) -> int:
        return UID_FIRST_BASE + self.slot * UID_RANGE

    def current_policy(self) -> NetworkPolicy | None:
        pol = (self.net or {}).get("policy")
        return None if pol is None else NetworkPolicy.model_validate(pol)

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "backend": self.backend,
            "state": self.state.value,
            "spec": _spec_json(self.spec),
            "slot": self.slot,
            "layers": self.layers,
            "created_at": self.created_at,
            "init_pid": self.init_pid,
            "init_start": self.init_start,
            "reason": self.reason,
            "edge": self.edge.to_json(),
            "stage": self.stage,
            "net": self.net,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ContainerRecord:
        edge = d.get("edge")
        if edge is None:  # written before records had a typed edge part
            edge = (d.get("meta") or {}).get("edge")
        return cls(
            id=d["id"],
            state=SandboxState(d["state"]),
            spec=SandboxSpec.model_validate(d["spec"]),
            slot=int(d["slot"]),
            layers=list(d["layers"]),
            created_at=float(d["created_at"]),
            init_pid=int(d.get("init_pid", 0)),
            init_start=int(d.get("init_start", 0)),
            reason=str(d.get("reason", "")),
            edge=EdgeMeta.from_json(edge),
            stage=d.get("stage"),
            net=d.get("net"),
        )


_SPEC_JSON: dict[int, tuple[SandboxSpec, dict[str, Any]]] = {}


def _spec_json(spec: SandboxSpec) -> dict[str, Any]:
    """model_dump is ~100 us; specs are immutable and usually shared by many sandboxes."""
    hit = _SPEC_JSON.get(id(spec))
    if hit is not None and hit[0] is spec:
        return hit[1]
    if len(_SPEC_JSON) > 256:
        _SPEC_JSON.clear()
    dumped = spec.model_dump(mode="json")
    _SPEC_JSON[id(spec)] = (spec, dumped)
    return dumped



def _is_paused(rec: ContainerRecord) -> bool:
    """(A function, so type checkers do not keep a narrowing across awaits that change the state.)"""
    return rec.state is SandboxState.PAUSED


def _proc_start_time(pid: int) -> int:
    """Start time (clock ticks since boot) of ``pid``: with the pid, a unique process identity."""
    return _proc_identity(pid)[0]


def _proc_identity(pid: int) -> tuple[int, bool]:
    """(start time, exited): an exited process that is not reaped yet (a zombie) still has one."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        data = f.read()
    fields = data[data.rindex(b")") + 2 :].split()
    return int(fields[19]), fields[0] in (b"Z", b"X")


def _children_tree(pid: int) -> list[int]:
    """All descendants of ``pid`` (host pids), read from /proc/*/task/*/children."""
    out: list[int] = []
    stack = [pid]
    while stack:
        p = stack.pop()
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for t in tasks:
            try:
                with open(f"/proc/{p}/task/{t}/children") as f:
                    kids = [int(x) for x in f.read().split()]
            except OSError:
                continue
            out.extend(kids)
            stack.extend(kids)
    return out


def _reap(pid: int) -> None:
    """Reap an exited child of ours, if it is one."""
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


def kill_tree(pid: int, *, include_root: bool = True) -> None:
    """SIGKILL a process, its process group and every descendant."""
    victims = _children_tree(pid)
    if include_root:
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGKILL)
        victims.append(pid)
    for v in victims:
        with contextlib.suppress(OSError):
            os.kill(v, signal.SIGKILL)


@dataclass(slots=True)
class Process:
    """A process started inside a sandbox. Its exit arrives through the spawner."""

    sandbox_id: str
    pid: int
    exited: asyncio.Future[ChildExit]
    started_at: float

    track: Path | None = None
    """The command's own freezer cgroup: every process it started, detached or not."""

    start_latency_s: float = 0.0
    """From the request to the command's execve (namespaces entered, limits set)."""

    def kill(self, *, tree: bool = True) -> None:
        """SIGKILL the process; with ``tree``, everything it started (its cgroup, group and descendants)."""
        if tree:
            if self.track is not None:
                cgroups.RuntimeCgroups.kill_tracked_path(self.track)
            if not self.exited.done():
                kill_tree(self.pid)
        elif not self.exited.done():
            with contextlib.suppress(OSError):
                os.kill(self.pid, signal.SIGKILL)


@dataclass(frozen=True, slots=True)
class PauseResult:
    """What :meth:`ContainerRuntime.pause` did."""

    sandbox_id: str
    freeze_s: float
    """Seconds until every process was frozen."""
    reclaim: pausing.ReclaimStats | None
    """Memory pushed out to swap (None: reclaim skipped, or the sandbox was resumed meanwhile)."""
    seconds: float
    """The whole pause."""


CAPABILITIES: Final = Capabilities(
    kind="container",
    ops=frozenset({
        Capability.SANDBOXES, Capability.EXEC, Capability.SESSIONS, Capability.PTY, Capability.FILES,
        Capability.PAUSE, Capability.SNAPSHOT, Capability.FORK, Capability.NETWORK, Capability.STAGES,
        Capability.PRISTINE,
    }),
    isolation="user, pid, mount, net, ipc, uts and cgroup namespaces; seccomp; Landlock stages; cgroup limits",
)


class ContainerRuntime(BackendBase):
    """Sandboxes on this node. Use ``async with ContainerRuntime(...) as rt``."""

    kind: ClassVar[str] = "container"

    def __init__(
        self,
        *,
        name: str = "default",
        state_dir: Path | str | None = None,
        run_dir: Path | str | None = None,
        layer_store: Any = None,
        id_prefix: str = "sb",
        zram_size: int = 0,
        reclaim_method: pausing.ReclaimMethod = "pageout+force_empty",
        network: NetworkConfig | None = None,
        uppers_path: Path | str | None = None,
        uppers_image_size: int = 0,
        shrinker_reserve: int = 0,
    ) -> None:
        """``zram_size`` (bytes, 0: none) sets up a zram swap device at ``start()`` for
        paused sandboxes' memory (docs/SNAPSHOTS.md, "Pause"); ``reclaim_method`` is how
        :meth:`pause` pushes memory out (see :mod:`dsec.backends.container.pause`).

        Writable layers on disk (``Resources.disk_medium="disk"``) live in this runtime's
        own btrfs filesystem (:mod:`dsec.backends.container.uppers`): by default a sparse
        image ``<state_dir>/uppers/<name>.img`` of ``uppers_image_size`` bytes (0: 80 % of
        its disk's free space) mounted at ``<run_dir>/<name>/uppers``; ``uppers_path`` is
        an existing btrfs mount to use instead."""
        self.shrinker_reserve = shrinker_reserve
        """Shrinker ids to reserve at start (:mod:`shrinkers`): 0, none."""
        if not NAME_RE.match(name):
            raise InvalidSpec(f"runtime name {name!r} must match {NAME_RE.pattern}", field="name")
        self.name = name
        self.capabilities = CAPABILITIES
        base_state = Path(state_dir or os.environ.get("DSEC_STATE_DIR", "/var/lib/dsec"))
        base_run = Path(run_dir or os.environ.get("DSEC_RUN_DIR", "/run/dsec")).absolute()  # mountinfo is absolute
        self.state_dir = base_state
        self.run_dir = base_run / name
        self.records_dir = base_state / "sandboxes" / name
        self.stage_dir = self.run_dir / "stage"
        self.slots_dir = base_run / "uid-slots"
        self.claims_dir = claims.claims_dir()
        """Host-wide claims of this runtime's name, network tag and subnet (:mod:`claims`)."""
        self._claims: list[claims.Claim] = []
        self.id_prefix = id_prefix
        self._store = layer_store
        self.cgroups = cgroups.RuntimeCgroups(name, on_repair=self._cgroup_repaired)
        self.host_problems: list[HostFinding] = []
        """What the last :meth:`heal` pass found wrong and could not repair (empty: healthy)."""
        self.host_repairs: collections.deque[HostFinding] = collections.deque(maxlen=32)
        """The latest repairs, oldest first."""
        self.repair_counts: collections.Counter[str] = collections.Counter()
        """Repairs made since start, by kind."""
        self._heal_lock = asyncio.Lock()
        self._spawner_lock = asyncio.Lock()
        self._problems_logged: set[str] = set()
        self._repair_gen = 0
        self._last_heal_start = float("-inf")
        self.spawner: Spawner | None = None
        self._boxes: dict[str, LiveSandbox] = {}
        """Every sandbox's live state, its record included (:mod:`sandbox`)."""
        self.sandboxes: RecordView = RecordView(self._boxes)
        """The records, read-only (the Backend protocol's view)."""
        self._devnull = -1
        self.reconciled: dict[str, list[str]] = {}
        self.last_activity: dict[str, float] = {}
        # Which sandboxes use which layer. The store holds one pin per layer for this
        # runtime ("runtime:<name>") while any sandbox uses it: one sqlite write per
        # layer, not per sandbox, and records rebuild the map after a crash.
        self._layers = SharedLayers(self.holder, grace_s=LAYER_RELEASE_GRACE_S, on_idle=self._maybe_release)
        self._resolved: dict[str, tuple[float, str]] = {}
        self._free_slots: list[int] = []
        self._track_seq = 0
        self._boot = secrets.token_hex(3)
        if reclaim_method not in pausing.RECLAIM_METHODS:
            raise InvalidSpec(f"reclaim_method {reclaim_method!r}: choose one of {pausing.RECLAIM_METHODS}",
                              field="reclaim_method")
        self.reclaim_method: pausing.ReclaimMethod = reclaim_method
        self.swap = ZramSwap(name, zram_size, self.run_dir / "zram.json")
        self.max_layers = snapshots.DEFAULT_MAX_LAYERS
        self.snapshot_compressor = snapshots.SNAPSHOT_COMPRESSOR
        """mkfs.erofs compressor of snapshot layers: lz4 (default), lz4hc, or none."""
        self.snapshot_precopy = True
        """Copy the upper once while the sandbox runs, then only what changed under the freeze."""
        self.snapshot_scratch = "auto"
        """Where a snapshot copies the upper while frozen: "auto" (a tmpfs if any, else the store) or "store"."""
        """A snapshot whose stack would be deeper collapses the snapshots on top (docs/SNAPSHOTS.md)."""
        self._lineage: dict[str, tuple[str, ...] | None] = {}
        self._kinds: dict[str, LayerKind] = {}
        self._ephemeral_dir = self.run_dir / "ephemeral"
        self.landlock_abi = staging.landlock_abi()
        """The kernel's Landlock ABI (0: none; stages with file rules then fail to exec)."""
        self.net = NetworkManager(network, runtime=name, claims_dir=self.claims_dir)
        """Sandbox networks (docs/SECURITY.md, "Network"); started at ``start()`` when
        ``network`` is given, else on the first sandbox that asks for a policy."""
        self._net_configured = network is not None
        self.net.open_netns = self.netns_fd
        self.skel_dir = self.run_dir / "skel"
        self.devskel_dir = self.skel_dir / "devskel"
        """The read-only skeleton every sandbox's /dev is bound from (no tmpfs per sandbox)."""
        self.empty_dir = self.skel_dir / "empty"
        """An empty read-only directory bound over /sys and masked /proc directories."""
        self.uppers = UpperStore(
            name,
            mountpoint=Path(uppers_path) if uppers_path else self.run_dir / "uppers",
            image=None if uppers_path else base_state / "uppers" / f"{name}.img",
            image_size=uppers_image_size,
        )
        if any(c in str(self.uppers.mountpoint) for c in ",:\\ \n"):
            raise InvalidSpec(f"uppers path {self.uppers.mountpoint} must not contain , : \\ or spaces "
                              "(it goes into overlayfs options)", field="uppers_path")
        self._uppers_lock = asyncio.Lock()

    # ----- lifecycle of the runtime itself -----

    async def __aenter__(self) -> ContainerRuntime:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def store(self) -> Any:
        if self._store is None:
            from dsec.images.store import LocalLayerStore

            self._store = LocalLayerStore(self.state_dir / "layers")
        return self._store

    async def start(self) -> None:
        from dsec.backends.container.build import spawner_path
        from dsec.backends.container.hostcheck import check_host
        from dsec.images.mounts import LayerMounts

        check_host()
        if self.shrinker_reserve:  # before any sandbox: the reserve is cheap only while few memcgs exist
            from dsec.backends.container import shrinkers

            try:
                await asyncio.to_thread(shrinkers.reserve, self.shrinker_reserve)
            except (OSError, subprocess.SubprocessError) as exc:
                log.warning("shrinker reserve of %d ids failed (creates may slow as the node fills): %s",
                            self.shrinker_reserve, exc)
        # First: another process with this name would share every resource below.
        self._claims = await asyncio.to_thread(claims.claim_runtime, self.claims_dir, self.name)
        try:
            self.cgroups.setup()
            for d in (self.run_dir, self.records_dir, self.stage_dir, self.slots_dir):
                d.mkdir(parents=True, exist_ok=True)
            self._layers.mounts = LayerMounts(self.store, self.run_dir / "layers")  # checks the paths first
        except BaseException:
            self._release_claims()
            raise
        self._devnull = os.open("/dev/null", os.O_RDWR | os.O_CLOEXEC)
        try:
            await asyncio.to_thread(_make_skeletons, self.skel_dir)
            if self.uppers.image is None or self.uppers.image.exists():
                # Adopt the store a previous run left (its sandboxes' layers are there).
                with contextlib.suppress(HostError):
                    await asyncio.to_thread(self.uppers.setup)
            await asyncio.to_thread(self._mounts.adopt)
            self.spawner = Spawner(spawner_path())
            await self.spawner.start()
            self.reconciled = await self._reconcile()
        except BaseException:
            # Half started: leave nothing behind that no sandbox of ours uses.
            if not self.sandboxes:
                with contextlib.suppress(Exception):
                    await asyncio.to_thread(self.uppers.close, unmount=True)
                with contextlib.suppress(Exception):
                    await asyncio.to_thread(_unmount_skeletons, self.skel_dir)
            if self.spawner is not None:
                with contextlib.suppress(Exception):
                    await self.spawner.close()
                self.spawner = None
            os.close(self._devnull)
            self._devnull = -1
            self._release_claims()
            raise
        try:
            await self._setup_swap()
            await asyncio.to_thread(snapshots.clean_scratch, self)
            if self._net_configured or self.net.sandboxes:
                await self.net.start()
        except BaseException:
            # Started but for these: stop again (re-adopted sandboxes keep running), so the
            # spawner, mounts and claims do not outlive a start that failed.
            with contextlib.suppress(Exception):
                await self.close(destroy_all=not self.sandboxes)
            raise

    async def close(self, *, destroy_all: bool = True) -> None:
        """Stop the runtime. By default every sandbox is destroyed; ``destroy_all=False``
        leaves them running for the next ``start()`` to re-adopt."""
        if destroy_all:
            await asyncio.gather(*(self.destroy(i) for i in list(self.sandboxes)), return_exceptions=True)
        await self.net.close()
        if destroy_all and self.net.host_tables_made and not any(r.net for r in self.sandboxes.values()):
            with contextlib.suppress(Exception):
                await asyncio.to_thread(self.net.remove_host_rules)
        if self.spawner is not None:
            await self.spawner.close()
            self.spawner = None
        if self._mounts is not None:
            self._layers.release_idle()
        if self._mounts is not None and destroy_all:
            await asyncio.to_thread(self._mounts.close)
        if self._devnull >= 0:
            os.close(self._devnull)
            self._devnull = -1
        with contextlib.suppress(OSError):
            snapshots.clean_scratch(self)
        if destroy_all and not self.sandboxes:
            await asyncio.to_thread(self.uppers.close, unmount=True)
            with contextlib.suppress(OSError):
                await asyncio.to_thread(_unmount_skeletons, self.skel_dir)
        else:
            self.uppers.close(unmount=False)
        if destroy_all:
            self.cgroups.remove_parents()
            if not self.sandboxes:
                # No sandbox left whose pages could be in it (swapoff would pull them back).
                with contextlib.suppress(HostError):
                    await asyncio.to_thread(self.swap.teardown)
            if not self.sandboxes:
                await asyncio.to_thread(self._remove_run_dir)
        self._release_claims()

    def _remove_run_dir(self) -> None:
        """Nothing mounted below the run directory any more: remove what is left of it (the
        layer mounts' lock file, empty directories), so a stopped runtime leaves no trace."""
        prefix = f"{self.run_dir}/"
        with open("/proc/self/mountinfo") as f:
            if any(ln.split()[4].startswith(prefix) for ln in f):
                return
        with contextlib.suppress(OSError):
            (self.run_dir / "layers" / ".lock").unlink()
        for d in sorted((p for p in self.run_dir.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
            with contextlib.suppress(OSError):
                d.rmdir()
        with contextlib.suppress(OSError):
            self.run_dir.rmdir()

    def _release_claims(self) -> None:
        for c in self._claims:
            c.release()
        self._claims = []

    # ----- records -----

    def _record_path(self, sandbox_id: str) -> Path:
        return self.records_dir / f"{sandbox_id}.json"

    def _save(self, rec: ContainerRecord) -> None:
        path = self._record_path(rec.id)
        data = json.dumps(rec.to_json()).encode()
        try:
            # First write: create it in place (one inode, no rename: file creation is
            # the slow part on a busy ext4 journal). A torn first write reads as
            # unparsable and the reconciler cleans the sandbox up by its cgroups.
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except FileExistsError:
            # Rewrite in place with one pwrite, padded with spaces (JSON ignores trailing
            # whitespace) to the old size: no truncation, no rename, so no ext4 journal
            # work (~10 us against ~250 us for temp file + rename, HOST-FACTS-style
            # measurement in docs/RUNTIME.md), and a process crash leaves either the old
            # or the new record, never a mix (one syscall into the page cache).
            fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
            try:
                old = os.fstat(fd).st_size
                if len(data) < old:
                    data += b" " * (old - len(data))
                os.pwrite(fd, data, 0)
            finally:
                os.close(fd)
            return
        try:
            os.write(fd, data)
        finally:
            os.close(fd)

    def _move(self, rec: ContainerRecord, dst: SandboxState, *, reason: str = "", save: bool = True) -> None:
        if not can_move(rec.state, dst):
            raise SandboxStateError(
                f"sandbox {rec.id} cannot go from {rec.state.value} to {dst.value}",
                sandbox_id=rec.id,
                state=rec.state.value,
            )
        rec.state = dst
        if reason:
            rec.reason = reason
        self._event(rec, "state", state=dst.value, reason=reason)
        if save:
            self._save(rec)

    def _event(self, rec: ContainerRecord, kind: str, **data: Any) -> None:
        rec.events.append({"t": time.time(), "event": kind, **data})
        if len(rec.events) > 1000:
            del rec.events[:100]

    def _claim_slot(self, sandbox_id: str) -> int:
        # Slot files are host-wide, so two runtimes never share a uid range.
        # Recently freed slots first: the spawner keeps their user namespaces.
        start = secrets.randbelow(UID_SLOTS)
        recent = list(reversed(self._free_slots))
        self._free_slots.clear()
        candidates = itertools.chain(recent, ((start + i) % UID_SLOTS for i in range(UID_SLOTS)))
        with self._slot_claim(sandbox_id) as claim:
            for slot in candidates:
                if claim(slot):
                    return slot
        raise HostError("no free uid range for a new sandbox (60,000 in use)")

    @contextlib.contextmanager
    def _slot_claim(self, sandbox_id: str) -> Any:
        """``claim(slot)`` -> whether this runtime took the slot for ``sandbox_id``. A slot file is
        written whole and then linked into place, never created empty and written after: an edge
        killed between the two left an empty file no reconcile could tell the owner of (a uid range
        lost until the host's next boot). The staging file names this process (``.claim-<pid>-``):
        the reconcile removes those of processes that are gone."""
        tmp = self.slots_dir / f"{CLAIM_PREFIX}{os.getpid()}-{sandbox_id}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, f"{self.name} {sandbox_id}\n".encode())
        finally:
            os.close(fd)

        def claim(slot: int) -> bool:
            try:
                os.link(tmp, self.slots_dir / str(slot))
            except FileExistsError:
                return False
            return True

        try:
            yield claim
        finally:
            tmp.unlink(missing_ok=True)

    def _release_slot(self, rec: ContainerRecord) -> None:
        path = self.slots_dir / str(rec.slot)
        with contextlib.suppress(OSError):
            if path.read_text().split() == [self.name, rec.id]:
                path.unlink()
                self._free_slots.append(rec.slot)
                del self._free_slots[:-1024]

    # ----- create / destroy -----

    def _new_id(self) -> str:
        return f"{self.id_prefix}-{secrets.token_hex(6)}"

    async def _ensure_spawner(self, *, check: bool = False) -> Spawner:
        """The spawner, restarted if it died (sandboxes do not depend on it staying up);
        ``check`` also looks at the process, not only at its socket."""
        old = self.spawner
        if old is None:
            raise HostError("the runtime is not started: use `async with ContainerRuntime(...)` or await start()")
        if old.lost or (check and not old.alive):
            async with self._spawner_lock:
                if self.spawner is old:  # not restarted meanwhile by a concurrent caller
                    from dsec.backends.container.build import spawner_path

                    new = Spawner(spawner_path())
                    try:
                        await new.start()
                    except BaseException:
                        with contextlib.suppress(Exception):
                            await new.close()
                        raise
                    self.spawner = new
                    self._note("spawner", f"restarted dsec-spawner (pid {old.pid} had exited; now pid {new.pid})",
                               repaired=True)
                    with contextlib.suppress(Exception):
                        await old.close()
        assert self.spawner is not None
        return self.spawner

    async def _spawn_create(self, sid: str, req: wire.CreateRequest) -> Any:
        """The spawner's create, tried again once when it failed because host state had
        vanished and a heal pass (:meth:`heal`) put it back (a layer unmounted, the /dev
        skeleton gone, the spawner dead)."""
        for attempt in (0, 1):
            gen, t0 = self._repair_gen, time.monotonic()
            spawner = await self._ensure_spawner()
            try:
                return await spawner.send(req)
            except SpawnError as exc:
                if exc.pid > 0:
                    _reap(exc.pid)  # our child (CLONE_PARENT), already exited
                if attempt or not await self._repaired_since(gen, t0):
                    raise SandboxFailed(
                        f"sandbox {sid} failed to start at step {exc.stage!r}: {exc.detail} ({os.strerror(exc.errno)})",
                        sandbox_id=sid,
                        reason=exc.stage,
                    ) from None
            except HostError:
                if attempt or not await self._repaired_since(gen, t0):
                    raise
        raise AssertionError("unreachable")

    async def create(
        self, spec: SandboxSpec, *, sandbox_id: str | None = None, edge: EdgeMeta | None = None,
        hide_pids: bool = False,
    ) -> ContainerRecord:
        """Start a sandbox of ``spec`` (idempotent per ``sandbox_id``); ``edge`` is kept with
        its record for the edge (never read here). ``hide_pids``: its /proc shows a process
        only to the same uid and to the sandbox's root (a backend that runs mutually
        untrusted uids in one sandbox: FnCall's workers)."""
        if spec.backend != self.kind:
            raise InvalidSpec(f"spec.backend is {spec.backend!r}; this is the {self.kind} backend", field="backend")
        check_spec(self.capabilities, spec)
        await self._ensure_spawner()
        sid = sandbox_id or self._new_id()
        if not ID_RE.match(sid):
            raise InvalidSpec(f"sandbox id {sid!r} must match {ID_RE.pattern}", field="sandbox_id")
        existing = self.sandboxes.get(sid)
        if existing is not None:
            return existing  # idempotent
        layers = self._layers_for(spec.image)
        policy = spec.effective_network()
        compiled = None if policy is None else await self.net.compile(policy)  # bad names fail first
        rec = ContainerRecord(id=sid, state=SandboxState.CREATING, spec=spec, created_at=time.time(), layers=layers,
                              edge=edge if edge is not None else EdgeMeta())
        box = self._boxes[sid] = LiveSandbox(rec)
        async with box.lock:
            lease: Lease | None = None
            try:
                # No record until the init runs: until then every host resource is
                # found by name (cgroups, uid slot file) and the reconciler removes it.
                rec.slot = self._claim_slot(sid)
                res = spec.resources
                if res.disk_medium == "disk" and not (self.uppers.ready and self.uppers.mounted()):
                    await self._setup_uppers()
                cg_dirs, upper = await asyncio.to_thread(self._make_host_parts, sid, res, rec.uid_base)
                lowers = [await self._use_layer(d, sid) for d in layers]
                if policy is not None:
                    lease = await self.net.take()
                    await self.net.apply(sid, lease.fd, lease.info(), policy, compiled=compiled, fresh=True)
                    rec.net = {**lease.info(), "policy": policy.model_dump(mode="json")}
                spawned = await self._spawn_create(sid, wire.CreateRequest(
                    sandbox_id=sid, stage=self.stage_dir, uid_base=rec.uid_base, uid_count=UID_RANGE,
                    disk=res.disk, inodes=max(16384, res.disk // 8192), devskel=self.devskel_dir,
                    empty=self.empty_dir, upper=upper, lowers=tuple(lowers), cgroups=tuple(cg_dirs),
                    net_fd=lease.fd if lease else None, hide_pids=hide_pids))
                os.close(spawned.pidfd)
                rec.init_pid = spawned.pid
                rec.init_start = _proc_start_time(spawned.pid)
                self._move(rec, SandboxState.RUNNING)
                self.last_activity[sid] = time.monotonic()
                return rec
            except BaseException:
                if lease is not None and sid not in self.net.sandboxes:
                    self.net.release(lease)  # never handed over to the sandbox's state
                await self._teardown(rec)
                self._boxes.pop(sid, None)
                raise
            finally:
                if lease is not None:
                    os.close(lease.fd)  # the sandbox's processes hold the namespace now

    async def destroy(self, sandbox_id: str) -> bool:
        """Destroy a sandbox and everything it holds. Idempotent: False if it was not there."""
        box = self._boxes.get(sandbox_id)
        if box is None:
            return False
        rec = box.rec
        async with box.lock:
            if self._boxes.get(sandbox_id) is not box:
                return False
            if rec.state is SandboxState.PAUSED:
                # Frozen tasks die only once thawed: kill them frozen, then thaw (no page-in).
                self.cgroups.kill_all(sandbox_id)
            if rec.state in (SandboxState.RUNNING, SandboxState.FAILED, SandboxState.CREATING, SandboxState.PAUSED):
                self._move(rec, SandboxState.STOPPING, save=False)  # a cut-short destroy: see docs/RUNTIME.md
            for sess in box.take_sessions():
                with contextlib.suppress(Exception):
                    await sess.close()
            left = await self._teardown(rec)
            if not left:
                self._move(rec, SandboxState.STOPPED, save=False)  # the record file is gone
            self._boxes.pop(sandbox_id, None)
            self.last_activity.pop(sandbox_id, None)
            if left:
                raise HostError(f"sandbox {sandbox_id}: could not remove {left}", sandbox_id=sandbox_id)
            return True

    async def _teardown(self, rec: ContainerRecord) -> list[str]:
        """Kill, unmount (the mount namespace dies with its last process), remove cgroups,
        release layers, uid range and record. Safe to call on a half-made sandbox."""
        sid = rec.id
        # A networked sandbox's namespace outlives it when we hold an fd: it is reset and
        # goes back to the pool (no veth to make, no namespace teardown: both are slow).
        keep_netns = self._netns_fd(rec, check=False) if rec.net is not None and rec.init_pid else None
        if rec.state is SandboxState.PAUSED or pausing.freezer_state(self.cgroups, sid) not in ("THAWED", ""):
            self.cgroups.kill_all(sid)  # frozen: kill, then thaw, or the init never exits
        if rec.init_pid:
            await self._kill_init(rec)
        if self.cgroups.pids(sid):
            self.cgroups.kill_all(sid)
            deadline = time.monotonic() + 5
            while self.cgroups.pids(sid) and time.monotonic() < deadline:
                await asyncio.sleep(0.002)
        left = await asyncio.to_thread(self._remove_host_parts, rec)
        for d in set(rec.layers):
            self._layers.unuse(d, sid)
        if rec.slot >= 0:
            self._release_slot(rec)
        if keep_netns is not None and not self.cgroups.pids(sid):
            self.net.recycle(sid, keep_netns)  # takes the fd
        elif keep_netns is not None:
            os.close(keep_netns)
        if rec.net is not None or sid in self.net.sandboxes:
            self.net.forget(sid)  # the namespace and its veth die with the last process
        if not left:
            self._record_path(sid).unlink(missing_ok=True)
        return left

    async def _kill_init(self, rec: ContainerRecord) -> None:
        fd = self._open_init(rec, check=False)
        if fd is None:
            return
        try:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(fd, signal.SIGKILL)
            # A pidfd polls readable once the process has exited (after its namespace is emptied).
            loop = asyncio.get_running_loop()
            done: asyncio.Future[None] = loop.create_future()
            loop.add_reader(fd, _set_done, done)
            try:
                await asyncio.wait_for(done, 10)
            except TimeoutError:
                pass
            finally:
                loop.remove_reader(fd)
            if done.done():
                # The init is this process's child (the spawner clones it with CLONE_PARENT);
                # one adopted from an earlier runtime process is not, and is reaped by init.
                with contextlib.suppress(ChildProcessError, OSError):
                    os.waitid(os.P_PIDFD, fd, os.WEXITED | os.WNOHANG)
        finally:
            os.close(fd)
        if self.spawner is not None:
            self.spawner.forget_exit(rec.init_pid)

    def _open_init(self, rec: ContainerRecord, *, check: bool = True) -> int | None:
        """A pidfd of the sandbox's init, verified to be that very process (no pid reuse)."""
        try:
            fd = os.pidfd_open(rec.init_pid)
        except OSError:
            fd = None
        if fd is not None:
            try:
                start, exited = _proc_identity(rec.init_pid)
                if start == rec.init_start:
                    if not exited:
                        return fd
                    # Dead but not reaped: it is this process's child (CLONE_PARENT). Reap it.
                    with contextlib.suppress(ChildProcessError, OSError):
                        os.waitid(os.P_PIDFD, fd, os.WEXITED | os.WNOHANG)
            except OSError:
                pass
            os.close(fd)
        if check:
            self._mark_failed(rec, "the sandbox's init process is gone")
            raise SandboxFailed(
                f"sandbox {rec.id} has failed: its init process is gone", sandbox_id=rec.id, reason="init_exited"
            )
        return None

    @property
    def holder(self) -> str:
        return f"runtime:{self.name}"

    @property
    def _mounts(self) -> Any:
        """The node's layer mounts this runtime uses (set at start)."""
        return self._layers.mounts

    def _resolve(self, ref: str) -> str:
        """Layer ref -> digest. Digests are immutable; a name:tag is re-read after 1 s."""
        if ref.startswith("sha256:") and len(ref) == 71:
            hit = self._resolved.get(ref)
            if hit is None:
                self._resolved[ref] = (float("inf"), self.store.resolve(ref).digest)
            return ref
        now = time.monotonic()
        hit = self._resolved.get(ref)
        if hit is not None and hit[0] > now:
            return hit[1]
        digest: str = self.store.resolve(ref).digest
        self._resolved[ref] = (now + 1.0, digest)
        return digest

    async def _use_layer(self, digest: str, sandbox_id: str) -> Path:
        known, remounted = await self._layers.use(digest, sandbox_id)
        if remounted:
            self._note("layer_mount", f"re-mounted layer {digest} at {known} (it had been unmounted)", repaired=True)
        return known

    def _maybe_release(self, digest: str) -> None:
        """A layer no sandbox uses (after the grace, or at close): its pin is dropped, a fork's
        layer removed, and a layer gone from the store unmounted."""
        held = self._layers.release(digest)  # False: an earlier timer released it already
        if held is None:
            return
        if (self._ephemeral_dir / digest.split(":", 1)[1]).exists():
            self.drop_ephemeral(digest)
        if held:
            self._unmount_if_removed(digest)

    def _unmount_if_removed(self, digest: str) -> None:
        """An idle layer stays mounted as a cache while the store has it; once it is removed
        (`dsec image rm` in another process, a dropped fork snapshot) it is unmounted, which
        frees its disk. Looked up every LAYER_REMOVAL_POLL_S while idle: one index read."""
        if self._mounts is None or digest in self._layers.users:
            return  # in use again: its next release watches it again
        try:
            if self._mounts.unmount_if_removed(digest):
                return
        except DsecError as exc:
            log.warning("cannot unmount removed layer %s: %s", digest, exc)
            return
        with contextlib.suppress(RuntimeError):  # no running loop (called from a test): no watch
            asyncio.get_running_loop().call_later(LAYER_REMOVAL_POLL_S, self._unmount_if_removed, digest)

    def update(self, sandbox_id: str, *, spec: SandboxSpec | None = None, edge: EdgeMeta | None = None) -> ContainerRecord:
        """Change what the record says (not the running sandbox): a warm-pool sandbox taken
        for a request gets that request's spec (same layers and resources) and edge part."""
        rec = self._running(sandbox_id)
        if spec is not None:
            if spec.resources != rec.spec.resources or self._layers_for(spec.image) != rec.layers:
                raise InvalidSpec(
                    f"sandbox {sandbox_id} runs other layers or resources than the new spec", field="spec", sandbox_id=sandbox_id
                )
            rec.spec = spec
        if edge is not None:
            rec.edge = edge
        self._save(rec)
        return rec

    def _check_limits(self, rec: ContainerRecord, counters: limit_evidence.Counters | None = None) -> None:
        """Turn new OOM kills and pids-limit hits into events (counters are cumulative);
        ``counters`` when the caller has just read them."""
        now = counters if counters is not None else limit_evidence.counters(self.cgroups, rec.id)
        if now is None:
            return
        box = self._boxes.get(rec.id)
        if box is None:
            return  # destroyed meanwhile
        seen = box.limits_seen
        for i, (event, value) in enumerate((("oom", now.oom_kills), ("pids_limit", now.pids_hits))):
            if value > seen[i]:
                self._event(rec, event, count=value - seen[i])
                seen[i] = value

    def limit_baseline(self, rec: ContainerRecord) -> limit_evidence.Baseline:
        """What a command starts from, for :meth:`limit_hit`: the sandbox's OOM-kill and
        pids-limit counters now (two small reads) and whether its layer was last seen full."""
        return limit_evidence.Baseline(limit_evidence.counters(self.cgroups, rec.id), rec.disk_full)

    def limit_hit(
        self,
        rec: ContainerRecord,
        before: limit_evidence.Baseline | None,
        *,
        exit_code: int | None,
        sig: int | None,
        timed_out: str | None = None,
        timeout_s: float | None = None,
        idle_timeout_s: float | None = None,
        truncated: bool = False,
        output_cap: int = 0,
        output: tuple[bytes, ...] = (),
    ) -> LimitHit | None:
        """Which limit ended a command that just finished (``ExecResult.limit``), judged from
        the counters ``before`` it and now (see :mod:`limits`). A failed command's counters
        are read here and turned into events at once; a succeeded one's are left to
        :meth:`_check_limits`, off the reply path."""
        after = disk = None
        if limit_evidence.failed(exit_code, sig) and timed_out is None:
            after = limit_evidence.counters(self.cgroups, rec.id)
            if after is not None:
                self._check_limits(rec, after)
            disk = self.disk_room(rec)
        return limit_evidence.judge(
            rec.spec.resources, exit_code=exit_code, sig=sig, timed_out=timed_out, timeout_s=timeout_s,
            idle_timeout_s=idle_timeout_s, truncated=truncated, output_cap=output_cap, before=before, after=after,
            disk=disk, output=output,
        )

    def disk_room(self, rec: SandboxRecord) -> DiskRoom | None:
        """Room left in the sandbox's writable layer under its quota (None: cannot tell);
        whether it is full is remembered in ``rec.disk_full``."""
        assert isinstance(rec, ContainerRecord)
        room = self._measure_disk(rec)
        if room is not None:
            rec.disk_full = room.full
        return room

    def _measure_disk(self, rec: ContainerRecord) -> DiskRoom | None:
        if rec.spec.resources.disk_medium == "disk":
            # statvfs of a subvolume shows the whole store: its qgroup holds the quota.
            try:
                use = self.uppers.usage(rec.id)
                seen = self.last_activity.get(rec.id, 0.0)
                box = self._boxes.get(rec.id)
                if use.free < limit_evidence.DISK_FULL_BYTES and box is not None and box.disk_commit != seen:
                    # Looks full: the figures may predate an rm (qgroups update at commits).
                    # Commit (a few ms) and look again, once per burst of activity: a full
                    # sandbox left idle costs nothing more.
                    box.disk_commit = seen
                    self.uppers.commit()
                    use = self.uppers.usage(rec.id)
            except (OSError, ValueError, HostError):
                return None
            return DiskRoom(use.free, -1, use.free < limit_evidence.DISK_FULL_BYTES)
        return limit_evidence.disk_room(rec.init_pid)

    def events(self, sandbox_id: str) -> builtins.list[dict[str, Any]]:
        return list(self.get(sandbox_id).events)

    def _mark_failed(self, rec: ContainerRecord, reason: str) -> None:
        if can_move(rec.state, SandboxState.FAILED):
            self._move(rec, SandboxState.FAILED, reason=reason)

    # ----- lookups -----

    def get(self, sandbox_id: str) -> ContainerRecord:
        rec = self.sandboxes.get(sandbox_id)
        if rec is None:
            raise SandboxNotFound(f"no sandbox {sandbox_id!r} on this node", sandbox_id=sandbox_id)
        return rec

    def list(self) -> builtins.list[ContainerRecord]:
        return [b.rec for b in self._boxes.values()]

    def sandbox_state(self, sandbox_id: str) -> LiveSandbox | None:
        """Like :meth:`live`, None for a sandbox that is gone."""
        return self._boxes.get(sandbox_id)

    def init_handle(self, rec: ContainerRecord) -> int:
        """A pidfd of the sandbox's init (the caller closes it); SandboxFailed, and the record
        marked failed, if the init is gone."""
        fd = self._open_init(rec)
        assert fd is not None
        return fd

    def mark_failed(self, rec: ContainerRecord, reason: str) -> None:
        self._mark_failed(rec, reason)

    def layer_path(self, digest: str) -> Path:
        """Where a layer this runtime uses is mounted on the host."""
        return self._layers.path(digest)

    def mark_ephemeral(self, digest: str) -> None:
        """A fork's layer: removed once no sandbox uses it (:meth:`drop_ephemeral`)."""
        self._mark_ephemeral(digest)

    def event(self, rec: ContainerRecord, kind: str, **data: Any) -> None:
        """Add to the sandbox's event log."""
        self._event(rec, kind, **data)

    def live(self, sandbox_id: str) -> LiveSandbox:
        """The sandbox's live state (lock, sessions, stage switch, pack handshake): what
        sessions, snapshots and pause use instead of the runtime's private members."""
        box = self._boxes.get(sandbox_id)
        if box is None:
            raise SandboxNotFound(f"no sandbox {sandbox_id!r} on this node", sandbox_id=sandbox_id)
        return box

    def require_running(self, sandbox_id: str) -> ContainerRecord:
        """The record of a running sandbox; SandboxNotFound / SandboxStateError otherwise."""
        return self._running(sandbox_id)

    def _running(self, sandbox_id: str, *, resume: bool = True) -> ContainerRecord:
        """The record of a running sandbox; a paused one is resumed first (unless ``resume``
        is False: then it is an error like any other state)."""
        rec = self.get(sandbox_id)
        if rec.state is SandboxState.PAUSED and resume:
            self.wake(sandbox_id)
        if rec.state is not SandboxState.RUNNING:
            raise SandboxStateError(
                f"sandbox {sandbox_id} is {rec.state.value}, not running"
                + (f" ({rec.reason})" if rec.reason else ""),
                sandbox_id=sandbox_id,
                state=rec.state.value,
            )
        return rec

    def _live(self, sandbox_id: str) -> ContainerRecord:
        """The record of a running or paused sandbox (a paused one stays paused)."""
        rec = self.get(sandbox_id)
        if rec.state is SandboxState.PAUSED:
            return rec
        return self._running(sandbox_id)

    def upper_path(self, sandbox_id: str) -> Path:
        """The writable layer as the host sees it (through the init's fd 3); a paused sandbox stays paused."""
        rec = self._live(sandbox_id)
        return Path(f"/proc/{rec.init_pid}/fd/3/upper")

    def root_path(self, sandbox_id: str) -> Path:
        rec = self._running(sandbox_id)
        return Path(f"/proc/{rec.init_pid}/root")

    # ----- network -----

    async def set_policy(self, sandbox_id: str, policy: NetworkPolicy | None) -> ContainerRecord:
        """Replace a sandbox's network policy at once (one nftables transaction); TCP
        connections the new policy forbids are cut. ``None``: nothing beyond loopback.
        A loopback-only sandbox gets its veth on the first policy. Works while paused."""
        compiled = None if policy is None else await self.net.compile(policy)
        async with self.live(sandbox_id).lock:
            rec = self._live(sandbox_id)
            if rec.net is None and policy is None:
                return rec
            pidfd = self._netns_fd(rec)
            assert pidfd is not None
            try:
                if rec.net is None:
                    lease = await self.net.attach(sandbox_id, pidfd)
                    os.close(lease.fd)
                    try:
                        cut = await self.net.apply(sandbox_id, pidfd, lease.info(), policy, compiled=compiled)
                    except BaseException:
                        if sandbox_id not in self.net.sandboxes:
                            self.net.release(lease)
                        raise
                    rec.net = lease.info()
                else:
                    cut = await self.net.apply(sandbox_id, pidfd, rec.net, policy, compiled=compiled)
            finally:
                os.close(pidfd)
            dumped = None if policy is None else policy.model_dump(mode="json")
            rec.net = {**rec.net, "policy": dumped}
            self._save(rec)
            self._event(rec, "policy_changed", policy=dumped, connections_cut=cut)
            return rec

    def _netns_fd(self, rec: ContainerRecord, *, check: bool = True) -> int | None:
        """An fd of the sandbox's network namespace, taken from its verified init."""
        pidfd = self._open_init(rec, check=check)
        if pidfd is None:
            return None
        fd = -1
        try:
            fd = os.open(f"/proc/{rec.init_pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
            signal.pidfd_send_signal(pidfd, 0)  # still that process: the fd is its namespace
            return fd
        except OSError:
            if fd >= 0:
                os.close(fd)
            if check:
                raise SandboxFailed(f"sandbox {rec.id}: its init is gone", sandbox_id=rec.id,
                                    reason="init exited") from None
            return None
        finally:
            os.close(pidfd)

    def netns_fd(self, sandbox_id: str) -> int | None:
        """An fd of a sandbox's network namespace (the caller closes it); None if it is gone."""
        rec = self.sandboxes.get(sandbox_id)
        return None if rec is None else self._netns_fd(rec, check=False)

    def network_info(self, sandbox_id: str) -> dict[str, Any] | None:
        """Address, policy and refused-packet counts (as of the last :meth:`collect_denied`);
        None for a loopback-only sandbox."""
        rec = self.get(sandbox_id)
        if rec.net is None:
            return None
        st = self.net.sandboxes.get(sandbox_id)
        return {
            "ip": rec.net.get("ip"),
            "ifname": rec.net.get("ifname"),
            "gateway": self.net.gateway,
            "policy": rec.net.get("policy"),
            "denied_packets": st.denied_seen if st else 0,
            "denied_recent": list(st.denied_recent) if st else [],
        }

    async def collect_denied(self) -> dict[str, int]:
        """Read every networked sandbox's refused-packet counter; record a ``net_denied``
        event where it grew. Returns the increase per sandbox (only those that grew)."""
        grown: dict[str, int] = {}
        for sid in list(self.net.sandboxes):
            rec = self.sandboxes.get(sid)
            st = self.net.sandboxes.get(sid)
            if rec is None or st is None or rec.state not in (SandboxState.RUNNING, SandboxState.PAUSED):
                continue
            pidfd = self._netns_fd(rec, check=False)
            if pidfd is None:
                continue
            try:
                total, dests = await self.net.denied(sid, pidfd)
            except Exception:
                continue
            finally:
                os.close(pidfd)
            st.denied_recent = dests[-16:]
            if total > st.denied_seen:
                grown[sid] = total - st.denied_seen
                st.denied_seen = total
                self._event(rec, "net_denied", count=grown[sid], total=total, destinations=dests[-16:])
        return grown

    # ----- stages (docs/SECURITY.md, "Stages and Landlock") -----

    def current_stage(self, sandbox_id: str) -> str | None:
        rec = self.get(sandbox_id)
        return rec.stage or rec.spec.stage

    async def set_stage(self, sandbox_id: str, name: str) -> ContainerRecord:
        """Switch the sandbox to stage ``name`` (declared in ``spec.stages``).

        Landlock cannot be changed on a running process, so every process of the
        sandbox but its init is killed first: commands in flight end with SIGKILL,
        sessions end (their next ``run`` raises SessionClosed). Then the stage's
        network policy is applied, the stage recorded (it survives a runtime
        restart) and a ``stage_changed`` event logged. New commands wait for the
        switch and start under the new stage's file rules."""
        rec = self._running(sandbox_id)
        stage = rec.spec.stages.get(name)
        if stage is None:
            known = ", ".join(sorted(rec.spec.stages)) or "none declared"
            raise InvalidSpec(f"sandbox {sandbox_id} has no stage {name!r} (declared: {known})",
                              field="stage", sandbox_id=sandbox_id, stages=sorted(rec.spec.stages))
        if not stage.files.unrestricted and self.landlock_abi < 1:
            raise HostError("stage file rules need Landlock, which this kernel lacks (CONFIG_SECURITY_LANDLOCK, lsm=landlock)",
                            sandbox_id=sandbox_id)
        box = self.live(sandbox_id)
        gate = await box.begin_stage_switch()  # one switch at a time
        t0 = time.perf_counter()
        try:
            rec = self._running(sandbox_id)
            old = rec.stage or rec.spec.stage
            # Starts already sent to the spawner finish first (their child may not be in the cgroup yet).
            while box.spawning > 0:
                await asyncio.sleep(0.0005)
            killed = await self._kill_all_but_init(rec)
            for sess in box.take_sessions():
                sess.ended_reason = f"the sandbox switched to stage {name!r}; open a new session"
                with contextlib.suppress(Exception):
                    await sess.close()
            split: builtins.list[str] = []
            symlinked: builtins.list[str] = []
            if not stage.files.unrestricted:
                split, symlinked = await asyncio.to_thread(self._stage_fs_checks, rec, stage.files)
            await self.set_policy(sandbox_id, stage.network)
            rec.stage = name
            self._save(rec)
            self._event(rec, "stage_changed", **{"from": old, "to": name}, killed=killed, links_split=split,
                        symlinked_rule_paths=symlinked, seconds=round(time.perf_counter() - t0, 6))
            self.last_activity[sandbox_id] = time.monotonic()
            return rec
        finally:
            box.end_stage_switch(gate)

    @staticmethod
    def _stage_fs_checks(rec: ContainerRecord, files: Any) -> tuple[builtins.list[str], builtins.list[str]]:
        """(files under restricted paths split off their hard links, rule paths that are symlinks)."""
        root = f"/proc/{rec.init_pid}/root"
        split = staging.split_hard_links(root, f"/proc/{rec.init_pid}/fd/3/upper", files)
        named = (*staging.restricted_paths(files), *files.writable)
        return split, staging.symlinked_paths(root, named)

    async def _kill_all_but_init(self, rec: ContainerRecord) -> int:
        """SIGKILL every process of the sandbox except its init (frozen first, so none forks
        meanwhile); returns how many were killed, once they are gone."""
        sid = rec.id
        if all(p == rec.init_pid for p in self.cgroups.pids(sid)):
            return 0  # the init alone never forks, and no start is in flight: nothing can appear
        await pausing.freeze(self.cgroups, sid)
        victims = [p for p in self.cgroups.pids(sid) if p != rec.init_pid]
        try:
            for pid in victims:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        finally:
            pausing.thaw(self.cgroups, sid)
        deadline = time.monotonic() + 10
        delay = 0.0002
        while any(p != rec.init_pid for p in self.cgroups.pids(sid)):
            if time.monotonic() > deadline:
                raise HostError(f"sandbox {sid}: processes of the old stage did not die within 10 s", sandbox_id=sid)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.01)
        return len(victims)

    def _pristine(self, rec: ContainerRecord, pristine: Sequence[str]) -> wire.Pristine:
        """What the spawner needs for pristine paths: the image layers (never snapshot layers:
        those hold the agent's own writes) as host mounts, top first, and the paths."""
        paths = staging.check_pristine(pristine)
        image = [d for d in rec.layers if self._layer_lineage(d) is None]
        if not image:
            raise InvalidSpec(f"sandbox {rec.id} has no image layers to take pristine copies from",
                              field="pristine", sandbox_id=rec.id)
        return wire.Pristine(tuple(self._layers.path(d) for d in image), paths)

    # ----- running things -----

    async def start_process(
        self,
        sandbox_id: str,
        argv: Sequence[str],
        *,
        stdin: int,
        stdout: int,
        stderr: int,
        env: Mapping[str, str] | None = None,
        cwd: str = "/",
        user: int | str = 0,
        seccomp: bool = True,
        tracked: bool = True,
        pristine: Sequence[str] = (),
        tty: TtySize | None = None,
    ) -> Process:
        """Start ``argv`` in the sandbox with the given host fds as its stdio.

        ``tracked`` puts the command in its own freezer cgroup so that
        :meth:`Process.kill` reaches every process it started. The current
        stage's file rules bind it (Landlock); ``pristine`` paths are the
        image's own (see :meth:`exec`). With ``tty`` the stdio fds are
        ignored: use :meth:`start_tty`."""
        spawner = await self._ensure_spawner()
        await self.live(sandbox_id).wait_for_stage_switch()  # it kills the old stage's processes
        rec = self._running(sandbox_id)
        box = self.live(sandbox_id)
        check_argv(sandbox_id, argv, cwd)
        uid, gid = user_ids(user)
        merged = command_env(rec.spec.env, env)
        res = rec.spec.resources
        stage = rec.stage or rec.spec.stage
        landlock = None if stage is None else staging.landlock(rec.spec.stages[stage].files)
        image_copies = self._pristine(rec, pristine) if pristine else None  # checked before a cgroup is made
        cg_dirs = self.cgroups.dirs(sandbox_id)
        track: Path | None = None
        if tracked:
            self._track_seq += 1  # unique across runtime restarts: leftovers of a re-adopted sandbox stay
            track = self.cgroups.make_track(sandbox_id, f"x{self._boot}{self._track_seq}")
            cg_dirs = [d for d in cg_dirs if d != self.cgroups.parents["freezer"] / sandbox_id] + [track]
        init_fd = self._open_init(rec)
        assert init_fd is not None
        started = time.monotonic()
        try:
            with box.starting():
                spawned = await spawner.send(wire.ExecRequest(
                    init_pidfd=init_fd, stdin=stdin, stdout=stdout, stderr=stderr, argv=tuple(argv),
                    env=tuple(merged.items()), cwd=cwd, uid=uid, gid=gid, seccomp=seccomp, cgroups=tuple(cg_dirs),
                    rlimits=(wire.Rlimit(7, res.nofile, res.nofile),),  # RLIMIT_NOFILE
                    landlock=landlock, pristine=image_copies,
                    init_pid=rec.init_pid if image_copies is not None or tty is not None else None,
                    # The sandbox's tty group (gid 5 inside) in host ids: devpts takes the mounter's.
                    tty=None if tty is None else wire.Tty(rec.uid_base + 5, tty.rows, tty.cols)))
        except SpawnError as exc:
            if track is not None:
                self.cgroups.drop_track(track)
            raise self._exec_error(sandbox_id, argv, cwd, uid, exc) from None
        except BaseException:
            if track is not None:
                self.cgroups.drop_track(track)
            raise
        finally:
            os.close(init_fd)
        os.close(spawned.pidfd)
        self.last_activity[sandbox_id] = time.monotonic()
        self._event(rec, "exec_started", pid=spawned.pid, argv0=argv[0], cmd=command_line(argv))
        return Process(sandbox_id, spawned.pid, spawner.exit_future(spawned.pid), started, track,
                       start_latency_s=time.monotonic() - started)

    async def start_tty(
        self,
        sandbox_id: str,
        argv: Sequence[str],
        *,
        size: TtySize,
        env: Mapping[str, str] | None = None,
        cwd: str = "/",
        user: int | str = 0,
    ) -> tuple[Process, int]:
        """Start ``argv`` on a new pseudo-terminal in the sandbox: a session leader with the
        pty as its controlling terminal (job control, ^C/^Z as signals to its foreground
        group). Returns the process and the pty's master (a host fd, non-blocking, the
        caller's to close): write the keystrokes, read the screen, resize with
        :func:`set_tty_size`. The sandbox's devpts is mounted on the first call."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        devnull = os.open("/dev/null", os.O_RDWR | os.O_CLOEXEC)
        try:
            proc = await self.start_process(
                sandbox_id, argv, stdin=theirs.fileno(), stdout=devnull, stderr=devnull, env=env, cwd=cwd,
                user=user, tty=size,
            )
            theirs.close()
            ours.setblocking(False)
            try:
                _, fds, _, _ = socket.recv_fds(ours, 8, 1)
            except OSError:
                fds = []
            if not fds:
                proc.kill()
                raise ExecError(f"sandbox {sandbox_id}: the terminal's master never arrived", sandbox_id=sandbox_id,
                                stage="tty")
            os.set_blocking(fds[0], False)
            return proc, fds[0]
        finally:
            ours.close()
            theirs.close()
            os.close(devnull)

    def _exec_error(self, sid: str, argv: Sequence[str], cwd: str, uid: int, exc: SpawnError) -> Exception:
        if exc.stage == "exec":
            hint = "not found in the sandbox's PATH" if exc.errno == 2 else os.strerror(exc.errno)
            return ExecError(f"cannot run {argv[0]!r} in sandbox {sid}: {hint}", sandbox_id=sid, stage="exec", errno=exc.errno)
        if exc.stage == "cwd":
            return ExecError(
                f"working directory {cwd!r} does not exist in sandbox {sid} ({os.strerror(exc.errno)})",
                sandbox_id=sid, stage="cwd", errno=exc.errno,
            )
        if exc.stage == "user":
            return ExecError(f"user {uid} cannot be used in sandbox {sid}: {exc.detail}", sandbox_id=sid, stage="user")
        if exc.stage == "pristine":
            return ExecError(f"pristine paths in sandbox {sid}: {exc.detail} ({os.strerror(exc.errno)})",
                             sandbox_id=sid, stage="pristine", errno=exc.errno)
        if exc.stage == "landlock":
            return ExecError(f"cannot apply the stage's file rules in sandbox {sid}: {exc}",
                             sandbox_id=sid, stage="landlock", errno=exc.errno)
        if exc.stage in ("setns", "died"):
            rec = self.sandboxes.get(sid)
            if rec is not None:
                fd = self._open_init(rec, check=False)
                if fd is None:  # the init is gone: say so in the record, as every other path does
                    self._mark_failed(rec, "the sandbox's init process is gone")
                else:
                    os.close(fd)
            return SandboxFailed(f"sandbox {sid} is gone: {exc}", sandbox_id=sid, reason=exc.stage)
        return ExecError(f"cannot start command in sandbox {sid}: {exc}", sandbox_id=sid, stage=exc.stage)

    async def exec(
        self,
        sandbox_id: str,
        cmd: Sequence[str] | str,
        *,
        env: Mapping[str, str] | None = None,
        cwd: str = "/",
        user: int | str = 0,
        stdin: bytes | None = None,
        timeout: float | _Unset | None = UNSET,
        idle_timeout: float | None = None,
        on_output: OutputCallback | None = None,
        output_cap: int | None = None,
        pristine: Sequence[str] = (),
    ) -> ExecResult:
        """Run a command to completion and return its result.

        ``cmd`` is an argv list, or a string run by ``/bin/sh -c``. ``timeout``
        (default 600 s; ``None`` for none) and ``idle_timeout`` (no output for
        that long) kill the command's whole process tree, never the sandbox, and
        raise :class:`ExecTimeout` carrying the partial result. ``on_output`` is
        called with ("stdout"|"stderr", chunk) as output is produced.
        ``pristine`` paths are replaced, for this command only, by read-only copies
        from the sandbox's image layers (docs/SECURITY.md, "Pristine paths").
        """
        argv, limit = check_exec(cmd, timeout=timeout, idle_timeout=idle_timeout, output_cap=output_cap)
        rec = self._running(sandbox_id)
        cap = output_cap or rec.spec.output_cap
        before = self.limit_baseline(rec)
        proc, in_w, out_r, err_r = await start_piped(lambda i, o, e: self.start_process(
            sandbox_id, argv, stdin=i, stdout=o, stderr=e, env=env, cwd=cwd, user=user, pristine=pristine))
        return await self._collect(proc, in_w, out_r, err_r, stdin, limit, idle_timeout, on_output, cap, before)

    async def _collect(
        self,
        proc: Process,
        in_w: int,
        out_r: int,
        err_r: int,
        stdin: bytes | None,
        limit: float | None,
        idle_timeout: float | None,
        on_output: OutputCallback | None,
        cap: int,
        before: limit_evidence.Baseline | None = None,
    ) -> ExecResult:
        """:func:`dsec.backends.common.output.collect`, then what this runtime makes of the
        result: the limit that ended it, an ``exec_ended`` event, ExecTimeout."""
        try:
            got = await collect(proc, in_w, out_r, err_r, stdin, limit, idle_timeout, on_output, cap)
        except asyncio.CancelledError:
            rec = self.sandboxes.get(proc.sandbox_id)
            if rec is not None:
                self._event(rec, "exec_ended", pid=proc.pid, exit_code=None, signal=signal.SIGKILL,
                            duration_s=round(time.monotonic() - proc.started_at, 6), cancelled=True)
            raise
        finally:
            if self.spawner is not None:
                self.spawner.forget_exit(proc.pid)
            if proc.track is not None:
                self.cgroups.drop_track(proc.track)  # stays while background jobs run
        self.last_activity[proc.sandbox_id] = time.monotonic()
        result = got.result(proc.start_latency_s)
        rec = self.sandboxes.get(proc.sandbox_id)
        if rec is not None:
            result.limit = self.limit_hit(rec, before, exit_code=result.exit_code, sig=result.signal,
                                          timed_out=result.timed_out, timeout_s=limit, idle_timeout_s=idle_timeout,
                                          truncated=result.truncated, output_cap=cap,
                                          output=(result.stderr, result.stdout))
            self._event(rec, "exec_ended", pid=proc.pid, exit_code=result.exit_code, signal=result.signal,
                        duration_s=round(result.duration_s, 6), timed_out=result.timed_out,
                        output_truncated=result.truncated,
                        limit=None if result.limit is None else result.limit.kind)
            if not limit_evidence.failed(result.exit_code, result.signal) or result.timed_out:
                # two cgroup reads: off the reply path
                asyncio.get_running_loop().call_soon(self._check_limits, rec)
        check_timed_out(result, proc.sandbox_id, limit=limit, idle_timeout=idle_timeout)
        return result

    # ----- reconcile after a crash -----

    async def _reconcile(self) -> dict[str, builtins.list[str]]:
        """Re-adopt running sandboxes whose init survived; destroy everything else."""
        adopted: list[str] = []
        destroyed: list[str] = []
        for path in sorted(self.records_dir.glob("*.json")):
            try:
                rec = ContainerRecord.from_json(json.loads(path.read_text()))
            except (OSError, ValueError, KeyError):
                path.unlink(missing_ok=True)
                continue
            alive = False
            if rec.state in (SandboxState.RUNNING, SandboxState.PAUSED) and rec.init_pid:
                fd = self._open_init(rec, check=False)
                if fd is not None:
                    os.close(fd)
                    alive = rec.init_pid in self.cgroups.pids(rec.id)
            if alive:
                self._boxes[rec.id] = LiveSandbox(rec)
                if rec.net is not None:
                    pol = rec.net.get("policy")
                    self.net.adopt(rec.id, rec.net, None if pol is None else NetworkPolicy.model_validate(pol))
                self._adopt_freezer(rec)
                self._event(rec, "adopted")
                self.last_activity[rec.id] = time.monotonic()
                adopted.append(rec.id)
                continue
            # Half-made, stopping or dead: remove every trace.
            if rec.init_pid:
                fd = self._open_init(rec, check=False)
                if fd is None:
                    rec.init_pid = 0
                else:
                    os.close(fd)
            await self._teardown(rec)
            destroyed.append(rec.id)
        # Cgroups with no record (a crash between mkdir and the record write cannot
        # happen, but a hand-deleted state dir can): kill and remove.
        for orphan in self.cgroups.existing_children() - set(self.sandboxes):
            self.cgroups.kill_all(orphan)
            deadline = time.monotonic() + 5
            while self.cgroups.pids(orphan) and time.monotonic() < deadline:
                await asyncio.sleep(0.005)
            self.cgroups.remove(orphan)
            destroyed.append(orphan)
        # Writable layers on disk that no live sandbox holds (named after the sandbox).
        if self.uppers.ready:
            for name in set(self.uppers.names()) - set(self.sandboxes):
                with contextlib.suppress(OSError):
                    await asyncio.to_thread(self.uppers.destroy, name)
                    destroyed.append(name)
        # uid slots of this runtime that no live sandbox holds, and claims staged by processes gone.
        for slot_file in self.slots_dir.iterdir():
            with contextlib.suppress(OSError, ValueError):
                if slot_file.name.startswith(CLAIM_PREFIX):
                    if not _pid_alive(int(slot_file.name[len(CLAIM_PREFIX):].split("-", 1)[0])):
                        slot_file.unlink()
                    continue
                owner = slot_file.read_text().split()
                if owner and owner[0] == self.name and owner[1] not in self.sandboxes:
                    slot_file.unlink()
        for rec in self.sandboxes.values():
            self._layers.adopt(rec.id, rec.layers)
        self._layers.release_unused_pins()
        for marker in list(self._ephemeral_dir.glob("*")) if self._ephemeral_dir.is_dir() else []:
            digest = "sha256:" + marker.name
            if digest not in self._layers.users:
                self.drop_ephemeral(digest)
        await asyncio.to_thread(self._mounts.unmount_unused)
        return {"adopted": adopted, "destroyed": destroyed}

    # ----- host state: notice what vanished, repair what can be -----

    def _note(self, kind: str, message: str, *, repaired: bool) -> HostFinding:
        """Record a finding: a repair is logged, counted and kept (``host_repairs``); a problem
        is logged once until it goes away (``host_problems`` holds the last pass's)."""
        found = HostFinding(kind, message, repaired)
        if repaired:
            self.host_repairs.append(found)
            self.repair_counts[kind] += 1
            self._repair_gen += 1
            log.warning("runtime %s: %s", self.name, message)
        elif message not in self._problems_logged:
            self._problems_logged.add(message)
            log.error("runtime %s: %s", self.name, message)
        return found

    def _cgroup_repaired(self, message: str) -> None:
        self._note("cgroup", message, repaired=True)

    async def _repaired_since(self, gen: int, t0: float) -> bool:
        """Whether host state was repaired since a create began (``gen``, ``t0``): a heal pass
        runs now unless one started after ``t0`` (a burst of failing creates shares one)."""
        if self._repair_gen == gen and self._last_heal_start < t0:
            await self.heal()
        return self._repair_gen != gen

    async def heal(self, *, repair: bool = True) -> builtins.list[HostFinding]:
        """Check the host state this runtime stands on and, with ``repair``, make again what
        vanished: its claims (:mod:`claims`), directories (records and uid slots are written
        again), cgroup parents, the /dev skeleton, layer mounts, the writable-layer store's
        mount, the sandbox network's host tables and the spawner. Someone else's cleanup (an
        operator, a script, an older DSec sharing a name) is the usual cause. Returns this
        pass's findings; :attr:`host_problems` keeps what could not be repaired, each saying
        exactly what and where. A few stats, one mountinfo read and two nftables lookups."""
        async with self._heal_lock:
            self._last_heal_start = time.monotonic()
            found = [self._note(k, m, repaired=r) for k, m, r in self._check_books(repair)]
            if self._mounts is not None:
                found += [self._note(k, m, repaired=r)
                          for k, m, r in await asyncio.to_thread(self._check_mounts, repair)]
            if self.uppers.ready and not self.uppers.mounted():
                what = f"the writable-layer store is not mounted at {self.uppers.mountpoint}"
                if not repair:
                    found.append(self._note("uppers", what, repaired=False))
                else:
                    try:
                        made = await self._setup_uppers()
                        found += [made] if made is not None else []
                    except (OSError, HostError) as exc:
                        found.append(self._note("uppers", f"{what} and cannot be mounted again: {exc}",
                                                repaired=False))
            sp = self.spawner
            if sp is not None and not sp.alive:
                what = f"dsec-spawner (pid {sp.pid}) has exited"
                if not repair:
                    found.append(self._note("spawner", what, repaired=False))
                else:
                    try:
                        await self._ensure_spawner(check=True)  # notes the repair
                    except (HostError, OSError) as exc:
                        found.append(self._note("spawner", f"{what} and cannot be started again: {exc}",
                                                repaired=False))
            if self.net.started:
                problems, repairs = await asyncio.to_thread(self.net.check_host, repair=repair)
                found += [self._note("network", m, repaired=False) for m in problems]
                found += [self._note("network", m, repaired=True) for m in repairs]
            self.host_problems = [f for f in found if not f.repaired]
            self._problems_logged &= {f.message for f in self.host_problems}
            return found

    def _check_books(self, repair: bool) -> builtins.list[tuple[str, str, bool]]:
        """Claims and directories (on the loop: a few stats, unless something is rewritten)."""
        out: list[tuple[str, str, bool]] = []
        for i, c in enumerate(self._claims):
            if c.intact():
                continue
            again = claims.try_claim(c.path, self.name) if repair else None
            if again is not None:
                c.release()
                self._claims[i] = again
                out.append(("claim", f"took the claim {c.path} again (its file had been removed)", True))
            else:
                out.append(("claim", f"the claim file {c.path} was removed"
                            + (f" and {claims.holder(c.path) or 'another process'} holds it now: two runtimes "
                               "may share this name; stop one of them" if repair else ""), False))
        for d in (self.run_dir, self.stage_dir, self.records_dir, self.slots_dir):
            if d.is_dir():
                continue
            if not repair:
                out.append(("directory", f"directory {d} is gone", False))
                continue
            try:
                d.mkdir(parents=True, exist_ok=True)
                note = ""
                if d == self.records_dir:
                    for rec in self.sandboxes.values():
                        if rec.state is not SandboxState.CREATING:
                            self._save(rec)
                    note = f"; wrote the records of {len(self.sandboxes)} sandboxes again"
                elif d == self.slots_dir:
                    lost = []
                    for rec in self.sandboxes.values():
                        with self._slot_claim(rec.id) as claim:
                            if not claim(rec.slot):
                                lost.append(rec.id)
                    note = f"; claimed the uid ranges of {len(self.sandboxes) - len(lost)} sandboxes again"
                    if lost:
                        out.append(("directory", f"uid ranges of {', '.join(lost[:5])} were claimed by another runtime "
                                    "while their slot files were gone: destroy those sandboxes", False))
                out.append(("directory", f"re-made directory {d} (it had been removed){note}", True))
            except OSError as exc:
                out.append(("directory", f"directory {d} is gone and cannot be made again: {exc}", False))
        return out

    def _check_mounts(self, repair: bool) -> builtins.list[tuple[str, str, bool]]:
        """Cgroup parents, the /dev skeleton, layer mounts (in a thread)."""
        from dsec.images import sysmount

        out: list[tuple[str, str, bool]] = []
        missing = self.cgroups.missing_parents()
        if missing and repair:
            try:
                self.cgroups.repair_parents(notify=False)
                out += [("cgroup", f"re-made cgroup directory {p} (it had been removed)", True) for p in missing]
            except (OSError, HostError) as exc:
                out.append(("cgroup", f"cgroup directories {', '.join(map(str, missing))} are gone and cannot be "
                            f"made again: {exc}", False))
        elif missing:
            out.append(("cgroup", f"cgroup directories {', '.join(map(str, missing))} are gone", False))
        mounted = {m.mount_point for m in sysmount.mountinfo()}
        if str(self.skel_dir) not in mounted or not self.devskel_dir.is_dir() or not self.empty_dir.is_dir():
            what = f"the /dev skeleton at {self.skel_dir} is gone"
            if repair:
                try:
                    _make_skeletons(self.skel_dir)
                    out.append(("skeleton", f"re-made the /dev skeleton at {self.skel_dir} (it had been removed)", True))
                except OSError as exc:
                    out.append(("skeleton", f"{what} and cannot be made again: {exc}", False))
            else:
                out.append(("skeleton", what, False))
        problems, repairs = self._mounts.check(repair=repair)
        out += [("layer_mount", m, False) for m in problems] + [("layer_mount", m, True) for m in repairs]
        return out

    def child_cgroups(self, sandbox_id: str, controller: str, names: Sequence[str]) -> builtins.list[Path]:
        """Make child cgroups of ``controller`` below the running sandbox's own (charged to it,
        bounded by it, removed with it); their host paths. For a backend that divides a
        sandbox of its own (FnCall: a memory cgroup per call slot)."""
        self._running(sandbox_id)
        return self.cgroups.make_children(sandbox_id, controller, names)

    def set_net_sysctls(self, sandbox_id: str, values: Mapping[str, str]) -> None:
        """Write ``net.*`` sysctls of the running sandbox's own network namespace from the host
        (root inside cannot: /proc/sys is read-only there). Blocking: a thread of its own."""
        bad = [k for k in values if not re.fullmatch(r"net(\.[a-z0-9_]+)+", k)]
        if bad:
            raise InvalidSpec(f"not a net.* sysctl: {', '.join(bad)}", field="sysctls")
        rec = self._running(sandbox_id)
        from dsec.backends.container import netfilter

        fd = os.open(f"/proc/{rec.init_pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        try:
            netfilter.in_netns(fd, lambda: netfilter.write_sysctls(values.items()))
        finally:
            os.close(fd)

    # ----- files and sessions -----

    def files(self, sandbox_id: str, *, platform: bool = False) -> SandboxFiles:
        """Confined host-side file access (see :mod:`fsops`). It obeys the current stage's
        file rules like the sandbox's processes do (agents' file tools usually come through
        here); ``platform=True`` is the platform's own access (fork identity, evaluation
        set-up), confined to the sandbox root but not to the stage."""
        rec = self._running(sandbox_id)
        self.last_activity[sandbox_id] = time.monotonic()
        stage = rec.stage or rec.spec.stage
        rules = rec.spec.stages[stage].files if stage is not None and stage in rec.spec.stages else None
        return SandboxFiles(f"/proc/{rec.init_pid}/root", rec.uid_base, sandbox_id, rules=None if platform else rules)

    async def open_session(
        self, sandbox_id: str, *, env: Mapping[str, str] | None = None, cwd: str = "/", user: int | str = 0
    ) -> Session:
        """A persistent shell; closed with the sandbox at the latest."""
        self._running(sandbox_id)
        sess = pausing.ResumingSession(self, sandbox_id, f"sess-{secrets.token_hex(4)}")
        await sess.start(env=dict(env or {}), cwd=cwd, user=user)
        self.live(sandbox_id).add_session(sess)
        return sess

    async def close_session(self, sandbox_id: str, session_id: str) -> bool:
        """Kill a session's shell and everything it started; False if there was no such session."""
        box = self._boxes.get(sandbox_id)
        sess = None if box is None else box.drop_session(session_id)
        if sess is None:
            return False
        await sess.close()
        return True

    def sessions(self, sandbox_id: str) -> builtins.list[Session]:
        box = self._boxes.get(sandbox_id)
        return [] if box is None else list(box.sessions.values())

    # ----- introspection -----

    def stats(self, sandbox_id: str) -> dict[str, Any]:
        rec = self._live(sandbox_id)
        st = self.cgroups.stats(sandbox_id)
        return {"id": rec.id, "state": rec.state.value, "init_pid": rec.init_pid, **dataclasses.asdict(st)}

    # ----- pause / resume (docs/SNAPSHOTS.md, "Pause") -----

    async def _setup_uppers(self) -> HostFinding | None:
        """Set up the writable-layer store, or mount it again when someone unmounted it (the
        repair is returned). One at a time: a create and a heal pass may both find it gone."""
        async with self._uppers_lock:
            if not self.uppers.ready:
                await asyncio.to_thread(self.uppers.setup)
            elif not self.uppers.mounted():
                await asyncio.to_thread(self.uppers.remount)
                return self._note("uppers", f"re-mounted the writable-layer store at {self.uppers.mountpoint} "
                                  "(it had been unmounted)", repaired=True)
        return None

    def _make_host_parts(self, sandbox_id: str, res: Any, uid_base: int) -> tuple[builtins.list[Path], Path | None]:
        """The sandbox's cgroups and, on the disk medium, its writable layer (one thread hop)."""
        dirs = self._make_cgroups(sandbox_id, res)
        if res.disk_medium != "disk":
            return dirs, None
        return dirs, self.uppers.create(sandbox_id, quota=res.disk, uid=uid_base)

    def _remove_host_parts(self, rec: ContainerRecord) -> builtins.list[str]:
        """Remove the sandbox's cgroups and writable layer (one thread hop); what could not go."""
        left = [str(p) for p in self.cgroups.remove(rec.id)]
        # A memory-medium sandbox has no subvolume (a crash's leftover is the reconciler's).
        if self.uppers.ready and rec.spec.resources.disk_medium == "disk":
            try:
                self.uppers.destroy(rec.id)
            except OSError as exc:
                left.append(f"writable layer {self.uppers.path(rec.id)} ({exc})")
        return left

    def disk_usage(self, sandbox_id: str) -> UpperUsage:
        """Bytes the sandbox's writable layer holds and may hold, on either medium."""
        rec = self._live(sandbox_id)
        if rec.spec.resources.disk_medium == "disk":
            return self.uppers.usage(sandbox_id)
        st = os.statvfs(f"/proc/{rec.init_pid}/fd/3")
        return UpperUsage(used=(st.f_blocks - st.f_bfree) * st.f_frsize, limit=st.f_blocks * st.f_frsize)

    def _make_cgroups(self, sandbox_id: str, res: Any) -> builtins.list[Path]:
        dirs = self.cgroups.create(sandbox_id, res)
        # With swap on the host, a memory limit alone would let a sandbox grow into swap
        # past it; memory+swap = the limit keeps it hard. Pausing moves pages from memory
        # to swap, which leaves memory+swap unchanged, so pause is not limited by it.
        memsw = self.cgroups.parents["memory"] / sandbox_id / "memory.memsw.limit_in_bytes"
        with contextlib.suppress(OSError):
            cgroupfs.write(memsw, str(res.memory))
        return dirs

    async def _setup_swap(self) -> None:
        if self.swap.size > 0:
            await asyncio.to_thread(self.swap.ensure)
            return
        # Not asked for: a device left by an earlier run goes, unless paused sandboxes use it.
        if self.swap.find() is not None and not any(r.state is SandboxState.PAUSED for r in self.sandboxes.values()):
            with contextlib.suppress(HostError):
                await asyncio.to_thread(self.swap.teardown)

    def swap_stats(self) -> ZramStats | None:
        """The zram device's figures (None without one)."""
        return self.swap.stats()

    def _adopt_freezer(self, rec: ContainerRecord) -> None:
        """After a restart the kernel's freezer state is the truth about pausedness: pause and
        resume write no record (a rename on a busy disk costs ms, too much for a group pause)."""
        frozen = pausing.freezer_state(self.cgroups, rec.id) in ("FROZEN", "FREEZING")
        if rec.state is SandboxState.PAUSED and not frozen:
            self._move(rec, SandboxState.RUNNING, save=False)
        elif rec.state is SandboxState.RUNNING and frozen:
            self._move(rec, SandboxState.PAUSED, save=False)  # paused (or frozen by a snapshot cut short)

    def wake(self, sandbox_id: str) -> bool:
        """Resume a paused sandbox now (synchronous: a thaw costs ~0.1 ms). False if it was not paused.

        Exec, files and sessions call this, so a paused sandbox resumes on any request;
        its pages come back from swap as they are touched."""
        box = self._boxes.get(sandbox_id)
        if box is None or box.rec.state is not SandboxState.PAUSED:
            return False
        if self.wake_gate is not None:
            self.wake_gate(sandbox_id)  # raises to keep it paused (preempted)
        rec = box.rec
        # While a snapshot copies its upper it thaws when the copy is done; the request
        # goes on and waits for that inside the frozen cgroup.
        if not box.wake_requested():
            pausing.thaw(self.cgroups, sandbox_id)
        self._move(rec, SandboxState.RUNNING, save=False)
        self._event(rec, "resumed")
        self.last_activity[sandbox_id] = time.monotonic()
        return True

    async def pause(self, sandbox_id: str, *, reclaim: bool = True) -> PauseResult:
        """Freeze every process of the sandbox, then push its memory out to swap.

        Pausing a paused sandbox raises SandboxStateError. Any exec, file or session
        call resumes it (:meth:`wake`); so does :meth:`resume`. The sandbox's disk
        (its writable layer is tmpfs, charged to its memory cgroup) goes to swap too.
        Commands running when it is paused are frozen with it; their timeouts keep
        counting. A sandbox holding less than ``pause.RECLAIM_MIN`` is only frozen."""
        t0 = time.perf_counter()
        freeze_s = await self._freeze(sandbox_id)
        stats = await self._reclaim_paused(sandbox_id) if reclaim else None
        elapsed = time.perf_counter() - t0
        rec = self.sandboxes.get(sandbox_id)
        if rec is not None:
            self._event(rec, "paused", freeze_s=round(freeze_s, 6), seconds=round(elapsed, 6),
                        memory_before=stats.before if stats else None, memory_after=stats.after if stats else None)
        return PauseResult(sandbox_id, freeze_s, stats, elapsed)

    async def _freeze(self, sandbox_id: str) -> float:
        """The first half of a pause: state paused, every process frozen. Returns seconds."""
        rec = self.get(sandbox_id)
        if rec.state is SandboxState.PAUSED:
            raise SandboxStateError(f"sandbox {sandbox_id} is already paused", sandbox_id=sandbox_id, state="paused")
        self._running(sandbox_id, resume=False)
        async with self.live(sandbox_id).lock:
            rec = self.get(sandbox_id)
            if rec.state is SandboxState.PAUSED:
                raise SandboxStateError(f"sandbox {sandbox_id} is already paused", sandbox_id=sandbox_id, state="paused")
            self._running(sandbox_id, resume=False)
            self._open_init_check(rec)
            # Paused before frozen: a request arriving during the freeze sees "paused" and thaws.
            self._move(rec, SandboxState.PAUSED, save=False)
            try:
                return await pausing.freeze(self.cgroups, sandbox_id)
            except BaseException:
                if _is_paused(rec):
                    with contextlib.suppress(OSError):
                        pausing.thaw(self.cgroups, sandbox_id)
                    self._move(rec, SandboxState.RUNNING, save=False)
                raise

    async def _reclaim_paused(self, sandbox_id: str) -> pausing.ReclaimStats | None:
        """The second half: push a paused sandbox's memory to swap (None if it was resumed meanwhile)."""
        box = self._boxes.get(sandbox_id)
        if box is None or not _is_paused(box.rec):
            return None
        rec, gen = box.rec, box.wake_gen
        async with box.lock:
            if not _is_paused(rec) or box.wake_gen != gen or self._boxes.get(sandbox_id) is not box:
                return None
            return await asyncio.to_thread(pausing.reclaim, self.cgroups, sandbox_id, self.reclaim_method)

    def _open_init_check(self, rec: ContainerRecord) -> None:
        fd = self._open_init(rec)  # raises SandboxFailed (and marks it failed) if the init is gone
        if fd is not None:
            os.close(fd)

    async def resume(self, sandbox_id: str) -> ContainerRecord:
        """Thaw a paused sandbox. SandboxStateError if it is not paused."""
        rec = self.get(sandbox_id)
        if rec.state is not SandboxState.PAUSED:
            raise SandboxStateError(
                f"sandbox {sandbox_id} is {rec.state.value}, not paused", sandbox_id=sandbox_id, state=rec.state.value
            )
        self.wake(sandbox_id)
        return rec

    async def pause_many(self, sandbox_ids: Sequence[str], *, reclaim: bool = True,
                         concurrency: int = 64) -> GroupOutcome:
        """Pause every sandbox in ``sandbox_ids``: all are frozen first (a preempted job stops
        at once), then their memory is pushed out. Already paused ones are skipped; errors
        are collected per sandbox (one bad sandbox never stops the group)."""
        out = GroupOutcome()
        t0 = time.perf_counter()
        frozen: list[str] = []

        async def freeze_one(sid: str) -> None:
            try:
                await self._freeze(sid)
                frozen.append(sid)
            except SandboxStateError as exc:
                if getattr(exc, "state", "") == "paused":
                    out.skipped.append(sid)
                else:
                    out.errors[sid] = exc
            except DsecError as exc:
                out.errors[sid] = exc

        await asyncio.gather(*(freeze_one(s) for s in dict.fromkeys(sandbox_ids)))
        if reclaim:
            sem = asyncio.Semaphore(max(1, concurrency))

            async def reclaim_one(sid: str) -> None:
                async with sem:
                    with contextlib.suppress(OSError):
                        stats = await self._reclaim_paused(sid)
                        rec = self.sandboxes.get(sid)
                        if rec is not None:
                            self._event(rec, "paused", group=True, memory_before=stats.before if stats else None,
                                        memory_after=stats.after if stats else None)

            await asyncio.gather(*(reclaim_one(s) for s in frozen))
        out.done = frozen
        out.seconds = time.perf_counter() - t0
        return out

    async def resume_many(self, sandbox_ids: Sequence[str]) -> GroupOutcome:
        """Resume every paused sandbox in ``sandbox_ids``; running ones are skipped."""
        out = GroupOutcome()
        t0 = time.perf_counter()
        for sid in dict.fromkeys(sandbox_ids):
            rec = self.sandboxes.get(sid)
            if rec is None:
                out.errors[sid] = SandboxNotFound(f"no sandbox {sid!r} on this node", sandbox_id=sid)
            elif rec.state is SandboxState.RUNNING:
                out.skipped.append(sid)
            else:
                try:
                    await self.resume(sid)
                    out.done.append(sid)
                except DsecError as exc:
                    out.errors[sid] = exc
                except OSError as exc:
                    out.errors[sid] = HostError(f"cannot thaw sandbox {sid}: {exc}", sandbox_id=sid)
        out.seconds = time.perf_counter() - t0
        return out

    # ----- snapshots and forks (docs/SNAPSHOTS.md) -----

    def _layer_kind(self, digest: str) -> LayerKind:
        """A layer's kind (layers are immutable: cached)."""
        kind = self._kinds.get(digest)
        if kind is None:
            kind = self._kinds[digest] = self.store.get(digest).kind
        return kind

    def _layer_lineage(self, digest: str) -> tuple[str, ...] | None:
        """A snapshot's parents (top first), None for other kinds; layers are immutable, so cached."""
        if digest not in self._lineage:
            layer: Layer = self.store.get(digest)
            self._lineage[digest] = tuple(layer.parents) if layer.kind is LayerKind.SNAPSHOT else None
        return self._lineage[digest]

    def _layers_for(self, image: ImageRef) -> builtins.list[str]:
        """The digests to stack (top first): :func:`dsec.backends.common.layers.stack`."""
        return stack_layers(image, resolve=self._resolve, kind_of=self._layer_kind, lineage_of=self._layer_lineage,
                            max_layers=wire.MAX_LAYERS)

    async def snapshot(
        self,
        sandbox_id: str,
        *,
        name: str | None = None,
        tag: str | None = None,
        exclude: Sequence[str] = (),
        max_layers: int | None = None,
        ephemeral: bool = False,
    ) -> Layer:
        """Pack the sandbox's writable layer (running or paused) into a new snapshot layer.

        The layer's ``parents`` are the sandbox's layers (its lineage); start new
        sandboxes from it with ``ImageRef(base=<its ref or digest>)``. The sandbox is
        frozen while its writable layer is copied out (docs/SNAPSHOTS.md).
        ``exclude`` leaves paths out (``/abs/path``, globs, or bare names such as
        ``__pycache__``). ``ephemeral`` layers are removed once no sandbox uses them.
        Raises StorageFull (an ImageError) if the layer store fills up."""
        info = await snapshots.make_snapshot(self, sandbox_id, name=name, tag=tag, exclude=exclude,
                                             max_layers=max_layers, ephemeral=ephemeral)
        return info.layer

    async def snapshot_info(
        self, sandbox_id: str, *, name: str | None = None, tag: str | None = None, exclude: Sequence[str] = (),
        max_layers: int | None = None, ephemeral: bool = False,
    ) -> snapshots.SnapshotInfo:
        """Like :meth:`snapshot`, with the packing figures (bytes, frozen time, collapse)."""
        return await snapshots.make_snapshot(self, sandbox_id, name=name, tag=tag, exclude=exclude,
                                             max_layers=max_layers, ephemeral=ephemeral)

    def _mark_ephemeral(self, digest: str) -> None:
        self._ephemeral_dir.mkdir(parents=True, exist_ok=True)
        (self._ephemeral_dir / digest.split(":", 1)[1]).touch()

    def drop_ephemeral(self, digest: str) -> bool:
        """Remove an unnamed (fork) snapshot if nothing uses it any more; True if removed."""
        marker = self._ephemeral_dir / digest.split(":", 1)[1]
        if self._layers.users.get(digest):
            return False
        try:
            self.store.remove(digest)
        except (LayerNotFound, InvalidSpec):
            pass
        except DsecError:
            return False  # pinned by another runtime, or a snapshot was taken on top of it
        marker.unlink(missing_ok=True)
        self._lineage.pop(digest, None)
        self._kinds.pop(digest, None)
        self._resolved.pop(digest, None)
        return True

    async def fork(
        self,
        sandbox_id: str,
        children: int | Sequence[str],
        *,
        edges: Sequence[EdgeMeta] | None = None,
        exclude: Sequence[str] = (),
    ) -> builtins.list[SandboxRecord]:
        """New sandboxes whose disks equal this one's now (running or paused): ``children``
        is how many, or their ids; ``edges`` (one per child) is kept with their records.

        Each child gets a fresh identity — its id as hostname, a new /etc/machine-id,
        no inherited random seed — and its own writable layer, so siblings never see
        each other's writes. Children start where the parent is now: its current stage,
        else its current network policy. All or nothing: if one child fails, the others
        are destroyed, the fork's layer is dropped and the error raised. Forking a failed
        sandbox raises SandboxStateError. The only fork: the edge calls this one."""
        ids: builtins.list[str | None] = (
            [None] * children if isinstance(children, int) else builtins.list(children))
        if not 1 <= len(ids) <= 10000:
            raise InvalidSpec("fork needs 1 <= n <= 10000", field="n")
        metas = builtins.list(edges) if edges is not None else [EdgeMeta() for _ in ids]
        if len(metas) != len(ids):
            raise InvalidSpec(f"fork got {len(ids)} children but {len(metas)} edge parts", field="edges")
        rec = self.get(sandbox_id)
        if rec.state not in (SandboxState.RUNNING, SandboxState.PAUSED):
            raise SandboxStateError(
                f"sandbox {sandbox_id} is {rec.state.value}"
                + (f" ({rec.reason})" if rec.reason else "") + ": only a running or paused sandbox can be forked",
                sandbox_id=sandbox_id, state=rec.state.value,
            )
        layer = await self.snapshot(sandbox_id, name=snapshots.FORK_NAME, tag=f"{sandbox_id}-{secrets.token_hex(3)}",
                                    exclude=exclude, ephemeral=True)
        spec = self.fork_spec(rec, layer.digest)
        results = await asyncio.gather(*(self.create(spec, sandbox_id=cid, edge=meta) for cid, meta in zip(ids, metas, strict=True)),
                                       return_exceptions=True)
        made: builtins.list[SandboxRecord] = [r for r in results if isinstance(r, ContainerRecord)]
        failure = next((r for r in results if isinstance(r, BaseException)), None)
        if failure is None:
            try:
                for child in made:
                    await asyncio.to_thread(snapshots.fresh_identity, self.files(child.id, platform=True))
                    assert isinstance(child, ContainerRecord)
                    self._event(child, "forked", parent=sandbox_id, layer=layer.digest)
            except Exception as exc:
                failure = exc
        if failure is not None:
            await asyncio.gather(*(self.destroy(c.id) for c in made), return_exceptions=True)
            for c in made:
                self._layers.users.get(layer.digest, set()).discard(c.id)
            self._maybe_release(layer.digest)
            self.drop_ephemeral(layer.digest)
            raise failure
        self._event(rec, "fork", children=[c.id for c in made], layer=layer.digest)
        return made

    @staticmethod
    def fork_spec(rec: ContainerRecord, layer: str) -> SandboxSpec:
        """The spec of ``rec``'s fork children: its layer as their image, and the stage in
        force now (else the network policy in force now)."""
        update: dict[str, Any] = {"image": ImageRef(base=layer)}
        current = rec.stage or rec.spec.stage
        if current is not None:
            update["stage"] = current
        elif rec.net is not None:
            update["network"] = rec.current_policy()
        return rec.spec.model_copy(update=update)

    # ----- the Backend protocol's narrow reads -----

    def usage(self, sandbox_id: str) -> Usage:
        """Memory, pids, CPU seconds and writable-layer bytes now (blocking reads: call from a thread)."""
        st = self.stats(sandbox_id)
        try:
            disk = self.disk_usage(sandbox_id).used
        except (OSError, DsecError):
            disk = 0
        return Usage(memory_bytes=int(st.get("memory_bytes", 0)), pids=int(st.get("pids", 0)),
                     cpu_s=cgroups.cpu_seconds(self.cgroups.pids(sandbox_id)), disk_bytes=disk)

    def check_limits(self, rec: SandboxRecord) -> None:
        """Turn new OOM kills and pids-limit hits into events."""
        assert isinstance(rec, ContainerRecord)
        self._check_limits(rec)

    def store_space(self) -> tuple[int, int] | None:
        """(free, total) bytes of the disk-medium writable-layer store; None until it is set up."""
        return self.uppers.space() if self.uppers.ready else None

    def release_layer(self, digest: str) -> None:
        """Drop this runtime's idle pin of a layer now (before deleting it from the store)."""
        self._maybe_release(digest)

    def refresh_identity(self, sandbox_id: str) -> None:
        """Give a sandbox started from another's disk its own machine-id (fork does this)."""
        snapshots.fresh_identity(self.files(sandbox_id, platform=True))


def _make_skeletons(skel: Path) -> None:
    """The node's /dev skeleton and empty directory, on a small tmpfs of the runtime's own
    (idempotent): sandboxes bind them read-only, and a bind of a tmpfs shows only
    ``/devskel`` in their mountinfo, never a host path."""
    from dsec.images import sysmount

    skel.mkdir(mode=0o755, parents=True, exist_ok=True)
    if not any(m.mount_point == str(skel) for m in sysmount.mountinfo()):
        sysmount.mount("dsec-skel", str(skel), "tmpfs", sysmount.MS_NOSUID | sysmount.MS_NODEV,
                       "size=64k,nr_inodes=64,mode=0755")
    devskel, empty = skel / "devskel", skel / "empty"
    empty.mkdir(mode=0o555, exist_ok=True)
    os.chmod(empty, 0o555)
    if devskel.is_dir():
        return  # made whole by the rename below
    tmp = skel / "devskel.new"
    if tmp.exists():
        import shutil

        shutil.rmtree(tmp)
    tmp.mkdir(mode=0o755)
    for name in ("null", "zero", "full", "random", "urandom", "tty"):
        (tmp / name).touch(mode=0o666)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2"), ("ptmx", "pts/ptmx")):
        os.symlink(target, tmp / name)
    (tmp / "pts").mkdir(mode=0o755)
    (tmp / "shm").mkdir(mode=0o1777)
    os.chmod(tmp / "shm", 0o1777)
    os.rename(tmp, devskel)


def _unmount_skeletons(skel: Path) -> None:
    from dsec.images import sysmount

    if any(m.mount_point == str(skel) for m in sysmount.mountinfo()):
        sysmount.umount(str(skel), sysmount.MNT_DETACH)
    with contextlib.suppress(OSError):
        skel.rmdir()
