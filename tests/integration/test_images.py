"""Image layers against the real thing: mkfs.erofs, file-backed EROFS mounts, debootstrap.

Every test works in a fresh directory whose path contains "dsec" and checks on
the way out that nothing is left mounted under it.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from dsec.cli.image import image_group
from dsec.errors import LayerInUse, LayerNotFound
from dsec.images import (
    LayerMounts,
    LocalLayerStore,
    UnsafeArchive,
    build_busybox,
    build_busybox_rootfs,
    build_debootstrap,
    build_from_dir,
    build_from_oci,
    build_from_tar,
)
from dsec.images.errors import LayerBuildError
from dsec.images.sysmount import MS_RDONLY, mount, mountinfo, umount

needs_mkfs = pytest.mark.skipif(shutil.which("mkfs.erofs") is None, reason="needs mkfs.erofs")
is_root = os.geteuid() == 0
root_only = [
    pytest.mark.root,
    pytest.mark.skipif(not is_root, reason="needs root (mount(2), chown)"),
]
pytestmark = [needs_mkfs]


def _mounts_under(path: Path) -> list[str]:
    prefix = str(path) + "/"
    return [m.mount_point for m in mountinfo() if m.mount_point.startswith(prefix)]


@pytest.fixture
def work() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="dsec-test-images-"))
    try:
        yield d
    finally:
        leaked = _mounts_under(d)
        for mp in sorted(leaked, key=len, reverse=True):
            umount(mp, 2)  # MNT_DETACH, so the directory can go
        shutil.rmtree(d)
        assert not leaked, f"test leaked mounts: {leaked}"


@pytest.fixture
def store(work: Path) -> LocalLayerStore:
    return LocalLayerStore(work / "store")


def _tree(root: Path) -> Path:
    """A small tree with the features images care about."""
    (root / "etc").mkdir(parents=True)
    (root / "etc/hostname").write_text("box\n")
    (root / "bin").mkdir()
    (root / "bin/tool").write_bytes(b"\x7fELF fake" * 100)
    os.chmod(root / "bin/tool", 0o4755)
    os.link(root / "bin/tool", root / "bin/tool-hard")
    os.symlink("tool", root / "bin/tool-sym")
    (root / "tmp").mkdir()
    os.chmod(root / "tmp", 0o1777)
    (root / "home/user").mkdir(parents=True)
    (root / "home/user/notes.txt").write_text("hello\n" * 1000)
    if is_root:
        os.chown(root / "home/user", 1000, 1000)
        os.chown(root / "home/user/notes.txt", 1000, 1000)
        os.chmod(root / "bin/tool", 0o4755)  # chown clears setuid; restore it
    os.chmod(root, 0o755)
    return root


def _leftovers(store: LocalLayerStore) -> list[str]:
    return os.listdir(store.tmp_dir)


# -- building --------------------------------------------------------------------


def test_build_from_dir_is_reproducible(work: Path, store: LocalLayerStore) -> None:
    src = _tree(work / "src")
    events: list[tuple[str, int, int | None]] = []
    a = build_from_dir(store, src, name="tree", tag="1", progress=lambda *e: events.append(e))
    b = build_from_dir(store, src, name="tree", tag="1")
    # The same content elsewhere, created in another order, at another time.
    copy = work / "copy"
    subprocess.run(["cp", "-a", str(src), str(copy)], check=True)
    (copy / "etc/hostname").unlink()
    (copy / "etc/hostname").write_text("box\n")
    c = build_from_dir(store, copy, name="tree-copy", tag="1")
    assert a.digest == b.digest == c.digest
    assert a.size == (store.root / "blobs/sha256" / f"{a.hex}.erofs").stat().st_size
    assert hashlib.sha256(store.open_local(a.digest).read_bytes()).hexdigest() == a.hex
    assert len(store.list()) == 2 and len(os.listdir(store.blob_dir)) == 1
    assert ("mkfs", 1, 1) in events and events[-1] == ("store", 1, 1)
    (src / "etc/hostname").write_text("other\n")
    assert build_from_dir(store, src, name="tree", tag="2").digest != a.digest
    assert _leftovers(store) == []


def _tar_of(src: Path, dest: Path, mode: str) -> Path:
    with tarfile.open(dest, mode) as tf:
        tf.add(src, arcname=".")
    return dest


@pytest.mark.parametrize("mode", ["w", "w:gz"])
def test_build_from_tar_matches_dir(work: Path, store: LocalLayerStore, mode: str) -> None:
    src = _tree(work / "src")
    from_dir = build_from_dir(store, src, name="d", tag="1")
    archive = _tar_of(src, work / ("t.tar" if mode == "w" else "t.tar.gz"), mode)
    seen: list[int] = []
    from_tar = build_from_tar(
        store,
        archive,
        name="t",
        tag="1",
        progress=lambda s, d, t: seen.append(d) if s == "unpack" else None,
    )
    # Modes, owners, setuid, hard links and symlinks all survive the round trip.
    assert from_tar.digest == from_dir.digest
    assert seen and seen[-1] == archive.stat().st_size
    assert _leftovers(store) == []


def test_unsafe_tar_fails_cleanly(work: Path, store: LocalLayerStore) -> None:
    archive = work / "evil.tar"
    with tarfile.open(archive, "w") as tf:
        ti = tarfile.TarInfo("../../escape")
        ti.size = 1
        tf.addfile(ti, io.BytesIO(b"x"))
    with pytest.raises(UnsafeArchive):
        build_from_tar(store, archive, name="evil", tag="1")
    assert _leftovers(store) == [] and store.list() == []
    assert not (work / "escape").exists() and not (store.root / "escape").exists()


# -- OCI layouts and docker save --------------------------------------------------


def _layer_tar(entries: list[tuple[str, bytes | None]], *, gz: bool) -> bytes:
    """A layer tar: (name, data) pairs; data None means a directory."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for name, data in entries:
            ti = tarfile.TarInfo(name)
            if data is None:
                ti.type, ti.mode = tarfile.DIRTYPE, 0o755
                tf.addfile(ti)
            else:
                ti.size, ti.mode = len(data), 0o644
                tf.addfile(ti, io.BytesIO(data))
    raw = buf.getvalue()
    return gzip.compress(raw, mtime=0) if gz else raw


LAYER1 = [
    ("etc", None), ("etc/a", b"a"), ("etc/b", b"b"), ("opq", None), ("opq/x", b"x"),
    ("opq/sub", None), ("opq/sub/y", b"y"), ("gone", None), ("gone/f", b"f"), ("keep", b"k"),
]  # fmt: skip
LAYER2 = [
    ("etc", None), ("etc/.wh.a", b""), ("opq", None), ("opq/z", b"z"),
    ("opq/.wh..wh..opq", b""), (".wh.gone", b""), ("etc/c", b"c"),
]  # fmt: skip


def _sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _write_oci_layout(d: Path, *, ref: str = "demo:1") -> None:
    blobs = d / "blobs/sha256"
    blobs.mkdir(parents=True)

    def put(data: bytes) -> str:
        digest = _sha(data)
        (blobs / digest.split(":")[1]).write_bytes(data)
        return digest

    l1 = _layer_tar(LAYER1, gz=True)
    l2 = _layer_tar(LAYER2, gz=False)
    config = json.dumps({
        "architecture": "amd64", "os": "linux",
        "rootfs": {"type": "layers", "diff_ids": [_sha(gzip.decompress(l1)), _sha(l2)]},
    }).encode()  # fmt: skip
    manifest = json.dumps({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                   "digest": put(config), "size": len(config)},
        "layers": [
            {"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": put(l1), "size": len(l1)},
            {"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": put(l2), "size": len(l2)},
        ],
    }).encode()  # fmt: skip
    mdigest = put(manifest)
    (d / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    (d / "index.json").write_text(json.dumps({
        "schemaVersion": 2,
        "manifests": [{
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "digest": mdigest, "size": len(manifest),
            "annotations": {"org.opencontainers.image.ref.name": ref},
            "platform": {"architecture": "amd64", "os": "linux"},
        }],
    }))  # fmt: skip


def _write_docker_save(path: Path) -> None:
    files = {
        "l1/layer.tar": _layer_tar(LAYER1, gz=False),
        "l2/layer.tar": _layer_tar(LAYER2, gz=False),
        "cfg.json": b'{"os": "linux"}',
        "manifest.json": json.dumps(
            [
                {
                    "Config": "cfg.json",
                    "RepoTags": ["demo:1"],
                    "Layers": ["l1/layer.tar", "l2/layer.tar"],
                }
            ]
        ).encode(),
        "repositories": b'{"demo": {"1": "l2"}}',
    }
    with tarfile.open(path, "w") as tf:
        for name, data in files.items():
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))


def _check_flattened(mp: Path) -> None:
    assert not (mp / "etc/a").exists()
    assert (mp / "etc/b").read_bytes() == b"b" and (mp / "etc/c").read_bytes() == b"c"
    assert sorted(os.listdir(mp / "opq")) == ["z"]
    assert not (mp / "gone").exists()
    assert (mp / "keep").read_bytes() == b"k"
    assert not [n for _, _, fs in os.walk(mp) for n in fs if n.startswith(".wh.")]


@pytest.mark.root
@pytest.mark.skipif(not is_root, reason="needs root (mount(2))")
def test_build_from_oci_layout_and_docker_save(work: Path, store: LocalLayerStore) -> None:
    layout = work / "layout"
    _write_oci_layout(layout)
    from_dir = build_from_oci(store, layout, name="demo", tag="oci-dir")
    oci_tar = work / "image.oci.tar"
    with tarfile.open(oci_tar, "w") as tf:
        for p in sorted(layout.rglob("*")):
            tf.add(p, arcname=str(p.relative_to(layout)), recursive=False)
    from_tar = build_from_oci(store, oci_tar, name="demo", tag="oci-tar", ref="demo:1")
    saved = work / "docker-save.tar"
    _write_docker_save(saved)
    from_docker = build_from_oci(store, saved, name="demo", tag="docker", ref="demo:1")
    # Three containers of the same two layers flatten to the same content.
    assert from_dir.digest == from_tar.digest == from_docker.digest
    with LayerMounts(store, work / "mnt") as mounts:
        mp = mounts.acquire(from_dir.digest, "t")
        _check_flattened(mp)
        mounts.release(from_dir.digest, "t")
    assert _leftovers(store) == []


def test_oci_errors_are_clear(work: Path, store: LocalLayerStore) -> None:
    layout = work / "layout"
    _write_oci_layout(layout)
    with pytest.raises(LayerBuildError, match="demo:1"):
        build_from_oci(store, layout, name="x", tag="1", ref="other")
    # Corrupt one layer blob: the digest check catches it.
    index = json.loads((layout / "index.json").read_text())
    mdigest = index["manifests"][0]["digest"].split(":")[1]
    manifest = json.loads((layout / "blobs/sha256" / mdigest).read_text())
    victim = layout / "blobs/sha256" / manifest["layers"][1]["digest"].split(":")[1]
    victim.write_bytes(_layer_tar([("evil", b"changed")], gz=False))
    with pytest.raises(LayerBuildError, match="corrupt"):
        build_from_oci(store, layout, name="x", tag="1")
    plain = work / "plain.tar"
    _tar_of(_tree(work / "t"), plain, "w")
    with pytest.raises(LayerBuildError, match="--from-tar"):
        build_from_oci(store, plain, name="x", tag="1")
    assert _leftovers(store) == [] and store.list() == []


# -- mounts ------------------------------------------------------------------------


def _loop_backing_files() -> set[str]:
    out = set()
    for f in Path("/sys/block").glob("loop*/loop/backing_file"):
        try:
            out.add(f.read_text().strip())
        except OSError:
            continue
    return out


@pytest.mark.root
@pytest.mark.skipif(not is_root, reason="needs root (mount(2))")
def test_mounts_share_one_file_backed_mount(work: Path, store: LocalLayerStore) -> None:
    layer = build_from_dir(store, _tree(work / "src"), name="tree", tag="1")
    blob = str(store.open_local(layer.digest))
    loops_before = _loop_backing_files()
    mounts = LayerMounts(store, work / "mnt")
    try:
        a = mounts.acquire(layer.digest, "sb-a")
        b = mounts.acquire(layer.digest, "sb-b")
        assert a == b == work / "mnt" / layer.hex
        lines = [m for m in mountinfo() if m.mount_point == str(a)]
        assert len(lines) == 1, lines
        m = lines[0]
        assert m.fstype == "erofs" and m.source == blob  # file-backed: the source is the file
        assert {"ro", "nosuid", "nodev"} <= set(m.options.split(","))
        assert _loop_backing_files() == loops_before and blob not in _loop_backing_files()
        # Content, owners and modes as built.
        assert (a / "etc/hostname").read_text() == "box\n"
        assert os.stat(a / "home/user/notes.txt").st_uid == 1000
        assert os.stat(a / "bin/tool").st_mode & 0o7777 == 0o4755
        assert os.stat(a / "bin/tool").st_ino == os.stat(a / "bin/tool-hard").st_ino
        assert os.readlink(a / "bin/tool-sym") == "tool"
        assert os.stat(a / "etc/hostname").st_mtime == 0
        with pytest.raises(OSError):
            (a / "etc/new").write_text("x")
        assert store.holders(layer.digest) == {"sb-a", "sb-b"}
        with pytest.raises(LayerInUse, match="sb-a"):
            store.remove("tree:1")
        mounts.release(layer.digest, "sb-a")
        assert mounts.unmount_unused() == []  # sb-b still holds it
        mounts.release(layer.digest, "sb-b")
        assert mounts.unmount_unused() == [layer.digest]
        assert _mounts_under(work) == [] and not a.exists()
        usage = store.disk_usage()
        store.remove("tree:1")
        assert not Path(blob).exists() and store.disk_usage() == usage - layer.size
        with pytest.raises(LayerNotFound):
            mounts.acquire(layer.digest, "sb-c")
        assert store.holders(layer.digest) == set()
    finally:
        mounts.close()


@pytest.mark.root
@pytest.mark.skipif(not is_root, reason="needs root (mount(2))")
def test_concurrent_acquire_mounts_once(work: Path, store: LocalLayerStore) -> None:
    layer = build_busybox(store)
    with LayerMounts(store, work / "mnt") as mounts:
        paths: list[Path] = []
        barrier = threading.Barrier(8)

        def grab(i: int) -> None:
            barrier.wait()
            paths.append(mounts.acquire(layer.digest, f"sb-{i}"))

        threads = [threading.Thread(target=grab, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(set(paths)) == 1 and len(_mounts_under(work / "mnt")) == 1
        assert store.unpin_all_except({"sb-3"}) == 7
        assert mounts.unmount_unused() == []
        mounts.release(layer.digest, "sb-3")
    assert _mounts_under(work) == []


@pytest.mark.root
@pytest.mark.skipif(not is_root, reason="needs root (mount(2))")
def test_two_backends_mounts_of_one_layer_each_go_with_their_own_pins(work: Path, store: LocalLayerStore) -> None:
    """Two backends of one edge mount the same layer, each under its own root. One closing
    while the other's sandbox still uses the layer unmounts its own mount (the other's pin
    keeps the other's mount only); an edge running the container and gVisor backends left
    the container's mount behind."""
    layer = build_busybox(store)
    first = LayerMounts(store, work / "mnt-a", holders=["runtime:a"])
    second = LayerMounts(store, work / "mnt-b", holders=["runtime:b"])
    try:
        a = first.acquire(layer.digest, "runtime:a")
        b = second.acquire(layer.digest, "runtime:b")
        assert a != b and _mounts_under(work / "mnt-a") and _mounts_under(work / "mnt-b")
        first.release(layer.digest, "runtime:a")
        first.close()
        assert _mounts_under(work / "mnt-a") == [], "a's mount stayed for b's pin"
        assert _mounts_under(work / "mnt-b") and (b / "bin/busybox").exists()
        second.release(layer.digest, "runtime:b")
    finally:
        first.close()
        second.close()
    assert _mounts_under(work / "mnt-b") == []


@pytest.mark.skipif(not is_root, reason="needs root (mount(2))")
def test_adopt_after_crash(work: Path, store: LocalLayerStore) -> None:
    layer = build_busybox(store)
    first = LayerMounts(store, work / "mnt")
    mp = first.acquire(layer.digest, "sb-1")
    del first  # "crash": no close(), the mount and the pin stay
    # A stray EROFS mount of a layer the store does not know, and a stale empty mountpoint.
    stray_img = work / "stray.erofs"
    subprocess.run(["mkfs.erofs", "--quiet", str(stray_img), str(work / "store/blobs")], check=True)
    stray = work / "mnt" / ("0" * 64)
    stray.mkdir()
    mount(str(stray_img), str(stray), "erofs", MS_RDONLY)
    stale = work / "mnt" / ("1" * 64)
    stale.mkdir()

    second = LayerMounts(LocalLayerStore(work / "store"), work / "mnt")
    try:
        assert second.adopt() == [layer.digest]
        assert _mounts_under(work / "mnt") == [str(mp)]
        assert not stray.exists() and not stale.exists()
        assert second.acquire(layer.digest, "sb-2") == mp
        assert len(_mounts_under(work / "mnt")) == 1
        assert (mp / "bin/busybox").is_file()
        second.release(layer.digest, "sb-1")
        second.release(layer.digest, "sb-2")
    finally:
        second.close()
    assert _mounts_under(work) == []


@pytest.mark.root
@pytest.mark.skipif(not is_root, reason="needs root (mount(2), chroot)")
def test_busybox_rootfs_runs(work: Path, store: LocalLayerStore) -> None:
    root = build_busybox_rootfs(work / "bb")
    assert os.readlink(root / "bin/sh") == "busybox"
    assert (root / "tmp").stat().st_mode & 0o7777 == 0o1777
    assert "nobody:x:65534" in (root / "etc/passwd").read_text()
    for d in ("proc", "dev", "sys", "root", "home", "usr/bin", "var"):
        assert (root / d).is_dir(), d
    layer = build_from_dir(store, root, name="busybox", tag="t")
    assert layer.size < 4 << 20
    with LayerMounts(store, work / "mnt") as mounts:
        mp = mounts.acquire(layer.digest, "t")
        out = subprocess.run(
            ["chroot", str(mp), "/bin/sh", "-c", "echo hi from $(basename $0); ls /bin | wc -l"],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        assert out.stdout.startswith("hi from sh")
        assert int(out.stdout.split()[-1]) > 100
        mounts.release(layer.digest, "t")


# -- CLI ---------------------------------------------------------------------------


def test_cli_build_ls_rm(work: Path) -> None:
    runner = CliRunner()
    src = _tree(work / "src")
    env = {"DSEC_STATE_DIR": str(work / "state")}
    r = runner.invoke(
        image_group, ["build", "--from-dir", str(src), "--name", "cli", "--tag", "1", "-q"], env=env
    )
    assert r.exit_code == 0, r.output
    digest = r.stdout.strip()
    assert digest.startswith("sha256:") and (work / "state/layers/index.db").is_file()
    (src / "etc/extra").write_text("on top\n")
    r = runner.invoke(
        image_group,
        ["build", "--from-dir", str(src), "--name", "cli", "--tag", "2", "--kind", "base",
         "--parent", "cli:1", "--json", "-q"],
        env=env,
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["parents"] == [digest]
    r = runner.invoke(image_group, ["ls", "--json"], env=env)
    assert [x["tag"] for x in json.loads(r.stdout)] == ["1", "2"]
    r = runner.invoke(image_group, ["ls"], env=env)
    assert "cli:1" in r.stdout and digest[:19] in r.stdout
    r = runner.invoke(image_group, ["rm", "nope:1"], env=env)
    assert r.exit_code == 1 and "dsec image ls" in r.output
    r = runner.invoke(image_group, ["build", "--name", "x"], env=env)
    assert r.exit_code == 2 and "exactly one source" in r.output
    r = runner.invoke(image_group, ["rm", "cli:1", "cli:2"], env=env)
    assert r.exit_code == 0, r.output
    assert os.listdir(work / "state/layers/blobs/sha256") == []


# -- debootstrap (slow, needs the mirror apt uses) ---------------------------------


@pytest.mark.slow
@pytest.mark.root
@pytest.mark.skipif(not is_root, reason="needs root (debootstrap, mount(2))")
@pytest.mark.skipif(shutil.which("debootstrap") is None, reason="needs debootstrap")
@pytest.mark.timeout(1200)
def test_build_debootstrap_bookworm(work: Path, store: LocalLayerStore) -> None:
    stages: set[str] = set()
    layer = build_debootstrap(
        store, suite="bookworm", packages=["less"], name="debian", tag="bookworm",
        progress=lambda s, d, t: stages.add(s),
    )  # fmt: skip
    assert {"debootstrap: retrieve", "debootstrap: unpack", "slim", "mkfs", "store"} <= stages
    assert layer.kind.value == "base" and layer.size < 80 << 20
    with LayerMounts(store, work / "mnt") as mounts:
        mp = mounts.acquire(layer.digest, "t")
        try:
            assert (mp / "etc/debian_version").read_text().startswith("12")
            assert (mp / "usr/bin/less").exists()
            assert os.listdir(mp / "usr/share/doc") == []
            assert not [
                p for p in os.listdir(mp / "var/lib/apt/lists") if p not in ("partial", "lock")
            ]
            assert not list((mp / "var/cache/apt/archives").glob("*.deb"))
            assert set(os.listdir(mp / "usr/share/locale")) <= {"locale.alias", "C", "C.UTF-8"}
            out = subprocess.run(
                ["chroot", str(mp), "/bin/sh", "-c", "dpkg-query -W -f '${Package}\\n' | wc -l"],
                capture_output=True, text=True, check=True,
            )  # fmt: skip
            assert int(out.stdout) > 50
        finally:
            mounts.release(layer.digest, "t")
    assert _leftovers(store) == []
