"""Warm pools: K ready sandboxes per (resolved layer digests, resources).

Pools are the container backend's (the one whose records carry their layers). A
create that matches a pool key takes a ready sandbox: the backend's record gets
the request's spec and edge part (``Backend.update``), which is
a record write, not a container start. The pool then refills in the
background, rate-limited by a token bucket and bounded in concurrency, so a
burst of claims does not turn into a burst of creates that starves exec.

Pooled sandboxes are marked in their record's edge part (``EdgeMeta.pool``), so an
edge restart re-adopts them as pool members; a pooled sandbox whose pool is
gone, changed or full is destroyed. They count as *reserved* capacity in
admission (see :mod:`dsec.edge.admission`): a refill happens only when it fits
beside everything else, and a real create that needs their room evicts them.

Never blocks the event loop: ``take`` and ``evict`` are synchronous and cheap;
creates and destroys run in tasks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from dsec.backends.base import EdgeMeta
from dsec.edge.admission import Admission, Usage
from dsec.edge.config import EdgeConfig, PoolConfig
from dsec.errors import DsecError
from dsec.spec import ImageRef, Resources, SandboxSpec, SandboxState

if TYPE_CHECKING:
    from dsec.backends.base import Backend, SandboxRecord
    from dsec.edge.events import EventLog
    from dsec.edge.metrics import EdgeMetrics

log = logging.getLogger("dsec.edge.pools")

PoolKey = tuple[str, tuple[str, ...], Resources]
"""(backend kind, layers top first, resources): a pool serves requests of exactly these."""
WATERMARK_WINDOW_S = 60.0
REFILL_QUIET_S = 0.02
"""A refill starts only this long after the last claim: a create's synchronous kernel work
(cgroups, uid slot) would otherwise delay the answer to the claim that woke it (measured:
warm create p50 over HTTP 5.3-6.4 ms -> 4.0-4.3 ms), and a burst of claims is served first."""
_NAME_TTL_S = 1.0  # a name:tag is re-resolved after this long (digests never change)


def pool_eligible(spec: SandboxSpec) -> bool:
    """Pooled sandboxes are loopback-only. A spec whose network policy (its own or its
    starting stage's) is not None is created cold: the runtime gives it a prepared namespace,
    while wiring a veth into a pooled sandbox costs more than the whole cold create. Stages
    with file rules only are fine: the edge switches the claimed sandbox into its starting
    stage, which costs less than a cold create (measured: docs/EDGE.md, "Warm pools")."""
    return spec.effective_network() is None


class WarmPool:
    def __init__(self, cfg: PoolConfig) -> None:
        self.cfg = cfg
        self.name = cfg.display_name()
        self.target = cfg.size
        self.spec = SandboxSpec(image=cfg.image, resources=cfg.resources, backend=cfg.backend)
        self.layers: tuple[str, ...] | None = None
        self.ready: deque[str] = deque()
        self.creating = 0
        self.hits = 0
        self.misses = 0
        self.failures = 0
        self.last_error = ""
        self.retry_at = 0.0
        self.blocked = False
        """Below target because the edge's budgets have no room for more (logged once)."""
        self._levels: deque[tuple[float, int]] = deque([(time.monotonic(), 0)])

    @property
    def key(self) -> PoolKey | None:
        return None if self.layers is None else (self.cfg.backend, self.layers, self.cfg.resources)

    def note_level(self) -> None:
        now = time.monotonic()
        self._levels.append((now, len(self.ready)))
        # keep one sample older than the window: the level at the window's start
        while len(self._levels) > 2 and self._levels[1][0] < now - WATERMARK_WINDOW_S:
            self._levels.popleft()
        if len(self._levels) > 10000:
            self._levels.popleft()

    def low_watermark(self) -> int:
        """The lowest ready count over the last minute (0 means a claim found it empty
        or nearly so: the pool is too small for the create rate)."""
        cutoff = time.monotonic() - WATERMARK_WINDOW_S
        levels = [len(self.ready)]
        before: int | None = None  # the level when the window opened
        for t, n in self._levels:
            if t < cutoff:
                before = n
            else:
                levels.append(n)
        if before is not None:
            levels.append(before)
        return min(levels)


class PoolManager:
    """The edge's warm pools, each of one backend's sandboxes (``PoolConfig.backend``)."""

    def __init__(self, cfg: EdgeConfig, *, backend: Callable[[str], Backend | None], admission: Callable[[], Admission],
                 events: EventLog, metrics: EdgeMetrics, new_id: Callable[[], str],
                 destroy: Callable[..., Awaitable[bool]], store: Callable[[], Any]) -> None:
        self._backend = backend
        self._admission = admission
        self.events = events
        self.metrics = metrics
        self.new_id = new_id
        self.destroy = destroy
        self._store = store
        self.pools = [WarmPool(p) for p in cfg.pools]
        self._by_name = {p.name: p for p in self.pools}
        self._by_key: dict[PoolKey, WarmPool] = {}
        self.pooled_ids: set[str] = set()
        self._resolved: dict[str, tuple[float, str]] = {}
        self._rate = cfg.pool_refill_per_s
        self._burst = max(1.0, self._rate / 4)
        self._tokens = self._burst
        self._last_refill = time.monotonic()
        self._slots = asyncio.Semaphore(cfg.pool_refill_concurrency)
        self._wake = asyncio.Event()
        self._last_claim = 0.0
        self._task: asyncio.Task[None] | None = None
        self._jobs: set[asyncio.Task[Any]] = set()

    # -- layers --

    def _digest(self, ref: str) -> str:
        now = time.monotonic()
        hit = self._resolved.get(ref)
        if hit is not None and hit[0] > now:
            return hit[1]
        digest: str = self._store().resolve(ref).digest
        ttl = float("inf") if ref.startswith("sha256:") and len(ref) == 71 else _NAME_TTL_S
        self._resolved[ref] = (now + ttl, digest)
        return digest

    def layers_of(self, image: ImageRef) -> tuple[str, ...]:
        return tuple(self._digest(r) for r in image.layers_top_first())

    def _refresh_keys(self) -> None:
        by_key: dict[PoolKey, WarmPool] = {}
        for pool in self.pools:
            try:
                pool.layers = self.layers_of(pool.cfg.image)
            except DsecError as exc:
                pool.layers = None
                pool.last_error = str(exc)
                continue
            key = pool.key
            assert key is not None
            by_key.setdefault(key, pool)
        self._by_key = by_key

    # -- start / stop --

    async def start(self) -> None:
        self._refresh_keys()
        stale: list[str] = []
        recs = [rec for kind in sorted({p.cfg.backend for p in self.pools} | {"container"})
                if (backend := self._backend(kind)) is not None for rec in list(backend.sandboxes.values())]
        for rec in recs:
            name = rec.edge.pool
            if not name:
                continue
            pool = self._by_name.get(name)
            if (
                pool is None or rec.backend != pool.cfg.backend or pool.layers is None or rec.state is not SandboxState.RUNNING
                or _layers(rec) != pool.layers or rec.spec.resources != pool.cfg.resources
                or len(pool.ready) >= pool.target
            ):
                stale.append(rec.id)
                continue
            pool.ready.append(rec.id)
            self.pooled_ids.add(rec.id)
            pool.note_level()
        for sid in stale:
            self._admission().release(sid)
            await self.destroy(sid, reason="pool_stale", tombstone=False)
        if self.pools:
            self._task = asyncio.create_task(self._refill_loop(), name="dsec-edge-pool-refill")

    async def stop(self) -> None:
        tasks = [t for t in (self._task, *self._jobs) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._task = None
        self._jobs.clear()

    # -- claims --

    def match(self, spec: SandboxSpec) -> WarmPool | None:
        if not self._by_key or not pool_eligible(spec):
            return None
        try:
            key = (spec.backend, self.layers_of(spec.image), spec.resources)
        except DsecError:
            return None  # the cold path reports the missing layer properly
        return self._by_key.get(key)

    def take(self, spec: SandboxSpec, edge: EdgeMeta) -> tuple[SandboxRecord, WarmPool] | None:
        """A ready sandbox of ``spec``'s pool, now carrying ``spec`` and ``edge``; or None."""
        pool = self.match(spec)
        rt = None if pool is None else self._backend(pool.cfg.backend)
        if pool is None or rt is None:
            return None
        try:
            while pool.ready:
                sid = pool.ready.pop()  # most recently made: warmest caches
                self.pooled_ids.discard(sid)
                rec = rt.sandboxes.get(sid)
                if rec is None or rec.state is not SandboxState.RUNNING or _layers(rec) != pool.layers:
                    self._discard(sid, "pool_stale")
                    continue
                edge.from_pool = pool.name
                try:
                    rt.update(sid, spec=spec, edge=edge)
                except DsecError:
                    self._discard(sid, "pool_stale")
                    continue
                pool.hits += 1
                self.metrics.pool_claims.labels(pool.name, "hit").inc()
                return rec, pool
            pool.misses += 1
            self.metrics.pool_claims.labels(pool.name, "miss").inc()
            return None
        finally:
            self._last_claim = time.monotonic()
            pool.note_level()
            self._wake.set()

    def evict(self, shortfall: Usage) -> list[str]:
        """Take pooled sandboxes out of their pools until ``shortfall`` is covered; the caller
        destroys them. Fullest pools give first, oldest sandboxes first."""
        need = Usage(shortfall.sandboxes, shortfall.cpu, shortfall.memory, shortfall.disk)
        victims: list[str] = []

        def covered() -> bool:
            return need.sandboxes <= 0 and need.cpu <= 1e-9 and need.memory <= 0 and need.disk <= 0

        for pool in sorted(self.pools, key=lambda p: -len(p.ready)):
            while pool.ready and not covered():
                sid = pool.ready.popleft()
                self.pooled_ids.discard(sid)
                victims.append(sid)
                need.add(pool.cfg.resources, -1)
                self.metrics.pool_evictions.labels(pool.name).inc()
            pool.note_level()
            if covered():
                break
        return victims

    def forget(self, sandbox_id: str) -> bool:
        """Drop ``sandbox_id`` from its pool (it is being destroyed). True if it was pooled."""
        if sandbox_id not in self.pooled_ids:
            return False
        self.pooled_ids.discard(sandbox_id)
        for pool in self.pools:
            with contextlib.suppress(ValueError):
                pool.ready.remove(sandbox_id)
                pool.note_level()
                self._wake.set()
                break
        return True

    def _discard(self, sandbox_id: str, reason: str) -> None:
        self._admission().release(sandbox_id)
        self._spawn(self.destroy(sandbox_id, reason=reason, tombstone=False))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._jobs.add(task)
        task.add_done_callback(self._jobs.discard)
        task.add_done_callback(_log_failure)

    # -- refill --

    def _wanting(self) -> WarmPool | None:
        """The emptiest pool below its target that fits beside everything else."""
        now = time.monotonic()
        best: WarmPool | None = None
        for pool in self.pools:
            if pool.layers is None or pool.retry_at > now:
                continue
            have = len(pool.ready) + pool.creating
            if have >= pool.target:
                continue
            if not self._admission().fits_pooled(pool.cfg.resources):
                if not pool.blocked:
                    pool.blocked = True
                    log.info("pool %s held at %d of %d: the edge's budgets are taken", pool.name, have, pool.target)
                continue
            pool.blocked = False
            if best is None or have / pool.target < (len(best.ready) + best.creating) / best.target:
                best = pool
        return best

    async def _refill_loop(self) -> None:
        last_keys = 0.0
        while True:
            now = time.monotonic()
            if now - last_keys >= _NAME_TTL_S:
                self._refresh_keys()
                last_keys = now
            pool = self._wanting()
            if pool is None:
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(0.5):
                        await self._wake.wait()
                continue
            quiet = self._last_claim + REFILL_QUIET_S - now
            if quiet > 0:
                await asyncio.sleep(quiet)
                continue
            self._tokens = min(self._burst, self._tokens + (now - self._last_refill) * self._rate)
            self._last_refill = now
            if self._tokens < 1.0:
                await asyncio.sleep((1.0 - self._tokens) / self._rate)
                continue
            await self._slots.acquire()
            # Re-check after the wait: the decision and the reservation must not be split.
            if self._wanting() is not pool:
                self._slots.release()
                continue
            self._tokens -= 1.0
            sid = self.new_id()
            self._admission().reserve(sid, pool.cfg.resources, pooled=True)
            pool.creating += 1
            task = asyncio.create_task(self._make(pool, sid))
            self._jobs.add(task)
            task.add_done_callback(self._jobs.discard)

    async def _make(self, pool: WarmPool, sid: str) -> None:
        t0 = time.perf_counter()
        ok = False
        try:
            backend = self._backend(pool.cfg.backend)
            if backend is None:
                raise DsecError(f"the {pool.cfg.backend} backend is not running")
            await backend.create(pool.spec, sandbox_id=sid, edge=EdgeMeta(pool=pool.name, pooled_at=time.time()))
            ok = True
        except DsecError as exc:
            pool.failures += 1
            pool.last_error = str(exc)
            pool.retry_at = time.monotonic() + min(30.0, 0.5 * 2 ** min(pool.failures, 6))
            log.warning("pool %s: refill failed: %s", pool.name, exc)
            self.metrics.pool_refills.labels(pool.name, "failed").inc()
        finally:
            pool.creating -= 1
            self._slots.release()
            if not ok:
                self._admission().release(sid)
        if ok:
            pool.failures = 0
            self.metrics.pool_refills.labels(pool.name, "ok").inc()
            self.metrics.create_seconds.labels("refill").observe(time.perf_counter() - t0)
            self.events.add(sid, "pooled", pool=pool.name)
            if len(pool.ready) >= pool.target or not self._admission().holds(sid):
                # over target (a resize), or evicted/stopped while being made
                self._discard(sid, "pool_stale")
            else:
                pool.ready.append(sid)
                self.pooled_ids.add(sid)
                pool.note_level()
        self._wake.set()


def _layers(rec: SandboxRecord) -> tuple[str, ...]:
    return rec.layer_stack()


def _log_failure(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.warning("pool job failed: %r", task.exception())
