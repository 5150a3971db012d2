"""A microVM's machine, as data: what QEMU is asked to run, and the command line that asks it.

Pure data: no I/O. :func:`qemu_argv` is the one place that writes a QEMU command line, so a
template and its clones are started from the same facts (a clone differs only in how its RAM
is mapped and in ``-incoming``). :meth:`MachineSpec.template_key` names every fact a saved
template depends on: a template restored into a machine that differs in any of them is
refused and rebuilt, never restored into garbage.

The settings come from the probe on this machine kind (docs/MICROVM.md, VM-PROBE.md §1): the
stock ``microvm`` machine with SeaBIOS crashes 9 boots in 10, qboot with
``x-option-roms=off,isa-serial=off`` boots every time; ``rtc=off`` costs 2 s with Debian's
kernel and ``pit=off,pic=off`` hangs under TCG, so both stay on.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

Accel = Literal["tcg", "kvm"]

BOOT_ARGS: tuple[str, ...] = (
    "console=hvc0", "quiet", "panic=-1", "reboot=t",
)
"""The kernel command line every microVM gets (the console is the virtio console: no UART)."""

FAST_BOOT_ARGS: tuple[str, ...] = (
    # initcalls the probe measured at 20-120 ms each that a sandbox's kernel does not need
    "initcall_blacklist=load_system_certificate_list,jent_mod_init,bpf_tcp_ca_kfunc_init,"
    "bpf_dummy_struct_ops_init,bert_init,init_encrypted,lockup_detector_check,trace_eval_init,"
    "crypto_kdf108_init",
    "cryptomgr.notests", "ipv6.disable=1", "audit=0", "tsc=reliable", "init_on_alloc=0",
)
"""Boot-time trims (``MicroVMConfig.fast_boot``): ~0.8 s of a 2 s cold boot under TCG. They
do not weaken isolation from the host (the guest is the sandbox); module signatures are not
checked (Debian does not enforce them without lockdown)."""


@dataclass(frozen=True, slots=True)
class Disk:
    """A virtio-blk disk; the guest finds it by ``serial`` (``dsec-l0``.. layers, ``dsec-up``)."""

    path: Path
    serial: str
    readonly: bool = True
    format: Literal["raw", "qcow2"] = "raw"


@dataclass(frozen=True, slots=True)
class MachineSpec:
    """One microVM's machine. Everything here but the disks' paths is part of its template key."""

    qemu: Path
    qemu_build: str
    """``qemu-system-x86_64 --version`` and the binary's size and mtime: a template saved by one
    build is never restored by another."""
    firmware: Path
    kernel: Path
    initrd: Path
    guest_digest: str
    """The kernel's and initrd's content digest (:mod:`dsec.backends.microvm.guest`)."""
    accel: Accel
    vcpus: int
    memory_mib: int
    tb_size_mib: int = 32
    cmdline: tuple[str, ...] = BOOT_ARGS
    layer_digests: tuple[str, ...] = ()
    """The image's layers, base first (the disks ``dsec-l0``.. in that order)."""
    upper_bytes: int = 0
    """The writable disk's size (the sandbox's disk quota)."""
    extra: tuple[tuple[str, str], ...] = field(default_factory=tuple)
    """Guest settings passed on the kernel command line as ``dsec.<key>=<value>``."""
    net: bool = False
    """A virtio-net NIC (:mod:`dsec.backends.microvm.network`): its template boots with it on
    an empty hub; a clone's is the tap in its sandbox's namespace."""

    def append(self) -> str:
        return " ".join([*self.cmdline, *(f"dsec.{k}={v}" for k, v in self.extra)])

    def to_json(self) -> dict[str, object]:
        return {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(self).items()}

    @classmethod
    def from_json(cls, d: dict[str, object]) -> MachineSpec:
        kw: dict[str, object] = dict(d)
        for k in ("qemu", "firmware", "kernel", "initrd"):
            kw[k] = Path(str(kw[k]))
        kw["cmdline"] = tuple(kw["cmdline"])  # type: ignore[arg-type]
        kw["layer_digests"] = tuple(kw["layer_digests"])  # type: ignore[arg-type]
        kw["extra"] = tuple(tuple(x) for x in kw["extra"])  # type: ignore[attr-defined]
        return cls(**kw)  # type: ignore[arg-type]

    def template_key(self) -> str:
        """A digest of every fact a template depends on (paths excluded: content is named
        by digests and the QEMU build)."""
        doc = asdict(self)
        for k in ("qemu", "firmware", "kernel", "initrd"):
            doc[k] = str(doc[k]) if k in ("qemu", "firmware") else None
        raw = json.dumps(doc, sort_keys=True, separators=(",", ":"), default=str)
        return hashlib.sha256(raw.encode()).hexdigest()[:32]


@dataclass(frozen=True, slots=True)
class RamFile:
    """Guest RAM in a file (tmpfs): ``shared`` for a template (its pages are the file's),
    else a clone's copy-on-write mapping of the template's file. ``path`` None: anonymous RAM
    under the same object id (a fork's child: its RAM comes whole from the parent's state)."""

    path: Path | None
    shared: bool


SOCKET_PATH_MAX = 107
"""sun_path holds 108 bytes with its NUL."""


@dataclass(frozen=True, slots=True)
class Sockets:
    """A VM's two unix sockets (QEMU listens on both): QMP, and the agent's chardev."""

    qmp: Path
    agent: Path

    @classmethod
    def under(cls, directory: Path, label: str) -> Sockets:
        """``<directory>/<label>.qmp`` and ``.agent``; HostError when the path is too long for a
        unix socket (keep the backend's socket directory short: it is under /run)."""
        from dsec.errors import HostError

        s = cls(qmp=directory / f"{label}.qmp", agent=directory / f"{label}.agent")
        if len(str(s.agent).encode()) > SOCKET_PATH_MAX:
            raise HostError(f"socket path {s.agent} is longer than {SOCKET_PATH_MAX} bytes: use a shorter "
                            "backend name or run directory")
        return s


def qemu_argv(m: MachineSpec, disks: Sequence[Disk], sockets: Sockets, *, ram: RamFile | None,
              incoming: bool = False, name: str = "dsec-vm", run_as: tuple[int, int] | None = None,
              confine: bool = True, tap_fd: int | None = None) -> list[str]:
    """The command line of one microVM. ``incoming``: start stopped, waiting for a restore
    (``migrate-incoming``). ``run_as``: QEMU drops to this uid:gid once its files are open.
    ``confine``: QEMU's seccomp filter (no new processes, no privilege changes, no obsolete
    system calls, no resource-control calls). ``tap_fd``: the NIC's tap (QEMU inherits the
    fd); without it a machine with ``net`` has its NIC on a hub with nothing else (a template).
    Neither offers a virtio-net header (the tap is made without ``IFF_VNET_HDR``): the NIC's
    features are the same on both, so a clone restores what its template negotiated."""
    machine = "microvm,x-option-roms=off,isa-serial=off,pic=on,rtc=on"
    accel = "kvm" if m.accel == "kvm" else f"tcg,thread=single,tb-size={m.tb_size_mib}"
    argv = [
        str(m.qemu), "-name", f"{name},debug-threads=off",
        "-M", machine, "-accel", accel, "-cpu", "host" if m.accel == "kvm" else "max",
        "-smp", str(m.vcpus), "-m", f"{m.memory_mib}M",
        "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
        "-bios", str(m.firmware),
        "-kernel", str(m.kernel), "-initrd", str(m.initrd), "-append", m.append(),
        "-device", "virtio-serial-device",
        "-chardev", f"socket,id=agent,path={sockets.agent},server=on,wait=off",
        "-device", "virtserialport,chardev=agent,name=dsec.agent",
        "-device", "virtio-rng-device",
        "-qmp", f"unix:{sockets.qmp},server=on,wait=off",
    ]
    if ram is not None and ram.path is None:
        argv += ["-object", f"memory-backend-ram,id=ram,size={m.memory_mib}M", "-machine", "memory-backend=ram"]
    elif ram is not None:
        opts = "share=on" if ram.shared else "share=off,readonly=on,rom=off"
        argv += ["-object", f"memory-backend-file,id=ram,size={m.memory_mib}M,mem-path={ram.path},{opts}",
                 "-machine", "memory-backend=ram"]
    if m.net:
        from dsec.backends.microvm.network import GUEST_MAC

        backend = "hubport,id=n0,hubid=0" if tap_fd is None else f"tap,id=n0,fd={tap_fd}"
        argv += ["-netdev", backend, "-device", f"virtio-net-device,netdev=n0,mac={GUEST_MAC}"]
    for i, d in enumerate(disks):
        # a writable disk is the sandbox's own and disposable: the guest's flushes are not
        # waited for (the host's page cache holds its writes; a snapshot freezes the guest first)
        mode = ",readonly=on" if d.readonly else ",cache=unsafe"
        argv += ["-drive", f"if=none,id=d{i},file={d.path},format={d.format}{mode}",
                 "-device", f"virtio-blk-device,drive=d{i},serial={d.serial}"]
    if incoming:
        argv += ["-incoming", "defer"]
    if run_as is not None:
        argv += ["-run-with", f"user={run_as[0]}:{run_as[1]}"]
    if confine:
        # elevateprivileges stays allowed only when QEMU must drop to run_as itself (its
        # seccomp filter is installed before -run-with user=); once dropped, no capability is
        # left to regain, so set*id calls cannot raise it again
        priv = "allow" if run_as is not None else "deny"
        argv += ["-sandbox", f"on,obsolete=deny,elevateprivileges={priv},spawn=deny,resourcecontrol=deny"]
    return argv
