"""Replica liveness: each control-plane replica records every ``replica_beat_s`` that it is alive.

A create's reservation names the replica that launched it (``sandboxes.launcher``).
When that replica stops beating (SIGKILL, a lost host), the watcher finishes
what it left half done instead of letting the reservation wait for its expiry:
it asks the reservation's edge for the sandbox under the reservation's key
(the edge makes it, or answers the one it already made) and records it, so a
client that retries the create on another replica gets that one sandbox.
Beats are small upserts on their own rows; a store that is down only delays
them (logged once), and never stops the loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import sqlalchemy as sa
from sqlalchemy.orm import Session

from dsec.control.db import Replica, Store

log = logging.getLogger("dsec.control.replicas")


def _beat_txn(s: Session, replica_id: str, url: str | None) -> None:
    now = time.time()
    row = s.get(Replica, replica_id, with_for_update=True)
    if row is None:
        s.add(Replica(id=replica_id, url=url or "", started_at=now, seen_at=now))
    else:
        row.seen_at = now
        if url:
            row.url = url
    s.execute(sa.delete(Replica).where(Replica.seen_at < now - 3600.0))


async def beat(store: Store, replica_id: str, url: str | None) -> None:
    await store.write(lambda s: _beat_txn(s, replica_id, url))


async def beat_forever(store: Store, replica_id: str, url: Callable[[], str | None], every_s: float) -> None:
    failing = False
    while True:
        await asyncio.sleep(every_s)
        try:
            await beat(store, replica_id, url())
            if failing:
                log.warning("replica %s: beats recorded again", replica_id[:8])
            failing = False
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if not failing:
                log.warning("replica %s: cannot record its beat (will keep trying): %s", replica_id[:8], exc)
            failing = True


async def leave(store: Store, replica_id: str) -> None:
    """A clean stop: this replica's creates are all recorded (Sandboxes.drain ran first)."""
    try:
        await store.write(lambda s: s.execute(sa.delete(Replica).where(Replica.id == replica_id)))
    except Exception as exc:
        log.warning("replica %s: could not record its stop: %s", replica_id[:8], exc)


def live_replicas(s: Session, *, dead_after_s: float) -> set[str]:
    since = time.time() - dead_after_s
    return set(s.execute(sa.select(Replica.id).where(Replica.seen_at >= since)).scalars())
