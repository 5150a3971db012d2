"""DSec layers in a real OCI registry (Debian's docker-registry, distribution 2.8, on loopback).

Every registry here is a real ``docker-registry serve`` with a throwaway root; the
token-auth registry trusts a real token server on loopback. Images for ``import`` are
built by the tests themselves (tar layers written with tarfile, gzip- and
zstd-compressed, pushed with the client, including a multi-arch index and
whiteouts). Trees are read back with ``fsck.erofs --extract`` (no mount needed).
At the end of the module no registry process of this session may be left.
"""

from __future__ import annotations

import asyncio
import gzip
import hashlib
import io
import json
import os
import shutil
import stat
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import zstandard

from dsec.errors import InvalidSpec
from dsec.images import LocalLayerStore, build_from_dir, sysmount
from dsec.images.errors import (
    DigestMismatch,
    LayerBuildError,
    RegistryAuthError,
    RegistryError,
    RegistryNotFound,
    RegistryUnreachable,
    UnsupportedManifest,
)
from dsec.images.layer import LayerKind
from dsec.images.lazy.erofs_meta import walk_metadata
from dsec.images.oci_import import import_image
from dsec.images.registry import (
    CHUNK_SIZE,
    DOCKER_LIST,
    DOCKER_MANIFEST,
    DSEC_LAYER_ARTIFACT,
    DSEC_LAYER_CONFIG,
    DSEC_LAYER_DATA,
    DSEC_LAYER_EROFS,
    DSEC_LAYER_META,
    OCI_INDEX,
    OCI_MANIFEST,
    TITLE_ANNOTATION,
    BlobTable,
    Credentials,
    Descriptor,
    DsecLayerConfig,
    RegistryClient,
    layer_alias_tag,
    parse_registry_ref,
    sha256_digest,
)
from dsec.images.registry_server import RegistryServer, TokenServer, registry_binary
from dsec.images.transfer import pull_layer, push_layer

zstd = pytest.importorskip("zstandard")

pytestmark = [
    pytest.mark.skipif(shutil.which("mkfs.erofs") is None, reason="needs mkfs.erofs (erofs-utils)"),
    pytest.mark.skipif(shutil.which("docker-registry") is None, reason="needs docker-registry (apt-get install docker-registry)"),
    pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl"),
]

OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
OCI_TAR = "application/vnd.oci.image.layer.v1.tar"
OCI_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
OCI_ZSTD = "application/vnd.oci.image.layer.v1.tar+zstd"
DOCKER_CONFIG = "application/vnd.docker.container.image.v1+json"
DOCKER_GZIP = "application/vnd.docker.image.rootfs.diff.tar.gzip"


# -- fixtures ---------------------------------------------------------------------------------


def _our_registry_pids() -> list[int]:
    """docker-registry processes started by this test session (they inherit its mark)."""
    mark = f"DSEC_TEST_SESSION={os.environ.get('DSEC_TEST_SESSION', '')}".encode()
    pids = []
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            if Path(f"/proc/{p}/comm").read_text().strip() != "docker-registry":
                continue
            if mark in Path(f"/proc/{p}/environ").read_bytes().split(b"\0"):
                pids.append(int(p))
        except OSError:
            continue
    return pids


@pytest.fixture(scope="module", autouse=True)
def _no_registry_left() -> Iterator[None]:
    before = set(_our_registry_pids())
    yield
    left = [p for p in _our_registry_pids() if p not in before]
    assert not left, f"registry processes left running: {left}"


@pytest.fixture(scope="module")
def registry() -> Iterator[RegistryServer]:
    with RegistryServer() as reg:
        yield reg


@pytest.fixture
def client(registry: RegistryServer) -> Iterator[RegistryClient]:
    with RegistryClient(registry.url) as c:
        yield c


@pytest.fixture
def work() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="dsec-test-registry-"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _store(work: Path, name: str) -> LocalLayerStore:
    return LocalLayerStore(work / name)


def _tree(root: Path, seed: bytes = b"a", big: int = 3 * CHUNK_SIZE + 12345) -> Path:
    """A tree whose layer spans several chunks (incompressible data)."""
    (root / "etc").mkdir(parents=True)
    (root / "etc/os-release").write_text("NAME=test\n")
    (root / "data").mkdir()
    rnd = hashlib.shake_256(seed).digest(big)
    (root / "data/blob.bin").write_bytes(rnd)
    os.chmod(root, 0o755)
    return root


def _extract(store: LocalLayerStore, digest: str, dest: Path) -> Path:
    r = subprocess.run(["fsck.erofs", f"--extract={dest}", str(store.blob_path(digest))],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return dest


def _files(root: Path) -> dict[str, str]:
    """path -> 'dir' | 'link:<target>' | file content (text)."""
    out: dict[str, str] = {}
    for dirpath, dirs, files in os.walk(root):
        for n in dirs + files:
            p = Path(dirpath) / n
            rel = str(p.relative_to(root))
            if p.is_symlink():
                out[rel] = "link:" + os.readlink(p)
            elif p.is_dir():
                out[rel] = "dir"
            else:
                out[rel] = p.read_bytes().decode(errors="replace")
    return out


# -- the format -------------------------------------------------------------------------------


def test_layer_config_chunk_table(work: Path) -> None:
    data = hashlib.shake_256(b"x").digest(2 * CHUNK_SIZE + 7)
    f = work / "f.erofs"
    f.write_bytes(data)
    cfg = DsecLayerConfig.of_file(f, kind="base", name="n", tag="t")
    assert cfg.size == len(data) and cfg.digest == sha256_digest(data) and cfg.chunk_count == 3
    assert cfg.chunk_range(2) == (2 * CHUNK_SIZE, len(data))
    assert cfg.chunk_of(CHUNK_SIZE) == 1
    for i in range(3):
        s, e = cfg.chunk_range(i)
        assert cfg.verify_chunk(i, data[s:e])
    assert not cfg.verify_chunk(2, data[-7:-1] + b"!")
    assert not cfg.verify_chunk(0, data[: CHUNK_SIZE - 1])
    with pytest.raises(IndexError):
        cfg.chunk_range(3)
    doc = json.loads(cfg.to_json())
    assert list(doc) == ["kind", "name", "tag", "parents", "size", "digest", "chunk_size", "chunks", "lazy"]
    assert doc["kind"] == "base" and doc["chunk_size"] == 1048576 and doc["parents"] == []
    assert DsecLayerConfig.parse(cfg.to_json()) == cfg
    doc["chunks"] = doc["chunks"][:2]
    with pytest.raises(UnsupportedManifest, match="chunk table has 2 entries"):
        DsecLayerConfig.parse(json.dumps(doc).encode())


def test_registry_refs() -> None:
    r = parse_registry_ref("127.0.0.1:5000/team/layers:v1")
    assert (r.base_url, r.repo, r.tag, r.digest) == ("http://127.0.0.1:5000", "team/layers", "v1", None)
    r = parse_registry_ref("registry.example.com/a/b")
    assert (r.base_url, r.repo, r.tag) == ("https://registry.example.com", "a/b", "latest")
    d = "sha256:" + "a" * 64
    r = parse_registry_ref(f"http://localhost:5000/x@{d}")
    assert (r.base_url, r.repo, r.tag, r.digest, r.reference) == ("http://localhost:5000", "x", None, d, d)
    assert parse_registry_ref("localhost/x", default_tag=None).tag is None
    for bad in ("nohost/x", "127.0.0.1:5000", "127.0.0.1:5000/Upper", "h.com/x@sha256:zz", "h.com/x:t!"):
        with pytest.raises(InvalidSpec):
            parse_registry_ref(bad)
    with pytest.raises(InvalidSpec, match="without a tag"):
        parse_registry_ref("h.com/x:t", allow_tag=False)


# -- push / pull --------------------------------------------------------------------------------


def test_push_pull_round_trip(work: Path, registry: RegistryServer, client: RegistryClient) -> None:
    a, b = _store(work, "a"), _store(work, "b")
    layer = build_from_dir(a, _tree(work / "src"), name="rt", tag="v1", kind="toolkit")
    dest = parse_registry_ref(f"{registry.url}/dsec/rt", default_tag=None)
    pushed = push_layer(a, "rt:v1", client, dest)
    assert pushed.uploaded and pushed.layer.digest == layer.digest
    host = registry.url.split("://")[1]
    assert pushed.ref == f"{host}/dsec/rt:v1"

    # The manifest and config are exactly the shared format.
    m = client.get_manifest("dsec/rt", "v1")
    assert m.digest == pushed.manifest_digest and m.media_type == OCI_MANIFEST
    assert m.doc["artifactType"] == DSEC_LAYER_ARTIFACT and m.doc["schemaVersion"] == 2
    assert m.doc["annotations"] == {TITLE_ANNOTATION: "rt:v1"}
    assert m.config.media_type == DSEC_LAYER_CONFIG
    cfg = json.loads(client.get_blob("dsec/rt", m.config.digest))
    lazy = cfg["lazy"]
    assert [(d.media_type, d.digest, d.size) for d in m.layers] == [
        (DSEC_LAYER_EROFS, layer.digest, layer.size),
        (DSEC_LAYER_META, lazy["meta"]["digest"], lazy["meta"]["offsets"][-1]),
        (DSEC_LAYER_DATA, lazy["data"]["digest"], lazy["data"]["offsets"][-1]),
    ]
    assert set(cfg) == {"kind", "name", "tag", "parents", "size", "digest", "chunk_size", "chunks", "lazy"}
    # the lazy form: a small metadata image, the file data in its data device
    assert lazy["format"] == "erofs-blobdev-v1" and lazy["meta"]["size"] < layer.size // 10
    assert lazy["data"]["size"] >= 3 * CHUNK_SIZE and lazy["data"]["encoding"] == "zstd"
    assert (cfg["kind"], cfg["name"], cfg["tag"], cfg["parents"]) == ("toolkit", "rt", "v1", [])
    assert (cfg["size"], cfg["digest"], cfg["chunk_size"]) == (layer.size, layer.digest, 1048576)
    raw = a.blob_path(layer.digest).read_bytes()
    assert len(cfg["chunks"]) == -(-len(raw) // CHUNK_SIZE) >= 2
    assert cfg["chunks"][1] == sha256_digest(raw[CHUNK_SIZE : 2 * CHUNK_SIZE])
    # A chunk is an HTTP Range of the blob.
    assert client.get_blob_range("dsec/rt", layer.digest, CHUNK_SIZE, 2 * CHUNK_SIZE) == raw[CHUNK_SIZE : 2 * CHUNK_SIZE]
    # Also under the alias tag, with the same manifest.
    assert client.get_manifest("dsec/rt", layer_alias_tag(layer.digest)).digest == m.digest

    got = pull_layer(b, client, parse_registry_ref(f"{registry.url}/dsec/rt:v1"))
    assert got.digest == layer.digest and (got.name, got.tag, got.kind) == ("rt", "v1", LayerKind.TOOLKIT)
    assert b.blob_path(got.digest).read_bytes() == raw
    # By manifest digest, under another name: no second download (the file is linked).
    again = pull_layer(b, client, parse_registry_ref(f"{registry.url}/dsec/rt@{m.digest}"), name="copy", tag="1")
    assert again.digest == layer.digest and again.ref == "copy:1"
    assert sorted(x.ref for x in b.list()) == ["copy:1", "rt:v1"]
    assert os.listdir(b.tmp_dir) == []
    # A second push sends metadata only, and reuses the lazy form: the same manifest.
    again_pushed = push_layer(a, "rt:v1", client, dest)
    assert not again_pushed.uploaded and again_pushed.manifest_digest == m.digest


@pytest.mark.root
def test_lazy_form_mounts_as_the_same_tree(work: Path, registry: RegistryServer, client: RegistryClient) -> None:
    """The lazy form (metadata image + data device), mounted from files as an edge does,
    shows exactly the layer's tree: owners, modes, times, links, devices, xattrs, data."""
    a = _store(work, "a")
    src = _tree(work / "odd")
    (src / "etc/link").symlink_to("os-release")
    os.link(src / "etc/os-release", src / "etc/hard")
    os.mknod(src / "etc/wh", 0o600 | stat.S_IFCHR, os.makedev(0, 0))  # an overlay whiteout
    os.setxattr(src / "data", "trusted.overlay.opaque", b"y")
    (src / "suid").write_bytes(b"x" * 5000)
    os.chmod(src / "suid", 0o4755)
    os.chown(src / "suid", 1234, 5678)
    (src / "empty").write_bytes(b"")
    layer = build_from_dir(a, src, name="odd", tag="1", kind="workspace")
    push_layer(a, "odd:1", client, parse_registry_ref(f"{registry.url}/odd", default_tag=None))
    cfg = json.loads(client.get_blob("odd", client.get_manifest("odd", "1").config.digest))
    meta, data = work / "meta", work / "data"
    for part, path in (("meta", meta), ("data", data)):
        table = BlobTable.model_validate(cfg["lazy"][part])
        blob = client.get_blob("odd", table.digest, max_bytes=1 << 30)
        assert table.encoding == "zstd" and len(blob) == table.blob_size
        # every chunk checks and inflates on its own
        plain = b""
        for i, d in enumerate(table.chunks):
            piece = blob[table.offsets[i] : table.offsets[i + 1]]
            assert sha256_digest(piece) == d
            plain += zstandard.ZstdDecompressor().decompress(piece, max_output_size=table.chunk_size)
        assert len(plain) == table.size
        path.write_bytes(plain)
    whole, split = work / "mnt-whole", work / "mnt-split"
    whole.mkdir()
    split.mkdir()
    sysmount.mount(str(a.blob_path(layer.digest)), str(whole), "erofs", sysmount.MS_RDONLY)
    try:
        sysmount.mount(str(meta), str(split), "erofs", sysmount.MS_RDONLY, f"device={data}")
        try:
            assert _walk(split) == _walk(whole)
            assert len(_walk(whole)) >= 9
            # the metadata image says where each file's data lies in the data device
            raw, dev = meta.read_bytes(), data.read_bytes()

            async def read(off: int, n: int) -> bytes:
                return raw[off : off + n]

            found = asyncio.run(walk_metadata(read, extents=True))
            assert found.data_extents is not None
            contents = sorted(p.read_bytes() for p in whole.rglob("*") if p.is_file() and not p.is_symlink()
                              and p.stat().st_size)
            pieces = sorted(dev[a:b] for a, b in found.data_extents)
            assert sorted(set(pieces)) == sorted(set(contents))  # hard links share their extent
        finally:
            sysmount.umount(str(split))
    finally:
        sysmount.umount(str(whole))


def _walk(root: Path) -> dict[str, tuple[Any, ...]]:
    out: dict[str, tuple[Any, ...]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st = p.lstat()
            xattrs = {k: os.getxattr(p, k, follow_symlinks=False) for k in os.listxattr(p, follow_symlinks=False)}
            body: Any = None
            if stat.S_ISREG(st.st_mode):
                body = hashlib.sha256(p.read_bytes()).hexdigest()
            elif stat.S_ISLNK(st.st_mode):
                body = os.readlink(p)
            out[str(p.relative_to(root))] = (st.st_mode, st.st_uid, st.st_gid, st.st_size, st.st_mtime_ns,
                                             st.st_nlink, st.st_rdev, sorted(xattrs.items()), body)
    return out


def test_lineage_travels(work: Path, registry: RegistryServer, client: RegistryClient) -> None:
    a, b = _store(work, "a"), _store(work, "b")
    base = build_from_dir(a, _tree(work / "base", b"base", big=1000), name="base", tag="1")
    ws_src = work / "ws"
    (ws_src / "workspace").mkdir(parents=True)
    (ws_src / "workspace/app.py").write_text("print('hi')\n")
    os.chmod(ws_src, 0o755)
    ws = build_from_dir(a, ws_src, name="ws", tag="1", kind="workspace", parents=["base:1"])
    pushed = push_layer(a, "ws:1", client, parse_registry_ref(f"{registry.url}/lineage", default_tag=None))
    assert pushed.parents == [base.digest]
    got = pull_layer(b, client, parse_registry_ref(f"{registry.url}/lineage:1"))
    assert got.digest == ws.digest and got.parents == (base.digest,)
    parent = b.get(base.digest)
    assert (parent.name, parent.tag, parent.kind) == ("base", "1", LayerKind.BASE)
    # A parent pulled along does not re-point a local name:tag that names another layer.
    e = _store(work, "e")
    mine = build_from_dir(e, _tree(work / "mine", b"mine", big=1000), name="base", tag="1")
    pull_layer(e, client, parse_registry_ref(f"{registry.url}/lineage:1"))
    assert e.resolve("base:1").digest == mine.digest
    assert e.get(base.digest).ref == "base:" + layer_alias_tag(base.digest)[:19]

    # A snapshot whose parent the registry does not have cannot be pulled.
    c = _store(work, "c")
    orphan_parent = "sha256:" + "1" * 64
    snap_file = work / "snap.erofs"
    shutil.copyfile(a.blob_path(ws.digest), snap_file)
    c.add_erofs(snap_file, name="snap", tag="1", kind="snapshot", parents=[orphan_parent])
    push_layer(c, "snap:1", client, parse_registry_ref(f"{registry.url}/orphan", default_tag=None))
    with pytest.raises(RegistryNotFound, match="snapshot over") as err:
        pull_layer(_store(work, "d"), client, parse_registry_ref(f"{registry.url}/orphan:1"))
    assert err.value.fields["status"] == 404


def test_corrupt_blob_is_refused(work: Path, registry: RegistryServer, client: RegistryClient) -> None:
    a, b = _store(work, "a"), _store(work, "b")
    layer = build_from_dir(a, _tree(work / "src", b"corrupt"), name="bad", tag="1")
    push_layer(a, "bad:1", client, parse_registry_ref(f"{registry.url}/corrupt", default_tag=None))
    blob = registry.blob_file(layer.digest)
    data = bytearray(blob.read_bytes())
    data[CHUNK_SIZE + 100] ^= 0xFF  # one byte of chunk 1, same size
    blob.write_bytes(bytes(data))
    with pytest.raises(DigestMismatch, match="chunk 1 ") as err:
        pull_layer(b, client, parse_registry_ref(f"{registry.url}/corrupt:1"))
    assert err.value.fields["chunk"] == 1 and err.value.code == "image_error"
    assert b.list() == [] and os.listdir(b.tmp_dir) == [] and os.listdir(b.blob_dir) == []
    # A truncated blob too (the registry's size no longer matches the manifest).
    blob.write_bytes(bytes(data[: CHUNK_SIZE + 10]))
    with pytest.raises(DigestMismatch):
        pull_layer(b, client, parse_registry_ref(f"{registry.url}/corrupt:1"))
    assert b.list() == []


def test_chunked_upload_and_errors(work: Path, client: RegistryClient) -> None:
    f = work / "big"
    data = hashlib.shake_256(b"up").digest(3 * CHUNK_SIZE + 5)
    f.write_bytes(data)
    seen: list[tuple[int, int]] = []
    desc, uploaded = client.push_blob_file("chunks", f, digest=sha256_digest(data), chunk=CHUNK_SIZE,
                                           on_progress=lambda d, t: seen.append((d, t)))
    assert uploaded and desc.size == len(data) and len(seen) >= 4
    assert client.blob_size("chunks", desc.digest) == len(data)
    with client.open_blob("chunks", desc.digest) as r:
        assert r.read() == data
        r.verify()
    # Uploading bytes under a digest they do not have is refused by the registry.
    with pytest.raises(RegistryError, match=r"DIGEST_INVALID"):
        client.push_blob_file("chunks", f, digest="sha256:" + "2" * 64)
    with pytest.raises(RegistryNotFound, match="MANIFEST_UNKNOWN"):
        client.get_manifest("chunks", "nope")
    with pytest.raises(RegistryNotFound):
        client.get_blob("chunks", "sha256:" + "3" * 64)
    with RegistryClient("http://127.0.0.1:1") as dead, pytest.raises(RegistryUnreachable, match="cannot reach"):
        dead.ping()


def _mock(manifest: dict[str, Any], content_type: str) -> RegistryClient:
    raw = json.dumps(manifest).encode()

    def handler(req: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=raw, headers={"content-type": content_type})

    return RegistryClient("http://mock.invalid", transport=httpx.MockTransport(handler))


def test_unknown_manifest_types_are_refused(work: Path, registry: RegistryServer, client: RegistryClient) -> None:
    # Media types the client does not read: one line naming the type and what is read.
    schema1 = {"schemaVersion": 1, "name": "x", "tag": "1", "fsLayers": []}
    with _mock(schema1, "application/vnd.docker.distribution.manifest.v1+prettyjws") as c, \
            pytest.raises(UnsupportedManifest, match="schema 1"):
        c.get_manifest("x", "1")
    odd = {"schemaVersion": 2, "mediaType": "application/vnd.example.thing.v1+json"}
    with _mock(odd, "application/vnd.example.thing.v1+json") as c, \
            pytest.raises(UnsupportedManifest, match=r"vnd\.example\.thing") as err:
        c.get_manifest("x", "1")
    assert err.value.fields["media_type"] == "application/vnd.example.thing.v1+json"
    # A real OCI artifact that is neither a DSec layer nor a container image (a helm chart).
    cfg = client.push_blob("helm", b"{}", media_type="application/vnd.cncf.helm.config.v1+json")
    blob = client.push_blob("helm", b"chart", media_type="application/vnd.cncf.helm.chart.content.v1.tar+gzip")
    raw = json.dumps({"schemaVersion": 2, "mediaType": OCI_MANIFEST, "config": cfg.to_json(),
                      "layers": [blob.to_json()]}).encode()
    client.put_manifest("helm", "1", raw, OCI_MANIFEST)
    with pytest.raises(UnsupportedManifest, match=r"not a DSec layer.*dsec image import"):
        pull_layer(_store(work, "s"), client, parse_registry_ref(f"{registry.url}/helm:1"))
    with pytest.raises(UnsupportedManifest, match="container images only"):
        import_image(_store(work, "s"), client, parse_registry_ref(f"{registry.url}/helm:1"))


# -- auth -----------------------------------------------------------------------------------------


def test_basic_auth(work: Path) -> None:
    a, b = _store(work, "a"), _store(work, "b")
    build_from_dir(a, _tree(work / "src", b"basic", big=5000), name="basic", tag="1")
    with RegistryServer(htpasswd={"alice": "s3cret"}) as reg:
        with RegistryClient(reg.url) as anon, pytest.raises(RegistryAuthError, match="user name and password") as e:
            anon.ping()
        assert e.value.fields["status"] == 401 and isinstance(e.value, PermissionError)
        with RegistryClient(reg.url, credentials=Credentials("alice", "nope")) as bad, \
                pytest.raises(RegistryAuthError, match="refused user 'alice'"):
            bad.ping()
        with RegistryClient(reg.url, credentials=Credentials("alice", "s3cret")) as c:
            c.ping()
            layer = a.resolve("basic:1")
            push_layer(a, "basic:1", c, parse_registry_ref(f"{reg.url}/private", default_tag=None))
            assert pull_layer(b, c, parse_registry_ref(f"{reg.url}/private:1")).digest == layer.digest


def test_bearer_token_auth(work: Path) -> None:
    a, b = _store(work, "a"), _store(work, "b")
    layer = build_from_dir(a, _tree(work / "src", b"bearer", big=5000), name="tok", tag="1")
    with TokenServer(users={"bob": "pw"}, anonymous_pull=True) as tokens, RegistryServer(token=tokens) as reg:
        # Anonymous: the registry's Bearer challenge leads to an anonymous token, pull-only.
        with RegistryClient(reg.url) as anon, pytest.raises(RegistryAuthError) as err:
            push_layer(a, "tok:1", anon, parse_registry_ref(f"{reg.url}/team/tok", default_tag=None))
        assert err.value.fields["status"] == 401
        with RegistryClient(reg.url, credentials=Credentials("bob", "wrong")) as bad, \
                pytest.raises(RegistryAuthError, match=r"token server .* refused"):
            bad.ping()
        with RegistryClient(reg.url, credentials=Credentials("bob", "pw")) as c:
            before = tokens.requests
            push_layer(a, "tok:1", c, parse_registry_ref(f"{reg.url}/team/tok", default_tag=None))
            push_layer(a, "tok:1", c, parse_registry_ref(f"{reg.url}/team/tok", default_tag="again"))
            # Tokens are cached per scope: one for pull, one for pull+push, whatever the request count.
            assert tokens.requests - before <= 2, tokens.scopes_seen
            assert "repository:team/tok:pull,push" in tokens.scopes_seen
            hdrs = c.auth_headers("team/tok")
            assert hdrs["Authorization"].startswith("Bearer ")
        r = httpx.get(f"{reg.url}/v2/team/tok/blobs/{layer.digest}", headers={**hdrs, "Range": "bytes=0-9"})
        assert r.status_code == 206 and len(r.content) == 10
        with RegistryClient(reg.url) as anon:
            got = pull_layer(b, anon, parse_registry_ref(f"{reg.url}/team/tok:1"))
        assert got.digest == layer.digest


# -- import -----------------------------------------------------------------------------------------


def _tar(entries: list[tuple[str, Any]]) -> bytes:
    """A layer tar: (name, bytes) files, (name, None) dirs, (name, ('link', target)) symlinks,
    (name, ('hard', target)) hard links."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for name, body in entries:
            ti = tarfile.TarInfo(name)
            ti.mtime = 1_700_000_000
            if body is None:
                ti.type, ti.mode = tarfile.DIRTYPE, 0o755
                tf.addfile(ti)
            elif isinstance(body, tuple):
                ti.type = tarfile.SYMTYPE if body[0] == "link" else tarfile.LNKTYPE
                ti.linkname = body[1]
                tf.addfile(ti)
            else:
                ti.size, ti.mode = len(body), 0o644
                tf.addfile(ti, io.BytesIO(body))
    return buf.getvalue()


def _push_image(c: RegistryClient, repo: str, layers: list[tuple[bytes, str]], *, arch: str = "amd64",
                docker: bool = False, tag: str | None = None) -> Descriptor:
    """Push an image of (blob, media type) layers; returns its manifest's descriptor."""
    descs = [c.push_blob(repo, blob, media_type=mt) for blob, mt in layers]
    config = json.dumps({"architecture": arch, "os": "linux",
                         "rootfs": {"type": "layers", "diff_ids": []}, "config": {}}).encode()
    cfg = c.push_blob(repo, config, media_type=DOCKER_CONFIG if docker else OCI_CONFIG)
    media = DOCKER_MANIFEST if docker else OCI_MANIFEST
    raw = json.dumps({"schemaVersion": 2, "mediaType": media, "config": cfg.to_json(),
                      "layers": [d.to_json() for d in descs]}).encode()
    digest = c.put_manifest(repo, tag or sha256_digest(raw), raw, media)
    return Descriptor(media, digest, len(raw), {"platform": {"os": "linux", "architecture": arch}})


def _index(c: RegistryClient, repo: str, tag: str, manifests: list[Descriptor], *, docker: bool = False) -> None:
    media = DOCKER_LIST if docker else OCI_INDEX
    raw = json.dumps({"schemaVersion": 2, "mediaType": media, "manifests": [m.to_json() for m in manifests]}).encode()
    c.put_manifest(repo, tag, raw, media)


def _image_layers() -> list[tuple[bytes, str]]:
    l1 = _tar([("etc", None), ("etc/a", b"a\n"), ("etc/b", b"b\n"), ("dir", None), ("dir/x", b"x\n"),
               ("dir/y", b"y\n"), ("keep", b"keep\n"), ("gone", None), ("gone/deep", b"deep\n")])
    l2 = _tar([("etc/.wh.a", b""), ("dir/.wh..wh..opq", b""), ("dir/z", b"z\n"), ("new", b"new\n"),
               (".wh.gone", b"")])
    l3 = _tar([("etc/c", ("link", "b")), ("etc/hard", ("hard", "keep")), ("bin", None), ("bin/tool", b"#!/bin/sh\n")])
    return [(gzip.compress(l1, mtime=0), OCI_GZIP), (zstd.ZstdCompressor().compress(l2), OCI_ZSTD), (l3, OCI_TAR)]


EXPECTED = {
    "etc": "dir", "etc/b": "b\n", "etc/c": "link:b", "etc/hard": "keep\n", "dir": "dir", "dir/z": "z\n",
    "keep": "keep\n", "new": "new\n", "bin": "dir", "bin/tool": "#!/bin/sh\n",
}


def test_import_multiarch_gzip_zstd_whiteouts(work: Path, registry: RegistryServer, client: RegistryClient) -> None:
    store = _store(work, "s")
    amd = _push_image(client, "lib/app", _image_layers())
    arm = _push_image(client, "lib/app", [(gzip.compress(_tar([("arm", b"arm\n")])), OCI_GZIP)], arch="arm64")
    attestation = client.push_blob("lib/app", b"{}", media_type=OCI_MANIFEST)  # stands in for an attestation
    att = Descriptor(OCI_MANIFEST, attestation.digest, attestation.size,
                     {"platform": {"os": "unknown", "architecture": "unknown"},
                      "annotations": {"vnd.docker.reference.type": "attestation-manifest"}})
    _index(client, "lib/app", "1.0", [arm, att, amd])
    progress: list[str] = []
    layer = import_image(store, client, parse_registry_ref(f"{registry.url}/lib/app:1.0"),
                         progress=lambda s, d, t: progress.append(s))
    assert (layer.name, layer.tag, layer.kind) == ("app", "1.0", LayerKind.BASE)
    assert {"unpack", "mkfs", "store"} <= set(progress)
    assert _files(_extract(store, layer.digest, work / "x")) == EXPECTED
    # Same image by its manifest digest, named explicitly: same content, same digest.
    same = import_image(store, client, parse_registry_ref(f"{registry.url}/lib/app@{amd.digest}"), name="app2", tag="t")
    assert same.digest == layer.digest and same.ref == "app2:t"
    # The index has no image for a platform we ask for: the error lists what it has.
    with pytest.raises(UnsupportedManifest, match=r"no linux/s390x image \(it offers: linux/arm64, linux/amd64\)"):
        import_image(store, client, parse_registry_ref(f"{registry.url}/lib/app:1.0"), arch="s390x")
    # A single-arch image of another architecture is refused before anything is fetched.
    client.put_manifest("lib/app", "arm-only", client.get_manifest("lib/app", arm.digest).raw, OCI_MANIFEST)
    with pytest.raises(UnsupportedManifest, match="linux/arm64 image"):
        import_image(store, client, parse_registry_ref(f"{registry.url}/lib/app:arm-only"))
    assert os.listdir(store.tmp_dir) == []


def test_import_docker_manifest_list(work: Path, registry: RegistryServer, client: RegistryClient) -> None:
    store = _store(work, "s")
    layers = [(gzip.compress(_tar([("hello", b"docker\n")])), DOCKER_GZIP)]
    one = _push_image(client, "dock", layers, docker=True)
    _index(client, "dock", "latest", [one], docker=True)
    layer = import_image(store, client, parse_registry_ref(f"{registry.url}/dock"))
    assert layer.ref == "dock:latest"
    assert _files(_extract(store, layer.digest, work / "x")) == {"hello": "docker\n"}


def test_import_corrupt_layer_is_refused(work: Path, registry: RegistryServer, client: RegistryClient) -> None:
    store = _store(work, "s")
    blob = gzip.compress(_tar([("f", hashlib.shake_256(b"c").digest(200_000))]), mtime=0)
    _push_image(client, "broken", [(blob, OCI_GZIP)], tag="1")
    path = registry.blob_file(sha256_digest(blob))
    data = bytearray(path.read_bytes())
    data[-20] ^= 0x01  # near the end of the compressed data
    path.write_bytes(bytes(data))
    with pytest.raises((LayerBuildError, DigestMismatch), match=r"corrupt|CRC|decompress"):
        import_image(store, client, parse_registry_ref(f"{registry.url}/broken:1"))
    assert store.list() == [] and os.listdir(store.tmp_dir) == []


# -- the CLI -------------------------------------------------------------------------------------------


def _dsec(state: Path, *args: str, env: dict[str, str] | None = None, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dsec.cli.main", "image", *args], capture_output=True, text=True,
                          env={**os.environ, "DSEC_STATE_DIR": str(state), **(env or {})}, input=stdin, timeout=120)


def test_cli_push_pull_import(work: Path) -> None:
    src = _tree(work / "src", b"cli", big=CHUNK_SIZE + 1)
    a, b = work / "a", work / "b"
    with RegistryServer(htpasswd={"u": "pw"}) as reg:
        host = reg.url.split("://")[1]
        r = _dsec(a, "build", "--from-dir", str(src), "--name", "cli", "--tag", "1", "-q")
        assert r.returncode == 0, r.stderr
        digest = r.stdout.strip()
        r = _dsec(a, "push", "cli:1", "--registry", f"{host}/team/cli")
        assert r.returncode == 1 and "user name and password" in r.stderr and "Traceback" not in r.stderr
        r = _dsec(a, "push", "cli:1", "--registry", f"{host}/team/cli", "-u", "u", "--password-stdin", "--json",
                  stdin="pw\n")
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert out["layer_digest"] == digest and out["uploaded"] and out["ref"] == f"{host}/team/cli:1"
        creds = {"DSEC_REGISTRY_USERNAME": "u", "DSEC_REGISTRY_PASSWORD": "pw"}
        r = _dsec(b, "pull", f"{host}/team/cli:1", env=creds)
        assert r.returncode == 0 and r.stdout.strip() == digest, r.stderr
        assert f"pulled {host}/team/cli:1 as cli:1" in r.stderr
        r = _dsec(b, "pull", f"{host}/team/cli@{out['manifest_digest']}", "--name", "again:2", "--json", env=creds)
        assert r.returncode == 0 and json.loads(r.stdout)["digest"] == digest, r.stderr
        r = _dsec(b, "pull", f"{host}/team/missing:1", env=creds)
        assert r.returncode == 1 and "MANIFEST_UNKNOWN" in r.stderr
        r = _dsec(b, "import", f"{host}/team/cli:1", env=creds)
        assert r.returncode == 1 and "dsec image pull" in r.stderr
        with RegistryClient(reg.url, credentials=Credentials("u", "pw")) as c:
            _index(c, "lib/img", "2", [_push_image(c, "lib/img", _image_layers())])
        r = _dsec(b, "import", f"{host}/lib/img:2", "--name", "img:2", "--json", env=creds)
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["name"] == "img"
        r = _dsec(b, "ls", "--json")
        assert sorted(x["name"] + ":" + x["tag"] for x in json.loads(r.stdout)) == ["again:2", "cli:1", "img:2"]
        r = _dsec(b, "pull", "nohost/x:1")
        assert r.returncode == 2 and "not a registry host" in r.stderr


def test_registry_server_lifecycle(work: Path) -> None:
    registry_binary()
    reg = RegistryServer(work / "reg")
    reg.start()
    pid = reg.pid
    assert pid is not None and reg.url.startswith("http://127.0.0.1:")
    assert Path(f"/proc/{pid}").exists()
    with RegistryClient(reg.url) as c:
        c.ping()
    reg.stop()
    reg.stop()  # idempotent
    assert not Path(f"/proc/{pid}").exists() or Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    assert (work / "reg/config.yml").is_file()  # a root that was given is kept
    # A port in use: the error carries the registry's own words.
    with RegistryServer() as first:
        port = int(first.url.rsplit(":", 1)[1])
        with pytest.raises(Exception, match="address already in use"):
            RegistryServer(port=port).start()
