"""What a microVM needs of its host: QEMU and its firmware, the TSC rate, the accelerator.

Read-only probes of the host, each in one small function. Nothing here starts a VM except
:func:`kvm_boots` (the canary), which the backend calls once at start when ``/dev/kvm`` exists.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from dsec.errors import HostError

FIRMWARE_DIRS = (Path("/usr/share/qemu"), Path("/usr/share/seabios"))


def find_qemu(configured: Path | None) -> Path:
    if configured is not None:
        if not os.access(configured, os.X_OK):
            raise HostError(f"MicroVMConfig.qemu={configured} is not an executable file")
        return configured
    found = shutil.which("qemu-system-x86_64")
    if found is None:
        raise HostError("qemu-system-x86_64 is not installed: install qemu-system-x86 and qemu-utils from "
                        "bookworm-backports (QEMU 10; scripts/setup.sh does), or set MicroVMConfig.qemu")
    return Path(found)


def find_qemu_img() -> Path:
    found = shutil.which("qemu-img")
    if found is None:
        raise HostError("qemu-img is not installed: install qemu-utils from bookworm-backports (scripts/setup.sh does)")
    return Path(found)


def find_firmware(name: str = "qboot.rom") -> Path:
    """qboot (qemu-system-data): the probe's only firmware that boots every time under TCG."""
    for d in FIRMWARE_DIRS:
        if (d / name).is_file():
            return d / name
    raise HostError(f"QEMU's firmware {name} is missing (package qemu-system-data 10 from bookworm-backports)")


def tsc_khz() -> int | None:
    """The host's TSC rate in kHz, when the CPU says it is constant and known.

    Under TCG the guest's TSC is the host's, so the guest kernel is told its rate
    (``tsc_early_khz=``): on a loaded host its own calibration against the PIT fails and the
    boot hangs ("Unable to calibrate against PIT", seen here with the load average at 4)."""
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read(65536)
    except OSError:
        return None
    flags: set[str] = set()
    mhz = None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "flags" and not flags:
            flags = set(value.split())
        elif key == "cpu MHz" and mhz is None:
            try:
                mhz = float(value)
            except ValueError:
                return None
    if mhz is None or not {"constant_tsc", "nonstop_tsc"} <= flags:
        return None
    return round(mhz * 1000)


def kvm_usable() -> bool:
    """``/dev/kvm`` exists and opens (whether a guest boots under it is :func:`kvm_boots`'s question)."""
    try:
        fd = os.open("/dev/kvm", os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return False
    os.close(fd)
    return True


def host_cpus() -> int:
    return len(os.sched_getaffinity(0))
