"""``dsec bench abuse``: the abuse suite as figures (issue 5 §3 and §5).

Runs every case of :mod:`dsec.bench.abuse_cases` (the same ones ``tests/abuse``
asserts) against one runtime while K neighbour sandboxes run ``/bin/true`` in a
loop, and writes a flat JSON object: per case ``case_<name>`` (true when
contained; null when skipped) and ``neighbour_ratio_<name>`` (neighbours' exec
p50 during the case ÷ their quiet p50), the totals, and in the same run the
network/stage figures: sandbox create p50 with a network policy ÷ without,
``set_policy`` p50 and the stage-switch p50. A real edge (its own runtime, HTTP
on loopback) serves the edge cases. Figures, not assertions.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dsec.bench.abuse_cases import (
    CASES,
    EdgeTarget,
    Lab,
    NeighbourLoad,
    Outcome,
    network_supported,
    outcomes_json,
    run_case,
)
from dsec.bench.abuse_helper import build_helper
from dsec.bench.stats import percentile

Progress = Callable[[str], None]
MiB = 1 << 20


async def _network_figures(rt: Any, lab: Lab, n: int, say: Progress) -> dict[str, Any]:
    """Create p50 with a policy ÷ without (interleaved, same run) and set_policy p50."""
    from dsec.spec import NetRule, NetworkPolicy

    out: dict[str, Any] = {"create_with_policy_ratio": None, "set_policy_p50_ms": None,
                           "create_plain_p50_ms": None, "create_with_policy_p50_ms": None}
    if not network_supported(rt):
        out["network_note"] = "network policies not in the runtime: figures not measured"
        return out
    pol_a = NetworkPolicy(rules=(NetRule(cidr="192.0.2.1/32", ports=("443",)),))
    pol_b = NetworkPolicy(rules=(NetRule(cidr="198.51.100.0/24", ports=("80", "8000-8100")),))
    plain = lab.spec()
    with_pol = plain.model_copy(update={"network": pol_a})
    say(f"network: create with / without a policy, {n} each, interleaved")
    for spec in (plain, with_pol, with_pol):  # warm-up: pools, first veth
        rec = await rt.create(spec)
        await rt.destroy(rec.id)
    # An edge configured with a network fills its namespace pool at start; this runtime
    # started it on the first networked create above. Measure once it is full, not
    # while the refill competes with the creates being timed.
    for _ in range(300):
        if rt.net.pool_ready >= rt.net.config.pool_size:
            break
        await asyncio.sleep(0.05)
    t_plain: list[float] = []
    t_pol: list[float] = []
    for _ in range(n):
        for spec, series in ((plain, t_plain), (with_pol, t_pol)):
            t0 = time.perf_counter()
            rec = await rt.create(spec)
            series.append((time.perf_counter() - t0) * 1000)
            await rt.destroy(rec.id)
            await asyncio.sleep(0.01)  # let the namespace pool refill as it would between real creates
    out["create_plain_p50_ms"] = percentile(t_plain, 50)
    out["create_with_policy_p50_ms"] = percentile(t_pol, 50)
    out["create_with_policy_ratio"] = out["create_with_policy_p50_ms"] / out["create_plain_p50_ms"]
    say(f"network: set_policy, {n * 2} switches")
    rec = await rt.create(with_pol)
    try:
        sw: list[float] = []
        for i in range(n * 2):
            t0 = time.perf_counter()
            await rt.set_policy(rec.id, pol_b if i % 2 == 0 else pol_a)
            sw.append((time.perf_counter() - t0) * 1000)
        out["set_policy_p50_ms"] = percentile(sw, 50)
        out["set_policy_p95_ms"] = percentile(sw, 95)
    finally:
        await rt.destroy(rec.id)
    return out


async def _stage_figures(rt: Any, lab: Lab, n: int, say: Progress) -> dict[str, Any]:
    try:
        from dsec.bench.stages import measure_stages
    except ImportError:
        return {"stage_switch_p50_ms": None, "stage_note": "stages not in the runtime: figure not measured"}
    say(f"stages: set_stage, {n * 2} switches")
    res = await measure_stages(rt, lab.spec(), n=n)
    return dict(res)


class _EdgeProcess:
    """``python -m dsec.edge`` on a free loopback port, stopped with SIGTERM."""

    def __init__(self, proc: subprocess.Popen[bytes], url: str) -> None:
        self.proc = proc
        self.url = url

    @classmethod
    async def start(cls, work: Path, key: bytes, state: Path) -> _EdgeProcess:
        import httpx

        with socket.socket() as sk:
            sk.bind(("127.0.0.1", 0))
            port = int(sk.getsockname()[1])
        cfg = {"edge_id": "abuse", "cluster_key": key.hex(), "port": port, "state_dir": str(state),
               "run_dir": str(work / "run"), "runtime_name": "bench-abuse-edge", "destroy_on_shutdown": True}
        cfg_path = work / "abuse-edge.json"
        cfg_path.write_text(json.dumps(cfg))
        log = open(work / "abuse-edge.log", "ab")  # noqa: SIM115 - owned by the child
        proc = subprocess.Popen([sys.executable, "-m", "dsec.edge", "--config", str(cfg_path)],
                                stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}"
        edge = cls(proc, url)
        for _ in range(300):
            if proc.poll() is not None:
                raise RuntimeError(f"the abuse edge exited at start (see {work / 'abuse-edge.log'})")
            with contextlib.suppress(httpx.HTTPError):
                async with httpx.AsyncClient() as h:
                    if (await h.get(url + "/metrics", timeout=1)).status_code == 200:
                        return edge
            await asyncio.sleep(0.1)
        await edge.stop()
        raise RuntimeError("the abuse edge did not come up")

    async def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.to_thread(self.proc.wait, 60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            await asyncio.to_thread(self.proc.wait)


async def _run(work: Path, *, quick: bool, k: int, only: list[str] | None, say: Progress) -> dict[str, Any]:
    from dsec.backends.container.runtime import ContainerRuntime
    from dsec.edge.testing import prepare_busybox
    from dsec.images.build import build_busybox

    cache = Path(os.environ.get("DSEC_STATE_DIR", "/var/lib/dsec")) / "cache"
    try:
        helper = build_helper(cache)
    except OSError:
        helper = build_helper(work / "cache")
    results: dict[str, Any] = {"quick": quick, "k_neighbours": k, "cpus": os.cpu_count() or 0,
                               "date": datetime.date.today().isoformat(),
                               "load_avg_start": round(os.getloadavg()[0], 2)}
    key = secrets.token_bytes(32)
    edge_state = work / "edge-state"
    prepare_busybox(edge_state, name="abuse-busybox", tag="latest")  # the same name as the lab's image
    # The edge runs in its own process, as deployed: the edge cases then load it, not the
    # process that drives the neighbours (a thread here would share its GIL with them).
    edge = await _EdgeProcess.start(work, key, edge_state)
    try:
        async with ContainerRuntime(name="bench-abuse", state_dir=work / "state", run_dir=work / "run") as rt:
            await asyncio.to_thread(build_busybox, rt.store, name="abuse-busybox", tag="latest")
            lab = Lab(rt=rt, image="abuse-busybox:latest", work=work / "lab", helper=helper,
                      edge=EdgeTarget(edge.url, key), quick=quick)
            await lab.setup(k)
            try:
                load = NeighbourLoad(rt, lab.neighbours)
                load.start()
                try:
                    quiet_s = 3.0 if quick else 10.0
                    say(f"neighbours: {k} sandboxes running /bin/true in a loop; quiet baseline {quiet_s:.0f} s")
                    baseline = await load.baseline(quiet_s)
                    say(f"  quiet neighbour exec p50: {baseline:.2f} ms" if baseline else "  no quiet samples")
                    outcomes: list[Outcome] = []
                    for c in CASES:
                        if only and c.name not in only:
                            continue
                        o = await run_case(lab, c, load=load)
                        outcomes.append(o)
                        _say_outcomes([o], baseline, say)
                    end_baseline = await load.baseline(quiet_s / 2)
                    results["neighbour_p50_quiet_end_ms"] = end_baseline
                finally:
                    await load.stop()
                results.update(outcomes_json(outcomes, baseline))
                n = 10 if quick else 50
                results.update(await _network_figures(rt, lab, n, say))
                results.update(await _stage_figures(rt, lab, n, say))
            finally:
                await lab.close()
    finally:
        with contextlib.suppress(Exception):
            await edge.stop()
    results["load_avg_end"] = round(os.getloadavg()[0], 2)
    return results


SUITES = ("container", "fncall", "gvisor")
"""The red-team suites, each against its backend: the container's cases (this module's
:data:`CASES`), FnCall's (:mod:`dsec.bench.abuse_fncall`) and gVisor's (:mod:`dsec.bench.abuse_gvisor`)."""


def _say_outcomes(outcomes: list[Outcome], baseline: float | None, say: Progress) -> None:
    for o in outcomes:
        verdict = "skipped" if o.skipped else ("contained" if o.contained else "NOT CONTAINED")
        ratio = (f"{o.neighbour_p50_ms / baseline:.2f}x" if o.neighbour_p50_ms and baseline else "-")
        say(f"  {o.name:<32} {verdict:<14} neighbours {ratio:>6}  ({o.seconds:.1f}s)")
        for f in o.failures()[:5]:
            say(f"      {f}")


async def _gvisor_part(work: Path, *, quick: bool, only: list[str] | None, say: Progress) -> dict[str, Any]:
    import shutil

    from dsec.bench.abuse_gvisor import GVISOR_CASES, gvisor_outcomes_json, run_gvisor_suite

    names = [c.name for c in GVISOR_CASES if not only or c.name in only]
    if not names:
        return {}
    if shutil.which("runsc") is None:
        say("gvisor: SUITE NOT RUN: runsc is not installed (scripts/setup.sh installs it)")
        return {"gvisor_note": "runsc not installed", "gvisor_cases_total": 0}
    say(f"gvisor: {len(names)} cases against the gVisor backend")
    outcomes, baseline = await run_gvisor_suite(work, quick=quick, only=names, say=say)
    _say_outcomes(outcomes, baseline, say)
    return gvisor_outcomes_json(outcomes, baseline)


def _fncall_part(work: Path, *, quick: bool, only: list[str] | None, say: Progress) -> dict[str, Any]:
    from dsec.bench.abuse_fncall import FNCALL_CASES, fncall_outcomes_json, run_fncall_suite

    names = [c.name for c in FNCALL_CASES if not only or c.name in only or f"fncall_{c.name}" in only]
    if not names:
        return {}
    say(f"fncall: {len(names)} cases against a FnCall worker (its neighbours are calls on the same worker)")
    outcomes, baseline = run_fncall_suite(work, quick=quick, only=names, say=say)
    _say_outcomes(outcomes, baseline, say)
    return fncall_outcomes_json(outcomes, baseline)


def _totals(results: dict[str, Any], suites: list[str]) -> None:
    """All suites together: what a reader checks first."""
    prefix = {"container": "", "fncall": "fncall_", "gvisor": "gvisor_"}
    total = contained = 0
    missing: list[str] = []
    for suite in suites:
        t = results.get(f"{prefix[suite]}cases_total")
        if t is None:
            continue
        total += int(t)
        contained += int(results.get(f"{prefix[suite]}cases_contained") or 0)
        if results.get(f"{prefix[suite]}cases_not_contained"):
            missing.append(str(results[f"{prefix[suite]}cases_not_contained"]))
    results["all_cases_total"] = total
    results["all_cases_contained"] = contained
    results["all_contained"] = total > 0 and total == contained
    results["all_cases_not_contained"] = ",".join(missing)


def run(*, quick: bool = False, k_neighbours: int | None = None, only: list[str] | None = None,
        suites: list[str] | None = None, say: Progress = print) -> dict[str, Any]:
    k = k_neighbours if k_neighbours is not None else (2 if quick else 4)
    chosen = list(suites or SUITES)
    bad = [x for x in chosen if x not in SUITES]
    if bad:
        raise ValueError(f"unknown suite {', '.join(bad)}: choose from {', '.join(SUITES)}")
    results: dict[str, Any] = {"suites": ",".join(chosen)}
    with tempfile.TemporaryDirectory(prefix="dsec-bench-abuse-") as tmp:
        if "container" in chosen and (not only or any(c.name in only for c in CASES)):
            results.update(asyncio.run(_run(Path(tmp), quick=quick, k=k, only=only, say=say)))
        if "fncall" in chosen:
            results.update(_fncall_part(Path(tmp), quick=quick, only=only, say=say))
        if "gvisor" in chosen:
            results.update(asyncio.run(_gvisor_part(Path(tmp), quick=quick, only=only, say=say)))
    _totals(results, chosen)
    return results
