"""A layer's lazy form: the same tree as a metadata-only EROFS image plus its data device.

``mkfs.erofs`` 1.5 (Debian 12) writes each inode beside its file's data, so the
metadata of a real image is spread over nearly every 1 MiB of it and "fetch the
metadata first" would mean "fetch the image" (docs/IMAGES.md, "Metadata first").
With ``--blobdev DATA --chunksize 4096`` it instead writes an image that holds only
inodes, directories and per-file chunk indexes (under 1 % of the bytes), and puts
every file's contents, uncompressed and 4 KiB-aligned (identical 4 KiB chunks
once), in the separate file DATA. The kernel mounts that pair from files
(``mount -t erofs -o device=DATA META``, file-backed, Linux >= 6.12), which is how
an edge mounts a lazily loaded layer: ``META`` fetched whole, ``DATA`` by chunk.

Built at push time from the layer itself (mounted read-only for the copy, so the
tree is exactly what sandboxes see: owners, modes, xattrs, whiteouts, hard links
and times are kept). Needs CAP_SYS_ADMIN for that mount; :class:`LazyFormUnavailable`
says so otherwise and the push goes on without a lazy form.
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from pathlib import Path

from dsec.errors import ImageError

from . import sysmount
from .erofs import FIXED_UUID, mkfs_binary
from .errors import LayerBuildError

EROFS_CHUNK = 4096
"""``--chunksize`` of the data device: one block, so no file's data is padded beyond its last block."""


class LazyFormUnavailable(ImageError):
    """A lazy form cannot be built here (``reason``): no CAP_SYS_ADMIN to mount the layer,
    or a kernel without file-backed EROFS."""


def build_lazy_form(layer_file: Path, workdir: Path) -> tuple[Path, Path]:
    """Write ``workdir/meta.erofs`` and ``workdir/data.blob`` from the EROFS file ``layer_file``.

    ``workdir`` must be an empty private directory (a store's scratch). The layer is
    mounted at ``workdir/tree`` for the copy and always unmounted again."""
    tree = workdir / "tree"
    tree.mkdir()
    meta, data = workdir / "meta.erofs", workdir / "data.blob"
    try:
        sysmount.mount(os.fspath(layer_file), os.fspath(tree), "erofs",
                       sysmount.MS_RDONLY | sysmount.MS_NODEV | sysmount.MS_NOSUID)  # fmt: skip
    except OSError as exc:
        why = {errno.EPERM: "mounting the layer needs CAP_SYS_ADMIN (push as root)",
               errno.ENOTBLK: "the kernel lacks file-backed EROFS (Linux >= 6.12)",
               errno.ENODEV: "the kernel lacks EROFS"}.get(exc.errno or 0, exc.strerror or str(exc))  # fmt: skip
        raise LazyFormUnavailable(f"cannot build the lazy form of {layer_file}: {why}", reason=why) from exc
    try:
        cmd = [mkfs_binary(), "--quiet", "--preserve-mtime", f"-U{FIXED_UUID}", f"--blobdev={data}",
               f"--chunksize={EROFS_CHUNK}", os.fspath(meta), os.fspath(tree)]  # fmt: skip
        proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True)
        if proc.returncode != 0:
            raise LayerBuildError(
                f"mkfs.erofs failed (exit {proc.returncode}) writing the lazy form of {layer_file}: "
                f"{(proc.stderr or proc.stdout).strip()[-2000:]}", stage="lazy-form", returncode=proc.returncode,
            )  # fmt: skip
    finally:
        try:
            sysmount.umount(os.fspath(tree))
        except OSError:
            with contextlib.suppress(OSError):
                sysmount.umount(os.fspath(tree), sysmount.MNT_DETACH)
        with contextlib.suppress(OSError):
            tree.rmdir()
    if not data.exists():  # a tree of empty files and directories only: an empty device
        data.write_bytes(b"")
    return meta, data


__all__ = ["EROFS_CHUNK", "LazyFormUnavailable", "build_lazy_form"]
