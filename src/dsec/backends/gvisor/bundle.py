"""A gVisor sandbox's OCI bundle: its root filesystem on the host and its config.json.

Layout, all named after the backend and the sandbox (``<run>`` is ``<run_dir>/<name>``):

- ``<run>/sb/<id>/``          the bundle directory (``config.json``)
- ``<run>/sb/<id>/upper``     a tmpfs of ``Resources.disk`` bytes (``disk_medium="memory"``)
  holding ``upper/`` and ``work/``; on disk they are a btrfs subvolume instead
- ``<run>/sb/<id>/rootfs``    overlayfs: the shared read-only EROFS layers under that upper,
  mounted ``nosuid,nodev`` (what the sandbox writes lands here, in our upper: runsc runs
  with ``--overlay2=none``)

:func:`oci_spec` is pure; the mount functions are blocking syscalls (callers run them in
threads). Nothing here starts a process.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import stat
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

from dsec.images import sysmount
from dsec.spec import Resources

CFS_PERIOD_US: Final = 100_000
CAPABILITIES: Final = (
    # Docker's default set without NET_RAW (no network) and MKNOD: what root inside a
    # sandbox expects for package installs and chown'ing its files. Never SYS_ADMIN,
    # SYS_RESOURCE (it would lift RLIMIT_NPROC, the sandbox's process limit) or SYS_PTRACE.
    "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FOWNER", "CAP_FSETID", "CAP_KILL", "CAP_SETGID", "CAP_SETUID",
    "CAP_SETPCAP", "CAP_SETFCAP", "CAP_NET_BIND_SERVICE", "CAP_SYS_CHROOT", "CAP_AUDIT_WRITE",
)
INIT_ARGV: Final = ("dsec-gvexec", "init")
"""The container's pid 1: our helper, loaded from a host fd (``runsc run --exec-fd``)."""
OVERLAY_OPTIONS: Final = "redirect_dir=off,metacopy=off,index=off,xino=off"


def oci_spec(*, hostname: str, rootfs: Path, env: Mapping[str, str], res: Resources, cgroups_path: str,
             host_pids: int, bind_tmp: bool) -> dict[str, Any]:
    """The container's config.json. ``host_pids`` bounds the host tasks of the sandbox (its
    pids cgroup); the sandbox's own processes are bounded by RLIMIT_NPROC = ``res.pids``,
    which gVisor enforces inside (for root too: no CAP_SYS_RESOURCE)."""
    caps = list(CAPABILITIES)
    mounts: list[dict[str, Any]] = [
        {"destination": "/proc", "type": "proc", "source": "proc"},
        {"destination": "/dev", "type": "tmpfs", "source": "tmpfs"},
        {"destination": "/sys", "type": "sysfs", "source": "sysfs", "options": ["nosuid", "noexec", "nodev", "ro"]},
    ]
    if bind_tmp:
        # runsc mounts a tmpfs of its own over an empty /tmp (in sentry memory, out of our
        # upper's quota and of the files API's sight). Mounting the upper's /tmp there
        # explicitly keeps /tmp in the writable layer like every other path.
        mounts.append({"destination": "/tmp", "type": "bind", "source": str(rootfs / "tmp"),
                       "options": ["rbind", "rw", "nosuid", "nodev"]})
    return {
        "ociVersion": "1.0.2",
        "process": {
            "terminal": False,
            "user": {"uid": 0, "gid": 0},
            "args": list(INIT_ARGV),
            "env": [f"{k}={v}" for k, v in env.items()],
            "cwd": "/",
            "capabilities": {k: caps for k in ("bounding", "effective", "permitted")},
            "rlimits": [
                {"type": "RLIMIT_NOFILE", "hard": res.nofile, "soft": res.nofile},
                {"type": "RLIMIT_NPROC", "hard": res.pids, "soft": res.pids},
            ],
            "noNewPrivileges": True,
        },
        "root": {"path": str(rootfs), "readonly": False},
        "hostname": hostname,
        "mounts": mounts,
        "linux": {
            "namespaces": [{"type": t} for t in ("pid", "network", "ipc", "uts", "mount")],
            "cgroupsPath": cgroups_path,
            "resources": {
                # swap = limit: memory+swap capped at the limit (the sandbox is not swapped out behind its back)
                "memory": {"limit": res.memory, "swap": res.memory},
                "cpu": {"shares": res.cpu_weight, "quota": int(res.cpu * CFS_PERIOD_US), "period": CFS_PERIOD_US},
                "pids": {"limit": host_pids},
            },
        },
    }


def write_spec(bundle: Path, spec: Mapping[str, Any]) -> None:
    tmp = bundle / "config.json.tmp"
    tmp.write_text(json.dumps(spec))
    os.replace(tmp, bundle / "config.json")


def _is_mount(path: Path) -> bool:
    target = os.fspath(path)
    return any(m.mount_point == target for m in sysmount.mountinfo())


def make_tmpfs_upper(upper_mount: Path, size: int) -> Path:
    """A tmpfs of ``size`` bytes with ``upper/`` and ``work/`` (the memory medium)."""
    upper_mount.mkdir(mode=0o700, parents=True, exist_ok=True)
    inodes = max(16384, size // 8192)
    sysmount.mount("dsec-gvisor-upper", os.fspath(upper_mount), "tmpfs",
                   sysmount.MS_NOSUID | sysmount.MS_NODEV, f"size={size},nr_inodes={inodes},mode=0700")
    (upper_mount / "upper").mkdir(mode=0o755)
    (upper_mount / "work").mkdir(mode=0o700)
    return upper_mount


def mount_rootfs(rootfs: Path, lowers: Sequence[Path], upper_dir: Path) -> bool:
    """The sandbox's root: overlayfs of ``lowers`` (top first) under ``upper_dir``/upper.
    Returns whether ``/tmp`` may be bound from it (a real directory, made if missing: never
    a symlink, whose target runsc would resolve on the host)."""
    for p in (rootfs, *lowers, upper_dir):
        if any(c in os.fspath(p) for c in ",:\\\n "):
            raise ValueError(f"{p} must not contain , : \\ or spaces (it goes into overlayfs options)")
    rootfs.mkdir(mode=0o755, parents=True, exist_ok=True)
    data = (f"lowerdir={':'.join(map(os.fspath, lowers))},upperdir={upper_dir / 'upper'},"
            f"workdir={upper_dir / 'work'},{OVERLAY_OPTIONS}")
    sysmount.mount("dsec-gvisor-root", os.fspath(rootfs), "overlay", sysmount.MS_NOSUID | sysmount.MS_NODEV, data)
    tmp = rootfs / "tmp"
    try:
        st = os.lstat(tmp)
    except FileNotFoundError:
        os.mkdir(tmp, 0o1777)
        os.chmod(tmp, 0o1777)
        return True
    return stat.S_ISDIR(st.st_mode)


def unmount(path: Path) -> bool:
    """Unmount everything at ``path`` (lazily when busy); False if something stays mounted."""
    for _ in range(8):
        if not _is_mount(path):
            return True
        try:
            sysmount.umount(os.fspath(path))
        except OSError as exc:
            if exc.errno == errno.EINVAL:
                return True
            if exc.errno == errno.EBUSY:
                with contextlib.suppress(OSError):
                    sysmount.umount(os.fspath(path), sysmount.MNT_DETACH)
            elif exc.errno != errno.ENOENT:
                raise
    return not _is_mount(path)


def remove_bundle(bundle: Path) -> list[str]:
    """Unmount the root and the tmpfs upper and delete the bundle directory; what is left."""
    left = []
    for mp in (bundle / "rootfs", bundle / "upper"):
        if not unmount(mp):
            left.append(f"mount {mp}")
    if not left:
        shutil.rmtree(bundle, ignore_errors=True)
        if bundle.exists():
            left.append(f"directory {bundle}")
    return left
