"""The control plane's books: which sandbox states hold quota and edge room, the counter
deltas of one transaction (:class:`Ledger`), and moving a row along the transition table.
Shared by the create path (:mod:`sandboxes`), scheduling, leases, the watcher and ops."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import sqlalchemy as sa
from sqlalchemy.orm import Session

from dsec.control.db import SandboxRow
from dsec.control.edges import bump_edge
from dsec.control.iam import Amount, bump_project, bump_task, bump_task_active
from dsec.control.placement import Room
from dsec.errors import DsecError
from dsec.spec import SandboxState, can_move

S = SandboxState
HOLDS_QUOTA = frozenset({S.CREATING.value, S.RUNNING.value, S.PAUSED.value})
"""States that count against the project's and the task's quota (a paused sandbox
still exists: any request resumes it)."""
HOLDS_EDGE = frozenset({S.CREATING.value, S.RUNNING.value, S.PAUSED.value, S.STOPPING.value, S.FAILED.value})
"""States that occupy room on the edge (until the edge confirms it is gone)."""
LIVE = (S.CREATING.value, S.RUNNING.value, S.PAUSED.value, S.STOPPING.value, S.FAILED.value)


def amount_of(row: SandboxRow) -> Amount:
    return Amount(1, row.cpu_m, row.memory)


def room_of(row: SandboxRow) -> Room:
    return Room(1, row.cpu_m, row.memory, row.disk)


_UNSUSPENDED = frozenset({S.CREATING.value, S.RUNNING.value})


def held_room(row: SandboxRow, state: str | None, preempted: bool) -> Room:
    """What the row holds on its edge in ``state``: a sandbox paused by preemption (and whatever
    follows, until it is resumed) keeps its slot and its disk, not its cpu and memory."""
    if state not in HOLDS_EDGE:
        return Room()
    if preempted and state not in _UNSUSPENDED:
        return Room(1, 0, 0, row.disk)
    return room_of(row)


def active_of(row: SandboxRow, state: str | None, preempted: bool) -> Amount:
    """What the row counts in its task's active capacity (scheduling: sched.Standing)."""
    if state not in HOLDS_QUOTA or (preempted and state not in _UNSUSPENDED):
        return Amount()
    return amount_of(row)


@dataclass
class Ledger:
    """Counter deltas of one transaction, written once at the end (one UPDATE per row touched)."""

    projects: dict[int, Amount] = field(default_factory=dict)
    tasks: dict[int, Amount] = field(default_factory=dict)
    edges: dict[str, Room] = field(default_factory=dict)
    active: dict[int, Amount] = field(default_factory=dict)
    """Tasks' active capacity beyond what moved with ``tasks`` (preemption)."""

    def charge(self, row: SandboxRow, old: str | None, new: str | None, *, old_edge: str | None = None,
               was_preempted: bool | None = None) -> None:
        """Account for ``row`` moving from state ``old`` to ``new`` (None: no row). ``was_preempted``:
        the row's preemption mark in ``old`` when it differs from the mark it has now."""
        now_p = row.preempted_at is not None
        was_p = now_p if was_preempted is None else was_preempted
        q = (new in HOLDS_QUOTA) - (old in HOLDS_QUOTA)
        if q:
            a = amount_of(row) * q
            self.projects[row.project_id] = self.projects.get(row.project_id, Amount()) + a
            if row.task_id is not None:
                self.tasks[row.task_id] = self.tasks.get(row.task_id, Amount()) + a
        if row.task_id is not None and (now_p or was_p):
            extra = active_of(row, new, now_p) - active_of(row, old, was_p) - amount_of(row) * q
            if extra != Amount():
                self.active[row.task_id] = self.active.get(row.task_id, Amount()) + extra
        prev_edge = row.edge_id if old_edge is None else old_edge
        if old in HOLDS_EDGE and prev_edge:
            self.edges[prev_edge] = self.edges.get(prev_edge, Room()) - held_room(row, old, was_p)
        if new in HOLDS_EDGE and row.edge_id:
            self.edges[row.edge_id] = self.edges.get(row.edge_id, Room()) + held_room(row, new, now_p)

    def flush(self, s: Session) -> None:
        for pid, a in sorted(self.projects.items()):
            bump_project(s, pid, a)
        for tid in sorted(set(self.tasks) | set(self.active)):
            bump_task(s, tid, self.tasks.get(tid, Amount()))
            bump_task_active(s, tid, self.active.get(tid, Amount()))
        for eid, r in sorted(self.edges.items()):
            if r != Room():
                bump_edge(s, eid, r)
        self.projects.clear()
        self.tasks.clear()
        self.active.clear()
        self.edges.clear()


def move(row: SandboxRow, target: SandboxState, ledger: Ledger, *, reason: str | None = None) -> None:
    """Move ``row`` to ``target`` along the transition table (through ``stopping`` to reach ``stopped``).
    Resuming a sandbox paused by preemption clears its mark (it holds its cpu and memory again)."""
    cur = SandboxState(row.state)
    if cur == target:
        return
    if not can_move(cur, target):
        if target == S.STOPPED and can_move(cur, S.STOPPING):
            move(row, S.STOPPING, ledger, reason=reason)
            move(row, S.STOPPED, ledger, reason=reason)
            return
        raise DsecError(f"sandbox {row.id or row.key}: illegal move {cur.value} -> {target.value}")
    if target == S.RUNNING and row.preempted_at is not None:
        row.preempted_at = None
        row.preemption = None
        ledger.charge(row, cur.value, target.value, was_preempted=True)
    else:
        ledger.charge(row, cur.value, target.value)
    row.state = target.value
    row.updated_at = time.time()
    if reason is not None:
        row.reason = reason


def forget(s: Session, row: SandboxRow, ledger: Ledger) -> None:
    """Drop a reservation that never became a sandbox (its counters return)."""
    ledger.charge(row, row.state, None)
    s.delete(row)


def finish_many(s: Session, ids: list[str]) -> None:
    ledger = Ledger()
    for row in s.execute(
        sa.select(SandboxRow).where(SandboxRow.id.in_(ids), SandboxRow.state == S.STOPPING.value).with_for_update()
    ).scalars():
        move(row, S.STOPPED, ledger)
    ledger.flush(s)


__all__ = ["HOLDS_EDGE", "HOLDS_QUOTA", "LIVE", "Ledger", "S", "active_of", "amount_of", "finish_many", "forget",
           "held_room", "move", "room_of"]
