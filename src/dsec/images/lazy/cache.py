"""The node-local, content-addressed chunk cache: ``<root>/sha256/<hex>``.

A chunk is stored under the sha256 of its bytes, so layers that share a chunk
share its file. Files are written to a temporary name and renamed, so a crash
leaves either the whole chunk or a ``.tmp-*`` file that :meth:`ChunkCache.open`
removes. Chunks are only ever put after the engine verified them.

A byte limit is kept by LRU eviction; a chunk being read is pinned and never
evicted (the limit is then exceeded until the read ends). The LRU order is
rebuilt at start from the files' mtimes (a hit does not touch the file: it would
cost a syscall per read), so after a restart it is insertion order. A chunk file
is re-hashed the first time this process serves it (:meth:`verified`), so a file
damaged on disk is dropped and fetched again rather than served.

Thread-safe (one lock); blocking file I/O — callers keep it off event loops where
it matters. Never deletes anything outside ``<root>/sha256``.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import secrets
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("dsec.images.lazy")

TMP_PREFIX = ".tmp-"


@dataclass
class CacheStats:
    chunks: int
    bytes: int
    limit_bytes: int | None
    evictions: int
    evicted_bytes: int
    pinned: int
    dropped_damaged: int


class ChunkCache:
    def __init__(self, root: Path, *, limit_bytes: int | None = None) -> None:
        self.root = Path(root)
        self.dir = self.root / "sha256"
        self.limit_bytes = limit_bytes
        self._lock = threading.Lock()
        self._lru: OrderedDict[str, int] = OrderedDict()  # hex -> size, oldest first
        self._bytes = 0
        self._pins: dict[str, int] = {}
        self._verified: set[str] = set()
        self.evictions = 0
        self.evicted_bytes = 0
        self.dropped_damaged = 0

    def open(self) -> int:
        """Create the directory, remove partial files of a crashed writer, index the rest.
        Returns how many partial files were removed."""
        self.dir.mkdir(parents=True, exist_ok=True)
        removed = remove_partials(self.root)
        entries: list[tuple[float, str, int]] = []
        with os.scandir(self.dir) as it:
            for e in it:
                if len(e.name) != 64 or not e.is_file(follow_symlinks=False):
                    continue
                st = e.stat(follow_symlinks=False)
                entries.append((st.st_mtime, e.name, st.st_size))
        entries.sort()
        with self._lock:
            self._lru.clear()
            self._bytes = 0
            for _, hx, size in entries:
                self._lru[hx] = size
                self._bytes += size
            self._evict_locked()
        return removed

    def path(self, hx: str) -> Path:
        return self.dir / hx

    def contains(self, hx: str) -> bool:
        with self._lock:
            return hx in self._lru

    def pin(self, hx: str) -> None:
        with self._lock:
            self._pins[hx] = self._pins.get(hx, 0) + 1

    def unpin(self, hx: str) -> None:
        with self._lock:
            n = self._pins.get(hx, 0) - 1
            if n > 0:
                self._pins[hx] = n
            else:
                self._pins.pop(hx, None)
        self._maybe_evict()

    def read(self, hx: str, offset: int, length: int) -> bytes | None:
        """Bytes of a cached chunk (the caller pins it), or None when it is not cached."""
        with self._lock:
            if hx not in self._lru:
                return None
            self._lru.move_to_end(hx)
        try:
            fd = os.open(self.dir / hx, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            self._forget(hx)
            return None
        try:
            return os.pread(fd, length, offset)
        finally:
            os.close(fd)

    def is_verified(self, hx: str) -> bool:
        with self._lock:
            return hx in self._verified

    def verified(self, hx: str, expected_size: int) -> bool:
        """True once the cached file of ``hx`` has been hashed by this process and matched.
        A damaged file is deleted (and counted) and False returned: fetch it again."""
        with self._lock:
            if hx in self._verified:
                return True
        try:
            data = (self.dir / hx).read_bytes()
        except FileNotFoundError:
            self._forget(hx)
            return False
        if len(data) == expected_size and hashlib.sha256(data).hexdigest() == hx:
            with self._lock:
                self._verified.add(hx)
            return True
        log.warning("chunk cache: sha256:%s is damaged on disk (%d bytes); dropped", hx, len(data))
        self.dropped_damaged += 1
        with contextlib.suppress(FileNotFoundError):
            (self.dir / hx).unlink()
        self._forget(hx)
        return False

    def put(self, hx: str, data: bytes) -> None:
        """Store a verified chunk (temp file + rename), then evict down to the limit."""
        with self._lock:
            if hx in self._lru:
                self._lru.move_to_end(hx)
                return
        tmp = self.dir / f"{TMP_PREFIX}{hx}-{secrets.token_hex(4)}"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
            os.rename(tmp, self.dir / hx)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()
            log.warning("chunk cache: cannot store sha256:%s: %s", hx, exc)
            return
        with self._lock:
            if hx not in self._lru:
                self._lru[hx] = len(data)
                self._bytes += len(data)
            self._verified.add(hx)
            self._evict_locked()

    def _forget(self, hx: str) -> None:
        with self._lock:
            size = self._lru.pop(hx, None)
            if size is not None:
                self._bytes -= size
            self._verified.discard(hx)

    def _maybe_evict(self) -> None:
        if self.limit_bytes is not None and self._bytes > self.limit_bytes:
            with self._lock:
                self._evict_locked()

    def _evict_locked(self) -> None:
        if self.limit_bytes is None:
            return
        for hx in list(self._lru):
            if self._bytes <= self.limit_bytes:
                break
            if hx in self._pins:
                continue
            size = self._lru.pop(hx)
            self._bytes -= size
            self._verified.discard(hx)
            with contextlib.suppress(FileNotFoundError):
                (self.dir / hx).unlink()
            self.evictions += 1
            self.evicted_bytes += size

    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(
                chunks=len(self._lru),
                bytes=self._bytes,
                limit_bytes=self.limit_bytes,
                evictions=self.evictions,
                evicted_bytes=self.evicted_bytes,
                pinned=len(self._pins),
                dropped_damaged=self.dropped_damaged,
            )


def remove_partials(root: Path) -> int:
    """Delete ``.tmp-*`` files a crashed writer left in ``<root>/sha256``; count them."""
    n = 0
    d = Path(root) / "sha256"
    if not d.is_dir():
        return 0
    for p in d.glob(f"{TMP_PREFIX}*"):
        with contextlib.suppress(FileNotFoundError):
            p.unlink()
            n += 1
    return n


__all__ = ["CacheStats", "ChunkCache", "remove_partials"]
