"""``dsec bench service``: the SDK against the all-in-one, beside direct runtime calls.

Same process, same machine, same busybox layer: the direct runtime figures
are the baseline the service overhead is measured against. Their samples
alternate with the SDK's (one direct create, one SDK create, ...), so a
noisy neighbour slows both alike and the ratio holds.

SDK creates are measured two ways, alternating too: as a user's client makes them (a
create repeated with one spec takes a slot of a lease held ahead: the edge makes it with no
control-plane call, ``sdk_create_*``), and with ``lease_ahead=0`` (one control-plane create
per sandbox, ``sdk_create_via_control_*``).
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dsec.bench.stats import percentile

Say = Callable[[str], None]


def _spec(memory_mib: int = 32, cpu: float = 1.0) -> Any:
    from dsec.spec import ImageRef, Resources, SandboxSpec

    return SandboxSpec(image=ImageRef(base="busybox:latest"),
                       resources=Resources(cpu=cpu, memory=memory_mib << 20, disk=16 << 20, pids=64))


class _Direct:
    """The baseline: the same calls on a ContainerRuntime in this process."""

    def __init__(self, rt: Any) -> None:
        self.rt = rt
        self.spec = _spec()
        self.create_ms: list[float] = []
        self.exec_ms: list[float] = []
        self._box: str | None = None

    async def create(self) -> None:
        t0 = time.perf_counter()
        sb = await self.rt.create(self.spec)
        self.create_ms.append((time.perf_counter() - t0) * 1000)
        await self.rt.destroy(sb.id)

    async def exec(self) -> None:
        if self._box is None:
            self._box = (await self.rt.create(self.spec)).id
        t0 = time.perf_counter()
        await self.rt.exec(self._box, ["true"])
        self.exec_ms.append((time.perf_counter() - t0) * 1000)

    async def close(self) -> None:
        if self._box is not None:
            await self.rt.destroy(self._box)
            self._box = None

    def figures(self) -> dict[str, float]:
        return {"direct_create_p50_ms": percentile(self.create_ms, 50),
                "direct_create_p99_ms": percentile(self.create_ms, 99),
                "direct_exec_p50_ms": percentile(self.exec_ms, 50)}


@contextlib.asynccontextmanager
async def _direct_runtime(work: Path) -> Any:
    from dsec.backends.container.runtime import ContainerRuntime
    from dsec.images.build import build_busybox

    async with ContainerRuntime(name="bench-direct", state_dir=work / "direct", run_dir=work / "run") as rt:
        await asyncio.to_thread(build_busybox, rt.store, name="busybox", tag="latest")
        d = _Direct(rt)
        for _ in range(3):
            await d.create()
        d.create_ms.clear()
        try:
            yield d
        finally:
            await d.close()


def _free_port() -> int:
    import socket

    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        return int(sk.getsockname()[1])


class _Procs:
    """The control plane and each edge as their own processes, as in a deployment."""

    def __init__(self) -> None:
        self.procs: list[Any] = []
        self.url = ""
        self.admin_token = ""
        self.edge_urls: list[str] = []
        self.edge_token = ""

    async def start(self, data: Path, edges: int, pools: list[dict[str, Any]], edge_overrides: dict[str, Any]) -> None:
        import json
        import subprocess
        import sys

        import httpx

        (data / "control").mkdir(parents=True, exist_ok=True)
        port = _free_port()
        log = open(data / "control.log", "ab")  # noqa: SIM115 - owned by the child
        self.procs.append(subprocess.Popen(
            [sys.executable, "-m", "dsec.control", "--data-dir", str(data / "control"), "--port", str(port)],
            stdout=log, stderr=log, stdin=subprocess.DEVNULL))
        self.url = f"http://127.0.0.1:{port}"
        await self._healthy(self.url + "/healthz")
        self.admin_token = (data / "control" / "admin.token").read_text().strip()
        from dsec.http import auth

        key = bytes.fromhex((data / "control" / "cluster.key").read_text().strip())
        self.edge_token = auth.mint(key, sandbox_id="*", project="*", ttl_s=86400, scope="edge-admin")[0]
        for i in range(edges):
            eid = f"e{i + 1}"
            state = data if i == 0 else data / "edges" / eid
            cfg = {"edge_id": eid, "cluster_key": (data / "control" / "cluster.key").read_text().strip(),
                   "port": _free_port(), "state_dir": str(state), "runtime_name": f"bench-{eid}",
                   "control_plane_url": self.url, "destroy_on_shutdown": True, "pools": pools, **edge_overrides}
            cfg_path = data / f"{eid}.json"
            cfg_path.write_text(json.dumps(cfg))
            elog = open(data / f"{eid}.log", "ab")  # noqa: SIM115
            self.procs.append(subprocess.Popen([sys.executable, "-m", "dsec.edge", "--config", str(cfg_path)],
                                               stdout=elog, stderr=elog, stdin=subprocess.DEVNULL))
            await self._healthy(f"http://127.0.0.1:{cfg['port']}/metrics")
            self.edge_urls.append(f"http://127.0.0.1:{cfg['port']}")
        async with httpx.AsyncClient(base_url=self.url, headers={"authorization": f"Bearer {self.admin_token}"}) as h:
            for _ in range(200):
                body = (await h.get("/v1/edges")).json()
                items = body["items"] if isinstance(body, dict) else body
                if len(items) >= edges:
                    break
                await asyncio.sleep(0.1)

    async def _healthy(self, url: str) -> None:
        import httpx

        for _ in range(300):
            if any(p.poll() is not None for p in self.procs):
                raise RuntimeError(f"a DSec process exited while starting (see the logs next to {url})")
            with contextlib.suppress(httpx.HTTPError):
                async with httpx.AsyncClient() as h:
                    if (await h.get(url, timeout=1)).status_code < 500:
                        return
            await asyncio.sleep(0.1)
        raise RuntimeError(f"{url} did not come up")

    async def stop(self) -> None:
        import signal

        for p in reversed(self.procs):  # edges first: they destroy their sandboxes
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
            await asyncio.to_thread(p.wait, 60)


async def _service(work: Path, *, edges: int, n: int, many: int, concurrent: int, execs_each: int,
                   say: Say, direct: _Direct | None = None) -> dict[str, float]:
    from dsec.images.build import build_busybox
    from dsec.images.store import LocalLayerStore
    from dsec.sdk import AsyncClient

    data = work / f"svc{edges}"
    for i in range(edges):
        state = data if i == 0 else data / "edges" / f"e{i + 1}"
        store = LocalLayerStore(state / "layers")
        await asyncio.to_thread(build_busybox, store, name="busybox", tag="latest")
    pool_spec = _spec(memory_mib=48)
    pools = [{"image": pool_spec.image.model_dump(), "resources": pool_spec.resources.model_dump(), "size": 8}]
    cluster = _Procs()
    out: dict[str, float] = {}
    tag = f"{edges}edge"
    try:
        # Budgets overcommitted on purpose: 1,000 sandboxes of 1 cpu / 32 MiB must fit on a
        # 2-core, 24 GiB machine (they run `true`); the default budgets would push back.
        await cluster.start(data, edges, pools, {"cpu_capacity": 4000.0, "max_sandboxes": 6000, "memory_capacity": 64 << 30})
        async with AsyncClient(cluster.url, cluster.admin_token, timeout=300) as c, \
                AsyncClient(cluster.url, cluster.admin_token, timeout=300, lease_ahead=0) as via_control:
            spec = _spec()
            for _ in range(3):
                await (await c.create(spec)).close()
                await (await via_control.create(spec)).close()
            say(f"service ({edges} edge): SDK create (cold), {n} samples, alternating with the control plane's "
                "path" + (" and direct" if direct else ""))
            lat, lat_cp = [], []
            hits0 = c._ahead.hits if c._ahead is not None else 0
            for _ in range(n):
                if direct is not None:
                    await direct.create()
                t0 = time.perf_counter()
                sb = await c.create(spec)  # as users create: a lease held ahead when the body repeats
                lat.append((time.perf_counter() - t0) * 1000)
                await sb.close()
                t0 = time.perf_counter()
                sb = await via_control.create(spec)  # one control-plane create per sandbox
                lat_cp.append((time.perf_counter() - t0) * 1000)
                await sb.close()
            out[f"sdk_create_p50_ms_{tag}"] = percentile(lat, 50)
            out[f"sdk_create_p99_ms_{tag}"] = percentile(lat, 99)
            out[f"sdk_create_via_control_p50_ms_{tag}"] = percentile(lat_cp, 50)
            out[f"sdk_create_via_control_p99_ms_{tag}"] = percentile(lat_cp, 99)
            out[f"sdk_create_lease_frac_{tag}"] = ((c._ahead.hits if c._ahead is not None else 0) - hits0) / n

            say(f"service ({edges} edge): SDK create from a warm pool, {n} samples")
            warm = []
            hits = 0
            for _ in range(n):
                await _wait_pool(cluster, pools[0]["size"])  # every edge's pool full again
                t0 = time.perf_counter()
                sb = await c.create(pool_spec)
                ms = (time.perf_counter() - t0) * 1000
                if sb.info.from_pool:  # a miss is a cold create: not what this figure measures
                    hits += 1
                    warm.append(ms)
                await sb.close()
            out[f"warm_create_p50_ms_{tag}"] = percentile(warm, 50) if warm else float("nan")
            out[f"warm_pool_hit_frac_{tag}"] = hits / n

            say(f"service ({edges} edge): SDK exec round trip, {n} samples")
            sb = await c.create(spec)
            ex = []
            for _ in range(n):
                if direct is not None:
                    await direct.exec()
                t0 = time.perf_counter()
                await sb.exec(["true"])
                ex.append((time.perf_counter() - t0) * 1000)
            out[f"sdk_exec_p50_ms_{tag}"] = percentile(ex, 50)
            await sb.close()

            for how, lease in (("", True), ("_via_control", False)):  # a lease (the default), and one by one
                say(f"service ({edges} edge): create_many({many}{', lease=False' if not lease else ''})")
                t0 = time.perf_counter()
                made = [o async for o in c.create_many(spec, many, concurrency=64, labels={"bench": "many"},
                                                       lease=lease)]
                out[f"create_many{how}_{many}_per_s_{tag}"] = len([o for o in made if o.ok]) / (time.perf_counter() - t0)
                out[f"create_many{how}_errors_{tag}"] = len([o for o in made if not o.ok])
                await asyncio.gather(*(o.sandbox.close() for o in made if o.sandbox), return_exceptions=True)

            say(f"service ({edges} edge): {concurrent} sandboxes x {execs_each} execs from one asyncio client")
            made = [o async for o in c.create_many(spec, concurrent, concurrency=64, labels={"bench": "conc"})]
            boxes = [o.sandbox for o in made if o.sandbox]
            errors = len(made) - len(boxes)
            t0 = time.perf_counter()

            kinds: dict[str, int] = {}

            async def drive(box: Any) -> int:
                bad = 0
                for _ in range(execs_each):
                    try:
                        r = await box.exec(["true"], timeout=120)
                        if r.exit_code != 0:
                            bad += 1
                            kinds[f"exit {r.exit_code}/{r.signal}"] = kinds.get(f"exit {r.exit_code}/{r.signal}", 0) + 1
                    except Exception as exc:
                        bad += 1
                        name = f"{type(exc).__name__}: {str(exc)[:80]}"
                        kinds[name] = kinds.get(name, 0) + 1
                return bad

            errors += sum(await asyncio.gather(*(drive(b) for b in boxes)))
            dt = time.perf_counter() - t0
            out[f"concurrent_errors_{tag}"] = errors
            if kinds:
                say(f"service ({edges} edge): concurrent exec errors: {kinds}")
                out[f"concurrent_error_kinds_{tag}"] = "; ".join(f"{k} x{v}" for k, v in sorted(kinds.items()))  # type: ignore[assignment]
            out[f"concurrent_execs_per_s_{tag}"] = len(boxes) * execs_each / dt
            await asyncio.gather(*(b.close() for b in boxes), return_exceptions=True)
    finally:
        await cluster.stop()
    return out


async def _wait_pool(cluster: _Procs, need: int, timeout: float = 10.0) -> None:
    """Until every edge's own health says its warm pool holds ``need`` ready sandboxes (the
    control plane's copy is a heartbeat old); then a moment more, so the refill that just
    finished is not still settling while the measured claim runs."""
    import httpx

    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(headers={"authorization": f"Bearer {cluster.edge_token}"}) as h:
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError, ValueError):
                ready = [sum(((await h.get(f"{u}/v1/health")).json().get("pools") or {}).values())
                         for u in cluster.edge_urls]
                if all(r >= need for r in ready):
                    break
            await asyncio.sleep(0.02)
    await asyncio.sleep(0.02)


def run(*, quick: bool = False, say: Say = print) -> dict[str, Any]:
    n = 30 if quick else 200
    many = 200 if quick else 1000
    concurrent = 200 if quick else 1000
    execs_each = 5 if quick else 20
    results: dict[str, Any] = {"quick": quick}
    async def one_edge(work: Path) -> dict[str, float]:
        async with _direct_runtime(work) as direct:
            out = await _service(work, edges=1, n=n, many=many, concurrent=concurrent, execs_each=execs_each,
                                 say=say, direct=direct)
            return {**out, **direct.figures()}

    # The default event loop, as in most users' programs (the edge and the control plane run on
    # uvloop: dsec/http/loop.py); the direct calls share it, so the baseline is what a program would
    # get calling the runtime itself.
    with tempfile.TemporaryDirectory(prefix="dsec-bench-svc-") as tmp:
        work = Path(tmp)
        results.update(asyncio.run(one_edge(work)))
        results.update(asyncio.run(_service(work, edges=3, n=n, many=many, concurrent=concurrent,
                                            execs_each=execs_each, say=say)))
    # The named keys are the 1-edge figures; the 3-edge ones carry their suffix.
    for key in ("sdk_create_p50_ms", "sdk_create_p99_ms", "sdk_create_via_control_p50_ms", "sdk_create_lease_frac",
                "warm_create_p50_ms", "sdk_exec_p50_ms", "concurrent_errors"):
        results[key] = results[f"{key}_1edge"]
    # A key names the N it holds: create_many_1000_per_s in a full run, create_many_200_per_s
    # with --quick (a 200-sandbox figure is not a 1,000-sandbox one).
    results[f"create_many_{many}_per_s"] = results[f"create_many_{many}_per_s_1edge"]
    results[f"create_many_via_control_{many}_per_s"] = results[f"create_many_via_control_{many}_per_s_1edge"]
    results["create_many_n"] = many
    results["concurrent_n"] = concurrent
    results["sdk_create_overhead_ratio"] = results["sdk_create_p50_ms"] / results["direct_create_p50_ms"]
    results["sdk_create_via_control_ratio"] = results["sdk_create_via_control_p50_ms"] / results["direct_create_p50_ms"]
    results["sdk_exec_overhead_ratio"] = results["sdk_exec_p50_ms"] / results["direct_exec_p50_ms"]
    return results
