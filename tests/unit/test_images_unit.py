"""Pure logic of dsec.images: refs, archive path safety, whiteouts, the index, apt sources.

No root, no mounts, no mkfs.erofs: the store tests use fake images that only
carry the EROFS superblock magic.
"""

from __future__ import annotations

import io
import os
import stat
import tarfile
from pathlib import Path

import pytest

from dsec.errors import ImageError, InvalidSpec, LayerInUse, LayerNotFound
from dsec.images import Layer, LayerKind, LayerMounts, LocalLayerStore, UnsafeArchive, parse_ref
from dsec.images.aptsources import deb822_sources, pick_source
from dsec.images.debootstrap import (
    apt_sources,
    check_args,
    debootstrap_phase,
    find_mirror,
    slim_rootfs,
)
from dsec.images.erofs import EROFS_MAGIC, is_erofs
from dsec.images.errors import LayerBuildError
from dsec.images.sysmount import parse_mountinfo
from dsec.images.unpack import normalize_member_path, resolve_in_root, unpack_tar

HEX = "ab" * 32
DIGEST = "sha256:" + HEX

# -- refs --------------------------------------------------------------------


def test_parse_ref_name_defaults_tag_to_latest() -> None:
    r = parse_ref("ubuntu")
    assert (r.name, r.tag, r.is_digest) == ("ubuntu", "latest", False)


def test_parse_ref_name_and_tag() -> None:
    r = parse_ref("py-3.11_tools:v1.2-rc.1")
    assert (r.name, r.tag) == ("py-3.11_tools", "v1.2-rc.1")


def test_parse_ref_full_and_short_digest() -> None:
    full = parse_ref(DIGEST)
    assert full.is_full_digest and full.digest_hex == HEX
    short = parse_ref("sha256:" + HEX[:12])
    assert short.is_digest and not short.is_full_digest


@pytest.mark.parametrize(
    "bad",
    ["", "Ubuntu", "a:b:c", "../x", "a/b", "sha256:xyz", "sha256:abc", "sha256:" + "A" * 64,
     "x:" + "t" * 129, ":tag", "-lead"],
)  # fmt: skip
def test_parse_ref_rejects_malformed(bad: str) -> None:
    with pytest.raises(InvalidSpec) as e:
        parse_ref(bad)
    assert "NAME[:TAG]" in str(e.value) or "hex" in str(e.value)


def test_layer_model_is_frozen_and_validated() -> None:
    layer = Layer(digest=DIGEST, name="a", tag="b", kind=LayerKind.BASE, size=1, created_at=0.0)
    assert layer.ref == "a:b" and layer.hex == HEX
    with pytest.raises(Exception):  # noqa: B017 - pydantic's frozen error
        layer.name = "c"  # type: ignore[misc]
    with pytest.raises(ValueError, match="not a layer digest"):
        Layer(digest="sha256:nothex", name="a", tag="b", kind="base", size=1, created_at=0.0)
    assert Layer.model_validate_json(layer.model_dump_json()) == layer


# -- archive member paths ----------------------------------------------------


@pytest.mark.parametrize(
    ("name", "want"),
    [("./a//b/", "a/b"), ("/etc/passwd", "etc/passwd"), ("a/../b", "b"), (".", ""), ("./", ""),
     ("a/./b/../c", "a/c"), ("..foo/bar", "..foo/bar")],
)  # fmt: skip
def test_normalize_member_path(name: str, want: str) -> None:
    assert normalize_member_path(name) == want


@pytest.mark.parametrize("name", ["..", "../x", "a/../../x", "./../etc/passwd", "/../x", "a\0b"])
def test_normalize_member_path_refuses_escape(name: str) -> None:
    with pytest.raises(UnsafeArchive):
        normalize_member_path(name)


def test_resolve_in_root_clamps_symlinks(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "usr/lib").mkdir(parents=True)
    os.symlink("/usr/lib", root / "lib")
    os.symlink("../../../../../../etc", root / "up")
    os.symlink("loop2", root / "loop1")
    os.symlink("loop1", root / "loop2")
    r = str(root)
    assert resolve_in_root(r, "lib/x", follow_last=True) == f"{r}/usr/lib/x"
    assert resolve_in_root(r, "lib", follow_last=False) == f"{r}/lib"
    assert resolve_in_root(r, "up/passwd", follow_last=True) == f"{r}/etc/passwd"
    with pytest.raises(UnsafeArchive):
        resolve_in_root(r, "loop1/x", follow_last=True)


# -- tar extraction ----------------------------------------------------------


def _tar(entries: list[tuple[str, str, bytes | str]]) -> io.BytesIO:
    """Build a tar in memory: (type, name, data-or-linkname); type in f, d, l, h, c."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for kind, name, data in entries:
            ti = tarfile.TarInfo(name)
            ti.mode = 0o644
            if kind == "f":
                assert isinstance(data, bytes)
                ti.size = len(data)
                tf.addfile(ti, io.BytesIO(data))
                continue
            if kind == "d":
                ti.type, ti.mode = tarfile.DIRTYPE, 0o755
            elif kind == "l":
                ti.type, ti.linkname = tarfile.SYMTYPE, str(data)
            elif kind == "h":
                ti.type, ti.linkname = tarfile.LNKTYPE, str(data)
            elif kind == "c":
                ti.type, ti.devmajor, ti.devminor = tarfile.CHRTYPE, 1, 3
            tf.addfile(ti)
    buf.seek(0)
    return buf


def test_unpack_refuses_dotdot(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    with pytest.raises(UnsafeArchive):
        unpack_tar(_tar([("f", "ok", b"1"), ("f", "../evil", b"x")]), root)
    assert not (tmp_path / "evil").exists()


def test_unpack_symlink_cannot_redirect_writes_outside(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    stats = unpack_tar(
        _tar([("l", "link", str(outside)), ("f", "link/pwned", b"x"), ("l", "rel", "../../.."),
              ("f", "rel/pwned2", b"y"), ("f", "/abs/file", b"z")]),
        root,
    )  # fmt: skip
    assert list(outside.iterdir()) == []
    # Resolved as if root were "/": the writes stay inside the tree.
    assert (root / str(outside).lstrip("/") / "pwned").read_bytes() == b"x"
    assert (root / "pwned2").read_bytes() == b"y"
    assert (root / "abs/file").read_bytes() == b"z"
    assert os.readlink(root / "link") == str(outside)
    assert stats.symlinks == 2


def test_unpack_hardlink_must_target_earlier_member(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    unpack_tar(_tar([("f", "a", b"data"), ("h", "b", "./a")]), root)
    assert os.stat(root / "a").st_ino == os.stat(root / "b").st_ino
    with pytest.raises(UnsafeArchive):
        unpack_tar(_tar([("h", "c", "../../etc/passwd")]), root)
    with pytest.raises(UnsafeArchive):
        unpack_tar(_tar([("h", "d", "missing")]), root)


def test_unpack_skips_devices_keeps_modes(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        ti = tarfile.TarInfo("bin/su")
        ti.mode, ti.size = 0o4755, 3
        tf.addfile(ti, io.BytesIO(b"bin"))
        d = tarfile.TarInfo("tmp")
        d.type, d.mode = tarfile.DIRTYPE, 0o1777
        tf.addfile(d)
        c = tarfile.TarInfo("dev/null")
        c.type = tarfile.CHRTYPE
        tf.addfile(c)
    buf.seek(0)
    stats = unpack_tar(buf, root)
    assert stats.skipped_devices == 1 and any("dev/null" in w for w in stats.warnings)
    assert not (root / "dev/null").exists()
    assert stat.S_IMODE(os.stat(root / "tmp").st_mode) == 0o1777
    # chown (as root) would clear setuid; the mode is applied after it.
    assert stat.S_IMODE(os.stat(root / "bin/su").st_mode) == 0o4755


def test_unpack_gzip_and_garbage(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    plain = _tar([("d", "etc", ""), ("f", "etc/hostname", b"box\n")]).getvalue()
    gz = io.BytesIO()
    import gzip

    gz.write(gzip.compress(plain))
    gz.seek(0)
    unpack_tar(gz, root)
    assert (root / "etc/hostname").read_text() == "box\n"
    with pytest.raises(UnsafeArchive):
        unpack_tar(io.BytesIO(b"this is not a tar archive" * 40), root)


# -- whiteouts -----------------------------------------------------------------


def _lower(root: Path) -> None:
    for p in ("etc/a", "etc/b", "opq/x", "opq/sub/y", "gone/deep/f", "keep"):
        (root / p).parent.mkdir(parents=True, exist_ok=True)
        (root / p).write_text(p)


def test_whiteouts_delete_files_dirs_and_opaque_content(tmp_path: Path) -> None:
    root = tmp_path / "root"
    _lower(root)
    # The opaque marker comes after this layer's own entry in opq/: order must not matter.
    layer = _tar([
        ("f", "etc/.wh.a", b""),
        ("f", "opq/new", b"mine"),
        ("d", "opq/sub", ""),
        ("f", "opq/sub/mine", b"m"),
        ("f", "opq/.wh..wh..opq", b""),
        ("f", ".wh.gone", b""),
        ("f", "nothere/.wh.x", b""),
        ("f", "etc/.wh..wh.plnk", b""),
    ])  # fmt: skip
    stats = unpack_tar(layer, root, whiteouts=True)
    assert not (root / "etc/a").exists() and (root / "etc/b").exists()
    assert sorted(os.listdir(root / "opq")) == ["new", "sub"]
    assert os.listdir(root / "opq/sub") == ["mine"]  # lower opq/sub/y is hidden
    assert not (root / "gone").exists()
    assert not (root / "nothere").exists()  # a whiteout creates nothing
    assert (root / "keep").exists()
    assert not any(n.startswith(".wh.") for _, _, fs in os.walk(root) for n in fs)
    assert (stats.whiteouts, stats.opaque_dirs) == (2, 1)


def test_whiteouts_are_plain_files_without_layer_semantics(tmp_path: Path) -> None:
    root = tmp_path / "root"
    _lower(root)
    unpack_tar(_tar([("f", "etc/.wh.a", b"")]), root, whiteouts=False)
    assert (root / "etc/a").exists() and (root / "etc/.wh.a").exists()


# -- the store's index (fake images) ---------------------------------------------


def _fake_erofs(path: Path, payload: bytes) -> Path:
    path.write_bytes(b"\0" * 1024 + EROFS_MAGIC.to_bytes(4, "little") + payload)
    return path


def test_store_add_resolve_list_remove(tmp_path: Path) -> None:
    store = LocalLayerStore(tmp_path / "store")
    img1 = _fake_erofs(tmp_path / "1.erofs", b"one")
    img2 = _fake_erofs(tmp_path / "2.erofs", b"two")
    assert is_erofs(img1) and not is_erofs(tmp_path)
    a = store.add_erofs(img1, name="py", tag="3", kind="base")
    assert img1.exists(), "add_erofs copies unless consume=True"
    assert store.add_erofs(img1, name="py", tag="3", kind="base").digest == a.digest
    b = store.add_erofs(img2, name="py", tag="3", kind="base", parents=[a.digest], consume=True)
    assert not img2.exists()
    assert b.parents == (a.digest,)
    assert store.resolve("py:3").digest == b.digest  # latest wins
    assert store.resolve("sha256:" + a.hex[:10]).digest == a.digest
    assert store.get(a.digest).size == img1.stat().st_size
    assert (store.root / "blobs/sha256" / f"{a.hex}.erofs").is_file()
    assert (store.root / "index.db").is_file()
    assert [x.digest for x in store.list()] == [b.digest, a.digest]
    # Re-adding older content re-points the tag at it.
    store.add_erofs(img1, name="py", tag="3", kind="base")
    assert store.resolve("py:3").digest == a.digest
    with pytest.raises(ImageError, match="kind"):
        store.add_erofs(img1, name="other", tag="1", kind="toolkit")
    with pytest.raises(LayerNotFound) as nf:
        store.resolve("py:4")
    assert "dsec image ls" in str(nf.value) and "3" in str(nf.value)
    store.remove("py:3")  # removes the layer py:3 points at (a), file freed
    assert not (store.root / "blobs/sha256" / f"{a.hex}.erofs").exists()
    assert store.resolve("py:3").digest == b.digest
    store.remove(b.digest)
    assert store.list() == []
    assert os.listdir(store.root / "blobs/sha256") == []
    assert os.listdir(store.tmp_dir) == []


def test_store_refuses_non_erofs_and_bad_names(tmp_path: Path) -> None:
    store = LocalLayerStore(tmp_path / "store")
    junk = tmp_path / "junk"
    junk.write_bytes(b"x" * 4096)
    with pytest.raises(ImageError, match="not an EROFS image"):
        store.add_erofs(junk, name="a", tag="b", kind="base")
    img = _fake_erofs(tmp_path / "i", b"")
    with pytest.raises(InvalidSpec):
        store.add_erofs(img, name="Bad Name", tag="b", kind="base")
    with pytest.raises(InvalidSpec):
        store.add_erofs(img, name="a", tag="b", kind="weird")
    with pytest.raises(InvalidSpec):
        store.add_erofs(img, name="a", tag="b", kind="base", parents=["py:3"])


def test_store_pins_block_removal_and_persist(tmp_path: Path) -> None:
    store = LocalLayerStore(tmp_path / "store")
    layer = store.add_erofs(_fake_erofs(tmp_path / "i", b"p"), name="p", tag="1", kind="toolkit")
    assert store.pin(layer.digest, "sb-1") is True
    assert store.pin(layer.digest, "sb-1") is False
    assert store.pin(layer.digest, "sb-2") is True
    with pytest.raises(LayerInUse) as e:
        store.remove("p:1")
    assert e.value.fields["holders"] == ["sb-1", "sb-2"]
    reopened = LocalLayerStore(tmp_path / "store")
    assert reopened.holders(layer.digest) == {"sb-1", "sb-2"}
    assert reopened.unpin_all_except({"sb-2"}) == 1
    assert store.holders(layer.digest) == {"sb-2"}
    store.unpin(layer.digest, "sb-2")
    store.unpin(layer.digest, "sb-2")  # idempotent
    store.remove("p:1")
    with pytest.raises(LayerNotFound):
        store.pin(layer.digest, "sb-3")


def test_store_scratch_is_removed_even_on_error(tmp_path: Path) -> None:
    store = LocalLayerStore(tmp_path / "store")
    with pytest.raises(RuntimeError), store.scratch() as d:
        (d / "ro").mkdir()
        (d / "ro/f").write_text("x")
        os.chmod(d / "ro", 0o500)
        raise RuntimeError("boom")
    assert os.listdir(store.tmp_dir) == []


def test_store_cleans_scratch_nobody_holds(tmp_path: Path) -> None:
    store = LocalLayerStore(tmp_path / "store")
    old = 1_000_000_000
    dead_dir = store.tmp_dir / "build-999999999-abc"
    dead_dir.mkdir()
    (dead_dir / "f").write_text("x")
    dead_file = store.tmp_dir / "import-999999999-x.erofs"
    dead_file.write_bytes(b"")
    young = store.tmp_dir / "build-1-young"
    young.mkdir()
    for p in (dead_dir, dead_file):
        os.utime(p, (old, old))
    with store.scratch() as live:
        os.utime(live, (old, old))
        LocalLayerStore(tmp_path / "store")  # another process opening the store
        assert sorted(os.listdir(store.tmp_dir)) == sorted([live.name, young.name])
    assert os.listdir(store.tmp_dir) == [young.name]


def test_layer_mounts_root_must_say_dsec(tmp_path: Path) -> None:
    store = LocalLayerStore(tmp_path / "store")
    with pytest.raises(InvalidSpec, match="dsec"):
        LayerMounts(store, Path("/tmp/layers-of-something"))


# -- apt sources and debootstrap arguments -----------------------------------------


def test_apt_sources_pick_the_archive_not_security(tmp_path: Path) -> None:
    etc = tmp_path / "apt"
    (etc / "sources.list.d").mkdir(parents=True)
    (etc / "sources.list").write_text("# nothing here\n")
    (etc / "sources.list.d/debian.sources").write_text(
        "Types: deb\nURIs: http://mirror.example/debian-security\nSuites: bookworm-security\n"
        "Components: main\n\n"
        "Types: deb deb-src\n# a comment\nURIs: http://mirror.example/debian/\n"
        "Suites: bookworm bookworm-updates\nComponents: main contrib\n"
        "Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg\n\n"
        "Enabled: no\nTypes: deb\nURIs: http://disabled.example/\nSuites: bookworm\nComponents: main\n"
    )
    (etc / "sources.list.d/other.list.disabled").write_text(
        "deb http://ignored.example/ bookworm main\n"
    )
    m = find_mirror("bookworm", etc_apt=etc)
    assert m.uri == "http://mirror.example/debian"
    assert m.keyring == "/usr/share/keyrings/debian-archive-keyring.gpg"
    # Another release: fall back to the host's archive mirror.
    assert find_mirror("trixie", etc_apt=etc).uri == "http://mirror.example/debian"
    assert all("ignored" not in s.uri and "disabled" not in s.uri for s in apt_sources(etc))


def test_apt_one_line_format_and_missing_mirror(tmp_path: Path) -> None:
    etc = tmp_path / "apt"
    etc.mkdir()
    (etc / "sources.list").write_text(
        "deb-src http://src.example/debian bookworm main\n"
        "deb [arch=amd64 signed-by=/k.gpg] http://one.example/debian bookworm main # c\n"
    )
    m = find_mirror("bookworm", etc_apt=etc)
    assert (m.uri, m.keyring) == ("http://one.example/debian", "/k.gpg")
    (etc / "sources.list").write_text("deb cdrom:[Debian]/ bookworm main\n")
    with pytest.raises(LayerBuildError, match="--mirror"):
        find_mirror("bookworm", etc_apt=etc)


REPO = Path(__file__).resolve().parents[2]
APTSOURCES = REPO / "src" / "dsec" / "images" / "aptsources.py"


def _corp_apt(tmp_path: Path) -> Path:
    """A machine behind its own mirror, with a third-party repository listed first."""
    etc = tmp_path / "apt"
    (etc / "sources.list.d").mkdir(parents=True)
    (etc / "sources.list").write_text(
        "deb [signed-by=/usr/share/keyrings/cloud.gpg] https://packages.example.com/apt cloud-sdk main\n")
    (etc / "sources.list.d/debian.sources").write_text(
        "Types: deb\nURIs: http://mirror.corp.example/debian-security\nSuites: bookworm-security\n"
        "Components: main\nSigned-By: /etc/apt/keyrings/corp.gpg\n\n"
        "Types: deb\nURIs: http://mirror.corp.example/debian/\nSuites: bookworm bookworm-updates\n"
        "Components: main non-free-firmware\nSigned-By: /etc/apt/keyrings/corp.gpg\n")
    (etc / "sources.list.d/z-cdrom.list").write_text("deb cdrom:[Debian 12]/ bookworm main\n")
    return etc


def test_the_mirror_for_a_suite_is_the_release_archive_not_a_third_party_repo(tmp_path: Path) -> None:
    etc = _corp_apt(tmp_path)
    srcs = apt_sources(etc)
    assert [s.uri for s in srcs] == ["https://packages.example.com/apt", "http://mirror.corp.example/debian-security",
                                     "http://mirror.corp.example/debian/", "cdrom:[Debian 12]/"]
    # the third-party repository comes first in apt's order and has a plain suite with main,
    # but the release's own archive carries bookworm-backports
    got = pick_source("bookworm-backports", srcs)
    assert got is not None and (got.uri, got.signed_by) == ("http://mirror.corp.example/debian/", "/etc/apt/keyrings/corp.gpg")
    assert find_mirror("bookworm-backports", etc_apt=etc).uri == "http://mirror.corp.example/debian"
    # a source that carries the suite itself wins over the archive
    (etc / "sources.list.d/backports.list").write_text("deb http://bpo.example/debian bookworm-backports main\n")
    got = pick_source("bookworm-backports", apt_sources(etc))
    assert got is not None and got.uri == "http://bpo.example/debian"


def test_aptsources_runs_by_path_for_the_setup_scripts(tmp_path: Path) -> None:
    """scripts/setup.sh and deploy/image.sh run it with the system python3 before any venv:
    standard library only, no import of the dsec package."""
    import subprocess
    import sys

    python = "/usr/bin/python3" if Path("/usr/bin/python3").exists() else sys.executable
    etc = _corp_apt(tmp_path)

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([python, "-I", str(APTSOURCES), "--etc-apt", str(etc), *args], capture_output=True,
                              text=True, cwd=tmp_path, timeout=30)

    r = run("stanza", "bookworm-backports")
    assert r.returncode == 0, r.stderr
    assert r.stdout == ("Types: deb\nURIs: http://mirror.corp.example/debian\nSuites: bookworm-backports\n"
                        "Components: main\nSigned-By: /etc/apt/keyrings/corp.gpg\n")
    assert [s.suites for s in deb822_sources(r.stdout, "written")] == [("bookworm-backports",)]  # apt reads it back
    assert run("mirror", "bookworm").stdout == "http://mirror.corp.example/debian\n"
    for f in etc.rglob("*"):
        if f.is_file():
            f.write_text("deb cdrom:[Debian 12]/ bookworm main\n")
    r = run("stanza", "bookworm-backports")
    assert r.returncode == 1 and r.stdout == "" and "no Debian mirror for 'bookworm-backports'" in r.stderr
    assert f"{etc}/sources.list.d/*.list and *.sources" in r.stderr
    assert run("stanza", "bookworm; rm -rf /").returncode == 2


def test_set_up_scripts_name_no_mirror_host() -> None:
    for rel in ("scripts/setup.sh", "deploy/image.sh", "docs/GVISOR.md"):
        text = (REPO / rel).read_text()
        assert "deb.debian.org" not in text and "URIs: http" not in text, rel
        assert "src/dsec/images/aptsources.py stanza bookworm-backports" in text, rel
    assert "COPY src/dsec/images/aptsources.py src/dsec/images/aptsources.py" in (
        REPO / "deploy" / "Containerfile").read_text()  # there before `image.sh packages` runs


def test_debootstrap_argument_checks() -> None:
    assert check_args("bookworm", "minbase", ["git", " ", "python3.11"]) == ["git", "python3.11"]
    with pytest.raises(InvalidSpec):
        check_args("bookworm; rm -rf /", "minbase", [])
    with pytest.raises(InvalidSpec):
        check_args("bookworm", "huge", [])
    with pytest.raises(InvalidSpec):
        check_args("bookworm", "minbase", ["--force-yes"])


@pytest.mark.parametrize(
    ("line", "phase"),
    [("I: Retrieving libacl1 2.3.1-3", "retrieve"), ("I: Validating libacl1 2.3.1-3", "validate"),
     ("I: Extracting libacl1...", "extract"), ("I: Unpacking libc6:amd64...", "unpack"),
     ("I: Configuring tzdata...", "configure"), ("I: Retrieving InRelease", None),
     ("I: Unpacking required packages...", None), ("I: Unpacking the base system...", None),
     ("I: Configuring required packages...", None), ("W: something", None)],
)  # fmt: skip
def test_debootstrap_progress_lines(line: str, phase: str | None) -> None:
    assert debootstrap_phase(line) == phase


def test_slim_rootfs(tmp_path: Path) -> None:
    root = tmp_path / "r"
    keep = ["usr/share/locale/C.UTF-8/x", "usr/share/locale/locale.alias", "usr/bin/sh",
            "var/lib/apt/lists/partial/.keep", "var/cache/apt/archives/partial/.keep"]  # fmt: skip
    drop = ["var/cache/apt/archives/a_1.deb", "var/lib/apt/lists/x_Packages",
            "usr/share/doc/pkg/copyright", "usr/share/man/man1/ls.1.gz",
            "usr/share/locale/de/LC_MESSAGES/x.mo", "var/cache/apt/pkgcache.bin"]  # fmt: skip
    for p in keep + drop:
        (root / p).parent.mkdir(parents=True, exist_ok=True)
        (root / p).write_text("x" * 10)
    assert slim_rootfs(root) >= 60
    for p in keep:
        assert (root / p).exists(), p
    for p in drop:
        assert not (root / p).exists(), p
    assert (root / "usr/share/doc").is_dir()


# -- mountinfo -------------------------------------------------------------------


def test_parse_mountinfo_unescapes_paths() -> None:
    text = (
        "57 27 0:39 / /run/dsec/layers/ab\\040c ro,nosuid,nodev,relatime shared:1 - erofs "
        "/var/lib/dsec/layers/blobs/sha256/ab.erofs ro,user_xattr\n"
        "22 1 8:1 / / rw - ext4 /dev/vda rw\n"
    )
    a, b = parse_mountinfo(text)
    assert a.mount_point == "/run/dsec/layers/ab c" and a.fstype == "erofs"
    assert a.source.endswith("ab.erofs") and b.fstype == "ext4"
