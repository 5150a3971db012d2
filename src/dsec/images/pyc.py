"""Python bytecode that stays valid after a layer's timestamps are normalised.

Layers are built with every inode's mtime set to :data:`NORMALISED_MTIME`
(``mkfs.erofs -T0``), but a ``__pycache__/*.pyc`` written by the distribution
(Debian's py3compile, a Dockerfile's compileall) records its source's *original*
mtime and size. In the layer the source's mtime is 0, the header still says
2023, so every Python process of every fresh sandbox decides the bytecode is
stale ("bytecode is stale for 'encodings'" under ``python3 -v``) and recompiles
each stdlib module it imports.

Owns: rewriting the 4-byte source-mtime field of timestamp-based pycs (PEP 552
layout, Python >= 3.7: magic(4) flags(4) mtime(4) size(4), flags == 0) to the
normalised mtime, but only for a pyc that *matched* its source before
normalisation (same mtime, same size): a pyc that was already stale stays stale,
so Python recompiles it exactly as it would have on the original system.
Hash-based pycs (flags 1 or 3) are valid whatever the mtime and are left alone,
as are truncated files, files that are not pycs, pycs of Python < 3.7 and pycs
without a source beside them. Nothing else in a pyc is touched, so the result
is a pure function of the tree (reproducible builds stay reproducible).

Why a header rewrite and not recompiling to unchecked-hash pycs: it needs no
interpreter (a build host may have none, or another version, or another
architecture), it cannot change what the bytecode does, and mtime checking stays
on, so a source edited inside a sandbox (new mtime) is still recompiled, where an
unchecked-hash pyc would silently keep running the old code.

Never follows a symlinked directory or pyc, never writes outside ``root``.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from .erofs import NORMALISED_MTIME
from .unpack import resolve_in_root

PYCACHE = "__pycache__"
HEADER_SIZE = 16
_MTIME_OFFSET = 8
_FIRST_PEP552_MAGIC = 3392  # Python 3.7a4: the header gained its flags word
_LAST_PY3_MAGIC = 19999  # Python 2 magic numbers start at 20121
_FLAG_HASH_BASED = 0b01
_FLAG_CHECK_SOURCE = 0b10


class Verdict(enum.Enum):
    """What :func:`judge_header` makes of one pyc."""

    REWRITE = "rewrite"  # matched its source; the mtime field gets the normalised time
    CURRENT = "current"  # already says the normalised time and the source's size
    HASH_BASED = "hash_based"  # checked or unchecked hash pyc: no mtime to fix
    STALE = "stale"  # did not match its source before either: left for Python to recompile
    NOT_A_PYC = "not_a_pyc"  # truncated, garbage, unknown flags, or Python < 3.7


def judge_header(
    header: bytes, *, source_mtime: int, source_size: int, mtime: int = NORMALISED_MTIME
) -> Verdict:
    """Decide what to do with a pyc whose first bytes are ``header``, given its source's
    ``st_mtime`` and ``st_size`` before normalisation. Pure; never raises."""
    if len(header) < HEADER_SIZE or header[2:4] != b"\r\n":
        return Verdict.NOT_A_PYC
    magic = int.from_bytes(header[0:2], "little")
    if not _FIRST_PEP552_MAGIC <= magic <= _LAST_PY3_MAGIC:
        return Verdict.NOT_A_PYC
    flags = int.from_bytes(header[4:8], "little")
    if flags & _FLAG_HASH_BASED:
        known = flags & ~(_FLAG_HASH_BASED | _FLAG_CHECK_SOURCE) == 0
        return Verdict.HASH_BASED if known else Verdict.NOT_A_PYC
    if flags != 0:
        return Verdict.NOT_A_PYC
    recorded_mtime = int.from_bytes(header[8:12], "little")
    recorded_size = int.from_bytes(header[12:16], "little")
    # The interpreter compares both fields modulo 2**32 (importlib._bootstrap_external).
    if recorded_size != source_size & 0xFFFFFFFF:
        return Verdict.STALE
    if recorded_mtime == mtime & 0xFFFFFFFF:
        return Verdict.CURRENT
    if recorded_mtime != source_mtime & 0xFFFFFFFF:
        return Verdict.STALE
    return Verdict.REWRITE


def source_for(pyc_name: str) -> str | None:
    """``NAME.TAG.pyc`` or ``NAME.TAG.opt-N.pyc`` (a file in ``__pycache__``) -> ``NAME.py``;
    None for any other name (as ``importlib.util.source_from_cache`` would refuse it)."""
    if not pyc_name.endswith(".pyc"):
        return None
    stem = pyc_name[: -len(".pyc")]
    dots = stem.count(".")
    if dots not in (1, 2) or stem.startswith("."):
        return None
    if dots == 2:
        opt = stem.rsplit(".", 1)[1]
        if not opt.startswith("opt-") or not opt[4:].isalnum():
            return None
    return stem.partition(".")[0] + ".py"


@dataclass
class PycStats:
    """Counts of one pass over a tree, by verdict; ``orphans`` have no source beside them."""

    counts: dict[Verdict, int] = field(default_factory=lambda: dict.fromkeys(Verdict, 0))
    orphans: int = 0
    foreign_owner: bool = False
    """Some entry is owned by another user (only looked for with ``check_owners``)."""

    @property
    def rewritten(self) -> int:
        return self.counts[Verdict.REWRITE]

    def __str__(self) -> str:
        parts = [f"{n} {v.value}" for v, n in self.counts.items() if n]
        if self.orphans:
            parts.append(f"{self.orphans} without source")
        return ", ".join(parts) or "no bytecode"


def _walk_pycaches(root: str, stats: PycStats, check_owners: bool) -> Iterator[str]:
    """Every ``__pycache__`` directory under ``root`` (symlinked directories not followed)."""
    uid = os.geteuid()
    if check_owners:
        stats.foreign_owner = os.lstat(root).st_uid != uid
    stack = [root]
    while stack:
        d = stack.pop()
        try:
            it = os.scandir(d)
        except OSError:
            continue
        with it:
            for entry in it:
                if check_owners and not stats.foreign_owner:
                    with contextlib.suppress(OSError):
                        stats.foreign_owner = entry.stat(follow_symlinks=False).st_uid != uid
                if entry.is_dir(follow_symlinks=False):
                    if entry.name == PYCACHE:
                        yield entry.path
                    stack.append(entry.path)


def _source_stat(root: str, source: str) -> os.stat_result | None:
    """``stat`` of a source the way Python inside the image sees it: symlinks resolved
    with ``root`` as ``/``; None unless it is a regular file."""
    try:
        st = os.lstat(source)
        if stat.S_ISLNK(st.st_mode):
            rel = os.path.relpath(source, root)
            st = os.stat(resolve_in_root(root, rel, follow_last=True))
    except (OSError, ValueError):
        return None
    return st if stat.S_ISREG(st.st_mode) else None


def _rewrite(path: str, header: bytes, mtime: int) -> bool:
    """Put ``mtime`` into the header of the pyc at ``path`` in place (hard links share it);
    False if the file changed under us or cannot be written."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except PermissionError:
        # A read-only pyc of ours (built unprivileged): open it up for the write only.
        st = os.lstat(path)
        if st.st_uid != os.geteuid():
            return False
        os.chmod(path, stat.S_IMODE(st.st_mode) | stat.S_IWUSR)
        try:
            return _rewrite(path, header, mtime)
        finally:
            os.chmod(path, stat.S_IMODE(st.st_mode))
    try:
        if os.pread(fd, HEADER_SIZE, 0) != header:
            return False
        os.pwrite(fd, (mtime & 0xFFFFFFFF).to_bytes(4, "little"), _MTIME_OFFSET)
        return True
    finally:
        os.close(fd)


def normalize_pycs(
    root: str | os.PathLike[str],
    *,
    mtime: int = NORMALISED_MTIME,
    dry_run: bool = False,
    check_owners: bool = False,
) -> PycStats:
    """Make every timestamp-based pyc under ``root`` that matches its source record ``mtime``
    instead (see the module docstring). ``dry_run`` only counts what would change;
    ``check_owners`` also notes whether any entry belongs to another user."""
    root_s = os.fspath(Path(root).absolute())
    stats = PycStats()
    for cache in _walk_pycaches(root_s, stats, check_owners):
        parent = os.path.dirname(cache)
        try:
            entries = list(os.scandir(cache))
        except OSError:
            continue
        for entry in entries:
            src_name = source_for(entry.name)
            if src_name is None or not entry.is_file(follow_symlinks=False):
                continue
            src = _source_stat(root_s, os.path.join(parent, src_name))
            if src is None:
                stats.orphans += 1
                continue
            try:
                with open(entry.path, "rb") as f:
                    header = f.read(HEADER_SIZE)
            except OSError as e:
                if e.errno not in (errno.EACCES, errno.EPERM):
                    raise
                stats.counts[Verdict.NOT_A_PYC] += 1
                continue
            verdict = judge_header(
                header, source_mtime=int(src.st_mtime), source_size=src.st_size, mtime=mtime
            )
            if verdict is Verdict.REWRITE and not dry_run and not _rewrite(entry.path, header, mtime):
                verdict = Verdict.STALE  # could not be written: Python recompiles it, as before
            stats.counts[verdict] += 1
    return stats


__all__ = ["NORMALISED_MTIME", "PycStats", "Verdict", "judge_header", "normalize_pycs", "source_for"]
