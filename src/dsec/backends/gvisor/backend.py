"""The gVisor backend: sandboxes under runsc, behind :class:`dsec.backends.base.Backend`.

One ``GVisorBackend`` per edge (per ``name`` on a test machine). A sandbox is a runsc
container ``<name>-<sandbox id>`` in the backend's own runsc root, whose root filesystem
is an overlay of the node's shared EROFS layers under a writable upper of ours (see
:mod:`bundle`); runsc applies the limits to cgroups ``dsec/<name>/<id>`` (see
:mod:`cgroups`); commands run through ``runsc exec`` of our helper (see :mod:`process`).

What stands between a sandbox and the host: the sentry (gVisor's kernel in user space,
systrap platform) answers the sandbox's system calls; the sentry and the gofer run in
their own namespaces under seccomp; the sandbox has no network but loopback. Inside, every
command runs under a seccomp filter of our helper's (no namespaces, no mounts, no signals to
pid 1), in a cgroup and a UTS namespace of its own by which a timeout finds all it started
(docs/GVISOR.md).

Crash safety: a record is written before any host resource is made, and every resource
is named after the backend and the sandbox, so ``start()`` after a SIGKILL re-adopts the
sandboxes whose sentry still runs and removes everything else (runsc containers, mounts,
cgroups, bundle directories, writable layers). Blocking work runs in threads or in
runsc's processes, never on the event loop.
"""

from __future__ import annotations

import asyncio
import builtins
import collections
import contextlib
import functools
import json
import logging
import os
import secrets
import signal
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
    ShellSession,
    Usage,
    _Unset,
    check_spec,
    command_line,
)
from dsec.backends.common import limits as limit_evidence
from dsec.backends.common.command import DEFAULT_ENV, check_argv, command_env, user_ids
from dsec.backends.common.fsops import SandboxFiles
from dsec.backends.common.layers import SharedLayers
from dsec.backends.common.layers import stack as stack_layers
from dsec.backends.common.names import ID_RE, NAME_RE
from dsec.backends.common.output import check_exec, check_timed_out, collect, start_piped
from dsec.backends.common.records import RecordBook
from dsec.backends.gvisor import bundle as bundles
from dsec.backends.gvisor.cgroups import SandboxCgroups
from dsec.backends.gvisor.config import GVisorConfig
from dsec.backends.gvisor.process import Command
from dsec.backends.gvisor.runsc import (
    Exit,
    Runsc,
    RunscError,
    Watched,
    hold_subreaper,
    reap_orphans,
    release_subreaper,
    spawn,
)
from dsec.errors import (
    DsecError,
    ExecError,
    HostError,
    InvalidSpec,
    SandboxFailed,
    SandboxNotFound,
    SandboxStateError,
)
from dsec.spec import ImageRef, SandboxSpec, SandboxState, can_move
from dsec.spec.results import ExecResult, LimitHit

log = logging.getLogger("dsec.gvisor")

MAX_LOWERS: Final = 15
ORPHAN_SWEEP_S: Final = 1.0
"""How often zombies of runsc processes reparented to us are reaped."""
PIDS_SLACK: Final = 2
_FORK_FAILED: Final = (b"Resource temporarily unavailable", b"can't fork", b"fork: retry", b"Cannot fork")
"""strerror(EAGAIN) in glibc's and musl's words, busybox's and bash's: a fork refused at RLIMIT_NPROC."""
HELPER_CAPS: Final = ",".join((*bundles.CAPABILITIES, "CAP_SYS_ADMIN"))
"""``runsc exec --cap`` of the helper's run and kill modes: the container's capabilities (what
the command gets, as root) and CAP_SYS_ADMIN, which the helper keeps only to mount cgroupfs in a
mount namespace of its own; the command never has it."""
_HELPER_STAGES: Final = {
    "fork": "the helper could not fork it",
    "cgroup": "its own cgroup could not be made",
    "namespace": "its own UTS namespace could not be made",
    "creds": "user {user!r} could not be set",
    "seccomp": "its seccomp filter could not be installed",
}
"""The helper's steps before the command runs (native/dsec-gvexec.c), as ``ExecError.stage``."""
ISOLATION: Final = ("gVisor application kernel (runsc, systrap): the sandbox's system calls are served by "
                    "the sentry in user space, not the host kernel; commands under a seccomp filter (no "
                    "namespaces, mounts or signals to pid 1); loopback-only network")


def _proc_start(pid: int, *, zombie: bool = False) -> int:
    """Start time of ``pid`` (clock ticks since boot): with the pid, a process identity; 0 if
    gone (or exited and not reaped yet, unless ``zombie``)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return 0
    fields = data[data.rindex(b")") + 2:].split()
    return 0 if fields[0] in (b"Z", b"X") and not zombie else int(fields[19])


@dataclass(slots=True)
class GVisorRecord(SandboxRecord):
    """A gVisor sandbox: the runsc container, its layers and its sentry process."""

    layers: list[str] = field(default_factory=list)
    """Layer digests, top first."""
    container_id: str = ""
    sandbox_pid: int = 0
    """Host pid of the runsc sandbox process (the sentry)."""
    sandbox_start: int = 0
    medium: str = "memory"
    """Where the writable layer is: "memory" (tmpfs) or "disk" (btrfs subvolume)."""
    oom_baseline: int = 0

    backend: ClassVar[str] = "gvisor"

    def layer_stack(self) -> tuple[str, ...]:
        return tuple(self.layers)

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id, "state": self.state.value, "spec": self.spec.model_dump(mode="json"),
            "created_at": self.created_at, "reason": self.reason, "edge": self.edge.to_json(),
            "stage": self.stage, "layers": self.layers, "container_id": self.container_id,
            "sandbox_pid": self.sandbox_pid, "sandbox_start": self.sandbox_start, "medium": self.medium,
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> GVisorRecord:
        return cls(
            id=str(d["id"]), state=SandboxState(d["state"]), spec=SandboxSpec.model_validate(d["spec"]),
            created_at=float(d["created_at"]), reason=str(d.get("reason", "")),
            edge=EdgeMeta.from_json(d.get("edge")), stage=d.get("stage"),
            layers=[str(x) for x in d.get("layers", [])], container_id=str(d.get("container_id", "")),
            sandbox_pid=int(d.get("sandbox_pid", 0)), sandbox_start=int(d.get("sandbox_start", 0)),
            medium=str(d.get("medium", "memory")),
        )


@dataclass(frozen=True, slots=True)
class PauseResult:
    sandbox_id: str
    freeze_s: float
    reclaim: None
    """gVisor sandboxes' memory is not pushed out on pause (it is the sentry's memory file)."""
    seconds: float


class GVisorBackend(BackendBase):
    """Sandboxes under gVisor on this node. ``async with GVisorBackend(...)`` or start()/close()."""

    kind: ClassVar[str] = "gvisor"

    def __init__(self, config: GVisorConfig | None = None, *, name: str, state_dir: Path | str,
                 run_dir: Path | str, id_prefix: str = "sb", store: Any = None) -> None:
        self.config = config or GVisorConfig()
        if not NAME_RE.match(name):
            raise InvalidSpec(f"backend name {name!r} must match {NAME_RE.pattern}", field="name")
        self.name = name
        self.id_prefix = id_prefix
        self.state_dir = Path(state_dir)
        self.run_dir = Path(run_dir).absolute() / name
        self.records_dir = self.state_dir / "sandboxes" / name
        self.records: RecordBook[GVisorRecord] = RecordBook(self.records_dir)
        self.bundles_dir = self.run_dir / "sb"
        self.runsc_root = self.run_dir / "runsc"
        self._store = store
        self.cgroups = SandboxCgroups(name)
        self.runsc: Runsc | None = None
        self.capabilities = Capabilities(
            kind=self.kind,
            ops=frozenset({Capability.SANDBOXES, Capability.EXEC, Capability.SESSIONS, Capability.PAUSE}
                          | ({Capability.FILES} if self.config.file_access == "shared" else set())),
            isolation=ISOLATION,
        )
        self._sandboxes: dict[str, GVisorRecord] = {}
        self.last_activity: dict[str, float] = {}
        self.reconciled: dict[str, builtins.list[str]] = {}
        self._repairs: collections.deque[HostFinding] = collections.deque(maxlen=32)
        self._locks: dict[str, asyncio.Lock] = {}
        self._sessions: dict[str, dict[str, Any]] = {}
        self._sentries: dict[str, Watched] = {}
        self._reaped: dict[int, Watched] = {}
        self._layers = SharedLayers(self.holder)
        self._helper_fd = -1
        self._uppers: Any = None
        self._uppers_lock = asyncio.Lock()
        self._started = False
        self._subreaper = False
        self._sweeper: asyncio.Task[None] | None = None

    # ----- the protocol's read-only views -----

    @property
    def sandboxes(self) -> Mapping[str, GVisorRecord]:
        return self._sandboxes

    @property
    def host_repairs(self) -> Sequence[HostFinding]:
        return list(self._repairs)

    @property
    def store(self) -> Any:
        if self._store is None:
            from dsec.images.store import LocalLayerStore

            self._store = LocalLayerStore(self.state_dir / "layers")
        return self._store

    @property
    def holder(self) -> str:
        return f"runtime:{self.name}"

    @property
    def _mounts(self) -> Any:
        """The node's layer mounts this backend uses (set at start)."""
        return self._layers.mounts

    def container_id(self, sandbox_id: str) -> str:
        return f"{self.name}-{sandbox_id}"

    def bundle_dir(self, sandbox_id: str) -> Path:
        return self.bundles_dir / sandbox_id

    def rootfs(self, sandbox_id: str) -> Path:
        return self.bundle_dir(sandbox_id) / "rootfs"

    # ----- lifecycle of the backend -----

    async def __aenter__(self) -> GVisorBackend:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> None:
        from dsec.backends.gvisor.build import helper_path
        from dsec.images.mounts import LayerMounts

        if self._started:
            return
        if os.geteuid() != 0:
            raise HostError("the gvisor backend needs root (runsc with cgroups, overlay mounts)")
        cfg = self.config
        self.runsc = Runsc(cfg.runsc, root=self.runsc_root, platform=cfg.platform, file_access=cfg.file_access,
                           debug_log_dir=cfg.debug_log_dir)
        helper = await asyncio.to_thread(helper_path)
        for d in (self.run_dir, self.records_dir, self.bundles_dir, self.runsc_root):
            d.mkdir(parents=True, exist_ok=True)
        await asyncio.to_thread(self.cgroups.setup)
        self._layers.mounts = LayerMounts(self.store, self.run_dir / "layers", holders=[self.holder])
        await asyncio.to_thread(self._mounts.adopt)
        self._helper_fd = os.open(helper, os.O_RDONLY | os.O_CLOEXEC)
        if cfg.subreaper:
            self._subreaper = hold_subreaper()
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep_orphans(), name=f"{self.name}-reaper")
        if self._uppers_wanted() and self._uppers_image_exists():
            with contextlib.suppress(HostError):
                await self._setup_uppers()
        self._started = True
        try:
            self.reconciled = await self._reconcile()
        except BaseException:
            await self.close(destroy_all=False)
            raise

    async def close(self, *, destroy_all: bool = True) -> None:
        """Stop the backend. By default every sandbox is destroyed; ``destroy_all=False``
        leaves them running for the next ``start()`` to re-adopt."""
        if destroy_all:
            await asyncio.gather(*(self.destroy(i) for i in list(self._sandboxes)), return_exceptions=True)
        else:
            for sid in list(self._sessions):
                for sess in list(self._sessions.pop(sid, {}).values()):
                    with contextlib.suppress(Exception):
                        await sess.close()
        for w in [*self._sentries.values(), *self._reaped.values()]:
            w.close()
        self._sentries.clear()
        self._reaped.clear()
        if self._mounts is not None:
            self._layers.release_idle()
            if destroy_all:
                await asyncio.to_thread(self._mounts.close)
            self._layers.mounts = None
        if self._uppers is not None:
            unmount = destroy_all and not self._sandboxes
            await asyncio.to_thread(self._uppers.close, unmount=unmount)
            self._uppers = None
        if destroy_all and not self._sandboxes:
            await asyncio.to_thread(self.cgroups.remove_parents)
            for d in (self.bundles_dir, self.runsc_root):
                with contextlib.suppress(OSError):
                    d.rmdir()
            with contextlib.suppress(OSError):
                (self.run_dir / "layers" / ".lock").unlink()
            for d in (self.run_dir / "layers", self.run_dir / "uppers", self.run_dir):
                with contextlib.suppress(OSError):
                    d.rmdir()
        if self._helper_fd >= 0:
            os.close(self._helper_fd)
            self._helper_fd = -1
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
            self._sweeper = None
        if self._subreaper:
            release_subreaper()
            self._subreaper = False
        self._started = False

    async def _sweep_orphans(self) -> None:
        """While this process is a subreaper, runsc's processes that die after being
        reparented to it (and that no watcher awaits) are reaped here, never left as zombies
        of the edge."""
        while True:
            await asyncio.sleep(ORPHAN_SWEEP_S)
            try:
                reap_orphans()
            except Exception:  # the sweep must outlive one bad pass
                log.exception("reaping runsc orphans failed")

    # ----- records -----

    # ----- lookups -----

    def get(self, sandbox_id: str) -> GVisorRecord:
        rec = self._sandboxes.get(sandbox_id)
        if rec is None:
            raise SandboxNotFound(f"no sandbox {sandbox_id!r} in the gvisor backend {self.name}",
                                  sandbox_id=sandbox_id)
        return rec

    def list(self) -> builtins.list[GVisorRecord]:
        return list(self._sandboxes.values())

    def update(self, sandbox_id: str, *, spec: SandboxSpec | None = None,
               edge: EdgeMeta | None = None) -> GVisorRecord:
        """Change what the record says (not the running sandbox): a pool sandbox taken for a
        request gets that request's spec (same layers and resources) and edge data."""
        rec = self.get(sandbox_id)
        if spec is not None:
            if spec.resources != rec.spec.resources or self._layers_for(spec.image) != rec.layers:
                raise InvalidSpec(f"sandbox {sandbox_id} runs other layers or resources than the new spec",
                                  field="spec", sandbox_id=sandbox_id)
            self._check_spec(spec)
            rec.spec = spec
        if edge is not None:
            rec.edge = edge
        self.records.save(rec)
        return rec

    def _running(self, sandbox_id: str) -> GVisorRecord:
        """A running sandbox's record; a paused one is thawed first when the pause method allows
        it synchronously (the freezer); otherwise SandboxStateError."""
        rec = self.get(sandbox_id)
        if rec.state is SandboxState.PAUSED:
            self.wake(sandbox_id)
        if rec.state is not SandboxState.RUNNING:
            raise SandboxStateError(
                f"sandbox {sandbox_id} is {rec.state.value}, not running" + (f" ({rec.reason})" if rec.reason else ""),
                sandbox_id=sandbox_id, state=rec.state.value)
        return rec

    async def _running_async(self, sandbox_id: str) -> GVisorRecord:
        rec = self.get(sandbox_id)
        if rec.state is SandboxState.PAUSED and self.config.pause_method == "runsc":
            with contextlib.suppress(SandboxStateError):  # resumed meanwhile
                await self.resume(sandbox_id)
        return self._running(sandbox_id)

    def _sentry_alive(self, rec: GVisorRecord) -> bool:
        return rec.sandbox_pid > 0 and _proc_start(rec.sandbox_pid) == rec.sandbox_start

    # ----- layers -----

    def _resolve(self, ref: str) -> str:
        return str(self.store.resolve(ref).digest)

    def _layers_for(self, image: ImageRef) -> builtins.list[str]:
        """Digests to stack, top first (:func:`dsec.backends.common.layers.stack`)."""
        from dsec.images.layer import LayerKind

        def lineage(digest: str) -> tuple[str, ...] | None:
            layer = self.store.get(digest)
            return tuple(layer.parents) if layer.kind is LayerKind.SNAPSHOT else None

        return stack_layers(image, resolve=self._resolve, kind_of=lambda d: self.store.get(d).kind,
                            lineage_of=lineage, max_layers=MAX_LOWERS)

    async def _use_layer(self, digest: str, sandbox_id: str) -> Path:
        known, remounted = await self._layers.use(digest, sandbox_id)
        if remounted:
            found = HostFinding("layer_mount", f"re-mounted layer {digest} at {known} (it had been unmounted)", True)
            log.warning("%s: %s", self.name, found.message)
            self._repairs.append(found)
        return known

    # ----- writable layers on disk -----

    def _uppers_wanted(self) -> bool:
        return True

    def _uppers_image_exists(self) -> bool:
        return self.config.uppers_path is not None or (self.state_dir / "uppers" / f"{self.name}.img").exists()

    async def _setup_uppers(self) -> Any:
        from dsec.backends.common.uppers import UpperStore

        async with self._uppers_lock:
            if self._uppers is None:
                cfg = self.config
                store = UpperStore(
                    self.name,
                    mountpoint=cfg.uppers_path or self.run_dir / "uppers",
                    image=None if cfg.uppers_path else self.state_dir / "uppers" / f"{self.name}.img",
                    image_size=cfg.uppers_image_size,
                )
                await asyncio.to_thread(store.setup)
                self._uppers = store
            return self._uppers

    # ----- create / destroy -----

    def _check_spec(self, spec: SandboxSpec) -> None:
        if spec.backend != self.kind:
            raise InvalidSpec(f"this spec is for the {spec.backend} backend, not {self.kind}", field="backend")
        check_spec(self.capabilities, spec)

    def _new_id(self) -> str:
        return f"{self.id_prefix}-{secrets.token_hex(6)}"

    def _require_started(self) -> Runsc:
        if self.runsc is None or not self._started:
            raise HostError("the gvisor backend is not started: use `async with GVisorBackend(...)` or await start()")
        return self.runsc

    async def create(self, spec: SandboxSpec, *, sandbox_id: str | None = None,
                     edge: EdgeMeta | None = None) -> GVisorRecord:
        runsc = self._require_started()
        self._check_spec(spec)
        sid = sandbox_id or self._new_id()
        if not ID_RE.match(sid):
            raise InvalidSpec(f"sandbox id {sid!r} must match {ID_RE.pattern}", field="sandbox_id")
        existing = self._sandboxes.get(sid)
        if existing is not None:
            return existing  # idempotent
        layers = self._layers_for(spec.image)
        rec = GVisorRecord(sid, SandboxState.CREATING, spec, time.time(), edge=edge or EdgeMeta(), layers=layers,
                           container_id=self.container_id(sid), medium=spec.resources.disk_medium)
        self._sandboxes[sid] = rec
        lock = self._locks.setdefault(sid, asyncio.Lock())
        async with lock:
            try:
                # The record first: whatever a crash leaves from here on is found by its name.
                self.records.save(rec)
                await self._make(rec, runsc)
                self.records.move(rec, SandboxState.RUNNING)
                self.last_activity[sid] = time.monotonic()
                return rec
            except BaseException as exc:
                await self._teardown(rec)
                self._sandboxes.pop(sid, None)
                self._locks.pop(sid, None)
                if isinstance(exc, RunscError):
                    raise SandboxFailed(f"sandbox {sid} failed to start under runsc: {exc}", sandbox_id=sid,
                                        reason="runsc", stderr=exc.fields.get("stderr", "")) from None
                raise

    async def _make(self, rec: GVisorRecord, runsc: Runsc) -> None:
        sid, res = rec.id, rec.spec.resources
        bundle = self.bundle_dir(sid)
        await asyncio.to_thread(bundle.mkdir, 0o700, True, False)
        lowers = [await self._use_layer(d, sid) for d in rec.layers]
        if res.disk_medium == "disk":
            store = await self._setup_uppers()
            upper_dir = await asyncio.to_thread(store.create, sid, quota=res.disk, uid=0)
        else:
            upper_dir = await asyncio.to_thread(bundles.make_tmpfs_upper, bundle / "upper", res.disk)
        rootfs = self.rootfs(sid)
        bind_tmp = await asyncio.to_thread(bundles.mount_rootfs, rootfs, lowers, upper_dir)
        env = {**DEFAULT_ENV, **rec.spec.env}
        oci = bundles.oci_spec(hostname=sid, rootfs=rootfs, env=env, res=res, cgroups_path=self.cgroups.path(sid),
                               host_pids=res.pids + self.config.host_pids_headroom, bind_tmp=bind_tmp)
        await asyncio.to_thread(bundles.write_spec, bundle, oci)
        pid_file = bundle / "sandbox.pid"
        # pid 1 is our helper (init mode: it reaps orphans), handed over as fd 3: nothing of
        # ours is put in the sandbox's filesystem.
        # The sentry's own last words (a Go panic, a fatal error) go to the bundle: _sentry_gone
        # puts them in the failed sandbox's events. (A logging flag: it may differ between calls.)
        argv = [f"--panic-log={bundle / 'panic.log'}", "run", "--detach", f"--bundle={bundle}",
                f"--pid-file={pid_file}", "--exec-fd=3", rec.container_id]
        await runsc.call(*argv, what="run", extra_fds={3: self._helper_fd})
        rec.sandbox_pid = int(pid_file.read_text().strip())
        rec.sandbox_start = _proc_start(rec.sandbox_pid)
        rec.oom_baseline = self.cgroups.oom_kills(sid)
        self._watch(rec)

    def _watch(self, rec: GVisorRecord) -> None:
        """Watch the sentry (a sandbox that dies on its own is marked failed at once) and reap
        the runsc processes that were reparented to us (we are their subreaper)."""
        loop = asyncio.get_running_loop()
        sentry = Watched(rec.sandbox_pid, loop)
        self._sentries[rec.id] = sentry
        sentry.exited.add_done_callback(functools.partial(self._sentry_exited, rec.id, rec.sandbox_start))
        mine = set(self.cgroups.pids(rec.id))
        for child in _children():
            if child in mine and child != rec.sandbox_pid and child not in self._reaped:
                w = Watched(child, loop)
                self._reaped[child] = w
                w.exited.add_done_callback(functools.partial(self._forget_reaped, child))

    def _forget_reaped(self, pid: int, _f: object) -> None:
        self._reaped.pop(pid, None)

    def _sentry_exited(self, sandbox_id: str, start: int, f: asyncio.Future[Exit]) -> None:
        self._sentry_gone(sandbox_id, start, f.result() if not f.cancelled() else None)

    def _sentry_gone(self, sandbox_id: str, start: int, how: Exit | None = None) -> None:
        self._sentries.pop(sandbox_id, None)
        rec = self._sandboxes.get(sandbox_id)
        if rec is None or rec.sandbox_start != start or rec.state not in (SandboxState.RUNNING, SandboxState.PAUSED):
            return
        oom = self.cgroups.oom_kills(sandbox_id) > rec.oom_baseline
        why = ("the memory limit was exceeded: the host's OOM killer ended the sandbox's sentry (gVisor has no "
               "per-process OOM kill inside)" if oom else "its runsc sandbox process exited")
        last = ""
        with contextlib.suppress(OSError):
            last = (self.bundle_dir(sandbox_id) / "panic.log").read_text(errors="replace")[-2000:]
        self.records.event(rec, "sentry_exited", oom=oom, panic_log=last,
                    exit_code=None if how is None else how.code, signal=None if how is None else how.signal)
        self.records.mark_failed(rec, why)

    async def destroy(self, sandbox_id: str) -> bool:
        """Destroy a sandbox and everything it holds. Idempotent: False if it was not there."""
        rec = self._sandboxes.get(sandbox_id)
        if rec is None:
            return False
        lock = self._locks.setdefault(sandbox_id, asyncio.Lock())
        async with lock:
            if sandbox_id not in self._sandboxes:
                return False
            if can_move(rec.state, SandboxState.STOPPING):
                self.records.move(rec, SandboxState.STOPPING, save=False)
            for sess in list(self._sessions.pop(sandbox_id, {}).values()):
                with contextlib.suppress(Exception):
                    await sess.close()
            left = await self._teardown(rec)
            if not left and can_move(rec.state, SandboxState.STOPPED):
                self.records.move(rec, SandboxState.STOPPED, save=False)
            self._sandboxes.pop(sandbox_id, None)
            self._locks.pop(sandbox_id, None)
            self.last_activity.pop(sandbox_id, None)
            if left:
                raise HostError(f"sandbox {sandbox_id}: could not remove {left}", sandbox_id=sandbox_id)
            return True

    async def _teardown(self, rec: GVisorRecord) -> builtins.list[str]:
        """Remove the runsc container, cgroups, mounts, upper, bundle, layer pins and record.
        Safe on a half-made sandbox and on one whose sentry died."""
        sid, cid = rec.id, rec.container_id or self.container_id(rec.id)
        left: list[str] = []
        # Watch every host process of the sandbox until it is gone: those that were reparented
        # to us (we are their subreaper) are reaped as they die, which runsc delete waits for.
        loop = asyncio.get_running_loop()
        watchers = [w for w in (self._sentries.pop(sid, None),) if w is not None]
        known = {w.pid for w in watchers}
        if rec.sandbox_pid > 0 and rec.sandbox_pid not in known and \
                _proc_start(rec.sandbox_pid, zombie=True) == rec.sandbox_start:
            watchers.append(Watched(rec.sandbox_pid, loop))
        watchers += [Watched(p, loop) for p in self.cgroups.pids(sid) if p not in known and p != rec.sandbox_pid]
        gofer = self.runsc.gofer_pid(cid) if self.runsc is not None else 0
        if gofer > 0 and _our_zombie(gofer):
            watchers.append(Watched(gofer, loop))
        # Kill the sentry, gofer and stubs ourselves (then thaw: frozen tasks die only once
        # thawed). runsc delete then finds a stopped sandbox and only removes its state and
        # cgroups: it never waits on a sentry that cannot answer (frozen, or its gofer gone).
        self.cgroups.kill_all(sid)
        self.cgroups.thaw(sid)
        if watchers:
            await asyncio.wait([asyncio.shield(w.exited) for w in watchers], timeout=5.0)
        runsc = self.runsc
        if runsc is not None and runsc.state_files(cid):
            try:
                await runsc.delete(cid)
            except (RunscError, TimeoutError) as exc:
                log.warning("gvisor %s: runsc delete %s failed (%s); removing by hand", self.name, cid, exc)
        if runsc is not None:
            for f in runsc.state_files(cid):
                with contextlib.suppress(OSError):
                    f.unlink()
        left += [f"cgroup {p}" for p in await self.cgroups.remove(sid)]
        for w in watchers:
            w.close()
        left += await asyncio.to_thread(bundles.remove_bundle, self.bundle_dir(sid))
        if rec.medium == "disk" and self._uppers is not None:
            with contextlib.suppress(OSError, HostError):
                await asyncio.to_thread(self._uppers.destroy, sid)
        for d in set(rec.layers):
            self._layers.unuse(d, sid)
        if not left:
            self.records.remove(sid)
        return left

    # ----- running commands -----

    async def start_process(self, sandbox_id: str, argv: Sequence[str], *, stdin: int, stdout: int, stderr: int,
                            env: Mapping[str, str] | None = None, cwd: str = "/",
                            user: int | str = 0) -> Command:
        """Start ``argv`` in the sandbox with the given host fds as its stdio (they go to the
        sentry as they are). The handle's ``kill(tree=True)`` reaches every process it started."""
        runsc = self._require_started()
        rec = await self._running_async(sandbox_id)
        check_argv(sandbox_id, argv, cwd)
        uid, gid = user_ids(user)
        merged = command_env(rec.spec.env, env)
        if any("\0" in a for a in argv) or "\0" in cwd:
            raise InvalidSpec("command or cwd contains a NUL byte", field="cmd")
        # The helper starts as root with CAP_SYS_ADMIN to put the command in a cgroup of its own
        # (named after the helper's pid and this token), then drops to uid:gid and the
        # container's capabilities before the command runs (native/dsec-gvexec.c).
        token = secrets.token_hex(8)
        args = ["exec", "--exec-fd=3", "--pass-fd=4:3", "--user=0:0", f"--cap={HELPER_CAPS}", "--cwd=/"]
        args += [f"--env={k}={v}" for k, v in merged.items()]
        args += [rec.container_id, "dsec-gvexec", "run", str(uid), str(gid), token, cwd, *argv]
        status_r, status_w = os.pipe2(os.O_CLOEXEC)
        try:
            pid = spawn(runsc.argv(*args), {0: stdin, 1: stdout, 2: stderr, 3: self._helper_fd, 4: status_w})
        except BaseException:
            os.close(status_r)
            raise
        finally:
            os.close(status_w)
        proc = Command(sandbox_id, Watched(pid, asyncio.get_running_loop()), status_r, self._kill_command,
                       cgroup_token=token)
        self.last_activity[sandbox_id] = time.monotonic()
        self.records.event(rec, "exec_started", pid=pid, argv0=argv[0], cmd=command_line(argv))
        return proc

    async def _helper_exec(self, rec: GVisorRecord, *args: str, timeout: float = 30.0,
                           cgroups: bool = False) -> bytes:
        """Run the helper as root in the sandbox (kill, count) and wait for it; its output.
        ``cgroups``: with CAP_SYS_ADMIN, to mount the commands' cgroup hierarchy for itself."""
        runsc = self._require_started()
        caps = [f"--cap={HELPER_CAPS}"] if cgroups else []
        try:
            return await runsc.call("exec", "--exec-fd=3", "--user=0:0", *caps, "--cwd=/", rec.container_id,
                                    "dsec-gvexec", *args, timeout=timeout, what=f"exec (helper {args[0]})",
                                    extra_fds={3: self._helper_fd})
        except (RunscError, TimeoutError) as exc:
            log.warning("gvisor %s: %s in %s: %s", self.name, args[0], rec.id, exc)
            return b""

    async def _pids_hit(self, rec: GVisorRecord, result: ExecResult) -> LimitHit | None:
        """The pids verdict gVisor needs: no host counter sees a fork refused inside the sentry
        (RLIMIT_NPROC), so the evidence is the command's own word for it (EAGAIN from a fork) and
        a user of the sandbox at the limit now. Asked only of a failed command that says so."""
        said = any(t in out for out in (result.stderr, result.stdout) for t in _FORK_FAILED)
        if not said or not limit_evidence.failed(result.exit_code, result.signal):
            return None
        counts = [ln.split() for ln in (await self._helper_exec(rec, "count", timeout=10)).decode().splitlines()]
        top = max((int(c[1]) for c in counts if len(c) == 2 and c[1].isdigit()), default=0)
        # At the limit when the fork failed; since then the shell whose fork failed and our helper
        # have exited: a user within PIDS_SLACK of the limit now was at it.
        return LimitHit.of("pids", rec.spec.resources.pids) if top + PIDS_SLACK >= rec.spec.resources.pids else None

    async def _kill_command(self, proc: Command, tree: bool) -> None:
        rec = self._sandboxes.get(proc.sandbox_id)
        if rec is None or rec.state not in (SandboxState.RUNNING, SandboxState.PAUSED):
            return
        if rec.state is SandboxState.PAUSED:
            with contextlib.suppress(SandboxStateError):
                await self.resume(rec.id)
        if proc.inner_pid <= 0 or not self._sentry_alive(rec):
            return  # never started, or the sandbox is gone with it
        # Everything in the command's UTS namespace and cgroup, however it detached (setsid,
        # orphaned), and of its session and their descendants; the helper (spared) lives to
        # report its end.
        await self._helper_exec(rec, "kill", proc.cgroup, proc.namespace, str(proc.inner_pid), str(proc.inner_pid),
                                cgroups=True)

    async def kill_children(self, proc: Command) -> None:
        """Kill what a session's shell started, not the shell (the session lives on)."""
        rec = self._sandboxes.get(proc.sandbox_id)
        if rec is not None and proc.command_pid > 0 and rec.state is SandboxState.RUNNING:
            await self._helper_exec(rec, "kill", proc.cgroup, proc.namespace, str(proc.inner_pid),
                                    str(proc.inner_pid), str(proc.command_pid), cgroups=True)

    async def exec(self, sandbox_id: str, cmd: str | Sequence[str], *, env: Mapping[str, str] | None = None,
                   cwd: str = "/", user: int | str = 0, stdin: bytes | None = None,
                   timeout: float | _Unset | None = UNSET, idle_timeout: float | None = None,
                   on_output: OutputCallback | None = None, output_cap: int | None = None,
                   pristine: Sequence[str] = ()) -> ExecResult:
        """Run a command to completion: argv list, or a string run by ``/bin/sh -c``.
        ``timeout`` (default 600 s; None: none) and ``idle_timeout`` kill the command's whole
        tree (never the sandbox) and raise :class:`ExecTimeout` with the partial result."""
        if pristine:
            raise self._unsupported("pristine paths")
        argv, limit = check_exec(cmd, timeout=timeout, idle_timeout=idle_timeout, output_cap=output_cap)
        rec = await self._running_async(sandbox_id)
        cap = output_cap or rec.spec.output_cap
        before = self.limit_baseline(rec)
        proc, in_w, out_r, err_r = await start_piped(lambda i, o, e: self.start_process(
            sandbox_id, argv, stdin=i, stdout=o, stderr=e, env=env, cwd=cwd, user=user))
        got = await collect(proc, in_w, out_r, err_r, stdin, limit, idle_timeout, on_output, cap)
        await proc.wait_killed()
        self.last_activity[sandbox_id] = time.monotonic()
        ex = got.exit
        if ex.error is not None:
            err, stage = ex.error
            if stage == "cwd":
                raise ExecError(f"working directory {cwd!r} does not exist in sandbox {sandbox_id} "
                                f"({os.strerror(err)})", sandbox_id=sandbox_id, stage="cwd", errno=err)
            if stage in _HELPER_STAGES:
                what = _HELPER_STAGES[stage].format(user=user)
                raise ExecError(f"cannot run {argv[0]!r} in sandbox {sandbox_id}: {what} ({os.strerror(err)})",
                                sandbox_id=sandbox_id, stage=stage, errno=err)
            hint = "not found in the sandbox's PATH" if err == 2 else os.strerror(err)
            raise ExecError(f"cannot run {argv[0]!r} in sandbox {sandbox_id}: {hint}", sandbox_id=sandbox_id,
                            stage=stage, errno=err)
        result = got.result(proc.start_latency_s)
        if ex.lost and not self._sentry_alive(rec):
            self._sentry_gone(rec.id, rec.sandbox_start)
            if self.cgroups.oom_kills(rec.id) > rec.oom_baseline or "memory limit" in rec.reason:
                result.exit_code, result.signal = None, signal.SIGKILL
                result.limit = LimitHit("memory", rec.spec.resources.memory,
                                        LimitHit.of("memory", rec.spec.resources.memory).message
                                        + " (under gVisor the whole sandbox is ended)")
            else:
                raise SandboxFailed(f"sandbox {sandbox_id} died while running the command ({rec.reason})",
                                    sandbox_id=sandbox_id, reason="sentry_exited")
        elif ex.lost and proc.inner_pid == 0:
            text = result.stderr.decode(errors="replace").strip().splitlines()
            raise ExecError(f"cannot start command in sandbox {sandbox_id}: {text[-1] if text else 'runsc exec failed'}",
                            sandbox_id=sandbox_id, stage="runsc")
        else:
            result.limit = self.limit_hit(rec, before, exit_code=result.exit_code, sig=result.signal,
                                          timed_out=result.timed_out, timeout_s=limit, idle_timeout_s=idle_timeout,
                                          truncated=result.truncated, output_cap=cap,
                                          output=(result.stderr, result.stdout))
            if result.limit is None or result.limit.kind == "output_cap":
                result.limit = await self._pids_hit(rec, result) or result.limit
        self.records.event(rec, "exec_ended", pid=proc.pid, exit_code=result.exit_code, signal=result.signal,
                    duration_s=round(result.duration_s, 6), timed_out=result.timed_out,
                    output_truncated=result.truncated, limit=None if result.limit is None else result.limit.kind)
        check_timed_out(result, sandbox_id, limit=limit, idle_timeout=idle_timeout)
        return result

    # ----- limits -----

    def limit_baseline(self, rec: SandboxRecord) -> limit_evidence.Baseline:
        counters = limit_evidence.Counters(self.cgroups.oom_kills(rec.id), 0)
        return limit_evidence.Baseline(counters, False)

    def limit_hit(self, rec: SandboxRecord, before: limit_evidence.Baseline | None, *, exit_code: int | None,
                  sig: int | None, timed_out: str | None = None, timeout_s: float | None = None,
                  idle_timeout_s: float | None = None, truncated: bool = False, output_cap: int = 0,
                  output: tuple[bytes, ...] = ()) -> LimitHit | None:
        """Which limit ended a command (``ExecResult.limit``), from the same evidence rules as the
        container backend. gVisor refuses forks past ``pids`` inside the sentry without a counter
        the host can read, so a pids verdict is never given."""
        after = disk = None
        if limit_evidence.failed(exit_code, sig) and timed_out is None:
            after = limit_evidence.Counters(self.cgroups.oom_kills(rec.id), 0)
            start = None if before is None else before.counters
            if start is not None and after.oom_kills > start.oom_kills:
                # The host's OOM killer ends the systrap stub that maps the process's memory;
                # the sentry then reports the process as exited (status 1, measured), not as
                # SIGKILL: the counter's growth while it ran is the evidence here.
                hit = LimitHit.of("memory", rec.spec.resources.memory)
                return LimitHit("memory", hit.value, hit.message + " (gVisor: the host's OOM killer ended it; "
                                "the sentry's own memory counts against the limit too)")
            disk = self.disk_room(rec)
        return limit_evidence.judge(rec.spec.resources, exit_code=exit_code, sig=sig, timed_out=timed_out,
                                    timeout_s=timeout_s, idle_timeout_s=idle_timeout_s, truncated=truncated,
                                    output_cap=output_cap, before=before, after=after, disk=disk, output=output)

    def disk_room(self, rec: SandboxRecord) -> DiskRoom | None:
        if not isinstance(rec, GVisorRecord):
            return None
        try:
            if rec.medium == "disk":
                if self._uppers is None:
                    return None
                use = self._uppers.usage(rec.id)
                return DiskRoom(use.free, -1, use.free < limit_evidence.DISK_FULL_BYTES)
            st = os.statvfs(self.bundle_dir(rec.id) / "upper")
        except (OSError, ValueError, HostError):
            return None
        free = st.f_bavail * st.f_frsize
        return DiskRoom(free, int(st.f_favail), free < limit_evidence.DISK_FULL_BYTES or st.f_favail == 0)

    def usage(self, sandbox_id: str) -> Usage:
        """Memory (sentry, gofer and the sandbox's memory, as the memory cgroup charges it),
        host tasks (the sandbox's processes are not host processes: this counts the sentry's
        threads, the gofer and the systrap stubs), CPU seconds and the writable layer's bytes."""
        rec = self.get(sandbox_id)
        disk = 0
        room = self.disk_room(rec)
        if room is not None:
            total = rec.spec.resources.disk
            disk = max(0, total - room.bytes_free)
        return Usage(memory_bytes=self.cgroups.memory_bytes(sandbox_id), pids=self.cgroups.host_tasks(sandbox_id),
                     cpu_s=self.cgroups.cpu_s(sandbox_id), disk_bytes=disk)

    def store_space(self) -> tuple[int, int] | None:
        if self._uppers is None:
            return None
        with contextlib.suppress(OSError):
            return self._uppers.space()  # type: ignore[no-any-return]
        return None

    # ----- files and sessions -----

    def files(self, sandbox_id: str) -> SandboxFiles:
        """Host-side file access to the sandbox's root (our overlay), confined by openat2
        (RESOLVE_IN_ROOT, no magic links, no mount crossing). runsc runs with
        ``--file-access=shared``, so the sandbox sees these changes at once."""
        self.capabilities.require(Capability.FILES, what="files (file_access='exclusive')")
        rec = self._running(sandbox_id)
        self.last_activity[sandbox_id] = time.monotonic()
        return SandboxFiles(str(self.rootfs(rec.id)), 0, sandbox_id)

    async def open_session(self, sandbox_id: str, *, env: Mapping[str, str] | None = None,
                           cwd: str = "/", user: int | str = 0) -> ShellSession:
        from dsec.backends.gvisor.sessions import GVisorSession

        await self._running_async(sandbox_id)
        sess = GVisorSession(self, sandbox_id, f"sess-{secrets.token_hex(4)}")
        await sess.start(env=dict(env or {}), cwd=cwd, user=user)
        self._sessions.setdefault(sandbox_id, {})[sess.id] = sess
        return sess

    def forget_session(self, sandbox_id: str, session_id: str) -> None:
        self._sessions.get(sandbox_id, {}).pop(session_id, None)

    def session_table(self) -> dict[str, dict[str, Any]]:
        return self._sessions

    # ----- pause / resume -----

    def wake(self, sandbox_id: str) -> bool:
        """Thaw a paused sandbox at once (freezer pause); False if it was not paused or the
        pause method needs an async resume."""
        rec = self._sandboxes.get(sandbox_id)
        if rec is None or rec.state is not SandboxState.PAUSED or self.config.pause_method != "freezer":
            return False
        if self.wake_gate is not None:
            self.wake_gate(sandbox_id)  # raises to keep it paused (preempted)
        self.cgroups.thaw(sandbox_id)
        self.records.move(rec, SandboxState.RUNNING)
        self.records.event(rec, "woken")
        self.last_activity[sandbox_id] = time.monotonic()
        return True

    async def pause(self, sandbox_id: str, *, reclaim: bool = True) -> PauseResult:
        """Freeze the sandbox (``reclaim`` is ignored: its memory is the sentry's, not swapped out)."""
        async with self._locks.setdefault(sandbox_id, asyncio.Lock()):
            return await self._pause(sandbox_id)

    async def _pause(self, sandbox_id: str) -> PauseResult:
        t0 = time.monotonic()
        rec = self.get(sandbox_id)
        if rec.state is not SandboxState.RUNNING:
            raise SandboxStateError(f"sandbox {sandbox_id} is {rec.state.value}: only a running sandbox can be paused",
                                    sandbox_id=sandbox_id, state=rec.state.value)
        if self.config.pause_method == "runsc":
            await self._require_started().pause(rec.container_id)
        else:
            self.cgroups.freeze(sandbox_id)
            deadline = time.monotonic() + 10
            while self.cgroups.freezer_state(sandbox_id) != "FROZEN":
                if time.monotonic() > deadline:
                    self.cgroups.thaw(sandbox_id)
                    raise HostError(f"sandbox {sandbox_id} did not freeze within 10 s", sandbox_id=sandbox_id)
                await asyncio.sleep(0.001)
        freeze_s = time.monotonic() - t0
        self.records.move(rec, SandboxState.PAUSED)
        self.records.event(rec, "paused", freeze_s=round(freeze_s, 6), method=self.config.pause_method)
        return PauseResult(sandbox_id, freeze_s, None, time.monotonic() - t0)

    async def resume(self, sandbox_id: str) -> GVisorRecord:
        if self.config.pause_method == "freezer":
            return self._resume(sandbox_id)  # one write, no await: nothing to interleave with
        async with self._locks.setdefault(sandbox_id, asyncio.Lock()):
            return await self._resume_runsc(sandbox_id)

    def _not_paused(self, rec: GVisorRecord) -> SandboxStateError:
        return SandboxStateError(f"sandbox {rec.id} is {rec.state.value}: only a paused sandbox can be resumed",
                                 sandbox_id=rec.id, state=rec.state.value)

    def _resume(self, sandbox_id: str) -> GVisorRecord:
        rec = self.get(sandbox_id)
        if rec.state is not SandboxState.PAUSED:
            raise self._not_paused(rec)
        self.cgroups.thaw(sandbox_id)
        self.records.move(rec, SandboxState.RUNNING)
        self.records.event(rec, "resumed")
        self.last_activity[sandbox_id] = time.monotonic()
        return rec

    async def _resume_runsc(self, sandbox_id: str) -> GVisorRecord:
        rec = self.get(sandbox_id)
        if rec.state is not SandboxState.PAUSED:
            raise self._not_paused(rec)
        await self._require_started().resume(rec.container_id)
        self.records.move(rec, SandboxState.RUNNING)
        self.records.event(rec, "resumed")
        self.last_activity[sandbox_id] = time.monotonic()
        return rec

    async def pause_many(self, sandbox_ids: Sequence[str], *, reclaim: bool = True) -> GroupOutcome:
        return await self._group(sandbox_ids, SandboxState.PAUSED, lambda s: self.pause(s, reclaim=reclaim))

    async def resume_many(self, sandbox_ids: Sequence[str]) -> GroupOutcome:
        return await self._group(sandbox_ids, SandboxState.RUNNING, self.resume)

    async def _group(self, ids: Sequence[str], target: SandboxState, op: Any) -> GroupOutcome:
        t0 = time.monotonic()
        out = GroupOutcome()

        async def one(sid: str) -> None:
            try:
                if self.get(sid).state is target:
                    out.skipped.append(sid)
                    return
                await op(sid)
                out.done.append(sid)
            except DsecError as exc:
                out.errors[sid] = exc

        await asyncio.gather(*(one(s) for s in dict.fromkeys(ids)))
        out.seconds = time.monotonic() - t0
        return out

    # ----- reconcile after a crash -----

    async def _reconcile(self) -> dict[str, builtins.list[str]]:
        """Re-adopt sandboxes whose sentry still runs; remove every trace of the others."""
        runsc = self._require_started()
        adopted: list[str] = []
        destroyed: list[str] = []
        containers = set(runsc.container_ids())
        mounted = {m.mount_point for m in await asyncio.to_thread(_mountinfo)}
        for path in self.records.files():
            try:
                rec = GVisorRecord.from_json(json.loads(path.read_text()))
            except (OSError, ValueError, KeyError):
                path.unlink(missing_ok=True)
                continue
            alive = (rec.state in (SandboxState.RUNNING, SandboxState.PAUSED) and rec.container_id in containers
                     and self._sentry_alive(rec) and str(self.rootfs(rec.id)) in mounted)
            if alive and rec.medium == "disk":
                try:
                    await self._setup_uppers()
                except HostError:
                    alive = False
            if alive:
                if self.config.pause_method == "freezer":
                    frozen = self.cgroups.freezer_state(rec.id) == "FROZEN"
                    rec.state = SandboxState.PAUSED if frozen else SandboxState.RUNNING
                rec.oom_baseline = self.cgroups.oom_kills(rec.id)
                self._sandboxes[rec.id] = rec
                self._layers.adopt(rec.id, rec.layers)
                self._watch(rec)
                self.records.event(rec, "adopted")
                self.records.save(rec)
                self.last_activity[rec.id] = time.monotonic()
                adopted.append(rec.id)
                continue
            await self._teardown(rec)
            destroyed.append(rec.id)
        # Anything of this name without a live record: runsc containers, cgroups, bundles, uppers.
        prefix = f"{self.name}-"
        for cid in containers:
            sid = cid[len(prefix):]
            if cid.startswith(prefix) and sid not in self._sandboxes:
                await self._teardown(GVisorRecord(sid, SandboxState.FAILED, _ORPHAN_SPEC, 0.0, container_id=cid))
                destroyed.append(sid)
        orphans = set(self.cgroups.existing()) | {p.name for p in self.bundles_dir.iterdir() if p.is_dir()}
        for sid in sorted(orphans - set(self._sandboxes) - set(destroyed)):
            if ID_RE.match(sid):
                await self._teardown(GVisorRecord(sid, SandboxState.FAILED, _ORPHAN_SPEC, 0.0))
                destroyed.append(sid)
        if self._uppers is not None:
            for sid in set(self._uppers.names()) - set(self._sandboxes):
                with contextlib.suppress(OSError, HostError):
                    await asyncio.to_thread(self._uppers.destroy, sid)
        self._layers.release_unused_pins()
        await asyncio.to_thread(self._mounts.unmount_unused)
        return {"adopted": adopted, "destroyed": destroyed}

    async def heal(self, *, repair: bool = True) -> builtins.list[HostFinding]:
        """Layer mounts that someone unmounted are mounted again (running sandboxes keep
        theirs: the overlay holds its lowers)."""
        if self._mounts is None:
            return []
        problems, repairs = await asyncio.to_thread(self._mounts.check, repair=repair)
        found = [HostFinding("layer_mount", m, False) for m in problems]
        found += [HostFinding("layer_mount", m, True) for m in repairs]
        self._repairs.extend(f for f in found if f.repaired)
        return found


_ORPHAN_SPEC: Final = SandboxSpec(image=ImageRef(base="orphan:none"), backend="gvisor")
"""The spec of a leftover found by name only (its record is gone): never run, only torn down."""


def _our_zombie(pid: int) -> bool:
    """``pid`` is an exited, unreaped child of this process that runsc made (its binary re-executed
    as ``exe``, or named runsc-*)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return False
    comm = data[data.index(b"(") + 1:data.rindex(b")")]
    fields = data[data.rindex(b")") + 2:].split()
    return fields[0] == b"Z" and int(fields[1]) == os.getpid() and (comm == b"exe" or comm.startswith(b"runsc"))


def _children() -> builtins.list[int]:
    out: list[int] = []
    for t in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError), open(f"/proc/self/task/{t}/children") as f:
            out.extend(int(x) for x in f.read().split())
    return out


def _mountinfo() -> builtins.list[Any]:
    from dsec.images import sysmount

    return list(sysmount.mountinfo())
