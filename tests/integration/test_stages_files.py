"""The files API obeys the current stage's file rules, as Landlock makes processes do.

Agents' file tools usually reach a sandbox through the files API (host side, where
Landlock does not bind), so without this a hidden /tests would be one
``files.read`` away. Paths are judged where they resolve to: symlinks the agent
plants do not lead around a rule.
"""

from __future__ import annotations

import io
import tarfile
from collections.abc import Iterator
from typing import Any

import pytest
from test_stages import SECRET, _spec, _stage, h  # noqa: F401  (the module's runtime fixture)

from conftest import RuntimeHarness
from dsec.errors import FileAccessError

pytestmark = pytest.mark.root


@pytest.fixture
def rollout(h: RuntimeHarness) -> Iterator[Any]:  # noqa: F811
    rec = h.run(h.rt.create(_spec()))
    try:
        # planted in the open stage, used after the switch
        h.ok(rec.id, "ln -s /tests /workspace/t; ln -s ../tests/expected /workspace/e; mkdir -p /workspace/sub")
        _stage(h, rec.id, "rollout")
        yield rec
    finally:
        h.destroy(rec.id)


def _denied(fn: Any, *args: Any, **kw: Any) -> FileAccessError:
    with pytest.raises(FileAccessError) as ei:
        fn(*args, **kw)
    assert ei.value.errno == 13, ei.value
    return ei.value


def test_hidden_paths_cannot_be_read_listed_or_written(h: RuntimeHarness, rollout: Any) -> None:  # noqa: F811
    fs = h.rt.files(rollout.id)
    for path in ("/tests/expected", "/workspace/t/expected", "/workspace/e", "//tests/../tests/expected"):
        err = _denied(fs.read, path)
        assert "hidden" in str(err) and SECRET not in str(err)
    _denied(fs.list, "/tests")
    _denied(fs.list, "/workspace/t")
    _denied(fs.stat, "/tests/expected")
    _denied(fs.write, "/tests/expected", b"forged")
    _denied(fs.write, "/workspace/t/new", b"x")
    with pytest.raises(FileAccessError):  # the final symlink is never followed for writes (ELOOP)
        fs.append("/workspace/e", b"x")
    _denied(fs.mkdir, "/tests/d")
    _denied(fs.remove, "/tests/expected")
    _denied(fs.rename, "/tests/expected", "/workspace/stolen")
    _denied(fs.download, "/tests")
    # a download of a parent leaves the hidden subtree out
    with tarfile.open(fileobj=io.BytesIO(fs.download("/workspace")), mode="r") as tar:
        names = tar.getnames()
        assert "sub" in names and "answer" in names
        for m in tar.getmembers():
            if m.isreg():
                f = tar.extractfile(m)
                assert f is not None and SECRET.encode() not in f.read()
    assert "expected" in [e.name for e in h.rt.files(rollout.id, platform=True).list("/tests")]
    assert h.rt.files(rollout.id, platform=True).read("/tests/expected").decode().strip() == SECRET


def test_read_only_paths_cannot_change_but_can_be_read(h: RuntimeHarness, rollout: Any) -> None:  # noqa: F811
    fs = h.rt.files(rollout.id)
    assert fs.read("/etc/passwd")
    _denied(fs.write, "/etc/passwd", b"root::0:0::/:/bin/sh\n")
    _denied(fs.append, "/etc/passwd", b"x")
    _denied(fs.remove, "/bin/sh")
    _denied(fs.rename, "/bin/sh", "/workspace/sh")
    _denied(fs.mkdir, "/etc/new")
    tar = io.BytesIO()
    with tarfile.open(fileobj=tar, mode="w") as t:
        info = tarfile.TarInfo("passwd")
        info.size = 3
        t.addfile(info, io.BytesIO(b"own"))
        ln = tarfile.TarInfo("hard")
        ln.type = tarfile.LNKTYPE
        ln.linkname = "passwd"
        t.addfile(ln)
    _denied(fs.upload, "/etc", tar.getvalue())
    # writable places still work, and a hard link out of a read-only path is refused
    fs.write("/workspace/sub/ok.txt", b"fine")
    assert fs.read("/workspace/sub/ok.txt") == b"fine"
    _denied(fs._hardlink, "/etc/passwd", "/workspace/sub/pw")
    assert h.ok(rollout.id, "cat /workspace/sub/ok.txt") == "fine"


def test_open_stage_and_default_ro_stage(h: RuntimeHarness) -> None:  # noqa: F811
    rec = h.run(h.rt.create(_spec()))
    try:
        fs = h.rt.files(rec.id)
        assert fs.read("/tests/expected").decode().strip() == SECRET  # setup: no rules
        _stage(h, rec.id, "locked")  # default ro, /workspace and /tmp writable
        fs = h.rt.files(rec.id)
        fs.write("/workspace/x", b"1")
        fs.write("/tmp/y", b"2")
        _denied(fs.write, "/etc/z", b"3")
        _denied(fs.write, "/tests/expected", b"4")
        assert fs.read("/tests/expected").decode().strip() == SECRET  # readable, not writable
    finally:
        h.destroy(rec.id)


def test_recursive_changes_cannot_reach_protected_paths_below(h: RuntimeHarness) -> None:  # noqa: F811
    rec = h.run(h.rt.create(_spec()))
    try:
        _stage(h, rec.id, "nested")  # /workspace rw, /workspace/private hidden, .../open read-only
        fs = h.rt.files(rec.id)
        _denied(fs.remove, "/workspace", recursive=True)
        _denied(fs.rename, "/workspace", "/workspace2")
        _denied(fs.read, "/workspace/private/key")
        assert fs.read("/workspace/private/open/notes") == b"notes\n"
        _denied(fs.write, "/workspace/private/open/notes", b"x")
        fs.write("/workspace/answer", b"mine\n")
        assert h.rt.files(rec.id, platform=True).read("/workspace/private/key") == b"private-key\n"
    finally:
        h.destroy(rec.id)
