"""The microVM backend: a QEMU microvm per sandbox, restored from a template (docs/MICROVM.md).

The node (this class) owns what every VM shares: the guest kernel and initramfs, the
accelerator, the templates and their tmpfs, the uids QEMU runs as, the cgroups' parents, the
VM loop (:mod:`~dsec.backends.microvm.vmloop`) and the records. Each sandbox is a
:class:`~dsec.backends.microvm.sandbox.MicroVM` (its QEMU process and its agent connection)
that does exec, sessions and files; the Backend protocol's per-sandbox calls are handed to it.

A create: the image's layers (EROFS files from the layer store, never copied) -> the
machine (:class:`~dsec.backends.microvm.machine.MachineSpec`) -> its template (made on first
use) -> a clone: QEMU started with ``-incoming defer`` in the sandbox's cgroups as the
sandbox's own uid, the template's state restored into it, its disk an overlay of the
template's, and a fresh identity (hostname, machine-id, RNG seed, clock) given to it.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import logging
import math
import os
import secrets
import shutil
import subprocess
import time
import tty as tty_mod
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from dsec.backends.base import (
    UNSET,
    BackendBase,
    Capabilities,
    Capability,
    DiskRoom,
    EdgeMeta,
    GroupOutcome,
    HostFinding,
    NetworkFacts,
    OutputCallback,
    ShellSession,
    TtySize,
    Usage,
    _Unset,
    check_spec,
    set_tty_size,
)
from dsec.backends.common import claims
from dsec.backends.common import limits as limit_evidence
from dsec.backends.common.cgroupsets import SandboxCgroups
from dsec.backends.common.layers import stack_in_store
from dsec.backends.common.names import ID_RE, NAME_RE
from dsec.backends.common.network import Lease, NetworkManager
from dsec.backends.common.output import check_exec, check_timed_out, collect, start_piped
from dsec.backends.common.records import RecordBook
from dsec.backends.common.zram import ZramSwap
from dsec.backends.microvm import host
from dsec.backends.microvm.config import MicroVMConfig
from dsec.backends.microvm.machine import BOOT_ARGS, FAST_BOOT_ARGS, Accel, MachineSpec, Sockets
from dsec.backends.microvm.network import close_tap, open_tap, qemu_netns
from dsec.backends.microvm.qemu import QemuDriver, VmDriverError, qemu_build
from dsec.backends.microvm.records import ISOLATION, MAX_LAYERS, MicroVMRecord, proc_start
from dsec.backends.microvm.sandbox import MicroVM, PauseResult
from dsec.backends.microvm.templates import Template, TemplateStore
from dsec.backends.microvm.vmloop import VmLoop
from dsec.errors import (
    HostError,
    InvalidSpec,
    SandboxFailed,
    SandboxNotFound,
    SandboxStateError,
)
from dsec.spec import ImageRef, NetworkPolicy, SandboxSpec, SandboxState, can_move
from dsec.spec.results import ExecResult

log = logging.getLogger("dsec.microvm")

MiB = 1 << 20


class MicroVMBackend(BackendBase):
    kind = "microvm"

    def __init__(self, config: MicroVMConfig | None = None, *, name: str, state_dir: Path, run_dir: Path,
                 id_prefix: str = "vm", store: Any = None) -> None:
        self.config = config or MicroVMConfig()
        if not NAME_RE.match(name):
            raise InvalidSpec(f"backend name {name!r} must match {NAME_RE.pattern}", field="name")
        self.name = name
        self.id_prefix = id_prefix
        self.state_dir = Path(state_dir)
        self.run_dir = Path(run_dir).absolute() / name
        self.records_dir = self.state_dir / "sandboxes" / name
        self.records: RecordBook[MicroVMRecord] = RecordBook(self.records_dir)
        self.vms_dir = self.run_dir / "vm"
        self.sock_dir = Path("/run") / f"dsec-vm-{name}"
        """QMP and agent sockets (a unix socket's path must stay under 108 bytes)."""
        self.ram_dir = self.config.ram_dir or self.run_dir / "ram"
        self._own_ram_mount = self.config.ram_dir is None
        self._store = store
        self.cgroups = SandboxCgroups(name)
        self.swap = ZramSwap(name, self.config.zram_size, self.run_dir / "zram.json")
        self.capabilities = Capabilities(
            kind=self.kind,
            ops=frozenset({Capability.SANDBOXES, Capability.EXEC, Capability.SESSIONS, Capability.PTY,
                           Capability.FILES, Capability.PAUSE, Capability.FORK, Capability.NETWORK}),
            isolation=ISOLATION,
        )
        self.loop = VmLoop(name)
        self.net = NetworkManager(self.config.network, runtime=name, claims_dir=claims.claims_dir())
        """Every VM's network namespace (:mod:`dsec.backends.microvm.network`); used on the VM loop."""
        self.net.open_netns = self._netns_of
        self._sandboxes: dict[str, MicroVMRecord] = {}
        self._vms: dict[str, MicroVM] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._repairs: list[HostFinding] = []
        self._uids: set[int] = set()
        self.last_activity: dict[str, float] = {}
        self.reconciled: dict[str, builtins.list[str]] = {}
        self.accel: Accel = "tcg"
        self.accel_reason = ""
        self.guest: Any = None
        self.templates: TemplateStore | None = None
        self._qemu: Path | None = None
        self._qemu_build = ""
        self._firmware: Path | None = None
        self._tsc_khz: int | None = None
        self._started = False
        self._quiet_watch: Any = None
        self.quiet_stops = 0

    # ----- read-only views -----

    @property
    def sandboxes(self) -> Mapping[str, MicroVMRecord]:
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

    def facts(self) -> dict[str, Any]:
        """What the backend runs on (health, bench output): accelerator, QEMU, kernel."""
        return {"vm_accel": self.accel, "vm_accel_reason": self.accel_reason, "qemu": self._qemu_build,
                "kernel": getattr(self.guest, "kernel_version", ""), "templates": len(self.templates.all())
                if self.templates else 0}

    # ----- lifecycle -----

    async def __aenter__(self) -> MicroVMBackend:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> None:
        if self._started:
            return
        if os.geteuid() != 0:
            raise HostError("the microvm backend needs root (cgroups, QEMU as per-VM uids, a tmpfs for templates)")
        cfg = self.config
        self._qemu = host.find_qemu(cfg.qemu)
        qemu_img = host.find_qemu_img()
        self._firmware = host.find_firmware()
        self._qemu_build = await asyncio.to_thread(qemu_build, self._qemu)
        self._tsc_khz = host.tsc_khz()
        from dsec.backends.microvm.guest import DEFAULT_CACHE, ensure_guest

        self.guest = await asyncio.to_thread(ensure_guest, cfg.guest_cache or DEFAULT_CACHE, kernel=cfg.kernel,
                                             initrd=cfg.initrd)
        for d in (self.run_dir, self.records_dir, self.vms_dir, self.ram_dir, self.sock_dir,
                  self.state_dir / "templates" / self.name):
            d.mkdir(parents=True, exist_ok=True)
        os.chmod(self.vms_dir, 0o711)
        _check_traversable(self.vms_dir)
        if self._own_ram_mount and not _is_mount(self.ram_dir):
            await asyncio.to_thread(_mount_tmpfs, self.ram_dir, cfg.ram_dir_size_mib, self.name)
        os.chmod(self.ram_dir, 0o755)
        await asyncio.to_thread(self.cgroups.setup)
        if self.swap.size > 0:
            await asyncio.to_thread(self.swap.ensure)
        self.loop.start()
        await self.loop.call(self.net.start(prefill=self.config.network is not None))
        self.templates = TemplateStore(
            ram_dir=self.ram_dir, disk_dir=self.state_dir / "templates" / self.name, sock_dir=self.sock_dir, qemu_img=qemu_img,
            boot_timeout_s=cfg.boot_timeout_s, boot_attempts=cfg.boot_attempts, start_vm=self._start_template_vm,
            booted=MicroVM.wait_booted, run_as=(cfg.uid_base + cfg.max_vms, cfg.uid_base + cfg.max_vms),
            release_vm=self._release_template_vm)
        self.accel, self.accel_reason = await self._choose_accel()
        self._started = True
        if cfg.idle_stop_s is not None:
            self._quiet_watch = self.loop.submit(self._watch_quiet(cfg.idle_stop_s, cfg.idle_cpu_frac))
        try:
            self.reconciled = await self._reconcile()
        except BaseException:
            await self.close(destroy_all=False)
            raise

    async def close(self, *, destroy_all: bool = True) -> None:
        """Stop the backend. By default every sandbox is destroyed and the templates removed;
        ``destroy_all=False`` leaves the VMs running (and their templates, in the backend's
        tmpfs) for the next ``start()`` to adopt."""
        if not self._started and self.loop.loop is None:
            return
        if destroy_all:
            await asyncio.gather(*(self.destroy(i) for i in list(self._sandboxes)), return_exceptions=True)
            if self.templates is not None:
                await asyncio.to_thread(self.templates.clear_all)
        else:
            for vm in list(self._vms.values()):
                await self.loop.call(vm.detach())
            self._vms.clear()
            self._sandboxes.clear()
        if self._quiet_watch is not None:
            self._quiet_watch.cancel()
            self._quiet_watch = None
        if self.loop.loop is not None:
            with contextlib.suppress(Exception):
                await self.loop.call(self.net.close())
            if destroy_all and self.net.host_tables_made and not self._sandboxes:
                with contextlib.suppress(Exception):
                    await asyncio.to_thread(self.net.remove_host_rules)
        self.loop.stop()
        if destroy_all:
            await asyncio.to_thread(self.cgroups.remove_parents)
            if self.swap.find() is not None:
                with contextlib.suppress(HostError):
                    await asyncio.to_thread(self.swap.teardown)
            if self._own_ram_mount and _is_mount(self.ram_dir):
                await asyncio.to_thread(_umount, self.ram_dir)
            # sockets a killed QEMU could not take with it (the backend's own: no VM is left)
            await asyncio.to_thread(shutil.rmtree, self.sock_dir, True)
            for d in (self.vms_dir, self.ram_dir, self.state_dir / "templates" / self.name,
                      self.run_dir / "canary", self.run_dir):
                with contextlib.suppress(OSError):
                    d.rmdir()
        self._started = False

    async def _watch_quiet(self, idle_s: float, cpu_frac: float) -> None:
        """On the VM loop: stop VMs that are quiet (:meth:`MicroVM.stop_if_quiet`), once a second."""
        while True:
            await asyncio.sleep(1.0)
            now = time.monotonic()
            for sid, vm in list(self._vms.items()):
                rec = self._sandboxes.get(sid)
                if rec is None or rec.state is not SandboxState.RUNNING:
                    continue
                try:
                    if await vm.stop_if_quiet(idle_s, cpu_frac, now):
                        self.quiet_stops += 1
                        if self.config.idle_reclaim and self.swap.find() is not None:
                            # its memory to zram, as a pause does: it comes back as it is touched
                            await asyncio.to_thread(self._push_out, sid)
                except Exception as exc:  # a VM that died meanwhile: its watcher marks it failed
                    log.debug("microvm %s: quiet stop of %s: %s", self.name, sid, exc)

    async def _reconcile(self) -> dict[str, builtins.list[str]]:
        """What a previous run of the backend left. A VM whose QEMU still runs, whose template
        is still here and whose agent answers is adopted (its processes and files intact);
        everything else of it (a half-made create, a dead VM) is removed: QEMU, cgroups,
        directory, sockets, record."""
        import json

        assert self.templates is not None
        self.templates.adopt()
        adopted: list[str] = []
        destroyed: list[str] = []
        for path in list(self.records.files()):
            sid = path.stem
            try:
                rec = MicroVMRecord.from_json(json.loads(path.read_text()))
            except (OSError, ValueError, KeyError):
                path.unlink(missing_ok=True)
                continue
            tmpl = self.templates.get_ready(rec.template)
            alive = rec.qemu_pid > 0 and proc_start(rec.qemu_pid) == rec.qemu_start
            if alive and tmpl is not None and rec.state in (SandboxState.RUNNING, SandboxState.PAUSED):
                vm = MicroVM(sid, self.vms_dir / sid, Sockets.under(self.sock_dir, sid), tmpl, [],
                             uid=rec.uid, enter=lambda pid: None)
                self.cgroups.thaw(sid)  # a paused VM's QEMU is frozen: it must answer QMP to be adopted
                try:
                    await self.loop.call(vm.attach(rec.qemu_pid, rec.qemu_start,
                                                   paused=rec.state is SandboxState.PAUSED))
                    if rec.state is SandboxState.PAUSED:
                        self.cgroups.freeze(sid)
                except (HostError, OSError, TimeoutError) as exc:
                    log.warning("microvm %s: cannot adopt %s: %s", self.name, sid, exc)
                    await self.loop.call(vm.close())
                else:
                    vm.paused = rec.state is SandboxState.PAUSED
                    if rec.net is not None:
                        self.net.adopt(sid, rec.net, rec.current_policy())
                    vm.on_exit(lambda s=sid: self._vm_gone(s))  # type: ignore[misc]
                    self._vms[sid] = vm
                    self._sandboxes[sid] = rec
                    self._uids.add(rec.uid)
                    for d in rec.layers:
                        self.store.pin(d, self.holder)
                    self.records.event(rec, "adopted", qemu_pid=rec.qemu_pid)
                    adopted.append(sid)
                    continue
            if rec.qemu_pid > 0 and proc_start(rec.qemu_pid) == rec.qemu_start:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(rec.qemu_pid, 9)
            await self._remove_leftovers(sid)
            self.records.remove(sid)
            destroyed.append(sid)
        for sid in self.cgroups.existing() - set(self._sandboxes):
            await self._remove_leftovers(sid)  # made by a create that never saved its record
            destroyed.append(sid)
        keep = set(self._sandboxes)
        for where in (self.vms_dir, self.sock_dir):
            with contextlib.suppress(OSError):
                for e in os.scandir(where):
                    if e.name.split(".")[0] in keep:
                        continue
                    if e.is_dir(follow_symlinks=False):
                        shutil.rmtree(e.path, ignore_errors=True)
                    else:
                        os.unlink(e.path)
        return {"adopted": sorted(adopted), "destroyed": sorted(set(destroyed))}

    async def _remove_leftovers(self, sid: str) -> None:
        self.cgroups.kill_all(sid)
        await self.cgroups.remove(sid)
        shutil.rmtree(self.vms_dir / sid, ignore_errors=True)
        s = Sockets.under(self.sock_dir, sid)
        for p in (s.qmp, s.agent):
            p.unlink(missing_ok=True)

    async def _choose_accel(self) -> tuple[Accel, str]:
        want = self.config.accel
        if want == "tcg":
            return "tcg", "configured"
        if not host.kvm_usable():
            if want == "kvm":
                raise HostError("MicroVMConfig.accel='kvm' but /dev/kvm cannot be opened")
            return "tcg", "no usable /dev/kvm"
        ok, why = await self._kvm_canary_cached()
        if ok:
            return "kvm", "a canary VM booted under KVM"
        if want == "kvm":
            raise HostError(f"MicroVMConfig.accel='kvm' but a canary VM does not boot under KVM: {why}")
        return "tcg", f"a canary VM did not boot under KVM ({why})"

    async def _kvm_canary_cached(self) -> tuple[bool, str]:
        """The canary's verdict, kept for this boot of the host (it does not change until a
        reboot, a new QEMU or a new guest kernel): a restarted edge does not boot it again."""
        import json

        from dsec.backends.microvm.guest import DEFAULT_CACHE

        try:
            boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        except OSError:
            boot_id = ""
        key = f"{boot_id}|{self._qemu_build}|{self.guest.digest}"
        cache = (self.config.guest_cache or DEFAULT_CACHE) / "kvm-canary.json"
        with contextlib.suppress(OSError, ValueError):
            seen = json.loads(cache.read_text())
            if seen.get("key") == key:
                return bool(seen["ok"]), str(seen["why"])
        ok, why = await self.loop.call(self._kvm_canary())
        with contextlib.suppress(OSError):
            cache.write_text(json.dumps({"key": key, "ok": ok, "why": why}))
        return ok, why

    async def _kvm_canary(self) -> tuple[bool, str]:
        from dsec.backends.microvm.machine import qemu_argv

        m = self._machine(vcpus=1, memory_mib=128, layers=(), upper_bytes=0, accel="kvm")
        d = self.run_dir / "canary"
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir()
        sockets = Sockets.under(self.sock_dir, "canary")
        vm = QemuDriver(qemu_argv(m, [], sockets, ram=None, name="dsec-canary"), qmp_socket=sockets.qmp,
                        log=d / "qemu.log")
        try:
            await vm.start()
            await MicroVM.wait_booted(vm, sockets, 6.0)
            return True, ""
        except (VmDriverError, TimeoutError, HostError, OSError) as exc:
            return False, str(exc).splitlines()[0][:200]
        finally:
            await vm.quit(timeout_s=2.0)
            shutil.rmtree(d, ignore_errors=True)
            for p in (sockets.qmp, sockets.agent):
                p.unlink(missing_ok=True)

    # ----- machines -----

    def _machine(self, *, vcpus: int, memory_mib: int, layers: Sequence[str], upper_bytes: int,
                 accel: Accel | None = None, extra: tuple[tuple[str, str], ...] = ()) -> MachineSpec:
        assert self._qemu is not None and self._firmware is not None and self.guest is not None
        cmdline = BOOT_ARGS + (FAST_BOOT_ARGS if self.config.fast_boot else ())
        if self._tsc_khz and (accel or self.accel) == "tcg":
            cmdline += (f"tsc_early_khz={self._tsc_khz}",)
        return MachineSpec(qemu=self._qemu, qemu_build=self._qemu_build, firmware=self._firmware,
                           kernel=self.guest.vmlinux, initrd=self.guest.initrd, guest_digest=self.guest.digest,
                           accel=accel or self.accel, vcpus=vcpus, memory_mib=memory_mib,
                           tb_size_mib=self.config.tb_size_mib, cmdline=cmdline,
                           layer_digests=tuple(layers), upper_bytes=upper_bytes, extra=extra, net=True)

    async def _start_template_vm(self, label: str, argv: list[str], sockets: Any, logfile: Path) -> QemuDriver:
        cg = label
        await asyncio.to_thread(self.cgroups.make, cg)
        vm = QemuDriver(argv, qmp_socket=sockets.qmp, log=logfile, cgroup_enter=lambda pid: self.cgroups.enter(cg, pid))
        await vm.start()
        return vm

    async def _release_template_vm(self, label: str) -> None:
        await self.cgroups.remove(label)

    # ----- lookups -----

    def get(self, sandbox_id: str) -> MicroVMRecord:
        rec = self._sandboxes.get(sandbox_id)
        if rec is None:
            raise SandboxNotFound(f"no sandbox {sandbox_id!r} in the microvm backend {self.name}",
                                  sandbox_id=sandbox_id)
        return rec

    def list(self) -> builtins.list[MicroVMRecord]:
        return list(self._sandboxes.values())

    def update(self, sandbox_id: str, *, spec: SandboxSpec | None = None,
               edge: EdgeMeta | None = None) -> MicroVMRecord:
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

    def wake(self, sandbox_id: str) -> bool:
        """Resume a paused VM now (thaw QEMU, QMP ``cont``: ~1-2 ms, waited for here, as any
        request resumes a paused sandbox). A VM stopped for being quiet runs again at once
        (its ``cont`` is queued on the VM loop before anything the caller sends next)."""
        rec = self._sandboxes.get(sandbox_id)
        vm = self._vms.get(sandbox_id)
        if vm is None or rec is None:
            return False
        if rec.state is SandboxState.PAUSED:
            self._freeze(sandbox_id, False)
            try:
                self.loop.call_sync(vm.resume(freeze=lambda on: None), timeout=30)
            except Exception as exc:
                log.warning("microvm %s: waking %s failed: %s", self.name, sandbox_id, exc)
                return False
            self.records.move(rec, SandboxState.RUNNING)
            self.last_activity[sandbox_id] = time.monotonic()
            return True
        if rec.state is SandboxState.RUNNING:
            if vm.quiet_stopped:
                self.loop.submit(vm.ensure_running())
            else:
                vm.touch()
            return True
        return False

    async def _vm(self, sandbox_id: str) -> MicroVM:
        """The running VM of a sandbox (a paused one is resumed first)."""
        rec = self.get(sandbox_id)
        if rec.state is SandboxState.PAUSED:
            with contextlib.suppress(SandboxStateError):
                await self.resume(sandbox_id)
        if rec.state is not SandboxState.RUNNING:
            raise SandboxStateError(
                f"sandbox {sandbox_id} is {rec.state.value}, not running" + (f" ({rec.reason})" if rec.reason else ""),
                sandbox_id=sandbox_id, state=rec.state.value)
        vm = self._vms.get(sandbox_id)
        if vm is None or not vm.alive():
            self._vm_gone(sandbox_id)
            raise SandboxFailed(f"sandbox {sandbox_id}: its VM is gone ({rec.reason})", sandbox_id=sandbox_id,
                                reason="vm_exited")
        self.last_activity[sandbox_id] = time.monotonic()
        if vm.quiet_stopped:
            await self.loop.call(vm.ensure_running())
        else:
            vm.touch()
        return vm

    def _vm_gone(self, sandbox_id: str, why: str = "") -> None:
        rec = self._sandboxes.get(sandbox_id)
        vm = self._vms.get(sandbox_id)
        if rec is None or rec.state not in (SandboxState.RUNNING, SandboxState.PAUSED):
            return
        oom = self.cgroups.oom_kills(sandbox_id) > 0
        why = why or ("the host's memory limit of its QEMU process was exceeded" if oom
                      else "its QEMU process exited" + (f": {vm.driver.log_tail(300)}" if vm else ""))
        self.records.mark_failed(rec, why)

    # ----- layers -----

    def _layers_for(self, image: ImageRef) -> builtins.list[str]:
        """Digests to stack, top first (:func:`dsec.backends.common.layers.stack`)."""
        return stack_in_store(image, self.store, max_layers=MAX_LAYERS)

    # ----- create / destroy -----

    def _check_spec(self, spec: SandboxSpec) -> None:
        if spec.backend != self.kind:
            raise InvalidSpec(f"this spec is for the {spec.backend} backend, not {self.kind}", field="backend")
        check_spec(self.capabilities, spec)
        res = spec.resources
        if res.memory < self.config.min_memory_mib * MiB:
            raise InvalidSpec(f"memory {res.memory // MiB} MiB is below the microVM minimum of "
                              f"{self.config.min_memory_mib} MiB (MicroVMConfig.min_memory_mib): ask for more",
                              field="resources.memory")
        if math.ceil(res.cpu) > host.host_cpus():
            raise InvalidSpec(f"cpu {res.cpu:g} needs {math.ceil(res.cpu)} vCPUs; this host has {host.host_cpus()}",
                              field="resources.cpu")
        if res.disk_medium != "disk":
            raise InvalidSpec("a microVM's writable layer is its own disk: disk_medium must be 'disk'",
                              field="resources.disk_medium")

    def _new_id(self) -> str:
        return f"{self.id_prefix}-{secrets.token_hex(6)}"

    def _take_uid(self) -> int:
        base = self.config.uid_base
        for slot in range(self.config.max_vms):
            if base + slot not in self._uids:
                self._uids.add(base + slot)
                return base + slot
        raise SandboxFailed(f"the microvm backend {self.name} holds its maximum of {self.config.max_vms} VMs",
                            reason="capacity")

    async def create(self, spec: SandboxSpec, *, sandbox_id: str | None = None,
                     edge: EdgeMeta | None = None) -> MicroVMRecord:
        if not self._started:
            raise HostError("the microvm backend is not started: use `async with MicroVMBackend(...)` or await start()")
        self._check_spec(spec)
        sid = sandbox_id or self._new_id()
        if not ID_RE.match(sid):
            raise InvalidSpec(f"sandbox id {sid!r} must match {ID_RE.pattern}", field="sandbox_id")
        existing = self._sandboxes.get(sid)
        if existing is not None:
            return existing
        if spec.network is not None:  # bad names fail first, before anything is made
            await self.loop.call(self.net.compile(spec.network))
        layers = self._layers_for(spec.image)
        res = spec.resources
        rec = MicroVMRecord(sid, SandboxState.CREATING, spec, time.time(), edge=edge or EdgeMeta(), layers=layers,
                            vcpus=max(1, math.ceil(res.cpu)),
                            memory_mib=-(-res.memory // MiB) + self.config.guest_overhead_mib)
        self._sandboxes[sid] = rec
        lock = self._locks.setdefault(sid, asyncio.Lock())
        async with lock:
            try:
                self.records.save(rec)
                await self.loop.call(self._make(rec))
                self.records.move(rec, SandboxState.RUNNING)
                self.last_activity[sid] = time.monotonic()
                return rec
            except BaseException:
                await self.loop.call(self._teardown(rec))
                self._sandboxes.pop(sid, None)
                self._locks.pop(sid, None)
                raise

    async def _make(self, rec: MicroVMRecord) -> None:
        """On the VM loop: the template, then the clone."""
        assert self.templates is not None
        sid, res = rec.id, rec.spec.resources
        files = []
        for d in reversed(rec.layers):  # base first: disk dsec-l0 is the lowest layer
            files.append(await asyncio.to_thread(self.store.open_local, d))
            self.store.pin(d, self.holder)
        machine = self._machine(vcpus=rec.vcpus, memory_mib=rec.memory_mib, layers=tuple(reversed(rec.layers)),
                                upper_bytes=res.disk, extra=(("pids", str(res.pids)), ("mem", str(res.memory))))
        tmpl: Template = await self.templates.get(machine, files)
        rec.template = tmpl.key
        rec.uid = self._take_uid()
        vdir = self.vms_dir / sid
        await asyncio.to_thread(vdir.mkdir, 0o700, True, True)
        await asyncio.to_thread(self.cgroups.make, sid)
        await asyncio.to_thread(
            self.cgroups.limit, sid, memory_bytes=(rec.memory_mib + self.config.qemu_overhead_mib) * MiB,
            cpu=res.cpu, pids=64)
        vm = MicroVM(sid, vdir, Sockets.under(self.sock_dir, sid), tmpl, files, uid=rec.uid,
                     enter=lambda pid: self.cgroups.enter(sid, pid))
        self._vms[sid] = vm
        t0 = time.perf_counter()
        await self._restore_networked(rec, vm, rec.spec.network, warm=self.config.warm_up)
        rec.restore_s = time.perf_counter() - t0
        rec.qemu_pid = vm.driver.pid
        rec.qemu_start = proc_start(vm.driver.pid)
        vm.on_exit(lambda: self._vm_gone(sid))
        self.records.event(rec, "vm_restored", seconds=round(rec.restore_s, 6), template=tmpl.key, uid=rec.uid,
                           accel=self.accel)

    async def destroy(self, sandbox_id: str) -> bool:
        rec = self._sandboxes.get(sandbox_id)
        if rec is None:
            return False
        lock = self._locks.setdefault(sandbox_id, asyncio.Lock())
        async with lock:
            if sandbox_id not in self._sandboxes:
                return False
            if can_move(rec.state, SandboxState.STOPPING):
                self.records.move(rec, SandboxState.STOPPING, save=False)
            left = await self.loop.call(self._teardown(rec))
            if not left and can_move(rec.state, SandboxState.STOPPED):
                self.records.move(rec, SandboxState.STOPPED, save=False)
            self._sandboxes.pop(sandbox_id, None)
            self._locks.pop(sandbox_id, None)
            self.last_activity.pop(sandbox_id, None)
            if left:
                raise HostError(f"sandbox {sandbox_id}: could not remove {left}", sandbox_id=sandbox_id)
            return True

    async def _teardown(self, rec: MicroVMRecord) -> builtins.list[str]:
        """Kill the VM, remove its cgroups, directory (sockets, disk, log), uid and record.
        Safe on a half-made sandbox and on one whose VM died."""
        sid = rec.id
        left: list[str] = []
        vm = self._vms.pop(sid, None)
        # its network namespace, taken before QEMU (which holds it) goes: back to the pool
        netns = self._netns_of(sid) if rec.net is not None else None
        if vm is not None:
            await vm.close()
        elif rec.qemu_pid > 0 and proc_start(rec.qemu_pid) == rec.qemu_start:
            with contextlib.suppress(ProcessLookupError):
                os.kill(rec.qemu_pid, 9)
        if netns is not None:
            try:
                await asyncio.to_thread(close_tap, netns)
            except Exception as exc:
                log.debug("microvm %s: the network of %s: %s", self.name, sid, exc)
                os.close(netns)
                self.net.forget(sid)
            else:
                self.net.recycle(sid, netns)  # takes the fd
        else:
            self.net.forget(sid)
        left += [f"cgroup {p}" for p in await self.cgroups.remove(sid)]
        await asyncio.to_thread(shutil.rmtree, self.vms_dir / sid, True)
        for p in (Sockets.under(self.sock_dir, sid).qmp, Sockets.under(self.sock_dir, sid).agent):
            p.unlink(missing_ok=True)
        if (self.vms_dir / sid).exists():
            left.append(str(self.vms_dir / sid))
        self._uids.discard(rec.uid)
        for d in set(rec.layers):
            if not any(d in r.layers for r in self._sandboxes.values() if r.id != sid):
                with contextlib.suppress(Exception):
                    self.store.unpin(d, self.holder)
        if not left:
            self.records.remove(sid)
        return left

    # ----- commands, sessions, files -----

    async def exec(self, sandbox_id: str, cmd: str | Sequence[str], *, env: Mapping[str, str] | None = None,
                   cwd: str = "/", user: int | str = 0, stdin: bytes | None = None,
                   timeout: float | _Unset | None = UNSET, idle_timeout: float | None = None,
                   on_output: OutputCallback | None = None, output_cap: int | None = None,
                   pristine: Sequence[str] = ()) -> ExecResult:
        if pristine:
            raise self._unsupported("pristine paths")
        argv, limit = check_exec(cmd, timeout=timeout, idle_timeout=idle_timeout, output_cap=output_cap)
        rec = self.get(sandbox_id)
        cap = output_cap or rec.spec.output_cap
        if on_output is None:  # kept whole on the VM loop: no pipes, one hand-over each way
            vm = await self._vm(sandbox_id)
            got = await self.loop.call(vm.run(argv, env={**rec.spec.env, **(env or {})}, cwd=cwd, user=user,
                                              stdin=stdin, limit=limit, idle_timeout=idle_timeout, cap=cap))
            pid, latency = 0, 0.0
        else:  # streamed: the caller's callback runs on its own loop, fed through pipes
            proc, in_w, out_r, err_r = await start_piped(lambda i, o, e: self.start_process(
                sandbox_id, argv, stdin=i, stdout=o, stderr=e, env=env, cwd=cwd, user=user))
            got = await collect(proc, in_w, out_r, err_r, stdin, limit, idle_timeout, on_output, cap)
            pid, latency = proc.pid, proc.start_latency_s
        self.last_activity[sandbox_id] = time.monotonic()
        result = got.result(latency)
        result.limit = judge_vm(rec.spec.resources, got.exit, result, timeout_s=limit, idle_timeout_s=idle_timeout,
                                output_cap=cap)
        self.records.event(rec, "exec_ended", pid=pid, exit_code=result.exit_code, signal=result.signal,
                           duration_s=round(result.duration_s, 6), timed_out=result.timed_out,
                           output_truncated=result.truncated)
        check_timed_out(result, sandbox_id, limit=limit, idle_timeout=idle_timeout)
        return result

    async def start_process(self, sandbox_id: str, argv: Sequence[str], *, stdin: int, stdout: int, stderr: int,
                            env: Mapping[str, str] | None = None, cwd: str = "/", user: int | str = 0,
                            tty: TtySize | None = None) -> Any:
        rec = self.get(sandbox_id)
        vm = await self._vm(sandbox_id)
        return await self.loop.call(vm.start_process(argv, stdin=stdin, stdout=stdout, stderr=stderr,
                                                     env={**rec.spec.env, **(env or {})}, cwd=cwd, user=user,
                                                     caller=asyncio.get_running_loop(), tty=tty is not None,
                                                     size=(tty.rows, tty.cols) if tty else (24, 80)))

    async def start_tty(self, sandbox_id: str, argv: Sequence[str], *, size: TtySize,
                        env: Mapping[str, str] | None = None, cwd: str = "/",
                        user: int | str = 0) -> tuple[Any, int]:
        """``argv`` on a new pseudo-terminal in the guest (the agent's: the guest's line
        discipline, ^C and job control are the guest kernel's). The host side is a pty pair in
        raw mode that only carries bytes: the caller gets its master, as from a container;
        its size, set on that master, follows to the guest's pty."""
        master, slave = os.openpty()
        try:
            tty_mod.setraw(slave)
            set_tty_size(master, size)
            os.set_blocking(master, False)
            proc = await self.start_process(sandbox_id, argv, stdin=slave, stdout=slave, stderr=-1, env=env,
                                            cwd=cwd, user=user, tty=size)
        except BaseException:
            os.close(master)
            raise
        finally:
            os.close(slave)  # the bridge holds its own copies
        return proc, master

    async def open_session(self, sandbox_id: str, *, env: Mapping[str, str] | None = None,
                           cwd: str = "/", user: int | str = 0) -> ShellSession:
        from dsec.backends.common.sessions import Session
        from dsec.backends.microvm.sandbox import VmSessionHost

        rec = self.get(sandbox_id)
        await self._vm(sandbox_id)
        sess = Session(VmSessionHost(self, sandbox_id), sandbox_id, f"sess-{secrets.token_hex(4)}")
        await sess.start(env={**rec.spec.env, **(env or {})}, cwd=cwd, user=user)
        return sess

    def files(self, sandbox_id: str) -> Any:
        rec = self.get(sandbox_id)
        if rec.state is not SandboxState.RUNNING and rec.state is not SandboxState.PAUSED:
            raise SandboxStateError(f"sandbox {sandbox_id} is {rec.state.value}, not running",
                                    sandbox_id=sandbox_id, state=rec.state.value)
        from dsec.backends.microvm.files import VmFiles

        self.last_activity[sandbox_id] = time.monotonic()
        return VmFiles(self, sandbox_id)

    def usage(self, sandbox_id: str) -> Usage:
        rec = self.get(sandbox_id)
        return Usage(memory_bytes=self.cgroups.memory_bytes(rec.id), cpu_s=self.cgroups.cpu_s(rec.id),
                     pids=self.cgroups.host_tasks(rec.id), disk_bytes=_file_bytes(self.vms_dir / rec.id / "disk.qcow2"))

    # ----- fork -----

    async def fork(self, sandbox_id: str, children: int | Sequence[str], *, edges: Sequence[EdgeMeta] | None = None,
                   exclude: Sequence[str] = ()) -> builtins.list[MicroVMRecord]:
        """``children`` (a count, or their ids) VMs that continue from the parent's running
        machine at this instant: its memory (processes, open files, a shell's variables) and
        its disk, each with a fresh identity (hostname, machine-id, RNG, clock). The parent
        goes on (a paused one stays paused). ``exclude``: paths removed in the children."""
        parent = self.get(sandbox_id)
        if isinstance(children, int):
            if children < 1:
                raise InvalidSpec("fork: children must be at least 1", field="children")
            ids = [self._new_id() for _ in range(children)]
        else:
            ids = list(children)
            if not ids:
                raise InvalidSpec("fork: give at least one child id", field="children")
        for cid in ids:
            if not ID_RE.match(cid):
                raise InvalidSpec(f"child id {cid!r} must match {ID_RE.pattern}", field="children")
        if len(set(ids)) != len(ids) or any(cid in self._sandboxes for cid in ids):
            raise InvalidSpec("fork: a child id is repeated or names a sandbox that exists", field="children")
        if edges is not None and len(edges) != len(ids):
            raise InvalidSpec(f"fork: {len(edges)} edge parts for {len(ids)} children (one each)", field="edges")
        if parent.state not in (SandboxState.RUNNING, SandboxState.PAUSED):
            raise SandboxStateError(f"sandbox {sandbox_id} is {parent.state.value}: only a running or paused VM forks",
                                    sandbox_id=sandbox_id, state=parent.state.value)
        vm = self._vms[sandbox_id]
        tmpl = vm.template
        where = self.vms_dir / sandbox_id / f"fork-{secrets.token_hex(4)}"
        await asyncio.to_thread(where.mkdir, 0o700)
        paused = parent.state is SandboxState.PAUSED
        made: list[MicroVMRecord] = []
        t0 = time.perf_counter()
        try:
            async with self._locks.setdefault(sandbox_id, asyncio.Lock()):
                if paused:
                    self._freeze(sandbox_id, False)  # QEMU must answer QMP; its vCPUs stay stopped
                try:
                    point = await self.loop.call(vm.save_for_fork(where))
                finally:
                    if paused:
                        self._freeze(sandbox_id, True)
                    else:
                        await self.loop.call(vm.cont_after_save())
            saved_s = time.perf_counter() - t0

            async def one(i: int, cid: str) -> MicroVMRecord:
                rec = MicroVMRecord(cid, SandboxState.CREATING, parent.spec, time.time(),
                                    edge=(edges[i] if edges is not None else parent.edge), layers=list(parent.layers),
                                    vcpus=parent.vcpus, memory_mib=parent.memory_mib, stage=parent.stage)
                self._sandboxes[cid] = rec
                made.append(rec)
                self.records.save(rec)
                await self.loop.call(self._clone(rec, tmpl, point, exclude, parent.current_policy()))
                self.records.move(rec, SandboxState.RUNNING)
                self.records.event(rec, "forked", parent=sandbox_id, saved_s=round(saved_s, 6))
                self.last_activity[cid] = time.monotonic()
                return rec

            return list(await asyncio.gather(*(one(i, cid) for i, cid in enumerate(ids))))
        except BaseException:
            for rec in made:
                with contextlib.suppress(Exception):
                    await self.loop.call(self._teardown(rec))
                self._sandboxes.pop(rec.id, None)
            raise
        finally:
            await asyncio.to_thread(shutil.rmtree, where, True)

    async def _clone(self, rec: MicroVMRecord, tmpl: Template, point: Any, exclude: Sequence[str],
                     policy: NetworkPolicy | None) -> None:
        """On the VM loop: a fork's child from the parent's saved state (``policy``: the
        parent's, in force in the child from its first instruction)."""
        sid = rec.id
        rec.template = tmpl.key
        rec.uid = self._take_uid()
        for d in rec.layers:
            self.store.pin(d, self.holder)
        files = [await asyncio.to_thread(self.store.open_local, d) for d in reversed(rec.layers)]
        vdir = self.vms_dir / sid
        await asyncio.to_thread(vdir.mkdir, 0o700, True, True)
        await asyncio.to_thread(self.cgroups.make, sid)
        await asyncio.to_thread(self.cgroups.limit, sid, memory_bytes=(rec.memory_mib + self.config.qemu_overhead_mib) * MiB,
                                cpu=rec.spec.resources.cpu, pids=64)
        vm = MicroVM(sid, vdir, Sockets.under(self.sock_dir, sid), tmpl, files, uid=rec.uid,
                     enter=lambda pid: self.cgroups.enter(sid, pid))
        self._vms[sid] = vm
        await self._restore_networked(rec, vm, policy, fork_of=point)
        if exclude:
            await vm.forget_paths(exclude)
        rec.qemu_pid = vm.driver.pid
        rec.qemu_start = proc_start(vm.driver.pid)
        vm.on_exit(lambda: self._vm_gone(sid))

    # ----- pause -----

    async def pause(self, sandbox_id: str, *, reclaim: bool = True) -> PauseResult:
        rec = self.get(sandbox_id)
        if rec.state is not SandboxState.RUNNING:
            raise SandboxStateError(f"sandbox {sandbox_id} is {rec.state.value}, not running",
                                    sandbox_id=sandbox_id, state=rec.state.value)
        vm = self._vms[sandbox_id]
        out = await self.loop.call(vm.pause(reclaim=reclaim, freeze=lambda on: self._freeze(sandbox_id, on),
                                            push_out=lambda: self._push_out(sandbox_id)))
        self.records.move(rec, SandboxState.PAUSED)
        return out

    def _freeze(self, sandbox_id: str, on: bool) -> None:
        if on:
            self.cgroups.freeze(sandbox_id)
        else:
            self.cgroups.thaw(sandbox_id)

    def _push_out(self, sandbox_id: str) -> tuple[int, int]:
        """A paused VM's host memory (QEMU's heap, TCG's code cache, the guest's own pages)
        pushed out to swap through its memory cgroup; (bytes before, after). The template's
        pages it shares are not its charge."""
        from dsec.backends.common import cgroupfs

        mdir = self.cgroups.dir("memory", sandbox_id)
        before = self.cgroups.memory_bytes(sandbox_id)
        with contextlib.suppress(OSError):
            cgroupfs.write(mdir / "memory.swappiness", "100")
        last = before
        for _ in range(4):
            with contextlib.suppress(OSError):
                cgroupfs.read(mdir / "memory.stat")  # fresh LRU statistics for reclaim
            with contextlib.suppress(OSError):
                cgroupfs.write(mdir / "memory.force_empty", "0")
            now = self.cgroups.memory_bytes(sandbox_id)
            if last - now < 1 * MiB:
                break
            last = now
        return before, self.cgroups.memory_bytes(sandbox_id)

    async def resume(self, sandbox_id: str) -> MicroVMRecord:
        rec = self.get(sandbox_id)
        if rec.state is not SandboxState.PAUSED:
            raise SandboxStateError(f"sandbox {sandbox_id} is {rec.state.value}, not paused",
                                    sandbox_id=sandbox_id, state=rec.state.value)
        await self.loop.call(self._vms[sandbox_id].resume(freeze=lambda on: self._freeze(sandbox_id, on)))
        self.records.move(rec, SandboxState.RUNNING)
        self.last_activity[sandbox_id] = time.monotonic()
        return rec

    async def pause_many(self, sandbox_ids: Sequence[str], *, reclaim: bool = True) -> GroupOutcome:
        return await super().pause_many(sandbox_ids, reclaim=reclaim)

    # ----- limits -----

    def limit_baseline(self, rec: Any) -> Any:
        return None

    def limit_hit(self, rec: Any, before: Any, **kw: Any) -> Any:
        return None

    def check_limits(self, rec: Any) -> None:
        return None

    def disk_room(self, rec: Any) -> DiskRoom | None:
        return None

    def store_space(self) -> tuple[int, int] | None:
        return None

    # ----- network -----

    def _netns_of(self, sandbox_id: str) -> int | None:
        """An fd of a networked VM's namespace (its QEMU's); None when it is gone or has none."""
        rec = self._sandboxes.get(sandbox_id)
        if rec is None or rec.net is None or rec.qemu_pid <= 0 or proc_start(rec.qemu_pid) != rec.qemu_start:
            return None
        return qemu_netns(rec.qemu_pid)

    async def _restore_networked(self, rec: MicroVMRecord, vm: MicroVM, policy: NetworkPolicy | None,
                                 **restore: Any) -> None:
        """On the VM loop: a namespace from the node's pool, the guest's tap in it, ``policy``
        in force (or deny-all), then the VM restored with QEMU in that namespace. QEMU holds
        the namespace and the tap from then on; on failure the lease is given back."""
        sid = rec.id
        lease: Lease = await self.net.take()
        tap = -1
        try:
            tap = await asyncio.to_thread(open_tap, lease.fd)
            if policy is not None:
                await self.net.apply(sid, lease.fd, lease.info(), policy, fresh=True)
            else:
                self.net.adopt(sid, lease.info(), None)
            rec.net = {**lease.info(), "policy": None if policy is None else policy.model_dump(mode="json")}
            await vm.restore(hostname=sid, netns_fd=lease.fd, tap_fd=tap, **restore)
            rec.qemu_pid = vm.driver.pid
            rec.qemu_start = proc_start(vm.driver.pid)
        except BaseException:
            if sid in self.net.sandboxes:
                self.net.forget(sid)
            else:
                self.net.release(lease)
            rec.net = None
            raise
        finally:
            if tap >= 0:
                os.close(tap)
            os.close(lease.fd)  # QEMU holds the namespace now (or it goes with the failure)

    async def set_policy(self, sandbox_id: str, policy: NetworkPolicy | None) -> MicroVMRecord:
        """Replace a VM's network policy at once (one nftables transaction in its namespace);
        ``None``: nothing beyond loopback. Works while paused or stopped for being quiet."""
        rec = self.get(sandbox_id)
        if rec.state not in (SandboxState.RUNNING, SandboxState.PAUSED):
            raise SandboxStateError(f"sandbox {sandbox_id} is {rec.state.value}", sandbox_id=sandbox_id,
                                    state=rec.state.value)
        async with self._locks.setdefault(sandbox_id, asyncio.Lock()):
            cut = await self.loop.call(self._set_policy(rec, policy))
        dumped = None if policy is None else policy.model_dump(mode="json")
        self.records.save(rec)
        self.records.event(rec, "policy_changed", policy=dumped, connections_cut=cut)
        return rec

    async def _set_policy(self, rec: MicroVMRecord, policy: NetworkPolicy | None) -> int:
        compiled = None if policy is None else await self.net.compile(policy)
        fd = self._netns_of(rec.id)
        if fd is None or rec.net is None:
            raise SandboxFailed(f"sandbox {rec.id}: its VM (and network namespace) is gone", sandbox_id=rec.id,
                                reason="vm_exited")
        try:
            cut = await self.net.apply(rec.id, fd, rec.net, policy, compiled=compiled)
        finally:
            os.close(fd)
        rec.net = {**rec.net, "policy": None if policy is None else policy.model_dump(mode="json")}
        # The guest's own connections the new policy forbids: cut in the guest, as the host's
        # SOCK_DESTROY does for a container (its connections are the guest kernel's). A paused
        # VM's are cut at its next packet (the forward chain resets it).
        vm = self._vms.get(rec.id)
        if vm is not None and rec.state is SandboxState.RUNNING and vm.agent is not None:
            allow = []
            for e in compiled or []:
                lo, _, hi = e.ports.partition("-")
                allow.append((e.cidr, e.proto, int(lo), int(hi or lo)))
            try:
                await vm.ensure_running()
                cut += await vm.agent.netcut(allow)
            except (HostError, InvalidSpec) as exc:
                log.warning("microvm %s: cutting the connections of %s: %s", self.name, rec.id, exc)
        return cut

    def network_info(self, sandbox_id: str) -> NetworkFacts | None:
        """Address, policy and refused-packet counts; None when no policy is in force (the VM
        then reaches nothing beyond its loopback)."""
        rec = self.get(sandbox_id)
        if rec.net is None or rec.net.get("policy") is None:
            return None
        st = self.net.sandboxes.get(sandbox_id)
        return {"ip": rec.net.get("ip"), "ifname": rec.net.get("ifname"), "gateway": self.net.gateway,
                "policy": rec.net.get("policy"), "denied_packets": st.denied_seen if st else 0,
                "denied_recent": list(st.denied_recent) if st else []}

    async def collect_denied(self) -> dict[str, int]:
        """Read every VM's refused-packet counter; a ``net_denied`` event where it grew."""
        return await self.loop.call(self._collect_denied())

    async def _collect_denied(self) -> dict[str, int]:
        grown: dict[str, int] = {}
        for sid, st in list(self.net.sandboxes.items()):
            rec = self._sandboxes.get(sid)
            if rec is None or rec.state not in (SandboxState.RUNNING, SandboxState.PAUSED):
                continue
            fd = self._netns_of(sid)
            if fd is None:
                continue
            try:
                total, dests = await self.net.denied(sid, fd)
            except Exception:
                continue
            finally:
                os.close(fd)
            st.denied_recent = dests[-16:]
            if total > st.denied_seen:
                grown[sid], st.denied_seen = total - st.denied_seen, total
                self.records.event(rec, "net_denied", count=grown[sid], total=total, destinations=dests[-16:])
        return grown

    async def heal(self, *, repair: bool = True) -> builtins.list[HostFinding]:
        found: list[HostFinding] = []
        for sid, rec in list(self._sandboxes.items()):
            vm = self._vms.get(sid)
            if rec.state in (SandboxState.RUNNING, SandboxState.PAUSED) and (vm is None or not vm.alive()):
                self._vm_gone(sid)
                found.append(HostFinding("vm_exited", f"sandbox {sid}: its QEMU process is gone", False))
        return found


def judge_vm(res: Any, ex: Any, result: ExecResult, *, timeout_s: float | None, idle_timeout_s: float | None,
             output_cap: int) -> Any:
    """Which limit ended a command in a VM, from the guest kernel's evidence the agent sends
    with its exit (OOM kills in its cgroup, forks refused at the pids limit, the disk's room)."""
    disk = None
    if ex.disk_free >= 0:
        full = ex.disk_free < limit_evidence.DISK_FULL_BYTES or ex.inodes_free == 0
        disk = DiskRoom(ex.disk_free, ex.inodes_free, full)
    return limit_evidence.judge(
        res, exit_code=result.exit_code, sig=result.signal, timed_out=result.timed_out, timeout_s=timeout_s,
        idle_timeout_s=idle_timeout_s, truncated=result.truncated, output_cap=output_cap,
        before=limit_evidence.Baseline(limit_evidence.Counters(0, 0)),
        after=limit_evidence.Counters(ex.oom_kills, ex.pids_hits), disk=disk,
        output=(result.stderr, result.stdout))


def _file_bytes(path: Path) -> int:
    try:
        return path.stat().st_blocks * 512
    except OSError:
        return 0


def _check_traversable(path: Path) -> None:
    """Each VM's QEMU runs as a uid of its own and opens its disk (in ``path``/<sandbox>)
    again when it starts: every directory above must let others pass (x)."""
    for d in [path, *path.parents]:
        if not os.stat(d).st_mode & 0o001:
            raise HostError(f"{d} is not searchable by other users (mode {oct(os.stat(d).st_mode & 0o777)}): the "
                            f"microVMs' QEMU processes (unprivileged uids) open their disks under {path}; "
                            f"`chmod o+x {d}` or choose a run directory under one that is (e.g. /run/dsec)")


def _is_mount(path: Path) -> bool:
    return os.path.ismount(path)


def _mount_tmpfs(path: Path, size_mib: int, name: str) -> None:
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mib}m,mode=0755", f"dsec-vmram-{name}", str(path)],
                   check=True, capture_output=True)


def _umount(path: Path) -> None:
    subprocess.run(["umount", "-l", str(path)], check=False, capture_output=True)
