"""Create leases on the edge: sandboxes made at an SDK's request, under the control plane's
signed say-so, without a control-plane call per sandbox (docs/CONTROL.md, "Create leases").

A lease token (``dsec.http.auth.mint_lease``, scope ``lease``) names the lease, the project,
this edge, how many sandboxes it allows (slots) and the hash of the one create body they are
all made from. The control plane charged the project's quota for every slot when it granted
the lease and holds one reservation per slot, keyed ``<lease id><slot:08x>``; the edge makes
slot *i*'s sandbox with that key as its request id, so:

- a sandbox is made under a slot at most once (the edge de-duplicates by request id), and a
  retried call (same ``request_id``) gets the sandboxes it already made, not new slots;
- the control plane knows which reservation each sandbox fills: the edge reports each one
  (:class:`LeaseReporter`, batched, off the create path), and the watcher's reconcile
  matches them by key anyway if reports are lost;
- at most ``slots`` are made: slots are counted here, a failed create gives its slot back.

Refused (:class:`dsec.errors.LeaseInvalid`): an expired lease, one revoked by the control
plane (``DELETE /v1/leases/{id}``, edge-admin: it answers what the lease made once the
creates in flight have finished), one used up, a body whose hash is not the token's, and a
lease granted for an earlier run of this edge (each run has its own ``boot_id``, reported in
its health and named by the token): the edge forgets its slot counts when it restarts, and
counting again from zero could reuse a slot. Nothing here blocks the event loop; the books are in memory
and forgotten a minute after a lease expires.

The edge never decides what a sandbox made under a slot is worth: when an SDK abandons a part
(the edge died or was cut off with its chunk in flight), the control plane gives the slots the
SDK does not hold up, and whatever this edge made under one — reported late after a partition,
or re-adopted after a restart — is deleted here by the control plane (docs/CONTROL.md, "Create
leases").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from dsec.errors import AuthError, DsecError, Forbidden, InvalidSpec, LeaseInvalid
from dsec.http import auth
from dsec.http.client import EdgeHTTP
from dsec.spec.api import EdgeCreateSandbox, LeaseReportItem, SandboxInfo

log = logging.getLogger("dsec.edge.leases")

FORGET_AFTER_S = 60.0
"""A lease's books are kept this long past its expiry (late retries still get their answers)."""
REVOKED_KEPT_S = 600.0
"""A revoked lease this edge never saw is remembered this long (longer than any lease lives)."""
SLOT_HEX = 8
"""A slot's key is the lease id followed by the slot number in this many hex digits."""

Make = Callable[[EdgeCreateSandbox], Awaitable[SandboxInfo]]
"""Makes one sandbox (the edge service's create: admission, pools, the backend)."""


def slot_key(lease_id: str, slot: int) -> str:
    return f"{lease_id}{slot:0{SLOT_HEX}x}"


@dataclass
class _Lease:
    claims: auth.LeaseClaims
    model: EdgeCreateSandbox
    body: dict[str, Any]
    """The body as sent (its hash is the token's)."""
    next_slot: int = 0
    free: list[int] = field(default_factory=list)
    by_item: dict[str, int] = field(default_factory=dict)
    """SDK item key (``<request_id>/<i>``) -> slot."""
    made: dict[int, SandboxInfo] = field(default_factory=dict)
    inflight: dict[int, asyncio.Future[SandboxInfo]] = field(default_factory=dict)
    revoked: bool = False

    def take(self) -> int:
        if self.free:
            return self.free.pop()
        if self.next_slot >= self.claims.slots:
            raise LeaseInvalid(f"lease {self.claims.lease_id} is used up ({self.claims.slots} sandboxes)",
                               lease_id=self.claims.lease_id, reason="used up")
        self.next_slot += 1
        return self.next_slot - 1


class LeaseBook:
    """The leases this edge has seen. ``report``: called with each sandbox made (the reporter's
    ``add``), or None (nobody to tell: the watcher's reconcile finds them)."""

    def __init__(self, edge_id: str, key: bytes, *, make: Make, report: Callable[[LeaseReportItem], None] | None,
                 boot_id: str | None = None) -> None:
        self.edge_id = edge_id
        self.key = key
        self.make = make
        self.report = report
        self.boot_id = boot_id or secrets.token_hex(8)
        """This run of the edge (health reports it; lease tokens name it)."""
        self._leases: dict[str, _Lease] = {}
        self._revoked: dict[str, float] = {}
        self._claims: dict[str, auth.LeaseClaims] = {}
        """Leases revoked before their first create here -> when."""
        self.made = 0
        self.refused = 0

    # ------------------------------------------------------------- checks --

    def authenticate(self, lease_id: str, token: str | None) -> auth.LeaseClaims:
        """The token's claims if it is a lease token for ``lease_id`` on this edge, not expired."""
        if not token:
            raise AuthError("a lease create needs 'Authorization: Bearer <lease token>' (POST /v1/leases)")
        claims = self._claims.get(token)
        if claims is None or claims.expires_at < time.time():
            claims = auth.verify_lease(self.key, token)  # signature once per token; expiry each time
            if len(self._claims) > 4096:
                self._claims.clear()
            self._claims[token] = claims
        if claims.lease_id != lease_id:
            raise Forbidden(f"this token is for lease {claims.lease_id}, not {lease_id}", lease_id=lease_id)
        if claims.edge_id != self.edge_id:
            raise Forbidden(f"lease {lease_id} is for edge {claims.edge_id}, not {self.edge_id}", lease_id=lease_id)
        return claims

    def _lease(self, lease_id: str, token: str | None, body: dict[str, Any]) -> _Lease:
        claims = self.authenticate(lease_id, token)
        known = self._leases.get(lease_id)
        if known is not None and known.body == body:
            pass  # the body this lease's hash was checked against: equal dicts, no second hash
        elif auth.body_hash(body) != claims.body_hash:
            raise LeaseInvalid(f"lease {lease_id}: the body is not the one the lease was granted for (send the "
                               "grant's body as it is)", lease_id=lease_id, reason="wrong body")
        got = self._leases.get(lease_id)
        if got is None:
            if lease_id in self._revoked:
                raise LeaseInvalid(f"lease {lease_id} was revoked by the control plane", lease_id=lease_id,
                                   reason="revoked")
            if claims.boot_id != self.boot_id:
                raise LeaseInvalid(f"lease {lease_id} was granted for an earlier run of edge {self.edge_id} (it "
                                   "restarted since): ask the control plane for a new one", lease_id=lease_id,
                                   reason="unknown")
            try:
                model = EdgeCreateSandbox.model_validate({**body, "project": claims.project})
            except ValueError as exc:  # the control plane made it: a bug, but a client error here
                raise InvalidSpec(f"lease {lease_id}: its body is not a create: {exc}", field="body") from None
            self._prune()
            got = self._leases[lease_id] = _Lease(claims, model, body)
        if got.revoked:
            raise LeaseInvalid(f"lease {lease_id} was revoked by the control plane", lease_id=lease_id,
                               reason="revoked")
        return got

    def _prune(self) -> None:
        now = time.time()
        for lid in [lid for lid, at in self._revoked.items() if at + REVOKED_KEPT_S < now]:
            del self._revoked[lid]
        for lid in [lid for lid, le in self._leases.items()
                    if le.claims.expires_at + FORGET_AFTER_S < now and not le.inflight]:
            del self._leases[lid]

    # ------------------------------------------------------------- create --

    async def create(self, lease_id: str, token: str | None, body: dict[str, Any], count: int,
                     request_id: str) -> list[SandboxInfo | DsecError]:
        """``count`` sandboxes under the lease, item ``i`` keyed ``<request_id>/<i>``; per item
        the sandbox (with its data-path token) or the error that stopped it."""
        le = self._lease(lease_id, token, body)
        slots: list[int | DsecError] = []
        for i in range(count):
            item = f"{request_id}/{i}"
            slot = le.by_item.get(item)
            if slot is None:
                try:
                    slot = le.take()
                except LeaseInvalid as exc:
                    slots.append(exc)
                    continue
                le.by_item[item] = slot
            slots.append(slot)
        return list(await asyncio.gather(*(
            self._one(le, s, f"{request_id}/{i}") if isinstance(s, int) else _done(s) for i, s in enumerate(slots))))

    async def _one(self, le: _Lease, slot: int, item: str) -> SandboxInfo | DsecError:
        done = le.made.get(slot)
        if done is not None:
            return done
        fut = le.inflight.get(slot)
        if fut is not None:  # the same item asked twice at once: one create
            try:
                return await asyncio.shield(fut)
            except DsecError as exc:
                return exc
        key = slot_key(le.claims.lease_id, slot)
        fut = asyncio.get_running_loop().create_future()
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())
        le.inflight[slot] = fut
        try:
            info = await self.make(le.model.model_copy(update={"request_id": key}))
        except DsecError as exc:
            le.free.append(slot)  # not made: another create may use the slot
            le.by_item.pop(item, None)
            self.refused += 1
            fut.set_exception(exc)
            return exc
        except BaseException as exc:
            le.free.append(slot)
            le.by_item.pop(item, None)
            if isinstance(exc, Exception):
                fut.set_exception(exc)
            else:
                fut.cancel()
            raise
        finally:
            le.inflight.pop(slot, None)
        le.made[slot] = info
        fut.set_result(info)
        self.made += 1
        if self.report is not None:
            self.report(_item(key, info))
        return info

    # ------------------------------------------------------------- revoke --

    async def revoke(self, lease_id: str) -> list[LeaseReportItem]:
        """No more creates under the lease; answers what it made once the creates in flight
        are done (an unknown lease made nothing here). Idempotent."""
        le = self._leases.get(lease_id)
        if le is None:
            self._revoked[lease_id] = time.time()
            self._prune()
            return []
        le.revoked = True
        if le.inflight:
            await asyncio.gather(*(asyncio.shield(f) for f in list(le.inflight.values())), return_exceptions=True)
        return [_item(slot_key(lease_id, s), i) for s, i in sorted(le.made.items())]


def _item(key: str, info: SandboxInfo) -> LeaseReportItem:
    return LeaseReportItem(key=key, id=info.id, state=info.state, created_at=info.created_at,
                           expires_at=info.expires_at, reason=info.reason)


async def _done(exc: DsecError) -> DsecError:
    return exc


class LeaseReporter:
    """Tells the control plane about sandboxes made under leases, in batches, off the create
    path: ``add`` queues, a background task posts ``POST /v1/edges/{id}/leases/report`` every
    ``interval_s`` or at :attr:`batch` items, to the first control-plane URL that answers.
    A control plane that is down delays reports (kept, up to ``max_queue``: past it the oldest
    are dropped with a warning, and the watcher's reconcile records those by their keys)."""

    batch = 512

    def __init__(self, urls: Sequence[str], *, edge_id: str, cluster_key: bytes, interval_s: float = 0.05,
                 max_queue: int = 200_000) -> None:
        self.urls = [u.rstrip("/") for u in urls]
        self.edge_id = edge_id
        self.key = cluster_key
        self.interval_s = interval_s
        self.max_queue = max_queue
        self._queue: list[LeaseReportItem] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._current = 0
        self._pools: dict[str, EdgeHTTP] = {}
        self._token: tuple[str, float] | None = None
        self.sent = 0
        self.failures = 0

    def add(self, item: LeaseReportItem) -> None:
        self._queue.append(item)
        if len(self._queue) > self.max_queue:
            dropped = len(self._queue) - self.max_queue
            del self._queue[:dropped]
            log.warning("lease reports: %d dropped (the control plane is unreachable; reconcile finds them)", dropped)
        if len(self._queue) >= self.batch:
            self._wake.set()

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="dsec-edge-lease-reports")

    async def stop(self) -> None:
        """Send what is queued (briefly), then stop."""
        if self._task is None:
            return
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._task = None
        if self._queue:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(2.0):
                    await self._send()
        for pool in self._pools.values():
            await pool.aclose()

    def _headers(self) -> dict[str, str]:
        now = time.time()
        if self._token is None or self._token[1] - now < 60.0:
            self._token = auth.mint(self.key, sandbox_id=f"edge:{self.edge_id}", project="", ttl_s=300.0,
                                    scope="edge-admin")
        return {"authorization": f"Bearer {self._token[0]}", "content-type": "application/json"}

    async def _post(self, url: str, body: bytes) -> None:
        """One report: the lean keep-alive client for ``http://`` (a report goes out every few
        creates at full rate: httpx would cost the edge's loop ~1 ms each), httpx otherwise."""
        path = f"/v1/edges/{self.edge_id}/leases/report"
        if url.startswith("http://"):
            pool = self._pools.get(url)
            if pool is None:
                pool = self._pools[url] = EdgeHTTP(url, size=2, timeout=10.0, connect_timeout=2.0)
            ans = await pool.request("POST", path, headers=self._headers(), body=body)  # the control plane de-duplicates
            if ans.status_code >= 300:
                raise DsecError(f"lease report answered HTTP {ans.status_code}: {ans.text[:200]}")
            return
        import httpx

        async with httpx.AsyncClient(timeout=10.0) as http:
            resp = await http.post(f"{url}{path}", content=body, headers=self._headers())
            resp.raise_for_status()

    async def _send(self) -> None:
        from dsec.spec.api import LeaseReport

        while self._queue:
            chunk = self._queue[: self.batch]
            body = LeaseReport(items=chunk).model_dump_json().encode()
            url = self.urls[self._current]
            try:
                await self._post(url, body)
            except Exception as exc:
                if self.failures == 0:
                    log.warning("lease reports to %s failed: %r (will keep trying)", url, exc)
                self.failures += 1
                self._current = (self._current + 1) % len(self.urls)
                return
            if self.failures:
                log.warning("lease reports delivered again (%s)", url)
            self.failures = 0
            del self._queue[: len(chunk)]
            self.sent += len(chunk)

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.interval_s if not self.failures else 1.0):
                    await self._wake.wait()
            self._wake.clear()
            if self._queue:
                await self._send()
