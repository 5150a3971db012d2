"""gVisor beside the container backend, in one run: ``measure(n)`` for ``dsec bench runtime``.

Figures, not assertions. Both backends run the same busybox layer (built once into one
store, which both read), the same spec and the same commands, one after the other in
this process:

- ``<b>_create_p50_ms``: ``create()`` until the sandbox runs (gVisor: ``runsc run --detach``
  returned; container: the init runs), ``n_lat`` samples after a warm-up.
- ``<b>_exec_p50_ms``: ``exec(["/bin/true"])`` round trip in one sandbox, ``n_exec`` samples.
- ``<b>_idle_mib_per_sandbox``: the drop in the host's MemAvailable with ``n`` idle sandboxes
  (after a settle), divided by ``n``; ``<b>_idle_n`` says the n (capped by MemAvailable).
  ``<b>_idle_cgroup_mib_per_sandbox``: what their memory cgroups are charged, per sandbox
  (steadier than MemAvailable on a shared machine at a small n).
- ``<b>_syscall_us``: a syscall-heavy loop (getpid, stat, open, close: 4 calls per round,
  ``loop_rounds`` rounds) timed inside the sandbox by the program itself (CLOCK_MONOTONIC
  through the vDSO, no trap), per call, best of 3; ``gvisor_syscall_overhead_ratio`` =
  gVisor's time over the container's for the same loop. ``<b>_getpid_us`` and
  ``gvisor_getpid_overhead_ratio``: getpid alone (the trap, no file system: gVisor's stat
  and open go to the gofer's files with ``--file-access=shared`` revalidation).

``<b>`` is ``gvisor`` or ``container``. Must never: leave a sandbox, mount or cgroup behind
(both backends are closed, destroying their sandboxes, on any error), or keep more idle
sandboxes than MemAvailable holds with headroom.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from dsec.bench.stats import percentile

Progress = Callable[[str], None]
MiB = 1 << 20
IDLE_BUDGET_MIB = 40
"""Host memory an idle gVisor sandbox is assumed to need when capping ``n`` (measured ~16-25)."""

SYSCALL_LOOP_C = r"""
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
int main(int argc, char **argv) {
    long rounds = argc > 1 ? atol(argv[1]) : 10000;
    int only_getpid = argc > 2;
    struct stat st;
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    for (long i = 0; i < rounds; i++) {
        getpid();
        if (only_getpid) continue;
        stat("/", &st);
        int fd = open("/etc/passwd", O_RDONLY);
        if (fd >= 0) close(fd);
    }
    clock_gettime(CLOCK_MONOTONIC, &b);
    printf("%ld\n", (b.tv_sec - a.tv_sec) * 1000000000L + (b.tv_nsec - a.tv_nsec));
    return 0;
}
"""
CALLS_PER_ROUND = 4  # getpid, stat, open, close


def _quiet(_msg: str) -> None:
    return None


def _mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def build_syscall_loop(out: Path) -> Path:
    """A static binary of the loop (musl where installed): it runs in any rootfs."""
    src = out.with_suffix(".c")
    src.write_text(SYSCALL_LOOP_C)
    cc = shutil.which("musl-gcc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler for the syscall loop (apt-get install musl-tools or gcc)")
    subprocess.run([cc, "-O2", "-static", "-o", str(out), str(src)], check=True, capture_output=True)
    return out


async def _create_p50(b: Any, spec: Any, n: int) -> tuple[float, float]:
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        rec = await b.create(spec)
        samples.append((time.perf_counter() - t0) * 1000)
        await b.destroy(rec.id)
    return percentile(samples, 50), percentile(samples, 95)


async def _exec_p50(b: Any, sid: str, n: int) -> tuple[float, float]:
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        r = await b.exec(sid, ["/bin/true"])
        samples.append((time.perf_counter() - t0) * 1000)
        if r.exit_code != 0:
            raise RuntimeError(f"/bin/true failed: {r}")
    return percentile(samples, 50), percentile(samples, 95)


async def _syscall_us(b: Any, sid: str, loop: Path, rounds: int, *, only_getpid: bool = False,
                      reps: int = 3) -> float:
    """Microseconds per call of the loop, the best of ``reps`` runs (the machine is shared)."""
    if not b.files(sid).exists("/usr/bin/dsec-syscall-loop"):
        b.files(sid).write("/usr/bin/dsec-syscall-loop", loop.read_bytes(), mode=0o755)
    argv = ["/usr/bin/dsec-syscall-loop", str(rounds), *(["getpid"] if only_getpid else [])]
    best = float("inf")
    for _ in range(reps):
        r = await b.exec(sid, argv, timeout=600)
        if r.exit_code != 0:
            raise RuntimeError(f"syscall loop failed: {r}")
        best = min(best, int(r.stdout) / 1000 / (rounds * (1 if only_getpid else CALLS_PER_ROUND)))
    return best


async def _idle(b: Any, spec: Any, n: int, concurrency: int = 4) -> tuple[float, float]:
    """MiB per idle sandbox with ``n`` of them (destroyed afterwards): the drop in MemAvailable,
    and what the sandboxes' memory cgroups are charged (steadier on a shared machine; no
    page tables or other kernel memory outside the cgroup)."""
    ids: list[str] = []
    sem = asyncio.Semaphore(concurrency)

    async def one() -> None:
        async with sem:
            ids.append((await b.create(spec)).id)

    await asyncio.sleep(1.0)
    before = _mem_available()
    try:
        await asyncio.gather(*(one() for _ in range(n)))
        await asyncio.sleep(2.0)  # let lazily freed and lazily touched memory settle
        after = _mem_available()
        charged = sum(await asyncio.to_thread(lambda: [b.usage(i).memory_bytes for i in ids]))
    finally:
        await asyncio.gather(*(b.destroy(i) for i in ids), return_exceptions=True)
    count = max(1, len(ids))
    return (before - after) / MiB / count, charged / MiB / count


async def _one_backend(kind: str, b: Any, spec: Any, loop: Path, *, n: int, n_lat: int, n_exec: int,
                       rounds: int, say: Progress) -> dict[str, float]:
    out: dict[str, float] = {}
    for _ in range(2):  # warm up: layer mount, page cache, helper binaries
        rec = await b.create(spec)
        await b.exec(rec.id, ["/bin/true"])
        await b.destroy(rec.id)
    say(f"{kind}: create, {n_lat} samples")
    out[f"{kind}_create_p50_ms"], out[f"{kind}_create_p95_ms"] = await _create_p50(b, spec, n_lat)
    rec = await b.create(spec)
    try:
        say(f"{kind}: exec round trip, {n_exec} samples")
        out[f"{kind}_exec_p50_ms"], out[f"{kind}_exec_p95_ms"] = await _exec_p50(b, rec.id, n_exec)
        say(f"{kind}: syscall loop, {rounds} rounds")
        out[f"{kind}_syscall_us"] = await _syscall_us(b, rec.id, loop, rounds)
        out[f"{kind}_getpid_us"] = await _syscall_us(b, rec.id, loop, rounds * 4, only_getpid=True)
    finally:
        await b.destroy(rec.id)
    say(f"{kind}: {n} idle sandboxes")
    out[f"{kind}_idle_mib_per_sandbox"], out[f"{kind}_idle_cgroup_mib_per_sandbox"] = await _idle(b, spec, n)
    out[f"{kind}_idle_n"] = float(n)
    return out


async def measure(n: int, *, work: Path | None = None, n_lat: int = 20, n_exec: int = 30,
                  loop_rounds: int = 20_000, platform: Literal["systrap", "ptrace"] = "systrap",
                  say: Progress = _quiet) -> dict[str, float]:
    """The gVisor figures beside the container backend's, same run (see the module docstring).
    ``n``: idle sandboxes per backend for the memory figure (capped by MemAvailable)."""
    from dsec.backends.container.runtime import ContainerRuntime
    from dsec.backends.gvisor.backend import GVisorBackend
    from dsec.backends.gvisor.config import GVisorConfig
    from dsec.images import LocalLayerStore, build_busybox
    from dsec.spec import ImageRef, Resources, SandboxSpec

    own_work = work is None
    base = Path(tempfile.mkdtemp(prefix="dsec-bench-gvisor-")) if work is None else work
    cap = int(_mem_available() * 0.5 / (IDLE_BUDGET_MIB * MiB))
    if n > cap:
        say(f"n={n} idle sandboxes would not fit in half of MemAvailable: using {cap}")
        n = max(1, cap)
    tag = f"{os.getpid() % 100000}"
    store = LocalLayerStore(base / "state" / "layers")
    layer = await asyncio.to_thread(build_busybox, store, name="bench-gv-busybox", tag="latest")
    loop = await asyncio.to_thread(build_syscall_loop, base / "dsec-syscall-loop")
    res = Resources(cpu=1, memory=256 * MiB, pids=256, disk=64 * MiB, disk_medium="memory")
    out: dict[str, float] = {}
    try:
        gv = GVisorBackend(GVisorConfig(platform=platform), name=f"bgv{tag}", state_dir=base / "state",
                           run_dir=base / "run", id_prefix="bg", store=store)
        async with gv:
            spec = SandboxSpec(image=ImageRef(base=layer.digest), resources=res, backend="gvisor")
            out.update(await _one_backend("gvisor", gv, spec, loop, n=n, n_lat=n_lat, n_exec=n_exec,
                                          rounds=loop_rounds, say=say))
        ct = ContainerRuntime(name=f"bct{tag}", state_dir=base / "state", run_dir=base / "run", layer_store=store)
        async with ct:
            spec = SandboxSpec(image=ImageRef(base=layer.digest), resources=res)
            out.update(await _one_backend("container", ct, spec, loop, n=n, n_lat=n_lat, n_exec=n_exec,
                                          rounds=loop_rounds, say=say))
    finally:
        if own_work and not any(f" {base}/" in ln for ln in Path("/proc/self/mountinfo").read_text().splitlines()):
            with contextlib.suppress(OSError):
                shutil.rmtree(base)  # only once nothing is mounted below it
    out["gvisor_syscall_overhead_ratio"] = out["gvisor_syscall_us"] / out["container_syscall_us"]
    out["gvisor_getpid_overhead_ratio"] = out["gvisor_getpid_us"] / out["container_getpid_us"]
    out["gvisor_vs_container_create_ratio"] = out["gvisor_create_p50_ms"] / out["container_create_p50_ms"]
    out["gvisor_vs_container_exec_ratio"] = out["gvisor_exec_p50_ms"] / out["container_exec_p50_ms"]
    return out


if __name__ == "__main__":
    import json
    import sys

    figures = asyncio.run(measure(int(sys.argv[1]) if len(sys.argv) > 1 else 20,
                                  say=lambda m: print(m, file=sys.stderr, flush=True)))
    print(json.dumps(figures, indent=2, sort_keys=True))
