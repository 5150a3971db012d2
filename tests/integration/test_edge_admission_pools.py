"""Final admission and warm pools on a real edge.

Admission: a create beyond the cpu/memory/disk/count budgets is refused with a
typed reason and creates nothing. Pools: a matching create is served from a
ready sandbox much faster than a cold create, the pool refills in the
background, and pooled sandboxes yield their room to real creates.
"""

from __future__ import annotations

import re
import secrets
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from conftest import edge_config, wait_until
from dsec.edge.config import EdgeConfig, PoolConfig
from dsec.edge.testing import EdgeThread, leftovers
from dsec.spec import ImageRef, Resources

pytestmark = pytest.mark.root

MiB = 1 << 20
KEY = secrets.token_bytes(32)
POOL_RES = Resources(cpu=0.25, memory=64 * MiB, disk=16 * MiB)


def _config(dsec_base: Path, suffix: str, edge_id: str, **kw: Any) -> EdgeConfig:
    return edge_config(dsec_base, suffix, edge_id, KEY, watchdog_interval_s=0.2, **kw)


@pytest.fixture
def small_edge(dsec_base: Path) -> Iterator[EdgeThread]:
    cfg = _config(dsec_base, "eadm", "ad", max_sandboxes=3, cpu_capacity=2.0,
                  memory_capacity=512 * MiB, disk_capacity=256 * MiB)
    with EdgeThread(cfg) as e:
        yield e
    assert not leftovers(cfg), leftovers(cfg)


@pytest.fixture
def pool_edge(dsec_base: Path) -> Iterator[EdgeThread]:
    cfg = _config(dsec_base, "epool", "pl", max_sandboxes=4, pool_refill_per_s=50,
                  pools=[PoolConfig(image=ImageRef(base="busybox:test"), resources=POOL_RES, size=2, name="bb")])
    with EdgeThread(cfg) as e:
        yield e
    assert not leftovers(cfg), leftovers(cfg)


def spec(cpu: float = 0.5, memory: int = 64 * MiB, disk: int = 16 * MiB) -> dict[str, Any]:
    return {"image": {"base": "busybox:test"}, "resources": {"cpu": cpu, "memory": memory, "disk": disk}}


def metric(text: str, series: str) -> float:
    m = re.search(rf"^{re.escape(series)} (\S+)$", text, re.M)
    assert m is not None, f"{series} not in metrics"
    return float(m.group(1))


def test_admission_refuses_over_budget(small_edge: EdgeThread) -> None:
    rt = small_edge.service.backends.get("container")
    with small_edge.client() as api:
        first = api.post("/v1/sandboxes", json={"spec": spec(cpu=1.5)})
        assert first.status_code == 201, first.text
        refusals: list[tuple[dict[str, Any], int, str, str]] = [
            (spec(cpu=1.0), 429, "backpressure", "cpu"),            # 1.5 + 1.0 > 2
            (spec(memory=600 * MiB), 422, "exceeds_capacity", "memory"),  # more than the whole node: never
            (spec(memory=480 * MiB), 429, "backpressure", "memory"),
            (spec(disk=250 * MiB), 429, "backpressure", "disk"),
        ]
        for body, status, code, reason in refusals:
            r = api.post("/v1/sandboxes", json={"spec": body})
            assert r.status_code == status, (body, r.text)
            e = r.json()["error"]
            assert (e["code"], e["reason"]) == (code, reason), e
            assert e["cpu_capacity"] == 2.0 and e["memory_capacity"] == 512 * MiB
            if status == 429:
                assert r.headers["retry-after"] == "1" and e["retry_after"] == 1.0
            else:  # what was asked and what the edge holds in all, and no retry
                assert "retry-after" not in r.headers and "retry_after" not in e
                assert (e["asked"]["memory"], e["capacity"]["memory"], e["edge_id"]) == (600 * MiB, 512 * MiB, "ad")
                assert e["message"].startswith("the sandbox asks for memory 600 MiB, more than edge ad can ever hold")
        assert len(rt.sandboxes) == 1  # refusals created nothing
        for _ in range(2):
            assert api.post("/v1/sandboxes", json={"spec": spec(cpu=0.1)}).status_code == 201
        r = api.post("/v1/sandboxes", json={"spec": spec(cpu=0.1)})
        assert r.status_code == 429 and r.json()["error"]["reason"] == "count"
        assert len(rt.sandboxes) == 3 and not leftovers_beyond(small_edge, 3)

        text = api.get("/metrics").text
        assert metric(text, 'dsec_edge_admission_refusals_total{reason="cpu"}') == 1
        assert metric(text, 'dsec_edge_admission_refusals_total{reason="memory"}') == 2
        assert metric(text, 'dsec_edge_admission_refusals_total{reason="count"}') == 1
        health = api.get("/v1/health").json()
        assert (health["sandboxes"], health["capacity_sandboxes"], health["cpu_committed"]) == (3, 3, 1.7)

        # room comes back when a sandbox goes
        api.delete(f"/v1/sandboxes/{first.json()['id']}")
        assert api.post("/v1/sandboxes", json={"spec": spec(cpu=1.0)}).status_code == 201


def leftovers_beyond(edge: EdgeThread, n: int) -> list[str]:
    """Records on disk beyond the ``n`` live sandboxes (refused creates must leave none)."""
    records = sorted((Path(edge.config.state_dir) / "sandboxes" / edge.config.runtime).glob("*.json"))
    return [str(p) for p in records[n:]]


def test_warm_pool_serves_refills_and_yields(pool_edge: EdgeThread) -> None:
    svc = pool_edge.service
    pool = svc.pools.pools[0]
    assert wait_until(lambda: len(pool.ready) == 2, timeout=15), pool.last_error
    with pool_edge.client() as api:
        text = api.get("/metrics").text
        assert metric(text, 'dsec_edge_pool_ready{pool="bb"}') == 2
        assert metric(text, 'dsec_edge_pool_target{pool="bb"}') == 2
        assert api.get("/v1/sandboxes").json() == []  # pool members are not sandboxes of anyone
        assert api.get("/v1/health").json()["pools"] == {"bb": 2}

        # a matching create takes a ready sandbox; a non-matching one is cold
        ready = set(pool.ready)
        t0 = time.perf_counter()
        r = api.post("/v1/sandboxes", json={"spec": {**spec(0.25), "env": {"A": "1"}}, "labels": {"k": "v"},
                                            "lifecycle": {"ttl_s": 120}})
        warm_ms = (time.perf_counter() - t0) * 1000
        assert r.status_code == 201, r.text
        warm = r.json()
        assert warm["from_pool"] is True and warm["id"] in ready and warm["labels"] == {"k": "v"}
        assert warm["expires_at"] == pytest.approx(time.time() + 120, abs=2)
        # it runs the request's spec (env) and is a normal sandbox now
        out = api.post(f"/v1/sandboxes/{warm['id']}/exec", json={"cmd": "echo $A"}).json()
        assert out["stdout_b64"] == "MQo="
        assert [e["event"] for e in api.get(f"/v1/sandboxes/{warm['id']}/events").json()].count("created") == 1
        r = api.post("/v1/sandboxes", json={"spec": spec(0.5)})
        assert r.status_code == 201 and r.json()["from_pool"] is False
        cold_id = r.json()["id"]
        text = api.get("/metrics").text
        assert metric(text, 'dsec_edge_pool_claims_total{pool="bb",result="hit"}') == 1
        assert metric(text, 'dsec_edge_create_seconds_count{source="pool"}') == 1
        assert metric(text, 'dsec_edge_create_seconds_count{source="cold"}') == 1

        # count budget 4: 2 real + 2 pooled fits; more real creates evict pooled ones
        assert wait_until(lambda: len(pool.ready) == 2, timeout=10)
        assert svc.admission.real.sandboxes == 2 and svc.admission.pooled.sandboxes == 2
        extra = []
        for _ in range(2):
            r = api.post("/v1/sandboxes", json={"spec": spec(0.5)})
            assert r.status_code == 201 and r.json()["from_pool"] is False, r.text
            extra.append(r.json()["id"])
        assert len(pool.ready) == 0 and len(svc.backends.get("container").sandboxes) == 4
        time.sleep(0.3)
        assert len(pool.ready) + pool.creating == 0, "no refill while real sandboxes need the room"
        r = api.post("/v1/sandboxes", json={"spec": spec(0.5)})
        assert r.status_code == 429 and r.json()["error"]["reason"] == "count"
        assert metric(api.get("/metrics").text, 'dsec_edge_pool_evictions_total{pool="bb"}') == 2

        # room freed: the pool refills to its size
        for sid in [*extra, cold_id]:
            assert api.delete(f"/v1/sandboxes/{sid}").status_code == 204
        assert wait_until(lambda: len(pool.ready) == 2, timeout=10)
        assert pool.low_watermark() == 0

        # warm vs cold through HTTP, sequential, after refills settle
        warm_times, cold_times = [], []
        for _ in range(3):
            assert wait_until(lambda: len(pool.ready) == 2 and pool.creating == 0, timeout=10)
            t0 = time.perf_counter()
            r = api.post("/v1/sandboxes", json={"spec": spec(0.25)})
            warm_times.append(time.perf_counter() - t0)
            assert r.json()["from_pool"] is True
            api.delete(f"/v1/sandboxes/{r.json()['id']}")
            assert wait_until(lambda: len(pool.ready) == 2 and pool.creating == 0, timeout=10)
            t0 = time.perf_counter()
            r = api.post("/v1/sandboxes", json={"spec": spec(0.5)})
            cold_times.append(time.perf_counter() - t0)
            api.delete(f"/v1/sandboxes/{r.json()['id']}")
        warm_p50, cold_p50 = statistics.median(warm_times) * 1000, statistics.median(cold_times) * 1000
        print(f"\nHTTP create p50: warm pool {warm_p50:.2f} ms (first {warm_ms:.2f} ms), cold {cold_p50:.2f} ms")
        assert warm_p50 < cold_p50
        api.delete(f"/v1/sandboxes/{warm['id']}")


def test_idempotent_create(small_edge: EdgeThread) -> None:
    with small_edge.client() as api:
        body = {"spec": spec(0.1), "request_id": "req-1"}
        a = api.post("/v1/sandboxes", json=body).json()
        b = api.post("/v1/sandboxes", json=body).json()
        assert a["id"] == b["id"] and len(small_edge.service.backends.get("container").sandboxes) == 1
        sid = "ad-0123456789ab"
        c = api.post("/v1/sandboxes", json={"spec": spec(0.1), "id": sid})
        assert c.status_code == 201 and c.json()["id"] == sid
        assert api.post("/v1/sandboxes", json={"spec": spec(0.1), "id": sid}).json()["id"] == sid
        assert len(small_edge.service.backends.get("container").sandboxes) == 2


def test_concurrent_creates_respect_the_budget(small_edge: EdgeThread) -> None:
    async def burst() -> list[int]:
        import asyncio

        async with httpx.AsyncClient(base_url=small_edge.url, headers=small_edge.admin_headers(), timeout=60) as c:
            rs = await asyncio.gather(*(c.post("/v1/sandboxes", json={"spec": spec(0.1)}) for _ in range(8)))
        return [r.status_code for r in rs]

    import asyncio

    codes = asyncio.run(burst())
    assert sorted(codes) == [201] * 3 + [429] * 5, codes
    assert len(small_edge.service.backends.get("container").sandboxes) == 3


@pytest.mark.skipif(__import__("shutil").which("runsc") is None,
                    reason="runsc is not installed (scripts/setup.sh installs it from bookworm-backports)")
def test_a_pool_keeps_sandboxes_of_its_own_backend(dsec_base: Path) -> None:
    """Pools are keyed by backend: a gVisor pool serves gVisor creates of its image and
    resources, and a container create of the same image and resources stays cold."""
    from dsec.backends.container.config import ContainerConfig
    from dsec.backends.gvisor.config import GVisorConfig

    cfg = _config(dsec_base, "egvpool", "gp", max_sandboxes=4, pool_refill_per_s=50,
                  backends=[ContainerConfig(), GVisorConfig()],
                  pools=[PoolConfig(image=ImageRef(base="busybox:test"), resources=POOL_RES, size=1,
                                    backend="gvisor", name="gv")])
    with EdgeThread(cfg) as e:
        pool = e.service.pools.pools[0]
        assert wait_until(lambda: len(pool.ready) == 1, timeout=60), pool.last_error
        pooled = set(pool.ready)
        assert pooled <= set(e.service.backends.get("gvisor").sandboxes)
        body = {"image": {"base": "busybox:test"}, "resources": {"cpu": 0.25, "memory": 64 * MiB, "disk": 16 * MiB}}
        with e.client() as api:
            r = api.post("/v1/sandboxes", json={"spec": body})  # the container backend: not this pool's
            assert r.status_code == 201 and r.json()["from_pool"] is False, r.text
            assert api.delete(f"/v1/sandboxes/{r.json()['id']}").status_code == 204
            r = api.post("/v1/sandboxes", json={"spec": {**body, "backend": "gvisor"}})
            assert r.status_code == 201, r.text
            got = r.json()
            assert got["from_pool"] is True and got["id"] in pooled
            out = api.post(f"/v1/sandboxes/{got['id']}/exec", json={"cmd": "echo pooled"}).json()
            assert out["stdout_b64"] == "cG9vbGVkCg=="
            assert api.delete(f"/v1/sandboxes/{got['id']}").status_code == 204
    assert not leftovers(cfg), leftovers(cfg)


def test_a_pool_of_a_backend_the_edge_does_not_run_is_refused(dsec_base: Path) -> None:
    with pytest.raises(ValueError, match="backend 'gvisor' is not one this edge runs"):
        _config(dsec_base, "ebadpool", "bp",
                pools=[PoolConfig(image=ImageRef(base="busybox:test"), resources=POOL_RES, size=1, backend="gvisor")])
