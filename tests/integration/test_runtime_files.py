"""The host-side files API: round trips, ownership, and confinement to the sandbox root.

Every confinement test plants a host file and a sandbox file at the *same*
path with different content, then makes the sandbox point at it in every way
it can (``..``, absolute symlinks, symlinked directories, /proc magic links,
races); the API must return the sandbox's content or refuse, never the host's.
"""

from __future__ import annotations

import errno
import io
import os
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

import pytest

from conftest import RuntimeHarness
from dsec.errors import FileAccessError, InvalidSpec, SandboxNotFound

pytestmark = pytest.mark.root


def _tar(members: list[tuple[tarfile.TarInfo, bytes | None]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in members:
            if data is not None:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
            else:
                tar.addfile(info)
    return buf.getvalue()


def _member(name: str, kind: bytes = tarfile.REGTYPE, *, linkname: str = "", mode: int = 0o644) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.type = kind
    ti.linkname = linkname
    ti.mode = mode
    return ti


@pytest.fixture
def host_secret(dsec_base: Path):
    """A host-only directory with a secret file; the sandbox gets a decoy at the same path."""
    d = dsec_base / f"host-secret-{os.getpid()}-{time.monotonic_ns()}"
    d.mkdir()
    (d / "secret").write_text("HOST-SECRET")
    yield d
    (d / "secret").unlink(missing_ok=True)
    for p in sorted(d.rglob("*"), reverse=True):
        p.unlink() if not p.is_dir() or p.is_symlink() else p.rmdir()
    d.rmdir()


def _read(f, path: str) -> bytes:
    """files.read(), retrying the spurious EAGAIN that openat2(RESOLVE_IN_ROOT) gives for a
    ".." met during a concurrent host rename (see test_dotdot_symlink_survives_host_renames)."""
    for _ in range(50):
        try:
            return f.read(path)
        except FileAccessError as exc:
            if exc.errno != errno.EAGAIN:
                raise
    return f.read(path)


# -------------------------------------------------------------- round trip ----


def test_files_round_trip(rtx: RuntimeHarness, sb) -> None:
    f = rtx.rt.files(sb.id)
    f.write("/tmp/a.txt", b"hello")
    assert f.read("/tmp/a.txt") == b"hello"
    assert rtx.ok(sb.id, "cat /tmp/a.txt") == "hello"
    f.write("/tmp/a.txt", b"replaced")  # atomic replace, no temp file left behind
    assert f.read("/tmp/a.txt") == b"replaced"
    assert [i.name for i in f.list("/tmp")] == ["a.txt"]
    f.append("/tmp/a.txt", b"+more")
    f.append("/tmp/new.log", b"line1\n")
    f.append("/tmp/new.log", b"line2\n")
    assert f.read("/tmp/a.txt") == b"replaced+more"
    assert rtx.ok(sb.id, "cat /tmp/new.log") == "line1\nline2\n"
    # stat and ownership: root inside, the mapped uid on the host.
    st = f.stat("/tmp/a.txt")
    assert (st.type, st.size, st.uid, st.gid, st.name) == ("file", 13, 0, 0, "a.txt")
    assert os.stat(rtx.rt.root_path(sb.id) / "tmp/a.txt").st_uid == sb.uid_base
    assert rtx.ok(sb.id, "stat -c %u:%g:%a /tmp/a.txt").strip() == "0:0:644"
    f.write("/tmp/u1000", b"x", user=1000, mode=0o600)
    assert rtx.ok(sb.id, "stat -c %u:%a /tmp/u1000").strip() == "1000:600"
    assert rtx.ok(sb.id, "cat /tmp/u1000", user=1000) == "x"
    assert f.stat("/").type == "dir"
    # mkdir / rename / remove
    f.mkdir("/work/deep/er", parents=True)
    assert f.stat("/work/deep/er").type == "dir"
    f.mkdir("/work/deep/er", parents=True)  # exists: fine with parents
    with pytest.raises(FileAccessError) as ei:
        f.mkdir("/work/deep/er")
    assert ei.value.errno == errno.EEXIST
    f.write("/work/deep/er/file", b"1")
    f.rename("/work/deep/er/file", "/work/moved")
    assert f.read("/work/moved") == b"1" and not f.exists("/work/deep/er/file")
    with pytest.raises(FileAccessError) as ei:
        f.remove("/work/deep")
    assert ei.value.errno == errno.ENOTEMPTY
    f.remove("/work/deep", recursive=True)
    f.remove("/work/moved")
    assert f.list("/work") == []
    assert rtx.ok(sb.id, "ls -A /work") == ""
    # Lower-layer files: readable, deletable (whiteout), listable.
    assert f.read("/etc/passwd").startswith(b"root:x:0:0:")
    f.remove("/etc/group")
    assert rtx.sh(sb.id, "test -e /etc/group").exit_code == 1
    sym = next(i for i in f.list("/bin") if i.name == "ls")
    assert (sym.type, sym.target) == ("symlink", "busybox")
    # Errors are typed, with the errno.
    with pytest.raises(FileAccessError) as ei:
        f.read("/nope")
    assert ei.value.errno == errno.ENOENT and "/nope" in str(ei.value)
    with pytest.raises(FileAccessError):
        f.list("/etc/passwd")
    with pytest.raises(InvalidSpec):
        f.read("/tmp/a\0b")
    with pytest.raises(SandboxNotFound):
        rtx.rt.files("sb-not-here")


def test_upload_download_round_trip(rtx: RuntimeHarness, sb) -> None:
    f = rtx.rt.files(sb.id)
    data = _tar([
        (_member("proj", tarfile.DIRTYPE, mode=0o755), None),
        (_member("proj/src", tarfile.DIRTYPE, mode=0o750), None),
        (_member("proj/src/main.py", mode=0o644), b"print('hi')\n"),
        (_member("proj/run.sh", mode=0o755), b"#!/bin/sh\necho ran\n"),
        (_member("proj/link", tarfile.SYMTYPE, linkname="src/main.py"), None),
        (_member("proj/hard", tarfile.LNKTYPE, linkname="proj/run.sh"), None),
    ])
    n = f.upload("/work", data)
    assert n == 6
    assert rtx.ok(sb.id, "cat /work/proj/src/main.py /work/proj/link") == "print('hi')\n" * 2
    assert rtx.ok(sb.id, "/work/proj/run.sh").strip() == "ran"
    assert rtx.ok(sb.id, "stat -c %a /work/proj/src /work/proj/run.sh").split() == ["750", "755"]
    assert rtx.ok(sb.id, "stat -c %i /work/proj/run.sh /work/proj/hard").split()[0] == rtx.ok(
        sb.id, "stat -c %i /work/proj/hard").strip()
    rtx.ok(sb.id, "echo extra > /work/proj/src/extra.txt")
    out = f.download("/work/proj")
    with tarfile.open(fileobj=io.BytesIO(out)) as tar:
        members = {m.name: m for m in tar.getmembers()}
        assert {"src", "src/main.py", "src/extra.txt", "run.sh", "link", "hard"} <= set(members)
        assert tar.extractfile(members["src/main.py"]).read() == b"print('hi')\n"
        assert tar.extractfile(members["src/extra.txt"]).read() == b"extra\n"
        assert members["link"].issym() and members["link"].linkname == "src/main.py"
        assert members["run.sh"].mode == 0o755
        assert all(m.uid == 0 for m in members.values())
        assert not any(m.name.startswith(("/", "..")) for m in members.values())


# ------------------------------------------------------------ confinement ----


def test_dotdot_stays_in_the_root(rtx: RuntimeHarness, sb, host_secret: Path) -> None:
    f = rtx.rt.files(sb.id)
    rtx.ok(sb.id, f"mkdir -p {host_secret} && echo SANDBOX-DECOY > {host_secret}/secret")
    for p in (f"../../../../..{host_secret}/secret", f"/../../{host_secret}/secret", f"{host_secret}/../{host_secret.name}/secret"):
        assert f.read(p) == b"SANDBOX-DECOY\n", p
    assert f.read("../../../etc/passwd") == f.read("/etc/passwd") != Path("/etc/passwd").read_bytes()
    # Writing with .. lands inside the sandbox.
    name = f"dsec-dotdot-{os.getpid()}"
    f.write(f"../../../../{name}", b"in-sandbox")
    assert rtx.ok(sb.id, f"cat /{name}") == "in-sandbox"
    assert not Path("/" + name).exists()
    assert not (host_secret.parent / name).exists()
    assert (host_secret / "secret").read_text() == "HOST-SECRET"


def test_absolute_symlinks_resolve_inside(rtx: RuntimeHarness, sb, host_secret: Path) -> None:
    f = rtx.rt.files(sb.id)
    host_shadow = Path("/etc/shadow").read_bytes() if Path("/etc/shadow").exists() else None
    rtx.ok(sb.id, f"""
        mkdir -p {host_secret} && echo SANDBOX-DECOY > {host_secret}/secret
        echo sandbox-shadow > /etc/shadow
        ln -s {host_secret}/secret /tmp/to-secret
        ln -s {host_secret} /tmp/to-dir
        ln -s /etc/shadow /tmp/to-shadow
        ln -s / /tmp/to-root
        ln -s ../../../../../../ /tmp/up
    """)
    assert f.read("/tmp/to-secret") == b"SANDBOX-DECOY\n"
    assert f.read("/tmp/to-dir/secret") == b"SANDBOX-DECOY\n"
    assert f.read(f"/tmp/to-root{host_secret}/secret") == b"SANDBOX-DECOY\n"
    assert _read(f, f"/tmp/up{host_secret}/secret") == b"SANDBOX-DECOY\n"
    shadow = f.read("/tmp/to-shadow")
    assert shadow == b"sandbox-shadow\n" and shadow != host_shadow
    assert _read(f, "/tmp/up/etc/passwd") == f.read("/etc/passwd")
    # With the decoy gone, the symlinks dangle: an error, never the host file.
    rtx.ok(sb.id, f"rm -rf {host_secret}")
    for p in ("/tmp/to-secret", "/tmp/to-dir/secret", f"/tmp/to-root{host_secret}/secret"):
        with pytest.raises(FileAccessError) as ei:
            f.read(p)
        assert ei.value.errno == errno.ENOENT, p
    with pytest.raises(FileAccessError):
        f.list("/tmp/to-dir")
    # Writes, appends, mkdirs and uploads through those links stay inside too.
    with pytest.raises(FileAccessError):
        f.append("/tmp/to-secret", b"x")  # a symlink as the last component is refused
    with pytest.raises(FileAccessError):
        f.write("/tmp/to-dir/evil", b"x")  # the link's target does not exist inside
    f.write("/tmp/to-secret", b"replaced-link")  # replaces the link itself
    assert rtx.ok(sb.id, "test -L /tmp/to-secret || cat /tmp/to-secret") == "replaced-link"
    marker = f"dsec-made-{os.getpid()}"
    f.mkdir(f"/tmp/to-root/{marker}", parents=True)
    assert rtx.sh(sb.id, f"test -d /{marker}").exit_code == 0 and not Path("/" + marker).exists()
    rtx.ok(sb.id, f"rm -rf {host_secret}; ln -sfn {host_secret.parent} /tmp/to-parent")
    f.upload("/tmp/to-parent/uploaded", _tar([(_member("evil.txt"), b"evil")]))
    assert not (host_secret.parent / "uploaded").exists()
    assert rtx.ok(sb.id, f"cat {host_secret.parent}/uploaded/evil.txt") == "evil"
    # download keeps links as links: no content through them.
    out = f.download("/tmp")
    with tarfile.open(fileobj=io.BytesIO(out)) as tar:
        for m in tar.getmembers():
            if m.name in ("to-shadow", "to-root", "up", "to-dir"):
                assert m.issym() and m.size == 0
    assert (host_secret / "secret").read_text() == "HOST-SECRET"
    assert sorted(p.name for p in host_secret.iterdir()) == ["secret"]


def test_proc_magic_links_and_other_mounts_are_refused(rtx: RuntimeHarness, sb) -> None:
    f = rtx.rt.files(sb.id)
    rtx.ok(sb.id, "ln -s /proc/1/root /tmp/init-root; ln -s /proc/self/root /tmp/self-root; ln -s /proc/self/cwd /tmp/cwd")
    for p in (
        "/proc/self/root/etc/passwd", "/proc/1/root/etc/passwd", "/proc/self/environ",
        "/proc/1/environ", "/tmp/init-root/etc/passwd", "/tmp/self-root/etc/passwd",
        "/tmp/cwd/etc/passwd", "/proc/self/fd/0", "/dev/zero", "/sys/kernel",
    ):
        with pytest.raises(FileAccessError) as ei:
            f.read(p)
        assert ei.value.errno in (errno.EXDEV, errno.ELOOP), (p, ei.value)
    for p in ("/proc", "/proc/1", "/dev", "/sys"):
        with pytest.raises(FileAccessError):
            f.list(p + "/x" if p == "/sys" else p + "/")
    with pytest.raises(FileAccessError):
        f.write("/proc/sys/vm/swappiness", b"1")
    with pytest.raises(FileAccessError):
        f.download("/proc")


def test_symlink_race_never_reaches_the_host(rtx: RuntimeHarness, sb, host_secret: Path) -> None:
    """A loop inside flips /tmp/race between a directory and a symlink to the host path."""
    f = rtx.rt.files(sb.id)
    rtx.ok(sb.id, f"mkdir -p {host_secret} && echo SANDBOX-DECOY > {host_secret}/secret")
    rtx.ok(sb.id, f"""
        (while :; do
            rm -rf /tmp/race; ln -s {host_secret} /tmp/race
            rm -f /tmp/race; mkdir /tmp/race; echo dir-version > /tmp/race/secret
        done) >/dev/null 2>&1 &
    """)
    seen: set[bytes] = set()
    errors = 0
    deadline = time.monotonic() + 1.5
    while time.monotonic() < deadline:
        try:
            seen.add(f.read("/tmp/race/secret"))
        except FileAccessError:
            errors += 1
    assert b"HOST-SECRET" not in seen
    assert seen <= {b"SANDBOX-DECOY\n", b"dir-version\n", b""}, seen
    assert seen, "the race loop never produced a readable file"
    rtx.sh(sb.id, "kill -9 -1")  # stop the flipper (root inside may kill its own processes)


def test_dotdot_symlink_survives_host_renames(rtx: RuntimeHarness, sb, dsec_base: Path) -> None:
    f = rtx.rt.files(sb.id)
    rtx.ok(sb.id, "ln -s ../../../../ /tmp/up")
    expected = f.read("/etc/passwd")
    storm_dir = dsec_base / f"rename-storm-{os.getpid()}-{time.monotonic_ns()}"
    storm_dir.mkdir()
    (storm_dir / "a").write_text("x")
    # What any busy host does all the time: atomic file replacements (another process).
    storm = subprocess.Popen([sys.executable, "-c", (
        "import os, sys\n"
        "a, b = sys.argv[1] + '/a', sys.argv[1] + '/b'\n"
        "while True:\n    os.rename(a, b); os.rename(b, a)\n"
    ), str(storm_dir)])
    failures: list[FileAccessError] = []
    reads = 0
    try:
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline and not failures:
            reads += 1
            try:
                assert f.read("/tmp/up/etc/passwd") == expected
            except FileAccessError as exc:
                failures.append(exc)
    finally:
        storm.kill()
        storm.wait()
        for p in storm_dir.iterdir():
            p.unlink()
        storm_dir.rmdir()
    assert not failures, f"read {reads} failed: {failures[0]} (errno {failures[0].errno})"


# ----------------------------------------------------------------- upload ----

BAD_UPLOADS = {
    "dotdot": [(_member("../escaped.txt"), b"x")],
    "dotdot-nested": [(_member("ok/../../escaped.txt"), b"x")],
    "absolute": [(_member("/tmp/abs-escaped.txt"), b"x")],
    "chardev": [(_member("null", tarfile.CHRTYPE), None)],
    "blockdev": [(_member("disk", tarfile.BLKTYPE), None)],
    "fifo": [(_member("fifo", tarfile.FIFOTYPE), None)],
    "good-then-bad": [(_member("first.txt"), b"first"), (_member("../escaped.txt"), b"x")],
}


@pytest.mark.parametrize("case", sorted(BAD_UPLOADS))
def test_bad_uploads_are_refused_and_write_nothing(rtx: RuntimeHarness, sb, case: str) -> None:
    f = rtx.rt.files(sb.id)
    f.mkdir("/dest")
    before = rtx.ok(sb.id, "find / -xdev | sort")
    with pytest.raises(FileAccessError) as ei:
        f.upload("/dest", _tar(BAD_UPLOADS[case]))
    assert "upload" in str(ei.value)
    assert f.list("/dest") == []
    assert rtx.ok(sb.id, "find / -xdev | sort") == before
    assert not Path("/tmp/abs-escaped.txt").exists()


def test_upload_refuses_garbage(rtx: RuntimeHarness, sb) -> None:
    with pytest.raises(InvalidSpec):
        rtx.rt.files(sb.id).upload("/dest", b"this is not a tar archive at all" * 100)


def test_refused_upload_creates_no_target_directory(rtx: RuntimeHarness, sb) -> None:
    f = rtx.rt.files(sb.id)
    with pytest.raises(FileAccessError):
        f.upload("/never/made", _tar([(_member("../escaped.txt"), b"x")]))
    assert not f.exists("/never")


def test_upload_hardlink_outside_the_tree_is_refused(rtx: RuntimeHarness, sb) -> None:
    f = rtx.rt.files(sb.id)
    with pytest.raises(FileAccessError):
        f.upload("/dest/sub", _tar([(_member("pw", tarfile.LNKTYPE, linkname="../../etc/passwd"), None)]))
    assert not f.exists("/dest/sub/pw")


# ------------------------------------------------- special files, messages ----


@pytest.mark.parametrize("op", ["read", "append"])
def test_fifo_made_inside_does_not_hang_the_host(rtx: RuntimeHarness, sb, op: str) -> None:
    f = rtx.rt.files(sb.id)
    rtx.ok(sb.id, "mkfifo /tmp/fifo")
    outcome: dict[str, object] = {}

    def call() -> None:
        try:
            outcome["value"] = f.read("/tmp/fifo") if op == "read" else f.append("/tmp/fifo", b"x")
        except Exception as exc:
            outcome["error"] = exc

    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(2)
    hung = t.is_alive()
    if hung:  # release the host thread: open the other end from inside
        peer = "echo x > /tmp/fifo" if op == "read" else "cat /tmp/fifo > /dev/null"
        rtx.sh(sb.id, f"timeout 5 sh -c '{peer}'")
        t.join(5)
    assert not hung, f"files.{op}() on a FIFO blocked the caller for 2 s"
    assert isinstance(outcome.get("error"), FileAccessError)


def test_read_errors_say_what_is_wrong(rtx: RuntimeHarness, sb) -> None:
    f = rtx.rt.files(sb.id)
    with pytest.raises(FileAccessError) as ei:
        f.read("/etc")
    assert "not a regular file" in str(ei.value), str(ei.value)
    with pytest.raises(FileAccessError) as ei:
        f.read("/etc/passwd", max_bytes=4)
    assert "limit" in str(ei.value), str(ei.value)
