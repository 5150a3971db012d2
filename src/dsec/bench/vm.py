"""``dsec bench vm``: the microVM backend beside the container backend, in one run.

Figures, not assertions (issue 24's keys). Both backends run the same busybox layer from
one store with the same spec, one after the other in this process. The host, accelerator,
QEMU build, guest kernel and guest RAM are in the output (``vm_accel``...).

- ``vm_cold_boot_ms`` (p50, ``_p95``): QEMU spawned -> the guest agent's hello, the whole
  machine (layers and upper attached), ``n_boot`` boots.
- ``vm_template_save_ms``: the template's save (device state; RAM stays in its file).
- ``vm_restore_p50_ms`` / ``_p95``: ``create()`` from the template -> the first ``exec(true)``
  answered (direct backend calls, not through the SDK: stated by ``vm_restore_path``), and
  its parts ``vm_create_p50_ms`` and ``vm_first_exec_p50_ms``; the container's
  ``container_create_exec_p50_ms`` beside it.
- ``vm_fanout10_s``: 10 creates at once, each answering ``true``.
- ``vm_exec_p50_ms``: ``exec(true)`` in a warm VM (container: ``container_exec_p50_ms``);
  ``vm_echo_ms``: the agent's round trip alone (ping).
- ``vm_idle_cpu_frac``: CPU per idle clone left running, over ``idle_window_s`` (cores),
  ``vm_idle_cpu_n`` of them. Then quiet VMs are stopped (``MicroVMConfig.idle_stop_s``) and
  clones are made up to ``vm_idle_n`` held at once: ``vm_idle_mib_per_clone`` (drop in
  MemAvailable / N), ``vm_idle_pss_mib`` (their QEMU processes' PSS per clone),
  ``vm_idle_cpu_frac_quiet_stop``, ``vm_quiet_stopped``, ``vm_quiet_resume_exec_ms`` (the
  first exec of a stopped one) and ``vm_idle_answering`` (all of them, asked once each).
- ``vm_fork8_s``: fork of a running VM into 8, each answering (``vm_fork8_data_ok``: children
  that read what the parent wrote just before).
- ``vm_pause_mem_returned_frac``: memory the pause gave back (cgroup charge before -> after)
  and ``vm_resume_first_exec_ms``.
- ``vm_sdk_pool_create_exec_p50_ms`` / ``_p95``: through the SDK on a real edge (HTTP on
  loopback) whose warm pool keeps restored VMs, create -> first ``exec(true)`` answered;
  ``vm_sdk_create_exec_p50_ms``: the same with the pool emptied (each create restores).
- ``vm_conformance_passed`` / ``_total`` (full mode): ``pytest tests/conformance -k microvm``.

Series (``run(series=...)``, the HTML report's charts: :func:`figures`): every sample behind
those percentiles, in the order taken (cold boots, restores and their parts, execs, agent
pings, creates through the SDK with and without the pool, the container's).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import platform
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from dsec.backends.common.procstat import cpu_ticks as _cpu_ticks
from dsec.bench.report import Figure, Series, SeriesData
from dsec.bench.stats import percentile

Progress = Callable[[str], None]
MiB = 1 << 20


def _quiet(_msg: str) -> None:
    pass


def _put(series: SeriesData | None, name: str, values: Sequence[float]) -> None:
    if series is not None:
        series[name] = [round(float(v), 3) for v in values]


def _mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def _pss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


async def _cold_boots(be: Any, layer_files: list[Path], n: int, say: Progress) -> list[float]:
    """Cold boots of the full machine (as a template boots), each to the agent's hello."""
    from dsec.backends.microvm.machine import Disk, RamFile, Sockets, qemu_argv
    from dsec.backends.microvm.qemu import QemuDriver
    from dsec.backends.microvm.sandbox import MicroVM
    from dsec.backends.microvm.templates import make_ext4

    out: list[float] = []
    work = be.run_dir / "coldboot"
    work.mkdir(exist_ok=True)
    machine = be._machine(vcpus=1, memory_mib=256, layers=("bench",), upper_bytes=64 * MiB)
    upper = work / "upper.raw"
    await asyncio.to_thread(make_ext4, upper, 64 * MiB)
    disks = [*(Disk(p, f"dsec-l{i}") for i, p in enumerate(layer_files)), Disk(upper, "dsec-up", readonly=False)]
    try:
        for i in range(n):
            sockets = Sockets.under(be.sock_dir, f"cold{i}")
            ram = be.ram_dir / f"cold{i}.ram"
            argv = qemu_argv(machine, disks, sockets, ram=RamFile(ram, shared=True), name=f"dsec-bench-cold{i}")
            t0 = time.perf_counter()
            vm = QemuDriver(argv, qmp_socket=sockets.qmp, log=work / "qemu.log")
            try:
                await vm.start()
                await MicroVM.wait_booted(vm, sockets, 30.0)
                out.append(time.perf_counter() - t0)
            except Exception as exc:  # a hung boot is a figure too (counted as failed)
                say(f"cold boot {i} failed: {exc}")
            finally:
                await vm.quit(timeout_s=2.0)
                for p in (sockets.qmp, sockets.agent, ram):
                    p.unlink(missing_ok=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out


async def _microvm(be: Any, spec: Any, *, n_boot: int, n_lat: int, n_exec: int, n_idle: int,
                   idle_window_s: float, say: Progress, series: SeriesData | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    files = [be.store.open_local(d) for d in reversed(be._layers_for(spec.image))]
    say(f"microvm: {n_boot} cold boots")
    boots = await _cold_boots(be, files, n_boot, say)
    out["vm_cold_boot_ms"] = percentile([b * 1000 for b in boots], 50) if boots else -1.0
    out["vm_cold_boot_p95_ms"] = percentile([b * 1000 for b in boots], 95) if boots else -1.0
    out["vm_cold_boot_failed"] = n_boot - len(boots)
    _put(series, "vm_cold_boot_ms", [b * 1000 for b in boots])

    say("microvm: template + warm-up")
    first = await be.create(spec)
    tmpl = be.templates.get_ready(first.template)
    out["vm_template_boot_ms"] = tmpl.boot_s * 1000
    out["vm_template_save_ms"] = tmpl.save_s * 1000
    await be.exec(first.id, ["true"])

    say(f"microvm: {n_lat} creates, each to its first exec")
    creates, firsts, totals, parts = [], [], [], []
    for _ in range(n_lat):
        t0 = time.perf_counter()
        rec = await be.create(spec)
        t1 = time.perf_counter()
        r = await be.exec(rec.id, ["true"])
        t2 = time.perf_counter()
        assert r.exit_code == 0, r
        creates.append((t1 - t0) * 1000)
        firsts.append((t2 - t1) * 1000)
        totals.append((t2 - t0) * 1000)
        parts.append(be._vms[rec.id].timings)
        await be.destroy(rec.id)
    out["vm_restore_path"] = "direct backend create + exec (not through the SDK)"
    out["vm_restore_p50_ms"] = percentile(totals, 50)
    out["vm_restore_p95_ms"] = percentile(totals, 95)
    out["vm_create_p50_ms"] = percentile(creates, 50)
    out["vm_first_exec_p50_ms"] = percentile(firsts, 50)
    for step in ("start", "restore", "hello", "identity", "warm"):
        out[f"vm_restore_{step}_p50_ms"] = percentile([p.get(step, 0.0) * 1000 for p in parts], 50)
        _put(series, f"vm_restore_{step}_ms", [p.get(step, 0.0) * 1000 for p in parts])
    _put(series, "vm_restore_ms", totals)
    _put(series, "vm_create_ms", creates)
    _put(series, "vm_first_exec_ms", firsts)

    say("microvm: fan-out of 10")
    t0 = time.perf_counter()

    async def one() -> str:
        rec = await be.create(spec)
        r = await be.exec(rec.id, ["true"])
        assert r.exit_code == 0, r
        return str(rec.id)

    fan = await asyncio.gather(*(one() for _ in range(10)))
    out["vm_fanout10_s"] = time.perf_counter() - t0
    for sid in fan:
        await be.destroy(sid)

    say(f"microvm: {n_exec} execs of true, and agent pings")
    ex = []
    for _ in range(n_exec):
        t0 = time.perf_counter()
        await be.exec(first.id, ["true"])
        ex.append((time.perf_counter() - t0) * 1000)
    out["vm_exec_p50_ms"] = percentile(ex, 50)
    _put(series, "vm_exec_ms", ex)
    vm = be._vms[first.id]

    async def pings() -> list[float]:
        return [await vm.agent.ping() * 1000 for _ in range(50)]

    echoes = await be.loop.call(pings())
    out["vm_echo_ms"] = percentile(echoes, 50)
    _put(series, "vm_echo_ms", echoes)

    say("microvm: fork of a running VM into 8")
    marker = os.urandom(8).hex()
    await be.exec(first.id, f"echo {marker} > /root/fork-mark")
    t0 = time.perf_counter()
    kids = await be.fork(first.id, 8)
    answers = await asyncio.gather(*(be.exec(k.id, ["cat", "/root/fork-mark"]) for k in kids))
    out["vm_fork8_s"] = time.perf_counter() - t0
    out["vm_fork8_data_ok"] = sum(1 for a in answers if a.stdout.decode().strip() == marker)
    await asyncio.gather(*(be.destroy(k.id) for k in kids))

    say("microvm: pause and resume")
    before = be.cgroups.memory_bytes(first.id)
    await be.pause(first.id)
    after = be.cgroups.memory_bytes(first.id)
    out["vm_pause_mem_returned_frac"] = (before - after) / before if before else 0.0
    t0 = time.perf_counter()
    await be.resume(first.id)
    await be.exec(first.id, ["true"])
    out["vm_resume_first_exec_ms"] = (time.perf_counter() - t0) * 1000
    await be.destroy(first.id)

    n = min(n_idle, int(_mem_available() * 0.7 / (40 * MiB)))  # ~30 MiB each, measured; headroom kept
    n_run = min(n, 20)
    say(f"microvm: {n_run} idle clones running, their CPU")
    await asyncio.sleep(2)
    base = _mem_available()
    idle = [await be.create(spec) for _ in range(n_run)]
    await asyncio.sleep(5)
    pids = [r.qemu_pid for r in idle]
    ticks0 = [_cpu_ticks(p) for p in pids]
    await asyncio.sleep(idle_window_s)
    ticks = sum(_cpu_ticks(p) - a for p, a in zip(pids, ticks0, strict=True))
    out["vm_idle_cpu_frac"] = ticks / os.sysconf("SC_CLK_TCK") / idle_window_s / max(1, n_run)
    out["vm_idle_cpu_n"] = n_run
    # Under TCG an idle guest costs ~1 % of a core: 300 running ones would take 3 cores of
    # this 2-core host. Quiet VMs are stopped (MicroVMConfig.idle_stop_s) as the rest are made.
    say(f"microvm: {n} idle clones held at once, quiet VMs stopped (MicroVMConfig.idle_stop_s=2)")
    be._quiet_watch = be.loop.submit(be._watch_quiet(2.0, be.config.idle_cpu_frac))
    for i in range(n_run, n):
        idle.append(await be.create(spec))
        if (i + 1) % 50 == 0:
            say(f"  {i + 1} of {n}")
    await asyncio.sleep(10)
    out["vm_idle_n"] = n
    out["vm_idle_mib_per_clone"] = (base - _mem_available()) / n / MiB if n else 0.0
    pids = [r.qemu_pid for r in idle]
    out["vm_idle_pss_mib"] = sum(_pss(p) for p in pids) / max(1, n) / MiB
    ticks0 = [_cpu_ticks(p) for p in pids]
    await asyncio.sleep(idle_window_s)
    ticks = sum(_cpu_ticks(p) - a for p, a in zip(pids, ticks0, strict=True))
    out["vm_idle_cpu_frac_quiet_stop"] = ticks / os.sysconf("SC_CLK_TCK") / idle_window_s / max(1, n)
    out["vm_quiet_stopped"] = sum(1 for r in idle if be._vms[r.id].quiet_stopped)
    t1 = time.perf_counter()
    await be.exec(idle[-1].id, ["true"])
    out["vm_quiet_resume_exec_ms"] = (time.perf_counter() - t1) * 1000
    alive = 0
    for r in idle:
        with contextlib.suppress(Exception):
            if (await be.exec(r.id, ["true"], timeout=30)).exit_code == 0:
                alive += 1
    out["vm_idle_answering"] = alive
    await asyncio.gather(*(be.destroy(r.id) for r in idle))
    out.update({f"vm_{k}": v for k, v in be.facts().items() if k != "vm_accel"})
    out["vm_accel"] = be.accel
    out["vm_guest_ram_mib"] = spec.resources.memory // MiB
    return out


async def _through_the_sdk(base: Path, tag: str, n: int, pool_size: int, say: Progress,
                           series: SeriesData | None = None) -> dict[str, Any]:
    """Create through the SDK on a real edge (HTTP on loopback) whose warm pool keeps restored,
    warmed-up VMs, to the first exec of ``true`` answered; the pool refills between creates."""
    import secrets

    from dsec.backends.container.config import ContainerConfig
    from dsec.backends.microvm.config import MicroVMConfig
    from dsec.edge.config import EdgeConfig, PoolConfig
    from dsec.edge.testing import EdgeThread, prepare_busybox
    from dsec.sdk import AsyncClient
    from dsec.spec import ImageRef, Resources, SandboxSpec

    state = base / "edge-state"
    prepare_busybox(state)
    res = Resources(cpu=1, memory=256 * MiB, pids=256, disk=64 * MiB)
    cfg = EdgeConfig(edge_id="bvm", cluster_key=secrets.token_bytes(32), port=0, state_dir=state, run_dir=base / "run",
                     destroy_on_shutdown=True, runtime_name=f"bve{tag}",
                     backends=[ContainerConfig(), MicroVMConfig()],
                     pools=[PoolConfig(image=ImageRef(base="busybox:test"), resources=res, size=pool_size,
                                       backend="microvm", name="vm")])
    edge = EdgeThread(cfg).start()
    out: dict[str, Any] = {}
    try:
        async with AsyncClient(edge.url, edge.admin_token()) as c:
            spec = SandboxSpec(image=ImageRef(base="busybox:test"), resources=res, backend="microvm")

            async def pool_full() -> None:
                deadline = time.monotonic() + 300
                while time.monotonic() < deadline:
                    if len(edge.service.pools.pools[0].ready) >= pool_size:
                        return
                    await asyncio.sleep(0.2)

            await pool_full()
            totals, cold = [], []
            for _ in range(n):
                await pool_full()
                t0 = time.perf_counter()
                sb = await c.create(spec)
                r = await sb.exec(["true"])
                totals.append((time.perf_counter() - t0) * 1000)
                assert r.exit_code == 0, r
                await sb.close()
            say("microvm: through the SDK without a pool (each create restores a clone)")
            edge.service.pools.pools[0].target = 0
            while edge.service.pools.pools[0].ready:  # what the pool still holds goes first, unmeasured
                await (await c.create(spec)).close()
            for _ in range(max(3, n // 2)):
                t0 = time.perf_counter()
                sb = await c.create(spec)
                await sb.exec(["true"])
                cold.append((time.perf_counter() - t0) * 1000)
                await sb.close()
        out["vm_sdk_pool_create_exec_p50_ms"] = percentile(totals, 50)
        out["vm_sdk_pool_create_exec_p95_ms"] = percentile(totals, 95)
        out["vm_sdk_create_exec_p50_ms"] = percentile(cold, 50)
        out["vm_sdk_create_exec_p95_ms"] = percentile(cold, 95)
        _put(series, "vm_sdk_pool_create_exec_ms", totals)
        _put(series, "vm_sdk_create_exec_ms", cold)
    finally:
        edge.stop()
    return out


def _conformance() -> tuple[int, int]:
    """The conformance suite's microvm cases, run by pytest in a child (a source checkout's
    tests/): (passed, total of those not skipped); (-1, -1) without the suite."""
    import re
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[3]
    if not (root / "tests" / "conformance").is_dir():
        return -1, -1
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "tests/conformance", "-k",
                           "microvm"], cwd=root, capture_output=True, text=True, timeout=1800)
    counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|error|errors|xfailed)", proc.stdout)}
    passed = counts.get("passed", 0)
    return passed, passed + counts.get("failed", 0) + counts.get("error", 0) + counts.get("errors", 0) + \
        counts.get("xfailed", 0)


async def _container(store: Any, base: Path, tag: str, spec: Any, n_lat: int, n_exec: int,
                     series: SeriesData | None = None) -> dict[str, float]:
    from dsec.backends.container.runtime import ContainerRuntime

    out: dict[str, float] = {}
    ct = ContainerRuntime(name=f"bvc{tag}", state_dir=base / "state", run_dir=base / "run", layer_store=store)
    async with ct:
        first = await ct.create(spec)
        await ct.exec(first.id, ["true"])
        totals = []
        for _ in range(n_lat):
            t0 = time.perf_counter()
            rec = await ct.create(spec)
            await ct.exec(rec.id, ["true"])
            totals.append((time.perf_counter() - t0) * 1000)
            await ct.destroy(rec.id)
        out["container_create_exec_p50_ms"] = percentile(totals, 50)
        _put(series, "container_create_exec_ms", totals)
        ex = []
        for _ in range(n_exec):
            t0 = time.perf_counter()
            await ct.exec(first.id, ["true"])
            ex.append((time.perf_counter() - t0) * 1000)
        out["container_exec_p50_ms"] = percentile(ex, 50)
        _put(series, "container_exec_ms", ex)
    return out


async def measure(*, quick: bool = False, say: Progress = _quiet, series: SeriesData | None = None) -> dict[str, Any]:
    from dsec.backends.microvm.backend import MicroVMBackend
    from dsec.backends.microvm.config import MicroVMConfig
    from dsec.images import LocalLayerStore, build_busybox
    from dsec.spec import ImageRef, Resources, SandboxSpec

    base = Path(tempfile.mkdtemp(prefix="dsec-bench-vm-"))
    base.chmod(0o711)
    tag = f"{os.getpid() % 100000}"
    store = LocalLayerStore(base / "state" / "layers")
    layer = await asyncio.to_thread(build_busybox, store, name="bench-vm-busybox", tag="latest")
    res = Resources(cpu=1, memory=256 * MiB, pids=256, disk=64 * MiB)
    out: dict[str, Any] = {"host": f"{platform.node()} {os.cpu_count()} cpus {platform.release()}",
                           "load_avg_1m_start": os.getloadavg()[0]}
    n_boot, n_lat, n_exec, n_idle, window = (3, 8, 20, 20, 10.0) if quick else (10, 20, 50, 300, 30.0)
    try:
        be = MicroVMBackend(MicroVMConfig(zram_size=12 << 30), name=f"bvm{tag}", state_dir=base / "state", run_dir=base / "run",
                            id_prefix="bv", store=store)
        async with be:
            spec = SandboxSpec(image=ImageRef(base=layer.digest), resources=res, backend="microvm")
            out.update(await _microvm(be, spec, n_boot=n_boot, n_lat=n_lat, n_exec=n_exec, n_idle=n_idle,
                                      idle_window_s=window, say=say, series=series))
        say("microvm: through the SDK on a real edge with a warm pool")
        out.update(await _through_the_sdk(base, tag, n_lat, 4, say, series))
        say("container: the same spec")
        cspec = SandboxSpec(image=ImageRef(base=layer.digest), resources=res)
        out.update(await _container(store, base, tag, cspec, n_lat, n_exec, series))
    finally:
        if not any(f" {base}/" in ln for ln in Path("/proc/self/mountinfo").read_text().splitlines()):
            shutil.rmtree(base, ignore_errors=True)
    if not quick:
        say("microvm: the conformance suite (pytest tests/conformance -k microvm)")
        out["vm_conformance_passed"], out["vm_conformance_total"] = await asyncio.to_thread(_conformance)
    out["vm_vs_container_exec_ratio"] = out["vm_exec_p50_ms"] / out["container_exec_p50_ms"]
    out["vm_vs_container_create_exec_ratio"] = out["vm_restore_p50_ms"] / out["container_create_exec_p50_ms"]
    out["load_avg_1m_end"] = os.getloadavg()[0]
    return out


def run(*, quick: bool = False, say: Progress = _quiet, series: SeriesData | None = None) -> dict[str, Any]:
    """The suite; ``series``, when given, receives every sample (module docstring)."""
    return asyncio.run(measure(quick=quick, say=say, series=series))


_CREATE_SERIES = (
    ("vm_restore_ms", "microVM: create + first exec (restore)", "C0"),
    ("vm_sdk_pool_create_exec_ms", "microVM through the SDK, warm pool", "C2"),
    ("vm_sdk_create_exec_ms", "microVM through the SDK, no pool", "C3"),
    ("container_create_exec_ms", "container: create + first exec", "C1"),
)


def figures(results: Mapping[str, Any], series: SeriesData) -> list[Figure]:
    """The report's charts (:mod:`dsec.bench.report`): create-to-first-exec sample by sample
    and as histograms, exec round trips, the restore's steps, idle memory per clone."""
    figs: list[Figure] = []
    got = [(lbl, series[k], c) for k, lbl, c in _CREATE_SERIES if series.get(k)]
    accel = results.get("vm_accel", "?")
    if got:
        figs.append(Figure(
            title="Create to first exec answered, sample by sample", kind="line", xlabel="sample", ylabel="ms",
            series=tuple(Series(lbl, range(1, len(v) + 1), v, color=c) for lbl, v, c in got), logy=True,
            caption=f"Accelerator {accel}. Direct backend calls, except the SDK's (HTTP on loopback to a real edge).",
            name="vm-create-samples"))
        figs.append(Figure(
            title="Create to first exec answered", kind="hist", xlabel="ms", ylabel="samples", logx=True, bins=30,
            series=tuple(Series(lbl, x=v, color=c) for lbl, v, c in got), name="vm-create-hist"))
    ex = [(lbl, series[k], c) for k, lbl, c in (("vm_exec_ms", "microVM exec(true)", "C0"),
                                                 ("vm_echo_ms", "microVM agent ping", "C4"),
                                                 ("container_exec_ms", "container exec(true)", "C1")) if series.get(k)]
    if ex:
        figs.append(Figure(title="Exec round trip in a running sandbox", kind="hist", xlabel="ms", ylabel="samples",
                           logx=True, bins=30, series=tuple(Series(lbl, x=v, color=c) for lbl, v, c in ex),
                           name="vm-exec-hist"))
    if series.get("vm_cold_boot_ms"):
        boots = series["vm_cold_boot_ms"]
        figs.append(Figure(title="Cold boots (QEMU spawned to the agent's hello)", kind="bar",
                           categories=tuple(str(i + 1) for i in range(len(boots))), xlabel="boot", ylabel="ms",
                           series=(Series("cold boot", y=boots, color="C0"),),
                           refs=(("restore p50", float(results.get("vm_restore_p50_ms", 0.0))),)
                           if "vm_restore_p50_ms" in results else (), name="vm-cold-boots"))
    steps = [s for s in ("start", "restore", "hello", "identity", "warm") if f"vm_restore_{s}_p50_ms" in results]
    if steps:
        figs.append(Figure(title="A restore's steps (p50)", kind="bar", categories=tuple(steps), ylabel="ms",
                           series=(Series("p50", y=tuple(float(results[f"vm_restore_{s}_p50_ms"]) for s in steps),
                                          color="C0"),), name="vm-restore-steps"))
    mem = [(lbl, k) for lbl, k in (("MemAvailable drop / clone", "vm_idle_mib_per_clone"),
                                   ("QEMU PSS / clone", "vm_idle_pss_mib")) if isinstance(results.get(k), (int, float))]
    if mem:
        figs.append(Figure(title=f"Idle memory per clone ({results.get('vm_idle_n', '?')} held at once)", kind="bar",
                           categories=tuple(lbl for lbl, _ in mem), ylabel="MiB",
                           series=(Series("MiB", y=tuple(float(results[k]) for _, k in mem), color="C0"),),
                           name="vm-idle-memory"))
    return figs
