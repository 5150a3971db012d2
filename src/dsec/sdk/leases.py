"""Create leases in the SDK: one control-plane call for a burst, then the edges directly.

``await client.lease(spec, n)`` asks the control plane for the right to create ``n``
sandboxes of ``spec`` (``POST /v1/leases``): it charges the quota once, splits the burst
over edges with room and answers one signed token per edge. :meth:`AsyncLease.create` then
sends the creates straight to those edges, a chunk of sandboxes per request, and
:meth:`AsyncLease.release` hands back what was not used. :meth:`AsyncClient.create_many`
does all of that by itself (docs/CONTROL.md, "Create leases"): a burst of N costs the
control plane two calls instead of N.

What an edge cannot make (its admission is full, it is unreachable, the lease ended) is
reported per item as the error that stopped it; ``create_many`` creates those through the
control plane instead, which places them elsewhere. A chunk whose answer was lost is sent
again with the same request id: the edge makes each item once.

A chunk that still has no answer (the edge died or is cut off with it in flight) may have been
made there, or may be made later: creating its items elsewhere could make them twice. So the
part is **abandoned** (``POST /v1/leases/{grant}/abandon``): no more chunks go to that edge,
and once every chunk in flight there has ended the SDK tells the control plane which slots it
holds (the keys of the sandboxes it got from that part); every other slot is given up and
whatever the edge made or makes under one is destroyed (docs/CONTROL.md, "Create leases").
Only after that answer are the chunk's items reported as :class:`EdgeGone` with
``abandoned=True``, which ``create_many`` creates through the control plane. If the abandon
cannot be made (no replica answers), they stay ``maybe_made`` and are not created again.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx

from dsec.errors import Backpressure, DsecError, LeaseInvalid, error_from_wire
from dsec.sdk._http import raise_for_error
from dsec.sdk.outcomes import CreateOutcome
from dsec.spec.api import AbandonLease, BatchResult, LeaseAbandoned, LeaseGrant, LeaseReleased

if TYPE_CHECKING:
    from dsec.sdk.client import AsyncClient, AsyncSandbox

CHUNK = 16
"""Sandboxes per request to an edge (the edge makes a chunk's sandboxes concurrently)."""
RESEND = 3
"""Times a chunk whose answer was lost is sent again (same request id: nothing made twice)."""


ABANDON_FOR_S = 60.0
"""How long an abandon is retried (replicas failing over, a store restarting) before its items
are given up as ``maybe_made``."""


class EdgeGone(DsecError):
    """Not on the wire: an edge did not take a chunk (nothing was sent, or the answer never came
    after :data:`RESEND` tries). ``maybe_made``: the edge may have made them (the part could not
    be abandoned); ``abandoned``: the control plane gave the part's other slots up, so nothing
    of this chunk will live on that edge."""


@dataclass
class _PartState:
    """The SDK's side of one edge part while it is used: chunks in flight, the slots it got."""

    inflight: int = 0
    gone: bool = False
    """A chunk found the edge gone: no more chunks are sent there; the part is abandoned."""
    held: set[str] = field(default_factory=set)
    """Slot keys of the sandboxes this SDK got from the part."""
    unnamed: bool = False
    """An answer without its slot key (an old edge): the part cannot be abandoned safely."""
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    abandon: asyncio.Future[LeaseAbandoned | None] | None = None


class AsyncLease:
    """A grant of create leases: up to :attr:`slots` sandboxes of one spec, made directly on
    edges until :attr:`expires_at`. ``async with`` releases it; releasing twice is fine."""

    def __init__(self, client: AsyncClient, grant: LeaseGrant) -> None:
        self._client = client
        self.grant = grant
        self._left = {p.lease_id: p.slots for p in grant.leases}
        self._released: LeaseReleased | None = None
        self._parts: dict[str, _PartState] = {}
        self._calls = 0
        self._seq = 0
        """Items sent so far (each chunk's request id names its first: a resend makes nothing twice)."""

    @property
    def id(self) -> str:
        return self.grant.id

    @property
    def slots(self) -> int:
        """Sandboxes granted (``short`` more were asked for; ``error`` says why not)."""
        return sum(p.slots for p in self.grant.leases)

    @property
    def left(self) -> int:
        """Slots not handed out yet."""
        return sum(self._left.values())

    @property
    def short(self) -> int:
        return self.grant.short

    @property
    def error(self) -> DsecError | None:
        return None if self.grant.error is None else error_from_wire(dict(self.grant.error))

    @property
    def expires_at(self) -> float:
        return self.grant.expires_at

    def __repr__(self) -> str:
        return f"<AsyncLease {self.id}: {self.slots} slots on {len(self.grant.leases)} edge(s)>"

    async def __aenter__(self) -> AsyncLease:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.release()

    async def create(self, n: int | None = None, *, concurrency: int = 64, first_index: int = 0,
                     labels: dict[str, str] | None = None) -> AsyncIterator[CreateOutcome]:
        """Make ``n`` sandboxes (default: every slot left), yielding each outcome as its chunk
        answers (indices from ``first_index``). ``concurrency``: sandboxes in flight at once.
        ``labels`` must be None: a lease's labels are fixed when it is granted."""

        if labels is not None:
            raise DsecError("a lease's labels are fixed at the grant: pass them to client.lease()")
        want = sum(self._left.values()) if n is None else n
        plan: list[tuple[Any, int, int]] = []  # (part, index of the first item, count)
        idx = first_index
        while want > 0 and any(self._left[p.lease_id] > 0 for p in self.grant.leases):
            for part in self.grant.leases:  # a chunk per part in turn: every edge works from the start
                if want > 0 and self._left[part.lease_id] > 0:
                    c = min(CHUNK, want, self._left[part.lease_id])
                    self._left[part.lease_id] -= c
                    plan.append((part, idx, c))
                    idx += c
                    want -= c
        sem = asyncio.Semaphore(max(1, concurrency // CHUNK))
        queue: asyncio.Queue[list[CreateOutcome]] = asyncio.Queue()

        async def chunk(part: Any, first: int, count: int) -> None:
            async with sem:
                await queue.put(await self._chunk(part, first, count))

        tasks = [asyncio.ensure_future(chunk(*p)) for p in plan]
        try:
            for _ in plan:
                for o in await queue.get():
                    yield o
            if want > 0:  # asked for more than the grant holds
                for i in range(idx, idx + want):
                    yield CreateOutcome(i, None, LeaseInvalid(f"lease {self.id} has no slot left", reason="used up",
                                                              lease_id=self.id))
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def take(self) -> CreateOutcome:
        """One sandbox on the next slot left (:class:`LeaseInvalid` ``used up`` when none is)."""

        part = next((p for p in self.grant.leases if self._left[p.lease_id] > 0 and not self._state(p).gone), None)
        if part is None:
            return CreateOutcome(0, None, LeaseInvalid(f"lease {self.id} has no slot left", reason="used up",
                                                       lease_id=self.id))
        self._left[part.lease_id] -= 1
        return (await self._chunk(part, 0, 1))[0]

    def _state(self, part: Any) -> _PartState:
        st = self._parts.get(part.lease_id)
        if st is None:
            st = self._parts[part.lease_id] = _PartState()
            st.idle.set()
        return st

    async def _chunk(self, part: Any, first: int, count: int) -> list[CreateOutcome]:
        """One chunk on the part's edge. An edge gone with it (or with another chunk) in flight:
        the part is abandoned before these outcomes are answered (module docstring)."""

        st = self._state(part)
        if st.gone:  # another chunk found the edge gone: nothing of this one is sent there
            err = EdgeGone(f"edge {part.edge_id} is gone: lease part {part.lease_id} is given up", edge_id=part.edge_id,
                           maybe_made=False)
            return [CreateOutcome(first + i, None, err) for i in range(count)]
        st.inflight += 1
        st.idle.clear()
        try:
            got = await self._send(part, first, count)
            for o in got:
                if o.sandbox is not None:
                    if o.sandbox.info.request_id:
                        st.held.add(o.sandbox.info.request_id)
                    else:
                        st.unnamed = True
        finally:
            st.inflight -= 1
            if st.inflight == 0:
                st.idle.set()
        if not any(isinstance(o.error, EdgeGone) for o in got):
            return got
        st.gone = True
        done = await self._abandon(part, st)
        out = []
        for o in got:
            if isinstance(o.error, EdgeGone):
                maybe = bool(o.error.fields.get("maybe_made")) and done is None
                o = CreateOutcome(o.index, None, EdgeGone(
                    str(o.error) + (f"; the part was abandoned ({done.kept} slot(s) kept)" if done is not None else ""),
                    edge_id=part.edge_id, maybe_made=maybe, abandoned=done is not None))
            out.append(o)
        return out

    async def _abandon(self, part: Any, st: _PartState) -> LeaseAbandoned | None:
        """Abandon the part (once, whoever asks first): when no chunk is in flight there any more,
        tell the control plane which slots this SDK holds. None: it could not be done."""
        if st.abandon is None:
            st.abandon = asyncio.ensure_future(self._abandon_when_idle(part, st))
        return await asyncio.shield(st.abandon)

    async def _abandon_when_idle(self, part: Any, st: _PartState) -> LeaseAbandoned | None:
        await st.idle.wait()
        if st.unnamed:
            return None
        body = AbandonLease(lease_id=part.lease_id, held=sorted(st.held),
                            request_id=f"{self.id[:32]}-{part.lease_id}-abandon").model_dump_json()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + ABANDON_FOR_S
        attempt = 0
        while True:
            try:  # the request id makes a resend (another replica, a lost answer) the same decision
                resp = await self._client._call("POST", f"/v1/leases/{self.id}/abandon", content=body,
                                                headers={"content-type": "application/json"}, idempotent=True)
                return LeaseAbandoned.model_validate_json(resp.content)
            except (Backpressure, httpx.HTTPError, DsecError) as exc:
                if isinstance(exc, DsecError) and not isinstance(exc, Backpressure) and \
                        int(exc.fields.get("status") or 0) < 500:
                    return None  # refused (an older control plane, the part abandoned by another client...)
                attempt += 1  # 429/503/500, no answer: again, with the same request id
                wait = min(5.0, float(getattr(exc, "retry_after", 0.5) or 0.5) * attempt) * random.uniform(0.5, 1.5)
                if loop.time() + wait > deadline:
                    return None
                await asyncio.sleep(wait)

    async def _send(self, part: Any, first: int, count: int) -> list[CreateOutcome]:
        self._calls += 1
        rid = f"{self.id[:32]}-{part.lease_id}-{self._seq}"
        self._seq += count
        body = {"body": self.grant.body, "count": count, "request_id": rid}
        http = self._client._edge(part.edge_url)
        last: Exception | None = None
        maybe = False
        for _ in range(RESEND):
            try:
                resp = await http.request("POST", f"/v1/leases/{part.lease_id}/sandboxes", key=rid, json=body,
                                          headers={"authorization": f"Bearer {part.token}"}, idempotent=True)
                raise_for_error(resp)
                items = BatchResult.model_validate_json(resp.content).items
                return [CreateOutcome(first + i, self._client._sandbox_of(it.sandbox), None)
                        if it.sandbox is not None else
                        CreateOutcome(first + i, None, error_from_wire(dict(it.error or {})))
                        for i, it in enumerate(items)]
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                last = exc
                break  # nothing was sent: the edge made nothing
            except httpx.HTTPError as exc:
                last, maybe = exc, True
                await asyncio.sleep(0.1)
            except DsecError as exc:  # the whole chunk refused (lease ended, token...)
                if maybe:  # after a try that may have made it (the edge restarted since, the lease
                    last = exc  # expired): what the edge made is unknown, not refused
                    break
                return [CreateOutcome(first + i, None, exc) for i in range(count)]
        err = EdgeGone(f"edge {part.edge_id} did not take {count} creates of lease {part.lease_id}: {last!r}",
                       edge_id=part.edge_id, maybe_made=maybe)
        return [CreateOutcome(first + i, None, err) for i in range(count)]

    async def release(self) -> LeaseReleased:
        """Hand back what was not used (its quota returns at once). Idempotent."""
        if self._released is None:
            resp = await self._client._call("DELETE", f"/v1/leases/{self.id}")
            self._released = LeaseReleased.model_validate_json(resp.content)
        return self._released


def retry_elsewhere(err: DsecError | None) -> bool:
    """An item a lease could not make that the control plane's own path may still make:
    the edge was full, or gone having made nothing of it or with its part abandoned (nothing it
    made there will live), or the lease ended."""
    if isinstance(err, EdgeGone):
        return not err.fields.get("maybe_made", False)
    return isinstance(err, Backpressure | LeaseInvalid)


async def grant(client: AsyncClient, body: str) -> AsyncLease:
    """``POST /v1/leases`` with this JSON body."""
    resp = await client._call("POST", "/v1/leases", content=body, headers={"content-type": "application/json"})
    return AsyncLease(client, LeaseGrant.model_validate_json(resp.content))



AHEAD_SLOTS = 8
"""Slots of a lease held ahead of repeated creates (``AsyncClient(lease_ahead=...)``)."""
AHEAD_TTL_S = 30.0
AHEAD_IDLE_S = 10.0
"""A lease held ahead that no create used for this long is handed back."""
AHEAD_MARGIN_S = 3.0
"""A lease this close to its expiry is not used any more (its slots go back)."""
AHEAD_COOLDOWN_S = 5.0


AHEAD_MAX_SLOTS = 512
"""A lease ahead grows (doubling) while each one is used up within :data:`AHEAD_FAST_S` of its
grant: many creates in flight at once get leases as large as their burst."""
AHEAD_FAST_S = 2.0


class _Ahead:
    __slots__ = ("calls", "cooldown_until", "granted_at", "granting", "last", "lease", "size")

    def __init__(self, size: int) -> None:
        self.lease: AsyncLease | None = None
        self.granting: asyncio.Task[None] | None = None
        self.last = 0.0
        self.calls = 0
        self.cooldown_until = 0.0
        self.size = size
        self.granted_at = 0.0


class LeasesAhead:
    """Creates repeated with one body take a slot of a small lease held ahead: the sandbox is
    made by the edge directly, the control plane is off the create's path (docs/CONTROL.md,
    "Create leases"). The second create of a body asks for the lease (in the background: that
    create, and any while the grant is under way, take the control plane's path); the lease is
    renewed when it runs out or nears its expiry (twice as large when it ran out fast: independent
    creates in flight at once soon share leases as large as their burst, up to
    :data:`AHEAD_MAX_SLOTS`) and handed back after :data:`AHEAD_IDLE_S`
    without a create and when the client closes. The control plane grants a lease ahead only
    while it takes at most half of the quota left (``CreateLease.ahead``), and takes it back
    when a create of the project is refused for quota: holding one never makes another create
    fail."""

    def __init__(self, client: AsyncClient, slots: int) -> None:
        self._client = client
        self.slots = slots
        self._by_key: dict[str, _Ahead] = {}
        self._background: set[asyncio.Task[Any]] = set()
        self.hits = 0
        self.misses = 0

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _drop(self, st: _Ahead) -> None:
        lease, st.lease = st.lease, None
        if lease is not None:
            self._spawn(_quietly(lease.release()))

    async def create(self, key: str, grant_body: dict[str, Any]) -> AsyncSandbox | None:
        """A sandbox from the lease held for ``key`` (the create body without its request id),
        or None: take the control plane's path (a lease is being asked for meanwhile)."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        self._expire_idle(now)
        st = self._by_key.get(key)
        if st is None:
            st = self._by_key[key] = _Ahead(self.slots)
        st.calls += 1
        st.last = now
        lease = st.lease
        if lease is not None and lease.left > 0 and lease.expires_at - time.time() > AHEAD_MARGIN_S:
            o = await lease.take()
            if o.sandbox is not None:
                self.hits += 1
                if lease.left == 0:
                    fast = now - st.granted_at < AHEAD_FAST_S
                    st.size = min(AHEAD_MAX_SLOTS, st.size * 2) if fast else max(self.slots, st.size // 2)
                    self._drop(st)
                    self._ask(st, grant_body, now)
                return o.sandbox
            if not retry_elsewhere(o.error):
                assert o.error is not None
                raise o.error
            st.cooldown_until = now + AHEAD_COOLDOWN_S  # the edge is full or gone: the control plane places it
        if st.lease is not None:
            self._drop(st)
        self._ask(st, grant_body, now)
        self.misses += 1
        return None

    def _ask(self, st: _Ahead, grant_body: dict[str, Any], now: float) -> None:
        if st.granting is not None or st.calls < 2 or now < st.cooldown_until or self.slots < 1:
            return

        async def ask() -> None:
            try:
                lease = await grant(self._client, json.dumps({**grant_body, "count": st.size, "ahead": True,
                                                              "lease_ttl_s": AHEAD_TTL_S}))
            except (DsecError, httpx.HTTPError):
                st.cooldown_until = asyncio.get_running_loop().time() + AHEAD_COOLDOWN_S
                st.size = self.slots  # too big for the quota or the room left, perhaps
                return
            finally:
                st.granting = None
            if lease.slots == 0:
                st.cooldown_until = asyncio.get_running_loop().time() + AHEAD_COOLDOWN_S
                return
            if st.lease is not None:
                self._drop(st)
            st.lease = lease
            st.granted_at = asyncio.get_running_loop().time()

        st.granting = asyncio.ensure_future(ask())
        self._background.add(st.granting)
        st.granting.add_done_callback(self._background.discard)

    def _expire_idle(self, now: float) -> None:
        for key, st in list(self._by_key.items()):
            if now - st.last > AHEAD_IDLE_S:
                self._drop(st)
                if st.granting is None:
                    del self._by_key[key]

    async def close(self) -> None:
        """Hand every lease back (their quota returns at once)."""
        for st in self._by_key.values():
            self._drop(st)
        self._by_key.clear()
        if self._background:
            await asyncio.wait(list(self._background), timeout=5.0)


async def _quietly(coro: Any) -> None:
    with contextlib.suppress(DsecError, httpx.HTTPError):
        await coro
