"""The chunk engine: maps reads of attached layers to verified chunks, fetched once.

Everything the FUSE process does with bytes happens here, on one trio event loop:

- A read of ``[off, off+n)`` of a layer is split at chunk boundaries; each chunk
  comes from the :class:`~.cache.ChunkCache` or is fetched by one Range request.
- A fetched chunk is hashed and compared with the chunk table before anything is
  done with it: a mismatch is refused (:class:`ChunkCorrupt`, a counter, a warning
  naming the layer and chunk) and its bytes are dropped. Nothing unverified is
  ever returned or cached.
- Concurrent reads of one chunk share one fetch (in-flight table keyed by the
  chunk's digest, so equal chunks of different layers share it too). The fetch
  runs in the engine's own nursery, so a reader giving up does not cancel it
  for the others.
- Fetch failures are retried with exponential backoff a bounded number of times;
  every read has a deadline after which it fails (:class:`ReadFailed`, EIO in the
  filesystem). A read never waits without end.
- A streaming reader (consecutive reads past ``readahead_trigger`` bytes) makes the
  engine fetch the next ``readahead_chunks`` chunks in the background.
- On attach the EROFS metadata is walked (:mod:`.erofs_meta`) and the chunks that
  hold it are fetched, so a tree walk of the mounted layer needs no other chunk.

Never blocks the loop on the network or on hashing (worker threads); small cache
reads (page-cache hits) are done inline, since a thread hop would cost more.
"""

from __future__ import annotations

import bisect
import collections
import hashlib
import logging
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import trio

from .cache import ChunkCache
from .erofs_meta import ErofsFormatError, covering_chunks, walk_metadata
from .errors import ChunkCorrupt, LayerBusy, LayerUnavailable, LazyError
from .extents import decode as decode_extents
from .extents import unpack as unpack_extents
from .fetch import FetchError, RangeFetcher
from .model import RemoteLayer

log = logging.getLogger("dsec.images.lazy")

LATENCY_BUCKETS_MS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000)


class ReadFailed(Exception):
    """A read cannot be served (EIO): ``reason`` is corrupt, unavailable or deadline."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass(frozen=True)
class EngineConfig:
    read_deadline_s: float = 30.0
    """A read fails with EIO after this long, whatever is still being tried."""
    fetch_attempts: int = 4
    attempt_timeout_s: float = 10.0
    backoff_s: float = 0.1
    """Sleep before retry k is ``backoff_s * 2**k``, capped at ``max_backoff_s``."""
    max_backoff_s: float = 2.0
    max_concurrent_fetches: int = 16
    readahead_chunks: int = 4
    readahead_trigger: int = 256 * 1024
    """Bytes of consecutive reads before readahead starts (so 4 KiB metadata reads never trigger it)."""


@dataclass
class LayerCounters:
    reads: int = 0
    read_bytes: int = 0
    hits: int = 0
    misses: int = 0
    chunks_fetched: int = 0
    bytes_fetched: int = 0
    read_errors: int = 0
    corrupt_chunks: int = 0
    registry_errors: int = 0
    readahead_chunks: int = 0
    metadata_chunks: int = 0
    metadata_bytes: int = 0
    metadata_inodes: int = 0
    metadata_s: float = 0.0
    prefetch_chunks: int = 0
    """Chunks of the layer's prefetch profile fetched ahead at attach (not cached before)."""
    prefetch_s: float = 0.0
    """Seconds from attach until the profile's chunks were all in (0: none or not done)."""


@dataclass
class Attached:
    layer: RemoteLayer
    ino: int
    attached_at: float
    counters: LayerCounters = field(default_factory=LayerCounters)
    open_count: int = 0
    next_offset: int = -1
    run_bytes: int = 0
    metadata_error: str = ""
    extents_of: str = ""
    """Hex digest of the metadata image whose files' data this layer holds (a lazy form's
    data device): a miss then fetches the rest of the file's extent with it."""
    extents: tuple[list[int], list[int]] | None = None
    """Sorted starts and their ends of the files' extents in this layer (once worked out)."""


class _Inflight:
    __slots__ = ("data", "error", "event", "stored")

    def __init__(self) -> None:
        self.event = trio.Event()
        """Set when ``data`` or ``error`` is there."""
        self.stored = trio.Event()
        """Set once the chunk is in the cache (or will not be: an error)."""
        self.data: bytes | None = None
        self.error: Exception | None = None


class LatencyHistogram:
    def __init__(self, keep: int = 4096) -> None:
        self.counts = [0] * (len(LATENCY_BUCKETS_MS) + 1)
        self.recent: collections.deque[float] = collections.deque(maxlen=keep)
        self.total = 0
        self.sum_ms = 0.0

    def observe(self, ms: float) -> None:
        self.counts[bisect.bisect_left(LATENCY_BUCKETS_MS, ms)] += 1
        self.recent.append(ms)
        self.total += 1
        self.sum_ms += ms

    def snapshot(self) -> dict[str, Any]:
        r = sorted(self.recent)

        def pct(p: float) -> float | None:
            return round(r[min(len(r) - 1, int(p * len(r)))], 3) if r else None

        buckets = {str(b): c for b, c in zip(LATENCY_BUCKETS_MS, self.counts, strict=False)}
        buckets["+Inf"] = self.counts[-1]
        return {"count": self.total, "sum_ms": round(self.sum_ms, 3), "buckets_le_ms": buckets,
                "p50": pct(0.5), "p90": pct(0.9), "p99": pct(0.99)}


MAX_READAHEAD_BYTES = 8 << 20
"""A sequential reader's readahead window grows to at most this."""
FILE_FETCH_BYTES = 4 << 20
PLAIN_KEEP_BYTES = 64 << 20
"""Inflated chunks of encoded layers kept in memory (LRU): a FUSE read that hits one copies a
slice instead of reading the chunk's file and inflating all of it again (the kernel reads a
64 KiB chunk in several pieces)."""
"""A miss in a lazy form's data device fetches this much of the file it falls in, at most."""
MAX_RUN_BYTES = 2 << 20
"""Most bytes one Range request asks for: consecutive missing chunks go together up to this."""


def _hash_pieces(data: bytes, start: int, run: list[int], layer: RemoteLayer) -> list[tuple[bytes, str]]:
    out = []
    for i in run:
        lo, hi = layer.wire_range(i)
        piece = data[lo - start : hi - start]
        out.append((piece, hashlib.sha256(piece).hexdigest()))
    return out


def _check_run(data: bytes, start: int, run: list[int], layer: RemoteLayer) -> list[tuple[bytes, str, bytes | None]]:
    """Per chunk of a fetched run: its wire bytes, the digest they have, and its file bytes (None
    when the digest is not the table's or they do not inflate to the chunk's length)."""
    return [(piece, got, _decode(layer, i, piece) if got == layer.chunks[i][7:] else None)
            for i, (piece, got) in zip(run, _hash_pieces(data, start, run, layer), strict=True)]


def _decode(layer: RemoteLayer, idx: int, piece: bytes) -> bytes | None:
    """The file's bytes of chunk ``idx`` from its verified wire bytes; None if they do not
    decode to exactly the chunk's length (a pusher's bug: treated as a corrupt chunk)."""
    if not layer.encoding:
        return piece
    lo, hi = layer.chunk_range(idx)
    try:
        out = _zstd().decompress(piece, max_output_size=hi - lo)
    except Exception:  # zstandard raises its own ZstdError
        return None
    return out if len(out) == hi - lo else None


def _zstd() -> Any:
    import zstandard

    return zstandard.ZstdDecompressor()


def _hex(digest: str) -> str:
    return digest.removeprefix("sha256:")


def _sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class Engine:
    """Serves reads of attached layers. Use from the trio loop only, after :meth:`bind`."""

    def __init__(
        self,
        cache: ChunkCache,
        fetcher: RangeFetcher,
        config: EngineConfig | None = None,
        *,
        on_change: Callable[[], None] | None = None,
    ) -> None:
        self.cache = cache
        self.fetcher = fetcher
        self.config = config or EngineConfig()
        self.on_change = on_change
        self.layers: dict[str, Attached] = {}  # hex -> Attached
        self.by_ino: dict[int, Attached] = {}
        self._next_ino = 2
        self._inflight: dict[str, _Inflight] = {}
        self._attaching: dict[str, trio.Event] = {}
        self._nursery: trio.Nursery | None = None
        self._limiter = trio.CapacityLimiter(self.config.max_concurrent_fetches)
        self.latency = LatencyHistogram()
        self.totals = LayerCounters()
        self.read_timeouts = 0
        self.corrupt_events: collections.deque[dict[str, Any]] = collections.deque(maxlen=20)
        self._plain: collections.OrderedDict[str, bytes] = collections.OrderedDict()
        self._plain_bytes = 0
        self.started = time.time()

    def bind(self, nursery: trio.Nursery) -> None:
        """Give the engine the nursery its background fetches run in (lives as long as it)."""
        self._nursery = nursery

    # ------------------------------------------------------------ attach/detach --

    async def attach(self, layer: RemoteLayer, *, prefetch_metadata: bool = True,
                     prefetch_all: bool = False, extents_of: str = "") -> Attached:
        """Make ``layer`` readable; with ``prefetch_metadata`` fetch its metadata chunks first,
        with ``prefetch_all`` every chunk (a lazy form's metadata image, which is all metadata).
        Raises LayerUnavailable / ChunkCorrupt when they cannot be had (the layer is then
        not attached). Attaching an attached layer refreshes its headers (new tokens)."""
        while (pending := self._attaching.get(layer.hex)) is not None:
            await pending.wait()  # another attach of this layer is prefetching: share its outcome
        al = self.layers.get(layer.hex)
        if al is not None:
            if (al.layer.size, al.layer.chunk_size, al.layer.chunks) != (
                layer.size, layer.chunk_size, layer.chunks,
            ):
                raise LazyError(
                    f"layer {layer.digest} is attached with another chunk table", digest=layer.digest
                )
            al.layer = layer
            return al
        al = Attached(layer=layer, ino=self._next_ino, attached_at=time.time(), extents_of=_hex(extents_of))
        if layer.extents:
            try:
                al.extents = unpack_extents(layer.extents)
                al.extents_of = ""  # known: nothing to work out
            except ValueError as exc:
                log.warning("layer %s: its packed extents are unreadable (%s); working them out", layer.digest, exc)
        self._next_ino += 1
        if prefetch_metadata or prefetch_all:
            done = self._attaching[layer.hex] = trio.Event()
            try:
                await (self._prefetch_all(al) if prefetch_all else self._prefetch_metadata(al))
            finally:
                del self._attaching[layer.hex]
                done.set()
        self.layers[layer.hex] = al
        self.by_ino[al.ino] = al
        self._changed()
        if layer.prefetch and self._nursery is not None:
            # the extents' parse (pure Python, ~0.4 s for 70,000 files) would hold the GIL while
            # the start-up reads: it waits until the profile is in, which serves those reads
            self._nursery.start_soon(self._prefetch_then_extents, al)
        elif al.extents_of and self._nursery is not None:
            self._nursery.start_soon(self._work_out_extents, al)
        return al

    async def _prefetch_then_extents(self, al: Attached) -> None:
        await self._prefetch_profile(al)
        if al.extents_of:
            await self._work_out_extents(al)

    async def _prefetch_profile(self, al: Attached) -> None:
        """Fetch the chunks of the layer's prefetch profile, all at once, in the background
        (reads of them meanwhile wait for the fetch in flight instead of starting their own)."""
        t0 = time.monotonic()
        indexes = al.layer.prefetch_indexes()
        wanted = [i for i in indexes if not self.cache.contains(al.layer.chunks[i][7:])]
        self._count(al, "prefetch_chunks", len(wanted))
        try:
            await self._fetch_chunks(al, wanted)
        except (ReadFailed, trio.TooSlowError) as exc:  # the reads that need them retry on their own
            log.warning("layer %s: prefetch of %d chunks incomplete: %s", al.layer.digest, len(wanted), exc)
            return
        al.counters.prefetch_s = round(time.monotonic() - t0, 4)
        log.info("layer %s: prefetched %d chunks in %.3f s", al.layer.digest, len(wanted), al.counters.prefetch_s)

    async def _work_out_extents(self, al: Attached) -> None:
        """Read the files' extents from the metadata image (cached: it was fetched whole)."""
        meta = self.layers.get(al.extents_of)
        if meta is None:
            log.warning("layer %s: its metadata image sha256:%s is not attached; no file-sized fetches",
                        al.layer.digest, al.extents_of)  # fmt: skip
            return

        t0 = time.monotonic()
        try:
            image = await self._read_range(meta, 0, meta.layer.size)  # cached: fetched whole at attach
            # parsed in a child process: in a thread its pure-Python walk of tens of thousands of
            # inodes would hold the GIL the FUSE reads need (dsec.images.lazy.extents)
            proc = await trio.run_process([sys.executable, "-m", "dsec.images.lazy.extents"], stdin=image,
                                          capture_stdout=True, capture_stderr=True, check=False)  # fmt: skip
            if proc.returncode != 0:
                raise ErofsFormatError(proc.stderr.decode(errors="replace").strip()[-500:] or
                                       f"the parse exited {proc.returncode}")  # fmt: skip
            al.extents = decode_extents(proc.stdout)
        except (ErofsFormatError, ReadFailed, OSError, ValueError) as exc:
            log.warning("layer %s: file extents not worked out: %s", al.layer.digest, exc)
            return
        log.info("layer %s: %d file extents in %.2f s", al.layer.digest, len(al.extents[0]), time.monotonic() - t0)

    def detach(self, hex_digest: str) -> bool:
        al = self.layers.get(hex_digest)
        if al is None:
            return False
        if al.open_count:
            raise LayerBusy(
                f"layer sha256:{hex_digest} is open {al.open_count} time(s) (an EROFS mount holds it); "
                "unmount it first",
                digest=f"sha256:{hex_digest}",
            )
        del self.layers[hex_digest]
        del self.by_ino[al.ino]
        self._changed()
        return True

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    async def _prefetch_all(self, al: Attached) -> None:
        layer = al.layer
        t0 = time.monotonic()
        before = al.counters.bytes_fetched
        try:
            await self._fetch_chunks(al, range(len(layer.chunks)))
        except trio.TooSlowError:
            raise LayerUnavailable(
                f"layer file {layer.digest}: not fetched within {self.config.read_deadline_s} s",
                digest=layer.digest, registry=layer.registry, status=0,
            ) from None
        except ReadFailed as exc:
            if isinstance(exc.__cause__, LazyError):
                raise exc.__cause__ from None
            raise LayerUnavailable(f"layer file {layer.digest}: not fetched: {exc}", digest=layer.digest,
                                   registry=layer.registry, status=0) from None  # fmt: skip
        al.counters.metadata_chunks = len(layer.chunks)
        al.counters.metadata_bytes = al.counters.bytes_fetched - before
        al.counters.metadata_s = round(time.monotonic() - t0, 4)

    async def _fetch_chunks(self, al: Attached, indexes: Iterable[int]) -> None:
        """Fetch every chunk of ``indexes`` not cached (runs together), by the read deadline:
        trio.TooSlowError past it, the first ReadFailed if any failed."""
        wanted = [i for i in indexes if not self.cache.contains(al.layer.chunks[i][7:])]
        errors: list[ReadFailed] = []

        async def one(i: int) -> None:
            try:
                await self._fetch_shared(al, i)
            except ReadFailed as exc:
                errors.append(exc)

        with trio.fail_after(self.config.read_deadline_s):
            self._start_fetches(al, wanted)
            async with trio.open_nursery() as n:
                for i in wanted:
                    n.start_soon(one, i)
            # the callers want them cached (a metadata image, a layer to materialize), not only read
            await self.wait_stored(al, wanted)
        if errors:
            raise errors[0]

    async def wait_stored(self, al: Attached, indexes: Iterable[int] | None = None) -> None:
        """Wait until the fetches in flight of these chunks (default: all of the layer's) have
        put them in the cache: a fetch answers its readers before it writes the chunk's file."""
        chunks = al.layer.chunks
        for hx in {chunks[i][7:] for i in (range(len(chunks)) if indexes is None else indexes)}:
            inf = self._inflight.get(hx)
            if inf is not None:
                await inf.stored.wait()

    async def _prefetch_metadata(self, al: Attached) -> None:
        layer = al.layer
        t0 = time.monotonic()
        before = al.counters.bytes_fetched

        async def read(off: int, n: int) -> bytes:
            with trio.fail_after(self.config.read_deadline_s):
                return await self._read_range(al, off, n)

        async def prefetch(ranges: list[tuple[int, int]]) -> None:
            await self._fetch_chunks(al, covering_chunks(ranges, layer.chunk_size, layer.size))

        try:
            meta = await walk_metadata(read, prefetch)
        except ErofsFormatError as exc:
            al.metadata_error = str(exc)
            log.warning("layer %s: metadata not prefetched: %s", layer.digest, exc)
            return
        except ReadFailed as exc:
            if isinstance(exc.__cause__, LazyError):
                raise exc.__cause__ from None
            raise LayerUnavailable(
                f"layer {layer.digest}: metadata not fetched: {exc}",
                digest=layer.digest, registry=layer.registry, status=0,
            ) from None
        except trio.TooSlowError:
            raise LayerUnavailable(
                f"layer {layer.digest}: metadata not fetched within {self.config.read_deadline_s} s",
                digest=layer.digest, registry=layer.registry, status=0,
            ) from None
        al.counters.metadata_chunks = len(covering_chunks(meta.ranges, layer.chunk_size, layer.size))
        al.counters.metadata_bytes = al.counters.bytes_fetched - before
        al.counters.metadata_inodes = meta.inodes
        al.counters.metadata_s = round(time.monotonic() - t0, 4)

    # -------------------------------------------------------------------- reads --

    def open(self, ino: int) -> Attached | None:
        al = self.by_ino.get(ino)
        if al is not None:
            al.open_count += 1
        return al

    def release(self, al: Attached) -> None:
        al.open_count = max(0, al.open_count - 1)

    async def read(self, al: Attached, off: int, size: int) -> bytes:
        """A read from the filesystem: the bytes, or ReadFailed (EIO) by the deadline."""
        layer = al.layer
        if off >= layer.size or size <= 0:
            return b""
        end = min(off + size, layer.size)
        al.run_bytes = al.run_bytes + (end - off) if off == al.next_offset else end - off
        al.next_offset = end
        al.counters.reads += 1
        self.totals.reads += 1
        if al.extents is not None:
            self._fetch_file_around(al, off, end)
        try:
            with trio.fail_after(self.config.read_deadline_s):
                data = await self._read_range(al, off, end - off)
        except trio.TooSlowError:
            self.read_timeouts += 1
            self._count(al, "read_errors")
            raise ReadFailed("deadline", f"{layer.digest} [{off}, {end}) not read within "
                             f"{self.config.read_deadline_s} s") from None
        except ReadFailed:
            self._count(al, "read_errors")
            raise
        al.counters.read_bytes += len(data)
        self.totals.read_bytes += len(data)
        if self.config.readahead_chunks and al.run_bytes >= self.config.readahead_trigger:
            # the window grows with the stream (as much as it has read), up to MAX_READAHEAD_BYTES
            window = min(MAX_READAHEAD_BYTES, max(self.config.readahead_chunks * layer.chunk_size, al.run_bytes))
            self._readahead(al, (end - 1) // layer.chunk_size + 1, max(1, window // layer.chunk_size))
        return data

    def _fetch_file_around(self, al: Attached, off: int, end: int) -> None:
        """A read that misses: fetch with it the rest of its file's extent (up to
        FILE_FETCH_BYTES), in as few requests as the runs allow."""
        assert al.extents is not None
        starts, ends = al.extents
        k = bisect.bisect_right(starts, off) - 1
        if k < 0 or ends[k] <= off:
            return
        layer = al.layer
        cs = layer.chunk_size
        stop = min(ends[k], off + FILE_FETCH_BYTES, layer.size)
        if stop <= end:
            return
        first, last = off // cs, (stop - 1) // cs
        want = [i for i in range(first, last + 1)
                if layer.chunks[i][7:] not in self._inflight and not self.cache.contains(layer.chunks[i][7:])]
        if want and want[0] == first:  # only on a miss: a cached read stays a cached read
            self._count(al, "readahead_chunks", len(want))
            self._start_fetches(al, want)

    async def _read_range(self, al: Attached, off: int, n: int) -> bytes:
        layer = al.layer
        cs = layer.chunk_size
        end = min(off + n, layer.size)
        if off >= end:
            return b""
        first, last = off // cs, (end - 1) // cs
        if first == last:
            return await self._slice(al, first, off - first * cs, end - first * cs)
        missing = [i for i in range(first, last + 1)
                   if layer.chunks[i][7:] not in self._inflight and not self.cache.contains(layer.chunks[i][7:])]
        if len(missing) > 1:
            self._start_fetches(al, missing)  # one request per run, not one per chunk
        parts: list[bytes] = [b""] * (last - first + 1)

        async def one(k: int) -> None:
            i = first + k
            lo = max(off, i * cs) - i * cs
            hi = min(end, (i + 1) * cs) - i * cs
            parts[k] = await self._slice(al, i, lo, hi)

        try:
            async with trio.open_nursery() as nursery:
                for k in range(len(parts)):
                    nursery.start_soon(one, k)
        except* ReadFailed as group:
            raise group.exceptions[0] from None
        return b"".join(parts)

    async def _slice(self, al: Attached, idx: int, lo: int, hi: int) -> bytes:
        layer = al.layer
        hx = layer.chunks[idx][7:]
        start, end = layer.wire_range(idx)
        if layer.encoding and (plain := self._plain.get(hx)) is not None:
            self._plain.move_to_end(hx)
            self._count(al, "hits")
            return plain[lo:hi]
        self.cache.pin(hx)
        try:
            if self.cache.contains(hx) and await self._usable(hx, end - start):
                if layer.encoding:  # the cache keeps chunks as fetched (checkable): decode each use
                    raw = self.cache.read(hx, 0, end - start)
                    data = None if raw is None else _decode(layer, idx, raw)
                    if data is not None:
                        self._keep_plain(hx, data)
                        data = data[lo:hi]
                else:
                    data = self.cache.read(hx, lo, hi - lo)
                if data is not None and len(data) == hi - lo:
                    self._count(al, "hits")
                    return data
            self._count(al, "misses")
            chunk = await self._fetch_shared(al, idx)
            return chunk[lo:hi]
        finally:
            self.cache.unpin(hx)

    def _keep_plain(self, hx: str, data: bytes) -> None:
        """Remember an encoded chunk's inflated bytes (keyed by its wire digest), LRU-bounded."""
        if hx in self._plain:
            self._plain.move_to_end(hx)
            return
        self._plain[hx] = data
        self._plain_bytes += len(data)
        while self._plain_bytes > PLAIN_KEEP_BYTES and self._plain:
            _, old = self._plain.popitem(last=False)
            self._plain_bytes -= len(old)

    async def _usable(self, hx: str, size: int) -> bool:
        if self.cache.is_verified(hx):
            return True
        return await trio.to_thread.run_sync(self.cache.verified, hx, size)

    def _count(self, al: Attached, name: str, n: int = 1) -> None:
        setattr(al.counters, name, getattr(al.counters, name) + n)
        setattr(self.totals, name, getattr(self.totals, name) + n)

    # ------------------------------------------------------------------ fetches --

    async def _fetch_shared(self, al: Attached, idx: int) -> bytes:
        """The verified bytes of chunk ``idx``, fetching it unless a fetch is in flight."""
        hx = al.layer.chunks[idx][7:]
        inf = self._inflight.get(hx)
        if inf is None:
            self._start_fetches(al, [idx])
            inf = self._inflight[hx]
        await inf.event.wait()
        if inf.error is not None:
            raise ReadFailed(
                "corrupt" if isinstance(inf.error, ChunkCorrupt) else "unavailable", str(inf.error)
            ) from inf.error
        assert inf.data is not None
        return inf.data

    def _start_fetches(self, al: Attached, indexes: list[int]) -> None:
        """Start fetching these chunks (those neither cached nor in flight), consecutive ones
        together: one Range request per run of up to :data:`MAX_RUN_BYTES`, each chunk of it
        verified on its own."""
        if self._nursery is None:
            raise RuntimeError("Engine.bind() was not called")
        layer = al.layer
        max_run = max(1, MAX_RUN_BYTES // layer.chunk_size)
        run: list[int] = []
        claimed: set[str] = set()

        def flush() -> None:
            if run:
                infs = [self._inflight[layer.chunks[i][7:]] for i in run]
                assert self._nursery is not None
                self._nursery.start_soon(self._fetch_run_task, al, list(run), infs)
                run.clear()

        for i in sorted(set(indexes)):
            hx = layer.chunks[i][7:]
            if hx in self._inflight or hx in claimed:
                flush()
                continue
            if run and (i != run[-1] + 1 or len(run) >= max_run):
                flush()
            self._inflight[hx] = _Inflight()
            claimed.add(hx)
            run.append(i)
        flush()

    async def _fetch_run_task(self, al: Attached, run: list[int], infs: list[_Inflight]) -> None:
        keep: list[tuple[str, bytes]] = []
        try:
            async with self._limiter:
                datas, keep = await self._fetch_verified(al, run)
            for i, inf, data in zip(run, infs, datas, strict=True):
                if isinstance(data, Exception):
                    inf.error = data
                else:
                    inf.data = data
                    if al.layer.encoding:
                        self._keep_plain(al.layer.chunks[i][7:], data)
        except (LazyError, OSError) as exc:
            for inf in infs:
                inf.error = exc
        finally:
            for inf in infs:
                inf.event.set()  # the readers have their bytes now
            try:
                # A chunk file costs ~1 ms to create on some filesystems: written after the
                # readers are answered; the chunks stay "in flight" (with their bytes, for any
                # reader that comes meanwhile) until they are in the cache.
                if keep:
                    with trio.CancelScope(shield=True):
                        await trio.to_thread.run_sync(self._put_all, keep)
            finally:
                for i, inf in zip(run, infs, strict=True):
                    self._inflight.pop(al.layer.chunks[i][7:], None)
                    inf.stored.set()

    async def _fetch_verified(self, al: Attached,
                              run: list[int]) -> tuple[list[bytes | ChunkCorrupt], list[tuple[str, bytes]]]:  # fmt: skip
        """Chunks ``run`` (consecutive) in one Range request, each checked against its digest:
        its bytes, or the ChunkCorrupt it is refused with (the others are still good); and the
        good ones' wire bytes by digest, for the cache."""
        layer = al.layer
        start, end = layer.wire_range(run[0])[0], layer.wire_range(run[-1])[1]
        cfg = self.config
        last: Exception | None = None
        status = 0
        for attempt in range(max(1, cfg.fetch_attempts)):
            if attempt:
                await trio.sleep(min(cfg.backoff_s * 2 ** (attempt - 1), cfg.max_backoff_s))
            t0 = time.monotonic()
            try:
                with trio.fail_after(cfg.attempt_timeout_s):
                    data = await self.fetcher.fetch_range(
                        layer.registry, layer.repo, layer.digest, start, end, layer.headers
                    )
            except (FetchError, trio.TooSlowError) as exc:
                self._count(al, "registry_errors")
                last = exc
                status = getattr(exc, "status", 0)
                log.warning("layer %s chunks %d-%d: fetch attempt %d failed: %s",
                            layer.digest, run[0], run[-1], attempt + 1, exc or "timed out")
                if isinstance(exc, FetchError) and not exc.retryable:
                    break
                continue
            ms = (time.monotonic() - t0) * 1000
            if len(data) != end - start:
                self._count(al, "registry_errors")
                last = FetchError(f"got {len(data)} of {end - start} bytes")
                continue
            self.latency.observe(ms)
            # hashing and inflating release the GIL: one worker thread call per run keeps them
            # off the loop that serves the FUSE reads (a single chunk, ~0.1 ms, is done inline)
            checked = (_check_run(data, start, run, layer) if len(run) == 1 else
                       await trio.to_thread.run_sync(_check_run, data, start, run, layer))  # fmt: skip
            out: list[bytes | ChunkCorrupt] = []
            keep: list[tuple[str, bytes]] = []
            for i, (piece, got, plain) in zip(run, checked, strict=True):
                hx = layer.chunks[i][7:]
                if plain is None:
                    out.append(self._corrupt(al, i, hx, got if got != hx else "undecodable"))
                    continue
                self._count(al, "chunks_fetched")
                self._count(al, "bytes_fetched", len(piece))
                keep.append((hx, piece))
                out.append(plain)
            return out, keep
        raise LayerUnavailable(
            f"chunks {run[0]}-{run[-1]} of layer {layer.digest} not fetched from {layer.registry} after "
            f"{cfg.fetch_attempts} attempt(s): {last or 'timed out'}",
            digest=layer.digest, registry=layer.registry, status=status,
        )

    def _put_all(self, chunks: list[tuple[str, bytes]]) -> None:
        for hx, data in chunks:
            self.cache.put(hx, data)

    def _corrupt(self, al: Attached, idx: int, hx: str, got: str) -> ChunkCorrupt:
        layer = al.layer
        self._count(al, "corrupt_chunks")
        event = {"digest": layer.digest, "chunk": idx, "expected": f"sha256:{hx}", "got": f"sha256:{got}",
                 "registry": layer.registry, "repo": layer.repo, "at": time.time()}
        self.corrupt_events.append(event)
        log.warning("AUDIT corrupt chunk refused: layer %s chunk %d from %s/%s: expected sha256:%s, got sha256:%s",
                    layer.digest, idx, layer.registry, layer.repo, hx, got)
        return ChunkCorrupt(f"chunk {idx} of layer {layer.digest} does not match its digest",
                            digest=layer.digest, chunk=idx, expected=f"sha256:{hx}", got=f"sha256:{got}")

    def _readahead(self, al: Attached, first: int, count: int) -> None:
        layer = al.layer
        if self._nursery is None:
            return
        want = [i for i in range(first, min(first + count, len(layer.chunks)))
                if layer.chunks[i][7:] not in self._inflight and not self.cache.contains(layer.chunks[i][7:])]
        if want:
            self._count(al, "readahead_chunks", len(want))
            self._start_fetches(al, want)  # failures are counted; a reader of the chunk sees its own

    # -------------------------------------------------------------------- state --

    def cached_chunks(self, al: Attached) -> int:
        return sum(1 for c in set(al.layer.chunks) if self.cache.contains(c[7:]))

    def stats(self) -> dict[str, Any]:
        layers = {}
        for hx, al in self.layers.items():
            cached = self.cached_chunks(al)
            distinct = len(set(al.layer.chunks))
            layers[hx] = {
                "digest": al.layer.digest,
                "registry": al.layer.registry,
                "repo": al.layer.repo,
                "size": al.layer.size,
                "chunk_size": al.layer.chunk_size,
                "chunks": len(al.layer.chunks),
                "cached_chunks": cached,
                "fully_cached": cached == distinct,
                "open": al.open_count,
                "metadata_error": al.metadata_error,
                "extents_known": al.extents is not None,
                **asdict(al.counters),
            }
        return {
            "uptime_s": round(time.time() - self.started, 3),
            **asdict(self.totals),
            "read_timeouts": self.read_timeouts,
            "inflight": len(self._inflight),
            "fetch_latency_ms": self.latency.snapshot(),
            "cache": asdict(self.cache.stats()),
            "corrupt_events": list(self.corrupt_events),
            "layers": layers,
        }


__all__ = ["Attached", "Engine", "EngineConfig", "LayerCounters", "ReadFailed"]
