"""Templates: a microVM booted once per machine, saved, and restored by every create.

A template is a VM cold-booted with its RAM in a file on tmpfs (``share=on``), run until its
agent answers, then saved with ``x-ignore-shared``: the state file holds device state only
(~70 KB) and the RAM file *is* the memory. A clone maps that file copy-on-write
(``share=off``): it starts in ~40 ms whatever the guest's RAM size, and every clone shares the
template's pages until it writes them. Its writable disk is a qcow2 overlay over the
template's upper disk, copied from an empty overlay made once (a file copy, no process).
Disk and RAM are from the same instant (the VM is stopped and its I/O drained when saved).

One template per :meth:`MachineSpec.template_key` (QEMU build, kernel and initramfs digests,
accelerator, vCPUs, RAM, layers, disk size, ...): a machine that differs in any of them never
restores another's template. Templates are made on first use, one at a time per key, and
removed when the backend closes (their RAM is in the backend's own tmpfs).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import subprocess
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from dsec.backends.microvm.machine import Disk, MachineSpec, RamFile, Sockets, qemu_argv
from dsec.backends.microvm.qemu import QemuDriver, VmDriverError
from dsec.errors import HostError, SandboxFailed

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Template:
    key: str
    machine: MachineSpec
    ram: Path
    state: Path
    upper: Path
    """The template's upper disk (raw ext4): the backing file of every clone's overlay."""
    overlay_seed: Path
    """An empty qcow2 overlay over ``upper``: a clone's disk is a copy of it."""
    boot_s: float
    save_s: float
    attempts: int


Booted = Callable[[QemuDriver, Sockets, float], Awaitable[None]]
"""Waits until a freshly started VM's agent answers (raises past the deadline)."""


def make_ext4(path: Path, size: int, *, label: str = "dsec-upper") -> None:
    """A sparse file holding an empty ext4 of ``size`` bytes (no journal: a sandbox's upper is
    disposable, and a snapshot stops the VM first)."""
    with open(path, "wb") as f:
        f.truncate(size)
    try:
        subprocess.run(["mkfs.ext4", "-q", "-F", "-L", label, "-O", "^has_journal", "-m", "0",
                        "-E", "lazy_itable_init=1,root_owner=0:0", str(path)],
                       check=True, capture_output=True, timeout=60)
    except subprocess.CalledProcessError as exc:
        raise HostError(f"mkfs.ext4 of {path} failed: {exc.stderr.decode(errors='replace').strip()}") from None


def make_overlay(qemu_img: Path, base: Path, out: Path) -> None:
    try:
        subprocess.run([str(qemu_img), "create", "-q", "-f", "qcow2", "-F", "raw", "-b", str(base), str(out)],
                       check=True, capture_output=True, timeout=30)
    except subprocess.CalledProcessError as exc:
        raise HostError(f"qemu-img create {out} failed: {exc.stderr.decode(errors='replace').strip()}") from None


class TemplateStore:
    """The backend's templates, by key. ``ram_dir`` is a tmpfs; ``disk_dir`` is on disk."""

    def __init__(self, *, ram_dir: Path, disk_dir: Path, sock_dir: Path, qemu_img: Path, boot_timeout_s: float,
                 boot_attempts: int, start_vm: Callable[[str, list[str], Sockets, Path], Awaitable[QemuDriver]],
                 booted: Booted, run_as: tuple[int, int] | None,
                 release_vm: Callable[[str], Awaitable[None]] | None = None) -> None:
        self.ram_dir = ram_dir
        self.disk_dir = disk_dir
        self.sock_dir = sock_dir
        self.qemu_img = qemu_img
        self.boot_timeout_s = boot_timeout_s
        self.boot_attempts = boot_attempts
        self._start_vm = start_vm
        self._booted = booted
        self.run_as = run_as
        self._release_vm = release_vm
        self._templates: dict[str, Template] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self.builds = 0
        self.failed_boots = 0

    def get_ready(self, key: str) -> Template | None:
        return self._templates.get(key)

    def all(self) -> list[Template]:
        return list(self._templates.values())

    async def get(self, machine: MachineSpec, layers: Sequence[Path]) -> Template:
        key = machine.template_key()
        t = self._templates.get(key)
        if t is not None:
            return t
        async with self._locks.setdefault(key, asyncio.Lock()):
            t = self._templates.get(key)
            if t is None:
                t = await self._build(key, machine, layers)
                self._templates[key] = t
            return t

    async def _build(self, key: str, machine: MachineSpec, layers: Sequence[Path]) -> Template:
        ddir = self.disk_dir / key
        await asyncio.to_thread(self._clear, key)
        await asyncio.to_thread(ddir.mkdir, 0o755, True, True)
        upper = ddir / "upper.raw"
        await asyncio.to_thread(make_ext4, upper, machine.upper_bytes)
        ram = self.ram_dir / f"{key}.ram"
        state = self.ram_dir / f"{key}.state"
        disks = [*(Disk(p, f"dsec-l{i}") for i, p in enumerate(layers)), Disk(upper, "dsec-up", readonly=False)]
        sockets = Sockets.under(self.sock_dir, f"t-{key[:16]}")
        last: Exception | None = None
        for attempt in range(1, self.boot_attempts + 1):
            for p in (sockets.qmp, sockets.agent, ram):
                p.unlink(missing_ok=True)
            argv = qemu_argv(machine, disks, sockets, ram=RamFile(ram, shared=True), name=f"dsec-tmpl-{key[:12]}",
                             run_as=self.run_as)
            t0 = time.perf_counter()
            label = f"tmpl-{key[:12]}"
            try:
                vm = await self._start_vm(label, argv, sockets, ddir / "qemu.log")
            except (VmDriverError, HostError, OSError) as exc:
                last = exc
                self.failed_boots += 1
                await self._release(label)
                continue
            try:
                await self._booted(vm, sockets, self.boot_timeout_s)
                boot_s = time.perf_counter() - t0
                save_s = await vm.save(state, ignore_shared=True)
            except (VmDriverError, TimeoutError, HostError, OSError) as exc:
                last = exc
                self.failed_boots += 1
                log.warning("microvm template %s: boot attempt %d of %d failed: %s", key[:12], attempt,
                            self.boot_attempts, exc)
                await vm.quit(timeout_s=2.0)
                await self._release(label)
                continue
            await vm.quit(timeout_s=5.0)
            await self._release(label)
            for p in (sockets.qmp, sockets.agent):
                p.unlink(missing_ok=True)
            seed = ddir / "overlay.qcow2"
            await asyncio.to_thread(make_overlay, self.qemu_img, upper, seed)
            os.chmod(upper, 0o444)  # the base of every clone: never written again
            for p in (state, ram):
                os.chmod(p, 0o444)
            meta = {"key": key, "made_at": time.time(), "boot_s": boot_s, "save_s": save_s, "attempts": attempt,
                    "machine": machine.to_json(), "layers": [str(p) for p in layers]}
            (ddir / "template.json").write_text(json.dumps(meta, indent=1))
            self.builds += 1
            return Template(key, machine, ram, state, upper, seed, boot_s, save_s, attempt)
        await asyncio.to_thread(self._clear, key)
        for p in (sockets.qmp, sockets.agent):
            p.unlink(missing_ok=True)
        raise SandboxFailed(f"the microVM template did not boot in {self.boot_attempts} attempts "
                            f"({self.boot_timeout_s:g} s each): {last}", reason="boot")

    def adopt(self) -> list[str]:
        """Templates a previous run of the backend made whose RAM and state are still here
        (the tmpfs outlives the backend's process): kept, so the VMs cloned from them can be
        adopted and more cloned. Others are removed. The keys adopted."""
        kept = []
        with contextlib.suppress(OSError):
            for e in os.scandir(self.disk_dir):
                key = e.name
                try:
                    meta = json.loads((Path(e.path) / "template.json").read_text())
                    machine = MachineSpec.from_json(meta["machine"])
                except (OSError, ValueError, KeyError, TypeError):
                    self._clear(key)
                    continue
                t = Template(key, machine, self.ram_dir / f"{key}.ram", self.ram_dir / f"{key}.state",
                             Path(e.path) / "upper.raw", Path(e.path) / "overlay.qcow2", float(meta["boot_s"]),
                             float(meta["save_s"]), int(meta["attempts"]))
                if machine.template_key() != key or not all(p.exists() for p in (t.ram, t.state, t.upper,
                                                                                  t.overlay_seed)):
                    self._clear(key)
                    continue
                self._templates[key] = t
                kept.append(key)
        return kept

    async def _release(self, label: str) -> None:
        if self._release_vm is not None:
            await self._release_vm(label)

    def _clear(self, key: str) -> None:
        for p in (self.ram_dir / f"{key}.ram", self.ram_dir / f"{key}.state"):
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
        shutil.rmtree(self.disk_dir / key, ignore_errors=True)

    def clear_all(self) -> None:
        for key in list(self._templates):
            self._clear(key)
        self._templates.clear()
        with contextlib.suppress(OSError):
            for e in os.scandir(self.disk_dir):
                shutil.rmtree(e.path, ignore_errors=True)
