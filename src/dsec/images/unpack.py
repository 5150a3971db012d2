"""Safe extraction of tar archives into a staging tree, with OCI whiteouts.

Owns: turning tar members into files under a root directory that the
extraction can never escape. Member names are made relative (a leading ``/``
is dropped, as GNU tar does); a name whose ``..`` climbs above the root is
refused. Symlinks inside the tree are resolved as if the root were ``/``
(chroot-style, clamped at the root), so a member ``lib/x`` under a symlink
``lib -> /usr/lib`` lands in ``<root>/usr/lib/x`` and never on the host.
Hard links must point at an earlier member. Device nodes are skipped with a
warning (a sandbox gets its own minimal /dev). Modes (including setuid),
owners (when running as root), symlinks, hard links, FIFOs and
``SCHILY.xattr.*`` extended attributes are preserved, and so are regular
files' mtimes: images are built with fixed timestamps, but the build first
checks Python bytecode against its sources' original times (pyc.py).

With ``whiteouts=True`` (image layers), ``.wh.NAME`` deletes NAME from the
layers below and ``.wh..wh..opq`` empties its directory of everything the
layers below put there, in any member order.
"""

from __future__ import annotations

import contextlib
import logging
import os
import posixpath
import stat
import tarfile
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO

from .errors import UnsafeArchive
from .fsutil import CHUNK, remove_tree

log = logging.getLogger("dsec.images")

WHITEOUT_PREFIX = ".wh."
OPAQUE_MARKER = ".wh..wh..opq"
_MAX_SYMLINK_HOPS = 40


@dataclass
class UnpackStats:
    """What an extraction did; ``warnings`` are human-readable, one per skipped thing."""

    members: int = 0
    files: int = 0
    dirs: int = 0
    symlinks: int = 0
    hardlinks: int = 0
    whiteouts: int = 0
    opaque_dirs: int = 0
    skipped_devices: int = 0
    warnings: list[str] = field(default_factory=list)

    def warn(self, message: str) -> None:
        if len(self.warnings) < 100:
            self.warnings.append(message)
        log.warning("%s", message)

    def merge(self, other: UnpackStats) -> None:
        for name in (
            "members", "files", "dirs", "symlinks", "hardlinks", "whiteouts",
            "opaque_dirs", "skipped_devices",
        ):  # fmt: skip
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.warnings.extend(other.warnings[: max(0, 100 - len(self.warnings))])


def normalize_member_path(name: str) -> str:
    """Return the member's path relative to the archive root ('' for the root itself).

    ``./a//b/`` -> ``a/b``; ``/etc/x`` -> ``etc/x``; ``a/../b`` -> ``b``.
    Raises UnsafeArchive if the path climbs above the root or contains NUL.
    """
    if "\0" in name:
        raise UnsafeArchive(f"archive member name {name!r} contains a NUL byte", member=name)
    parts: list[str] = []
    for part in name.split("/"):
        if part in ("", "."):
            continue
        if part == "..":
            if not parts:
                raise UnsafeArchive(
                    f"archive member {name!r} points outside the archive root ('..'); "
                    "the archive is malformed or malicious",
                    member=name,
                )
            parts.pop()
        else:
            parts.append(part)
    return "/".join(parts)


def resolve_in_root(root: str, rel: str, *, follow_last: bool) -> str:
    """Host path of ``rel`` inside ``root``, resolving symlinks as if ``root`` were ``/``.

    Components that do not exist yet are taken literally. The result is always
    ``root`` or below it.
    """
    current: list[str] = []
    pending = deque(p for p in rel.split("/") if p)
    hops = 0
    while pending:
        part = pending.popleft()
        if part in ("", "."):
            continue
        if part == "..":
            if current:
                current.pop()
            continue
        candidate = os.path.join(root, *current, part)
        try:
            st = os.lstat(candidate)
        except (FileNotFoundError, NotADirectoryError):
            current.append(part)
            continue
        if stat.S_ISLNK(st.st_mode) and (pending or follow_last):
            hops += 1
            if hops > _MAX_SYMLINK_HOPS:
                raise UnsafeArchive(
                    f"too many levels of symbolic links resolving {rel!r} in the archive",
                    member=rel,
                )
            target = os.readlink(candidate)
            if target.startswith("/"):
                current = []
            pending.extendleft(reversed([p for p in target.split("/") if p]))
            continue
        current.append(part)
    return os.path.join(root, *current) if current else root


class _Unpacker:
    def __init__(self, root: str, *, whiteouts: bool, stats: UnpackStats) -> None:
        self.root = root
        self.whiteouts = whiteouts
        self.stats = stats
        self.is_root = os.geteuid() == 0
        # Paths (relative to root, symlinks resolved) this layer created, and their
        # ancestors: an opaque marker must not delete them, whatever the member order.
        self.touched: set[str] = set()
        self.opaque: list[str] = []
        self.dir_modes: list[tuple[str, int]] = []
        self.warned_xattr: set[str] = set()

    def touch(self, rel: str) -> None:
        while rel and rel not in self.touched:
            self.touched.add(rel)
            rel = posixpath.dirname(rel)

    def rel(self, host_path: str) -> str:
        return os.path.relpath(host_path, self.root) if host_path != self.root else ""

    def parent_dir(self, rel_parent: str, member: str) -> str:
        """Resolve (and create, 0755) the parent directory of a member."""
        path = resolve_in_root(self.root, rel_parent, follow_last=True)
        if not os.path.isdir(path):
            missing: list[str] = []
            probe = path
            while not os.path.lexists(probe):
                missing.append(probe)
                probe = os.path.dirname(probe)
            if not os.path.isdir(probe) or os.path.islink(probe):
                raise UnsafeArchive(
                    f"archive member {member!r}: {self.rel(probe)!r} is not a directory",
                    member=member,
                )
            for d in reversed(missing):
                os.mkdir(d, 0o755)
                self.touch(self.rel(d))
        return path

    def apply(self, tf: tarfile.TarFile, member: tarfile.TarInfo) -> None:
        self.stats.members += 1
        rel = normalize_member_path(member.name)
        if rel == "":
            if member.isdir():
                self.metadata(self.root, member)
            return
        rel_parent, base = posixpath.split(rel)
        if self.whiteouts and base.startswith(WHITEOUT_PREFIX):
            parent = resolve_in_root(self.root, rel_parent, follow_last=True)
            if os.path.isdir(parent):
                self.whiteout(parent, base)
            return
        parent = self.parent_dir(rel_parent, member.name)
        dest = os.path.join(parent, base)
        dest_rel = self.rel(dest)

        if member.ischr() or member.isblk():
            self.stats.skipped_devices += 1
            self.stats.warn(f"skipped device node {member.name!r} (sandboxes get their own /dev)")
            return
        existing = _lstat(dest)
        if existing is not None and not (member.isdir() and stat.S_ISDIR(existing.st_mode)):
            remove_tree(dest)
            existing = None

        if member.isdir():
            if existing is None:
                os.mkdir(dest, 0o700)
            self.stats.dirs += 1
        elif member.isreg():
            src = tf.extractfile(member)
            if src is None:  # pragma: no cover - isreg() members always have data
                raise UnsafeArchive(
                    f"archive member {member.name!r} has no data", member=member.name
                )
            fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "wb") as out, src:
                while True:
                    buf = src.read(CHUNK)
                    if not buf:
                        break
                    out.write(buf)
            self.stats.files += 1
        elif member.issym():
            os.symlink(member.linkname, dest)
            self.stats.symlinks += 1
        elif member.islnk():
            target_rel = normalize_member_path(member.linkname)
            t_parent, t_base = posixpath.split(target_rel)
            target = os.path.join(resolve_in_root(self.root, t_parent, follow_last=True), t_base)
            tst = _lstat(target)
            if not target_rel or tst is None or stat.S_ISDIR(tst.st_mode):
                raise UnsafeArchive(
                    f"archive member {member.name!r} is a hard link to {member.linkname!r}, "
                    "which is not an earlier file in the archive",
                    member=member.name,
                )
            os.link(target, dest, follow_symlinks=False)
            self.stats.hardlinks += 1
            self.touch(dest_rel)
            return  # a hard link shares its target's metadata
        elif member.isfifo():
            os.mkfifo(dest, 0o600)
            self.stats.files += 1
        else:
            self.stats.warn(
                f"skipped archive member {member.name!r} of unsupported type {member.type!r}"
            )
            return
        self.touch(dest_rel)
        self.metadata(dest, member)

    def metadata(self, path: str, member: tarfile.TarInfo) -> None:
        if self.is_root:
            os.lchown(path, member.uid, member.gid)
        for key, value in member.pax_headers.items():
            if key.startswith("SCHILY.xattr."):
                self.set_xattr(path, key[len("SCHILY.xattr.") :], value)
        if member.issym():
            return
        if member.isreg():
            with contextlib.suppress(OSError, OverflowError, ValueError):
                os.utime(path, (member.mtime, member.mtime))
        mode = member.mode & 0o7777
        if member.isdir():
            # Applied at the end, so read-only dirs can still be filled (unprivileged).
            self.dir_modes.append((path, mode))
        else:
            os.chmod(path, mode)

    def set_xattr(self, path: str, name: str, value: str) -> None:
        try:
            os.setxattr(path, name, value.encode("utf-8", "surrogateescape"), follow_symlinks=False)
        except OSError as e:
            if name not in self.warned_xattr:
                self.warned_xattr.add(name)
                self.stats.warn(f"could not keep extended attribute {name} ({e.strerror})")

    def whiteout(self, parent: str, base: str) -> None:
        if base == OPAQUE_MARKER:
            self.opaque.append(parent)
            self.stats.opaque_dirs += 1
            return
        if base.startswith(WHITEOUT_PREFIX + WHITEOUT_PREFIX):
            return  # other AUFS metadata (.wh..wh.plnk...): meaningless here
        target = os.path.join(parent, base[len(WHITEOUT_PREFIX) :])
        self.stats.whiteouts += 1
        if _lstat(target) is not None:
            remove_tree(target)

    def prune(self, d: str) -> None:
        """Delete everything under ``d`` that this layer did not create."""
        for entry in os.listdir(d):
            child = os.path.join(d, entry)
            if self.rel(child) not in self.touched:
                remove_tree(child)
            elif os.path.isdir(child) and not os.path.islink(child):
                self.prune(child)

    def finish(self) -> None:
        for d in self.opaque:
            if os.path.isdir(d) and not os.path.islink(d):
                self.prune(d)
        for path, mode in reversed(self.dir_modes):
            with contextlib.suppress(FileNotFoundError):  # deleted by a later whiteout
                os.chmod(path, mode)


def _lstat(path: str) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None


def unpack_tar(
    fileobj: IO[bytes],
    root: str | os.PathLike[str],
    *,
    whiteouts: bool = False,
    on_member: Callable[[int], None] | None = None,
) -> UnpackStats:
    """Extract a (possibly gzip/bzip2/xz-compressed) tar stream into ``root``.

    ``on_member(n)`` is called after each member. Raises UnsafeArchive for
    members that would escape ``root`` and LayerBuildError-family errors for
    malformed archives.
    """
    stats = UnpackStats()
    u = _Unpacker(os.fspath(root), whiteouts=whiteouts, stats=stats)
    try:
        with tarfile.open(fileobj=fileobj, mode="r|*") as tf:
            for member in tf:
                u.apply(tf, member)
                if on_member is not None:
                    on_member(stats.members)
    except tarfile.ReadError as e:
        raise UnsafeArchive(f"not a readable tar archive: {e}", reason=str(e)) from e
    except tarfile.CompressionError as e:
        raise UnsafeArchive(
            f"unsupported tar compression: {e}; use a plain, gzip, bzip2 or xz tar",
            reason=str(e),
        ) from e
    u.finish()
    return stats


__all__ = [
    "OPAQUE_MARKER",
    "WHITEOUT_PREFIX",
    "UnpackStats",
    "normalize_member_path",
    "resolve_in_root",
    "unpack_tar",
]
