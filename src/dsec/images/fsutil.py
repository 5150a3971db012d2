"""Small filesystem helpers shared by the store and the builders.

``remove_tree`` never crosses into another filesystem: a staging tree that
somehow still has something mounted inside it (``/proc`` left by a failed
debootstrap, a bind mount of ``/dev``) is refused, not emptied — deleting
through a bind mount would delete host files.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import stat
from collections.abc import Callable
from pathlib import Path

from dsec.errors import ImageError

CHUNK = 1 << 20


def remove_tree(path: str | os.PathLike[str]) -> None:
    """Delete ``path`` recursively without following symlinks or crossing mounts.

    Missing paths are fine. Directories without write/search permission are
    opened up first so an unprivileged caller can clean an extracted image too.
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(path)
        return
    _remove_dir(os.fspath(path), st.st_dev)


def _remove_dir(path: str, dev: int) -> None:
    st = os.lstat(path)
    if st.st_dev != dev:
        raise ImageError(
            f"refusing to delete {path}: another filesystem is mounted there; "
            f"unmount it (umount -l {path}) and retry",
            path=path,
        )
    if st.st_mode & 0o700 != 0o700:
        os.chmod(path, stat.S_IMODE(st.st_mode) | 0o700)
    with os.scandir(path) as it:
        entries = list(it)
    for entry in entries:
        if entry.is_dir(follow_symlinks=False):
            _remove_dir(entry.path, dev)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)
    with contextlib.suppress(FileNotFoundError):
        os.rmdir(path)


def sha256_file(path: Path, *, on_chunk: Callable[[int], None] | None = None) -> tuple[str, int]:
    """Return (hex digest, size) of a file, calling ``on_chunk(bytes_so_far)``."""
    h = hashlib.sha256()
    done = 0
    with open(path, "rb") as f:
        while True:
            buf = f.read(CHUNK)
            if not buf:
                break
            h.update(buf)
            done += len(buf)
            if on_chunk is not None:
                on_chunk(done)
    return h.hexdigest(), done


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as e:  # pragma: no cover - only on exotic filesystems
        if e.errno in (errno.EACCES, errno.EPERM):
            return
        raise
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
