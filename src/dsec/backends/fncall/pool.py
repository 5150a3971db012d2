"""Warm Python workers per image, and the calls they serve (docs/FNCALL.md).

Owns: the worker sandboxes of the FnCall backend (created in the container
backend it is given, labelled ``dsec.fncall=worker``), the worker program
running in each (``worker.py``, copied in through the files API), the frames
to and from it, the choice of a worker per call, restarting a worker that
died, and turning a worker's answer into an :class:`FnResult` or a typed
:class:`FnCallFailed`.

Must never: block the event loop (frames are read and written through asyncio
pipes), run a call's code on the host (every call runs in a sandbox, as an
unprivileged uid of its own), or let a call wait forever for a worker that is
gone (a lost worker fails its calls with :class:`FnCallWorkerLost`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from dsec.backends.base import UNSET, _Unset
from dsec.backends.fncall.config import FnCallConfig, FnCallImage
from dsec.backends.fncall.workers import (
    _RESTART_BACKOFF_S,
    LABEL,
    LABEL_POOL,
    Worker,
    WorkerHost,
    _labels,
    _Limits,
    _outcome,
    image_label,
    image_ref,
)
from dsec.errors import Backpressure, DsecError, ExecError, ImageError, InvalidSpec, PayloadTooLarge
from dsec.spec import ImageRef
from dsec.spec.fncall import FnCall, FnCallFailed, FnCallWorkerLost, FnOutcome, FnResult

log = logging.getLogger("dsec.fncall")

class _ImagePool:
    """The workers of one image, and the calls waiting for room on them."""

    def __init__(self, pool: FnCallPool, image: ImageRef, cfg: FnCallImage) -> None:
        self.pool = pool
        self.image = image
        self.cfg = cfg
        self.workers: list[Worker | None] = [None] * cfg.workers
        self.waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self.tasks: set[asyncio.Task[None]] = set()
        self.failures = 0
        self.last_error: BaseException | None = None
        self.starting = 0
        self.restarts = 0

    def spawn(self, index: int, delay: float = 0.0) -> None:
        self.starting += 1
        task = asyncio.create_task(self._start_worker(index, delay))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _start_worker(self, index: int, delay: float) -> None:
        w = Worker(self.pool, self.image, self.cfg, index)
        try:
            if delay:
                await asyncio.sleep(delay)
            self.workers[index] = w
            await w.start()
        except asyncio.CancelledError:
            await w.stop("pool closing")
            raise
        except BaseException as exc:
            self.failures += 1
            self.last_error = _start_error(self.image, exc, w)
            log.warning("fncall: worker %d for %s failed to start (%d in a row): %s", index,
                        image_label(self.image), self.failures, self.last_error)
            await w.stop(f"start failed: {exc}")
            self.starting -= 1
            self._wake_all()
            if not self.pool.closing:
                backoff = _RESTART_BACKOFF_S[min(self.failures, len(_RESTART_BACKOFF_S)) - 1]
                self.spawn(index, backoff)
            return
        self.starting -= 1
        self.failures = 0
        self.last_error = None
        self._wake_all()

    def _wake_all(self) -> None:
        while self.waiters:
            f = self.waiters.popleft()
            if not f.done():
                f.set_result(None)

    def release(self, w: Worker) -> None:
        w.in_flight -= 1
        while self.waiters:
            f = self.waiters.popleft()
            if not f.done():
                f.set_result(None)
                return

    async def acquire(self) -> Worker:
        while True:
            best: Worker | None = None
            for w in self.workers:
                if w is not None and w.ready and w.in_flight < w.capacity and (
                        best is None or w.in_flight < best.in_flight):
                    best = w
            if best is not None:
                best.in_flight += 1
                return best
            if self.pool.closing:
                raise FnCallWorkerLost("the fncall pool is closed", reason="closed")
            if self.failures and self.last_error is not None:
                raise self.last_error  # its workers fail to start: say why, do not wait for a retry
            if len(self.waiters) >= self.pool.config.max_queue:
                raise Backpressure(f"{len(self.waiters)} calls already wait for a fncall worker of "
                                   f"{image_label(self.image)}", retry_after=1.0, reason="fncall_queue")
            fut = asyncio.get_running_loop().create_future()
            self.waiters.append(fut)
            try:
                await fut
            except asyncio.CancelledError:
                if fut.done() and not fut.cancelled():
                    self._pass_on()
                raise

    def _pass_on(self) -> None:
        """A waiter that was woken but gave up hands its turn to the next one."""
        while self.waiters:
            f = self.waiters.popleft()
            if not f.done():
                f.set_result(None)
                return


def _start_error(image: ImageRef, exc: BaseException, w: Worker) -> BaseException:
    label = image_label(image)
    if isinstance(exc, ExecError):
        return ImageError(f"image {label} cannot run the fncall worker ({w.cfg.python}): {exc}", image=label)
    if isinstance(exc, DsecError):
        return exc
    return ImageError(f"fncall worker for {label} failed to start: {exc!r}", image=label)


@dataclass(slots=True)
class PoolStats:
    calls: int = 0
    failures: dict[str, int] = field(default_factory=dict)
    restarts: int = 0


class FnCallPool:
    """Warm workers per image (``config.images`` at start, others on first use) and the calls on them."""

    def __init__(self, config: FnCallConfig, host: WorkerHost, *, name: str = "fncall") -> None:
        self.config = config
        self.host = host
        self.name = name
        self.images: dict[ImageRef, _ImagePool] = {}
        self.closing = False
        self.stats = PoolStats()
        self._restarts: set[asyncio.Task[None]] = set()

    async def start(self, *, wait: bool = True) -> None:
        """Remove worker sandboxes an earlier run of this pool left, then start the configured
        images' workers (waiting until each is ready or has failed once, with ``wait``)."""
        stale = [sid for sid, rec in list(self.host.sandboxes.items())
                 if _labels(rec).get(LABEL) == "worker" and _labels(rec).get(LABEL_POOL) == self.name]
        for sid in stale:
            log.info("fncall: removing worker sandbox %s left by an earlier run", sid)
            with contextlib.suppress(Exception):
                await self.host.destroy(sid)
        for img in self.config.images:
            self._image_pool(img.image, img)
        if wait:
            await self.wait_ready()

    async def wait_ready(self, timeout: float | None = None) -> None:
        """Until no worker is starting (each is ready, or failed and waits for a retry)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while any(ip.starting and ip.failures == 0 for ip in self.images.values()):
            if deadline is not None and time.monotonic() > deadline:
                return
            await asyncio.sleep(0.02)

    async def close(self) -> None:
        self.closing = True
        # A restart under way is let finish its stop of the dead worker (cancelled mid-destroy
        # it left the sandbox half destroyed); with `closing` set it starts no other.
        for ip in self.images.values():
            for t in list(ip.tasks):
                t.cancel()
        tasks = [t for ip in self.images.values() for t in ip.tasks] + list(self._restarts)
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        stops = [w.stop("pool closed") for ip in self.images.values() for w in ip.workers if w is not None]
        await asyncio.gather(*stops, return_exceptions=True)
        for ip in self.images.values():
            ip.last_error = FnCallWorkerLost("the fncall pool is closed", reason="closed")
            ip._wake_all()

    def _image_pool(self, image: ImageRef, cfg: FnCallImage | None = None) -> _ImagePool:
        ip = self.images.get(image)
        if ip is not None:
            return ip
        if cfg is None:
            cfg = self.config.image_config(image)
        if cfg is None:
            if not self.config.lazy_images:
                raise InvalidSpec(f"no fncall workers for image {image_label(image)} (configured: "
                                  f"{', '.join(image_label(c.image) for c in self.config.images) or 'none'})",
                                  field="image")
            cfg = FnCallImage(image=image, concurrency=self.config.lazy_concurrency)
        ip = _ImagePool(self, image, cfg)
        self.images[image] = ip
        for i in range(cfg.workers):
            ip.spawn(i)
        return ip

    def _worker_died(self, w: Worker) -> None:
        if self.closing:
            return
        ip = self.images.get(w.image)
        if ip is None:
            return
        self.stats.restarts += 1
        ip.restarts += 1
        log.warning("fncall worker %s for %s died (%s); starting another", w.sandbox_id, image_label(w.image),
                    w.reason)

        async def replace() -> None:
            await w.stop(w.reason)
            if not self.closing and ip.workers[w.index] is w:
                ip.spawn(w.index)

        task = asyncio.create_task(replace())
        self._restarts.add(task)
        task.add_done_callback(self._restarts.discard)

    def workers(self) -> list[Worker]:
        return [w for ip in self.images.values() for w in ip.workers if w is not None]

    def worker_sandboxes(self) -> set[str]:
        return {w.sandbox_id for w in self.workers() if w.sandbox_id}

    # -- calls --

    def _limits(self, timeout: float | _Unset | None, memory: int | None, output_cap: int | None) -> _Limits:
        cfg = self.config
        t = cfg.call_timeout_s if isinstance(timeout, _Unset) else timeout
        if t is not None and not t > 0:
            raise InvalidSpec("timeout must be positive (or None for none)", field="timeout")
        if cfg.max_call_timeout_s is not None and (t is None or t > cfg.max_call_timeout_s):
            raise InvalidSpec(f"timeout {t} is above this edge's ceiling of {cfg.max_call_timeout_s} s",
                              field="timeout")
        m = cfg.call_memory if memory is None else int(memory)
        if not 16 << 20 <= m <= cfg.max_call_memory:
            raise InvalidSpec(f"memory must be 16 MiB..{cfg.max_call_memory} bytes", field="memory")
        c = cfg.output_cap if output_cap is None else int(output_cap)
        if not 1024 <= c <= cfg.max_output_cap:
            raise InvalidSpec(f"output_cap must be 1024..{cfg.max_output_cap} bytes", field="output_cap")
        return _Limits(t, m, c)

    def _payload(self, source: str, args: Sequence[Any], kwargs: Mapping[str, Any] | None,
                 entry: str | None) -> bytes:
        if not isinstance(source, str):
            raise InvalidSpec("source must be a string of Python code", field="source")
        if entry is not None and not entry.isidentifier():
            raise InvalidSpec(f"entry {entry!r} is not a Python identifier", field="entry")
        try:
            payload = json.dumps({"source": source, "args": list(args), "kwargs": dict(kwargs or {}),
                                  "entry": entry}, separators=(",", ":")).encode()
        except (TypeError, ValueError) as exc:
            raise InvalidSpec(f"args and kwargs must be JSON values: {exc}", field="args") from None
        if len(payload) > self.config.max_request_bytes:
            raise PayloadTooLarge(f"a call of {len(payload)} bytes is over this edge's "
                                  f"{self.config.max_request_bytes}", limit=self.config.max_request_bytes)
        return payload

    async def call(self, image: ImageRef | str, source: str, args: Sequence[Any] = (),
                   kwargs: Mapping[str, Any] | None = None, *, entry: str | None = None,
                   timeout: float | _Unset | None = UNSET, memory: int | None = None,
                   output_cap: int | None = None) -> FnResult:
        """Run ``source`` in a fresh fork of ``image``'s warm template (docs/FNCALL.md, "Contract").

        ``timeout`` (seconds; default the pool's; None for none where the pool allows),
        ``memory`` (bytes the call may map on top of the template) and ``output_cap``
        (bytes of each of stdout, stderr and the JSON result) bound it. Raises a
        :class:`FnCallFailed` subclass when it does not return a value."""
        out = await self._call(image_ref(image), self._payload(source, args, kwargs, entry),
                               self._limits(timeout, memory, output_cap))
        if isinstance(out, FnResult):
            return out
        raise out

    async def call_many(self, image: ImageRef | str, calls: Sequence[FnCall | str], *,
                        timeout: float | _Unset | None = UNSET, memory: int | None = None,
                        output_cap: int | None = None) -> list[FnOutcome]:
        """Several calls on ``image``, run concurrently (as many at once as its workers take):
        one :class:`FnResult` or :class:`FnCallFailed` per call, in order (failures are
        returned, not raised). Bad input (not JSON, over the limits) raises before any runs."""
        ref = image_ref(image)
        limits = self._limits(timeout, memory, output_cap)
        items = [FnCall(c) if isinstance(c, str) else c for c in calls]
        payloads = [self._payload(c.source, c.args, c.kwargs, c.entry) for c in items]
        return list(await asyncio.gather(*(self._call(ref, p, limits) for p in payloads)))

    async def _call(self, image: ImageRef, payload: bytes, limits: _Limits) -> FnOutcome:
        t0 = time.monotonic()
        ip = self._image_pool(image)
        worker = await ip.acquire()
        try:
            header, body, _sent = await worker.call(payload, limits)
        except FnCallFailed as exc:
            self._count(exc)
            return exc
        finally:
            ip.release(worker)
        self.stats.calls += 1
        out = _outcome(header, body, limits, worker.sandbox_id or "", time.monotonic() - t0)
        if isinstance(out, FnCallFailed):
            self._count(out)
        return out

    def _count(self, exc: FnCallFailed) -> None:
        self.stats.failures[exc.code] = self.stats.failures.get(exc.code, 0) + 1

