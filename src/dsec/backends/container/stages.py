"""Stages: the file rules (Landlock) and pristine paths of commands run in a sandbox.

This module owns what the runtime sends the spawner for a stage's
:class:`~dsec.spec.FileRules` and for ``pristine=`` paths, and the host-side
work of a stage switch (breaking hard links out of restricted paths). The
kernel work itself — walking the sandbox's tree, building the Landlock ruleset,
mounting pristine copies — happens in the spawner's exec child
(``native/landlock.c``), inside the sandbox's mount namespace, so
every exec sees the tree as it is at that moment.

It never grants anything: an empty token list means "no Landlock", which is
only returned for rules that restrict nothing (the no-stage fast path).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import posixpath
import stat as stat_mod
from collections.abc import Iterable, Sequence
from functools import lru_cache

from dsec.backends.common.fsops import (
    RESOLVE_IN_ROOT,
    RESOLVE_NO_MAGICLINKS,
    RESOLVE_NO_XDEV,
    openat2,
)
from dsec.backends.container import wire
from dsec.errors import InvalidSpec
from dsec.spec import FileRules

_libc = ctypes.CDLL(None, use_errno=True)
_SYS_LANDLOCK_CREATE_RULESET = 444
_LANDLOCK_CREATE_RULESET_VERSION = 1
RESOLVE_NO_SYMLINKS = 0x04

IMPLICIT_WRITABLE: tuple[str, ...] = ("/dev",)
"""Writable unless a rule names them or a path beneath: /dev is the sandbox's own
small tmpfs (null, zero, tty, pts, shm); a shell cannot work without /dev/null."""

MAX_PRISTINE = 64


@lru_cache(maxsize=1)
def landlock_abi() -> int:
    """The running kernel's Landlock ABI version (0: no Landlock)."""
    v = _libc.syscall(_SYS_LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(_LANDLOCK_CREATE_RULESET_VERSION))
    return int(v) if v > 0 else 0


def _under(path: str, top: str) -> bool:
    return top == "/" or path == top or path.startswith(top + "/")


@lru_cache(maxsize=256)
def landlock(rules: FileRules) -> wire.Landlock | None:
    """The spawner's Landlock part of an exec for ``rules``: the default access and one rule
    per path (``h``idden, ``r``ead-only, ``w``ritable), plus the implicitly writable paths no
    rule names. None when nothing is restricted: such an exec carries no Landlock at all."""
    if rules.unrestricted:
        return None
    out: list[wire.LandlockRule] = []
    named: list[str] = []
    for cls, paths in (("h", rules.hidden), ("r", rules.read_only), ("w", rules.writable)):
        for p in paths:
            out.append(wire.LandlockRule(cls, p))  # type: ignore[arg-type]
            named.append(p)
    for p in IMPLICIT_WRITABLE:
        if not any(_under(n, p) for n in named if n != "/"):
            out.append(wire.LandlockRule("w", p))
    return wire.Landlock("w" if rules.default == "rw" else "r", tuple(out))


def check_pristine(paths: Sequence[str]) -> tuple[str, ...]:
    """Validate ``pristine=`` paths (absolute, normalised, not the root, no duplicates)."""
    if isinstance(paths, str):
        raise InvalidSpec("pristine takes a list of paths, not one string", field="pristine")
    if len(paths) > MAX_PRISTINE:
        raise InvalidSpec(f"at most {MAX_PRISTINE} pristine paths", field="pristine")
    out: list[str] = []
    for p in paths:
        if not isinstance(p, str) or not p.startswith("/") or "\0" in p:
            raise InvalidSpec(f"pristine path {p!r} must be absolute", field="pristine")
        norm = "/" + posixpath.normpath(p).lstrip("/")
        if norm != p.rstrip("/") or norm == "/":
            raise InvalidSpec(
                f"pristine path {p!r} must be normalised and not the root (write {norm!r})", field="pristine"
            )
        if norm not in out:
            out.append(norm)
    # A path beneath another is already pristine (and mounting it again would hide nothing).
    return tuple(p for p in out if not any(p != q and _under(p, q) for q in out))


def restricted_paths(rules: FileRules) -> tuple[str, ...]:
    """Paths whose content the agent must not change (read-only) or reach (hidden)."""
    return tuple(rules.hidden) + tuple(rules.read_only)


def access_class(path: str, rules: FileRules) -> str:
    """"h", "r" or "w" for ``path`` under ``rules``: the deepest rule covering it wins,
    else the default (the same semantics as the walk in the spawner)."""
    best, cls = -1, "w" if rules.default == "rw" else "r"
    for c, paths in (("h", rules.hidden), ("r", rules.read_only), ("w", rules.writable)):
        for p in paths:
            if _under(path, p) and len(p) > best:
                best, cls = len(p), c
    if best < 0 and any(_under(path, p) for p in IMPLICIT_WRITABLE):
        cls = "w"
    return cls


def split_hard_links(root_dir: str, upper_dir: str, rules: FileRules) -> list[str]:
    """Give every restricted name of a hard-linked file its own inode.

    Landlock is path-based: a hard link made while both names were reachable
    (``ln /tests/expected /workspace/e`` in an open stage) would reach the same
    inode from an allowed path after the switch — reading a hidden file's later
    content, or writing a read-only one. Only files in the writable layer can be
    such links (overlayfs copies a lower file up before linking it), so the
    upper is searched (``upper_dir``, the host's view of it: only what the
    sandbox wrote), names are grouped by inode, and where the names' access
    differs, each hidden or read-only name is copied to a fresh inode through
    the sandbox's root (``root_dir``, confined with openat2) and renamed over
    itself. The other names keep the old inode: what the agent could read when
    it made the link. Returns the sandbox paths that were split. Call with the
    sandbox's processes stopped (a stage switch kills them first).
    """
    groups: dict[int, list[str]] = {}
    upper = _open_dir(upper_dir)
    try:
        dfd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=upper)
    finally:
        os.close(upper)
    try:
        for dirpath, _dirs, files, dirfd in os.fwalk(".", dir_fd=dfd, follow_symlinks=False):
            for name in files:
                with contextlib.suppress(OSError):
                    st = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
                    if stat_mod.S_ISREG(st.st_mode) and st.st_nlink > 1:
                        groups.setdefault(st.st_ino, []).append("/" + posixpath.normpath(posixpath.join(dirpath, name)))
    finally:
        os.close(dfd)
    split: list[str] = []
    for names in groups.values():
        classes = {n: access_class(n, rules) for n in names}
        if len(set(classes.values())) < 2:
            continue
        for n, cls in classes.items():
            if cls != "w":
                _split_one(root_dir, n)
                split.append(n)
    return sorted(split)


def symlinked_paths(root_dir: str, paths: Iterable[str]) -> list[str]:
    """Rule paths that are, or go through, a symlink in the sandbox now: Landlock grants
    them nothing, and the host's files API (which follows symlinks inside the sandbox)
    would write into the symlink's target — a trainer should know the agent did this."""
    out: list[str] = []
    root = _open_dir(root_dir)
    try:
        for p in paths:
            try:
                os.close(openat2(root, p.lstrip("/") or ".", os.O_PATH | os.O_NOFOLLOW,
                                 resolve=RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_SYMLINKS))
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    out.append(p)
                continue
            with contextlib.suppress(OSError):
                st = os.stat(p.lstrip("/") or ".", dir_fd=root, follow_symlinks=False)
                if stat_mod.S_ISLNK(st.st_mode):
                    out.append(p)
    finally:
        os.close(root)
    return out


def _open_dir(path: str) -> int:
    return os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)


def _split_one(root_dir: str, path: str) -> None:
    """Copy ``path`` (in the sandbox) to a new inode with the same owner and mode, renamed over it."""
    root = _open_dir(root_dir)
    try:
        head, name = posixpath.split(path.lstrip("/"))
        parent = openat2(root, head or ".", os.O_PATH | os.O_DIRECTORY,
                         resolve=RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV | RESOLVE_NO_SYMLINKS)
    finally:
        os.close(root)
    try:
        src = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=parent)
        try:
            st = os.fstat(src)
            if not stat_mod.S_ISREG(st.st_mode):
                return
            tmp = f".dsec-split-{os.getpid()}-{name}"[:240]
            dst = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=parent)
            try:
                while True:
                    chunk = os.read(src, 1 << 20)
                    if not chunk:
                        break
                    os.write(dst, chunk)
                os.fchown(dst, st.st_uid, st.st_gid)
                os.fchmod(dst, stat_mod.S_IMODE(st.st_mode))
                os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns))
            except BaseException:
                os.close(dst)
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=parent)
                raise
            os.close(dst)
            try:
                os.rename(tmp, name, src_dir_fd=parent, dst_dir_fd=parent)
            except OSError:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=parent)
                raise
        finally:
            os.close(src)
    except OSError as exc:
        if exc.errno not in (errno.ENOENT, errno.ELOOP):
            raise
    finally:
        os.close(parent)


__all__ = [
    "IMPLICIT_WRITABLE",
    "MAX_PRISTINE",
    "access_class",
    "check_pristine",
    "landlock",
    "landlock_abi",
    "restricted_paths",
    "split_hard_links",
    "symlinked_paths",
]
