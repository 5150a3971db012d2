"""How many sandboxes an adapter asks for at once, learned from the refusals it gets.

An adapter turns each request of a foreign client into a sandbox (create, run, delete). A
burst (verl sends one request per test case, 64 or more at once) asks for more sandboxes
than the cluster admits; the control plane then answers ``Backpressure`` (429). Polling
creates until one fits costs a placement per try and serves nobody in order, so the
adapter keeps a **window**: at most ``cap`` sandboxes in flight, requests beyond it wait in
FIFO order for one to end. A refusal shrinks the window to what is running (those fit); each
admitted create widens it by ``1/cap`` (one per round, additive increase), up to
``ceiling``; the head of the queue also widens it by one when nothing has ended for
``probe_s`` (room may have come from elsewhere). Waiting has a deadline: past it the caller
gets :class:`WindowTimeout` and answers its client the way that client retries.

**A retried request keeps its place.** A waiter that gives up with a ``key`` (the adapter's:
the client's token and the request's body) leaves a *place* in the queue for ``hold_s``: the
queue does not move past it, and the first request with the same key that comes back in
that time takes it. Clients that retry a refusal after a short sleep (verl: 1 s, then 2 s)
would otherwise come back behind every request that arrived meanwhile and, when each
request holds its sandbox for its whole timeout, be refused again and again until they give
up. A place nobody comes back for lapses and the queue moves on.

Never blocks the event loop; single event loop only (no locks: nothing awaits between a
check and its update).
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass


class WindowTimeout(TimeoutError):
    """No room within the deadline (or too many requests waiting already)."""


@dataclass(slots=True)
class _Waiter:
    fut: asyncio.Future[None]
    key: str | None = None
    held_until: float = 0.0
    """Past 0: a place kept for a request that gave up (its key's), until then (loop time)."""


class Window:
    def __init__(self, ceiling: int, *, max_waiting: int = 4096, probe_s: float = 0.5, hold_s: float = 4.0) -> None:
        if ceiling < 1:
            raise ValueError("ceiling must be at least 1")
        self.ceiling = ceiling
        self.cap = float(ceiling)
        self.inflight = 0
        self.max_waiting = max_waiting
        self.probe_s = probe_s
        self.hold_s = hold_s
        self._queue: deque[_Waiter] = deque()
        self.refusals = 0
        self.waits = 0
        self.timeouts = 0
        self.kept = 0
        """Places taken back by a request that came back for its own."""
        self.lapsed = 0
        self._held = 0
        """Places kept in the queue now (the scans below run only when there are some)."""

    @property
    def waiting(self) -> int:
        return len(self._queue)

    async def acquire(self, deadline: float, *, again: bool = False, key: str | None = None) -> None:
        """Take a slot, waiting (FIFO) until one is free or ``deadline`` (loop time) passes.
        ``again``: a request the cluster just refused goes back to the head of the queue.
        ``key``: a request that gives up leaves its place to the next one with this key
        (module docstring); one that comes with the key of a kept place takes it."""
        loop = asyncio.get_running_loop()
        self._lapse(loop.time())
        w = self._kept(key) if key is not None and not again and self._held else None
        if w is None:
            if not self._queue and self.inflight < int(self.cap):
                self.inflight += 1
                return
            if len(self._queue) >= self.max_waiting:
                self.timeouts += 1
                raise WindowTimeout(f"{len(self._queue)} requests are waiting already")
            w = _Waiter(loop.create_future())
            if again:
                self._queue.appendleft(w)
            else:
                self._queue.append(w)
        self.waits += 1
        keep = False
        try:
            while True:
                if self._queue[0] is w and self.inflight < int(self.cap):
                    self.inflight += 1
                    return
                remaining = deadline - loop.time()
                if remaining <= 0:
                    self.timeouts += 1
                    keep = key is not None
                    raise WindowTimeout(f"no room for a sandbox within the deadline ({self.inflight} in flight, "
                                        f"{len(self._queue)} waiting)")
                try:
                    async with asyncio.timeout(min(remaining, self.probe_s)):
                        await w.fut
                except TimeoutError:
                    if self._queue[0] is w and self.inflight >= int(self.cap):
                        self.cap = min(float(self.ceiling), self.cap + 1)  # probe for room freed elsewhere
                w.fut = loop.create_future()
        finally:
            if keep:
                w.key, w.held_until = key, loop.time() + self.hold_s
                self._held += 1
                loop.call_later(self.hold_s, self._lapse_and_kick)
            else:
                self._queue.remove(w)
            self._kick()

    def _kept(self, key: str) -> _Waiter | None:
        """The oldest place kept for ``key``, now taken back by its request."""
        for w in self._queue:
            if w.held_until and w.key == key:
                w.held_until, w.key = 0.0, None
                self._held -= 1
                w.fut = asyncio.get_running_loop().create_future()
                self.kept += 1
                return w
        return None

    def _lapse(self, now: float) -> None:
        """Drop kept places nobody came back for."""
        if not self._held:
            return
        gone = [w for w in self._queue if w.held_until and w.held_until <= now]
        for w in gone:
            self._queue.remove(w)
        self._held -= len(gone)
        self.lapsed += len(gone)

    def _lapse_and_kick(self) -> None:
        self._lapse(asyncio.get_running_loop().time())
        self._kick()

    def release(self) -> None:
        """A sandbox taken with :meth:`acquire` is gone (or was never made)."""
        self.inflight -= 1
        self._kick()

    def refused(self) -> None:
        """The cluster refused a create made with a slot this caller still holds: what runs
        besides it fits, more does not."""
        self.refusals += 1
        self.cap = max(1.0, float(self.inflight - 1))

    def admitted(self) -> None:
        self.cap = min(float(self.ceiling), self.cap + 1 / self.cap)
        self._kick()

    def _kick(self) -> None:
        if self._queue and self.inflight < int(self.cap):
            fut = self._queue[0].fut  # a kept place at the head holds the queue until its request is back
            if not fut.done():
                fut.set_result(None)

    def stats(self) -> dict[str, float | int]:
        return {"cap": round(self.cap, 2), "inflight": self.inflight, "waiting": len(self._queue),
                "refusals": self.refusals, "waits": self.waits, "timeouts": self.timeouts, "kept": self.kept,
                "lapsed": self.lapsed}
