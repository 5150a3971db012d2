"""End to end: SDK -> edge (HTTP, the fast routes and the FastAPI ones) -> fncall backend ->
worker sandboxes of the edge's container backend, all real, on loopback.

The edge runs the container backend and the fncall backend (numpy preloaded) on the
python3+numpy Debian layer that tests/integration/test_fncall.py uses (built once and
cached under $DSEC_STATE_DIR/cache).
"""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from conftest import edge_config, running_edge
from dsec.backends.fncall.config import FnCallConfig, FnCallImage
from dsec.bench import fncall as bench
from dsec.errors import Forbidden, InvalidSpec, Unsupported
from dsec.http.auth import mint
from dsec.sdk import AsyncClient, Client
from dsec.spec import ImageRef
from dsec.spec.fncall import (
    FnCall,
    FnCallError,
    FnCallOOM,
    FnCallOutputTooLarge,
    FnCallTimeout,
    FnResult,
)

pytestmark = [pytest.mark.root, pytest.mark.timeout(900)]

KEY = secrets.token_bytes(32)
CACHE = Path(os.environ.get("DSEC_STATE_DIR", "/var/lib/dsec")) / "cache"
IMAGE = ImageRef(base="pyfn:test")
FNCALL = FnCallConfig(images=(FnCallImage(image=IMAGE, preload=("numpy",), concurrency=4, spare=2),))


@pytest.fixture(scope="module")
def edge(dsec_base: Path) -> Iterator[Any]:
    have_cache = (CACHE / ("debian-bookworm-" + "-".join(sorted(bench.PACKAGES))) / ".dsec-complete").exists()
    if not have_cache and shutil.which("debootstrap") is None:
        pytest.skip("needs debootstrap (or a cached Debian python3-numpy rootfs) for a python layer")
    from dsec.backends.container.config import ContainerConfig
    from dsec.images.store import LocalLayerStore

    injected = False
    try:  # the edge's configuration lists the fncall backend, once EdgeConfig's union has it
        cfg = edge_config(dsec_base, "efn", "fn", KEY, backends=[ContainerConfig(), FNCALL])
    except ValidationError:
        cfg = edge_config(dsec_base, "efn", "fn", KEY)
        injected = True
    store = LocalLayerStore(Path(cfg.state_dir) / "layers")
    try:
        bench.python_layer(store, CACHE, name="pyfn", tag="test")
    finally:
        store.close()
    with running_edge(cfg) as e:
        if injected:  # until then: the same backend, built as the edge would and added to it
            from dsec.backends.fncall.backend import FnCallBackend

            b = FnCallBackend(FNCALL, name=f"{cfg.runtime}-fncall", host=e.service.backends.by_kind["container"])
            e.call(b.start())
            e.service.backends.by_kind["fncall"] = b
        yield e


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_a_call_through_the_sdk(edge: Any) -> None:
    async def go() -> None:
        async with AsyncClient(edge.url, edge.admin_token()) as c:
            r = await c.fncall(IMAGE, "import numpy as np\ndef main(a, b, *, k=1):\n    print('out')\n"
                                      "    return float(np.dot(a, b)) * k", args=[[1, 2], [3, 4]], kwargs={"k": 2})
            assert isinstance(r, FnResult) and r.value == 22.0 and r.stdout == "out\n" and r.worker
            assert (await c.fncall("pyfn:test", "40 + 2")).value == 42  # a base layer reference
            assert (await c.fncall(IMAGE, "def f(x): return -x", args=[3], entry="f")).value == -3

    run(go())


def test_failures_arrive_typed(edge: Any) -> None:
    async def go() -> None:
        async with AsyncClient(edge.url, edge.admin_token()) as c:
            with pytest.raises(FnCallError) as info:
                await c.fncall(IMAGE, "def main():\n    raise KeyError('nope')")
            e = info.value
            assert e.exc_type == "KeyError" and "'nope'" in e.exc_message
            assert 'File "<fncall>", line 2, in main' in e.traceback
            with pytest.raises(FnCallTimeout) as t:
                await c.fncall(IMAGE, "import time\ntime.sleep(30)", timeout=1)
            assert isinstance(t.value, TimeoutError) and t.value.fields["timeout"] == 1
            with pytest.raises(FnCallOOM):
                await c.fncall(IMAGE, "bytearray(1 << 30)", memory=64 << 20)
            with pytest.raises(FnCallOutputTooLarge):
                await c.fncall(IMAGE, "print('x' * 100000)", output_cap=4096)
            with pytest.raises(InvalidSpec):  # refused by the edge before any call
                await c.fncall(IMAGE, "1", timeout=-1)

    run(go())


def test_a_batch_in_one_request(edge: Any) -> None:
    async def go() -> list[Any]:
        async with AsyncClient(edge.url, edge.admin_token()) as c:
            calls = [FnCall("def main(i):\n    return i * i", (i,)) for i in range(50)]
            return await c.fncall_many(IMAGE, [*calls, "1/0"], timeout=20)

    outs = run(go())
    assert [o.value for o in outs[:50]] == [i * i for i in range(50)]
    assert isinstance(outs[50], FnCallError) and outs[50].exc_type == "ZeroDivisionError"


FORGED_ERROR = ("import os, stat, struct\ndef main():\n"
                "    fd = next(f for f in range(3, 64) if os.path.exists(f'/proc/self/fd/{f}')"
                " and stat.S_ISFIFO(os.fstat(f).st_mode))\n"
                "    body = b'this is not json'\n"
                "    os.write(fd, struct.pack('>IBd', 9 + len(body), 0x45, 0.0) + body)\n"
                "    os._exit(0)\n")


def test_a_forged_result_in_a_batch_fails_that_call_alone(edge: Any) -> None:
    """An error frame whose payload is not JSON gave an HTTP 500 for one call, and in a batch the
    edge dropped the connection with every other call's result (issue 22)."""
    async def go() -> tuple[Any, list[Any]]:
        async with AsyncClient(edge.url, edge.admin_token()) as c:
            with pytest.raises(FnCallError) as one:
                await c.fncall(IMAGE, FORGED_ERROR, timeout=20)
            calls = [FnCall("def main(i):\n    return i * i", (i,)) for i in range(20)]
            return one.value, await c.fncall_many(IMAGE, [*calls, FORGED_ERROR], timeout=20)

    single, outs = run(go())
    assert single.exc_type == "ProtocolError"
    assert [o.value for o in outs[:20]] == [i * i for i in range(20)]
    assert isinstance(outs[20], FnCallError) and outs[20].exc_type == "ProtocolError"


def test_the_sync_client_has_the_same_calls(edge: Any) -> None:
    with Client(edge.url, edge.admin_token()) as c:
        assert c.fncall(IMAGE, "'sync'").value == "sync"
        assert [o.value for o in c.fncall_many(IMAGE, ["1", "2"])] == [1, 2]


def test_who_may_call(edge: Any) -> None:
    url = f"{edge.url}/v1/fncall"
    body = {"image": "pyfn:test", "source": "1"}
    r = httpx.post(url, json=body, headers=edge.sandbox_headers("fn-anything"))
    assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden"
    assert httpx.post(url, json=body).status_code == 401
    token, _ = mint(KEY, sandbox_id="", project="p1", scope="fncall")
    r = httpx.post(url, json=body, headers={"authorization": f"Bearer {token}"})
    assert r.status_code == 200 and r.json()["value"] == 1

    async def forbidden() -> None:
        async with AsyncClient(edge.url, edge.sandbox_headers("x")["authorization"].split()[1]) as c:
            await c.fncall(IMAGE, "1")

    with pytest.raises(Forbidden):
        run(forbidden())


def test_the_fastapi_route_answers_the_same(edge: Any) -> None:
    """A request the fast route passes on (a query string) is answered by the FastAPI route."""
    h = edge.admin_headers()
    body = {"image": {"base": "pyfn:test"}, "source": "def main(x): return [x]", "args": [7]}
    fast = httpx.post(f"{edge.url}/v1/fncall", json=body, headers=h).json()
    slow = httpx.post(f"{edge.url}/v1/fncall?via=fastapi", json=body, headers=h).json()
    assert fast["value"] == slow["value"] == [7] and fast["ok"] is slow["ok"] is True
    bad = {"image": "pyfn:test", "source": 1}
    a = httpx.post(f"{edge.url}/v1/fncall", json=bad, headers=h)
    b = httpx.post(f"{edge.url}/v1/fncall?via=fastapi", json=bad, headers=h)
    assert a.status_code == b.status_code == 422 and a.json()["error"]["field"] == b.json()["error"]["field"] == "source"
    r = httpx.post(f"{edge.url}/v1/fncall/batch?x=1", json={"image": "pyfn:test", "calls": [{"source": "5"}]},
                   headers=h)
    assert r.status_code == 200 and r.json()["results"][0]["value"] == 5


def test_an_edge_without_the_backend_says_unsupported(edge: Any) -> None:
    kinds = edge.service.backends.by_kind
    b = kinds.pop("fncall")
    try:
        r = httpx.post(f"{edge.url}/v1/fncall", json={"image": "pyfn:test", "source": "1"},
                       headers=edge.admin_headers())
        assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported"

        async def go() -> None:
            async with AsyncClient(edge.url, edge.admin_token()) as c:
                await c.fncall(IMAGE, "1")

        with pytest.raises(Unsupported):
            run(go())
    finally:
        kinds["fncall"] = b


def test_sdk_latency_is_milliseconds(edge: Any) -> None:
    """Not a benchmark (dsec.bench.fncall is): a sanity bound on a loaded test machine."""
    async def go() -> list[float]:
        async with AsyncClient(edge.url, edge.admin_token()) as c:
            for _ in range(10):
                await c.fncall(IMAGE, bench.SNIPPET, args=list(bench.ARGS))
            out = []
            for _ in range(50):
                t = time.perf_counter()
                await c.fncall(IMAGE, bench.SNIPPET, args=list(bench.ARGS))
                out.append((time.perf_counter() - t) * 1000)
            return out

    lat = run(go())
    assert statistics.median(lat) < 100, sorted(lat)


def test_through_the_control_plane_calls_go_straight_to_the_edge() -> None:
    """A client of the all-in-one's control plane: one lease (an edge running fncall and a
    fncall token), then calls to that edge; a refused token is leased again, once."""
    import tempfile

    from dsec.cli.up import start_cluster
    from dsec.images.store import LocalLayerStore

    have_cache = (CACHE / ("debian-bookworm-" + "-".join(sorted(bench.PACKAGES))) / ".dsec-complete").exists()
    if not have_cache and shutil.which("debootstrap") is None:
        pytest.skip("needs debootstrap (or a cached Debian python3-numpy rootfs) for a python layer")
    with tempfile.TemporaryDirectory(prefix="dsec-test-fncp-") as tmp:
        data = Path(tmp)
        store = LocalLayerStore(data / "layers")
        try:
            bench.python_layer(store, CACHE, name="pyfn", tag="test")
        finally:
            store.close()

        async def go() -> None:
            cluster = await start_cluster(data, port=0, edge_overrides={
                "backends": [{"kind": "container"}, FNCALL.model_dump(mode="json")]})
            try:
                async with AsyncClient(cluster.url, cluster.admin_token) as c:
                    assert (await c.fncall(IMAGE, "def main(x):\n    return x + 1", args=[41])).value == 42
                    leases = c.__dict__["_fncall_leases"]
                    (expires, edge, token), = leases.values()
                    assert edge.base_url == cluster.edges[0].url != cluster.url
                    assert expires > time.time() + 600
                    async with httpx.AsyncClient(timeout=60) as h:  # (the cluster runs on this loop)
                        r = await h.post(f"{edge.base_url}/v1/fncall", json={"image": "pyfn:test", "source": "1"},
                                         headers={"authorization": f"Bearer {token}"})
                    assert r.status_code == 200 and r.json()["value"] == 1  # the token is the edge's to check
                    # a lease the edge no longer honours (another cluster key) is replaced, once
                    bad, _ = mint(secrets.token_bytes(32), sandbox_id="fncall:x", project="x", scope="fncall")
                    leases[next(iter(leases))] = (expires, edge, bad)
                    assert (await c.fncall(IMAGE, "2 * 21")).value == 42
                    assert next(iter(leases.values()))[2] != bad
                    # a sandbox token (no fncall scope) is refused by the edge
                    sb_token, _ = mint(b"k" * 32, sandbox_id="x", project="p")
                    async with httpx.AsyncClient(timeout=60) as h:
                        r = await h.post(f"{edge.base_url}/v1/fncall", json={"image": "pyfn:test", "source": "1"},
                                         headers={"authorization": f"Bearer {sb_token}"})
                    assert r.status_code in (401, 403), r.text
            finally:
                await cluster.stop()

        asyncio.run(go())
