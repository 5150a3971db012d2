"""Overlay diffs as plain trees: copy a writable layer out, merge stacked diffs.

An overlayfs upper — and every snapshot layer made from one — is a *diff*
over the layers beneath it: entries that add or replace, **whiteouts**
(character devices 0:0, or empty files with ``trusted.overlay.whiteout``) that
delete what the layers below hold, and **opaque** directories
(``trusted.overlay.opaque=y``) whose lower content is hidden. This module
copies such a diff into a directory that ``mkfs.erofs`` turns into a layer
with that meaning intact (EROFS keeps character devices and ``trusted.*``
xattrs, so the layer works as an overlay lower), and merges consecutive diffs
into one the way overlayfs reads them stacked (collapsing a long chain).

Kept: regular files (sparse ones stay sparse), directories, symlinks, hard
links (within one source), FIFOs, sockets, device nodes, owners, modes
(setuid included), mtimes, and xattrs — ``user.*``, ``security.*``, POSIX
ACLs, other ``trusted.*`` — except overlayfs's private bookkeeping
(``trusted.overlay.origin``, ``impure``, ``nlink``...), which describes the
old stack and would mislead a new one. With ``uid_shift`` (a sandbox's upper
is owned by host uids ``uid_base + n``) owners, ACL ids and the root id of
v3 file capabilities are shifted back to the sandbox's own ids; an id outside
the sandbox's range becomes 65534 (nobody).

Safety: the source is controlled by the sandbox. Every lookup is relative to
an open directory fd with ``O_NOFOLLOW``; a symlink is copied as a symlink
and never followed; FIFOs are recreated, never opened. Blocking: run it in a
worker thread.
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Final

OVL_OPAQUE: Final = "trusted.overlay.opaque"
OVL_KEEP: Final = frozenset({OVL_OPAQUE, "trusted.overlay.whiteout", "trusted.overlay.whiteouts"})
ACL_XATTRS: Final = frozenset({"system.posix_acl_access", "system.posix_acl_default"})
CAP_XATTR: Final = "security.capability"
ID_RANGE: Final = 65536
OVERFLOW_ID: Final = 65534
_ACL_USER, _ACL_GROUP = 0x02, 0x08
_VFS_CAP_REVISION_MASK, _VFS_CAP_REVISION_2, _VFS_CAP_REVISION_3 = 0xFF000000, 0x02000000, 0x03000000
_DIR_FLAGS: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_GLOB = frozenset("*?[")


@dataclass
class DiffStats:
    files: int = 0
    dirs: int = 0
    symlinks: int = 0
    hardlinks: int = 0
    whiteouts: int = 0
    opaque_dirs: int = 0
    special: int = 0
    bytes: int = 0
    """Bytes of file data copied."""
    excluded: list[str] = field(default_factory=list)
    """Paths left out by ``exclude`` (the first 1,000)."""
    vanished: int = 0
    """Entries gone between listing and copying (only a running source can do that)."""
    recopied: int = 0
    """Entries copied again by :func:`resync_diff` (changed since the first pass)."""
    removed: int = 0
    """Entries :func:`resync_diff` removed (deleted since the first pass)."""

    def add_excluded(self, path: str) -> None:
        if len(self.excluded) < 1000:
            self.excluded.append(path)


class Excluder:
    """Which paths (absolute, as the sandbox sees them) to leave out.

    A pattern starting with ``/`` names a path and everything below it
    (``/root/.cache``) and may use shell globs (``/tmp/*.log``, where ``*``
    also crosses ``/``); a pattern without ``/`` matches an entry's name at any
    depth (``__pycache__``, ``*.pyc``).
    """

    def __init__(self, patterns: Iterable[str] = ()) -> None:
        self.paths: list[str] = []
        self.path_globs: list[str] = []
        self.names: list[str] = []
        for raw in patterns:
            p = raw.strip()
            if not p:
                continue
            if "/" in p:
                if not p.startswith("/"):
                    raise ValueError(f"exclude pattern {raw!r}: a path must be absolute (or give a bare name)")
                p = "/" + "/".join(x for x in p.split("/") if x and x != ".")
                if ".." in p.split("/"):
                    raise ValueError(f"exclude pattern {raw!r}: '..' is not allowed")
                (self.path_globs if _GLOB & set(p) else self.paths).append(p)
            else:
                self.names.append(p)

    def __bool__(self) -> bool:
        return bool(self.paths or self.path_globs or self.names)

    def matches(self, path: str, name: str) -> bool:
        for p in self.paths:
            if path == p or path.startswith(p + "/") or p == "/":
                return True
        if any(fnmatch.fnmatchcase(path, g) for g in self.path_globs):
            return True
        return any(fnmatch.fnmatchcase(name, n) for n in self.names)


def is_whiteout(st: os.stat_result) -> bool:
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == 0


def _shift_id(i: int, shift: int) -> int:
    if not shift:
        return i
    j = i - shift
    return j if 0 <= j < ID_RANGE else OVERFLOW_ID


def _shift_acl(value: bytes, shift: int) -> bytes:
    if not shift or len(value) < 4 or (len(value) - 4) % 8:
        return value
    out = bytearray(value)
    for off in range(4, len(out), 8):
        tag = int.from_bytes(out[off : off + 2], "little")
        if tag in (_ACL_USER, _ACL_GROUP):
            ident = int.from_bytes(out[off + 4 : off + 8], "little")
            out[off + 4 : off + 8] = _shift_id(ident, shift).to_bytes(4, "little")
    return bytes(out)


def _shift_cap(value: bytes, shift: int) -> bytes | None:
    """v3 caps carry the host uid of their namespace's root; inside the layer it is root itself (v2)."""
    if not shift or len(value) < 24:
        return value
    magic = int.from_bytes(value[0:4], "little")
    if magic & _VFS_CAP_REVISION_MASK != _VFS_CAP_REVISION_3:
        return value
    rootid = int.from_bytes(value[20:24], "little")
    if rootid != shift:
        return None  # capabilities of some other namespace: meaningless here
    v2 = (magic & ~_VFS_CAP_REVISION_MASK) | _VFS_CAP_REVISION_2
    return v2.to_bytes(4, "little") + value[4:20]


class _Copier:
    def __init__(self, root_fd: int, uid_shift: int, exclude: Excluder | None, stats: DiffStats,
                 record: dict[str, tuple[int, int]] | None = None) -> None:
        self.root_fd = root_fd
        self.shift = uid_shift
        self.exclude = exclude if exclude else None
        self.stats = stats
        self.links: dict[tuple[int, int], str] = {}
        self.record = record
        """Filled with path -> (inode, ctime) of every source entry seen (for resync_diff)."""

    # ----- xattrs and metadata -----

    @staticmethod
    def _proc(dirfd: int, name: str) -> str:
        return f"/proc/self/fd/{dirfd}/{name}"

    def _xattrs(self, sfd: int, name: str) -> dict[str, bytes]:
        path = self._proc(sfd, name)
        out: dict[str, bytes] = {}
        try:
            names = os.listxattr(path, follow_symlinks=False)
        except OSError as exc:
            if exc.errno in (errno.ENOTSUP, errno.ENOENT):
                return out
            raise
        for x in names:
            if x.startswith("trusted.overlay.") and x not in OVL_KEEP:
                continue
            try:
                v = os.getxattr(path, x, follow_symlinks=False)
            except OSError as exc:
                if exc.errno in (errno.ENODATA, errno.ENOTSUP, errno.ENOENT):
                    continue
                raise
            if x in ACL_XATTRS:
                v = _shift_acl(v, self.shift)
            elif x == CAP_XATTR:
                shifted = _shift_cap(v, self.shift)
                if shifted is None:
                    continue
                v = shifted
            out[x] = v
        return out

    def _meta(self, dfd: int, name: str, st: os.stat_result, xattrs: dict[str, bytes], *,
              keep_opaque: bool = False) -> None:
        """Owner, mode, xattrs, times — in that order (chown clears setuid; times go last)."""
        link = stat.S_ISLNK(st.st_mode)
        os.chown(name, _shift_id(st.st_uid, self.shift), _shift_id(st.st_gid, self.shift), dir_fd=dfd,
                 follow_symlinks=False)
        if not link:
            os.chmod(name, stat.S_IMODE(st.st_mode), dir_fd=dfd)
        path = self._proc(dfd, name)
        if keep_opaque or xattrs:
            current = set(os.listxattr(path, follow_symlinks=False))
            for x in current - set(xattrs):
                if keep_opaque and x == OVL_OPAQUE:
                    continue
                with contextlib.suppress(OSError):
                    os.removexattr(path, x, follow_symlinks=False)
        for x, v in xattrs.items():
            os.setxattr(path, x, v, follow_symlinks=False)
        os.utime(name, ns=(st.st_atime_ns, st.st_mtime_ns), dir_fd=dfd, follow_symlinks=False)

    # ----- removal in the destination -----

    @staticmethod
    def _remove(dfd: int, name: str) -> None:
        try:
            st = os.lstat(name, dir_fd=dfd)
        except FileNotFoundError:
            return
        if stat.S_ISDIR(st.st_mode):
            sub = os.open(name, _DIR_FLAGS, dir_fd=dfd)
            try:
                for entry in os.listdir(sub):
                    _Copier._remove(sub, entry)
            finally:
                os.close(sub)
            os.rmdir(name, dir_fd=dfd)
        else:
            os.unlink(name, dir_fd=dfd)

    # ----- copying -----

    def _copy_data(self, sfd: int, name: str, dfd: int, st: os.stat_result) -> None:
        src = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NOATIME, dir_fd=sfd)
        try:
            dst = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
            try:
                size = os.fstat(src).st_size
                pos = 0
                while pos < size:
                    try:
                        data_at = os.lseek(src, pos, os.SEEK_DATA)
                    except OSError as exc:
                        if exc.errno == errno.ENXIO:
                            break  # only a hole left
                        raise
                    hole_at = os.lseek(src, data_at, os.SEEK_HOLE)
                    off = data_at
                    while off < hole_at:
                        n = self._copy_range(src, dst, off, hole_at - off)
                        if n == 0:
                            break
                        off += n
                        self.stats.bytes += n
                    pos = hole_at
                os.ftruncate(dst, size)
            finally:
                os.close(dst)
        finally:
            os.close(src)

    @staticmethod
    def _copy_range(src: int, dst: int, off: int, count: int) -> int:
        os.lseek(dst, off, os.SEEK_SET)
        return os.sendfile(dst, src, off, min(count, 1 << 30))

    def _new_entry(self, sfd: int, dfd: int, name: str, st: os.stat_result, rel: str) -> None:
        """Create ``name`` in ``dfd`` as a copy of the source's non-directory entry."""
        mode = st.st_mode
        if stat.S_ISREG(mode) and st.st_nlink > 1:
            key = (st.st_dev, st.st_ino)
            first = self.links.get(key)
            if first is not None:
                os.link(first, name, src_dir_fd=self.root_fd, dst_dir_fd=dfd, follow_symlinks=False)
                self.stats.hardlinks += 1
                return
            self.links[key] = rel.lstrip("/")
        xattrs = self._xattrs(sfd, name)
        if stat.S_ISREG(mode):
            self._copy_data(sfd, name, dfd, st)
            self.stats.files += 1
        elif stat.S_ISLNK(mode):
            os.symlink(os.readlink(name, dir_fd=sfd), name, dir_fd=dfd)
            self.stats.symlinks += 1
        elif stat.S_ISCHR(mode) or stat.S_ISBLK(mode) or stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode):
            os.mknod(name, stat.S_IFMT(mode) | 0o600, st.st_rdev, dir_fd=dfd)
            if is_whiteout(st):
                self.stats.whiteouts += 1
            else:
                self.stats.special += 1
        else:
            return
        self._meta(dfd, name, st, xattrs)

    def apply_dir(self, sfd: int, dfd: int, rel: str) -> None:
        """Apply the source directory's entries onto the destination directory (both open)."""
        for name in sorted(os.listdir(sfd)):
            path = f"{rel.rstrip('/')}/{name}"
            try:
                st = os.lstat(name, dir_fd=sfd)
            except FileNotFoundError:
                self.stats.vanished += 1
                continue
            if self.exclude is not None and self.exclude.matches(path, name):
                self.stats.add_excluded(path)
                continue
            if self.record is not None:
                self.record[path] = (st.st_ino, st.st_ctime_ns)
            try:
                self._apply_entry(sfd, dfd, name, st, path)
            except FileNotFoundError:
                self.stats.vanished += 1
            except OSError as exc:
                # A first pass over a running source races with it (a directory turned into a
                # file between lstat and open...): forget the entry, the second pass redoes it.
                if self.record is None or exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EIO):
                    raise
                self.record.pop(path, None)
                self.stats.vanished += 1

    def resync_dir(self, sfd: int, dfd: int, rel: str, seen: dict[str, tuple[int, int]], since_ns: int) -> None:
        """Bring a first-pass copy up to date with the source (see :func:`resync_diff`)."""
        names = set(os.listdir(sfd))
        for name in sorted(names):
            path = f"{rel.rstrip('/')}/{name}"
            try:
                st = os.lstat(name, dir_fd=sfd)
            except FileNotFoundError:
                names.discard(name)
                continue
            if self.exclude is not None and self.exclude.matches(path, name):
                names.discard(name)
                continue
            old = seen.get(path)
            # ctime changes with every change to an inode and cannot be set from inside; a
            # change in the same clock tick as the first pass's stat is caught by since_ns.
            changed = old is None or old != (st.st_ino, st.st_ctime_ns) or st.st_ctime_ns >= since_ns
            try:
                dst = os.lstat(name, dir_fd=dfd)
            except FileNotFoundError:
                dst = None
            if stat.S_ISDIR(st.st_mode) and dst is not None and stat.S_ISDIR(dst.st_mode) and old is not None \
                    and old[0] == st.st_ino:
                s2 = os.open(name, _DIR_FLAGS, dir_fd=sfd)
                try:
                    d2 = os.open(name, _DIR_FLAGS, dir_fd=dfd)
                    try:
                        self.resync_dir(s2, d2, path, seen, since_ns)
                    finally:
                        os.close(d2)
                finally:
                    os.close(s2)
                if changed:
                    self._meta(dfd, name, st, self._xattrs(sfd, name), keep_opaque=False)
                    self.stats.recopied += 1
                continue
            if not changed and dst is not None:
                continue
            try:
                if dst is not None:
                    self._remove(dfd, name)  # never merge into a stale first-pass copy
                self._apply_entry(sfd, dfd, name, st, path)
                self.stats.recopied += 1
            except FileNotFoundError:
                names.discard(name)
                with contextlib.suppress(FileNotFoundError):
                    self._remove(dfd, name)
        for gone in set(os.listdir(dfd)) - names:
            self._remove(dfd, gone)
            self.stats.removed += 1

    def _apply_entry(self, sfd: int, dfd: int, name: str, st: os.stat_result, path: str) -> None:
        try:
            dst = os.lstat(name, dir_fd=dfd)
        except FileNotFoundError:
            dst = None
        if not stat.S_ISDIR(st.st_mode):
            if dst is not None:
                self._remove(dfd, name)
            self._new_entry(sfd, dfd, name, st, path)
            return
        xattrs = self._xattrs(sfd, name)
        opaque = xattrs.get(OVL_OPAQUE) == b"y"
        keep_opaque = False
        if dst is not None and stat.S_ISDIR(dst.st_mode) and not opaque:
            keep_opaque = True  # merge into it; if it hid the layers below, it still must
        else:
            if dst is not None:
                # A directory over a file or whiteout: in the stack, what lies below that
                # file was hidden; above the merged layers the directory must hide it too.
                self._remove(dfd, name)
                xattrs[OVL_OPAQUE] = b"y"
                opaque = True
            os.mkdir(name, 0o700, dir_fd=dfd)
        if opaque:
            self.stats.opaque_dirs += 1
        self.stats.dirs += 1
        s2 = os.open(name, _DIR_FLAGS, dir_fd=sfd)
        try:
            d2 = os.open(name, _DIR_FLAGS, dir_fd=dfd)
            try:
                self.apply_dir(s2, d2, path)
            finally:
                os.close(d2)
        finally:
            os.close(s2)
        self._meta(dfd, name, st, xattrs, keep_opaque=keep_opaque)


def apply_diff(
    src_dir_fd: int,
    dst_root: str | os.PathLike[str],
    *,
    uid_shift: int = 0,
    exclude: Excluder | None = None,
    stats: DiffStats | None = None,
    root_meta: bool = True,
    record: dict[str, tuple[int, int]] | None = None,
) -> DiffStats:
    """Apply the diff under ``src_dir_fd`` onto the tree at ``dst_root`` (which may hold
    earlier, lower diffs: this is how a chain is collapsed, bottom first).

    Source entries replace destination ones; a whiteout removes the destination's
    entry and stays (it must still hide what lies further below); an opaque
    directory replaces the destination's directory wholesale; a plain directory
    merges into an existing one. ``root_meta`` copies the source root's owner,
    mode, xattrs and times onto ``dst_root``.
    """
    stats = stats if stats is not None else DiffStats()
    dfd = os.open(dst_root, _DIR_FLAGS)
    try:
        copier = _Copier(dfd, uid_shift, exclude, stats, record)
        copier.apply_dir(src_dir_fd, dfd, "/")
        if root_meta:
            _copy_root_meta(copier, src_dir_fd, dfd, uid_shift)
    finally:
        os.close(dfd)
    return stats


def _copy_root_meta(copier: _Copier, src_dir_fd: int, dfd: int, uid_shift: int) -> None:
    """Owner, mode, xattrs and times of the source's root onto the copy's root."""
    st = os.fstat(src_dir_fd)
    xattrs = copier._xattrs(src_dir_fd, ".")
    xattrs.pop(OVL_OPAQUE, None)  # the root of a layer is never opaque
    os.chown(dfd, _shift_id(st.st_uid, uid_shift), _shift_id(st.st_gid, uid_shift))
    os.chmod(dfd, stat.S_IMODE(st.st_mode))
    for x, v in xattrs.items():
        os.setxattr(dfd, x, v)
    os.utime(dfd, ns=(st.st_atime_ns, st.st_mtime_ns))


def resync_diff(
    src_dir_fd: int,
    dst_root: str | os.PathLike[str],
    seen: dict[str, tuple[int, int]],
    since_ns: int,
    *,
    uid_shift: int = 0,
    exclude: Excluder | None = None,
    stats: DiffStats | None = None,
) -> DiffStats:
    """Second pass of a two-pass copy: make ``dst_root`` (a first-pass :func:`apply_diff` copy of
    the same source onto an empty tree, with ``record=seen``) equal to the source *now*.

    Entries whose inode or ctime differ from the first pass, or whose ctime is at or after
    ``since_ns`` (CLOCK_REALTIME when the first pass started, minus a tick), are copied again;
    entries gone from the source are removed; unchanged files are not read. So the source need
    only be still (frozen) for this pass, and it costs a metadata walk plus what changed."""
    stats = stats if stats is not None else DiffStats()
    dfd = os.open(dst_root, _DIR_FLAGS)
    try:
        copier = _Copier(dfd, uid_shift, exclude, stats)
        copier.resync_dir(src_dir_fd, dfd, "/", seen, since_ns)
        _copy_root_meta(copier, src_dir_fd, dfd, uid_shift)
    finally:
        os.close(dfd)
    return stats


def open_dir(path: str | os.PathLike[str]) -> int:
    """An fd of a directory to use as a diff source (the last component not followed)."""
    return os.open(path, _DIR_FLAGS)


def tree_bytes(dir_fd: int, exclude: Excluder | None = None) -> int:
    """Bytes allocated under a directory (blocks, so sparse files count what they hold),
    leaving out what ``exclude`` matches (paths relative to the directory, as ``/...``)."""
    total = 0
    stack = [(os.dup(dir_fd), "")]
    try:
        while stack:
            fd, rel = stack.pop()
            try:
                for name in os.listdir(fd):
                    path = f"{rel}/{name}"
                    if exclude and exclude.matches(path, name):
                        continue
                    try:
                        st = os.lstat(name, dir_fd=fd)
                    except FileNotFoundError:
                        continue
                    total += st.st_blocks * 512
                    if stat.S_ISDIR(st.st_mode):
                        with contextlib.suppress(OSError):
                            stack.append((os.open(name, _DIR_FLAGS, dir_fd=fd), path))
            finally:
                os.close(fd)
    finally:
        for fd, _ in stack:
            os.close(fd)
    return total


__all__ = ["DiffStats", "Excluder", "apply_diff", "is_whiteout", "open_dir", "resync_diff", "tree_bytes"]
