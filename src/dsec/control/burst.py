"""The burst pool: extra nodes for when the primary pool runs hot, and who starts and stops them.

Placement sends eligible creates to edges labelled ``pool=burst`` only while the primary
pool's utilisation is at or above ``scheduling.burst_threshold`` (sched.py); below it they
get nothing, so they drain as their sandboxes end. This module is the other half: the
:class:`BurstController` (run by the watcher's leader every ``burst_interval_s``) asks a
:class:`BurstProvider` for nodes when the burst pool in use runs short of free room, and
gives back the nodes that hold nothing once utilisation falls below
``burst_release_below`` (:func:`dsec.control.sched.burst_plan` decides, the same code the
simulator runs).

A provider is anything with ``provision(n)`` and ``release(edge_id)``:

- :class:`StaticBurstProvider` (``burst_provider: static``, the default): the burst pool is the
  edges labelled ``pool=burst`` that joined; nothing is started or stopped (``release`` is only
  recorded, and the node simply gets no creates until the threshold is crossed again).
- a cloud's (``burst_provider: "module:factory"``, built with ``burst_provider_options``):
  ``provision`` starts VMs from an image whose boot runs ``dsec edge join URL --token dsb_...
  --config burst-edge.toml`` with ``labels = {pool = "burst"}``, and answers the edge ids they
  will join as; ``release`` terminates the VM of an edge that is drained and empty. Set
  ``terminates = True``: the controller then marks a released edge draining (no create can
  land on it while it shuts down) and removes its row once it stops reporting.
  docs/CONTROL.md ("Scheduling") sketches one over EC2 Auto Scaling.

The controller keeps the nodes asked for and not joined yet in memory (a new leader starts
without them: at worst it asks once more). Never blocks the event loop; provider calls are awaited.
"""

from __future__ import annotations

import importlib
import logging
import time
from typing import Any, Protocol, runtime_checkable

import sqlalchemy as sa
from sqlalchemy.orm import Session

from dsec.control.config import ControlConfig
from dsec.control.db import EdgeRow, SchedEventRow, Store
from dsec.control.edges import HealthCache, load_views
from dsec.control.sched import (
    BurstNode,
    BurstSizing,
    SchedConfig,
    burst_active,
    burst_plan,
    split_pools,
)

log = logging.getLogger("dsec.control.burst")

JOIN_TIMEOUT_S = 600.0
"""A node asked for that has not joined in this long is no longer counted as on its way."""


@runtime_checkable
class BurstProvider(Protocol):
    name: str
    terminates: bool
    """``release`` stops the node (the controller then drains and, once silent, removes its edge)."""

    async def provision(self, n: int) -> list[str]:
        """Start ``n`` more burst nodes; the edge ids they will join as (labelled ``pool=burst``)."""
        ...

    async def release(self, edge_id: str) -> None:
        """Give back a burst node that is drained and holds no sandbox."""
        ...


class StaticBurstProvider:
    """The burst edges that joined are the pool: nothing to start or stop."""

    name = "static"
    terminates = False

    def __init__(self, **_: Any) -> None:
        self.released: list[str] = []
        """Edges reported empty below the release threshold (in order; for operators and tests)."""

    async def provision(self, n: int) -> list[str]:
        return []

    async def release(self, edge_id: str) -> None:
        self.released.append(edge_id)


def load_provider(config: ControlConfig) -> BurstProvider:
    spec = config.scheduling.burst_provider
    if spec == "static":
        return StaticBurstProvider(**config.scheduling.burst_provider_options)
    module, _, attr = spec.partition(":")
    if not module or not attr:
        raise ValueError(f"scheduling.burst_provider {spec!r}: 'static' or 'module:factory'")
    factory = getattr(importlib.import_module(module), attr)
    provider = factory(**config.scheduling.burst_provider_options)
    if not isinstance(provider, BurstProvider):
        raise TypeError(f"{spec} built {type(provider).__name__}, which lacks provision/release/name/terminates")
    return provider


class BurstController:
    def __init__(self, config: ControlConfig, store: Store, health: HealthCache, cfg: SchedConfig,
                 provider: BurstProvider) -> None:
        self.config = config
        self.store = store
        self.health = health
        self.cfg = cfg
        self.provider = provider
        self.pending: dict[str, float] = {}
        """Edge ids asked for and not joined yet -> when."""
        self.released: set[str] = set()
        self.active = False
        self._last = float("-inf")

    async def tick(self, *, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last < self.config.scheduling.burst_interval_s:
            return
        self._last = now
        views = await self.store.read(lambda s: [v for v, _ in load_views(s, self.health)])
        pools = split_pools(views)
        joined = {v.id for v in pools.burst}
        self.pending = {e: t for e, t in self.pending.items() if e not in joined and now - t < JOIN_TIMEOUT_S}
        live = [v for v in pools.burst if v.alive and not v.draining]
        active = bool(live) and burst_active(pools, self.cfg)
        events: list[tuple[str, dict[str, Any]]] = []
        if active != self.active:
            self.active = active
            events.append(("burst_on" if active else "burst_off", {"edges": sorted(v.id for v in live)}))
            if active:  # the static pool's nodes serve again
                self.released.clear()
        nodes = [BurstNode(v.id, v.alive and not v.draining, v.committed.sandboxes, v.capacity, v.committed,
                           released=v.id in self.released) for v in pools.burst]
        sizing = BurstSizing(headroom=self.config.scheduling.burst_headroom,
                             max_nodes=self.config.scheduling.burst_max_nodes)
        plan = burst_plan(pools, nodes, len(self.pending), self.cfg, sizing)
        if plan.provision:
            ids = await self.provider.provision(plan.provision)
            for eid in ids:
                self.pending[eid] = now
            if ids:
                events.append(("node_requested", {"edges": ids, "provider": self.provider.name}))
        for eid in plan.release:
            await self.provider.release(eid)
            self.released.add(eid)
            events.append(("node_released", {"edges": [eid], "provider": self.provider.name}))
        gone = [v.id for v in pools.burst if v.id in self.released and not v.alive] if self.provider.terminates else []
        if events or (self.provider.terminates and (plan.release or gone)):
            await self.store.write(lambda s: self._record_txn(s, events, list(plan.release), gone))
        for eid in gone:
            self.released.discard(eid)

    def _record_txn(self, s: Session, events: list[tuple[str, dict[str, Any]]], released: list[str],
                    gone: list[str]) -> None:
        now = time.time()
        for kind, detail in events:
            s.add(SchedEventRow(at=now, project_id=None, kind=kind, detail=detail))
        if self.provider.terminates:
            if released:
                s.execute(sa.update(EdgeRow).where(EdgeRow.id.in_(released)).values(draining=True))
            if gone:  # its node is stopped: it will not report again
                s.execute(sa.update(EdgeRow).where(EdgeRow.id.in_(gone), EdgeRow.committed_sandboxes == 0)
                          .values(status="removed"))
