"""The edge agent's core: this node's sandboxes behind admission, warm pools,
lifecycle enforcement, event logs and metrics. No HTTP here (app.py is the
thin HTTP layer over it), so the same object serves tests and embeddings.

It runs the backends its config lists (:class:`EdgeBackends`; ids prefixed with
the edge id) and talks to them only through :class:`dsec.backends.base.Backend`.
It never blocks the event loop: file operations run in worker threads, kernel
work runs in the backends' helpers. It never destroys a sandbox on its own
except for TTL/idle expiry, failure, and pool upkeep, and says so in events.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import builtins
import contextlib
import logging
import secrets
import shutil
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, TypeVar

from dsec.backends.base import (
    Backend,
    Capability,
    EdgeMeta,
    GroupOutcome,
    OutputCallback,
    SandboxRecord,
    ShellSession,
    check_spec,
    command_line,
)
from dsec.backends.common.output import BoundedCapture
from dsec.edge.admission import Admission, Budgets, disk_reserve, resolve_budgets
from dsec.edge.audit import FULL_ERRNOS, Auditor
from dsec.edge.backends import EdgeBackends
from dsec.edge.config import EdgeConfig
from dsec.edge.events import EventLog, Tombstone
from dsec.edge.fencing import LOST_REASON, FenceEpoch, fenced_out
from dsec.edge.heartbeat import Heartbeat
from dsec.edge.host import HostSampler
from dsec.edge.leases import LeaseBook, LeaseReporter
from dsec.edge.lifecycle import Watchdog
from dsec.edge.metrics import EdgeMetrics
from dsec.edge.pools import PoolManager
from dsec.edge.preempt import EVICTED_REASON, Preempted
from dsec.edge.selfcheck import SelfCheck
from dsec.errors import (
    Backpressure,
    DsecError,
    ExceedsCapacity,
    ExecTimeout,
    FileAccessError,
    HostError,
    InvalidSpec,
    SandboxEvicted,
    SandboxLost,
    SandboxNotFound,
    SandboxStateError,
    SessionClosed,
    Unsupported,
    encode_error,
)
from dsec.http.auth import mint
from dsec.spec import NetworkPolicy, SandboxState
from dsec.spec.api import (
    EdgeCreateSandbox,
    EdgeHealth,
    ExecRequest,
    ExecResultWire,
    FenceResult,
    ForkRequest,
    GroupResult,
    Lifecycle,
    LimitHitWire,
    NetworkInfo,
    PauseReport,
    SandboxInfo,
    SandboxStats,
    SessionOpen,
    SessionRun,
    SnapshotInfo,
    SnapshotRequest,
    StreamChunk,
)
from dsec.spec.results import ExecResult

log = logging.getLogger("dsec.edge")
T = TypeVar("T")

TOKEN_TTL_S = 3600.0
STREAM_BUFFER_BYTES = 1024 * 1024
"""Output an exec stream holds for a reader that is behind; past it the command waits."""


def result_to_wire(r: ExecResult) -> ExecResultWire:
    return ExecResultWire(
        exit_code=r.exit_code,
        signal=r.signal,
        stdout_b64=base64.b64encode(r.stdout).decode(),
        stderr_b64=base64.b64encode(r.stderr).decode(),
        stdout_bytes=r.stdout_bytes,
        stderr_bytes=r.stderr_bytes,
        truncated=r.truncated,
        duration_s=r.duration_s,
        timed_out=r.timed_out,
        limit=None if r.limit is None else LimitHitWire(kind=r.limit.kind, value=r.limit.value, message=r.limit.message),
        start_latency_s=round(r.start_latency_s, 6),
        cpu_user_s=round(r.cpu_user_s, 6),
        cpu_system_s=round(r.cpu_system_s, 6),
    )


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, str | int | float | bool):
        return value
    if isinstance(value, ExecResult):
        return result_to_wire(value).model_dump(mode="json")
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [_jsonable(v) for v in value]
    return str(value)


def wire_value(value: Any) -> Any:
    """A field of an error in JSON form: a partial ExecResult as its wire form, the rest as text."""
    return _jsonable(value)


def error_body(exc: DsecError) -> dict[str, Any]:
    """``{"error": ...}`` for the wire (:func:`dsec.errors.encode_error`'s body)."""
    return _jsonable(encode_error(exc, default=wire_value)[1])  # type: ignore[no-any-return]


def platform_addresses(config: EdgeConfig) -> tuple[str, ...]:
    """The IPv4 addresses of this edge (bound and advertised) and of the control plane, as
    /32s: no policy may open a way to the platform. Wildcards and loopback are left out (the
    runtime refuses the host's own addresses and 127.0.0.0/8 anyway); names are resolved
    once, at start."""
    import ipaddress
    import socket
    from urllib.parse import urlsplit

    hosts = [config.host]
    for url in (config.url, *config.control_plane_urls):
        if url:
            hosts.append(urlsplit(url).hostname or "")
    out: list[str] = []
    for host in hosts:
        if host in ("", "0.0.0.0", "::", "localhost"):
            continue
        try:
            addrs = {str(ipaddress.ip_address(host))}
        except ValueError:
            try:
                addrs = {str(a[4][0]) for a in socket.getaddrinfo(host, None, socket.AF_INET)}
            except OSError as exc:
                log.warning("cannot resolve %s to block it from sandboxes: %s", host, exc)
                continue
        for a in sorted(addrs):
            ip = ipaddress.ip_address(a)
            if ip.version == 4 and not ip.is_loopback and not ip.is_unspecified and f"{a}/32" not in out:
                out.append(f"{a}/32")
    return tuple(out)


def platform_blocked(config: EdgeConfig) -> tuple[str, ...]:
    """What the edge's sandbox networks block: the network config's ``blocked`` and the
    platform's addresses (:func:`platform_addresses`), which the container backend adds
    itself when it is built (``BackendContext.platform``)."""
    assert config.network is not None
    return config.network.with_platform(platform_addresses(config)).blocked


PLATFORM_LABELS = ("dsec.fncall",)
"""Spec labels of sandboxes a backend runs for itself (FnCall's workers): not the API's to see."""


def _platform_owned(rec: SandboxRecord) -> bool:
    labels = rec.spec.labels
    return bool(labels) and any(k in labels for k in PLATFORM_LABELS)


class EdgeService:
    def __init__(self, config: EdgeConfig) -> None:
        self.config = config
        self.edge_id = config.edge_id
        self.url = config.base_url
        self.backends = EdgeBackends(list(config.backends), runtime=config.runtime, state_dir=config.state_dir,
                                     run_dir=config.run_dir, edge_id=config.edge_id, registry=config.registry,
                                     max_sandboxes=config.max_sandboxes, platform=platform_addresses(config))
        self._store_cache: tuple[float, tuple[int, int]] = (float("-inf"), (1 << 62, 1 << 62))
        self.budgets: Budgets | None = None
        self.admission: Admission = Admission(Budgets(0, 0.0, 0, 0))
        self.events = EventLog(tombstones=config.tombstones)
        self.metrics = EdgeMetrics(self)
        self.pools = PoolManager(
            config, backend=self.backends.by_kind.get, admission=lambda: self.admission,
            events=self.events, metrics=self.metrics, new_id=self.new_id, destroy=self.destroy,
            store=lambda: self.backends.store,
        )
        self.watchdog = Watchdog(self.backends, interval=config.watchdog_interval_s, is_busy=self.is_busy,
                                 expire=self.expire, auto_pause=self.auto_pause)
        self.audit = Auditor(self.backends, self.events, self.metrics, interval=config.audit_interval_s,
                             is_busy=self.is_busy, pooled=lambda: self.pools.pooled_ids, scan_limits=self._scan_limits)
        self.selfcheck = SelfCheck(self.backends, interval=config.host_check_interval_s)
        self.host = HostSampler(config.state_dir)
        self.heartbeat: Heartbeat | None = None
        self.lease_reports: LeaseReporter | None = None
        self.leases = LeaseBook(self.edge_id, config.cluster_key, make=self.create, report=None)
        """Create leases (docs/CONTROL.md): sandboxes made at an SDK's request under the control plane's say-so."""
        self.fencing = FenceEpoch(config.state_dir / f"fence-{config.runtime}.json")
        self.preempted = Preempted(config.state_dir / f"preempted-{config.runtime}.json")
        """Sandboxes paused by the control plane's scheduler: no memory counted, no waking by requests."""
        self.started = False
        self._begun = False
        self.draining = False
        self._busy: dict[str, int] = {}
        self._by_request: dict[str, str] = {}
        self._pending_requests: dict[str, asyncio.Future[SandboxInfo]] = {}
        self._sessions: dict[str, dict[str, ShellSession]] = {}
        self._limits_seen: dict[str, float] = {}
        self._layers_cache: tuple[float, list[str]] = (0.0, [])
        self._background: set[asyncio.Task[Any]] = set()

    # ------------------------------------------------------------ lifecycle --

    async def start(self) -> None:
        if self.started:
            return
        self._begun = True  # from here on, stop() undoes what a start cut short did
        self.budgets = await asyncio.to_thread(resolve_budgets, self.config)
        reserve = await asyncio.to_thread(disk_reserve, self.config)
        self.admission = Admission(self.budgets, retry_after_s=self.config.retry_after_s,
                                   store_free=self._store_free, disk_reserve=reserve, edge_id=self.edge_id)
        await self.backends.start()
        for rec in self.backends.records():
            if rec.edge.request_id:
                self._by_request[rec.edge.request_id] = rec.id
        for b in self.backends.sandbox_backends():
            b.wake_gate = self.preempted.gate
        self.preempted.keep_only(r.id for r in self.backends.records()
                                 if r.state is SandboxState.PAUSED)
        self.resync_admission()
        if self.fencing.epoch:  # a fence a crash interrupted finishes before anything else runs
            await self.fence(self.fencing.epoch)
        await self.pools.start()
        self.watchdog.start()
        self.audit.start()
        self.selfcheck.start()
        if self.config.control_plane_urls:
            self.heartbeat = Heartbeat(self.health, self.config.control_plane_urls, edge_id=self.edge_id,
                                       cluster_key=self.config.cluster_key, interval=self.config.heartbeat_interval_s,
                                       on_epoch=self.fence)
            self.heartbeat.start()
        urls = [u.strip() for u in (self.config.control_plane_url or "").split(",") if u.strip()]
        if urls:  # sandboxes made under leases are recorded by the control plane at once
            self.lease_reports = LeaseReporter(urls, edge_id=self.edge_id, cluster_key=self.config.cluster_key)
            self.leases.report = self.lease_reports.add
            self.lease_reports.start()
        self.started = True
        adopted = self.backends.reconciled().get("adopted", [])
        log.info("edge %s up at %s: %d sandboxes re-adopted, budgets %s", self.edge_id, self.url, len(adopted), self.budgets)

    async def stop(self, *, destroy_all: bool | None = None) -> None:
        """Stop background work and the backends. Sandboxes survive for the next start
        (re-adopted with their TTLs) unless ``destroy_all`` (default: the config's
        ``destroy_on_shutdown``). Also undoes a start that failed or was cancelled half-way
        (the backends' host state, the lazy loader, background loops)."""
        if not self.started and not self._begun:
            return
        self.started = False
        self._begun = False
        destroy = self.config.destroy_on_shutdown if destroy_all is None else destroy_all
        if self.heartbeat is not None:
            await self.heartbeat.stop()
        if self.lease_reports is not None:
            await self.lease_reports.stop()
        await self.watchdog.stop()
        await self.audit.stop()
        await self.selfcheck.stop()
        await self.pools.stop()
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        for sessions in self._sessions.values():
            for sess in sessions.values():
                with contextlib.suppress(Exception):
                    await sess.close()
        self._sessions.clear()
        await self.backends.close(destroy_all=destroy)

    def resync_admission(self) -> None:
        """Rebuild admission's books from the records (at start: nothing is in flight)."""
        self.admission.resync(
            ((r.id, r.spec.resources, r.edge.pool is not None)
             for r in self.backends.records() if r.state is not SandboxState.STOPPED),
            suspended=list(self.preempted.by_id),
        )

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # -------------------------------------------------------------- helpers --

    def new_id(self) -> str:
        return f"{self.edge_id}-{secrets.token_hex(6)}"

    def is_busy(self, sandbox_id: str) -> bool:
        return self._busy.get(sandbox_id, 0) > 0

    def session_count(self) -> int:
        return sum(len(s) for s in self._sessions.values())

    def touch(self, sandbox_id: str) -> None:
        self.backends.touch(sandbox_id)

    @contextlib.contextmanager
    def activity(self, sandbox_id: str) -> Iterator[None]:
        """Marks the sandbox busy (never idle-expired) for the duration of a data-path call."""
        self._busy[sandbox_id] = self._busy.get(sandbox_id, 0) + 1
        self.touch(sandbox_id)
        try:
            yield
        finally:
            n = self._busy.get(sandbox_id, 1) - 1
            if n <= 0:
                self._busy.pop(sandbox_id, None)
            else:
                self._busy[sandbox_id] = n
            self.touch(sandbox_id)

    def record(self, sandbox_id: str) -> SandboxRecord:
        """A sandbox the API may see (not a ready pool member); a clear 404 otherwise."""
        rec = self.backends.record(sandbox_id)
        if rec is None or sandbox_id in self.pools.pooled_ids or _platform_owned(rec):
            tomb = self.events.tombstone(sandbox_id)
            if tomb is not None and tomb.reason == EVICTED_REASON:
                raise SandboxEvicted(
                    f"sandbox {sandbox_id} was destroyed to make room for more urgent work (its task's "
                    "preemption policy is destroy); create another", sandbox_id=sandbox_id, reason=EVICTED_REASON,
                )
            if tomb is not None and tomb.reason == LOST_REASON:
                raise SandboxLost(
                    f"sandbox {sandbox_id} was lost: the control plane lost this edge ({self.edge_id}) for too "
                    "long, declared the sandbox lost and had it destroyed here when the edge came back; create "
                    "another", sandbox_id=sandbox_id, edge_id=self.edge_id, reason=LOST_REASON,
                )
            if tomb is not None:
                raise SandboxNotFound(
                    f"sandbox {sandbox_id} was destroyed at {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(tomb.destroyed_at))} "
                    f"UTC ({tomb.reason}); see GET /v1/sandboxes/{sandbox_id}/events",
                    sandbox_id=sandbox_id, reason=tomb.reason,
                )
            raise SandboxNotFound(f"no sandbox {sandbox_id!r} on edge {self.edge_id}", sandbox_id=sandbox_id)
        return rec

    def backend(self, sandbox_id: str) -> Backend:
        """The backend holding a sandbox the API may see (the same 404 as :meth:`record` otherwise)."""
        found = self.backends.find(sandbox_id)
        if found is None or sandbox_id in self.pools.pooled_ids or _platform_owned(found[1]):
            self.record(sandbox_id)  # raises the 404 (with the tombstone's story)
            raise AssertionError("unreachable")
        return found[0]

    def _require(self, sandbox_id: str, op: Capability, what: str | None = None) -> Backend:
        """The sandbox's backend, if it offers ``op``; ``Unsupported`` (HTTP 400) otherwise."""
        b = self.backend(sandbox_id)
        b.capabilities.require(op, what=what)
        return b

    def info(self, rec: SandboxRecord, *, with_token: bool = False, from_pool: bool | None = None) -> SandboxInfo:
        edge = rec.edge
        token = expires = None
        if with_token:
            ttl = TOKEN_TTL_S
            if edge.expires_at:
                ttl = max(60.0, min(TOKEN_TTL_S, edge.expires_at - time.time() + 60.0))
            token, expires = mint(self.config.cluster_key, sandbox_id=rec.id, project=edge.project or "", ttl_s=ttl)
        return SandboxInfo(
            id=rec.id, state=rec.state, edge_id=self.edge_id, edge_url=self.url,
            token=token, token_expires_at=expires,
            labels=dict(edge.labels), task=edge.task, project=edge.project,
            created_at=edge.created_at or rec.created_at, expires_at=edge.expires_at,
            reason=rec.reason, from_pool=bool(edge.from_pool) if from_pool is None else from_pool,
            image=rec.spec.image, resources=rec.spec.resources,
            stage=rec.current_stage, network=rec.current_policy(), stages=sorted(rec.spec.stages),
            backend=rec.spec.backend, request_id=edge.request_id, epoch=edge.epoch,
        )

    def tomb_info(self, tomb: Tombstone) -> SandboxInfo:
        data = dict(tomb.info)
        data.update(state=SandboxState.STOPPED, reason=tomb.reason, token=None, token_expires_at=None)
        return SandboxInfo.model_validate(data)

    # --------------------------------------------------------------- create --

    async def create(self, req: EdgeCreateSandbox) -> SandboxInfo:
        """Create (or return the one already made for ``req.request_id`` / ``req.id``)."""
        rid = req.request_id
        if rid is None:
            return await self._create(req)
        known = self._by_request.get(rid)
        known_rec = None if known is None else self.backends.record(known)
        if known_rec is not None:
            return self.info(known_rec, with_token=True)
        pending = self._pending_requests.get(rid)
        if pending is not None:
            return await asyncio.shield(pending)
        fut: asyncio.Future[SandboxInfo] = asyncio.get_running_loop().create_future()
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved: no warning
        self._pending_requests[rid] = fut
        try:
            info = await self._create(req)
        except BaseException as exc:
            if isinstance(exc, Exception):
                fut.set_exception(exc)
            else:
                fut.cancel()
            raise
        else:
            fut.set_result(info)
            return info
        finally:
            self._pending_requests.pop(rid, None)

    def _edge_meta(self, req: EdgeCreateSandbox, now: float) -> EdgeMeta:
        return EdgeMeta.lifecycle(now, req.lifecycle.ttl_s, req.lifecycle.idle_timeout_s,
                                  req.lifecycle.auto_pause_s or self.config.auto_pause_s,
                                  labels=dict(req.labels), task=req.task, project=req.project,
                                  request_id=req.request_id, epoch=self.fencing.epoch)

    async def _create(self, req: EdgeCreateSandbox) -> SandboxInfo:
        t0 = time.perf_counter()
        if self.draining:
            raise Backpressure(f"edge {self.edge_id} is draining", retry_after=self.config.retry_after_s, reason="draining")
        if req.id is not None:
            if not req.id.startswith(f"{self.edge_id}-") or len(req.id) <= len(self.edge_id) + 1:
                raise InvalidSpec(f"sandbox id {req.id!r} must start with this edge's prefix {self.edge_id}-", field="id")
            existing = self.backends.record(req.id)
            if existing is not None:
                if req.id in self.pools.pooled_ids:
                    raise InvalidSpec(f"sandbox id {req.id!r} is taken; leave `id` out", field="id")
                return self.info(existing, with_token=True)
        spec = req.spec
        backend = self.backends.get(spec.backend)
        check_spec(backend.capabilities, spec)  # the backend's own check, before any reservation
        if spec.effective_network() is not None or any(st.network is not None for st in spec.stages.values()):
            self.require_network("the spec", "spec.network" if spec.stage is None else "spec.stages")
        now = time.time()
        if req.id is None and self.pools.pools:
            taken = self.pools.take(req.spec, self._edge_meta(req, now))
            if taken is not None:
                rec, pool = taken
                self.admission.claim(rec.id)
                if spec.stage is not None:
                    # A pooled sandbox has run nothing yet: entering the stage binds every later
                    # process (2x faster than a cold create with the stage; docs/EDGE.md).
                    try:
                        rec = await backend.set_stage(rec.id, spec.stage)
                    except BaseException:
                        with contextlib.suppress(Exception):
                            await self.destroy(rec.id, reason="pool_stage_failed", tombstone=False)
                        self.admission.release(rec.id)
                        raise
                return self._created(rec, req, "pool", t0, pool=pool.name)
        res = req.spec.resources
        try:
            shortfall = self.admission.check(res)
        except (Backpressure, ExceedsCapacity) as exc:
            reason = str(exc.fields.get("reason") or (exc.fields.get("reasons") or ["count"])[0])
            self.metrics.admission_refusals.labels(reason).inc()
            self.metrics.creates.labels("failed", "cold", exc.code).inc()
            raise
        victims = self.pools.evict(shortfall) if shortfall is not None else []
        for v in victims:
            self.admission.release(v)
        sid = req.id or self.new_id()
        self.admission.reserve(sid, res)
        try:
            if victims:
                await asyncio.gather(*(self.destroy(v, reason="pool_evicted", tombstone=False) for v in victims),
                                     return_exceptions=True)
            rec = await backend.create(req.spec, sandbox_id=sid, edge=self._edge_meta(req, now))
        except DsecError as exc:
            self.admission.release(sid)
            self.metrics.creates.labels("failed", "cold", str(getattr(exc, "reason", "") or exc.code)).inc()
            raise
        except BaseException:
            self.admission.release(sid)
            raise
        if sid not in backend.sandboxes:  # deleted while being made
            self.admission.release(sid)
        return self._created(rec, req, "cold", t0)

    def _created(self, rec: SandboxRecord, req: EdgeCreateSandbox, source: str, t0: float, *, pool: str = "") -> SandboxInfo:
        elapsed = time.perf_counter() - t0
        self.metrics.creates.labels("ok", source, "").inc()
        self.metrics.create_seconds.labels(source).observe(elapsed)
        if req.request_id:
            self._by_request[req.request_id] = rec.id
        self.events.add(rec.id, "created", source=source, pool=pool or None, latency_ms=round(elapsed * 1000, 3),
                        expires_at=rec.edge.expires_at, idle_timeout_s=rec.edge.idle_timeout_s,
                        backend=rec.spec.backend)
        self.backends.touch(rec.id)
        return self.info(rec, with_token=True, from_pool=source == "pool")

    # -------------------------------------------------------------- destroy --

    async def destroy(self, sandbox_id: str, *, reason: str = "deleted", tombstone: bool = True) -> bool:
        """Destroy a sandbox (idempotent: False if it was not there)."""
        pooled = self.pools.forget(sandbox_id)
        found = self.backends.find(sandbox_id)
        if found is None:
            self.admission.release(sandbox_id)
            return False
        for sess in self._sessions.pop(sandbox_id, {}).values():
            with contextlib.suppress(Exception):
                await sess.close()
        backend, rec = found
        info = self.info(rec).model_dump(mode="json") if tombstone and not pooled else None
        try:
            done = await backend.destroy(sandbox_id)
        finally:
            if sandbox_id not in backend.sandboxes:
                self.admission.release(sandbox_id)
        if not done:
            return False
        self.metrics.destroys.labels(reason).inc()
        self.preempted.discard(sandbox_id)
        if rec.edge.request_id:
            self._by_request.pop(rec.edge.request_id, None)
        self._busy.pop(sandbox_id, None)
        self._limits_seen.pop(sandbox_id, None)
        self.audit.forget(sandbox_id)
        self.events.add(sandbox_id, "destroyed", reason=reason)
        if info is not None:
            now = time.time()
            self.events.bury(Tombstone(sandbox_id, reason, now, float(info["created_at"]),
                                       self.events.merged(sandbox_id, list(rec.events)), info))
        else:
            self.events.forget(sandbox_id)
        return True

    async def fence(self, epoch: int) -> FenceResult:
        """Destroy every sandbox made for the control plane before ``epoch`` (it declared them
        lost while it could not reach this edge); the epoch never goes down. Idempotent."""
        self.fencing.raise_to(epoch)
        target = self.fencing.epoch
        pooled = self.pools.pooled_ids
        doomed = [r.id for r in self.backends.records()
                  if fenced_out(r.edge.epoch, r.edge.project, r.id in pooled or r.edge.pool is not None, target)]
        destroyed: builtins.list[str] = []
        for sid in doomed:
            self.events.add(sid, "fenced", epoch=target)
            try:
                if await self.destroy(sid, reason=LOST_REASON):
                    destroyed.append(sid)
            except DsecError as exc:  # the next fence (or start) tries again
                log.warning("fence: cannot destroy %s: %s", sid, exc)
        if doomed:
            log.warning("fenced at epoch %d: destroyed %d sandbox(es) the control plane declared lost",
                        target, len(destroyed))
        return FenceResult(epoch=target, destroyed=destroyed)

    async def expire(self, sandbox_id: str, why: str) -> None:
        rec = self.backends.record(sandbox_id)
        if rec is None:
            return
        detail: dict[str, Any] = {}
        if why == "ttl":
            detail = {"ttl_s": rec.edge.ttl_s, "expires_at": rec.edge.expires_at}
        elif why == "idle":
            detail = {"idle_timeout_s": rec.edge.idle_timeout_s}
        elif why == "failed":
            detail = {"failure": rec.reason}
        self.events.add(sandbox_id, f"{why}_expired" if why != "failed" else "failed", **detail)
        self.metrics.expirations.labels(why).inc()
        await self.destroy(sandbox_id, reason=f"{why}_expired" if why != "failed" else "failed")

    # --------------------------------------------------------------- lookups --

    def get(self, sandbox_id: str, *, with_token: bool = False) -> SandboxInfo:
        try:
            return self.info(self.record(sandbox_id), with_token=with_token)
        except SandboxNotFound:
            tomb = self.events.tombstone(sandbox_id)
            if tomb is None or not tomb.info:
                raise
            return self.tomb_info(tomb)

    def list(self, *, labels: dict[str, str] | None = None, task: str | None = None,
             state: str | None = None) -> list[SandboxInfo]:
        out = []
        pooled = self.pools.pooled_ids
        for rec in self.backends.records():
            if rec.id in pooled or _platform_owned(rec):
                continue
            if task is not None and rec.edge.task != task:
                continue
            if state is not None and rec.state.value != state:
                continue
            if labels and any(rec.edge.labels.get(k) != v for k, v in labels.items()):
                continue
            out.append(self.info(rec))
        return out

    def event_log(self, sandbox_id: str) -> builtins.list[dict[str, Any]]:
        rec = self.backends.record(sandbox_id)
        if rec is not None and sandbox_id not in self.pools.pooled_ids:
            self._scan_limits(rec)
            return self.events.merged(sandbox_id, list(rec.events))
        tomb = self.events.tombstone(sandbox_id)
        if tomb is not None:
            return tomb.events
        self.record(sandbox_id)  # raises the 404
        return []

    def _store_space(self) -> tuple[int, int]:
        """(free, total) bytes of the disk holding writable layers, re-read at most once a second."""
        now = time.monotonic()
        if now - self._store_cache[0] > 1.0:
            try:
                known = self.backends.store_space()
                if known is not None:
                    space = known
                else:
                    usage = shutil.disk_usage(self.config.state_dir)
                    space = (usage.free, usage.total)
            except OSError:
                space = self._store_cache[1]
            self._store_cache = (now, space)
        return self._store_cache[1]

    def _store_free(self) -> int:
        return self._store_space()[0]

    def health(self) -> EdgeHealth:
        problems = self.selfcheck.problems()
        b = self.admission.budgets
        real = self.admission.real
        return EdgeHealth(
            edge_id=self.edge_id, url=self.url, sandboxes=real.sandboxes, capacity_sandboxes=b.sandboxes,
            cpu_committed=round(real.cpu, 6), cpu_capacity=b.cpu, memory_committed=real.memory,
            memory_capacity=b.memory, disk_committed=real.disk, disk_capacity=b.disk,
            layers=self._layers(), pools={p.name: len(p.ready) for p in self.pools.pools},
            pool_targets={p.name: p.target for p in self.pools.pools}, draining=self.draining,
            labels=dict(self.config.labels),
            host={**self.host.sample(), "store_free": float(self._store_space()[0]),
                  "store_total": float(self._store_space()[1])},
            paused=sum(1 for r in self.backends.records() if r.state is SandboxState.PAUSED),
            healthy=not problems, problems=problems, repairs=self.selfcheck.repairs(), runtime=self.config.runtime,
            epoch=self.fencing.epoch,
            backends=self.backends.capabilities(),
            backend_facts=self.backends.facts(),
            boot_id=self.leases.boot_id,
            registry=self.backends.registry.url if self.backends.registry is not None else "",
        )

    def _layers(self) -> builtins.list[str]:
        now = time.monotonic()
        if now - self._layers_cache[0] > 2.0:
            out: set[str] = set()
            try:
                for layer in self.backends.store.list():
                    out.add(layer.digest)
                    out.add(layer.ref)
            except Exception as exc:  # a broken store must not break health
                log.warning("cannot list layers: %r", exc)
            self._layers_cache = (now, sorted(out))
        return self._layers_cache[1]

    # ------------------------------------------------------------------ exec --

    def ready_for_exec(self, sandbox_id: str) -> None:
        """Raise unless a command can start in the sandbox now (a paused one is woken)."""
        rec = self.record(sandbox_id)
        if rec.state is SandboxState.PAUSED:
            self.backend(sandbox_id).wake(sandbox_id)  # any request resumes a paused sandbox
        if rec.state is not SandboxState.RUNNING:
            raise SandboxStateError(
                f"sandbox {sandbox_id} is {rec.state.value}, not running" + (f" ({rec.reason})" if rec.reason else ""),
                sandbox_id=sandbox_id, state=rec.state.value,
            )

    def _exec_args(self, sandbox_id: str, req: ExecRequest) -> bytes | None:
        self.ready_for_exec(sandbox_id)
        if req.stdin_b64 is None:
            return None
        try:
            return base64.b64decode(req.stdin_b64, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidSpec("stdin_b64 is not valid base64", field="stdin_b64") from None

    async def exec(self, sandbox_id: str, req: ExecRequest, *, kind: str = "exec",
                   on_output: OutputCallback | None = None) -> ExecResult:
        """Run a command to completion. A timeout is a result with ``timed_out`` set (what
        the SDK expects), not an error: the partial output is worth having."""
        stdin = self._exec_args(sandbox_id, req)
        t0 = time.perf_counter()
        outcome = "error"
        try:
            with self.activity(sandbox_id):
                try:
                    extra: dict[str, Any] = {"pristine": req.pristine} if req.pristine else {}
                    if req.output_cap is not None:
                        extra["output_cap"] = req.output_cap
                    result = await self._require(sandbox_id, Capability.EXEC).exec(
                        sandbox_id, req.cmd, env=req.env, cwd=req.cwd, user=req.user, stdin=stdin,
                        timeout=req.timeout, idle_timeout=req.idle_timeout, on_output=on_output, **extra,
                    )
                except ExecTimeout as exc:
                    partial = getattr(exc, "result", None)
                    if not isinstance(partial, ExecResult):
                        raise
                    result = partial
            outcome = "timeout" if result.timed_out else ("ok" if result.exit_code == 0 else "nonzero")
            self._note_output(sandbox_id, kind, result, req.output_cap)
            return result
        except asyncio.CancelledError:
            outcome = "cancelled"  # the client went away; the runtime killed the command
            raise
        finally:
            self.metrics.execs.labels(kind, outcome).inc()
            self.metrics.exec_seconds.labels(kind).observe(time.perf_counter() - t0)
            found = self.backends.find(sandbox_id)
            if found is not None:
                self._scan_limits(found[1])
                self.audit.check_disk(found[0], found[1])

    def _note_output(self, sandbox_id: str, kind: str, result: ExecResult, cap: int | None = None) -> None:
        if result.truncated:
            rec = self.backends.record(sandbox_id)
            self.audit.note_output(sandbox_id, kind, stdout_bytes=result.stdout_bytes, stderr_bytes=result.stderr_bytes,
                                   cap=cap if cap is not None else rec.spec.output_cap if rec is not None else 0)

    def _scan_limits(self, rec: SandboxRecord) -> None:
        """Count the runtime's new OOM / pids-limit events (they appear after an exec)."""
        since = self._limits_seen.get(rec.id, 0.0)
        newest = since
        for ev in reversed(rec.events):
            t = float(ev.get("t", 0.0))
            if t <= since:
                break
            newest = max(newest, t)
            if ev.get("event") in ("oom", "pids_limit"):
                self.metrics.limit_events.labels(str(ev["event"])).inc(int(ev.get("count", 1)))
        self._limits_seen[rec.id] = newest

    async def exec_stream(self, sandbox_id: str, req: ExecRequest) -> AsyncIterator[bytes]:
        """NDJSON lines of :class:`StreamChunk`: output as produced, then the result (or
        an error). Checks run before the first byte, so a bad request is a plain HTTP
        error; cancelling the iteration (the client went away) kills the command."""
        self._exec_args(sandbox_id, req)
        return self._stream_lines(sandbox_id, req)

    async def _stream_lines(self, sandbox_id: str, req: ExecRequest) -> AsyncIterator[bytes]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[str, bytes] | None] = asyncio.Queue()
        queued = 0
        drained: asyncio.Future[None] | None = None
        cap = req.output_cap
        # with a cap: per stream, the head is sent as it comes, the newest `cap` bytes after it at the end
        caps = None if cap is None else {"stdout": BoundedCapture(cap), "stderr": BoundedCapture(cap)}

        def on_output(stream: str, chunk: bytes) -> asyncio.Future[None] | None:
            nonlocal queued, drained
            if caps is not None:
                chunk = caps[stream].feed(chunk)
                if not chunk:
                    return None
            queued += len(chunk)
            queue.put_nowait((stream, chunk))
            if queued <= STREAM_BUFFER_BYTES:
                return None
            # The reader is behind: the runtime stops reading the command's pipes until it
            # catches up (the command blocks on its writes). Nothing is dropped.
            if drained is None or drained.done():
                drained = loop.create_future()
            return drained

        def line(kind: str, data: bytes | bytearray, lost: int = 0) -> str:
            return StreamChunk(kind="stdout" if kind == "stdout" else "stderr",
                               data_b64=base64.b64encode(data).decode(),
                               dropped_bytes=lost or None).model_dump_json(exclude_none=True)

        task = asyncio.ensure_future(self.exec(sandbox_id, req, kind="stream", on_output=on_output))
        task.add_done_callback(lambda _t: queue.put_nowait(None))
        try:
            done = False
            while not done:
                items = [await queue.get()]
                while not queue.empty():
                    items.append(queue.get_nowait())
                merged: list[tuple[str, bytearray]] = []
                for it in items:
                    if it is None:
                        done = True
                        continue
                    queued -= len(it[1])
                    if merged and merged[-1][0] == it[0]:
                        merged[-1][1].extend(it[1])
                    else:
                        merged.append((it[0], bytearray(it[1])))
                if drained is not None and not drained.done() and queued <= STREAM_BUFFER_BYTES // 2:
                    drained.set_result(None)
                lines = [line(stream, data) for stream, data in merged]
                if lines:
                    yield ("\n".join(lines) + "\n").encode()
            tail_lines = [line(stream, c.tail, c.dropped) for stream, c in (caps or {}).items() if c.tail]
            if tail_lines:
                yield ("\n".join(tail_lines) + "\n").encode()
            try:
                final = StreamChunk(kind="result", result=result_to_wire(task.result()))
            except DsecError as exc:
                final = StreamChunk(kind="error", error=error_body(exc)["error"])
            except Exception as exc:
                log.exception("exec stream failed")
                final = StreamChunk(kind="error", error={"code": "dsec_error", "message": f"edge error: {exc!r}"})
            yield (final.model_dump_json(exclude_none=True) + "\n").encode()
        finally:
            if not task.done():
                task.cancel()  # the runtime kills the command's process tree
                self.events.add(sandbox_id, "exec_cancelled", reason="client_disconnected")
                with contextlib.suppress(BaseException):
                    await task

    # ------------------------------------------------ network policy, stages --

    async def set_policy(self, sandbox_id: str, policy: NetworkPolicy | None) -> SandboxInfo:
        """Replace the sandbox's network policy atomically (None: loopback only). An unknown
        permission name is an InvalidSpec and changes nothing."""
        self.record(sandbox_id)
        if policy is not None:
            self.require_network(f"sandbox {sandbox_id}'s policy", "policy")
        t0 = time.perf_counter()
        try:
            rec = await self._require(sandbox_id, Capability.NETWORK, "network policies").set_policy(sandbox_id, policy)
        except DsecError:
            self.metrics.policy_changes.labels("failed").inc()
            raise
        self.metrics.policy_changes.labels("ok").inc()
        self.metrics.policy_seconds.labels("policy").observe(time.perf_counter() - t0)
        self.touch(sandbox_id)
        return self.info(rec)

    async def set_stage(self, sandbox_id: str, stage: str) -> SandboxInfo:
        """Switch to a declared stage: its file rules and network policy; processes started
        before the switch are killed by the runtime."""
        rec = self.record(sandbox_id)
        backend = self._require(sandbox_id, Capability.STAGES)
        if stage not in rec.spec.stages:
            known = ", ".join(sorted(rec.spec.stages)) or "none: create the sandbox with `stages`"
            raise InvalidSpec(f"sandbox {sandbox_id} has no stage {stage!r} (declared: {known})",
                              field="stage", sandbox_id=sandbox_id, stage=stage)
        if rec.spec.stages[stage].network is not None:
            self.require_network(f"stage {stage!r}", "stage")
        if rec.state is SandboxState.PAUSED:
            backend.wake(sandbox_id)
        t0 = time.perf_counter()
        try:
            rec = await backend.set_stage(sandbox_id, stage)
        except DsecError:
            self.metrics.stage_changes.labels("failed").inc()
            raise
        self.metrics.stage_changes.labels("ok").inc()
        self.metrics.policy_seconds.labels("stage").observe(time.perf_counter() - t0)
        # the switch killed what ran under the old stage: their sessions are gone
        for sess in self._sessions.pop(sandbox_id, {}).values():
            with contextlib.suppress(Exception):
                await sess.close()
        self.touch(sandbox_id)
        return self.info(rec)

    def require_network(self, what: str, field: str) -> None:
        if self.config.network is None:
            raise InvalidSpec(
                f"{what} asks for network, but edge {self.edge_id} has no network configured: add a `network` "
                "section to its configuration (docs/EDGE.md, \"Network\"; `dsec up --edge-config FILE`)",
                field=field, edge_id=self.edge_id,
            )

    def network_info(self, sandbox_id: str) -> NetworkInfo:
        """Address, policy in force and refused attempts (as of the last audit pass)."""
        rec = self.record(sandbox_id)
        facts = self.backend(sandbox_id).network_info(sandbox_id) or {}
        ip = facts.get("ip")
        denied = facts.get("denied_packets", 0)
        recent = facts.get("denied_recent") or []
        raw = {k: v for k, v in facts.items() if k not in ("policy", "ip", "denied_packets", "denied_recent")}
        return NetworkInfo(
            sandbox_id=sandbox_id, ip=None if ip is None else str(ip), policy=rec.current_policy(),
            stage=rec.current_stage, denied=int(denied or 0), recent_denied=[str(x) for x in recent][-32:],
            detail=_jsonable(raw),
        )

    # -------------------------------------------------------------- sessions --

    async def open_session(self, sandbox_id: str, body: SessionOpen) -> str:
        backend = self._require(sandbox_id, Capability.SESSIONS)
        with self.activity(sandbox_id):
            sess = await backend.open_session(sandbox_id, env=body.env, cwd=body.cwd, user=body.user)
        self._sessions.setdefault(sandbox_id, {})[sess.id] = sess
        self.events.add(sandbox_id, "session_opened", session_id=sess.id)
        return sess.id

    def _session(self, sandbox_id: str, session_id: str) -> ShellSession:
        self.record(sandbox_id)
        sess = self._sessions.get(sandbox_id, {}).get(session_id)
        if sess is None:
            raise SessionClosed(f"no open session {session_id!r} in sandbox {sandbox_id}",
                                sandbox_id=sandbox_id, session_id=session_id)
        return sess

    async def session_run(self, sandbox_id: str, session_id: str, body: SessionRun) -> ExecResult:
        sess = self._session(sandbox_id, session_id)
        t0 = time.perf_counter()
        outcome = "error"
        self.events.add(sandbox_id, "session_command", session_id=session_id, cmd=command_line(body.command))
        result: ExecResult | None = None
        try:
            with self.activity(sandbox_id):
                try:
                    result = await sess.run(body.command, timeout=body.timeout,
                                            output_cap=self.record(sandbox_id).spec.output_cap)
                except ExecTimeout as exc:
                    partial = getattr(exc, "result", None)
                    if not isinstance(partial, ExecResult):
                        raise
                    result = partial
                except SessionClosed:
                    if self._sessions.get(sandbox_id, {}).pop(session_id, None) is not None:
                        self.events.add(sandbox_id, "session_closed", session_id=session_id, reason="shell_exited")
                    raise
            outcome = "timeout" if result.timed_out else ("ok" if result.exit_code == 0 else "nonzero")
            self._note_output(sandbox_id, "session", result)
            return result
        finally:
            if result is not None:
                self.events.add(sandbox_id, "session_command_ended", session_id=session_id,
                                exit_code=result.exit_code, duration_s=round(time.perf_counter() - t0, 6),
                                timed_out=result.timed_out)
            self.metrics.execs.labels("session", outcome).inc()
            self.metrics.exec_seconds.labels("session").observe(time.perf_counter() - t0)

    async def close_session(self, sandbox_id: str, session_id: str) -> None:
        self.record(sandbox_id)
        sess = self._sessions.get(sandbox_id, {}).pop(session_id, None)
        if sess is None:
            return  # idempotent
        self.touch(sandbox_id)
        await sess.close()
        self.events.add(sandbox_id, "session_closed", session_id=session_id, reason="closed")

    def note_copy(self, sandbox_id: str, event: str, path: str, size: int, *, entries: int | None = None,
                  tar: bool = False) -> None:
        """A file or tar that went into (``copy_in``) or out of (``copy_out``) a sandbox, for its event log."""
        extra = {"tar": True, "entries": entries} if tar else {}
        self.events.add(sandbox_id, event, path=path, bytes=size, **extra)

    async def stats(self, sandbox_id: str) -> SandboxStats:
        """What the sandbox uses now, beside its limits (``dsec top``)."""
        rec = self.record(sandbox_id)
        res = rec.spec.resources
        use = await asyncio.to_thread(self.backend(sandbox_id).usage, sandbox_id)
        return SandboxStats(id=sandbox_id, state=rec.state, cpu_s=round(use.cpu_s, 3), cpu_limit=res.cpu,
                            memory_bytes=use.memory_bytes, memory_limit=res.memory, disk_bytes=use.disk_bytes,
                            disk_limit=res.disk, pids=use.pids, pids_limit=res.pids)

    # ----------------------------------------------------------------- files --

    async def files(self, sandbox_id: str, op: Callable[[Any], T]) -> T:
        """Run ``op`` on the sandbox's files object (the backend's; ``SandboxFiles`` for the
        container backend) in a worker thread (blocking syscalls)."""
        backend = self._require(sandbox_id, Capability.FILES)
        with self.activity(sandbox_id):
            fs = backend.files(sandbox_id)
            try:
                return await asyncio.to_thread(op, fs)
            except FileAccessError as exc:
                if getattr(exc, "errno", None) in FULL_ERRNOS:
                    self.audit.note_disk_full(sandbox_id, source="files_api")
                raise

    # ---------------------------------------------- pause, snapshots, forks --

    async def pause(self, sandbox_id: str, *, how: str = "api") -> PauseReport:
        """Freeze the sandbox and push its memory to swap. SandboxStateError if it is paused already."""
        backend = self._require(sandbox_id, Capability.PAUSE)
        res = await backend.pause(sandbox_id)
        self.metrics.pauses.labels(how).inc()
        r = res.reclaim
        self.events.add(sandbox_id, "paused", how=how, seconds=round(res.seconds, 6),
                        memory_before=r.before if r else None, memory_after=r.after if r else None)
        return PauseReport(id=sandbox_id, state=backend.get(sandbox_id).state, freeze_s=res.freeze_s,
                           seconds=res.seconds, memory_before=r.before if r else None,
                           memory_after=r.after if r else None, swapped=r.swapped if r else None)

    async def preempt(self, sandbox_id: str, *, by_priority: int | None = None, reason: str = "") -> PauseReport:
        """Pause for the control plane's scheduler: frozen, memory pushed to swap, and its cpu and
        memory no longer counted by admission (a more urgent sandbox takes them); requests do not
        wake it (edge/preempt.py), only :meth:`resume`. A sandbox paused already (by its owner or
        when idle) is only marked. Idempotent."""
        rec = self.record(sandbox_id)
        if sandbox_id in self.preempted:
            return PauseReport(id=sandbox_id, state=rec.state, freeze_s=0.0, seconds=0.0)
        if rec.state is SandboxState.RUNNING:
            rep = await self.pause(sandbox_id, how="preempt")
        elif rec.state is SandboxState.PAUSED:
            self._require(sandbox_id, Capability.PAUSE)
            rep = PauseReport(id=sandbox_id, state=rec.state, freeze_s=0.0, seconds=0.0)
        else:
            raise SandboxStateError(f"sandbox {sandbox_id} is {rec.state.value}: only a running or paused "
                                    "sandbox can be preempted", sandbox_id=sandbox_id, state=rec.state.value)
        self.preempted.add(sandbox_id, at=time.time(), by_priority=by_priority, reason=reason)
        self.admission.suspend(sandbox_id)
        self.events.add(sandbox_id, "preempted", action="pause", by_priority=by_priority, reason=reason)
        return rep

    async def evict(self, sandbox_id: str, *, by_priority: int | None = None, reason: str = "") -> bool:
        """Destroy for the control plane's scheduler (the task allows it): data-path calls on it
        then answer ``SandboxEvicted``. Idempotent: False if it was not there."""
        if self.backends.find(sandbox_id) is not None:
            self.events.add(sandbox_id, "preempted", action="destroy", by_priority=by_priority, reason=reason)
        self.preempted.discard(sandbox_id)
        return await self.destroy(sandbox_id, reason=EVICTED_REASON)

    async def auto_pause(self, sandbox_id: str) -> None:
        """The watchdog's pause of an idle sandbox (a race with a request or a pause is fine)."""
        found = self.backends.find(sandbox_id)
        if found is None or not found[0].capabilities.supports(Capability.PAUSE):
            return
        rec = found[1]
        if rec.state is not SandboxState.RUNNING or self.is_busy(sandbox_id):
            return
        with contextlib.suppress(SandboxStateError):
            await self.pause(sandbox_id, how="idle")

    async def resume(self, sandbox_id: str) -> SandboxInfo:
        """Thaw a paused sandbox. SandboxStateError if it is not paused."""
        backend = self._require(sandbox_id, Capability.PAUSE, "resume")
        if sandbox_id not in self.preempted:
            rec = await backend.resume(sandbox_id)
            self.touch(sandbox_id)
            self.events.add(sandbox_id, "resumed", how="api")
            return self.info(rec)
        # paused by preemption: its cpu and memory must fit again first (Backpressure if not)
        self.admission.unsuspend(sandbox_id)
        info = self.preempted.by_id[sandbox_id]
        self.preempted.discard(sandbox_id)
        try:
            rec = await backend.resume(sandbox_id)
        except BaseException:
            self.preempted.add(sandbox_id, at=float(info.get("at", time.time())),
                               by_priority=int(info.get("by_priority", -1)), reason=str(info.get("reason", "")))
            self.admission.suspend(sandbox_id)
            raise
        self.touch(sandbox_id)
        self.events.add(sandbox_id, "resumed", how="after preemption")
        return self.info(rec)

    def _select(self, ids: builtins.list[str] | None, labels: dict[str, str] | None, task: str | None) -> builtins.list[str]:
        if ids is None and not labels and task is None:
            raise InvalidSpec("say which sandboxes: ids, a task or labels", field="labels")
        chosen = [i.id for i in self.list(labels=labels, task=task)] if (labels or task is not None) else []
        if ids is not None:
            pooled = self.pools.pooled_ids
            chosen = [i for i in ids if i not in pooled] if not (labels or task is not None) else \
                [i for i in chosen if i in set(ids)]
        return chosen

    async def _group_op(self, chosen: builtins.list[str], *, pause: bool) -> GroupOutcome:
        """Pause or resume many sandboxes, each backend's share in one call; a sandbox whose
        backend cannot pause gets an ``Unsupported`` error in the outcome."""
        t0 = time.perf_counter()
        by_backend: dict[str, tuple[Backend, builtins.list[str]]] = {}
        out = GroupOutcome()
        for sid in chosen:
            found = self.backends.find(sid)
            if found is None:
                out.errors[sid] = SandboxNotFound(f"no sandbox {sid!r} on edge {self.edge_id}", sandbox_id=sid)
                continue
            b = found[0]
            if not b.capabilities.supports(Capability.PAUSE):
                out.errors[sid] = Unsupported.operation("pause" if pause else "resume", backend=b.capabilities.kind,
                                                        sandbox_id=sid)
                continue
            by_backend.setdefault(b.capabilities.kind, (b, []))[1].append(sid)
        for b, ids in by_backend.values():
            part = await (b.pause_many(ids) if pause else b.resume_many(ids))
            out.done += part.done
            out.skipped += part.skipped
            out.errors.update(part.errors)
        out.seconds = time.perf_counter() - t0
        return out

    @staticmethod
    def _group(out: Any) -> GroupResult:
        return GroupResult(done=out.done, skipped=out.skipped, seconds=out.seconds,
                           errors={k: error_body(v)["error"] for k, v in out.errors.items()})

    async def pause_where(self, *, ids: builtins.list[str] | None = None, labels: dict[str, str] | None = None,
                          task: str | None = None) -> GroupResult:
        """Pause every (running) sandbox of a task / with these labels / in ``ids``."""
        out = await self._group_op(self._select(ids, labels, task), pause=True)
        for sid in out.done:
            self.metrics.pauses.labels("group").inc()
            self.events.add(sid, "paused", how="group")
        return self._group(out)

    async def resume_where(self, *, ids: builtins.list[str] | None = None, labels: dict[str, str] | None = None,
                           task: str | None = None) -> GroupResult:
        chosen = self._select(ids, labels, task)
        held = [sid for sid in chosen if sid in self.preempted]  # only their own resume takes room back
        out = await self._group_op([sid for sid in chosen if sid not in self.preempted], pause=False)
        for sid in held:
            try:
                self.preempted.gate(sid)
            except DsecError as exc:
                out.errors[sid] = exc
        for sid in out.done:
            self.touch(sid)
            self.events.add(sid, "resumed", how="group")
        return self._group(out)

    @staticmethod
    def snapshot_info(layer: Any, *, sandbox_id: str | None = None, extra: Any = None) -> SnapshotInfo:
        return SnapshotInfo(
            digest=layer.digest, name=layer.name, tag=layer.tag, ref=layer.ref, kind=str(layer.kind.value),
            size=layer.size, created_at=layer.created_at, parents=list(layer.parents), sandbox_id=sandbox_id,
            bytes=extra.stats.bytes if extra is not None else None,
            frozen_s=extra.frozen_s if extra is not None else None,
            seconds=extra.seconds if extra is not None else None,
            collapsed=len(extra.collapsed) if extra is not None else None,
        )

    async def snapshot(self, sandbox_id: str, body: SnapshotRequest) -> SnapshotInfo:
        """Pack the sandbox's writable layer into a snapshot layer (it keeps running, or stays paused)."""
        backend = self._require(sandbox_id, Capability.SNAPSHOT)
        with self.activity(sandbox_id):
            info = await backend.snapshot_info(sandbox_id, name=body.name, tag=body.tag, exclude=body.exclude)
        self.metrics.snapshots.labels("snapshot").inc()
        self.events.add(sandbox_id, "snapshot", digest=info.layer.digest, ref=info.layer.ref, size=info.layer.size)
        self._layers_cache = (0.0, [])
        return self.snapshot_info(info.layer, sandbox_id=sandbox_id, extra=info)

    async def fork(self, sandbox_id: str, body: ForkRequest) -> builtins.list[SandboxInfo]:
        """``n`` new sandboxes from this one's disk now (all or nothing), each with its own
        identity, under the parent's project, task and (unless given) labels and lifecycle.
        The backend's ``fork`` does the work (it decides what the children start as: the
        parent's stage and policy in force now); the edge books their room first."""
        backend = self._require(sandbox_id, Capability.FORK)
        rec = self.record(sandbox_id)
        if rec.state not in (SandboxState.RUNNING, SandboxState.PAUSED):
            raise SandboxStateError(
                f"sandbox {sandbox_id} is {rec.state.value}" + (f" ({rec.reason})" if rec.reason else "")
                + ": only a running or paused sandbox can be forked",
                sandbox_id=sandbox_id, state=rec.state.value,
            )
        parent = rec.edge
        # Refuse early, before anything is frozen or packed, if the children cannot all fit.
        self.admission.check_room(rec.spec.resources, body.n)
        life = body.lifecycle or Lifecycle(ttl_s=parent.ttl_s or 3600.0, idle_timeout_s=parent.idle_timeout_s,
                                           auto_pause_s=parent.auto_pause_s)
        now = time.time()
        ids = [self.new_id() for _ in range(body.n)]
        edges = [EdgeMeta.lifecycle(now, life.ttl_s, life.idle_timeout_s, life.auto_pause_s or self.config.auto_pause_s,
                                    labels=dict(body.labels if body.labels is not None else parent.labels),
                                    task=parent.task, project=parent.project)
                 for _ in ids]
        t0 = time.perf_counter()
        for cid in ids:
            self.admission.reserve(cid, rec.spec.resources)
        try:
            with self.activity(sandbox_id):
                made = await backend.fork(sandbox_id, ids, edges=edges, exclude=body.exclude)
        except BaseException:
            for cid in ids:
                self.admission.release(cid)
            raise
        elapsed = time.perf_counter() - t0
        layer = None
        out = []
        for child in made:
            self.metrics.creates.labels("ok", "fork", "").inc()
            self.metrics.create_seconds.labels("fork").observe(elapsed)
            layer = child.spec.image.base
            self.events.add(child.id, "created", source="fork", latency_ms=round(elapsed * 1000, 3),
                            expires_at=child.edge.expires_at, idle_timeout_s=child.edge.idle_timeout_s,
                            backend=child.spec.backend)
            self.events.add(child.id, "forked", parent=sandbox_id, layer=layer)
            self.backends.touch(child.id)
            out.append(self.info(child, with_token=True, from_pool=False))
        self.metrics.snapshots.labels("fork").inc()
        self.events.add(sandbox_id, "fork", children=[c.id for c in made], layer=layer)
        self._layers_cache = (0.0, [])
        return out

    def list_snapshots(self) -> builtins.list[SnapshotInfo]:
        from dsec.images.layer import LayerKind

        return [self.snapshot_info(lay) for lay in self.backends.store.list() if lay.kind is LayerKind.SNAPSHOT]

    def delete_snapshot(self, ref: str) -> None:
        """Remove a snapshot (LayerInUse while a sandbox or another snapshot needs it)."""
        from dsec.images.layer import LayerKind

        layer = self.backends.store.resolve(ref)
        if layer.kind is not LayerKind.SNAPSHOT:
            raise InvalidSpec(f"{ref} is a {layer.kind.value} layer, not a snapshot (use `dsec image rm`)", field="ref")
        # The runtime keeps an idle layer pinned a moment after its last sandbox (LAYER_RELEASE_GRACE_S):
        # a delete right after that sandbox must not say "in use". No-op while a sandbox uses it.
        for b in self.backends.by_kind.values():
            b.release_layer(layer.digest)
        self.backends.store.remove(ref)
        self._layers_cache = (0.0, [])

    # ------------------------------------------------------------- utilities --

    def require_running(self) -> None:
        if not self.started:
            raise HostError(f"edge {self.edge_id} is not running", edge_id=self.edge_id)
