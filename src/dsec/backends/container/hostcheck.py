"""Checks that this host can run container sandboxes, with fixes in the messages."""

from __future__ import annotations

import os
from pathlib import Path

from dsec.errors import HostError


def _filesystems() -> set[str]:
    try:
        return {line.split()[-1] for line in Path("/proc/filesystems").read_text().splitlines() if line.strip()}
    except OSError:
        return set()


def check_host() -> None:
    problems: list[str] = []
    if os.geteuid() != 0:
        problems.append("the node runtime must run as root (it creates namespaces, mounts and cgroups)")
    fs = _filesystems()
    for need in ("overlay", "erofs", "tmpfs", "proc", "devpts"):
        if need not in fs:
            problems.append(f"kernel filesystem {need!r} is not available (modprobe {need})")
    for ns in ("user", "mnt", "pid", "net", "ipc", "uts", "cgroup"):
        if not Path(f"/proc/self/ns/{ns}").exists():
            problems.append(f"kernel lacks {ns} namespaces")
    max_userns = Path("/proc/sys/user/max_user_namespaces")
    if max_userns.exists() and max_userns.read_text().strip() == "0":
        problems.append("user namespaces are disabled: sysctl -w user.max_user_namespaces=100000")
    if problems:
        raise HostError("this host cannot run DSec container sandboxes:\n- " + "\n- ".join(problems), problems=problems)


def features() -> dict[str, int]:
    """Optional kernel features, for reports: ``landlock_abi`` (0: none; stages with file
    rules then fail with HostError, everything else works)."""
    from dsec.backends.container.stages import landlock_abi

    return {"landlock_abi": landlock_abi()}
