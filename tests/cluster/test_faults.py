"""Fault tests: each ends with "nothing lost, nothing duplicated, nothing leaked".

- lost: every create the SDK asked for succeeded (create_many retries 429/503 with the
  same request id) and every live sandbox in the store is on its edge;
- duplicated: no sandbox on an edge that the store does not know, one sandbox per
  request id (the SDK's ids are distinct);
- leaked: the lab's teardown and the session's leak check (mounts, cgroups, processes,
  namespaces) find nothing.

Slow (a burst each, processes started and killed): ``pytest -m slow tests/cluster``;
``dsec bench cluster`` measures the same faults.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest

from dsec import ImageRef, Resources, SandboxSpec

pytestmark = [pytest.mark.root, pytest.mark.slow]

SPEC = SandboxSpec(image=ImageRef(base="busybox:test"),
                   resources=Resources(cpu=0.1, memory=32 << 20, disk=8 << 20, disk_medium="memory"))


async def burst(lab: Any, n: int, *, at: int, fault: Any, concurrency: int = 8) -> tuple[list[Any], list[Any]]:
    """``n`` creates; ``fault()`` runs (in a thread) once ``at`` of them were answered."""
    ok: list[Any] = []
    errors: list[Any] = []
    threads: list[threading.Thread] = []
    async with lab.client() as c:
        # the control plane's create path (one create per sandbox, request ids, failover): what
        # these faults test; create leases (edges taking creates directly) are not used here
        async for o in c.create_many(SPEC, n, concurrency=concurrency, max_wait_s=120, lease=False):
            (ok if o.ok else errors).append(o.sandbox if o.ok else o.error)
            if len(ok) + len(errors) >= at and not threads:
                threads.append(threading.Thread(target=fault, daemon=True))
                threads[0].start()
    for t in threads:  # the fault has played out (a restart may outlast the burst)
        t.join(60)
    return ok, errors


def settled(lab: Any, timeout: float = 40.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        audit = lab.audit()
        if not audit["missing"] and not audit["unknown"] and not audit["duplicate_requests"]:
            return audit
        assert time.monotonic() < deadline, audit
        time.sleep(1.0)


def nothing_lost_or_duplicated(lab: Any, ok: list[Any], errors: list[Any], n: int, *,
                               check: list[Any] | None = None) -> None:
    """``check``: sandboxes to exec in besides a sample of every tenth."""
    assert not errors, errors[:5]
    assert len(ok) == n and len({s.id for s in ok}) == n
    settled(lab)

    async def all_there() -> None:
        async with lab.client() as c:
            listed = {s.id: s for s in await c.list()}
            gone = [s.id for s in ok if s.id not in listed]
            trail = {}
            for i in gone[:5]:  # the trail: what the store says of them
                try:
                    trail[i] = (await c.info(i)).model_dump(mode="json", include={"state", "reason", "created_at"})
                except Exception as exc:
                    trail[i] = repr(exc)
            assert not gone, (gone, trail)
            # one the edge was still making when the watcher listed it is recorded 'creating', and
            # running when the edge reports it made (or the next round lists it, a restarted edge's)
            deadline = time.monotonic() + 3 * lab.timings.reconcile_interval_s + 5
            while (late := {s.id: listed[s.id].state.value for s in ok if listed[s.id].state.value != "running"}):
                assert time.monotonic() < deadline, late
                await asyncio.sleep(0.5)
                listed = {s.id: s for s in await c.list()}
            for s in {s.id: s for s in [*ok[:: max(1, n // 10)], *(check or [])]}.values():  # and they work
                assert (await (await c.connect(s.id)).exec("echo ok")).stdout == b"ok\n", s.id

    asyncio.run(all_there())


def test_edge_sigkilled_mid_burst(lab: Any) -> None:
    # the lost bound far off: the edge is back long before its sandboxes could be declared lost
    # (that outcome is the partition test's), so everything it made must be there and work
    lb = lab(edges=3, postgres=True, edge_lost_after_s=600.0)
    ok, errors = asyncio.run(burst(lb, 60, at=20, fault=lambda: lb.kill_edge(1)))
    lb.wait_edge(1, "dead", timeout=30)
    on1 = [s for s in ok if s.info.edge_id == lb.edges[1].edge_id]
    assert on1, "some sandboxes were made on edge 1 before it was killed"
    lb.start_edge(1)  # re-adopts them
    nothing_lost_or_duplicated(lb, ok, errors, 60, check=on1)


async def lease_burst(lab: Any, n: int, *, at: int, fault: Any, edge: int, concurrency: int = 64,
                      timeout: float = 30.0) -> tuple[list[Any], list[Any]]:
    """``n`` creates through one create lease (``create_many``'s default: chunks of 16 straight to
    the edges); ``fault()`` runs (in a thread) once ``at`` of them were answered, some by ``edge``
    (the SDK holds sandboxes there: they must stand)."""
    from dsec import AsyncClient

    ok: list[Any] = []
    errors: list[Any] = []
    threads: list[threading.Thread] = []
    async with AsyncClient(lab.urls, lab.admin_token, timeout=timeout) as c:
        async for o in c.create_many(SPEC, n, concurrency=concurrency, max_wait_s=120):
            (ok if o.ok else errors).append(o.sandbox if o.ok else o.error)
            if len(ok) + len(errors) >= at and not threads and any(
                    s.info.edge_id == lab.edges[edge].edge_id for s in ok):
                threads.append(threading.Thread(target=fault, daemon=True))
                threads[0].start()
    assert threads, "the fault ran"
    for t in threads:
        t.join(60)
    return ok, errors


def books_agree(lab: Any, n: int, timeout: float = 40.0) -> None:
    """After a lease burst of ``n``: exactly ``n`` live sandboxes in the store and on the edges (no
    duplicate), every counter equal to a recount of the rows, no reservation left."""
    import sqlalchemy as sa

    from dsec.control.db import SandboxRow, Store
    from dsec.control.watcher import recount_txn

    store = Store(lab.pg.url("dsec"), threads=1)
    try:
        deadline = time.monotonic() + timeout
        while True:  # reservations of slots the SDK held are filled by the edge's report or the reconcile
            left = store.run_sync(lambda s: s.execute(sa.select(SandboxRow.key).where(
                SandboxRow.id.is_(None), SandboxRow.state == "creating")).scalars().all(), write=False)
            audit = settled(lab)
            if not left and audit["live"] == n and audit["on_edges"] == n:
                break
            assert time.monotonic() < deadline, (left[:5], audit)
            time.sleep(1.0)
        assert store.run_sync(recount_txn, write=True) == 0  # the counters moved with the rows
    finally:
        store.engine.dispose()
    logs = "".join((lab.base / f"control{c.index}.log").read_text(errors="replace") for c in lab.controls)
    assert "drifted" not in logs  # and the watcher's own recounts never found one off


def abandoned(lab: Any) -> list[str]:
    """The control plane's log lines of lease parts abandoned by the SDK (printed: the trail of
    what was given up, and of what the edge had made under it)."""
    logs = "".join((lab.base / f"control{c.index}.log").read_text(errors="replace") for c in lab.controls)
    lines = [line for line in logs.splitlines() if "abandoned by the client" in line or "which had ended" in line]
    print("\n".join(lines))
    return [line for line in lines if "abandoned by the client" in line]


def test_lease_burst_edge_sigkilled_mid_burst(lab: Any) -> None:
    # the edge dies with chunks of the lease in flight there: its part is abandoned, the SDK
    # creates those items through the control plane (elsewhere); what the edge made of them
    # (it re-adopts its sandboxes when it starts again) is destroyed, never counted twice
    lb = lab(edges=2, postgres=True, edge_lost_after_s=600.0)
    ok, errors = asyncio.run(lease_burst(lb, 160, at=16, fault=lambda: lb.kill_edge(1), edge=1))
    assert abandoned(lb), "the kill found a chunk of the lease in flight (or the next one): its part was abandoned"
    lb.wait_edge(1, "dead", timeout=30)
    on1 = [s for s in ok if s.info.edge_id == lb.edges[1].edge_id]
    assert on1, "some sandboxes were made on edge 1 before it was killed"
    lb.start_edge(1)  # re-adopts them: the SDK's stand, the others are destroyed
    nothing_lost_or_duplicated(lb, ok, errors, 160, check=on1)
    books_agree(lb, 160)
    abandoned(lb)


def test_lease_burst_edge_partitioned_mid_burst_then_healed(lab: Any) -> None:
    # the veth goes down with a chunk in flight: no answer (the edge may make it all the same, and
    # tells of it when the link is back). The part is abandoned; after the heal, whatever the edge
    # made under the slots given up is destroyed; the sandboxes the SDK got from it stand
    lb = lab(edges=2, postgres=True, edge_lost_after_s=600.0)
    ok, errors = asyncio.run(lease_burst(lb, 160, at=16, fault=lambda: lb.partition(1), edge=1,
                                           timeout=10.0))
    assert abandoned(lb), "the partition found a chunk of the lease in flight (or the next one)"
    assert lb.edge_info(1)["status"] == "dead"
    on1 = [s for s in ok if s.info.edge_id == lb.edges[1].edge_id]
    assert on1, "some sandboxes were made on edge 1 before it was cut off"
    lb.heal(1)
    lb.wait_edge(1, "alive", timeout=30)
    nothing_lost_or_duplicated(lb, ok, errors, 160, check=on1)
    books_agree(lb, 160)
    abandoned(lb)


def test_control_replica_sigkilled_mid_burst_sdk_fails_over(lab: Any) -> None:
    lb = lab(edges=2, replicas=2, postgres=True)
    ok, errors = asyncio.run(burst(lb, 80, at=25, fault=lambda: lb.kill_control(0), concurrency=16))
    assert not lb.controls[0].proc.alive
    nothing_lost_or_duplicated(lb, ok, errors, 80)


def test_postgresql_restarted_mid_burst(lab: Any) -> None:
    lb = lab(edges=2, replicas=2, postgres=True)
    down: list[float] = []
    ok, errors = asyncio.run(burst(lb, 60, at=20, fault=lambda: down.append(lb.restart_postgres())))
    assert down, "the restart ran"
    nothing_lost_or_duplicated(lb, ok, errors, 60)


def test_clock_skew_of_two_seconds(lab: Any) -> None:
    from dsec.bench.netlab import FAKETIME_LIB

    if FAKETIME_LIB is None:
        pytest.skip("libfaketime is not installed (scripts/setup.sh installs it)")
    lb = lab(edges=0, postgres=True)
    ahead, behind = lb.add_edge(1, clock_offset_s=2.0), lb.add_edge(2, clock_offset_s=-2.0)
    ok, errors = asyncio.run(burst(lb, 40, at=40, fault=lambda: None))
    assert {s.info.edge_id for s in ok} == {ahead.edge_id, behind.edge_id}
    # nothing young is taken for an orphan, tokens verify both ways, the watcher's view holds
    time.sleep(lb.timings.orphan_grace_s + lb.timings.reconcile_interval_s + 1)
    nothing_lost_or_duplicated(lb, ok, errors, 40)
    for n in (1, 2):
        assert lb.edge_info(n)["status"] == "alive"

    async def ttl() -> None:  # a TTL is the edge's own clock: it still ends on time, and is reported so
        async with lb.client() as c:
            short = [await c.create(SPEC, ttl_s=3) for _ in range(4)]
            t0 = time.monotonic()
            while any([(await c.info(s.id)).state.value != "stopped" for s in short]):
                assert time.monotonic() - t0 < 60, "the 3 s TTLs never ended"
                await asyncio.sleep(0.5)
            assert all(["ttl" in (await c.info(s.id)).reason for s in short])

    asyncio.run(ttl())
    # a partition across the skew still ends with the control plane's decision
    lb.partition(1)
    lb.wait_edge(1, "dead", timeout=10)
    lb.heal(1)
    lb.wait_edge(1, "alive", timeout=30)
    settled(lb)
