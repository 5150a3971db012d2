"""The node's /dev skeleton and empty directory: what every sandbox binds read-only."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def make_skeletons(skel: Path) -> None:
    """The node's /dev skeleton and empty directory, on a small tmpfs of the runtime's own
    (idempotent): sandboxes bind them read-only, and a bind of a tmpfs shows only
    ``/devskel`` in their mountinfo, never a host path."""
    from dsec.images import sysmount

    skel.mkdir(mode=0o755, parents=True, exist_ok=True)
    if not any(m.mount_point == str(skel) for m in sysmount.mountinfo()):
        sysmount.mount("dsec-skel", str(skel), "tmpfs", sysmount.MS_NOSUID | sysmount.MS_NODEV,
                       "size=64k,nr_inodes=64,mode=0755")
    devskel, empty = skel / "devskel", skel / "empty"
    empty.mkdir(mode=0o555, exist_ok=True)
    os.chmod(empty, 0o555)
    if devskel.is_dir():
        return  # made whole by the rename below
    tmp = skel / "devskel.new"
    if tmp.exists():
        import shutil

        shutil.rmtree(tmp)
    tmp.mkdir(mode=0o755)
    for name in ("null", "zero", "full", "random", "urandom", "tty"):
        (tmp / name).touch(mode=0o666)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2"), ("ptmx", "pts/ptmx")):
        os.symlink(target, tmp / name)
    (tmp / "pts").mkdir(mode=0o755)
    (tmp / "shm").mkdir(mode=0o1777)
    os.chmod(tmp / "shm", 0o1777)
    os.rename(tmp, devskel)


def unmount_skeletons(skel: Path) -> None:
    from dsec.images import sysmount

    if any(m.mount_point == str(skel) for m in sysmount.mountinfo()):
        sysmount.umount(str(skel), sysmount.MNT_DETACH)
    with contextlib.suppress(OSError):
        skel.rmdir()


__all__ = ["make_skeletons", "unmount_skeletons"]
