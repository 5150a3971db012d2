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
import functools
import logging
import os
import secrets
import subprocess
import time
from pathlib import Path
from typing import Any, ClassVar, Final

from dsec.backends.base import (
    BackendBase,
    Capabilities,
    Capability,
    EdgeMeta,
    HostFinding,
    check_spec,
)
from dsec.backends.common import claims
from dsec.backends.common.command import UID_RANGE
from dsec.backends.common.names import ID_RE, NAME_RE
from dsec.backends.common.network import Lease, NetworkConfig, NetworkManager
from dsec.backends.common.records import RecordBook
from dsec.backends.common.uppers import UpperStore
from dsec.backends.common.zram import ZramSwap
from dsec.backends.container import cgroups, wire
from dsec.backends.container import pause as pausing
from dsec.backends.container import snapshot as snapshots
from dsec.backends.container import stages as staging
from dsec.backends.container.dispatch import SandboxDispatch
from dsec.backends.container.forks import NodeForks
from dsec.backends.container.groups import NodeGroups
from dsec.backends.container.heal import NodeRepair
from dsec.backends.container.hostparts import NodeHostParts
from dsec.backends.container.layerbook import NodeLayers
from dsec.backends.container.procs import (
    proc_identity,
    proc_start_time,
    reap,
)
from dsec.backends.container.records import ContainerRecord
from dsec.backends.container.sandbox import ContainerSandbox, RecordView, open_netns
from dsec.backends.container.skeletons import make_skeletons, unmount_skeletons
from dsec.backends.container.slots import UidSlots
from dsec.backends.container.spawner import Spawner, SpawnError
from dsec.errors import (
    HostError,
    InvalidSpec,
    SandboxFailed,
    SandboxNotFound,
)
from dsec.spec import SandboxSpec, SandboxState

log = logging.getLogger("dsec.runtime")






CAPABILITIES: Final = Capabilities(
    kind="container",
    ops=frozenset({
        Capability.SANDBOXES, Capability.EXEC, Capability.SESSIONS, Capability.PTY, Capability.FILES,
        Capability.PAUSE, Capability.SNAPSHOT, Capability.FORK, Capability.NETWORK, Capability.STAGES,
        Capability.PRISTINE,
    }),
    isolation="user, pid, mount, net, ipc, uts and cgroup namespaces; seccomp; Landlock stages; cgroup limits",
)


class ContainerRuntime(SandboxDispatch, NodeRepair, NodeHostParts, NodeGroups, NodeForks, BackendBase):
    """Sandboxes on this node. Use ``async with ContainerRuntime(...) as rt``."""

    kind: ClassVar[str] = "container"
    host_problems: list[HostFinding]
    host_repairs: collections.deque[HostFinding]
    repair_counts: collections.Counter[str]

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
        own btrfs filesystem (:mod:`dsec.backends.common.uppers`): by default a sparse
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
        self.records: RecordBook[ContainerRecord] = RecordBook(self.records_dir)
        """The records on disk and their state moves (:mod:`dsec.backends.common.records`)."""
        self.stage_dir = self.run_dir / "stage"
        self.slots_dir = base_run / "uid-slots"
        self.slots = UidSlots(name, self.slots_dir)
        """uid ranges, one per sandbox, claimed host-wide (:mod:`slots`)."""
        self.claims_dir = claims.claims_dir()
        """Host-wide claims of this runtime's name, network tag and subnet (:mod:`claims`)."""
        self._claims: list[claims.Claim] = []
        self.id_prefix = id_prefix
        self._store = layer_store
        self.cgroups = cgroups.RuntimeCgroups(name, on_repair=self._cgroup_repaired)
        self._init_repairs()
        self._spawner_lock = asyncio.Lock()
        self.spawner: Spawner | None = None
        self._boxes: dict[str, ContainerSandbox] = {}
        """Every sandbox's live state, its record included (:mod:`sandbox`)."""
        self.sandboxes: RecordView = RecordView(self._boxes)
        """The records, read-only (the Backend protocol's view)."""
        self._devnull = -1
        self.reconciled: dict[str, list[str]] = {}
        self.last_activity: dict[str, float] = {}
        # Which sandboxes use which layer. The store holds one pin per layer for this
        # runtime ("runtime:<name>") while any sandbox uses it: one sqlite write per
        # layer, not per sandbox, and records rebuild the map after a crash.
        self.layers = NodeLayers(self.holder, lambda: self.store, self.run_dir / "ephemeral",
                                 on_remount=lambda d, p: self._note(
                                     "layer_mount", f"re-mounted layer {d} at {p} (it had been unmounted)", repaired=True))
        """Refs, stacks, pins on the node's layer mounts, forks' layers (:mod:`layerbook`)."""
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
        """Start the runtime: claims, cgroups, mounts, the spawner, then re-adopt what a
        previous run left. A start cancelled half-way (an edge stopped while it starts) is
        not torn mid-step, where a worker thread would go on mounting after the cleanup: it
        runs to its end, then the runtime stops again (sandboxes it adopted keep running for
        the next start), and the cancellation goes on."""
        task = asyncio.ensure_future(self._start())
        cancelled = False
        while not task.done():
            try:
                await asyncio.shield(task)
            except asyncio.CancelledError:
                cancelled = True
        if not cancelled:
            task.result()
            return
        if not task.cancelled() and task.exception() is None:
            try:
                await asyncio.shield(self.close(destroy_all=not self.sandboxes))
            except Exception as exc:
                log.warning("runtime %s: stopping after a cancelled start: %s", self.name, exc)
        raise asyncio.CancelledError

    async def _start(self) -> None:
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
            self.layers.shared.mounts = LayerMounts(self.store, self.run_dir / "layers", holders=[self.holder])  # checks the paths first
        except BaseException:
            self._release_claims()
            raise
        self._devnull = os.open("/dev/null", os.O_RDWR | os.O_CLOEXEC)
        try:
            await asyncio.to_thread(make_skeletons, self.skel_dir)
            if self.uppers.image is None or self.uppers.image.exists():
                # Adopt the store a previous run left (its sandboxes' layers are there).
                with contextlib.suppress(HostError):
                    await asyncio.to_thread(self.uppers.setup)
            await asyncio.to_thread(self.layers.mounts.adopt)
            self.spawner = Spawner(spawner_path())
            await self.spawner.start()
            self.reconciled = await self._reconcile()
        except BaseException:
            # Half started: leave nothing behind that no sandbox of ours uses.
            if not self.sandboxes:
                with contextlib.suppress(Exception):
                    await asyncio.to_thread(self.uppers.close, unmount=True)
                with contextlib.suppress(Exception):
                    await asyncio.to_thread(unmount_skeletons, self.skel_dir)
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
        leaves them running for the next ``start()`` to re-adopt. Every step is tried
        whatever the ones before it did; the failures, all of them, are raised together
        (HostError) once the rest is done."""
        failed: list[str] = []

        async def step(what: str, fn: Any, *args: Any) -> None:
            try:
                out = fn(*args)
                if asyncio.iscoroutine(out):
                    await out
            except Exception as exc:
                failed.append(f"{what}: {exc}")
                log.warning("runtime %s: close: %s: %s", self.name, what, exc)

        if destroy_all:
            outcomes = await asyncio.gather(*(self.destroy(i) for i in list(self.sandboxes)), return_exceptions=True)
            failed += [f"destroying a sandbox: {o}" for o in outcomes if isinstance(o, Exception)]
        await step("the network manager", self.net.close)
        if destroy_all and self.net.host_tables_made and not any(r.net for r in self.sandboxes.values()):
            await step("the host's network tables", asyncio.to_thread, self.net.remove_host_rules)
        if self.spawner is not None:
            spawner, self.spawner = self.spawner, None
            await step("the spawner", spawner.close)
        if self.layers.mounts is not None:
            await step("idle layer pins", self.layers.shared.release_idle)
        if self.layers.mounts is not None and destroy_all:
            await step("the layer mounts", asyncio.to_thread, self.layers.mounts.close)
        if self._devnull >= 0:
            os.close(self._devnull)
            self._devnull = -1
        with contextlib.suppress(OSError):
            snapshots.clean_scratch(self)
        if destroy_all and not self.sandboxes:
            await step("the writable-layer store", asyncio.to_thread, functools.partial(self.uppers.close, unmount=True))
            with contextlib.suppress(OSError):
                await asyncio.to_thread(unmount_skeletons, self.skel_dir)
        else:
            await step("the writable-layer store", functools.partial(self.uppers.close, unmount=False))
        if destroy_all:
            await step("the cgroups", self.cgroups.remove_parents)
            if not self.sandboxes:
                # No sandbox left whose pages could be in it (swapoff would pull them back).
                with contextlib.suppress(HostError):
                    await asyncio.to_thread(self.swap.teardown)
            if not self.sandboxes:
                await step("the run directory", asyncio.to_thread, self._remove_run_dir)
        self._release_claims()
        if failed:
            raise HostError(f"runtime {self.name} stopped with {len(failed)} failure(s): " + "; ".join(failed))

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

    # ----- create / destroy -----

    def _new_id(self) -> str:
        return f"{self.id_prefix}-{secrets.token_hex(6)}"

    async def ensure_spawner(self, *, check: bool = False) -> Spawner:
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
            spawner = await self.ensure_spawner()
            try:
                return await spawner.send(req)
            except SpawnError as exc:
                if exc.pid > 0:
                    reap(exc.pid)  # our child (CLONE_PARENT), already exited
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
        await self.ensure_spawner()
        sid = sandbox_id or self._new_id()
        if not ID_RE.match(sid):
            raise InvalidSpec(f"sandbox id {sid!r} must match {ID_RE.pattern}", field="sandbox_id")
        existing = self.sandboxes.get(sid)
        if existing is not None:
            return existing  # idempotent
        layers = self.layers.stack_for(spec.image)
        policy = spec.effective_network()
        compiled = None if policy is None else await self.net.compile(policy)  # bad names fail first
        rec = ContainerRecord(id=sid, state=SandboxState.CREATING, spec=spec, created_at=time.time(), layers=layers,
                              edge=edge if edge is not None else EdgeMeta())
        box = self._boxes[sid] = ContainerSandbox(rec, self)
        async with box.lock:
            lease: Lease | None = None
            try:
                # No record until the init runs: until then every host resource is
                # found by name (cgroups, uid slot file) and the reconciler removes it.
                rec.slot = self.slots.claim(sid)
                res = spec.resources
                if res.disk_medium == "disk" and not (self.uppers.ready and self.uppers.mounted()):
                    await self._setup_uppers()
                cg_dirs, upper = await asyncio.to_thread(self._make_host_parts, sid, res, rec.uid_base)
                lowers = [await self.layers.use(d, sid) for d in layers]
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
                rec.init_start = proc_start_time(spawned.pid)
                self.records.move(rec, SandboxState.RUNNING)
                self.last_activity[sid] = time.monotonic()
                return rec
            except BaseException:
                if lease is not None and sid not in self.net.sandboxes:
                    self.net.release(lease)  # never handed over to the sandbox's state
                await self._teardown(rec)
                self._forget(sid)
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
                self.records.move(rec, SandboxState.STOPPING, save=False)  # a cut-short destroy: see docs/RUNTIME.md
            for sess in box.take_sessions():
                with contextlib.suppress(Exception):
                    await sess.close()
            left = await self._teardown(rec)
            if not left:
                self.records.move(rec, SandboxState.STOPPED, save=False)  # the record file is gone
            self._forget(sandbox_id)
            self.last_activity.pop(sandbox_id, None)
            if left:
                raise HostError(f"sandbox {sandbox_id}: could not remove {left}", sandbox_id=sandbox_id)
            return True

    def open_init(self, rec: ContainerRecord, *, check: bool = True) -> int | None:
        """A pidfd of the sandbox's init, verified to be that very process (no pid reuse)."""
        try:
            fd = os.pidfd_open(rec.init_pid)
        except OSError:
            fd = None
        if fd is not None:
            try:
                start, exited = proc_identity(rec.init_pid)
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
            self.records.mark_failed(rec, "the sandbox's init process is gone")
            raise SandboxFailed(
                f"sandbox {rec.id} has failed: its init process is gone", sandbox_id=rec.id, reason="init_exited"
            )
        return None

    @property
    def holder(self) -> str:
        return f"runtime:{self.name}"

    def events(self, sandbox_id: str) -> builtins.list[dict[str, Any]]:
        return list(self.get(sandbox_id).events)


    # ----- lookups -----

    def get(self, sandbox_id: str) -> ContainerRecord:
        rec = self.sandboxes.get(sandbox_id)
        if rec is None:
            raise SandboxNotFound(f"no sandbox {sandbox_id!r} on this node", sandbox_id=sandbox_id)
        return rec

    def list(self) -> builtins.list[ContainerRecord]:
        return [b.rec for b in self._boxes.values()]

    def _forget(self, sandbox_id: str) -> None:
        box = self._boxes.pop(sandbox_id, None)
        if box is not None:
            box.gone = True

    def sandbox_state(self, sandbox_id: str) -> ContainerSandbox | None:
        """Like :meth:`live`, None for a sandbox that is gone."""
        return self._boxes.get(sandbox_id)

    def init_handle(self, rec: ContainerRecord) -> int:
        """A pidfd of the sandbox's init (the caller closes it); SandboxFailed, and the record
        marked failed, if the init is gone."""
        fd = self.open_init(rec)
        assert fd is not None
        return fd

    def live(self, sandbox_id: str) -> ContainerSandbox:
        """The sandbox object (:mod:`sandbox`): its live state and what is done to it."""
        box = self._boxes.get(sandbox_id)
        if box is None:
            raise SandboxNotFound(f"no sandbox {sandbox_id!r} on this node", sandbox_id=sandbox_id)
        return box

    # ----- network -----

    def netns_fd(self, sandbox_id: str) -> int | None:
        """An fd of a sandbox's network namespace (the caller closes it); None if it is gone."""
        rec = self.sandboxes.get(sandbox_id)
        return None if rec is None else open_netns(self, rec, check=False)

    async def collect_denied(self) -> dict[str, int]:
        """Read every networked sandbox's refused-packet counter; record a ``net_denied``
        event where it grew. Returns the increase per sandbox (only those that grew)."""
        grown: dict[str, int] = {}
        for sid in list(self.net.sandboxes):
            box = self._boxes.get(sid)
            n = 0 if box is None else await box.collect_denied()
            if n:
                grown[sid] = n
        return grown

    # ----- what a sandbox reaches of its node (sandbox.Node) -----

    def track_name(self) -> str:
        """A new command's freezer cgroup name, unique across runtime restarts (leftovers of
        a re-adopted sandbox stay)."""
        self._track_seq += 1
        return f"x{self._boot}{self._track_seq}"

    # ----- the Backend protocol's narrow reads -----

    def store_space(self) -> tuple[int, int] | None:
        """(free, total) bytes of the disk-medium writable-layer store; None until it is set up."""
        return self.uppers.space() if self.uppers.ready else None

    def release_layer(self, digest: str) -> None:
        """Drop this runtime's idle pin of a layer now (before deleting it from the store)."""
        self.layers.maybe_release(digest)
