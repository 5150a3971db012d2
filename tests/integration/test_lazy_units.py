"""The lazy layer pieces on their own, without FUSE or a registry (no root needed):
the chunk table model, the cache, the engine against a scripted fetcher, the EROFS walk."""

from __future__ import annotations

import hashlib
import math
import os
import shutil
import time
from pathlib import Path

import pytest
import trio

from dsec.errors import InvalidSpec
from dsec.images.erofs import make_erofs
from dsec.images.lazy.cache import ChunkCache
from dsec.images.lazy.engine import Engine, EngineConfig, ReadFailed
from dsec.images.lazy.erofs_meta import covering_chunks, parse_superblock, walk_metadata
from dsec.images.lazy.fetch import FetchError
from dsec.images.lazy.model import RemoteLayer

CS = 4096


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def make_layer(data: bytes, cs: int = CS) -> RemoteLayer:
    return RemoteLayer(
        registry="http://127.0.0.1:1", repo="r", digest="sha256:" + sha(data), size=len(data),
        chunk_size=cs, chunks=tuple("sha256:" + sha(data[i : i + cs]) for i in range(0, len(data), cs)),
    )


class ScriptedFetcher:
    """Serves ranges of ``data``, counting calls; can corrupt, fail or hang on demand."""

    def __init__(self, data: bytes, *, delay: float = 0.0) -> None:
        self.data = data
        self.delay = delay
        self.calls: list[tuple[int, int]] = []
        self.corrupt: set[int] = set()
        self.down = False
        self.hang = False

    async def fetch_range(self, registry: str, repo: str, digest: str, start: int, end: int,
                          headers: dict[str, str]) -> bytes:
        self.calls.append((start, end))
        if self.hang:
            await trio.sleep_forever()
        if self.down:
            raise FetchError("connection refused")
        await trio.sleep(self.delay)
        out = bytearray(self.data[start:end])
        if start in self.corrupt:
            out[0] ^= 1
        return bytes(out)

    async def aclose(self) -> None:
        return None


def run_engine(tmp: Path, fetcher: ScriptedFetcher, body, **cfg: float) -> None:  # type: ignore[no-untyped-def]
    cache = ChunkCache(tmp / "cache", limit_bytes=None)
    cache.open()
    engine = Engine(cache, fetcher, EngineConfig(**cfg))  # type: ignore[arg-type]

    async def main() -> None:
        async with trio.open_nursery() as n:
            engine.bind(n)
            await body(engine, cache)
            n.cancel_scope.cancel()

    trio.run(main)


def test_lazy_model_checks_the_chunk_table() -> None:
    data = os.urandom(3 * CS + 5)
    layer = make_layer(data)
    assert layer.chunk_range(3) == (3 * CS, 3 * CS + 5)
    assert layer.filename == f"{layer.digest[7:]}.erofs"
    with pytest.raises(ValueError):
        RemoteLayer(**{**layer.model_dump(), "chunks": layer.chunks[:-1]})
    with pytest.raises(InvalidSpec):
        RemoteLayer.from_config({"size": 1}, registry="http://x", repo="r")
    assert "Authorization" not in repr(RemoteLayer(**{**layer.model_dump(), "headers": {"Authorization": "x"}}))


def test_lazy_cache_lru_pins_partials_and_damage(tmp_path: Path) -> None:
    cache = ChunkCache(tmp_path, limit_bytes=3 * CS)
    cache.open()
    chunks = [os.urandom(CS) for _ in range(5)]
    cache.pin(sha(chunks[0]))
    for c in chunks:
        cache.put(sha(c), c)
        time.sleep(0.01)  # distinct mtimes: the rebuilt LRU order
    st = cache.stats()
    assert st.bytes <= 3 * CS + CS and st.evictions >= 1
    assert cache.contains(sha(chunks[0])), "a pinned chunk was evicted"
    cache.unpin(sha(chunks[0]))
    assert cache.stats().bytes <= 3 * CS
    assert cache.contains(sha(chunks[4]))
    # restart: index rebuilt from the files, a crashed writer's partial file removed
    (tmp_path / "sha256" / ".tmp-abc-1").write_bytes(b"partial")
    again = ChunkCache(tmp_path, limit_bytes=3 * CS)
    assert again.open() == 1
    assert again.stats().chunks == cache.stats().chunks
    # a file damaged on disk is dropped on first use, never served
    victim = sha(chunks[4])
    (tmp_path / "sha256" / victim).write_bytes(b"x" * CS)
    assert not again.verified(victim, CS)
    assert not again.contains(victim) and again.stats().dropped_damaged == 1


def test_lazy_engine_fetches_a_chunk_once_for_concurrent_readers(tmp_path: Path) -> None:
    data = os.urandom(8 * CS)
    layer = make_layer(data)
    fetcher = ScriptedFetcher(data, delay=0.05)

    async def body(engine: Engine, cache: ChunkCache) -> None:
        al = await engine.attach(layer, prefetch_metadata=False)
        got: list[bytes] = []

        async def reader(off: int) -> None:
            got.append(await engine.read(al, off, 512))

        async with trio.open_nursery() as n:
            for k in range(32):
                n.start_soon(reader, CS + (k % 8) * 512)
        want = [data[CS + (k % 8) * 512 :][:512] for k in range(32)]
        assert sorted(got) == sorted(want)
        assert fetcher.calls == [(CS, 2 * CS)]
        # a read across chunk boundaries joins them
        assert await engine.read(al, CS - 10, 20) == data[CS - 10 : CS + 10]
        assert engine.stats()["chunks_fetched"] == 2

    run_engine(tmp_path, fetcher, body, readahead_chunks=0)


def test_lazy_engine_refuses_corrupt_chunks_and_bounds_failures(tmp_path: Path) -> None:
    data = os.urandom(6 * CS)
    layer = make_layer(data)
    fetcher = ScriptedFetcher(data)
    fetcher.corrupt.add(2 * CS)

    async def body(engine: Engine, cache: ChunkCache) -> None:
        al = await engine.attach(layer, prefetch_metadata=False)
        assert await engine.read(al, 0, 10) == data[:10]
        with pytest.raises(ReadFailed) as ei:
            await engine.read(al, 2 * CS, 100)
        assert ei.value.reason == "corrupt"
        assert not cache.contains(layer.chunks[2][7:])
        st = engine.stats()
        assert st["corrupt_chunks"] == 1 and st["read_errors"] == 1
        assert st["corrupt_events"][0]["chunk"] == 2
        # registry down: a bounded number of attempts, then EIO
        fetcher.down = True
        calls = len(fetcher.calls)
        with pytest.raises(ReadFailed) as ei:
            await engine.read(al, 3 * CS, 100)
        assert ei.value.reason == "unavailable"
        assert len(fetcher.calls) - calls == 3
        # a registry that never answers: the read deadline ends it
        fetcher.down, fetcher.hang = False, True
        t0 = trio.current_time()
        with pytest.raises(ReadFailed) as ei:
            await engine.read(al, 4 * CS, 100)
        assert ei.value.reason == "deadline" and trio.current_time() - t0 < 1.5
        # a chunk fetched before still reads with the registry gone
        fetcher.hang = False
        fetcher.down = True
        assert await engine.read(al, 5, 10) == data[5:15]

    run_engine(tmp_path, fetcher, body, readahead_chunks=0, fetch_attempts=3, backoff_s=0.01,
               read_deadline_s=0.5, attempt_timeout_s=5.0)


def test_lazy_engine_reads_ahead_for_a_streaming_reader(tmp_path: Path) -> None:
    data = os.urandom(16 * CS)
    layer = make_layer(data)
    fetcher = ScriptedFetcher(data)

    async def body(engine: Engine, cache: ChunkCache) -> None:
        al = await engine.attach(layer, prefetch_metadata=False)
        for off in range(0, 2 * CS, 1024):
            assert await engine.read(al, off, 1024) == data[off : off + 1024]
        await trio.sleep(0.1)
        assert engine.stats()["readahead_chunks"] >= 1
        assert cache.contains(layer.chunks[3][7:])

    run_engine(tmp_path, fetcher, body, readahead_chunks=2, readahead_trigger=2 * 1024)


@pytest.mark.skipif(shutil.which("mkfs.erofs") is None, reason="needs mkfs.erofs (erofs-utils)")
def test_lazy_metadata_walk_finds_every_inode(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    for d in range(30):
        sub = tree / f"d{d}" / "deeper"
        sub.mkdir(parents=True)
        for f in range(40):  # directories larger than one block
            (sub / f"a-rather-long-file-name-{f:04d}.txt").write_text("x" * (f * 37))
    (tree / "link").symlink_to("d0")
    out = tmp_path / "l.erofs"
    make_erofs(tree, out)
    data = out.read_bytes()

    async def read(off: int, n: int) -> bytes:
        return data[off : off + n]

    meta = trio.run(walk_metadata, read)
    sb = parse_superblock(data[1024:1152])
    assert meta.inodes == sb.inos == sum(1 for _ in tree.rglob("*")) + 1
    assert meta.directories == 1 + 30 * 2
    chunks = covering_chunks(meta.ranges, 1 << 20, len(data))
    assert chunks[0] == 0 and chunks[-1] <= math.ceil(len(data) / (1 << 20)) - 1


def test_lazy_engine_concurrent_attaches_of_one_layer_make_one(tmp_path: Path) -> None:
    data = os.urandom(4 * CS)
    layer = make_layer(data)
    fetcher = ScriptedFetcher(data, delay=0.02)

    async def body(engine: Engine, cache: ChunkCache) -> None:
        got = []

        async def attach() -> None:
            got.append(await engine.attach(layer))  # not EROFS: the walk gives up, still attached

        async with trio.open_nursery() as n:
            for _ in range(5):
                n.start_soon(attach)
        assert len({a.ino for a in got}) == 1 and len(engine.by_ino) == 1
        assert got[0].metadata_error

    run_engine(tmp_path, fetcher, body)


def test_the_extents_parse_in_its_own_process_matches_the_in_process_walk(tmp_path: Path) -> None:
    """``python -m dsec.images.lazy.extents`` (how the loader works out a lazy form's file extents
    without holding its GIL) gives exactly what the walk gives in process; bad input is refused."""
    import subprocess
    import sys

    from dsec.images.lazy.extents import decode, encode, pack, unpack, walk_extents
    from dsec.images.lazyform import LazyFormUnavailable, build_lazy_form

    tree = tmp_path / "tree"
    (tree / "d").mkdir(parents=True)
    for i in range(30):
        (tree / "d" / f"f{i}").write_bytes(os.urandom(1000 + 5000 * i))
    (tree / "empty").write_bytes(b"")
    layer = tmp_path / "layer.erofs"
    make_erofs(tree, layer)
    work = tmp_path / "lazy"
    work.mkdir()
    try:
        meta, _data = build_lazy_form(layer, work)
    except LazyFormUnavailable as exc:
        pytest.skip(str(exc))
    image = meta.read_bytes()
    want = walk_extents(image).data_extents
    assert want and len(want) >= 30  # every non-empty file has its data somewhere
    proc = subprocess.run([sys.executable, "-m", "dsec.images.lazy.extents"], input=image, capture_output=True,
                          check=True)  # fmt: skip
    starts, ends = decode(proc.stdout)
    assert list(zip(starts, ends, strict=True)) == [tuple(e) for e in want]
    assert decode(encode([(1, 2), (5, 9)])) == ([1, 5], [2, 9])
    # what a push ships in the lazy form, so that edges need not parse at all
    assert unpack(pack(want)) == (starts, ends)
    with pytest.raises(ValueError):
        unpack("not base64 zstd!")
    with pytest.raises(ValueError):
        decode(proc.stdout[:-1])
    bad = subprocess.run([sys.executable, "-m", "dsec.images.lazy.extents"], input=b"\0" * 4096, capture_output=True)
    assert bad.returncode == 2 and b"not a metadata image" in bad.stderr
