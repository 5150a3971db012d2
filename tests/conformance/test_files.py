"""Files: the ``files(sandbox_id)`` object (read, write, list, mkdir, remove, stat): round
trips of text, binary and an 8 MiB file, agreeing with what commands inside see; and every
attempt to leave the sandbox's root (``..``, absolute and relative symlinks pointing out,
symlink loops) stays inside it: refused with FileAccessError whenever the target is not the
sandbox's own, and a canary on the host is never read, changed or joined by anything.

Contract (fsops): paths resolve as if the sandbox's root were ``/``, like a chroot, so
``../../etc/passwd`` is the *sandbox's* /etc/passwd, never the host's.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dsec.backends.base import Capability
from dsec.errors import DsecError, FileAccessError

from .conftest import BackendHarness

pytestmark = [pytest.mark.root, pytest.mark.timeout(90), pytest.mark.requires(Capability.FILES)]


def test_write_read_round_trip(backend: BackendHarness, sb: Any) -> None:
    f = backend.impl.files(sb.id)
    f.write("/tmp/hello.txt", b"hello\n")
    assert f.read("/tmp/hello.txt") == b"hello\n"
    assert backend.ok(sb.id, "cat /tmp/hello.txt") == "hello\n"  # commands see what was written
    backend.ok(sb.id, "echo from-inside > /tmp/inside.txt")
    assert f.read("/tmp/inside.txt") == b"from-inside\n"  # and the other way
    f.write("/tmp/hello.txt", b"replaced")
    assert f.read("/tmp/hello.txt") == b"replaced"
    assert f.stat("/tmp/hello.txt").size == 8 and f.exists("/tmp/hello.txt")
    assert not f.exists("/tmp/never-written")


def test_binary_content(backend: BackendHarness, sb: Any) -> None:
    f = backend.impl.files(sb.id)
    data = bytes(range(256)) * 64 + b"\x00\xff\r\n\x00"
    f.write("/tmp/bin", data)
    assert f.read("/tmp/bin") == data
    out = backend.ok(sb.id, "sha256sum /tmp/bin").split()[0]
    assert out == hashlib.sha256(data).hexdigest()


def test_large_file(backend: BackendHarness, sb: Any) -> None:
    f = backend.impl.files(sb.id)
    data = secrets.token_bytes(8 << 20)
    f.write("/tmp/large", data)
    assert backend.ok(sb.id, "sha256sum /tmp/large; stat -c %s /tmp/large").split()[::2] == [
        hashlib.sha256(data).hexdigest(), str(8 << 20)]
    assert f.read("/tmp/large") == data
    backend.ok(sb.id, "head -c 8388608 /dev/urandom > /tmp/made-inside")
    got = f.read("/tmp/made-inside")
    assert len(got) == 8 << 20
    assert hashlib.sha256(got).hexdigest() == backend.ok(sb.id, "sha256sum /tmp/made-inside").split()[0]


def test_list_mkdir_remove(backend: BackendHarness, sb: Any) -> None:
    f = backend.impl.files(sb.id)
    f.mkdir("/work/a/b", parents=True)
    f.write("/work/a/one", b"1")
    f.write("/work/a/b/two", b"22")
    listing = {i.name: (i.type, i.size) for i in f.list("/work/a")}
    assert listing == {"b": ("dir", listing["b"][1]), "one": ("file", 1)}, listing
    assert backend.ok(sb.id, "find /work | sort").split() == ["/work", "/work/a", "/work/a/b", "/work/a/b/two",
                                                               "/work/a/one"]
    with pytest.raises(FileAccessError):
        f.mkdir("/work/a")  # exists
    with pytest.raises(FileAccessError):
        f.remove("/work/a")  # not empty
    f.remove("/work/a/one")
    assert [i.name for i in f.list("/work/a")] == ["b"]
    f.remove("/work", recursive=True)
    assert not f.exists("/work")
    assert backend.sh(sb.id, "test -e /work").exit_code == 1
    with pytest.raises(FileAccessError):
        f.read("/work/a/b/two")
    with pytest.raises(FileAccessError):
        f.remove("/no/such/thing")
    with pytest.raises(FileAccessError):
        f.list("/etc/passwd")  # not a directory
    with pytest.raises(FileAccessError):
        f.read("/etc")  # a directory


# ------------------------------------------------------------ traversal ----


@pytest.fixture
def canary() -> Iterator[Path]:
    """A host directory with a file no sandbox has; the test checks it is never touched."""
    d = Path(tempfile.mkdtemp(prefix="dsec-cf-canary-"))
    (d / "canary").write_bytes(b"host secret " + secrets.token_bytes(16))
    os.chmod(d, 0o777)  # nothing but the confinement keeps a sandbox out
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _state(d: Path) -> dict[str, tuple[bytes, int, int]]:
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns, p.stat().st_ino) for p in d.iterdir()}


def _refused(call: Any, *args: Any, **kw: Any) -> FileAccessError:
    """``call`` must fail with FileAccessError, not another error and not success."""
    try:
        got = call(*args, **kw)
    except DsecError as exc:
        assert type(exc) is FileAccessError, f"{call.__name__}{args}: {exc!r} (wanted FileAccessError)"
        return exc
    raise AssertionError(f"{call.__name__}{args} was not refused: returned {got!r:.200}")


def test_dotdot_stays_inside(backend: BackendHarness, sb: Any, canary: Path) -> None:
    f = backend.impl.files(sb.id)
    before = _state(canary)
    mark = f"sandbox-{secrets.token_hex(4)}"
    backend.ok(sb.id, f"echo {mark} >> /etc/passwd")
    ours = backend.ok(sb.id, "cat /etc/passwd").encode()
    for path in ("../../etc/passwd", "/../../../../etc/passwd", "tmp/../../../etc/passwd"):
        try:
            got = f.read(path)
        except FileAccessError:
            continue
        assert got == ours, f"read({path!r}) gave something other than the sandbox's own file"
    up = "../" * 12
    _refused(f.read, f"{up}{canary}/canary")
    _refused(f.list, f"{up}{canary}")
    _refused(f.write, f"{up}{canary}/canary", b"pwned")
    _refused(f.write, f"{up}{canary}/new", b"pwned")
    _refused(f.mkdir, f"{up}{canary}/newdir")
    _refused(f.remove, f"{up}{canary}/canary")
    _refused(f.stat, f"{up}{canary}/canary")
    assert _state(canary) == before


def test_symlinks_pointing_out_stay_inside(backend: BackendHarness, sb: Any, canary: Path) -> None:
    f = backend.impl.files(sb.id)
    before = _state(canary)
    rel = "../" * 12 + str(canary).lstrip("/")
    backend.ok(sb.id, f"ln -s {canary}/canary /tmp/abs-file; ln -s {canary} /tmp/abs-dir; "
                      f"ln -s {rel} /tmp/rel-dir; ln -s / /tmp/root")
    for link in ("/tmp/abs-file", "/tmp/abs-dir/canary", "/tmp/rel-dir/canary", f"/tmp/root{canary}/canary"):
        _refused(f.read, link)
    for d in ("/tmp/abs-dir", "/tmp/rel-dir", f"/tmp/root{canary}"):
        _refused(f.list, d)
        _refused(f.write, f"{d}/new", b"pwned")
        _refused(f.write, f"{d}/canary", b"pwned")
        _refused(f.mkdir, f"{d}/newdir")
        _refused(f.remove, f"{d}/canary")
    assert _state(canary) == before
    assert backend.sh(sb.id, f"cat {canary}/canary").exit_code != 0  # nor can commands inside


def test_symlink_loops_are_refused(backend: BackendHarness, sb: Any) -> None:
    f = backend.impl.files(sb.id)
    backend.ok(sb.id, "ln -s /tmp/loop-b /tmp/loop-a; ln -s /tmp/loop-a /tmp/loop-b; ln -s self /tmp/self")
    for path in ("/tmp/loop-a", "/tmp/self"):
        _refused(f.read, path)
        _refused(f.list, path)
        _refused(f.write, f"{path}/x", b"x")
        _refused(f.mkdir, f"{path}/d")
    assert [i.name for i in f.list("/tmp") if i.name.startswith(("loop", "self"))] == ["loop-a", "loop-b", "self"]
