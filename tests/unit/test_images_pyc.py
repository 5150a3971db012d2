"""Python bytecode made valid for a layer's normalised mtimes (dsec.images.pyc).

No root, no mkfs: real pycs written by this interpreter's py_compile, checked
by this interpreter's importer (``python3 -v``) after the sources' mtimes are
set to 0 the way ``mkfs.erofs -T0`` sets them.
"""

from __future__ import annotations

import io
import os
import py_compile
import subprocess
import sys
import tarfile
from importlib.util import MAGIC_NUMBER, cache_from_source
from pathlib import Path

import pytest

from dsec.images.pyc import NORMALISED_MTIME, Verdict, judge_header, normalize_pycs, source_for
from dsec.images.unpack import unpack_tar

T0 = 1_700_000_000  # when the distribution's sources were "installed"


def _header(flags: int = 0, mtime: int = T0, size: int = 100, magic: bytes = MAGIC_NUMBER) -> bytes:
    return magic + flags.to_bytes(4, "little") + mtime.to_bytes(4, "little") + size.to_bytes(4, "little")


PY36_MAGIC = (3379).to_bytes(2, "little") + b"\r\n"
PY27_MAGIC = (62211).to_bytes(2, "little") + b"\r\n"


@pytest.mark.parametrize(
    ("header", "mtime", "size", "want"),
    [
        (_header(), T0, 100, Verdict.REWRITE),
        (_header(mtime=0), T0, 100, Verdict.CURRENT),  # already normalised
        (_header(mtime=0), 0, 100, Verdict.CURRENT),
        (_header(mtime=T0 - 1), T0, 100, Verdict.STALE),  # stale before: stays stale
        (_header(), T0, 101, Verdict.STALE),  # same time, other size
        (_header(mtime=0), T0, 101, Verdict.STALE),
        (_header(mtime=5), 2**32 + 5, 100, Verdict.REWRITE),  # compared modulo 2**32, like Python
        (_header(size=7), T0, 2**32 + 7, Verdict.REWRITE),
        (_header(flags=1), T0, 100, Verdict.HASH_BASED),  # unchecked hash
        (_header(flags=3), T0, 100, Verdict.HASH_BASED),  # checked hash
        (_header(flags=2), T0, 100, Verdict.NOT_A_PYC),  # check_source without hash: undefined
        (_header(flags=4), T0, 100, Verdict.NOT_A_PYC),
        (_header(flags=5), T0, 100, Verdict.NOT_A_PYC),
        (_header()[:15], T0, 100, Verdict.NOT_A_PYC),  # truncated
        (b"", T0, 100, Verdict.NOT_A_PYC),
        (b"\x00" * 16, T0, 100, Verdict.NOT_A_PYC),
        (b"#!/bin/sh\necho hi\n", T0, 100, Verdict.NOT_A_PYC),
        (_header(magic=PY36_MAGIC), T0, 100, Verdict.NOT_A_PYC),  # 12-byte header layout
        (_header(magic=PY27_MAGIC), T0, 100, Verdict.NOT_A_PYC),
        (_header(magic=b"\x10\x0d\r\r"), T0, 100, Verdict.NOT_A_PYC),
    ],
)  # fmt: skip
def test_judge_header(header: bytes, mtime: int, size: int, want: Verdict) -> None:
    assert judge_header(header, source_mtime=mtime, source_size=size) is want


@pytest.mark.parametrize(
    ("name", "want"),
    [("json.cpython-311.pyc", "json.py"), ("__init__.cpython-311.opt-1.pyc", "__init__.py"),
     ("x.cpython-312.opt-2.pyc", "x.py"), ("x.pyc", None), ("x.cpython-311.opt-z!.pyc", None),
     ("x.a.b.c.pyc", None), ("x.cpython-311.o1.pyc", None), ("x.cpython-311.py", None),
     (".cpython-311.pyc", None)],
)  # fmt: skip
def test_source_for_mirrors_importlib(name: str, want: str | None) -> None:
    assert source_for(name) == want
    if want is not None:  # the stdlib agrees
        from importlib.util import source_from_cache

        assert Path(source_from_cache(f"/d/__pycache__/{name}")).name == want


def _module(root: Path, rel: str, body: str, *, mode: py_compile.PycInvalidationMode | None = None) -> Path:
    """A module and its pyc, compiled while the source says ``T0`` (like a distro install)."""
    src = root / rel
    src.parent.mkdir(parents=True, exist_ok=True)
    src.write_text(body)
    os.utime(src, (T0, T0))
    py_compile.compile(
        str(src), doraise=True,
        invalidation_mode=mode or py_compile.PycInvalidationMode.TIMESTAMP,
    )  # fmt: skip
    return Path(cache_from_source(str(src)))


def _zero_mtimes(root: Path) -> None:
    """What mkfs.erofs -T0 does to every inode."""
    for dirpath, dirnames, filenames in os.walk(root):
        for n in dirnames + filenames:
            os.utime(os.path.join(dirpath, n), (0, 0), follow_symlinks=False)


def _imports(root: Path, *modules: str) -> str:
    """``python -v`` importing ``modules`` from ``root``, bytecode never written: its stderr."""
    code = "import sys; sys.path.insert(0, sys.argv[1]); " + "; ".join(f"import {m}" for m in modules)
    proc = subprocess.run(
        [sys.executable, "-v", "-S", "-B", "-c", code, str(root)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return proc.stderr


def test_rewritten_pycs_are_used_after_mtimes_are_zeroed(tmp_path: Path) -> None:
    root = tmp_path / "tree"
    good = _module(root, "pkg/__init__.py", "X = 1\n")
    mod = _module(root, "pkg/mod.py", "Y = 2\n")
    before = mod.read_bytes()
    # Without the rewrite the importer finds every pyc stale once mtimes are zeroed...
    plain = tmp_path / "plain"
    subprocess.run(["cp", "-a", str(root), str(plain)], check=True)
    _zero_mtimes(plain)
    out = _imports(plain, "pkg.mod")
    assert "bytecode is stale for 'pkg.mod'" in out and "bytecode is stale for 'pkg'" in out
    # ...with it, it uses them.
    stats = normalize_pycs(root)
    assert stats.rewritten == 2 and stats.counts[Verdict.STALE] == 0
    after = mod.read_bytes()
    assert after[8:12] == NORMALISED_MTIME.to_bytes(4, "little")
    assert after[:8] == before[:8] and after[12:] == before[12:]  # nothing else changed
    _zero_mtimes(root)
    out = _imports(root, "pkg.mod")
    assert "stale" not in out, out
    assert f"# {mod} matches {root / 'pkg/mod.py'}" in out
    assert f"# {good} matches {root / 'pkg/__init__.py'}" in out
    # Normalising again is a no-op: the same tree, the same bytes.
    assert normalize_pycs(root).counts[Verdict.CURRENT] == 2
    assert mod.read_bytes() == after


def test_what_is_left_alone(tmp_path: Path) -> None:
    root = tmp_path / "tree"
    stale = _module(root, "stale.py", "A = 1\n")
    (root / "stale.py").write_text("A = 22\n")  # edited after compiling: stale on the host too
    os.utime(root / "stale.py", (T0 + 60, T0 + 60))
    checked = _module(root, "checked.py", "B = 1\n", mode=py_compile.PycInvalidationMode.CHECKED_HASH)
    unchecked = _module(root, "unchecked.py", "C = 1\n", mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)
    cache = root / "__pycache__"
    tag = sys.implementation.cache_tag
    truncated = cache / f"short.{tag}.pyc"
    (root / "short.py").write_text("D = 1\n")
    truncated.write_bytes(stale.read_bytes()[:10])
    garbage = cache / f"junk.{tag}.pyc"
    (root / "junk.py").write_text("E = 1\n")
    garbage.write_bytes(os.urandom(64))
    orphan = cache / f"gone.{tag}.pyc"
    orphan.write_bytes(_header())
    link = cache / f"linked.{tag}.pyc"
    (root / "linked.py").write_text("x" * 100)
    os.utime(root / "linked.py", (T0, T0))
    os.symlink(stale.name, link)  # a symlinked pyc is not followed
    legacy = root / "legacy.pyc"  # sourceless-style names are not __pycache__ entries
    legacy.write_bytes(_header())
    files = [stale, checked, unchecked, truncated, garbage, orphan, legacy]
    before = {p: p.read_bytes() for p in files}
    stats = normalize_pycs(root)
    assert {p: p.read_bytes() for p in files} == before
    assert stats.rewritten == 0 and stats.orphans == 1
    assert stats.counts[Verdict.STALE] == 1 and stats.counts[Verdict.HASH_BASED] == 2
    assert stats.counts[Verdict.NOT_A_PYC] == 2
    _zero_mtimes(root)
    out = _imports(root, "stale", "checked")
    assert "bytecode is stale for 'stale'" in out  # recompiled, as it would be on the host
    assert f"# {checked} matches" in out  # checked-hash pycs do not care about mtimes


def test_dry_run_symlinked_source_and_hard_links(tmp_path: Path) -> None:
    root = tmp_path / "tree"
    real = _module(root, "usr/share/pkg/real.py", "R = 1\n")
    # An absolute symlink means a path inside the image, not on this host.
    (root / "usr/lib/pkg").mkdir(parents=True)
    os.symlink("/usr/share/pkg/real.py", root / "usr/lib/pkg/real.py")
    (root / "usr/lib/pkg/__pycache__").mkdir()
    via_link = root / "usr/lib/pkg/__pycache__" / real.name
    os.link(real, via_link)  # one inode, two names (compileall --hardlink-dupes)
    before = real.read_bytes()
    plan = normalize_pycs(root, dry_run=True)
    assert plan.rewritten == 2 and real.read_bytes() == before
    stats = normalize_pycs(root)
    # The first name rewrites the shared inode; the second finds it done.
    assert stats.rewritten == 1 and stats.counts[Verdict.CURRENT] == 1
    assert via_link.read_bytes()[8:12] == b"\0\0\0\0" and os.stat(via_link).st_nlink == 2


def test_read_only_pyc_of_ours_is_rewritten_and_keeps_its_mode(tmp_path: Path) -> None:
    root = tmp_path / "tree"
    pyc = _module(root, "ro.py", "Z = 1\n")
    os.chmod(pyc, 0o444)
    assert normalize_pycs(root).rewritten == 1
    assert pyc.read_bytes()[8:12] == b"\0\0\0\0"
    assert pyc.stat().st_mode & 0o777 == 0o444


def test_unpack_keeps_regular_files_mtimes(tmp_path: Path) -> None:
    """A tar's pycs can only be judged if its sources keep their times through unpack."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for name, mtime in (("a.py", T0), ("b.txt", 12345)):
            info = tarfile.TarInfo(name)
            info.size, info.mtime = 3, mtime
            tf.addfile(info, io.BytesIO(b"x=1"))
    buf.seek(0)
    unpack_tar(buf, tmp_path)
    assert os.stat(tmp_path / "a.py").st_mtime == T0
    assert os.stat(tmp_path / "b.txt").st_mtime == 12345
