"""Writable layers on the node's disk: one btrfs filesystem per runtime, one subvolume per sandbox.

A sandbox's upper (``Resources.disk_medium="disk"``) is a btrfs subvolume named after
the sandbox, under a hard quota of ``Resources.disk`` bytes (a simple-quota qgroup
limit: writes past it fail with EDQUOT). Its file data is ordinary page cache,
reclaimable and written back to disk, so a sandbox with 128 MiB of memory can write
gigabytes; its memory limit covers memory only.

Why btrfs subvolumes (measured here, docs/RUNTIME.md "Writable layer on disk"): a
subvolume is a directory of one shared filesystem, so it adds no superblock (and no
memory-cgroup shrinker) per sandbox, unlike a loop-mounted ext4 image per sandbox;
create 0.05 ms, quota 0.003 ms, delete 0.02 ms (the space returns in the background,
in the btrfs cleaner). This kernel has no ext4/xfs project quotas.

The filesystem is the runtime's own: a sparse image file in the state directory
(``<state>/uppers/<runtime>.img``), attached to a loop device in direct-I/O mode (no
double caching) and mounted at ``<run>/<runtime>/uppers``; or an existing btrfs mount
given by the operator. Everything is named after the runtime, so two runtimes on one
host never share it, and a restarted runtime finds its mount, its loop device and its
sandboxes' subvolumes by name.

This module only touches that filesystem; it never blocks the event loop (callers
run it in threads) and never deletes a subvolume it did not name.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import shutil
import struct
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from dsec.errors import HostError

GiB: Final = 1 << 30
DEFAULT_IMAGE_FRACTION: Final = 0.8
"""A new image is sized to this share of the free space of the disk it lives on (sparse)."""
MIN_IMAGE_SIZE: Final = 1 * GiB


def _ioc(direction: int, nr: int, size: int) -> int:
    return (direction << 30) | (size << 16) | (0x94 << 8) | nr


_W, _R, _RW = 1, 2, 3
_SUBVOL_CREATE: Final = _ioc(_W, 14, 4096)
_SNAP_DESTROY: Final = _ioc(_W, 15, 4096)
_INO_LOOKUP: Final = _ioc(_RW, 18, 4096)
_QUOTA_CTL: Final = _ioc(_RW, 40, 16)
_START_SYNC: Final = _ioc(_R, 24, 8)
_WAIT_SYNC: Final = _ioc(_W, 22, 8)
_QGROUP_LIMIT: Final = _ioc(_R, 43, 48)
_QUOTA_CTL_ENABLE: Final = 1
_QUOTA_CTL_ENABLE_SIMPLE: Final = 4
_LIMIT_MAX_RFER: Final = 1
_FIRST_FREE_OBJECTID: Final = 256
_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")


def _vol_args(name: str) -> bytearray:
    return bytearray(struct.pack("q4088s", 0, name.encode()))


def subvolume_id(fd: int) -> int:
    """The id of the subvolume an open fd lies in."""
    buf = bytearray(struct.pack("QQ4080s", 0, _FIRST_FREE_OBJECTID, b""))
    fcntl.ioctl(fd, _INO_LOOKUP, buf)
    return int(struct.unpack_from("Q", buf)[0])


@dataclass(frozen=True, slots=True)
class UpperUsage:
    used: int
    """Bytes the sandbox's writable layer holds (data and its metadata)."""
    limit: int
    """Its quota in bytes."""

    @property
    def free(self) -> int:
        return max(0, self.limit - self.used)


class UpperStoreError(HostError):
    """The node cannot keep writable layers on disk (say why and how to fix it)."""


class UpperStore:
    """The runtime's btrfs filesystem for writable layers (see the module docstring)."""

    def __init__(self, name: str, *, mountpoint: Path, image: Path | None, image_size: int = 0) -> None:
        """``image`` None: ``mountpoint`` must already be a btrfs mount (the operator's).
        ``image_size`` 0: size a new image at 80 % of its disk's free space."""
        self.name = name
        self.mountpoint = mountpoint
        self.image = image
        self.image_size = image_size
        self.quota_mode = ""
        """"simple" (squota: extents charged to the subvolume that wrote them) or "full"."""
        self._fsid = ""
        self._root_fd = -1
        self._ids: dict[str, int] = {}
        """Subvolume id per sandbox (read once: usage is read after every exec)."""
        self._made_mount = False

    # ----- the filesystem -----

    @property
    def ready(self) -> bool:
        return self._root_fd >= 0

    def setup(self) -> None:
        """Mount (or adopt) the filesystem and enable quotas. Idempotent."""
        if self.ready:
            return
        if not _btrfs_in_kernel():
            raise UpperStoreError(
                "writable layers on disk need btrfs, which this kernel does not offer "
                "(/proc/filesystems); use Resources(disk_medium='memory') for tmpfs layers"
            )
        if not _is_btrfs_mount(self.mountpoint):
            if self.image is None:
                raise UpperStoreError(
                    f"{self.mountpoint} is not a btrfs mount; mount one there, or let the runtime make "
                    "its own image (leave the uppers path unset)"
                )
            self._attach_and_mount()
        fd = os.open(self.mountpoint, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            self._fsid = _fsid(self.mountpoint)
            self.quota_mode = _quota_mode(self._fsid) or _enable_quota(fd)
        except BaseException:
            os.close(fd)
            raise
        self._root_fd = fd

    def _attach_and_mount(self) -> None:
        assert self.image is not None
        self.image.parent.mkdir(parents=True, exist_ok=True)
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        if not self.image.exists():
            size = self.image_size or _default_size(self.image.parent)
            mkfs = shutil.which("mkfs.btrfs")
            if mkfs is None:
                raise UpperStoreError(
                    "mkfs.btrfs is missing: install btrfs-progs (apt-get install btrfs-progs; "
                    "scripts/setup.sh does), or use Resources(disk_medium='memory')"
                )
            tmp = self.image.with_suffix(".new")
            with open(tmp, "wb") as f:
                f.truncate(size)
            _run([mkfs, "-q", "-f", "-L", f"dsec-{self.name}"[:255], "-m", "single", str(tmp)], "format")
            os.replace(tmp, self.image)
        loop = _loop_of(self.image) or _run(
            ["losetup", "--direct-io=on", "--find", "--show", str(self.image)], "attach a loop device"
        ).strip()
        try:
            _run(["mount", "-t", "btrfs", "-o", "noatime,nosuid,nodev,discard=async", loop,
                  str(self.mountpoint)], "mount")
        except UpperStoreError:
            with contextlib.suppress(UpperStoreError):
                _run(["losetup", "-d", loop], "detach")
            raise
        self._made_mount = True

    def close(self, *, unmount: bool) -> None:
        """Let go of the filesystem; with ``unmount``, unmount it and detach its loop device
        (sandboxes still running keep it alive until they end)."""
        if self._root_fd >= 0:
            os.close(self._root_fd)
            self._root_fd = -1
        if not unmount or self.image is None or not _is_btrfs_mount(self.mountpoint):
            return
        loop = _loop_of(self.image)
        with contextlib.suppress(UpperStoreError):
            _run(["umount", str(self.mountpoint)], "unmount")
        if loop:
            with contextlib.suppress(UpperStoreError):
                _run(["losetup", "-d", loop], "detach")
            # A device still open (the last sandboxes' mount namespaces are being torn down)
            # is only marked to detach when released: wait for that, briefly.
            backing = Path("/sys/block") / os.path.basename(loop) / "loop" / "backing_file"
            deadline = time.monotonic() + 10
            while backing.exists() and time.monotonic() < deadline:
                time.sleep(0.02)

    def mounted(self) -> bool:
        """The store is (still) mounted at its mountpoint: two stats. False once someone
        unmounted it (lazily: the runtime's open root keeps the filesystem alive)."""
        if self._root_fd < 0:
            return False
        try:
            return os.stat(self.mountpoint).st_dev == os.fstat(self._root_fd).st_dev
        except OSError:
            return False

    def remount(self) -> None:
        """Mount the store at its mountpoint again after someone unmounted it. The open root
        (and every sandbox's layer) stays as it is: the same filesystem is mounted once more."""
        if self.mounted():
            return
        if self.image is None:
            raise UpperStoreError(f"{self.mountpoint} is not mounted any more: mount its btrfs filesystem there again")
        if not self.image.exists():
            raise UpperStoreError(f"its image {self.image} was deleted: restart the edge (disk-medium sandboxes "
                                  "cannot be made until then)")
        loop = _loop_of(self.image)
        if not loop:
            raise UpperStoreError(f"the loop device of {self.image} is gone: restart the edge")
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        _run(["mount", "-t", "btrfs", "-o", "noatime,nosuid,nodev,discard=async", loop, str(self.mountpoint)], "mount")

    def _root(self) -> int:
        if self._root_fd < 0:
            raise UpperStoreError("the writable-layer store is not set up (UpperStore.setup())")
        return self._root_fd

    # ----- per sandbox -----

    def path(self, sandbox_id: str) -> Path:
        return self.mountpoint / sandbox_id

    def create(self, sandbox_id: str, *, quota: int, uid: int) -> Path:
        """A subvolume for the sandbox, with ``upper`` (owned by ``uid``), ``work`` and
        ``shm`` (/dev/shm, sticky, owned by ``uid``) inside, limited to ``quota`` bytes."""
        if not _NAME_RE.match(sandbox_id):
            raise ValueError(f"bad sandbox id {sandbox_id!r}")
        root = self._root()
        try:
            fcntl.ioctl(root, _SUBVOL_CREATE, _vol_args(sandbox_id))
        except FileExistsError:
            self.destroy(sandbox_id)  # a leftover of a crash: start clean
            fcntl.ioctl(root, _SUBVOL_CREATE, _vol_args(sandbox_id))
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise UpperStoreError(f"the writable-layer store {self.mountpoint} is full") from None
            raise
        path = self.path(sandbox_id)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            buf = bytearray(struct.pack("QQQQQQ", 0, _LIMIT_MAX_RFER, quota, 0, 0, 0))
            fcntl.ioctl(fd, _QGROUP_LIMIT, buf)
            os.mkdir("upper", 0o755, dir_fd=fd)
            os.chown("upper", uid, uid, dir_fd=fd)
            os.mkdir("work", 0o700, dir_fd=fd)
            os.mkdir("shm", 0o1777, dir_fd=fd)
            os.chmod("shm", 0o1777, dir_fd=fd)
            os.chown("shm", uid, uid, dir_fd=fd)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                self.destroy(sandbox_id)
            raise
        os.close(fd)
        return path

    def destroy(self, sandbox_id: str) -> bool:
        """Delete the sandbox's subvolume (its space returns in the background). False if absent.
        Safe while a dying sandbox still holds it: the kernel frees it after the last user."""
        if not _NAME_RE.match(sandbox_id):
            return False
        self._ids.pop(sandbox_id, None)
        try:
            fcntl.ioctl(self._root(), _SNAP_DESTROY, _vol_args(sandbox_id))
        except FileNotFoundError:
            return False
        except OSError as exc:
            if exc.errno == errno.ENOTDIR:
                return False
            raise
        return True

    def names(self) -> list[str]:
        """Subvolumes present (sandbox ids), for the reconciler."""
        with contextlib.suppress(FileNotFoundError):
            return [n for n in os.listdir(self.mountpoint) if _NAME_RE.match(n)]
        return []

    def usage(self, sandbox_id: str, *, fd: int | None = None) -> UpperUsage:
        """What the sandbox's writable layer holds and may hold (from its qgroup)."""
        sub = self._ids.get(sandbox_id)
        if sub is None:
            own = os.open(self.path(sandbox_id), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC) if fd is None else -1
            try:
                sub = subvolume_id(fd if fd is not None else own)
            finally:
                if own >= 0:
                    os.close(own)
            self._ids[sandbox_id] = sub
        base = Path(f"/sys/fs/btrfs/{self._fsid}/qgroups/0_{sub}")
        # What the kernel checks the limit against: committed extents plus what writes not
        # yet committed (page cache, the running transaction) have reserved.
        used = sum(int((base / f).read_text())
                   for f in ("referenced", "rsv_data", "rsv_meta_pertrans", "rsv_meta_prealloc"))
        limit = int((base / "max_referenced").read_text())
        return UpperUsage(used=used, limit=limit)

    def commit(self) -> None:
        """Commit the running transaction (no data writeback): qgroup figures are updated at
        commits, so after an ``rm`` a layer reads full until the next one (~30 s by default).
        Callers use it only when a layer looks full."""
        buf = bytearray(8)
        fcntl.ioctl(self._root(), _START_SYNC, buf)
        fcntl.ioctl(self._root(), _WAIT_SYNC, buf)

    def space(self) -> tuple[int, int]:
        """(free, total) bytes of the store, as the kernel sees it (and, for an image, no
        more than the disk under the image can still hold)."""
        st = os.statvfs(self.mountpoint)
        free, total = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
        if self.image is not None:
            host = os.statvfs(self.image.parent)
            allocated = os.stat(self.image).st_blocks * 512
            # The sparse image grows into its disk: what the disk has left caps what the store has.
            free = min(free, host.f_bavail * host.f_frsize + max(0, total - free - allocated))
        return free, total


def _run(argv: list[str], what: str) -> str:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise UpperStoreError(f"writable-layer store: {what} failed: {exc}") from None
    if out.returncode != 0:
        raise UpperStoreError(f"writable-layer store: {what} failed: {' '.join(argv)}: {out.stderr.strip()}")
    return out.stdout


def _btrfs_in_kernel() -> bool:
    try:
        with open("/proc/filesystems") as f:
            return any(line.split()[-1] == "btrfs" for line in f if line.strip())
    except OSError:
        return False


def _mount_at(path: Path) -> tuple[str, str]:
    """(filesystem type, source device) of the mount at ``path``; ("", "") if none."""
    from dsec.images.sysmount import mountinfo

    want = os.path.realpath(path)
    on_top = [m for m in mountinfo() if m.mount_point == want]
    return (on_top[-1].fstype, on_top[-1].source) if on_top else ("", "")  # the last is on top


def _is_btrfs_mount(path: Path) -> bool:
    return _mount_at(path)[0] == "btrfs"


def _fsid(path: Path) -> str:
    out = _run(["findmnt", "-n", "-o", "UUID", "--target", str(path)], "read the filesystem id").strip()
    if out and Path(f"/sys/fs/btrfs/{out}").is_dir():
        return out
    for d in Path("/sys/fs/btrfs").iterdir():  # findmnt may not know a loop device's UUID
        if (d / "label").exists() and d.name != "features":
            with contextlib.suppress(OSError):
                dev = next((d / "devices").iterdir()).name
                if os.path.basename(_mount_at(path)[1]) == dev:
                    return d.name
    raise UpperStoreError(f"cannot find the btrfs id of {path} under /sys/fs/btrfs")


def _quota_mode(fsid: str) -> str:
    """The quota mode already in force ("" when quotas are off)."""
    try:
        mode = Path(f"/sys/fs/btrfs/{fsid}/qgroups/mode").read_text().strip()
    except OSError:
        return ""
    return "simple" if mode == "squota" else "full"


def _enable_quota(fd: int) -> str:
    """Simple quotas where the kernel has them (6.7+: no backref walks), else full qgroups."""
    for cmd, mode in ((_QUOTA_CTL_ENABLE_SIMPLE, "simple"), (_QUOTA_CTL_ENABLE, "full")):
        try:
            fcntl.ioctl(fd, _QUOTA_CTL, bytearray(struct.pack("QQ", cmd, 0)))
            return mode
        except OSError as exc:
            if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                raise UpperStoreError(f"cannot enable btrfs quotas: {exc}") from None
    raise UpperStoreError("this kernel's btrfs refuses quotas")


def _loop_of(image: Path) -> str:
    """The loop device the image is attached to, if any."""
    out = subprocess.run(["losetup", "-n", "-O", "NAME", "-j", str(image)], capture_output=True, text=True)
    lines = out.stdout.split()
    return lines[0] if lines else ""


def _default_size(directory: Path) -> int:
    st = os.statvfs(directory)
    return max(MIN_IMAGE_SIZE, int(st.f_bavail * st.f_frsize * DEFAULT_IMAGE_FRACTION))
