"""``dsec bench cluster``: the create path at cluster rates, on PostgreSQL.

What it measures: how many sandbox creates per second the control plane answers, with one
replica and with two replicas sharing one PostgreSQL (a throwaway cluster the bench makes:
:mod:`dsec.bench.postgres`, with the distribution's durability defaults). The edges are
**in-process stand-ins** (:mod:`dsec.bench.standin`) that answer at once and make nothing,
so the figure is the control plane's, not the runtime's; every result carries
``edge_kind`` saying so. Replicas run as their own processes (``python -m dsec.control``),
as deployed; the load comes from SDK clients (``dsec.AsyncClient``) in worker processes.

Two ways to create, each measured:

- ``single``: one ``POST /v1/sandboxes`` per sandbox (``client.create``), many in flight:
  what independent rollouts each creating their own sandbox cost;
- ``lease``: ``client.create_many``, which asks the control plane for signed, quota-backed
  create leases (one call per burst) and creates on the edges directly (docs/CONTROL.md,
  "Create leases").

Every phase reports CPU seconds per 1,000 creates of each process (replicas, PostgreSQL,
stand-in edges, clients), read from /proc: on a 2-core machine everything competes, and
the split says what bounds the rate and what a bigger machine would give.

Series (``run(series=...)``, the HTML report's charts: :func:`figures`): per phase, when
each create was answered (seconds since the go, every worker's) and a sample of create
latencies (``single`` / ``independent``: ``create()`` calls), beside the flat keys.

Hook for the fault suite: :data:`EXTRA_PHASES`. A module that measures faults (edge loss,
replica failover, partitions) registers ``name -> run(quick, say) -> dict`` there (or is
listed in :data:`PHASE_MODULES`, imported lazily); its keys are merged into the results.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsec.bench.report import Figure, Series, SeriesData, downsample, rate_over_time
from dsec.bench.stats import percentile

Say = Callable[[str], None]
Phase = Callable[..., dict[str, Any]]

EDGE_KIND = "in-process stand-in (answers at once, makes nothing)"
LAYER = "busybox:latest"
EXTRA_PHASES: dict[str, Phase] = {}
"""More phases of ``dsec bench cluster`` (name -> ``run(*, quick, say) -> dict``)."""
PHASE_MODULES: tuple[str, ...] = ()
"""Modules imported before the run; each may add to :data:`EXTRA_PHASES` (e.g. the fault suite)."""


def _ticks() -> int:
    return os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int, *, children: bool = False) -> float:
    """User + system CPU seconds of a process (all its threads), 0 if it is gone.
    ``children``: plus its children's, the live ones and those it has reaped (a
    PostgreSQL server forks a backend per connection)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    total = (int(fields[11]) + int(fields[12])) / _ticks()
    if children:
        total += (int(fields[13]) + int(fields[14])) / _ticks()
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{pid}/task"):
                with contextlib.suppress(OSError):
                    for child in Path(f"/proc/{pid}/task/{task}/children").read_text().split():
                        total += cpu_s(int(child), children=True)
    return total


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class _Replicas:
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    urls: list[str] = field(default_factory=list)

    async def start(self, work: Path, n: int, db_url: str, key: bytes, token: str) -> None:
        work.mkdir(parents=True, exist_ok=True)
        for i in range(n):
            port = _free_port()
            cfg = {"data_dir": str(work / f"control{i}"), "database_url": db_url, "cluster_key": key.hex(),
                   "port": port, "bootstrap_token": token, "watcher": i == 0}
            path = work / f"control{i}.json"
            path.write_text(json.dumps(cfg))
            log = open(work / f"control{i}.log", "ab")  # noqa: SIM115 - owned by the child
            self.procs.append(subprocess.Popen([sys.executable, "-m", "dsec.control", "--config", str(path)],
                                               stdout=log, stderr=log, stdin=subprocess.DEVNULL))
            url = f"http://127.0.0.1:{port}"
            await _healthy(url + "/healthz", self.procs)
            self.urls.append(url)

    async def stop(self) -> None:
        import signal

        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                await asyncio.to_thread(p.wait, 30)
            except subprocess.TimeoutExpired:
                p.kill()


async def _healthy(url: str, procs: list[subprocess.Popen[bytes]]) -> None:
    import httpx

    for _ in range(600):
        if any(p.poll() is not None for p in procs):
            raise RuntimeError(f"a control-plane replica exited while starting (its log is beside {url})")
        with contextlib.suppress(httpx.HTTPError):
            async with httpx.AsyncClient() as h:
                if (await h.get(url, timeout=1)).status_code < 500:
                    return
        await asyncio.sleep(0.1)
    raise RuntimeError(f"{url} did not come up")


# ------------------------------------------------------------------ load ----


def _spec_doc() -> dict[str, Any]:
    return {"image": {"base": LAYER}, "resources": {"cpu": 0.25, "memory": 64 << 20, "disk": 64 << 20}}


async def _worker(args: dict[str, Any]) -> dict[str, Any]:
    """One load process: ``n`` creates through the SDK once the parent says go (a line on stdin)."""
    from dsec.sdk import AsyncClient
    from dsec.sdk.leases import AHEAD_SLOTS
    from dsec.spec import SandboxSpec

    spec = SandboxSpec.model_validate(_spec_doc())
    mode, n, conc = args["mode"], int(args["n"]), int(args["concurrency"])
    lat: list[float] = []
    done: list[float] = []
    errors: dict[str, int] = {}
    ahead = AHEAD_SLOTS if mode == "independent" else 0  # single: one control-plane create each
    async with AsyncClient(args["url"], args["token"], timeout=120, lease_ahead=ahead) as c:
        for _ in range(3):  # connections and caches warm
            await c.create(spec, labels={"bench": "warm"})
        loop = asyncio.get_running_loop()
        print("ready", flush=True)
        await loop.run_in_executor(None, sys.stdin.readline)
        t0 = time.perf_counter()
        cpu0 = time.process_time()
        if mode in ("single", "independent"):
            sem = asyncio.Semaphore(conc)

            async def one() -> None:
                async with sem:
                    s = time.perf_counter()
                    try:
                        await c.create(spec, labels={"bench": mode})
                        now = time.perf_counter()
                        lat.append((now - s) * 1000)
                        done.append(now - t0)
                    except Exception as exc:
                        k = f"{type(exc).__name__}: {str(exc)[:120]}"
                        errors[k] = errors.get(k, 0) + 1

            await asyncio.gather(*(one() for _ in range(n)))
        else:
            async for o in c.create_many(spec, n, concurrency=conc, labels={"bench": "lease"}):
                done.append(time.perf_counter() - t0)
                if not o.ok:
                    k = f"{type(o.error).__name__}: {str(o.error)[:120]}"
                    errors[k] = errors.get(k, 0) + 1
        wall = time.perf_counter() - t0
        cpu = time.process_time() - cpu0
    return {"made": n - sum(errors.values()), "errors": errors, "wall_s": wall, "cpu_s": cpu,
            "p50_ms": percentile(lat, 50) if lat else None,
            "done_s": [round(t, 4) for t in done], "lat_ms": [round(x, 3) for x in downsample(lat, 2000)]}


def _recorded(db_url: str, mode: str) -> int:
    """Sandboxes of this phase the store has recorded (with their ids: reservations not counted)."""
    import psycopg
    from sqlalchemy.engine import make_url

    u = make_url(db_url)
    with psycopg.connect(host=str(u.query["host"]), port=int(str(u.query["port"])), user=u.username,
                         dbname=u.database) as c:
        row = c.execute("SELECT count(*) FROM sandboxes WHERE id IS NOT NULL AND labels->>'bench' = %s",
                        (mode,)).fetchone()
    return int(row[0]) if row else 0


async def _run_phase(mode: str, urls: list[str], token: str, *, n: int, workers: int, concurrency: int,
                     pids: dict[str, list[int]], db_url: str, say: Say,
                     series: SeriesData | None = None) -> dict[str, Any]:
    """``workers`` load processes spread over the replicas; returns the rate and the CPU split
    (and puts the phase's answer times and latencies in ``series``)."""
    per = n // workers
    procs = []
    for i in range(workers):
        args = {"mode": mode, "n": per, "concurrency": concurrency, "url": urls[i % len(urls)], "token": token}
        p = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "dsec.bench.cluster", "--worker", json.dumps(args),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
        procs.append(p)
    for p in procs:
        assert p.stdout is not None
        line = await p.stdout.readline()
        if line.strip() != b"ready":
            raise RuntimeError(f"a load worker failed to start: {line!r}")
    groups = dict(pids)
    def sample() -> dict[str, float]:
        return {k: sum(cpu_s(x, children=k == "postgres") for x in v) for k, v in groups.items()}

    before = sample()
    t0 = time.perf_counter()
    for p in procs:
        assert p.stdin is not None
        p.stdin.write(b"go\n")
        await p.stdin.drain()
    outs = []
    for p in procs:
        assert p.stdout is not None
        outs.append(json.loads((await p.stdout.readline()).decode()))
    answered = time.perf_counter() - t0
    made = sum(o["made"] for o in outs)
    # done when the control plane has recorded every one (lease creates are reported by the
    # edges after the SDK has its answer): the rate counts the control plane's whole work
    deadline = time.monotonic() + 120
    while await asyncio.to_thread(_recorded, db_url, mode) < made and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    wall = time.perf_counter() - t0
    recorded = await asyncio.to_thread(_recorded, db_url, mode)
    after = sample()
    for p in procs:
        await p.wait()
    errors: dict[str, int] = {}
    for o in outs:
        for k, v in o["errors"].items():
            errors[k] = errors.get(k, 0) + v
    res: dict[str, Any] = {"rate": made / wall, "made": made, "recorded": recorded, "wall_s": wall,
                           "answered_per_s": made / answered, "errors": sum(errors.values())}
    if errors:
        res["error_kinds"] = "; ".join(f"{k} x{v}" for k, v in sorted(errors.items()))
    if series is not None:
        series["done_s"] = sorted(t for o in outs for t in o.get("done_s", ()))
        series["lat_ms"] = [x for o in outs for x in o.get("lat_ms", ())]
    p50s = [o["p50_ms"] for o in outs if o["p50_ms"] is not None]
    if p50s:
        res["p50_ms"] = sum(p50s) / len(p50s)
    used = {k: after[k] - before[k] for k in groups}
    used["clients"] = sum(o["cpu_s"] for o in outs)
    for k, v in used.items():
        res[f"cpu_ms_per_create_{k}"] = v * 1000 / max(made, 1)
    res["cpu_busy_frac"] = sum(used.values()) / wall / (os.cpu_count() or 1)
    say(f"  {mode}: {made} creates recorded in {wall:.2f} s = {made / wall:,.0f}/s (answered in {answered:.2f} s), "
        f"errors {sum(errors.values())}; "
        f"CPU ms per create: " + ", ".join(f"{k} {res[f'cpu_ms_per_create_{k}']:.3f}" for k in used))
    return res


async def _cluster(pg: Any, work: Path, *, replicas: int, edges: int, modes: list[str], n: dict[str, int],
                   workers: int, concurrency: int, say: Say,
                   series: dict[str, SeriesData] | None = None) -> dict[str, Any]:
    from dsec.bench.standin import StandInEdge
    from dsec.http import auth

    key = auth.new_key()
    token = "dsk_" + secrets.token_urlsafe(32)
    db = pg.create_database(f"bench_{replicas}r_{secrets.token_hex(3)}")
    ctl = _Replicas()
    stand = [StandInEdge(f"s{i + 1}", key, layers=[LAYER]) for i in range(edges)]
    out: dict[str, Any] = {}
    try:
        await ctl.start(work / f"r{replicas}", replicas, db, key, token)
        for i, e in enumerate(stand):
            await e.start()
            # each edge registers with and reports to one replica, spread over them (a deployment's
            # edges reach the replicas through a load balancer)
            url = ctl.urls[i % len(ctl.urls)]
            await e.register(url, report_urls=[url, *(u for u in ctl.urls if u != url)])
        pids = {"replicas": [p.pid for p in ctl.procs], "postgres": pg.server_pids()[:1], "edges": [os.getpid()]}
        for mode in modes:
            say(f"cluster: {replicas} replica(s), {edges} stand-in edges, {n[mode]} creates ({mode}), "
                f"{workers} client processes x {concurrency} in flight")
            phase_series: SeriesData | None = None if series is None else series.setdefault(mode, {})
            out[mode] = await _run_phase(mode, ctl.urls, token, n=n[mode], workers=workers,
                                         concurrency=concurrency, pids=pids, db_url=db, say=say,
                                         series=phase_series)
    finally:
        await ctl.stop()
        for e in stand:
            await e.stop()
    return out


KEY_OF_MODE = {"lease": "control_creates", "independent": "control_independent_creates",
               "single": "control_single_creates"}
"""Result key prefix per mode: the issue's ``control_creates_per_s_<n>replica(s)`` is the SDK's
bulk path (``create_many``: a lease); independent ``create()`` calls of one spec (leases held
ahead, growing with the burst) and one control-plane create per sandbox (``lease_ahead=0``)
have their own keys beside it."""


def run(*, quick: bool = False, say: Say = print, modes: tuple[str, ...] = ("lease", "independent", "single"),
        replicas: tuple[int, ...] = (1, 2), edges: int = 4, series: SeriesData | None = None) -> dict[str, Any]:
    """The suite; ``series``, when given, receives each phase's answer times and latencies
    under ``"phases"`` (``"<mode> <tag>"``, e.g. ``"lease 1replica"``)."""
    from dsec.bench.postgres import temp_postgres, unavailable

    why = unavailable()
    if why is not None:
        raise RuntimeError(f"dsec bench cluster needs PostgreSQL: {why}")
    for m in PHASE_MODULES:
        importlib.import_module(m)
    n = 3000 if quick else 20000
    per_mode = {"lease": n, "independent": n // 2, "single": n // 4}
    """The per-sandbox paths are slower: fewer creates keep a full run within minutes."""
    results: dict[str, Any] = {"quick": quick, "edge_kind": EDGE_KIND, "edges": edges,
                               "store": "postgresql (throwaway, local socket, fsync on)", "cores": os.cpu_count(),
                               "load1_before": os.getloadavg()[0]}

    async def main() -> None:
        with tempfile.TemporaryDirectory(prefix="dsec-bench-cluster-") as tmp, temp_postgres() as pg:
            for r in replicas:
                tag = f"{r}replica{'s' if r > 1 else ''}"
                per_phase: dict[str, SeriesData] = {}
                got = await _cluster(pg, Path(tmp), replicas=r, edges=edges, modes=list(modes), n=per_mode,
                                     workers=2 * r, concurrency=64, say=say, series=per_phase)
                if series is not None:
                    for mode, data in per_phase.items():
                        series.setdefault("phases", {})[f"{mode} {tag}"] = data
                for mode, figures in got.items():
                    pre = KEY_OF_MODE[mode]
                    results[f"{pre}_per_s_{tag}"] = figures.pop("rate")
                    for k, v in figures.items():
                        results[f"{pre}_{k}_{tag}"] = v

    from dsec.http import loop as dsec_loop

    dsec_loop.run(main())
    results["load1_after"] = os.getloadavg()[0]
    for name, phase in EXTRA_PHASES.items():
        say(f"cluster: phase {name}")
        results.update(phase(quick=quick, say=say))
    return results


_MODE_LABEL = {"lease": "create_many (lease)", "independent": "create(), leases ahead", "single": "create(), one each"}


def figures(results: Mapping[str, Any], series: SeriesData) -> list[Figure]:
    """The report's charts (:mod:`dsec.bench.report`): creates answered per second through
    each phase, create latency histograms, the rates and the CPU split per create."""
    figs: list[Figure] = []
    phases: Mapping[str, SeriesData] = series.get("phases", {})
    curves = [(name, rate_over_time(p["done_s"], 40)) for name, p in phases.items() if len(p.get("done_s", ())) >= 2]
    if curves:
        figs.append(Figure(
            title="Creates answered per second through each phase", kind="line", xlabel="seconds since the go",
            ylabel="creates answered / s", series=tuple(Series(name, x, y) for name, (x, y) in curves),
            caption=f"Edges: {results.get('edge_kind', '?')}; {results.get('cores', '?')} cores shared by replicas, "
                    "PostgreSQL and the load. The flat keys count to the last create recorded in the store.",
            name="cluster-rate-curve"))
    lats = [(name, p["lat_ms"]) for name, p in phases.items() if p.get("lat_ms")]
    if lats:
        figs.append(Figure(title="Create latency through the SDK (create() calls)", kind="hist", xlabel="ms",
                           ylabel="creates", logx=True, bins=40,
                           series=tuple(Series(name, x=v) for name, v in lats), name="cluster-latency"))
    tags = sorted({k.rsplit("_", 1)[1] for k in results if k.startswith("control_") and "_per_s_" in k})
    modes = [m for m in KEY_OF_MODE if any(f"{KEY_OF_MODE[m]}_per_s_{t}" in results for t in tags)]
    if tags and modes:
        figs.append(Figure(
            title="Creates per second, by path and replicas", kind="bar",
            categories=tuple(_MODE_LABEL[m] for m in modes), ylabel="creates / s (recorded)",
            series=tuple(Series(t, y=tuple(float(results.get(f"{KEY_OF_MODE[m]}_per_s_{t}", 0.0)) for m in modes))
                         for t in tags), name="cluster-rates"))
        groups = ("replicas", "postgres", "edges", "clients")
        cats = [(m, t) for t in tags for m in modes if f"{KEY_OF_MODE[m]}_cpu_ms_per_create_replicas_{t}" in results]
        if cats:
            figs.append(Figure(
                title="CPU per create, by process", kind="bar",
                categories=tuple(f"{m} {t}" for m, t in cats), ylabel="CPU ms per create",
                series=tuple(Series(g, y=tuple(float(results.get(f"{KEY_OF_MODE[m]}_cpu_ms_per_create_{g}_{t}", 0.0))
                                               for m, t in cats)) for g in groups),
                caption="Read from /proc over each phase: what bounds the rate on this machine.",
                name="cluster-cpu"))
    return figs


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        from dsec.http import loop as dsec_loop

        print(json.dumps(dsec_loop.run(_worker(json.loads(sys.argv[2])))), flush=True)
