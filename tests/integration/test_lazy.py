"""Lazy layers end to end: a real registry, the real FUSE process, real EROFS mounts.

Debian's ``docker-registry`` (CNCF distribution) runs on loopback with a throwaway
root; layers are built with the project's mkfs.erofs wrapper and pushed as blobs
with plain httpx (monolithic upload). Each test starts its own :class:`LazyLayers`
(own mountpoint, cache and socket under the session's directory) and leaves no
mount and no process behind.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import random
import signal
import stat
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from dsec.errors import HostError
from dsec.images import LocalLayerStore, build_from_dir, sysmount
from dsec.images.lazy import (
    ChunkCorrupt,
    LayerBusy,
    LayerUnavailable,
    LazyLayers,
    RemoteLayer,
)
from dsec.images.lazy.erofs_meta import covering_chunks, walk_metadata
from dsec.images.registry import RegistryClient, RegistryRef
from dsec.images.registry_server import RegistryServer
from dsec.images.transfer import push_layer, read_dsec_layer

pytestmark = [pytest.mark.root]

MiB = 1 << 20


# ------------------------------------------------------ registry and layers ----


@pytest.fixture
def registry_factory(dsec_base: Path) -> Iterator[Callable[[], RegistryServer]]:
    """Registries of a test's own (a test that stops or damages one uses its own)."""
    made: list[RegistryServer] = []

    def make() -> RegistryServer:
        try:
            r = RegistryServer(dsec_base / f"registry-{len(made)}-{time.monotonic_ns()}").start()
        except HostError as exc:
            pytest.skip(str(exc))
        made.append(r)
        return r

    yield make
    for r in made:
        r.stop()


@pytest.fixture(scope="module")
def shared_registry(dsec_base: Path) -> Iterator[RegistryServer]:
    try:
        r = RegistryServer(dsec_base / "registry-lazy-shared").start()
    except HostError as exc:
        pytest.skip(str(exc))
    yield r
    r.stop()


def make_tree(root: Path, *, seed: int, big_files: int = 3, big_mib: int = 3) -> None:
    """A tree that looks like a layer: nested small files, links, and a few large files
    (random bytes: incompressible, so each spans whole chunks of its own)."""
    rnd = random.Random(seed)
    root.mkdir(parents=True)
    for d in range(12):
        sub = root / f"dir{d:02d}" / f"sub{d % 3}"
        sub.mkdir(parents=True, exist_ok=True)
        for f in range(20):
            (sub / f"f{f:03d}.txt").write_bytes((f"file {d}/{f} {seed} " * rnd.randint(1, 400)).encode())
    (root / "dir00" / "link").symlink_to("sub0/f000.txt")
    (root / "empty").mkdir()
    os.link(root / "dir01" / "sub1" / "f001.txt", root / "hardlink")
    (root / "exec.sh").write_text("#!/bin/sh\necho hi\n")
    (root / "exec.sh").chmod(0o755)
    big = root / "big"
    big.mkdir()
    for i in range(big_files):
        (big / f"blob{i}.bin").write_bytes(rnd.randbytes(big_mib * MiB + 12345 * i))


def tree_digest(root: Path) -> dict[str, str]:
    """Relative path -> type, mode, and content sha256 (or link target) of every entry."""
    out: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in sorted(dirnames + filenames):
            p = Path(dirpath) / name
            st = p.lstat()
            rel = str(p.relative_to(root))
            if stat.S_ISLNK(st.st_mode):
                out[rel] = f"l {os.readlink(p)}"
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = f"d {stat.S_IMODE(st.st_mode):o}"
            else:
                out[rel] = f"f {stat.S_IMODE(st.st_mode):o} {sha256_file(p)}"
    return out


def sha256_file(p: Path) -> str:
    h = hashlib.sha256()
    with open(p, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


class BuiltLayer:
    """A layer built by the project's builder, pushed with ``dsec image push``'s code."""

    def __init__(self, base: Path, registry: RegistryServer, repo: str, seed: int) -> None:
        self.tree = base / "tree"
        make_tree(self.tree, seed=seed)
        store = LocalLayerStore(base / "store")
        built = build_from_dir(store, self.tree, name=f"lazy{seed}", tag="t")
        self.erofs = store.blob_path(built.digest)
        self.data = self.erofs.read_bytes()
        self.digest = built.digest
        self.expected = tree_digest(self.tree)
        self.registry = registry
        self.repo = repo
        with RegistryClient(registry.url) as client:
            push_layer(store, built.digest, client, RegistryRef(registry.url, repo, tag="t"))
            _, self.config = read_dsec_layer(client, repo, "t")
        assert self.config.digest == self.digest
        self.chunks = list(self.config.chunks)
        self.metadata_chunks = metadata_chunks(self.data, self.config.chunk_size)

    def ref(self) -> RemoteLayer:
        return RemoteLayer.from_config(self.config.model_dump(mode="json"),
                                       registry=self.registry.url, repo=self.repo)

    def chunk_of(self, rel: str) -> list[int]:
        """Chunks holding some bytes of the file ``rel`` (found by searching its content:
        the big files are incompressible, so mkfs.erofs stores them as they are)."""
        content = (self.tree / rel).read_bytes()
        at = self.data.find(content[:4096])
        assert at >= 0, f"{rel} not stored verbatim"
        cs = self.config.chunk_size
        return list(range(at // cs, (at + len(content) - 1) // cs + 1))


def metadata_chunks(data: bytes, chunk_size: int) -> set[int]:
    async def read(off: int, n: int) -> bytes:
        return data[off : off + n]

    meta = trio.run(walk_metadata, read)
    return set(covering_chunks(meta.ranges, chunk_size, len(data)))


@pytest.fixture(scope="module")
def layer(dsec_base: Path, shared_registry: RegistryServer) -> BuiltLayer:
    return BuiltLayer(dsec_base / "lazy-layer-a", shared_registry, "dsec/lazy-a", seed=1)


# ---------------------------------------------------------------- service ----


class Mounted:
    """An EROFS mount of a lazily served file (what the runtime's LayerMounts does)."""

    def __init__(self, source: Path, mp: Path) -> None:
        self.source = source
        self.mp = mp
        mp.mkdir(parents=True, exist_ok=True)
        sysmount.mount(str(source), str(mp), "erofs", sysmount.MS_RDONLY | sysmount.MS_NOSUID | sysmount.MS_NODEV)

    def umount(self) -> None:
        with contextlib.suppress(OSError):
            sysmount.umount(str(self.mp), sysmount.MNT_DETACH)


@pytest.fixture
def lazy_factory(dsec_base: Path) -> Iterator[Callable[..., LazyLayers]]:
    made: list[LazyLayers] = []
    mounts: list[Mounted] = []

    def make(name: str | None = None, **kw: Any) -> LazyLayers:
        d = dsec_base / f"lazy-{name or len(made)}-{time.monotonic_ns()}"
        kw.setdefault("read_deadline_s", 10.0)
        kw.setdefault("backoff_s", 0.05)
        lz = LazyLayers(d / "mnt", d / "cache", **kw)
        lz.start()
        made.append(lz)
        return lz

    make.mounts = mounts  # type: ignore[attr-defined]
    yield make
    for m in mounts:
        m.umount()
    for lz in made:
        pid = lz.pid
        lz.close()
        assert not any(m.mount_point == str(lz.mountpoint) for m in sysmount.mountinfo())
        assert pid is None or not _alive(pid), f"lazy layer process {pid} left running"


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in (b"Z", b"X")


def mount(factory: Callable[..., LazyLayers], source: Path, mp: Path) -> Mounted:
    m = Mounted(source, mp)
    factory.mounts.append(m)  # type: ignore[attr-defined]
    return m


def drop_caches(m: Mounted) -> None:
    """Forget the pages of the EROFS mount and of the FUSE file, so the next read reaches
    the FUSE process (remount for EROFS; fadvise for the FUSE file's page cache)."""
    sysmount.umount(str(m.mp))
    fd = os.open(m.source, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    sysmount.mount(str(m.source), str(m.mp), "erofs", sysmount.MS_RDONLY | sysmount.MS_NOSUID | sysmount.MS_NODEV)


def walk_metadata_only(root: Path) -> int:
    """``ls -R`` plus ``stat`` of everything; returns the number of entries."""
    n = 0
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            os.lstat(os.path.join(dirpath, name))
            n += 1
    return n


def layer_stats(lz: LazyLayers, digest: str) -> dict[str, Any]:
    s: dict[str, Any] = lz.stats()["layers"][digest.removeprefix("sha256:")]
    return s


# ------------------------------------------------------------------ tests ----


def test_lazy_tree_equals_original_and_ls_needs_only_metadata(
    lazy_factory: Callable[..., LazyLayers], layer: BuiltLayer
) -> None:
    lz = lazy_factory("tree")
    path = lz.attach(layer.ref())
    assert path == lz.mountpoint / f"{layer.digest[7:]}.erofs"
    assert path.stat().st_size == len(layer.data)
    after_attach = layer_stats(lz, layer.digest)
    assert after_attach["metadata_chunks"] > 0
    assert after_attach["chunks_fetched"] == after_attach["metadata_chunks"]
    assert after_attach["metadata_chunks"] == len(layer.metadata_chunks)
    assert after_attach["chunks_fetched"] < len(layer.chunks)  # the big files' chunks are not metadata

    m = mount(lazy_factory, path, lz.cache_dir.parent / "erofs")
    assert walk_metadata_only(m.mp) == len(layer.expected)
    after_ls = layer_stats(lz, layer.digest)
    assert after_ls["chunks_fetched"] == after_attach["chunks_fetched"], "ls -R fetched data chunks"
    assert after_ls["misses"] == after_attach["misses"]

    assert tree_digest(m.mp) == layer.expected
    full = layer_stats(lz, layer.digest)
    assert full["fully_cached"] and full["corrupt_chunks"] == 0
    assert full["chunks_fetched"] == len(set(layer.chunks))  # each chunk once
    with pytest.raises(LayerBusy):
        lz.detach(layer.digest)
    m.umount()
    assert lz.detach(layer.digest)
    assert not path.exists()


def test_lazy_reading_one_file_fetches_only_its_chunks(
    lazy_factory: Callable[..., LazyLayers], layer: BuiltLayer
) -> None:
    lz = lazy_factory("onefile", readahead_chunks=0)
    path = lz.attach(layer.ref())
    m = mount(lazy_factory, path, lz.cache_dir.parent / "erofs")
    walk_metadata_only(m.mp)
    before = layer_stats(lz, layer.digest)
    rel = "big/blob1.bin"
    assert sha256_file(m.mp / rel) == layer.expected[rel].split()[-1]
    after = layer_stats(lz, layer.digest)
    wanted = set(layer.chunk_of(rel)) - layer.metadata_chunks
    assert after["chunks_fetched"] - before["chunks_fetched"] == len(wanted)
    # and nothing of the other big files
    others = set(layer.chunk_of("big/blob0.bin")) | set(layer.chunk_of("big/blob2.bin"))
    cached = {i for i, c in enumerate(layer.chunks) if (lz.cache_dir / "sha256" / c[7:]).exists()}
    assert not (others - layer.metadata_chunks - set(layer.chunk_of(rel))) & cached


def test_lazy_corrupt_chunk_is_refused_with_eio(
    lazy_factory: Callable[..., LazyLayers], registry_factory: Callable[[], RegistryServer], dsec_base: Path
) -> None:
    reg = registry_factory()
    bad = BuiltLayer(dsec_base / f"lazy-layer-bad-{time.monotonic_ns()}", reg, "dsec/bad", seed=2)
    rel = "big/blob0.bin"
    inner = bad.chunk_of(rel)[1:-1]  # chunks no other file shares
    victim = max(set(inner) - bad.metadata_chunks)
    blob = reg.blob_file(bad.digest)
    raw = bytearray(blob.read_bytes())
    raw[victim * bad.config.chunk_size + 100] ^= 0xFF
    blob.write_bytes(bytes(raw))

    lz = lazy_factory("corrupt")
    path = lz.attach(bad.ref())
    m = mount(lazy_factory, path, lz.cache_dir.parent / "erofs")
    with pytest.raises(OSError) as exc_info:
        sha256_file(m.mp / rel)
    assert exc_info.value.errno == errno.EIO
    # every other file reads fine
    for other in ("big/blob1.bin", "big/blob2.bin", "dir03/sub0/f004.txt"):
        assert sha256_file(m.mp / other) == bad.expected[other].split()[-1]
    st = layer_stats(lz, bad.digest)
    assert st["corrupt_chunks"] >= 1 and st["read_errors"] >= 1
    events = lz.stats()["corrupt_events"]
    assert events and events[0]["chunk"] == victim and events[0]["expected"] == bad.chunks[victim]
    assert not (lz.cache_dir / "sha256" / bad.chunks[victim][7:]).exists(), "a corrupt chunk was cached"

    # a damaged metadata chunk makes attach itself fail (a create would be refused)
    m.umount()
    lz.detach(bad.digest)
    raw[100] ^= 0xFF  # chunk 0 holds the superblock
    blob.write_bytes(bytes(raw))
    fresh = lazy_factory("corrupt-meta")
    with pytest.raises(ChunkCorrupt):
        fresh.attach(bad.ref())


def test_lazy_registry_down_cached_reads_work_uncached_fail_within_deadline(
    lazy_factory: Callable[..., LazyLayers], registry_factory: Callable[[], RegistryServer], dsec_base: Path
) -> None:
    reg = registry_factory()
    built = BuiltLayer(dsec_base / f"lazy-layer-down-{time.monotonic_ns()}", reg, "dsec/down", seed=3)
    deadline = 3.0
    lz = lazy_factory("down", read_deadline_s=deadline, fetch_attempts=3, attempt_timeout_s=1.0,
                      readahead_chunks=0)
    path = lz.attach(built.ref())
    m = mount(lazy_factory, path, lz.cache_dir.parent / "erofs")
    cached_rel, uncached_rel = "big/blob0.bin", "big/blob2.bin"
    assert sha256_file(m.mp / cached_rel) == built.expected[cached_rel].split()[-1]
    reg.stop()
    drop_caches(m)
    # metadata and the file read before are served from the cache
    assert walk_metadata_only(m.mp) == len(built.expected)
    assert sha256_file(m.mp / cached_rel) == built.expected[cached_rel].split()[-1]
    t0 = time.monotonic()
    with pytest.raises(OSError) as exc_info:
        sha256_file(m.mp / uncached_rel)
    took = time.monotonic() - t0
    assert exc_info.value.errno == errno.EIO
    assert took < deadline + 2.0, f"an uncached read took {took:.1f} s with the registry down"
    st = lz.stats()
    assert st["registry_errors"] >= 1 and st["read_errors"] >= 1
    # a layer nothing of which is cached cannot be attached: a typed error, quickly
    other = RemoteLayer(registry=built.registry.url, repo="dsec/none", digest="sha256:" + "ab" * 32,
                        size=3 * MiB, chunk_size=MiB, chunks=tuple("sha256:" + f"{i:064x}" for i in range(3)))
    t0 = time.monotonic()
    with pytest.raises(LayerUnavailable):
        lz.attach(other)
    assert time.monotonic() - t0 < deadline + 2.0


def test_lazy_concurrent_readers_fetch_each_chunk_once(
    lazy_factory: Callable[..., LazyLayers], layer: BuiltLayer
) -> None:
    lz = lazy_factory("burst")
    path = lz.attach(layer.ref())
    m = mount(lazy_factory, path, lz.cache_dir.parent / "erofs")
    rel = "big/blob2.bin"
    want = layer.expected[rel].split()[-1]
    results: list[str] = []
    errors: list[BaseException] = []
    start = threading.Barrier(32)

    def reader(k: int) -> None:
        try:
            start.wait()
            if k % 2:
                results.append(sha256_file(m.mp / rel))
            else:  # the FUSE file itself, each thread in its own chunk order
                cs = layer.config.chunk_size
                fd = os.open(path, os.O_RDONLY)
                try:
                    idx = layer.chunk_of(rel)
                    for i in idx[k % len(idx):] + idx[: k % len(idx)]:
                        data = os.pread(fd, cs, i * cs)
                        assert hashlib.sha256(data).hexdigest() == layer.chunks[i][7:]
                finally:
                    os.close(fd)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=reader, args=(k,)) for k in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors[:3]
    assert results == [want] * 16
    st = lz.stats()
    # every fetched chunk was cached once and no chunk twice: fetches == distinct cached chunks
    assert st["chunks_fetched"] == st["cache"]["chunks"]
    assert st["bytes_fetched"] <= len(layer.data)


def test_lazy_cache_limit_evicts_and_reads_stay_correct(
    lazy_factory: Callable[..., LazyLayers], layer: BuiltLayer
) -> None:
    limit = 4 * MiB
    assert len(layer.data) > 2 * limit
    lz = lazy_factory("evict", cache_limit_bytes=limit)
    path = lz.attach(layer.ref())
    m = mount(lazy_factory, path, lz.cache_dir.parent / "erofs")
    assert tree_digest(m.mp) == layer.expected
    st = lz.stats()["cache"]
    assert st["evictions"] > 0
    assert st["bytes"] <= limit
    on_disk = sum(p.stat().st_size for p in (lz.cache_dir / "sha256").iterdir())
    assert on_disk == st["bytes"]
    drop_caches(m)
    assert tree_digest(m.mp) == layer.expected  # evicted chunks come back, verified


def test_lazy_sigkill_then_reconcile_and_restart(
    lazy_factory: Callable[..., LazyLayers], layer: BuiltLayer
) -> None:
    lz = lazy_factory("crash")
    path = lz.attach(layer.ref())
    m = mount(lazy_factory, path, lz.cache_dir.parent / "erofs")
    rel = "big/blob0.bin"
    assert sha256_file(m.mp / rel) == layer.expected[rel].split()[-1]
    partial = lz.cache_dir / "sha256" / ".tmp-deadbeef-0000"
    partial.write_bytes(b"half a chunk")
    assert lz.pid is not None
    os.kill(lz.pid, signal.SIGKILL)
    assert _wait(lambda: not _alive(lz.pid or 0))
    with pytest.raises(OSError):
        sha256_file(m.mp / "big/blob1.bin")  # never read: the dead connection answers with an error
    report = lz.reconcile()
    assert not report.alive and report.unmounted
    assert report.partial_files >= 1  # ours, and maybe a chunk the kill interrupted
    assert str(m.mp) in report.stale_mounts  # the runtime's EROFS mount of the dead file
    assert not any(mi.mount_point == str(lz.mountpoint) for mi in sysmount.mountinfo())
    assert not partial.exists()
    m.umount()
    assert lz.reconcile().stale_mounts == []
    lz.start()
    assert lz.stats()["layers"][layer.digest[7:]]["size"] == len(layer.data)  # re-attached from state
    m2 = mount(lazy_factory, path, lz.cache_dir.parent / "erofs2")
    assert tree_digest(m2.mp) == layer.expected


def _wait(pred: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return pred()


def test_lazy_fully_cached_layer_materializes_and_a_second_handle_adopts(
    lazy_factory: Callable[..., LazyLayers], layer: BuiltLayer, dsec_base: Path
) -> None:
    lz = lazy_factory("local")
    path = lz.attach(layer.ref())
    assert not lz.fully_cached(layer.digest)
    # the switch to a local file: fetches what is missing, checks the whole digest
    dest = lz.materialize(layer.digest, lz.cache_dir.parent / "layer.erofs")
    assert hashlib.sha256(dest.read_bytes()).hexdigest() == layer.digest[7:]
    assert lz.fully_cached(layer.digest)
    # another handle (an edge restarted) adopts the running process instead of starting one
    again = LazyLayers(lz.mountpoint, lz.cache_dir)
    again.start()
    assert again.pid == lz.pid
    assert again.attach(layer.ref()) == path  # idempotent
    assert again.stats()["layers"][layer.digest[7:]]["fully_cached"]


@pytest.mark.slow
def test_lazy_figures(lazy_factory: Callable[..., LazyLayers], layer: BuiltLayer) -> None:
    """Figures for docs/IMAGES.md (printed, asserted only loosely): chunk fetch latency,
    FUSE read throughput cold and warm against the local file, metadata prefetch size."""

    def fadvise_out(p: Path) -> None:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)

    def mib_s(p: Path) -> float:
        fd = os.open(p, os.O_RDONLY)
        n, t0 = 0, time.monotonic()
        try:
            while block := os.read(fd, MiB):
                n += len(block)
        finally:
            os.close(fd)
        return round(n / MiB / (time.monotonic() - t0), 1)

    lz = lazy_factory("figures")
    path = lz.attach(layer.ref())
    meta = layer_stats(lz, layer.digest)
    m = mount(lazy_factory, path, lz.cache_dir.parent / "erofs")
    t0 = time.monotonic()
    walk_metadata_only(m.mp)
    ls_s = time.monotonic() - t0
    m.umount()
    fadvise_out(path)
    cold = mib_s(path)
    fadvise_out(path)
    warm = mib_s(path)
    fadvise_out(layer.erofs)
    local = mib_s(layer.erofs)
    st = lz.stats()
    figures = {
        "layer_bytes": len(layer.data), "chunks": len(layer.chunks),
        "metadata_chunks": meta["metadata_chunks"], "metadata_bytes": meta["metadata_bytes"],
        "ls_R_ms": round(ls_s * 1000, 1),
        "chunk_fetch_p50_ms": st["fetch_latency_ms"]["p50"],
        "fuse_read_mib_s_cold": cold, "fuse_read_mib_s_warm": warm, "local_read_mib_s": local,
        "load_avg_1m": os.getloadavg()[0],
    }
    print("lazy figures:", figures)
    assert cold > 0 and warm > 0
