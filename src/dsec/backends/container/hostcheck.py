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


INOTIFY_INSTANCES = 1 << 16
"""The host's fs.inotify.max_user_instances at least (tune_inotify)."""


def tune_inotify(path: Path = Path("/proc/sys/fs/inotify/max_user_instances")) -> int | None:
    """Raise the host's inotify instance limit to :data:`INOTIFY_INSTANCES` when it is lower;
    returns the value set (None: left as it was).

    Every sandbox's user namespace is made by host root, and the kernel charges an inotify
    instance made anywhere below it to every level up to the host's: to host root's own 128
    (Debian's default), shared by all sandboxes and by the host's root daemons. One sandbox
    (or one FnCall call) holding 128 instances took inotify from every other sandbox on the
    node. The kernel accounts each instance's memory to its cgroup, and a sandbox's open
    files bound how many it holds: the host-wide count is not the bound that matters."""
    try:
        current = int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    if current >= INOTIFY_INSTANCES:
        return None
    try:
        path.write_text(str(INOTIFY_INSTANCES))
    except OSError:
        return None
    return INOTIFY_INSTANCES
