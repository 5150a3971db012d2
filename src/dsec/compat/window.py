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


class Window:
    def __init__(self, ceiling: int, *, max_waiting: int = 4096, probe_s: float = 0.5) -> None:
        if ceiling < 1:
            raise ValueError("ceiling must be at least 1")
        self.ceiling = ceiling
        self.cap = float(ceiling)
        self.inflight = 0
        self.max_waiting = max_waiting
        self.probe_s = probe_s
        self._queue: deque[_Waiter] = deque()
        self.refusals = 0
        self.waits = 0
        self.timeouts = 0

    @property
    def waiting(self) -> int:
        return len(self._queue)

    async def acquire(self, deadline: float, *, again: bool = False) -> None:
        """Take a slot, waiting (FIFO) until one is free or ``deadline`` (loop time) passes.
        ``again``: a request the cluster just refused goes back to the head of the queue."""
        loop = asyncio.get_running_loop()
        if not self._queue and self.inflight < int(self.cap):
            self.inflight += 1
            return
        if len(self._queue) >= self.max_waiting:
            self.timeouts += 1
            raise WindowTimeout(f"{len(self._queue)} requests are waiting already")
        self.waits += 1
        w = _Waiter(loop.create_future())
        if again:
            self._queue.appendleft(w)
        else:
            self._queue.append(w)
        try:
            while True:
                if self._queue[0] is w and self.inflight < int(self.cap):
                    self.inflight += 1
                    return
                remaining = deadline - loop.time()
                if remaining <= 0:
                    self.timeouts += 1
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
            self._queue.remove(w)
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
            fut = self._queue[0].fut
            if not fut.done():
                fut.set_result(None)

    def stats(self) -> dict[str, float | int]:
        return {"cap": round(self.cap, 2), "inflight": self.inflight, "waiting": len(self._queue),
                "refusals": self.refusals, "waits": self.waits, "timeouts": self.timeouts}
