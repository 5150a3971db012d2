"""``dsec bench runtime``: the node runtime beside crun and bwrap, in one run.

Every figure is measured on the same busybox rootfs in the same process run,
so ratios hold on a noisy machine. Figures, not assertions.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dsec.bench.stats import percentile

Progress = Callable[[str], None]


def _mem_used_bytes() -> int:
    info: dict[str, int] = {}
    with open("/proc/meminfo") as f:
        for line in f:
            k, v = line.split(":", 1)
            info[k] = int(v.split()[0]) * 1024
    return info["MemTotal"] - info["MemAvailable"]


def _ensure_pid_max(need: int, say: Progress) -> None:
    path = Path("/proc/sys/kernel/pid_max")
    cur = int(path.read_text())
    if cur < need:
        path.write_text(str(min(4194304, need * 2)))
        say(f"raised kernel.pid_max from {cur} to {path.read_text().strip()} for this run")


def debian_rootfs(cache: Path, say: Progress) -> Path:
    """A Debian bookworm minbase rootfs with python3, made once and cached (debootstrap, ~1 min)."""
    from dsec.images.debootstrap import find_mirror, run_debootstrap, slim_rootfs

    target = cache / "debian-bookworm-python3"
    done = target / ".dsec-complete"
    if done.exists():
        return target
    if target.exists():
        import shutil

        shutil.rmtree(target)
    say(f"building a Debian rootfs for the benchmark in {target} (debootstrap, once)")
    cache.mkdir(parents=True, exist_ok=True)
    run_debootstrap(target, suite="bookworm", variant="minbase", packages=("python3",), mirror=find_mirror("bookworm"))
    slim_rootfs(target)
    done.write_text("ok\n")
    return target


async def _dsec_latency(rt: Any, spec: Any, n: int) -> tuple[list[float], list[float]]:
    lat: list[float] = []
    full: list[float] = []
    for _ in range(n):
        t0 = time.perf_counter()
        sb = await rt.create(spec)
        await rt.exec(sb.id, ["/bin/true"])
        t1 = time.perf_counter()
        await rt.destroy(sb.id)
        lat.append((t1 - t0) * 1000)
        full.append((time.perf_counter() - t0) * 1000)
    return lat, full


async def _dsec_side(rootfs: Path, work: Path, *, n_lat: int, n_keep: int, n_exec: int, say: Progress,
                     debian: Path | None = None) -> dict[str, float]:
    from dsec.backends.container.runtime import ContainerRuntime
    from dsec.images.build import build_from_dir
    from dsec.spec import ImageRef, Resources, SandboxSpec

    out: dict[str, float] = {}
    async with ContainerRuntime(name="bench", state_dir=work / "state", run_dir=work / "run") as rt:
        layer = await asyncio.to_thread(build_from_dir, rt.store, rootfs, name="bench-busybox", tag="latest", kind="base")
        spec = SandboxSpec(
            image=ImageRef(base=layer.digest),
            resources=Resources(cpu=1, memory=256 << 20, pids=256, disk=64 << 20),
        )
        # Warm up: first mount of the layer, page cache, spawner start.
        for _ in range(3):
            sb = await rt.create(spec)
            await rt.exec(sb.id, ["/bin/true"])
            await rt.destroy(sb.id)

        say(f"dsec: create + first exec, {n_lat} samples")
        lat, full = await _dsec_latency(rt, spec, n_lat)
        out["create_p50_ms"] = percentile(lat, 50)
        out["create_p95_ms"] = percentile(lat, 95)
        # `crun run` and bwrap also tear the sandbox down before they return:
        # this is the like-for-like figure.
        out["create_exec_destroy_p50_ms"] = percentile(full, 50)
        out["create_exec_destroy_p95_ms"] = percentile(full, 95)

        if debian is not None:
            say(f"dsec: create + first exec on the Debian rootfs, {n_lat} samples")
            deb = await asyncio.to_thread(build_from_dir, rt.store, debian, name="bench-debian", tag="latest", kind="base")
            deb_spec = SandboxSpec(image=ImageRef(base=deb.digest), resources=spec.resources)
            await _dsec_latency(rt, deb_spec, 3)
            dlat, dfull = await _dsec_latency(rt, deb_spec, n_lat)
            out["debian_create_p50_ms"] = percentile(dlat, 50)
            out["debian_create_exec_destroy_p50_ms"] = percentile(dfull, 50)

        say(f"dsec: exec round trip, {n_exec} samples")
        sb = await rt.create(spec)
        ex: list[float] = []
        for _ in range(n_exec):
            t0 = time.perf_counter()
            await rt.exec(sb.id, ["/bin/true"])
            ex.append((time.perf_counter() - t0) * 1000)
        out["exec_p50_ms"] = percentile(ex, 50)
        out["exec_p95_ms"] = percentile(ex, 95)
        # Throughput with both cores busy: many execs in flight over a few sandboxes.
        others = [sb] + [await rt.create(spec) for _ in range(3)]
        done = 0
        stop_at = time.perf_counter() + 3.0

        async def worker(i: int) -> None:
            nonlocal done
            target = others[i % len(others)].id
            while time.perf_counter() < stop_at:
                await rt.exec(target, ["/bin/true"])
                done += 1

        t0 = time.perf_counter()
        await asyncio.gather(*(worker(i) for i in range(16)))
        out["execs_per_s"] = done / (time.perf_counter() - t0)
        for o in others:
            await rt.destroy(o.id)

        say(f"dsec: create-and-keep {n_keep} sandboxes, each with a shell waiting on stdin")
        mem0 = _mem_used_bytes()
        devnull = os.open("/dev/null", os.O_RDWR | os.O_CLOEXEC)
        stdins: list[int] = []
        ids: list[str] = []
        stamps: list[float] = []
        sem = asyncio.Semaphore(8)

        async def keep() -> None:
            async with sem:
                s = await rt.create(spec)
                r, w = os.pipe2(os.O_CLOEXEC)
                try:
                    await rt.start_process(s.id, ["/bin/sh"], stdin=r, stdout=devnull, stderr=devnull)
                finally:
                    os.close(r)
                stdins.append(w)
                ids.append(s.id)
                stamps.append(time.perf_counter())

        t_start = time.perf_counter()
        try:
            await asyncio.gather(*(keep() for _ in range(n_keep)))
            total = time.perf_counter() - t_start
            stamps.sort()
            dec = max(1, n_keep // 10)
            first = dec / (stamps[dec - 1] - t_start)
            last = dec / (stamps[-1] - stamps[-dec - 1]) if n_keep > dec else first
            out["create_rate"] = n_keep / total
            out["create_rate_first_decile"] = first
            out["create_rate_last_decile"] = last
            out["create_rate_last_decile_ratio"] = last / first
            await asyncio.sleep(1.0)  # let lazily freed memory settle
            out["idle_mib_per_sandbox"] = (_mem_used_bytes() - mem0) / n_keep / (1 << 20)
            out["idle_n"] = n_keep
            say(f"dsec: teardown of {n_keep}")
            tsem = asyncio.Semaphore(16)

            async def kill(i: str) -> None:
                async with tsem:
                    await rt.destroy(i)

            for w in stdins:
                os.close(w)
            stdins.clear()
            t0 = time.perf_counter()
            await asyncio.gather(*(kill(i) for i in ids))
            out["teardown_rate"] = n_keep / (time.perf_counter() - t0)
        finally:
            for w in stdins:
                os.close(w)
            os.close(devnull)
        with contextlib.suppress(Exception):
            rt.store.remove(layer.digest)
    return out


def run(*, quick: bool = False, n_keep: int | None = None, debian: bool | None = None,
        cache_dir: Path | None = None, say: Progress = print) -> dict[str, Any]:
    from dsec.bench import baselines

    n_lat = 30 if quick else 200
    n_exec = 50 if quick else 300
    keep = n_keep if n_keep is not None else (200 if quick else 2000)
    n_base_keep = min(keep, 200 if quick else 2000)
    _ensure_pid_max(keep * 4 + 2000, say)
    results: dict[str, Any] = {"quick": quick}
    with tempfile.TemporaryDirectory(prefix="dsec-bench-") as tmp:
        work = Path(tmp)
        rootfs = baselines.prepare_busybox_rootfs(work / "rootfs")
        deb_root = None
        if debian if debian is not None else not quick:
            cache = cache_dir or Path(os.environ.get("DSEC_STATE_DIR", "/var/lib/dsec")) / "cache"
            deb_root = debian_rootfs(cache, say)
        results.update(asyncio.run(_dsec_side(rootfs, work, n_lat=n_lat, n_keep=keep, n_exec=n_exec, say=say,
                                              debian=deb_root)))
        if deb_root is not None:
            say(f"crun and bwrap: create + first exec on the Debian rootfs, {n_lat} samples")
            results["debian_crun_create_p50_ms"] = percentile(baselines.crun_create_latency(deb_root, n_lat), 50)
            results["debian_bwrap_create_p50_ms"] = percentile(baselines.bwrap_create_latency(deb_root, n_lat), 50)
            results["debian_create_p50_vs_crun"] = results["debian_create_p50_ms"] / results["debian_crun_create_p50_ms"]

        say(f"crun: create + first exec, {n_lat} samples")
        crun_lat = baselines.crun_create_latency(rootfs, n_lat)
        results["crun_create_p50_ms"] = percentile(crun_lat, 50)
        results["crun_create_p95_ms"] = percentile(crun_lat, 95)
        say(f"bwrap: create + first exec, {n_lat} samples")
        bw_lat = baselines.bwrap_create_latency(rootfs, n_lat)
        results["bwrap_create_p50_ms"] = percentile(bw_lat, 50)
        results["bwrap_create_p95_ms"] = percentile(bw_lat, 95)
        say(f"crun: exec round trip, {n_exec} samples")
        results["crun_exec_p50_ms"] = percentile(baselines.crun_exec_latency(rootfs, n_exec), 50)
        say(f"crun: create-and-keep {n_base_keep}")
        cr = baselines.crun_create_rate(rootfs, n_base_keep)
        results["crun_create_rate"] = cr["rate"]
        results["crun_create_rate_last_decile_ratio"] = cr.get("last_decile_ratio", float("nan"))
        results["crun_teardown_rate"] = cr.get("teardown_rate", float("nan"))
        say(f"bwrap: create-and-keep {n_base_keep}")
        br = baselines.bwrap_create_rate(rootfs, n_base_keep)
        results["bwrap_create_rate"] = br["rate"]
        results["bwrap_create_rate_last_decile_ratio"] = br.get("last_decile_ratio", float("nan"))

    results["create_p50_vs_crun"] = results["create_p50_ms"] / results["crun_create_p50_ms"]
    results["create_exec_destroy_p50_vs_crun"] = results["create_exec_destroy_p50_ms"] / results["crun_create_p50_ms"]
    results["create_p50_vs_bwrap"] = results["create_p50_ms"] / results["bwrap_create_p50_ms"]
    results["create_rate_vs_crun"] = results["create_rate"] / results["crun_create_rate"]
    results["exec_p50_vs_crun"] = results["exec_p50_ms"] / results["crun_exec_p50_ms"]
    results["cpus"] = os.cpu_count() or 0
    return results
