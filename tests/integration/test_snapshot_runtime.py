"""pack_diff on the real kernel: a sandbox's writable layer becomes a snapshot layer.

Integrity is checked by walking both root filesystems from the host (through
``/proc/<init>/root``) and comparing every entry: type, mode, owner, size,
mtime, symlink target, content hash, user xattrs and hard-link groups. The
writes cover what an overlay upper holds: new files, modified lower files,
deletions (whiteouts), replaced directories (opaque), a file turned into a
directory and back, sparse files. Snapshots of snapshots, collapsing a long
chain, snapshots of a paused sandbox, a full disk while packing, and removing
layers that something still needs are covered too.
"""

from __future__ import annotations

import errno
import gc
import hashlib
import os
import shutil
import stat
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import CGROUP_ROOT, MiB, RuntimeHarness, mountinfo_lines, pid_alive, wait_until
from dsec.backends.common.uppers import UpperUsage
from dsec.backends.container import snapshot as snapshots
from dsec.backends.container.runtime import ContainerRuntime
from dsec.errors import InvalidSpec, LayerInUse, SandboxFailed, SandboxStateError
from dsec.images import LocalLayerStore, build_from_dir
from dsec.images.diff import Excluder
from dsec.images.errors import StorageFull
from dsec.images.layer import LayerKind
from dsec.spec import ImageRef, Resources, SandboxSpec, SandboxState

pytestmark = pytest.mark.root

SKIP_TOP = {"proc", "sys", "dev"}


def manifest(h: RuntimeHarness, sid: str, *, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """Every entry of the sandbox's root as the sandbox sees it (ids in its own range)."""
    rec = h.rt.get(sid)
    root = f"/proc/{rec.init_pid}/root"
    base = rec.uid_base
    out: dict[str, Any] = {}
    inodes: dict[int, list[str]] = {}

    def walk(rel: str) -> None:
        for name in sorted(os.listdir(root + rel)):
            path = f"{rel.rstrip('/')}/{name}"
            if (rel == "/" and name in SKIP_TOP) or any(path == s or path.startswith(s + "/") for s in skip):
                continue
            st = os.lstat(root + path)
            entry: dict[str, Any] = {
                "type": stat.S_IFMT(st.st_mode), "mode": stat.S_IMODE(st.st_mode),
                "uid": st.st_uid - base, "gid": st.st_gid - base,
            }
            xa = {x: os.getxattr(root + path, x, follow_symlinks=False)
                  for x in os.listxattr(root + path, follow_symlinks=False) if x.startswith("user.")}
            if xa:
                entry["xattrs"] = xa
            if stat.S_ISLNK(st.st_mode):
                entry["target"] = os.readlink(root + path)
            elif stat.S_ISREG(st.st_mode):
                entry["size"] = st.st_size
                entry["mtime"] = st.st_mtime_ns // 10**9
                entry["blocks_small"] = st.st_blocks * 512 < 4 * MiB
                with open(root + path, "rb") as f:
                    entry["sha"] = hashlib.sha256(f.read()).hexdigest()
                if st.st_nlink > 1:
                    inodes.setdefault(st.st_ino, []).append(path)
            elif stat.S_ISDIR(st.st_mode):
                walk(path)
            out[path] = entry

    walk("/")
    out["#hardlinks"] = sorted(sorted(v) for v in inodes.values() if len(v) > 1)
    return out


@pytest.fixture(scope="module")
def snap(make_runtime: Callable[[str], RuntimeHarness], dsec_base: Path) -> Iterator[RuntimeHarness]:
    h = make_runtime("snap").start()
    # A workspace layer with content to delete, replace and change from inside the sandbox.
    ws = dsec_base / "snap-ws"
    for d in ("ws/keep", "ws/replace", "ws/dir_to_file", "ws/deep/a/b"):
        (ws / d).mkdir(parents=True, exist_ok=True)
    for f, text in (("ws/keep/a", "a"), ("ws/replace/x", "x"), ("ws/replace/y", "y"), ("ws/delete_me", "gone"),
                    ("ws/dir_to_file/z", "z"), ("ws/file_to_dir", "f"), ("ws/modify", "old"),
                    ("ws/deep/a/b/c", "c")):
        (ws / f).write_text(text)
    h.ws = build_from_dir(h.rt.store, ws, name="ws", tag="test", kind="workspace")
    try:
        yield h
    finally:
        h.close()
    assert not h.leftovers(), h.leftovers()


def _spec(base: str, *, workspace: str | None = None, **res: Any) -> SandboxSpec:
    return SandboxSpec(image=ImageRef(base=base, workspace=workspace), resources=Resources(**res))


def _create(h: RuntimeHarness, spec: SandboxSpec) -> Any:
    rec = h.run(h.rt.create(spec))
    from conftest import _TRAIL

    _TRAIL.append((h, rec.id))
    return rec


WRITES = r"""
set -e
mkdir -p /data/sub /data/cache /data/empty
printf 'hello' > /data/a && chmod 640 /data/a
printf 'suid' > /data/suid && chmod 4755 /data/suid
printf 'owned' > /data/owned && chown 1000:2000 /data/owned
mkdir /data/private && chown 1001:1001 /data/private && chmod 700 /data/private
printf 'p' > /data/private/p
ln -s a /data/link && ln -s /nowhere /data/dangling && ln -s /etc/passwd /data/abs
printf 'linked' > /data/h1 && ln /data/h1 /data/h2 && ln /data/h1 /data/sub/h3
head -c 2097152 /dev/urandom > /data/random
dd if=/dev/zero of=/data/sparse bs=1 count=1 seek=104857599 2>/dev/null
touch -d '2001-02-03 04:05:06' /data/a
mkfifo /data/fifo
printf 'junk' > /data/cache/junk && printf 'x' > /data/sub/mod.pyc
rm /ws/delete_me
rm -rf /ws/replace && mkdir /ws/replace && printf 'new' > /ws/replace/only
rm -rf /ws/dir_to_file && printf 'now a file' > /ws/dir_to_file
rm /ws/file_to_dir && mkdir /ws/file_to_dir && printf 'inside' > /ws/file_to_dir/in
printf 'new' > /ws/modify
rm /ws/deep/a/b/c
rm /etc/group
rm /bin/vi
"""


def test_snapshot_keeps_everything_and_new_sandboxes_start_from_it(snap: RuntimeHarness) -> None:
    h = snap
    parent = _create(h, _spec("busybox:test", workspace="ws:test"))
    child = None
    try:
        h.ok(parent.id, WRITES)
        os.setxattr(f"/proc/{parent.init_pid}/root/data/a", "user.note", b"kept")
        os.setxattr(f"/proc/{parent.init_pid}/root/data/sub", "user.dir", b"d")
        own = ("/etc/hostname", "/etc/hosts")  # every sandbox's own (the child's are checked below)
        want = manifest(h, parent.id, skip=("/data/cache", "/tmp", *own))
        want.pop("/data/sub/mod.pyc")
        layer = h.run(h.rt.snapshot(parent.id, name="integrity", exclude=["/data/cache", "*.pyc", "/tmp"]))
        assert layer.kind is LayerKind.SNAPSHOT and layer.name == "integrity"
        assert list(layer.parents) == h.rt.get(parent.id).layers
        assert h.rt.get(parent.id).state is SandboxState.RUNNING
        h.ok(parent.id, "echo after > /data/after")  # not in the snapshot
        child = _create(h, _spec("integrity"))  # a snapshot brings its lineage
        assert h.rt.get(child.id).layers == [layer.digest, *layer.parents]
        got = manifest(h, child.id, skip=("/data/cache", "/tmp", *own))
        assert got.pop("/data/after", None) is None
        diff = {k: (want.get(k), got.get(k)) for k in set(want) | set(got) if want.get(k) != got.get(k)}
        assert not diff, diff
        # The points that matter, spelled out.
        assert got["/data/a"]["mode"] == 0o640 and got["/data/a"]["xattrs"] == {"user.note": b"kept"}
        assert got["/data/a"]["mtime"] == 981173106
        assert got["/data/suid"]["mode"] == 0o4755
        assert (got["/data/owned"]["uid"], got["/data/owned"]["gid"]) == (1000, 2000)
        assert got["/data/private"]["mode"] == 0o700 and got["/data/private"]["uid"] == 1001
        assert got["/data/link"]["target"] == "a" and got["/data/abs"]["target"] == "/etc/passwd"
        assert ["/data/h1", "/data/h2", "/data/sub/h3"] in got["#hardlinks"]
        assert got["/data/sparse"]["size"] == 100 * MiB and got["/data/sparse"]["blocks_small"]
        assert stat.S_ISFIFO(got["/data/fifo"]["type"])
        assert "/data/cache" not in got and "/data/sub/mod.pyc" not in got
        for gone in ("/ws/delete_me", "/ws/deep/a/b/c", "/etc/group", "/bin/vi", "/ws/replace/x", "/ws/dir_to_file/z"):
            assert gone not in got, gone
        assert sorted(p for p in got if p.startswith("/ws/replace/")) == ["/ws/replace/only"]
        assert got["/ws/dir_to_file"]["type"] == stat.S_IFREG
        assert got["/ws/file_to_dir"]["type"] == stat.S_IFDIR and "/ws/file_to_dir/in" in got
        assert h.ok(child.id, "cat /ws/modify /ws/keep/a; cat /data/h2") == "newalinked"
        assert h.ok(child.id, "hostname").strip() == child.id
        assert h.ok(child.id, "cat /etc/hostname") == f"{child.id}\n"  # not the parent's, kept in the snapshot
        assert f"127.0.1.1\t{child.id}\n" in h.ok(child.id, "cat /etc/hosts") and parent.id not in h.ok(
            child.id, "cat /etc/hosts")
        # The child's own writes stay its own.
        h.ok(child.id, "echo mine > /data/a")
        assert h.ok(parent.id, "cat /data/a") == "hello"
    finally:
        if child is not None:
            h.destroy(child.id)
        h.destroy(parent.id)


def test_snapshots_of_snapshots_collapse_and_keep_deletions(snap: RuntimeHarness) -> None:
    h = snap
    made: list[str] = []
    try:
        h.rt.max_layers = 3
        a = _create(h, _spec("busybox:test", workspace="ws:test"))
        made.append(a.id)
        h.ok(a.id, "echo 1 > /gen1 && rm /ws/keep/a && echo gone1 > /gone1 && mkdir /dir1 && echo d > /dir1/f")
        s1 = h.run(h.rt.snapshot(a.id, name="chain", tag="1"))
        assert len([s1.digest, *s1.parents]) == 3  # s1 + ws + busybox
        b = _create(h, _spec("chain:1"))
        made.append(b.id)
        h.ok(b.id, "echo 2 > /gen2 && rm /gone1 && rm -rf /dir1 && mkdir /dir1 && echo new > /dir1/g && rm /ws/modify")
        s2 = h.run(h.rt.snapshot(b.id, name="chain", tag="2"))
        # [s2, s1, ws, busybox] would be 4 > 3: s1 was merged into s2.
        assert list(s2.parents) == [h.rt.store.resolve("ws:test").digest, h.rt.store.resolve("busybox:test").digest]
        c = _create(h, _spec("chain:2"))
        made.append(c.id)
        assert len(h.rt.get(c.id).layers) == 3
        out = h.ok(c.id, "cat /gen1 /gen2; ls /dir1; ls /gone1 /ws/keep/a /ws/modify 2>&1 | wc -l; cat /ws/replace/x")
        assert out == "1\n2\ng\n3\nx"
        h.ok(c.id, "echo 3 > /gen3 && rm /gen1")
        s3 = h.run(h.rt.snapshot(c.id, name="chain", tag="3"))
        assert len(s3.parents) == 2
        d = _create(h, _spec("chain:3"))
        made.append(d.id)
        assert h.ok(d.id, "cat /gen2 /gen3; test -e /gen1 || echo nogen1") == "2\n3\nnogen1\n"
    finally:
        h.rt.max_layers = snapshots.DEFAULT_MAX_LAYERS
        for sid in made:
            h.destroy(sid)


def test_snapshot_of_a_paused_sandbox_leaves_it_paused(snap: RuntimeHarness) -> None:
    h = snap
    with h.sandbox() as rec:
        h.ok(rec.id, "echo paused > /state")
        h.run(h.rt.pause(rec.id))
        layer = h.run(h.rt.snapshot(rec.id, name="paused"))
        assert h.rt.get(rec.id).state is SandboxState.PAUSED
        fz = CGROUP_ROOT / "freezer" / "dsec" / h.name / rec.id / "freezer.state"
        assert fz.read_text().strip() == "FROZEN"
        child = _create(h, _spec(layer.digest))
        try:
            assert h.ok(child.id, "cat /state") == "paused\n"
        finally:
            h.destroy(child.id)


def test_snapshot_refusals_are_typed(snap: RuntimeHarness) -> None:
    h = snap
    with h.sandbox() as rec:
        with pytest.raises(InvalidSpec):
            h.run(h.rt.snapshot(rec.id, name="Bad Name"))
        with pytest.raises(InvalidSpec) as ei:
            h.run(h.rt.snapshot(rec.id, exclude=["relative/path"]))
        assert ei.value.fields["field"] == "exclude"
        os.kill(rec.init_pid, 9)
        assert wait_until(lambda: not pid_alive(rec.init_pid))
        with pytest.raises(SandboxFailed):
            h.run(h.rt.snapshot(rec.id))
        with pytest.raises(SandboxStateError):
            h.run(h.rt.snapshot(rec.id))  # now marked failed
    # A snapshot used by a sandbox, or beneath another snapshot, cannot be removed.
    with h.sandbox() as rec:
        s = h.run(h.rt.snapshot(rec.id, name="inuse"))
        child = _create(h, _spec("inuse"))
        try:
            with pytest.raises(LayerInUse):
                h.rt.store.remove("inuse")
            grand = h.run(h.rt.snapshot(child.id, name="ontop"))
        finally:
            h.destroy(child.id)
        h.rt.layers.maybe_release(s.digest)  # the runtime's 1 s grace, now
        assert not h.rt.store.holders(s.digest)
        with pytest.raises(LayerInUse) as e3:  # unpinned, but "ontop" is a diff over it
            h.rt.store.remove(s.digest)
        assert e3.value.fields["holders"] == [f"snapshot:{grand.digest}"]
        h.rt.store.remove("ontop")
        h.rt.store.remove("inuse")  # unused now: fine


def test_image_must_sit_on_the_snapshots_lineage(snap: RuntimeHarness) -> None:
    h = snap
    with h.sandbox() as rec:
        s = h.run(h.rt.snapshot(rec.id, name="lineage"))
        ok = SandboxSpec(image=ImageRef(base="busybox:test", toolkits=("lineage",)))
        wrong = SandboxSpec(image=ImageRef(base="ws:test", toolkits=("lineage",)))
        assert h.rt.layers.stack_for(ok.image) == [s.digest, *s.parents]
        with pytest.raises(InvalidSpec):
            h.run(h.rt.create(wrong))


def test_excluder_patterns() -> None:
    ex = Excluder(["/root/.cache", "*.pyc", "/tmp/*.log", "__pycache__"])
    assert ex.matches("/root/.cache", ".cache") and ex.matches("/root/.cache/x/y", "y")
    assert not ex.matches("/root/.cachet", ".cachet")
    assert ex.matches("/a/b/c.pyc", "c.pyc") and ex.matches("/tmp/a.log", "a.log")
    assert ex.matches("/x/__pycache__", "__pycache__") and not ex.matches("/tmp/a.txt", "a.txt")
    for bad in ("rel/path", "/a/../b"):
        with pytest.raises(ValueError):
            Excluder([bad])


@pytest.fixture
def small_store(dsec_base: Path, busybox_seed: Path) -> Iterator[LocalLayerStore]:
    # A small ext4 on a loop device (file-backed EROFS cannot mount an image that lives on tmpfs).
    mp, img = dsec_base / "small-store", dsec_base / "small-store.img"
    mp.mkdir(exist_ok=True)
    with open(img, "wb") as f:
        f.truncate(16 * MiB)
    subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", str(img)], check=True, capture_output=True)
    subprocess.run(["mount", "-o", "loop", str(img), str(mp)], check=True)
    try:
        store = LocalLayerStore(mp)
        store.add_erofs(busybox_seed, name="busybox", tag="test", kind="base")
        yield store
    finally:
        store.close()
        gc.collect()  # sqlite connections of the runtime's finished worker threads hold the index open
        r = subprocess.run(["umount", "-d", str(mp)], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        img.unlink()
    assert not [ln for ln in mountinfo_lines() if str(mp) in ln]


@pytest.mark.parametrize("stage", ["check", "copy", "mkfs"])
def test_full_disk_while_packing_is_typed_and_leaves_nothing(
    make_runtime: Callable[[str], RuntimeHarness], small_store: LocalLayerStore, stage: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    h = make_runtime(f"snap-full{stage[:3]}")
    h.rt = ContainerRuntime(name=h.name, state_dir=h.state_dir, run_dir=h.run_dir, layer_store=small_store)
    h.start()
    try:
        if shutil.which("mkfs.ext4") is None:
            pytest.skip("needs mkfs.ext4 for a small filesystem to fill")
        if stage != "check":  # get past the up-front check, so the copy or mkfs itself hits ENOSPC
            monkeypatch.setattr(snapshots, "SPACE_MARGIN", 0)
            monkeypatch.setattr(h.rt, "disk_usage", lambda _sid: UpperUsage(used=0, limit=64 * MiB))
        # "copy": the tree is copied beside the image (no RAM scratch), so the copy fills the disk;
        # otherwise the tree is in RAM and mkfs fills it.
        h.rt.snapshot_scratch = "store" if stage == "copy" else "auto"
        with h.sandbox(disk=64 * MiB, memory=256 * MiB) as rec:
            h.ok(rec.id, "head -c 16777216 /dev/urandom > /big && echo small > /small")
            before = {(lay.digest, lay.ref) for lay in small_store.list()}
            with pytest.raises(StorageFull) as ei:
                h.run(h.rt.snapshot(rec.id, name="toobig"))
            assert ei.value.fields["stage"] == stage and ei.value.code == "image_error"
            assert isinstance(ei.value, OSError)
            assert {(lay.digest, lay.ref) for lay in small_store.list()} == before
            assert list(small_store.tmp_dir.iterdir()) == []
            ram = snapshots.ram_scratch_root(h.rt)
            assert ram is None or not ram.exists() or list(ram.iterdir()) == []
            assert list(small_store.blob_dir.iterdir()) == [small_store.blob_path(d) for d, _ in before]
            # The sandbox runs on, thawed, its disk intact; a smaller snapshot works.
            assert h.rt.get(rec.id).state is SandboxState.RUNNING
            assert h.ok(rec.id, "cat /small") == "small\n"
            monkeypatch.undo()
            layer = h.run(h.rt.snapshot(rec.id, name="fits", exclude=["/big"]))
            assert layer.size < 1 * MiB
    finally:
        h.close()
    assert not h.leftovers()


def test_copy_error_paths_keep_errno() -> None:
    e = StorageFull("x", stage="copy", path="/p", errno=errno.ENOSPC)
    assert e.fields["errno"] == errno.ENOSPC


def _tree(root: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    inodes: dict[int, list[str]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for n in sorted(dirnames + filenames):
            p = Path(dirpath) / n
            rel = "/" + str(p.relative_to(root))
            st = os.lstat(p)
            e: dict[str, Any] = {"t": stat.S_IFMT(st.st_mode), "m": stat.S_IMODE(st.st_mode), "u": st.st_uid,
                                 "mt": st.st_mtime_ns}
            if stat.S_ISREG(st.st_mode):
                e["d"] = p.read_bytes()
                if st.st_nlink > 1:
                    inodes.setdefault(st.st_ino, []).append(rel)
            elif stat.S_ISLNK(st.st_mode):
                e["l"] = os.readlink(p)
            out[rel] = e
    out["#links"] = sorted(sorted(v) for v in inodes.values() if len(v) > 1)
    return out


def test_two_pass_copy_catches_every_change(tmp_path: Path) -> None:
    """The frozen second pass must leave the copy equal to the source, whatever changed after the first."""
    import time as _time

    from dsec.images.diff import apply_diff, open_dir, resync_diff

    src, dst = tmp_path / "src", tmp_path / "dst"
    for d in ("keep", "gone_dir/sub", "dir_to_file", "renamed_dir"):
        (src / d).mkdir(parents=True)
    for f, text in (("keep/a", "aaaa"), ("keep/same_size", "1111"), ("gone", "x"), ("gone_dir/sub/f", "f"),
                    ("dir_to_file/z", "z"), ("file_to_dir", "f"), ("linked", "L"), ("chmod_me", "c"),
                    ("renamed_dir/in", "i")):
        (src / f).write_text(text)
    os.link(src / "linked", src / "keep/linked2")
    dst.mkdir()
    seen: dict[str, tuple[int, int]] = {}
    since = _time.clock_gettime_ns(_time.CLOCK_REALTIME) - snapshots.PRECOPY_TICK_NS
    fd = open_dir(src)
    try:
        apply_diff(fd, dst, record=seen)
        # Changes after the first pass, the same-size overwrite within the same clock tick included.
        (src / "keep/same_size").write_text("2222")
        (src / "gone").unlink()
        shutil.rmtree(src / "gone_dir")
        shutil.rmtree(src / "dir_to_file")
        (src / "dir_to_file").write_text("now a file")
        (src / "file_to_dir").unlink()
        (src / "file_to_dir").mkdir()
        (src / "file_to_dir/in").write_text("in")
        os.chmod(src / "chmod_me", 0o600)
        os.link(src / "keep/a", src / "a_link")
        (src / "linked").write_text("L2")  # both names of that inode change
        os.rename(src / "renamed_dir", src / "moved_dir")
        (src / "new").write_text("new")
        st = resync_diff(fd, dst, seen, since)
    finally:
        os.close(fd)
    assert st.recopied and st.removed
    want = _tree(src)
    got = _tree(dst)
    assert {k: v for k, v in got.items() if v != want.get(k)} == {}
    assert set(got) == set(want)


def test_snapshot_of_a_busy_sandbox_is_one_instant(snap: RuntimeHarness) -> None:
    """A writer keeps B <= A <= B + 1 at every instant (renames are atomic); a torn copy would break it."""
    h = snap
    with h.sandbox() as rec:
        h.ok(rec.id, "mkdir /w; head -c 20000000 /dev/urandom > /w/ballast; i=0; "
                     "(while :; do i=$((i+1)); echo $i > /w/a.t; mv /w/a.t /w/A; echo $i > /w/b.t; mv /w/b.t /w/B; done)"
                     " >/dev/null 2>&1 &")
        for k in range(3):
            info = h.run(h.rt.snapshot_info(rec.id, name="busy", tag=str(k)))
            assert info.stats.recopied >= 1, info.stats  # the writer changed things during the first pass
            child = _create(h, _spec(info.layer.digest))
            try:
                a, b = (int(x) for x in h.ok(child.id, "cat /w/A /w/B").split())
                assert b <= a <= b + 1, (a, b)
            finally:
                h.destroy(child.id)
