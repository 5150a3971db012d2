"""Scheduling against real edges (issue 15): a real control plane, real edge agents, the SDK.

- Preemption (on SQLite and PostgreSQL): an edge whose memory holds three background sandboxes gets an evaluation
  create; the control plane pauses one background sandbox (its memory goes to swap and the
  edge's admission stops counting it), the evaluation sandbox is made, and the owner sees it
  typed through the SDK (``SandboxInfo.preemption``, ``sched_events``, ``SandboxPreempted``
  when a request finds no room to resume it, the resume once there is). With the task's
  policy switched to ``destroy``, the next victim is destroyed (``SandboxEvicted``).
- Burst: a primary edge and an edge labelled ``pool=burst``: the burst edge gets creates only
  while the primary pool is at or above 80 %, none once it fell below, and the burst
  controller gives it back (static provider) once it is empty below 70 %.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import test_control_support as support

from conftest import edge_config

pytestmark = [pytest.mark.root, pytest.mark.anyio]

anyio_backend = support.anyio_backend
db_url = support.db_url
pg_cluster = support.pg_cluster
KEY = secrets.token_bytes(32)
MiB = 1 << 20
SPEC: dict[str, Any] = {"image": {"base": "busybox:test"},
                        "resources": {"cpu": 0.25, "memory": 64 * MiB, "disk": 16 * MiB}}


@pytest.fixture
def tmp(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path


@asynccontextmanager
async def cell(dsec_base: Path, tmp_path: Path, edges: list[dict[str, Any]],
               database_url: str | None = None) -> AsyncIterator[tuple[Any, list[Any], Any]]:
    """A control plane (no watcher loop: the tests tick it), real edges reporting to it, and an
    SDK client with the admin token (no leases held ahead: every create goes through the scheduler)."""
    import dsec
    from dsec.control import ControlConfig, serve_control
    from dsec.control.config import SchedulingConfig
    from dsec.edge.testing import EdgeThread, leftovers

    ctl = await serve_control(ControlConfig(
        data_dir=tmp_path / "control", cluster_key=KEY, port=0, watcher=False, auth_cache_s=0.0,
        database_url=database_url, scheduling=SchedulingConfig(burst_interval_s=0.01),
    ))
    cfgs = [edge_config(dsec_base, f"sch{i}", e.pop("edge_id"), KEY, control_plane_url=ctl.url,
                        heartbeat_interval_s=0.2, watchdog_interval_s=0.2, **e) for i, e in enumerate(edges)]
    started: list[Any] = []
    try:
        for cfg in cfgs:
            started.append(await asyncio.to_thread(EdgeThread(cfg).start))
        async with dsec.AsyncClient(ctl.url, ctl.admin_token, lease_ahead=0) as client:
            await registered(client, len(cfgs))
            yield ctl, started, client
    finally:
        for e in started:
            await asyncio.to_thread(e.stop)
        await ctl.stop()
    for cfg in cfgs:
        assert not leftovers(cfg), leftovers(cfg)


async def registered(client: Any, n: int) -> None:
    for _ in range(200):
        edges = await client.edges()
        if len(edges) == n and all(e["health"] for e in edges):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"edges did not register: {await client.edges()}")


async def reported(edge: Any, ctl: Any) -> None:
    """Wait for two heartbeats, so the control plane's view of the edge is its latest word."""
    await asyncio.sleep(0.5)


async def books_agree(ctl: Any) -> None:
    """Every counter the ledger moved (projects, tasks' used and active, edges) equals what the
    recount makes of the sandbox rows."""
    from dsec.control.watcher import recount_txn

    assert await ctl.control.db.write(recount_txn) == 0


async def test_an_evaluation_create_pauses_a_background_sandbox_on_a_real_edge(
    dsec_base: Path, tmp: Path, db_url: str
) -> None:
    import dsec
    from dsec.spec import SandboxSpec

    spec = SandboxSpec.model_validate(SPEC)
    async with cell(dsec_base, tmp, [{"edge_id": "sp", "memory_capacity": 3 * 64 * MiB, "max_sandboxes": 8}],
                    db_url) as (ctl, (edge,), client):
        bg = await client.create_task("bg", priority="background", preemption="pause")
        ev = await client.create_task("ev", priority="evaluation")
        assert (bg.priority, bg.preemption, ev.priority) == (100, "pause", 300)
        low = [await client.create(spec, task="bg") for _ in range(3)]
        # the edge's memory is full: another background sandbox gets the 429
        with pytest.raises(dsec.Backpressure):
            await client.create(spec, task="bg")

        # an evaluation create preempts the newest background sandbox and is made
        high = await client.create(spec, task="ev")
        assert high.info.edge_id == "sp"
        infos = {sb.id: await client.info(sb.id) for sb in low}
        paused = [i for i in infos.values() if i.state is dsec.SandboxState.PAUSED]
        assert [i.id for i in paused] == [low[-1].id]
        p = paused[0].preemption
        assert p is not None and (p.action, p.by_priority, p.priority) == ("pause", 300, 100)
        events = await client.sched_events(task="bg")
        assert [(e.kind, e.sandbox_id, e.action, e.by_priority) for e in events] == \
            [("preempted", low[-1].id, "pause", 300)]
        health = edge.service.health()
        assert health.memory_committed == 3 * 64 * MiB and health.sandboxes == 4 and health.paused == 1
        active = (await client.task("bg")).active
        assert active is not None and active.sandboxes == 2
        status = await client.sched_status()
        assert status.preempted == 1 and status.primary.edges == 1
        await books_agree(ctl)

        # a request does not wake it while there is no room: typed, with a retry hint
        victim = low[-1]
        with pytest.raises(dsec.SandboxPreempted) as exc:
            await victim.exec("echo hi")
        assert exc.value.fields.get("retry_after")
        assert (await client.info(victim.id)).state is dsec.SandboxState.PAUSED

        # once the evaluation sandbox is gone, the same request resumes it (through the control plane)
        await high.close()
        await reported(edge, ctl)
        res = await victim.exec("echo back")
        assert res.exit_code == 0 and res.stdout == b"back\n"
        again = await client.info(victim.id)
        assert again.state is dsec.SandboxState.RUNNING and again.preemption is None
        assert [e.kind for e in await client.sched_events(task="bg")] == ["preempted", "resumed"]
        await books_agree(ctl)
        assert edge.service.health().memory_committed == 3 * 64 * MiB

        # with the policy "destroy", the next victim goes altogether
        await client.create_task("bg", priority="background", preemption="destroy")
        high = await client.create(spec, task="ev")
        gone = [sb for sb in low if (await client.info(sb.id)).state is dsec.SandboxState.STOPPED]
        assert len(gone) == 1
        with pytest.raises(dsec.SandboxEvicted):
            await client.connect(gone[0].id)
        with pytest.raises(dsec.SandboxNotFound):  # the edge's tombstone says why, as SandboxEvicted
            await gone[0].exec("true")
        last = (await client.sched_events(task="bg"))[-1]
        assert (last.kind, last.action, last.sandbox_id) == ("preempted", "destroy", gone[0].id)
        await books_agree(ctl)

        # a project cannot raise its own task above training, nor give it a minimum
        await client.create_project("team", quota={"sandboxes": 10, "cpu": 4, "memory": 1 << 30})
        tok = await client.create_token(project="team")
        async with dsec.AsyncClient(ctl.url, tok.token, lease_ahead=0) as team:
            with pytest.raises(dsec.Forbidden):
                await team.create_task("mine", priority="evaluation")
            assert (await team.create_task("mine", priority="background")).priority == 100
        assert (await client.create_task("mine", project="team", priority=300)).priority == 300

        assert await client.delete_where(task="bg") >= 0
        assert await client.delete_where(task="ev") == 1
        await ctl.control.watcher.tick(reconcile=True)
        root = (await client.list_projects())[0]
        assert root.used.sandboxes == 0


async def test_burst_edges_are_used_only_above_the_threshold_and_given_back(dsec_base: Path, tmp: Path) -> None:
    from dsec.spec import SandboxSpec

    spec = SandboxSpec.model_validate(SPEC)
    async with cell(dsec_base, tmp, [{"edge_id": "pa", "max_sandboxes": 5},
                                     {"edge_id": "pb", "max_sandboxes": 5, "labels": {"pool": "burst"}}]) \
            as (ctl, (primary, burst), client):
        # below 80 % of the primary pool (5 slots), every create lands on it
        first = [await client.create(spec) for _ in range(4)]
        assert [sb.info.edge_id for sb in first] == ["pa"] * 4
        status = await client.sched_status()
        assert status.utilisation == pytest.approx(0.8) and status.burst_active and status.burst.edges == 1
        # at 80 % the next creates go to the burst pool, though the primary edge has room
        over = [await client.create(spec) for _ in range(2)]
        assert [sb.info.edge_id for sb in over] == ["pb", "pb"]
        await ctl.control.burst.tick(force=True)

        # load falls: new creates stay on the primary pool, the burst edge drains
        for sb in first[:3]:
            await sb.close()
        await asyncio.sleep(0.5)  # heartbeats: the edges' reports agree
        again = [await client.create(spec) for _ in range(2)]
        assert [sb.info.edge_id for sb in again] == ["pa", "pa"]
        assert (await client.sched_status()).utilisation == pytest.approx(0.6)
        await ctl.control.burst.tick(force=True)
        provider = ctl.control.burst.provider
        assert provider.released == []  # it still holds sandboxes
        for sb in over:
            await sb.close()
        await asyncio.sleep(0.5)
        await ctl.control.burst.tick(force=True)
        assert provider.released == ["pb"]
        kinds = [e.kind for e in await client.sched_events()]
        assert kinds == ["burst_on", "burst_off", "node_released"], kinds
        for sb in (*first[3:], *again):
            await sb.close()
        assert primary.service.health().sandboxes == 0 and burst.service.health().sandboxes == 0
