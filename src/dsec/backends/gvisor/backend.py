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
import logging
import os
import secrets
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

from dsec.backends.base import (
    BackendBase,
    Capabilities,
    Capability,
    EdgeMeta,
    HostFinding,
    ShellSession,
    check_spec,
)
from dsec.backends.common import identity
from dsec.backends.common.cgroupsets import SandboxCgroups
from dsec.backends.common.command import DEFAULT_ENV
from dsec.backends.common.fsops import SandboxFiles
from dsec.backends.common.layers import SharedLayers, stack_in_store
from dsec.backends.common.names import ID_RE, NAME_RE
from dsec.backends.common.procstat import proc_start as _proc_start
from dsec.backends.common.records import RecordBook
from dsec.backends.gvisor import bundle as bundles
from dsec.backends.gvisor.commands import GVisorCommands
from dsec.backends.gvisor.config import GVisorConfig
from dsec.backends.gvisor.heal import GVisorRepair
from dsec.backends.gvisor.pausing import GVisorPausing
from dsec.backends.gvisor.records import (
    ISOLATION,
    MAX_LOWERS,
    ORPHAN_SWEEP_S,
    GVisorRecord,
    _children,
    _our_zombie,
)
from dsec.backends.gvisor.runsc import (
    Exit,
    Runsc,
    RunscError,
    Watched,
    hold_subreaper,
    reap_orphans,
    release_subreaper,
)
from dsec.errors import (
    HostError,
    InvalidSpec,
    SandboxFailed,
    SandboxNotFound,
    SandboxStateError,
)
from dsec.spec import ImageRef, SandboxSpec, SandboxState, can_move

log = logging.getLogger("dsec.gvisor")

class GVisorBackend(GVisorCommands, GVisorPausing, GVisorRepair, BackendBase):
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

    def _layers_for(self, image: ImageRef) -> builtins.list[str]:
        """Digests to stack, top first (:func:`dsec.backends.common.layers.stack`)."""
        return stack_in_store(image, self.store, max_layers=MAX_LOWERS)

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
        # its own /etc/hostname and /etc/hosts (localhost and its name resolve), whatever the image holds
        await asyncio.to_thread(identity.write_identity, upper_dir / "upper", sid, 0)
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
