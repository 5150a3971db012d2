"""Layers the project builds carry nothing of the build host (issue 13, section 1): once pushed
to a registry they go to every node, so the build machine's name, resolver, identity, apt
lists and logs must not ride along."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from dsec.images import LocalLayerStore, build_busybox, build_debootstrap, build_from_dir
from dsec.images.debootstrap import NEUTRAL_HOSTNAME, NEUTRAL_HOSTS, scrub_build_host

pytestmark = [pytest.mark.skipif(shutil.which("mkfs.erofs") is None, reason="needs mkfs.erofs (erofs-utils)")]

HOSTNAME = socket.gethostname()
MACHINE_ID = Path("/etc/machine-id").read_text().strip() if Path("/etc/machine-id").is_file() else ""


@pytest.fixture
def work() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="dsec-test-buildhost-"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _extract(store: LocalLayerStore, digest: str, dest: Path) -> Path:
    r = subprocess.run(["fsck.erofs", f"--extract={dest}", str(store.blob_path(digest))],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return dest


def _host_facts_in(tree: Path, image: Path) -> list[str]:
    """Where the build host's name (a whole line of a file under etc/ or var/) or machine-id
    (anywhere in the image's bytes) shows up."""
    found = []
    for top in ("etc", "var"):
        for dirpath, _dirs, files in os.walk(tree / top):
            for f in files:
                p = Path(dirpath) / f
                if p.is_symlink() or not p.is_file():
                    continue
                lines = p.read_bytes().decode(errors="replace").splitlines()
                if HOSTNAME in (ln.strip() for ln in lines) or any(ln.split()[1:2] == [HOSTNAME] for ln in lines if ln.strip()):
                    found.append(f"hostname in {p.relative_to(tree)}")
    if MACHINE_ID and MACHINE_ID.encode() in image.read_bytes():
        found.append("machine-id in the image")
    resolv = Path("/etc/resolv.conf")
    if (tree / "etc/resolv.conf").exists() or (resolv.is_file() and resolv.read_bytes().strip()
                                               and resolv.read_bytes().strip() in image.read_bytes()):
        found.append("resolv.conf")
    return found


def test_scrub_takes_out_what_a_build_copies_from_the_host(work: Path) -> None:
    """A tree as debootstrap leaves it (host hostname and resolver copied in) plus what package
    scripts may write; and a symlink that points out of the tree, which must not be followed."""
    root = work / "rootfs"
    for d in ("etc/ssh", "var/lib/dbus", "var/lib/apt/lists/partial", "var/cache/apt/archives/partial",
              "var/log/apt", "tmp", "var/tmp", "root", "var/lib/urandom"):
        (root / d).mkdir(parents=True)
    (root / "etc/hostname").write_text(HOSTNAME + "\n")
    os.chmod(root / "etc/hostname", 0o755)  # debootstrap's copy keeps odd modes
    (root / "etc/hosts").write_text(f"127.0.0.1 localhost\n127.0.1.1 {HOSTNAME}\n")
    (root / "etc/resolv.conf").write_text("nameserver 10.9.8.7\n")
    (root / "etc/machine-id").write_text((MACHINE_ID or "ab" * 16) + "\n")
    (root / "var/lib/dbus/machine-id").write_text((MACHINE_ID or "ab" * 16) + "\n")
    (root / "etc/ssh/ssh_host_ed25519_key").write_text("secret\n")
    (root / "etc/ssh/sshd_config").write_text("# kept\n")
    (root / "var/lib/urandom/random-seed").write_bytes(os.urandom(32))
    (root / "var/lib/apt/lists/deb.debian.org_debian_dists_bookworm_InRelease").write_text("x")
    (root / "var/lib/apt/lists/lock").write_text("")
    (root / "var/lib/apt/lists/partial/half").write_text("x")
    (root / "var/cache/apt/pkgcache.bin").write_text("x")
    (root / "var/cache/apt/archives/bash.deb").write_text("x")
    (root / "var/log/dpkg.log").write_text(f"configured on {HOSTNAME}\n")
    (root / "var/log/apt/history.log").write_text("x")
    (root / "var/log/wtmp").write_bytes(b"login record")
    (root / "tmp/build-leftover").write_text("x")
    (root / "root/.bash_history").write_text("apt-get install secrets\n")
    outside = work / "outside"
    outside.mkdir()
    (outside / "random-seed").write_text("the host's, not the tree's")
    (root / "var/lib/systemd").symlink_to(outside)
    os.chmod(root, 0o755)

    changed = scrub_build_host(root)
    assert "etc/hostname" in changed and "etc/resolv.conf" in changed
    assert (root / "etc/hostname").read_text() == NEUTRAL_HOSTNAME
    assert (root / "etc/hostname").stat().st_mode & 0o777 == 0o644
    assert HOSTNAME not in (root / "etc/hosts").read_text().split()
    assert not (root / "etc/resolv.conf").exists()
    assert (root / "etc/machine-id").read_bytes() == b""
    assert os.readlink(root / "var/lib/dbus/machine-id") == "/etc/machine-id"
    assert sorted(os.listdir(root / "etc/ssh")) == ["sshd_config"]
    assert not (root / "var/lib/urandom/random-seed").exists()
    assert sorted(os.listdir(root / "var/lib/apt/lists")) == ["lock", "partial"]
    assert os.listdir(root / "var/lib/apt/lists/partial") == []
    assert os.listdir(root / "var/cache/apt") == ["archives"]
    assert os.listdir(root / "var/cache/apt/archives") == ["partial"]
    assert sorted(os.listdir(root / "var/log")) == ["apt", "wtmp"] and (root / "var/log/wtmp").stat().st_size == 0
    assert os.listdir(root / "var/log/apt") == []
    assert os.listdir(root / "tmp") == [] and not (root / "root/.bash_history").exists()
    assert (outside / "random-seed").exists(), "followed a symlink out of the tree"
    assert scrub_build_host(root) == []  # idempotent

    store = LocalLayerStore(work / "store")
    layer = build_from_dir(store, root, name="scrubbed", tag="1")
    tree = _extract(store, layer.digest, work / "x")
    assert _host_facts_in(tree, store.blob_path(layer.digest)) == []


def test_scrub_writes_a_neutral_hosts_file_where_the_tree_has_none(work: Path) -> None:
    """debootstrap's minbase leaves no /etc/hosts: in the tree (in a chroot, before any sandbox
    writes its own) localhost must still resolve. A toolkit's diff gets none of its own."""
    root = work / "rootfs"
    (root / "etc").mkdir(parents=True)
    assert scrub_build_host(root) == ["etc/hosts"]
    assert (root / "etc/hosts").read_text() == NEUTRAL_HOSTS
    assert (root / "etc/hosts").stat().st_mode & 0o777 == 0o644
    assert "127.0.0.1\tlocalhost\n" in NEUTRAL_HOSTS and "::1\tlocalhost ip6-localhost ip6-loopback\n" in NEUTRAL_HOSTS
    assert not (root / "etc/hostname").exists()  # a sandbox's own comes at create
    assert scrub_build_host(root) == []
    diff = work / "toolkit-upper"
    (diff / "etc").mkdir(parents=True)
    assert scrub_build_host(diff, add_missing=False) == [] and not (diff / "etc/hosts").exists()
    bare = work / "no-etc"
    bare.mkdir()
    assert scrub_build_host(bare) == [] and not (bare / "etc").exists()


@pytest.mark.skipif(not Path("/bin/busybox").is_file(), reason="needs busybox-static")
def test_busybox_layer_has_no_host_facts(work: Path) -> None:
    store = LocalLayerStore(work / "store")
    layer = build_busybox(store, name="busybox", tag="t")
    tree = _extract(store, layer.digest, work / "x")
    assert _host_facts_in(tree, store.blob_path(layer.digest)) == []
    assert not (tree / "etc/hostname").exists() and not (tree / "etc/machine-id").exists()
    assert (tree / "etc/hosts").read_text() == NEUTRAL_HOSTS


@pytest.mark.slow
@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (debootstrap)")
@pytest.mark.skipif(shutil.which("debootstrap") is None, reason="needs debootstrap")
@pytest.mark.timeout(1200)
def test_debootstrap_layer_has_no_host_facts(work: Path) -> None:
    store = LocalLayerStore(work / "store")
    layer = build_debootstrap(store, suite="bookworm", name="debian", tag="scrubbed")
    tree = _extract(store, layer.digest, work / "x")
    assert _host_facts_in(tree, store.blob_path(layer.digest)) == []
    assert (tree / "etc/hostname").read_text() == NEUTRAL_HOSTNAME
    assert not (tree / "etc/resolv.conf").exists()
    assert not (tree / "etc/machine-id").exists() or (tree / "etc/machine-id").read_bytes() == b""
    assert set(os.listdir(tree / "var/lib/apt/lists")) <= {"partial", "lock"}
    assert not [f for f in os.listdir(tree / "var/log") if f.endswith(".log")]
    assert not list((tree / "var/cache/apt").glob("*.bin"))
