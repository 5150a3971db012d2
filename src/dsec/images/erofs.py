"""Writing and recognising EROFS images (wraps ``mkfs.erofs`` from erofs-utils).

Images are made reproducible: every inode gets timestamp 0 (``-T0``), the
filesystem UUID is fixed (``-U``), and erofs-utils sorts directory entries, so
the same tree always yields the same bytes and hence the same digest. Owners
are kept as they are in the tree (no ``--all-root``). Never mounts anything.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from pathlib import Path

from dsec.errors import HostError

from .errors import LayerBuildError, StorageFull

EROFS_MAGIC = 0xE0F5E1E2
EROFS_SUPER_OFFSET = 1024
FIXED_UUID = uuid.UUID(int=0)
COMPRESSOR = "lz4hc"
NORMALISED_MTIME = 0
"""The mtime of every inode of a built layer (``-T``); bytecode is made to match it (pyc.py)."""


def mkfs_binary() -> str:
    path = shutil.which("mkfs.erofs")
    if path is None:
        raise HostError(
            "mkfs.erofs not found: install erofs-utils (apt-get install erofs-utils)",
            binary="mkfs.erofs",
        )
    return path


def make_erofs(src: Path, out: Path, *, compressor: str = COMPRESSOR, keep_mtimes: bool = False) -> None:
    """Write the tree under ``src`` to the EROFS image ``out`` (lz4hc, reproducible).

    ``compressor`` "none" writes an uncompressed image (faster, larger).
    ``keep_mtimes`` (snapshots) keeps every file's modification time instead of
    zeroing them: the image is then only as reproducible as its tree's times.
    Raises :class:`StorageFull` when the image's filesystem fills up."""
    cmd = [
        mkfs_binary(),
        *(["--preserve-mtime"] if keep_mtimes else [f"-T{NORMALISED_MTIME}"]),
        f"-U{FIXED_UUID}",
        *([] if compressor == "none" else [f"-z{compressor}"]),
        "--quiet",
        str(out),
        str(src),
    ]
    proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True)
    if proc.returncode != 0:
        detail = (proc.stderr or proc.stdout).strip()[-2000:]
        free = _free_bytes(out.parent)
        if "No space left" in detail or (free is not None and free < 1024 * 1024):
            raise StorageFull(
                f"no space left on the filesystem of {out.parent} while mkfs.erofs wrote the layer",
                stage="mkfs", path=str(out.parent),
            )
        raise LayerBuildError(
            f"mkfs.erofs failed (exit {proc.returncode}) building from {src}: {detail}",
            stage="mkfs",
            returncode=proc.returncode,
        )


def _free_bytes(path: Path) -> int | None:
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def is_erofs(path: Path) -> bool:
    """True if ``path`` starts like an EROFS image (superblock magic at 1 KiB)."""
    try:
        with open(path, "rb") as f:
            f.seek(EROFS_SUPER_OFFSET)
            magic = f.read(4)
    except OSError:
        return False
    return len(magic) == 4 and int.from_bytes(magic, "little") == EROFS_MAGIC


__all__ = [
    "COMPRESSOR",
    "EROFS_MAGIC",
    "FIXED_UUID",
    "NORMALISED_MTIME",
    "is_erofs",
    "make_erofs",
    "mkfs_binary",
]
