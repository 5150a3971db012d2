"""Pause, snapshots and forks end to end, without a control plane: SDK and CLI -> edge -> runtime.

The SDK's client is pointed at the edge itself with an edge-admin token (the
edge answers the same create/list/get/delete calls as the control plane), so
everything here runs through the real HTTP API of one edge agent with a zram
swap device, on loopback.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import time
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from click.testing import CliRunner

from conftest import edge_config, wait_until
from dsec import AsyncClient, Client, ImageRef, Resources, SandboxSpec
from dsec.backends.common.zram import active_swaps, read_label, swap_label
from dsec.edge.testing import EdgeThread, leftovers
from dsec.errors import (
    ImageError,
    InvalidSpec,
    LayerInUse,
    SandboxFailed,
    SandboxNotFound,
    SandboxStateError,
)
from dsec.sdk.client import AsyncSandbox
from dsec.spec import SandboxState

pytestmark = pytest.mark.root
T = TypeVar("T")
KEY = secrets.token_bytes(32)
SPEC = SandboxSpec(image=ImageRef(base="busybox:test"), resources=Resources(cpu=0.5, memory=256 << 20, disk=64 << 20))


class Harness:
    def __init__(self, edge: EdgeThread) -> None:
        self.edge = edge
        self.runner = asyncio.Runner()
        self.token = edge.admin_token()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 120) -> T:
        return self.runner.run(asyncio.wait_for(coro, timeout))

    def client(self) -> AsyncClient:
        return AsyncClient(self.edge.url, self.token)

    @property
    def rt(self) -> Any:
        return self.edge.service.backends.get("container")


@pytest.fixture(scope="module")
def h(dsec_base: Path) -> Iterator[Harness]:
    cfg = edge_config(dsec_base, "esnap", "es", KEY, watchdog_interval_s=0.1, zram_size=256 << 20)
    name = cfg.runtime_name
    edge = EdgeThread(cfg).start()
    harness = Harness(edge)
    try:
        yield harness
    finally:
        harness.runner.close()
        edge.stop()
    assert not leftovers(cfg), leftovers(cfg)
    assert not [p for p in active_swaps() if read_label(Path(p)) == swap_label(name)], "zram device left"


def test_pause_resume_and_transparent_resume_through_the_sdk(h: Harness) -> None:
    async def go() -> None:
        async with h.client() as c, await c.create(SPEC, labels={"suite": "pause"}) as sb:
            await sb.exec("yes 'some text' | head -c 20000000 > /data.txt; echo kept > /k")
            rep = await sb.pause()
            assert rep.state is SandboxState.PAUSED and rep.memory_before and rep.memory_after is not None
            assert rep.memory_after < 0.1 * rep.memory_before, rep
            assert (await c.info(sb.id)).state is SandboxState.PAUSED
            with pytest.raises(SandboxStateError) as ei:
                await sb.pause()
            assert ei.value.fields["state"] == "paused"
            # Any request resumes: a file read here.
            assert await sb.files.read("/k") == b"kept\n"
            assert (await c.info(sb.id)).state is SandboxState.RUNNING
            await sb.pause()
            res = await sb.exec("wc -c < /data.txt")  # an exec resumes too
            assert res.stdout.strip() == b"20000000"
            await sb.pause()
            async with await sb.session() as sess:  # and a session
                assert (await sess.run("cat /k")).stdout == b"kept\n"
            await sb.pause()
            await sb.resume()
            with pytest.raises(SandboxStateError):
                await sb.resume()
            events = [e["event"] for e in (await sb._request("GET", "/events")).json()]
            assert events.count("paused") >= 4 and "resumed" in events
    h.run(go())


def test_snapshot_and_start_from_it(h: Harness) -> None:
    async def go() -> None:
        async with h.client() as c:
            async with await c.create(SPEC) as sb:
                await sb.exec("mkdir -p /app/cache && echo v1 > /app/config && echo junk > /app/cache/x && rm /etc/group")
                info = await sb.snapshot(name="e2e-app", exclude=["/app/cache"])
                assert info.kind == "snapshot" and info.ref == "e2e-app:latest" and info.sandbox_id == sb.id
                assert info.parents == h.rt.get(sb.id).layers and info.frozen_s is not None
                spec = SandboxSpec(image=ImageRef(base=info.ref), resources=SPEC.resources)
                async with await c.create(spec) as child:
                    out = await child.exec("cat /app/config; ls /app; test -e /etc/group || echo nogroup")
                    assert out.stdout == b"v1\nconfig\nnogroup\n"
                with pytest.raises(InvalidSpec):  # a bad name is refused before anything happens
                    await sb.snapshot(name="Bad Name")
            # The snapshot is listed; it can be removed once nothing uses it.
            api = h.edge.client()
            listed = api.get("/v1/snapshots").json()
            assert any(x["ref"] == "e2e-app:latest" for x in listed)
            r = api.delete("/v1/snapshots/busybox:test")
            assert r.status_code == 422  # not a snapshot
            assert api.delete("/v1/snapshots/e2e-app:latest").status_code == 204
            api.close()
    h.run(go())


def test_deleting_a_snapshot_in_use_is_refused(h: Harness) -> None:
    async def go() -> None:
        async with h.client() as c, await c.create(SPEC) as sb:
            info = await sb.snapshot(name="e2e-inuse")
            async with await c.create(SandboxSpec(image=ImageRef(base=info.digest), resources=SPEC.resources)):
                api = h.edge.client()
                r = api.delete(f"/v1/snapshots/{info.digest}")
                assert r.status_code == 409 and r.json()["error"]["code"] == "layer_in_use"
                api.close()
    h.run(go())


def test_fork_through_the_sdk(h: Harness) -> None:
    async def go() -> None:
        async with h.client() as c, await c.create(SPEC, labels={"job": "fork"}, task="tree") as sb:
            await sb.exec("echo step-k > /state")
            kids = await sb.fork(3)
            try:
                assert len(kids) == 3 and all(isinstance(k, AsyncSandbox) for k in kids)
                for k in kids:
                    assert k.info.labels == {"job": "fork"} and k.info.task == "tree" and k.info.token
                    r = await k.exec("cat /state; hostname; cat /etc/machine-id")
                    state, host, mid = r.stdout.decode().split()
                    assert (state, host) == ("step-k", k.id) and len(mid) == 32
                await kids[0].exec("echo other > /state")
                assert (await kids[1].exec("cat /state")).stdout == b"step-k\n"
                # A paused parent forks and stays paused.
                await sb.pause()
                more = await sb.fork(1, labels={"job": "fork2"})
                kids += more
                assert more[0].info.labels == {"job": "fork2"}
                assert (await more[0].exec("cat /state")).stdout == b"step-k\n"
                assert h.rt.get(sb.id).state is SandboxState.PAUSED
            finally:
                for k in kids:
                    await k.close()
            # A failed sandbox cannot be forked (409 sandbox_state).
            await sb.resume()  # (a frozen process dies only once thawed)
            init = h.rt.get(sb.id).init_pid
            os.kill(init, 9)
            assert wait_until(lambda: not os.path.exists(f"/proc/{init}/fd/3"))
            with pytest.raises(SandboxFailed):
                await sb.exec("true")  # the edge notices and marks it failed
            with pytest.raises((SandboxStateError, SandboxNotFound)):  # or the watchdog already removed it
                await sb.fork(1)
    h.run(go())


def test_group_pause_and_resume_by_label_and_task(h: Harness) -> None:
    async def go() -> None:
        async with h.client() as c:
            sbs = [await c.create(SPEC, labels={"grp": "a"}, task="job1") for _ in range(3)]
            other = await c.create(SPEC, labels={"grp": "b"})
            try:
                res = await c.pause_where(labels={"grp": "a"})
                assert sorted(res.done) == sorted(s.id for s in sbs) and not res.errors
                assert h.rt.get(other.id).state is SandboxState.RUNNING
                again = await c.pause_where(task="job1")
                assert sorted(again.skipped) == sorted(s.id for s in sbs)
                assert h.edge.client().get("/v1/health").json()["paused"] == 3
                back = await c.resume_where(ids=[s.id for s in sbs] + [other.id])
                assert sorted(back.done) == sorted(s.id for s in sbs) and back.skipped == [other.id]
                # The edge's own group route (admin): by task.
                api = h.edge.client()
                r = api.post("/v1/pause", params={"task": "job1"})
                assert r.status_code == 200 and sorted(r.json()["done"]) == sorted(s.id for s in sbs)
                r = api.post("/v1/resume", params=[("label", "grp=a")])
                assert sorted(r.json()["done"]) == sorted(s.id for s in sbs)
                assert api.post("/v1/pause").status_code == 422  # says nothing: refused
                api.close()
            finally:
                for s in [*sbs, other]:
                    await s.close()
    h.run(go())


def test_auto_pause_and_ttl_while_paused(h: Harness) -> None:
    async def go() -> None:
        async with h.client() as c:
            sb = await c.create(SPEC, auto_pause_s=0.4)
            short = await c.create(SPEC, ttl_s=1.5)
            try:
                await sb.exec("echo survived > /f")
                await asyncio.sleep(1.2)
                assert h.rt.get(sb.id).state is SandboxState.PAUSED  # idle -> paused by the watchdog
                assert (await sb.exec("cat /f")).stdout == b"survived\n"  # resumed by the request
                assert h.rt.get(sb.id).state is SandboxState.RUNNING
                await short.pause()
                await asyncio.sleep(2.0)
                assert short.id not in h.rt.sandboxes  # TTL counted while paused
                info = await c.info(short.id)
                assert info.state is SandboxState.STOPPED and info.reason == "ttl_expired"
            finally:
                await sb.close()
                await short.close()
    h.run(go())


def test_sync_client_and_cli(h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    from dsec.cli.main import main

    with Client(h.edge.url, h.token) as c:
        sb = c.create(SPEC, labels={"cli": "yes"})
        try:
            assert c.connect(sb.id).pause().state is SandboxState.PAUSED
            sb.resume()
            monkeypatch.setenv("DSEC_URL", h.edge.url)
            monkeypatch.setenv("DSEC_TOKEN", h.token)
            runner = CliRunner()
            r = runner.invoke(main, ["pause", "--label", "cli=yes"])
            assert r.exit_code == 0, r.output
            assert h.rt.get(sb.id).state is SandboxState.PAUSED
            r = runner.invoke(main, ["resume", sb.id])
            assert r.exit_code == 0, r.output
            assert h.rt.get(sb.id).state is SandboxState.RUNNING
            sb.exec("echo cli > /c")
            r = runner.invoke(main, ["snapshot", sb.id, "--name", "e2e-cli", "-x", "/tmp"])
            assert r.exit_code == 0 and r.stdout.strip().endswith("e2e-cli:latest"), r.output
            r = runner.invoke(main, ["fork", sb.id, "-n", "2"])
            assert r.exit_code == 0, r.output
            kids = r.stdout.split()
            assert len(kids) == 2
            for k in kids:
                assert c.connect(k).exec("cat /c").stdout == b"cli\n"
                c.delete(k)
            r = runner.invoke(main, ["pause"])
            assert r.exit_code != 0
        finally:
            c.delete(sb.id)


def test_errors_map_to_the_wire(h: Harness) -> None:
    api = h.edge.client()
    try:
        r = api.post("/v1/sandboxes/es-000000000000/pause")
        assert r.status_code == 404 and r.json()["error"]["code"] == "sandbox_not_found"
        r = api.post("/v1/sandboxes", json={"spec": SPEC.model_dump(mode="json")})
        sid = r.json()["id"]
        assert api.post(f"/v1/sandboxes/{sid}/snapshot", json={"name": "BAD"}).status_code == 422
        assert api.post(f"/v1/sandboxes/{sid}/fork", json={"n": 0}).status_code == 422
        r = api.post(f"/v1/sandboxes/{sid}/fork", json={"n": 100000})
        assert r.status_code == 422
        assert api.post(f"/v1/sandboxes/{sid}/resume").status_code == 409
        api.delete(f"/v1/sandboxes/{sid}")
    finally:
        api.close()
    assert issubclass(LayerInUse, ImageError)
    time.sleep(0)
