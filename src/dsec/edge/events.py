"""Per-sandbox event logs of the edge, and tombstones of destroyed sandboxes.

The runtime logs what it sees (state moves, exec started/ended with exit
code, OOM and pids-limit hits, adoption); the edge adds what it decides
(created from a pool or cold, sessions, TTL/idle expiry, eviction,
destroyed and why). ``GET /v1/sandboxes/{id}/events`` merges both by time.

When a sandbox is destroyed its merged log becomes a tombstone, kept for the
last ``limit`` sandboxes, so "why is my sandbox gone?" has an answer after
the fact (a TTL expiry is never silent). Logs live in memory: an edge
restart starts each re-adopted sandbox's log afresh with an ``adopted`` event.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

MAX_EVENTS = 1000


@dataclass(slots=True)
class Tombstone:
    sandbox_id: str
    reason: str
    destroyed_at: float
    created_at: float
    events: list[dict[str, Any]]
    info: dict[str, Any] = field(default_factory=dict)
    """What SandboxInfo said about it while it lived (labels, task, project, ...)."""


class EventLog:
    def __init__(self, *, tombstones: int = 4096) -> None:
        self._logs: dict[str, list[dict[str, Any]]] = {}
        self._tombs: OrderedDict[str, Tombstone] = OrderedDict()
        self._limit = tombstones

    def add(self, sandbox_id: str, event: str, **data: Any) -> dict[str, Any]:
        item = {"t": time.time(), "event": event, "origin": "edge", **data}
        log = self._logs.setdefault(sandbox_id, [])
        log.append(item)
        if len(log) > MAX_EVENTS:
            del log[: MAX_EVENTS // 10]
        return item

    def merged(self, sandbox_id: str, runtime_events: list[dict[str, Any]]) -> list[dict[str, Any]]:
        rt = [{**e, "origin": "runtime"} for e in runtime_events]
        return sorted(rt + self._logs.get(sandbox_id, []), key=lambda e: float(e.get("t", 0.0)))

    def forget(self, sandbox_id: str) -> None:
        self._logs.pop(sandbox_id, None)

    def bury(self, tomb: Tombstone) -> None:
        self._logs.pop(tomb.sandbox_id, None)
        if self._limit <= 0:
            return
        self._tombs[tomb.sandbox_id] = tomb
        self._tombs.move_to_end(tomb.sandbox_id)
        while len(self._tombs) > self._limit:
            self._tombs.popitem(last=False)

    def tombstone(self, sandbox_id: str) -> Tombstone | None:
        return self._tombs.get(sandbox_id)
