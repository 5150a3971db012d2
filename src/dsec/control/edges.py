"""Edges as the control plane sees them: the registry rows, the HTTP client, the directory.

- :class:`EdgeClient` calls an edge's admin API (create, delete, list, health)
  with an edge-admin ``dsec1`` token minted from the cluster key, and sorts
  failures into "refused" (429: try another edge), "unreachable" (try another
  edge; a timed-out create may have happened, the watcher reaps such orphans)
  and typed errors from the edge.
- :class:`EdgeDirectory` is each replica's cache of edge id -> URL. A sandbox
  id carries its edge (``<edge>-<hex>``), so GET/DELETE route through this
  cache without asking the store where the sandbox lives.
- The ``*_txn`` functions run inside one store transaction.
"""

from __future__ import annotations

import asyncio
import contextlib
import json as _json
import logging
import re
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import httpx
import sqlalchemy as sa
from sqlalchemy.orm import Session

from dsec.control.db import EDGES, EdgeRow, Store
from dsec.control.errors import Conflict, NotFound
from dsec.control.iam import Amount, bump_statement
from dsec.control.locking import add_new, lock_one
from dsec.control.placement import EdgeView, Room, layer_set, room_of_health
from dsec.errors import Backpressure, DsecError, Forbidden, InvalidSpec, error_from_wire
from dsec.http import auth
from dsec.http.client import Answer, ConnectFailed, EdgeHTTP, NoAnswer
from dsec.spec.api import (
    EDGE_ID_PATTERN,
    EdgeHealth,
    EdgeInfo,
    Fence,
    FenceResult,
    ForkRequest,
    GroupResult,
    LayerInfo,
    LeaseReleased,
    LeaseReportItem,
    PauseReport,
    SandboxInfo,
    SandboxStats,
    SnapshotInfo,
    SnapshotRequest,
)

log = logging.getLogger("dsec.control.edges")

_EDGE_ID = re.compile(EDGE_ID_PATTERN)


def edge_of(sandbox_id: str) -> str:
    """The edge a sandbox id names: everything before the first '-'."""
    return sandbox_id.split("-", 1)[0]


def check_edge_id(edge_id: str) -> str:
    if not _EDGE_ID.match(edge_id):
        raise InvalidSpec(
            f"edge id {edge_id!r} must match {EDGE_ID_PATTERN} (it prefixes sandbox ids)", field="edge_id"
        )
    return edge_id


# ------------------------------------------------------------------ client ----


class EdgeRemoved(Forbidden):
    """A report from an edge that ``dsec edge rm`` removed (HTTP 403, ``edge_id``): it must join again."""


class EdgeUnreachable(DsecError):
    """The edge did not answer (``maybe_done``: the request may still have happened)."""

    code = "host_error"

    def __init__(self, message: str, *, maybe_done: bool, **fields: Any) -> None:
        super().__init__(message, **fields)
        self.maybe_done = maybe_done


class EdgeClient:
    """Calls to the edges: keep-alive connections per edge, at most ``per_edge`` in flight.

    Plain-http edges go through :class:`EdgeHTTP` (edgehttp.py: a few hundred
    microseconds per call); ``https://`` edges through httpx.
    """

    def __init__(self, key: bytes, *, timeout: float, token_ttl_s: float = 3600.0, per_edge: int = 16) -> None:
        self._key = key
        self._ttl = token_ttl_s
        self._timeout = timeout
        self._long = max(timeout, 600.0)  # pause (reclaim), snapshot and fork may take minutes
        self._per_edge = per_edge
        self._token: tuple[str, float] | None = None
        self._pools: dict[str, EdgeHTTP | tuple[httpx.AsyncClient, asyncio.Semaphore]] = {}

    def _pool(self, base: str) -> EdgeHTTP | tuple[httpx.AsyncClient, asyncio.Semaphore]:
        pool = self._pools.get(base)
        if pool is None:
            if base.startswith("http://"):
                pool = EdgeHTTP(base, size=self._per_edge, timeout=self._timeout, connect_timeout=min(5.0, self._timeout))
            else:  # TLS: httpx
                client = httpx.AsyncClient(
                    timeout=httpx.Timeout(self._timeout, connect=min(5.0, self._timeout)),
                    limits=httpx.Limits(max_connections=self._per_edge, max_keepalive_connections=self._per_edge),
                )
                pool = (client, asyncio.Semaphore(self._per_edge))
            self._pools[base] = pool
        return pool

    def admin_token(self) -> str:
        now = time.time()
        if self._token is None or self._token[1] - now < self._ttl / 4:
            self._token = auth.mint(self._key, sandbox_id="*", project="*", ttl_s=self._ttl, scope="edge-admin")
        return self._token[0]

    async def aclose(self) -> None:
        pools, self._pools = self._pools, {}
        for pool in pools.values():
            if isinstance(pool, EdgeHTTP):
                await pool.aclose()
            else:
                await pool[0].aclose()

    async def _call(
        self, method: str, base: str, path: str, *, json: Any = None, timeout: float | None = None,
        retry_stale: bool = True, body: bytes | None = None,
    ) -> Answer | httpx.Response:
        """One call. ``retry_stale``: the request is idempotent (or the edge de-duplicates it), so a
        kept-alive connection that turns out dead may be retried on a fresh one."""
        headers = {"authorization": f"Bearer {self.admin_token()}"}
        url = f"{base}{path}"
        pool = self._pool(base)
        if json is not None and body is None:
            body = _json.dumps(json, separators=(",", ":")).encode()
        if body is not None:
            headers["content-type"] = "application/json"
        if isinstance(pool, EdgeHTTP):
            try:
                return await pool.request(
                    method, path, headers=headers, body=body, timeout=timeout, retry_stale=retry_stale
                )
            except ConnectFailed as exc:
                raise EdgeUnreachable(f"edge at {url} refused the connection: {exc}", maybe_done=False, url=url) from None
            except NoAnswer as exc:
                raise EdgeUnreachable(f"edge at {url} did not answer: {exc}", maybe_done=True, url=url) from None
        client, sem = pool
        kw: dict[str, Any] = {"headers": headers}
        if body is not None:
            kw["content"] = body
        if timeout is not None:
            kw["timeout"] = timeout
        try:
            async with sem:
                return await client.request(method, url, **kw)
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            raise EdgeUnreachable(f"edge at {url} refused the connection: {exc}", maybe_done=False, url=url) from None
        except httpx.TransportError as exc:  # read timeout, reset...: the request may have happened
            raise EdgeUnreachable(
                f"edge at {url} did not answer: {type(exc).__name__} {exc}", maybe_done=True, url=url
            ) from None

    @staticmethod
    def _raise(resp: Answer | httpx.Response, edge_id: str) -> None:
        if resp.status_code < 400:
            return
        payload: dict[str, Any] | None = None
        with contextlib.suppress(ValueError):
            body = resp.json()
            if isinstance(body, dict) and isinstance(body.get("error"), dict):
                payload = dict(body["error"])
        if payload is None:
            if resp.status_code == 429:
                raise Backpressure(f"edge {edge_id} is busy", retry_after=_retry_after(resp), edge_id=edge_id)
            if resp.status_code >= 500:
                raise EdgeUnreachable(
                    f"edge {edge_id} failed with HTTP {resp.status_code}: {resp.text[:200]}",
                    maybe_done=True, edge_id=edge_id,
                )
            raise DsecError(f"edge {edge_id} answered HTTP {resp.status_code}: {resp.text[:200]}", edge_id=edge_id)
        if resp.status_code == 429:
            payload.setdefault("retry_after", _retry_after(resp))
        payload.setdefault("edge_id", edge_id)
        raise error_from_wire(payload)

    async def create(self, edge_id: str, url: str, body: dict[str, Any]) -> SandboxInfo:
        resp = await self._call("POST", url, "/v1/sandboxes", json=body)
        self._raise(resp, edge_id)
        return SandboxInfo.model_validate_json(resp.content)

    async def create_raw(self, edge_id: str, url: str, body: bytes) -> SandboxInfo:
        """A create whose JSON body is ready (the hot path: no second encode). The edge
        de-duplicates by the body's request_id, so a dead kept-alive connection is retried."""
        resp = await self._call("POST", url, "/v1/sandboxes", body=body)
        self._raise(resp, edge_id)
        return SandboxInfo.model_validate_json(resp.content)

    async def pause(self, edge_id: str, url: str, sandbox_id: str) -> PauseReport:
        resp = await self._call("POST", url, f"/v1/sandboxes/{sandbox_id}/pause", timeout=self._long)
        self._raise(resp, edge_id)
        return PauseReport.model_validate_json(resp.content)

    async def preempt(self, edge_id: str, url: str, sandbox_id: str, *, action: str, by_priority: int | None,
                      reason: str = "") -> None:
        """The scheduler's pause (memory to swap, no longer counted) or destroy of a sandbox."""
        resp = await self._call("POST", url, f"/v1/sandboxes/{sandbox_id}/preempt", timeout=self._long,
                                json={"action": action, "by_priority": by_priority, "reason": reason[:300]})
        self._raise(resp, edge_id)

    async def resume(self, edge_id: str, url: str, sandbox_id: str) -> SandboxInfo:
        resp = await self._call("POST", url, f"/v1/sandboxes/{sandbox_id}/resume")
        self._raise(resp, edge_id)
        return SandboxInfo.model_validate_json(resp.content)

    async def group(self, edge_id: str, url: str, op: str, ids: list[str]) -> GroupResult:
        """``op`` (pause / resume) of these sandboxes of one edge, in one call (the edge freezes the
        whole group first). Idempotent: a sandbox already there is reported ``skipped``."""
        query = "&".join(f"id={quote(i, safe='')}" for i in ids)
        resp = await self._call("POST", url, f"/v1/{op}?{query}", timeout=self._long)
        self._raise(resp, edge_id)
        return GroupResult.model_validate_json(resp.content)

    async def snapshot(self, edge_id: str, url: str, sandbox_id: str, req: SnapshotRequest) -> SnapshotInfo:
        resp = await self._call("POST", url, f"/v1/sandboxes/{sandbox_id}/snapshot", body=req.model_dump_json().encode(),
                                timeout=self._long, retry_stale=False)
        self._raise(resp, edge_id)
        return SnapshotInfo.model_validate_json(resp.content)

    async def fork(self, edge_id: str, url: str, sandbox_id: str, req: ForkRequest) -> list[SandboxInfo]:
        """Not idempotent on the edge: never retried (a lost answer leaves orphans the watcher reaps)."""
        resp = await self._call("POST", url, f"/v1/sandboxes/{sandbox_id}/fork", body=req.model_dump_json().encode(),
                                timeout=self._long, retry_stale=False)
        self._raise(resp, edge_id)
        return [SandboxInfo.model_validate(x) for x in resp.json()]

    async def delete_snapshot(self, edge_id: str, url: str, ref: str) -> None:
        """Remove a snapshot layer; already gone is fine."""
        resp = await self._call("DELETE", url, f"/v1/snapshots/{quote(ref, safe=':')}")
        if resp.status_code == 404:
            return
        self._raise(resp, edge_id)

    async def set_stage(self, edge_id: str, url: str, sandbox_id: str, stage: str) -> SandboxInfo:
        resp = await self._call("POST", url, f"/v1/sandboxes/{sandbox_id}/stage", json={"stage": stage})
        self._raise(resp, edge_id)
        return SandboxInfo.model_validate_json(resp.content)

    async def delete(self, edge_id: str, url: str, sandbox_id: str) -> None:
        """Destroy on the edge; already gone is fine."""
        resp = await self._call("DELETE", url, f"/v1/sandboxes/{sandbox_id}")
        if resp.status_code == 404:
            return
        self._raise(resp, edge_id)

    async def events(self, edge_id: str, url: str, sandbox_id: str) -> list[dict[str, Any]]:
        """The sandbox's event log on the edge (docs/EDGE.md has the fields)."""
        resp = await self._call("GET", url, f"/v1/sandboxes/{quote(sandbox_id, safe='')}/events")
        self._raise(resp, edge_id)
        data = resp.json()
        return [x for x in data if isinstance(x, dict)] if isinstance(data, list) else []

    async def stats(self, edge_id: str, url: str, sandbox_id: str) -> SandboxStats:
        """What the sandbox uses now, beside its limits."""
        resp = await self._call("GET", url, f"/v1/sandboxes/{quote(sandbox_id, safe='')}/stats")
        self._raise(resp, edge_id)
        return SandboxStats.model_validate_json(resp.content)

    async def get(self, edge_id: str, url: str, sandbox_id: str) -> SandboxInfo:
        resp = await self._call("GET", url, f"/v1/sandboxes/{sandbox_id}")
        self._raise(resp, edge_id)
        return SandboxInfo.model_validate_json(resp.content)

    async def revoke_lease(self, edge_id: str, url: str, lease_id: str) -> list[LeaseReportItem]:
        """The edge stops honouring a create lease; answers what it made under it (idempotent)."""
        resp = await self._call("DELETE", url, f"/v1/leases/{lease_id}")
        self._raise(resp, edge_id)
        return LeaseReleased.model_validate_json(resp.content).sandboxes

    async def list(self, edge_id: str, url: str) -> list[SandboxInfo]:
        resp = await self._call("GET", url, "/v1/sandboxes")
        self._raise(resp, edge_id)
        data = resp.json()
        items = data["items"] if isinstance(data, dict) else data
        return [SandboxInfo.model_validate(x) for x in items]

    async def fence(self, edge_id: str, url: str, epoch: int) -> FenceResult:
        """Tell the edge to destroy everything it made before ``epoch`` (the control plane
        declared those sandboxes lost). Idempotent: a fence at or below the edge's epoch is a no-op."""
        resp = await self._call("POST", url, "/v1/fence", body=Fence(epoch=epoch).model_dump_json().encode(),
                                timeout=self._long)
        self._raise(resp, edge_id)
        return FenceResult.model_validate_json(resp.content)

    async def health(self, edge_id: str, url: str, *, timeout: float | None = None) -> EdgeHealth:
        resp = await self._call("GET", url, "/v1/health", timeout=timeout)
        self._raise(resp, edge_id)
        return EdgeHealth.model_validate_json(resp.content)


def _retry_after(resp: Answer | httpx.Response) -> float:
    try:
        return float(resp.headers.get("retry-after", "1"))
    except ValueError:
        return 1.0


# --------------------------------------------------------------- directory ----


class EdgeDirectory:
    """This replica's cache of edge id -> URL (edges rarely move; refreshed on a miss)."""

    def __init__(self, store: Store, *, max_age_s: float = 5.0) -> None:
        self._store = store
        self._max_age = max_age_s
        self._urls: dict[str, str] = {}
        self._loaded = 0.0
        self._lock = asyncio.Lock()

    def put(self, edge_id: str, url: str) -> None:
        self._urls[edge_id] = url

    def forget(self, edge_id: str) -> None:
        self._urls.pop(edge_id, None)

    async def url(self, edge_id: str) -> str | None:
        if edge_id not in self._urls or time.monotonic() - self._loaded > self._max_age:
            await self.refresh()
        return self._urls.get(edge_id)

    async def refresh(self) -> None:
        async with self._lock:
            if time.monotonic() - self._loaded < 0.05:
                return
            rows = await self._store.read(lambda s: [(i, u) for i, u in s.execute(sa.select(EdgeRow.id, EdgeRow.url))])
            self._urls = dict(rows)
            self._loaded = time.monotonic()


# ------------------------------------------------------------ transactions ----


def effective_draining(e: EdgeRow) -> bool:
    return bool(e.draining or (e.health or {}).get("draining", False))


EDGE_STATUSES = ("alive", "dead", "fencing", "removed")


def edge_info(e: EdgeRow) -> EdgeInfo:
    return EdgeInfo(
        id=e.id,
        url=e.url,
        status=e.status if e.status in EDGE_STATUSES else "dead",  # type: ignore[arg-type]
        draining=effective_draining(e),
        last_seen=e.last_seen,
        registered_at=e.registered_at,
        health=EdgeHealth.model_validate(e.health) if e.health is not None else None,
        committed=Amount(e.committed_sandboxes, e.committed_cpu_m, e.committed_memory).to_quota(),
        epoch=int(e.epoch or 0),
        lost_at=e.lost_at,
    )


def needs_fence(e: EdgeRow, reported_epoch: int) -> bool:
    """The edge still holds sandboxes the control plane declared lost (it reports an epoch
    below the one the control plane raised when it declared them)."""
    return reported_epoch < int(e.epoch or 0)


def record_health_txn(s: Session, health: EdgeHealth, *, now: float | None = None) -> EdgeInfo:
    """Register or heartbeat: upsert the edge with its report; it is alive again, unless it was
    removed (``dsec edge rm``: refused until it joins again) or still has to be fenced (its
    reported epoch is below the control plane's: ``fencing``, no placement, until it reports
    the fence applied)."""
    check_edge_id(health.edge_id)
    if not health.url.startswith(("http://", "https://")):
        raise InvalidSpec(f"edge url {health.url!r} must be http(s)://host:port", field="url")
    now = time.time() if now is None else now
    e = s.get(EdgeRow, health.edge_id, with_for_update=True)
    if e is None:
        new = EdgeRow(
            id=health.edge_id, url=health.url.rstrip("/"), registered_at=now, status="alive", misses=0,
            draining=False, committed_sandboxes=0, committed_cpu_m=0, committed_memory=0, committed_disk=0,
        )
        if add_new(s, new):
            e = new
            log.info("edge %s registered at %s", health.edge_id, health.url)
            if health.epoch > 0:  # an edge that was fenced before (this store forgot it): keep its epoch
                e.epoch = health.epoch
        else:  # a concurrent registration of the same edge (a retried call) committed first: update theirs
            e = lock_one(s, sa.select(EdgeRow).where(EdgeRow.id == health.edge_id), lambda: Conflict(
                f"edge {health.edge_id} was registered and removed by concurrent calls: register again",
                edge_id=health.edge_id))
    if e.status == "removed":
        raise EdgeRemoved(f"edge {e.id} was removed from the cluster (dsec edge rm): join it again "
                          "(dsec edge join) to use it", edge_id=e.id)
    status = "fencing" if needs_fence(e, health.epoch) else "alive"
    if status != e.status:
        if status == "fencing":
            log.warning("edge %s is back at epoch %d; its sandboxes were declared lost at epoch %d: "
                        "fencing it before it gets work", e.id, health.epoch, e.epoch)
        elif e.status != "alive":
            log.warning("edge %s is alive again", e.id)
    e.url = health.url.rstrip("/")
    e.health = health.model_dump(mode="json")
    e.last_seen = now
    e.status = status
    e.misses = 0
    s.flush()
    return edge_info(e)


def list_edges_txn(s: Session) -> list[EdgeInfo]:
    return [edge_info(e) for e in s.execute(sa.select(EdgeRow).order_by(EdgeRow.id)).scalars()]


def get_edge(s: Session, edge_id: str, *, lock: bool = False) -> EdgeRow:
    """``lock``: taken for update by the lookup itself (a write follows: an edge removed
    concurrently is a 404 then, not an UPDATE that matches nothing)."""
    if lock:
        return lock_one(s, sa.select(EdgeRow).where(EdgeRow.id == edge_id),
                        lambda: NotFound(f"no edge {edge_id!r}", edge_id=edge_id))
    e = s.get(EdgeRow, edge_id)
    if e is None:
        raise NotFound(f"no edge {edge_id!r}", edge_id=edge_id)
    return e


def drain_txn(s: Session, edge_id: str, draining: bool) -> EdgeInfo:
    e = get_edge(s, edge_id, lock=True)
    e.draining = draining
    s.flush()
    return edge_info(e)


def layers_txn(s: Session) -> tuple[list[LayerInfo], list[str]]:
    """The layers live edges hold, and the registries they load others from."""
    held: dict[str, list[str]] = {}
    registries: set[str] = set()
    for e in s.execute(sa.select(EdgeRow).where(EdgeRow.status == "alive").order_by(EdgeRow.id)).scalars():
        health = e.health or {}
        for ref in health.get("layers", []):
            held.setdefault(str(ref), []).append(e.id)
        if health.get("registry"):
            registries.add(str(health["registry"]))
    return [LayerInfo(ref=r, edges=ids) for r, ids in sorted(held.items())], sorted(registries)


_ED = EDGES
_BUMP_EDGE = bump_statement(_ED, "committed", ("disk",))


def bump_edge(s: Session, edge_id: str, delta: Room) -> None:
    if delta == Room():
        return
    s.connection().execute(
        _BUMP_EDGE,
        {"b_id": edge_id, "b_n": delta.sandboxes, "b_cpu": delta.cpu_m, "b_mem": delta.memory, "b_disk": delta.disk},
    )


_Q_VIEWS = sa.select(
    _ED.c.id, _ED.c.url, _ED.c.status, _ED.c.last_seen, _ED.c.draining, _ED.c.committed_sandboxes, _ED.c.committed_cpu_m,
    _ED.c.committed_memory, _ED.c.committed_disk, sa.cast(_ED.c.health, sa.Text).label("health"),
)


@dataclass(frozen=True, slots=True)
class _Parsed:
    capacity: Room
    reported: Room
    layers: frozenset[str]
    labels: dict[str, str]
    draining: bool
    backends: frozenset[str]
    fetches: bool = False


class HealthCache:
    """Parsed health reports by edge, re-parsed only when the report's text changes.

    Placement runs on every create and looks at every edge; parsing each
    report's JSON and model every time would cost more than the rest of it.
    """

    def __init__(self, *, stale_after_s: float | None = None) -> None:
        self._by_edge: dict[str, tuple[str, _Parsed]] = {}
        self.stale_after_s = stale_after_s
        """An edge whose last report is older than this is not alive for placement, whatever
        the watcher last wrote (``ControlConfig.dead_after_s``; None: the status alone)."""

    def parsed(self, edge_id: str, text: str | None) -> _Parsed | None:
        if text is None:
            return None
        hit = self._by_edge.get(edge_id)
        if hit is not None and hit[0] == text:
            return hit[1]
        h = EdgeHealth.model_validate_json(text)
        cap, reported = room_of_health(h)
        p = _Parsed(cap, reported, layer_set(h.layers), dict(h.labels), h.draining, frozenset(h.backends),
                    bool(h.registry))
        self._by_edge[edge_id] = (text, p)
        return p


def load_views(s: Session, cache: HealthCache) -> list[tuple[EdgeView, str]]:
    """Every edge as placement sees it, with its URL (one query, reports parsed once)."""
    out: list[tuple[EdgeView, str]] = []
    stale = cache.stale_after_s
    fresh_after = time.time() - stale if stale is not None else None
    for r in s.connection().execute(_Q_VIEWS):
        if r.status == "removed":
            continue
        placed = Room(r.committed_sandboxes, r.committed_cpu_m, r.committed_memory, r.committed_disk)
        p = cache.parsed(r.id, r.health)
        alive = r.status == "alive" and (fresh_after is None or r.last_seen is None or r.last_seen >= fresh_after)
        if p is None:
            view = EdgeView(id=r.id, capacity=Room(), committed=placed, alive=False)
        else:
            view = EdgeView(
                id=r.id, capacity=p.capacity, committed=p.reported.max_with(placed), layers=p.layers,
                labels=p.labels, draining=bool(r.draining) or p.draining, alive=alive,
                backends=p.backends, fetches=p.fetches,
            )
        out.append((view, r.url))
    return out
