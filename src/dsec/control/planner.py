"""Optimistic launch: start a create's edge call before its reservation commits.

A cold create is mostly the edge making the sandbox (~2-3 ms); the
reservation transaction (quota checks, placement, the row and its counters,
~1 ms) used to run before it, serially. When this replica's recent view says
the create will surely fit, the edge call starts at once and the
transaction runs beside it. **The transaction still decides**: it checks the
quotas against the store, records the reservation on the planned edge and
works out what the sandbox must be (a task's stages). If it refuses, or
disagrees with the plan, the optimistic sandbox is deleted and the create
answers the refusal or goes down the careful path. So the cost of a wrong
guess is a sandbox made and dropped, never a quota overrun that stays.

What "surely fits" means, per replica, from the answers of its own
transactions (every reserve reports what it saw):

- the project's free quota (and the task's, when it has one) at that
  transaction, less every optimistic create this replica started since that
  has not yet been recorded, still holds this create;
- no refusal for that project (or task) was seen since;
- the task, if any, declared no stages (the edge body would lack them), or
  the spec declares its own;
- its request_id is not one this replica saw lately (a retried create is
  answered from its first call's row: an optimistic call would make a
  sandbox only to drop it);
- placement runs on the last edge views a transaction loaded, with this
  replica's unrecorded optimistic creates added to each edge's load;
- the last transaction's placement was an ordinary one (the scheduler's
  ``plain``: the primary pool below the burst threshold, no task minimum held
  back, nothing preempted); burst edges are never in the views it plans on.

Anything older than :data:`MAX_AGE_S` is not trusted: the create takes the
careful path and refreshes it. Pure bookkeeping, no I/O; called on the event
loop only.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dsec.control.iam import Amount
from dsec.control.placement import Demand, EdgeView, Room, normalize_ref, place

MAX_AGE_S = 1.0
"""How long a transaction's view of quotas and edges is trusted for optimistic launches."""
RECENT_REQUESTS = 65536
"""How many recent request_ids a replica remembers (a retry of one takes the careful path)."""

TaskLimit = Mapping[str, int | None]
"""A task's free room per dimension (None: no limit in that dimension)."""


@dataclass(frozen=True, slots=True)
class Seen:
    """What one reserve transaction saw (after charging its own create)."""

    project_id: int
    project_free: Amount
    task: str | None = None
    task_free: TaskLimit | None = None
    task_has_stages: bool = False
    views: tuple[tuple[EdgeView, str], ...] = ()
    plain: bool = True
    """The scheduler placed it the ordinary way (primary pool, below the burst threshold, no
    minimum held back): False makes this replica take the careful path until one is again."""


@dataclass(frozen=True, slots=True)
class Plan:
    key: str
    edge: EdgeView
    url: str


@dataclass(slots=True)
class _Quota:
    at: float
    free: Amount
    task_free: dict[str, TaskLimit | None]
    task_stages: dict[str, bool]


def _amount_fits(free: Amount, want: Amount) -> bool:
    return free.sandboxes >= want.sandboxes and free.cpu_m >= want.cpu_m and free.memory >= want.memory


def _task_fits(free: TaskLimit, want: Amount) -> bool:
    return all(limit is None or want.get(dim) <= limit for dim, limit in free.items())


class LaunchPlanner:
    def __init__(self, *, k: int, require_layers: bool, rng: random.Random, max_age_s: float = MAX_AGE_S) -> None:
        self.k = k
        self.require_layers = require_layers
        self.rng = rng
        self.max_age_s = max_age_s
        self._quota: dict[int, _Quota] = {}
        self._views: tuple[float, tuple[tuple[EdgeView, str], ...]] | None = None
        self._pending: dict[str, tuple[int, str | None, str, Amount, Room]] = {}
        """Optimistic creates not yet recorded: key -> (project, task, edge, amount, room)."""
        self._by_project: dict[int, Amount] = {}
        self._by_task: dict[tuple[int, str], Amount] = {}
        self._by_edge: dict[str, Room] = {}
        """Sums of ``_pending`` kept as it changes (a plan reads them: O(1), not O(creates in flight))."""
        self._recent: dict[tuple[int, str], None] = {}
        self.launched = 0
        self.discarded = 0

    # ---------------------------------------------------------- planning ----

    def plan(
        self, project_id: int, task: str | None, spec_has_stages: bool, demand: Demand, key: str,
        request_id: str | None = None,
    ) -> Plan | None:
        """An edge to start this create on now, or None (take the careful path)."""
        if request_id is not None:
            rk = (project_id, request_id)
            if rk in self._recent:
                return None
            self._recent[rk] = None
            if len(self._recent) > RECENT_REQUESTS:
                del self._recent[next(iter(self._recent))]
        now = time.monotonic()
        q = self._quota.get(project_id)
        if q is None or now - q.at > self.max_age_s or self._views is None or now - self._views[0] > self.max_age_s:
            return None
        want = Amount(1, demand.need.cpu_m, demand.need.memory)
        used = self._by_project.get(project_id, Amount())
        if not _amount_fits(q.free - used, want):
            return None
        if task is not None:
            tfree = q.task_free.get(task)
            if task not in q.task_free or (q.task_stages.get(task, False) and not spec_has_stages):
                return None  # unknown (made on first use) or the sandbox would inherit stages
            if tfree is not None:
                tused = self._by_task.get((project_id, task), Amount())
                left = {d: (None if v is None else v - tused.get(d)) for d, v in tfree.items()}
                if not _task_fits(left, want):
                    return None
        views = self._views[1]
        if not _layers_known(views, demand.layers):
            return None  # the careful path answers 404 with its hint
        load = self._by_edge
        edges = [dataclasses.replace(v, committed=v.committed + load[v.id]) if v.id in load else v for v, _ in views]
        chosen = place(edges, demand, k=self.k, rng=self.rng, require_layers=self.require_layers)
        if chosen is None:
            return None  # the careful path answers the 429 with its reason
        url = next(u for v, u in views if v.id == chosen.id)
        self._add(key, (project_id, task, chosen.id, want, demand.need))
        self.launched += 1
        return Plan(key=key, edge=chosen, url=url)

    def _add(self, key: str, p: tuple[int, str | None, str, Amount, Room]) -> None:
        self._pending[key] = p
        self._by_project[p[0]] = self._by_project.get(p[0], Amount()) + p[3]
        if p[1] is not None:
            self._by_task[(p[0], p[1])] = self._by_task.get((p[0], p[1]), Amount()) + p[3]
        self._by_edge[p[2]] = self._by_edge.get(p[2], Room()) + p[4]

    def _drop(self, key: str) -> None:
        p = self._pending.pop(key, None)
        if p is None:
            return
        _less(self._by_project, p[0], p[3], Amount())
        if p[1] is not None:
            _less(self._by_task, (p[0], p[1]), p[3], Amount())
        _less(self._by_edge, p[2], p[4], Room())

    # ---------------------------------------------------- what was seen ----

    def seen(self, s: Seen, *, key: str | None = None) -> None:
        """A reserve transaction answered (its own create, ``key``, is now recorded)."""
        if key is not None:
            self._drop(key)
        now = time.monotonic()
        q = self._quota.get(s.project_id)
        if q is None:
            q = self._quota[s.project_id] = _Quota(now, s.project_free, {}, {})
        q.at, q.free = now, s.project_free
        if s.task is not None:
            q.task_free[s.task] = s.task_free
            q.task_stages[s.task] = s.task_has_stages
        if not s.plain:
            self._views = None  # priorities, minimums or the burst pool are in play: the transaction decides
        elif s.views:
            self._views = (now, s.views)

    def refused(self, project_id: int, key: str | None = None) -> None:
        """A reserve for this project was refused (quota, gone...): no optimism until the
        next transaction says otherwise."""
        if key is not None:
            self._drop(key)
        self._quota.pop(project_id, None)

    def done(self, key: str) -> None:
        self._drop(key)


def _less(sums: dict[Any, Any], k: Any, v: Any, zero: Any) -> None:
    left = sums[k] - v
    if left == zero:
        del sums[k]  # nothing in flight there: no entry (a plan's views stay untouched)
    else:
        sums[k] = left


def _layers_known(views: Sequence[tuple[EdgeView, str]], layers: Sequence[str]) -> bool:
    known = {ref for v, _ in views if v.alive for ref in v.layers}
    return all(normalize_ref(r) in known for r in layers)
