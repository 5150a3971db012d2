"""The microVM backend's part of an edge's configuration (``EdgeConfig.backends``).

Pure data: no I/O, nothing imported beyond pydantic. The backend itself
(:mod:`dsec.backends.microvm.backend`) is imported only when an edge runs it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from dsec.backends.common.netconfig import NetworkConfig

if TYPE_CHECKING:
    from dsec.backends import BackendContext
    from dsec.backends.base import Backend


class MicroVMConfig(BaseModel):
    """Sandboxes in QEMU microVMs: each has its own kernel (docs/MICROVM.md)."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["microvm"] = "microvm"
    network: NetworkConfig | None = None
    """Sandbox networking, as a container's (named permissions, always-blocked ranges, the
    prepared-namespace pool; docs/EDGE.md): every VM's QEMU runs in its sandbox's namespace
    and its NIC is a tap there (docs/MICROVM.md, "Network"). None: the defaults (no named
    permissions; a policy's own rules still apply)."""
    qemu: Path | None = None
    """``qemu-system-x86_64``; None: on PATH (QEMU 10 from bookworm-backports; scripts/setup.sh)."""
    kernel: Path | None = None
    """The guest kernel (an uncompressed ``vmlinux`` with the PVH note); None: Debian's cloud
    kernel from bookworm-backports, fetched and prepared by scripts/setup.sh."""
    initrd: Path | None = None
    """The guest's initramfs holding DSec's init and agent; None: built from the kernel's modules."""
    guest_cache: Path | None = None
    """Where the prepared kernel and initramfs are kept (shared by the node's backends); None:
    ``/var/lib/dsec/cache/microvm``."""
    accel: Literal["auto", "tcg", "kvm"] = "auto"
    """``auto``: KVM when a canary VM boots under it at start, else TCG (the edge's health and
    every bench key say which: ``vm_accel``)."""
    tb_size_mib: Annotated[int, Field(ge=8, le=1024)] = 32
    """TCG's translated-code cache per VM (MiB): memory per VM against re-translation. Measured
    (docs/PERFORMANCE.md): 32 holds the warmed-up code, and a pooled VM answers its first
    command in ~50 ms (idle clones ~45 MiB each at N = 171); 16 gives ~38 MiB at N = 300 but
    evicts it, and the first command takes ~120 ms."""
    fast_boot: bool = True
    """Skip kernel initcalls a sandbox does not need (machine.FAST_BOOT_ARGS): ~0.8 s of a cold boot."""
    qemu_overhead_mib: Annotated[int, Field(ge=32)] = 160
    """Host memory allowed to a VM beyond its guest RAM (QEMU itself, TCG's code cache, device
    buffers): the QEMU process's memory cgroup is the guest's RAM plus this."""
    guest_overhead_mib: Annotated[int, Field(ge=32)] = 80
    """Guest RAM beyond the sandbox's memory limit, for the guest's kernel and agent (~40 MiB of
    a 128 MiB guest are the kernel's own): a VM's RAM is ``Resources.memory`` plus this, and its
    processes are held to ``Resources.memory`` by a cgroup inside the guest, as in a container."""
    min_memory_mib: Annotated[int, Field(ge=8)] = 16
    """The smallest memory limit a sandbox may ask for (its processes' share of the guest)."""
    boot_timeout_s: Annotated[float, Field(gt=0)] = 20.0
    """A cold boot's deadline (spawn to the agent's hello); past it the boot is retried."""
    boot_attempts: Annotated[int, Field(ge=1, le=5)] = 3
    """Cold boots tried before a create fails (about 1 boot in 40 hangs under TCG)."""
    ram_dir: Path | None = None
    """A tmpfs for templates' RAM files; None: the backend mounts its own under its run directory."""
    ram_dir_size_mib: Annotated[int, Field(ge=256)] = 8192
    """Size of the backend's own tmpfs for templates' RAM (pages are used only as touched)."""
    idle_stop_s: Annotated[float, Field(gt=0)] | None = None
    """Stop quiet VMs: a running VM with no command, session or terminal open, that nothing
    reached for this long and whose QEMU used under ``idle_cpu_frac`` of a core meanwhile, is
    stopped (QMP ``stop``) until the next call, which runs it again first (~1 ms): an idle
    clone then costs no CPU (under TCG an idle guest costs ~1 % of a core). While stopped
    its clock stands still: a background job's timers wait, and the guest's clock is behind
    by the time stopped (not yet stepped on resume). None (default): never."""
    idle_cpu_frac: Annotated[float, Field(gt=0, le=1)] = 0.02
    idle_reclaim: bool = True
    """A VM stopped for being quiet also has its host memory pushed to the node's zram swap
    (``zram_size``), as a pause does; it comes back page by page as the VM runs again."""
    warm_up: bool = True
    """Run one short command (``sh -c :``) in each new VM before it is handed out: under TCG a
    clone translates the guest's code afresh and its first command pays ~200 ms for it; a
    warm pool then hands out VMs whose first command answers in milliseconds."""
    zram_size: Annotated[int, Field(ge=0)] = 0
    """Bytes of compressed RAM swap (zram) set up at start, where a paused VM's host memory
    (QEMU's heap, TCG's code cache, the pages the guest wrote) goes; 0: none (a pause then
    stops and freezes the VM but returns little memory)."""
    uid_base: Annotated[int, Field(ge=1000)] = 720_000
    """QEMU runs as ``uid_base + slot`` (one uid per VM: no VM can signal or trace another)."""
    max_vms: Annotated[int, Field(ge=1, le=60_000)] = 4096

    def build(self, ctx: BackendContext) -> Backend:
        """The microVM backend this config describes (not yet started)."""
        from dsec.backends.microvm import build_backend  # the backend's own code, imported now

        return build_backend(self, ctx)
