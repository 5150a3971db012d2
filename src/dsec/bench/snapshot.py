"""``dsec bench snapshot``: pack_diff, start from a snapshot, fork, pause/resume, idle density.

One runtime with a zram swap device, a busybox base layer, and a small static
helper (``hog``) that holds memory inside a sandbox: text-like and/or random
bytes, re-checked (paged back in) on SIGUSR1. Figures, not assertions. Every
key is documented in :data:`KEYS`; the JSON is flat.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dsec.bench.stats import percentile

Progress = Callable[[str], None]
MiB = 1 << 20
GiB = 1 << 30

KEYS: dict[str, str] = {
    "pack_1mb_s": "snapshot (pack_diff) of a sandbox whose writable layer holds 1 MB of mixed files: seconds",
    "pack_100mb_s": "... 100 MB of mixed files (40% small text files, 30% 1 MiB random, 30% large text)",
    "pack_1gb_s": "... 1 GB (with --quick: 256 MB measured, x4; see pack_1gb_measured_mb)",
    "pack_*_frozen_s": "of which the sandbox was frozen (second pass of the copy); the rest is the first pass "
                       "while it runs, compression and the import",
    "pack_100mb_onepass_*": "the 100 MB snapshot again with the whole copy under the freeze (no first pass)",
    "snapshot_start_p50_ms": "create + first exec of a sandbox from the 100 MB snapshot (p50), alternated with ...",
    "base_start_p50_ms": "... create + first exec from the busybox base alone, same run",
    "fork32_s": "fork(32) of the 100 MB sandbox: snapshot + 32 creates + identities, wall seconds",
    "pause_mem_returned_frac": "pause of a sandbox holding 200 MiB of text-like data: share of its memory cgroup's "
                               "usage returned (swapped out); target >= 0.9",
    "pause_host_returned_frac": "the same net of what zram keeps (compressed): share the host really got back",
    "pause_s": "that pause: freeze + reclaim, seconds",
    "resume_first_exec_p50_ms": "resume + first exec after a full pause, before pages come back (p50); target <= 10",
    "page_in_s": "after resume, touching all 200 MiB again (pages come back from zram): seconds",
    "group_pause_1000_s": "pause_many of 1,000 idle sandboxes (shell + sleep each); target <= 5 "
                          "(with --quick: 200 measured, x5; see group_n)",
    "group_resume_1000_s": "resume_many of the same; target <= 5",
    "idle_fit_autopause": "idle sandboxes of 64 MiB working set (25% random, 75% text-like) that fit in this "
                          "host's RAM when paused: EXTRAPOLATED from a measured sample of idle_sample_n sandboxes "
                          "(available RAM / measured host memory per paused sandbox, zram included); "
                          "_text / _random50 variants: 0% / 50% random",
    "idle_fit_no_autopause": "... the same, running (not paused): available RAM / measured memory per sandbox",
}


HOG_C = r"""
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <fcntl.h>
/* hog MIB RANDOM_PERCENT LOG: holds MIB MiB (RANDOM_PERCENT of it random, the rest text-like);
   on SIGUSR1 reads all of it again and appends "ok N" to LOG. */
static volatile sig_atomic_t asked;
static void on_usr1(int s) { (void)s; asked = 1; }
int main(int argc, char **argv) {
    size_t n = (size_t)atoi(argv[1]) << 20;
    size_t rnd = n / 100 * (size_t)atoi(argv[2]);
    int log = open(argv[3], O_WRONLY | O_CREAT | O_APPEND, 0644);
    unsigned char *p = malloc(n);
    const char *text = "the quick brown fox jumps over the lazy dog 0123456789 ";
    size_t tl = strlen(text);
    unsigned long x = 88172645463325252UL ^ (unsigned long)getpid();
    for (size_t i = 0; i < n; i++) {
        if (i < rnd) { x ^= x << 13; x ^= x >> 7; x ^= x << 17; p[i] = (unsigned char)x; }
        else p[i] = (unsigned char)text[(i * 7 + i / 4096) % tl];
    }
    signal(SIGUSR1, on_usr1);
    dprintf(log, "ready\n");
    for (int round = 1;; round++) {
        while (!asked) pause();
        asked = 0;
        unsigned long sum = 0;
        for (size_t i = 0; i < n; i += 64) sum += p[i];
        dprintf(log, "ok %d %lu\n", round, sum);
    }
}
"""


def _meminfo() -> dict[str, int]:
    out: dict[str, int] = {}
    with open("/proc/meminfo") as f:
        for line in f:
            k, v = line.split(":", 1)
            out[k] = int(v.split()[0]) * 1024
    return out


def _available() -> int:
    return _meminfo()["MemAvailable"]


def _build_hog(work: Path) -> Path | None:
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        return None
    src, out = work / "hog.c", work / "hog"
    src.write_text(HOG_C)
    proc = subprocess.run([gcc, "-static", "-O2", "-o", str(out), str(src)], capture_output=True)
    return out if proc.returncode == 0 else None


def _fill_mixed(files: Any, root: str, total: int, seed: int) -> int:
    """Write ``total`` bytes of mixed files under ``root`` in a sandbox (host side, files API)."""
    rng = random.Random(seed)
    words = [rng.choice("abcdefghijklmnopqrstuvwxyz") * rng.randint(2, 9) for _ in range(500)]

    def text(n: int) -> bytes:
        chunk = " ".join(rng.choice(words) for _ in range(4096)).encode() + b"\n"
        return (chunk * (n // len(chunk) + 1))[:n]

    files.mkdir(root, parents=True)
    written = 0
    small_budget, medium_budget = int(total * 0.4), int(total * 0.3)
    i = 0
    while written < small_budget:  # small text files, 4-64 KiB, 100 per directory
        if i % 100 == 0:
            files.mkdir(f"{root}/d{i // 100}", parents=True)
        n = min(rng.randint(4096, 65536), max(1, small_budget - written))
        files.write(f"{root}/d{i // 100}/f{i}.txt", text(n))
        written += n
        i += 1
    j = 0
    while written < small_budget + medium_budget:  # 1 MiB random blobs
        n = min(MiB, max(1, small_budget + medium_budget - written))
        files.write(f"{root}/blob{j}.bin", os.urandom(n))
        written += n
        j += 1
    k = 0
    while written < total:  # large text-like files, 32 MiB each
        n = min(32 * MiB, total - written)
        files.write(f"{root}/large{k}.log", text(n))
        written += n
        k += 1
    return written


async def _start_lat(rt: Any, spec: Any) -> float:
    t0 = time.perf_counter()
    sb = await rt.create(spec)
    await rt.exec(sb.id, ["/bin/true"])
    ms = (time.perf_counter() - t0) * 1000
    await rt.destroy(sb.id)
    return ms


async def _hog_round(rt: Any, sid: str, inner_pid: str, log: str, rounds: int) -> None:
    await rt.exec(sid, ["/bin/kill", "-USR1", inner_pid])
    files = rt.files(sid)
    while files.read(log).decode().count("\nok ") < rounds:
        await asyncio.sleep(0.002)


async def _start_hog(rt: Any, sid: str, hog: Path, mib: int, random_pct: int) -> str:
    """Start the hog; returns its pid inside the sandbox."""
    files = rt.files(sid)
    if not files.exists("/usr/bin/hog"):
        files.write("/usr/bin/hog", hog.read_bytes(), mode=0o755)
    res = await rt.exec(sid, f"/usr/bin/hog {mib} {random_pct} /tmp/hog.log </dev/null >/dev/null 2>&1 & echo $!")
    pid = str(res.stdout.decode().strip())
    while not (files.exists("/tmp/hog.log") and files.read("/tmp/hog.log").startswith(b"ready")):
        await asyncio.sleep(0.01)
    return pid


def _memcg_usage(rt: Any, sid: str) -> int:
    return int((rt.cgroups.parents["memory"] / sid / "memory.usage_in_bytes").read_text())


async def _idle_density(rt: Any, base: str, hog: Path, n: int, random_pct: int, label: str,
                        out: dict[str, Any]) -> None:
    from dsec.spec import ImageRef, Resources, SandboxSpec

    await asyncio.sleep(0.5)
    avail0 = _available()
    spec = SandboxSpec(image=ImageRef(base=base), resources=Resources(cpu=0.5, memory=256 * MiB, disk=16 * MiB))
    ids: list[str] = []
    try:
        for _ in range(n):
            s = await rt.create(spec)
            ids.append(s.id)
            await _start_hog(rt, s.id, hog, 64, random_pct)
        await asyncio.sleep(0.5)
        running = sum(_memcg_usage(rt, i) for i in ids) / n
        z0 = rt.swap_stats()
        await rt.pause_many(ids)
        z1 = rt.swap_stats()
        zram = (z1.mem_used_total - z0.mem_used_total) if z0 and z1 else 0
        paused = (sum(_memcg_usage(rt, i) for i in ids) + zram) / n
        usable = avail0 - 1 * GiB  # keep 1 GiB for the host
        out[f"idle_running_mib_per_sandbox{label}"] = running / MiB
        out[f"idle_paused_mib_per_sandbox{label}"] = paused / MiB
        out[f"idle_fit_no_autopause{label}"] = int(usable // max(running, 1))
        out[f"idle_fit_autopause{label}"] = int(usable // max(paused, 1))
        out["idle_sample_n"] = n
        out["idle_fit_usable_gib"] = usable / GiB
    finally:
        await asyncio.gather(*(rt.destroy(i) for i in ids), return_exceptions=True)


async def _run(work: Path, *, quick: bool, say: Progress) -> dict[str, Any]:
    from dsec.backends.container.runtime import ContainerRuntime
    from dsec.images.build import build_busybox
    from dsec.spec import ImageRef, Resources, SandboxSpec

    out: dict[str, Any] = {}
    hog = _build_hog(work)
    n_start = 20 if quick else 100
    group_n = 200 if quick else 1000
    sample_n = 8 if quick else 24
    zram = 8 * GiB
    async with ContainerRuntime(name="bench-snap", state_dir=work / "state", run_dir=work / "run",
                                zram_size=zram) as rt:
        base = await asyncio.to_thread(build_busybox, rt.store, name="bench-busybox", tag="latest")
        small = Resources(cpu=1, memory=256 * MiB, disk=64 * MiB)
        base_spec = SandboxSpec(image=ImageRef(base=base.digest), resources=small)
        for _ in range(3):
            await _start_lat(rt, base_spec)

        # ---- pack_diff against diff size ----
        sizes = [("1mb", 1_000_000), ("100mb", 100_000_000),
                 ("1gb", 256_000_000 if quick else 1_000_000_000)]
        snap100 = None
        src100 = None
        for key, size in sizes:
            big = Resources(cpu=1, memory=int(size * 1.6) + 256 * MiB, disk=int(size * 1.3) + 64 * MiB)
            sb = await rt.create(SandboxSpec(image=ImageRef(base=base.digest), resources=big))
            say(f"pack_diff: writing {size / 1e6:.0f} MB of mixed files into {sb.id}")
            await asyncio.to_thread(_fill_mixed, rt.files(sb.id), "/work", size, seed=size)
            info = await rt.snapshot_info(sb.id, name="bench-snap", tag=key)
            scale = 1_000_000_000 / size if key == "1gb" else 1.0
            out[f"pack_{key}_s"] = info.seconds * scale
            out[f"pack_{key}_frozen_s"] = info.frozen_s * scale
            out[f"pack_{key}_layer_mb"] = info.layer.size / 1e6
            if key == "1gb":
                out["pack_1gb_measured_mb"] = size / 1e6
            say(f"  {key}: {info.seconds:.2f} s (frozen {info.frozen_s:.2f} s), layer {info.layer.size / 1e6:.1f} MB")
            if key == "100mb":
                snap100, src100 = info.layer, sb
                rt.snapshot_precopy = False  # the same in one frozen pass, for comparison
                one = await rt.snapshot_info(sb.id, name="bench-snap", tag="100mb-onepass")
                rt.snapshot_precopy = True
                out["pack_100mb_onepass_s"] = one.seconds
                out["pack_100mb_onepass_frozen_s"] = one.frozen_s
            else:
                await rt.destroy(sb.id)
        assert snap100 is not None and src100 is not None

        # ---- start from a snapshot beside start from the base ----
        say(f"start latency: snapshot vs base, {n_start} samples each, alternated")
        snap_spec = SandboxSpec(image=ImageRef(base=snap100.digest), resources=small)
        await _start_lat(rt, snap_spec)
        s_ms: list[float] = []
        b_ms: list[float] = []
        for _ in range(n_start):
            s_ms.append(await _start_lat(rt, snap_spec))
            b_ms.append(await _start_lat(rt, base_spec))
        out["snapshot_start_p50_ms"] = percentile(s_ms, 50)
        out["base_start_p50_ms"] = percentile(b_ms, 50)
        out["snapshot_start_p95_ms"] = percentile(s_ms, 95)
        out["base_start_p95_ms"] = percentile(b_ms, 95)

        # ---- fork(32) ----
        say("fork(32) of the 100 MB sandbox")
        t0 = time.perf_counter()
        kids = await rt.fork(src100.id, 32)
        out["fork32_s"] = time.perf_counter() - t0
        await asyncio.gather(*(rt.destroy(k.id) for k in kids))
        await rt.destroy(src100.id)

        # ---- pause / resume of a sandbox holding 200 MiB ----
        say("pause of a sandbox holding 200 MiB of text-like data")
        sb = await rt.create(SandboxSpec(image=ImageRef(base=base.digest),
                                         resources=Resources(cpu=1, memory=512 * MiB, disk=64 * MiB)))
        if hog is not None:
            inner = await _start_hog(rt, sb.id, hog, 200, 0)
            out["pause_workload"] = "anonymous memory of a process (200 MiB, text-like)"
        else:
            await rt.exec(sb.id, "yes 'a line of program output 0123456789' | head -c 209715200 > /tmp/data")
            inner = ""
            out["pause_workload"] = "a 200 MiB file in the writable layer (no gcc for the helper)"
        z0 = rt.swap_stats()
        res = await rt.pause(sb.id)
        z1 = rt.swap_stats()
        assert res.reclaim is not None
        out["pause_mem_returned_frac"] = res.reclaim.returned_frac
        out["pause_s"] = res.seconds
        out["pause_freeze_ms"] = res.freeze_s * 1000
        zram_cost = (z1.mem_used_total - z0.mem_used_total) if z0 and z1 else 0
        out["pause_zram_mib"] = zram_cost / MiB
        out["pause_host_returned_frac"] = (res.reclaim.returned - zram_cost) / res.reclaim.before
        rounds = 0
        first: list[float] = []
        for i in range(5 if quick else 20):
            if i:
                await rt.pause(sb.id)
            t0 = time.perf_counter()
            await rt.resume(sb.id)
            await rt.exec(sb.id, ["/bin/true"])
            first.append((time.perf_counter() - t0) * 1000)
        out["resume_first_exec_p50_ms"] = percentile(first, 50)
        await rt.pause(sb.id)
        await rt.resume(sb.id)
        t0 = time.perf_counter()
        if hog is not None:
            rounds += 1
            await _hog_round(rt, sb.id, inner, "/tmp/hog.log", rounds)
        else:
            await rt.exec(sb.id, "cat /tmp/data > /dev/null")
        out["page_in_s"] = time.perf_counter() - t0
        await rt.destroy(sb.id)

        # ---- group pause / resume ----
        say(f"group pause/resume of {group_n} idle sandboxes (creating them)")
        tiny = Resources(cpu=0.1, memory=64 * MiB, disk=8 * MiB, pids=32)
        tiny_spec = SandboxSpec(image=ImageRef(base=base.digest), resources=tiny)
        ids: list[str] = []
        sem = asyncio.Semaphore(8)

        async def make() -> None:
            async with sem:
                s = await rt.create(tiny_spec)
                await rt.exec(s.id, "sleep 100000 >/dev/null 2>&1 &")
                ids.append(s.id)

        await asyncio.gather(*(make() for _ in range(group_n)))
        g = await rt.pause_many(ids)
        scale = 1000 / group_n
        out["group_pause_1000_s"] = g.seconds * scale
        out["group_pause_errors"] = len(g.errors)
        g2 = await rt.resume_many(ids)
        out["group_resume_1000_s"] = g2.seconds * scale
        out["group_n"] = group_n
        say(f"  pause {g.seconds:.2f} s, resume {g2.seconds:.2f} s for {group_n}")
        dsem = asyncio.Semaphore(16)

        async def drop(i: str) -> None:
            async with dsem:
                await rt.destroy(i)

        await asyncio.gather(*(drop(i) for i in ids))

        # ---- idle density: 64 MiB working set, paused vs running ----
        if hog is not None:
            for label, pct in (("", 25), ("_text", 0), ("_random50", 50)):
                say(f"idle density sample: {sample_n} sandboxes holding 64 MiB ({pct}% random)")
                await _idle_density(rt, base.digest, hog, sample_n, pct, label, out)
            out["idle_fit_method"] = (
                f"EXTRAPOLATED, not filled: (MemAvailable at start - 1 GiB) / host memory per idle sandbox, measured "
                f"over {sample_n} sandboxes each holding 64 MiB (25% random bytes, 75% text-like; _text and _random50 "
                "keys: 0% and 50%). Running: the sandbox's memory cgroup usage. Paused: what stays in its cgroup plus "
                "its share of zram's memory. Paused sandboxes also need zram disksize >= n x 64 MiB (uncompressed).")
        for layer in await asyncio.to_thread(rt.store.list):
            if layer.name == "bench-snap":
                with contextlib.suppress(Exception):
                    await asyncio.to_thread(rt.store.remove, layer.digest)
        zs = rt.swap_stats()
        out["zram_algorithm"] = zs.algorithm if zs else ""
    return out


def run(*, quick: bool = False, say: Progress = print, work_dir: Path | None = None) -> dict[str, Any]:
    """Run the benchmark; a flat dict of figures (see :data:`KEYS`)."""
    pid_max = Path("/proc/sys/kernel/pid_max")
    if int(pid_max.read_text()) < 65536:
        pid_max.write_text("65536")
        say("raised kernel.pid_max to 65536 for this run")
    work = Path(tempfile.mkdtemp(prefix="dsec-bench-snap-", dir=work_dir))
    try:
        out = asyncio.run(_run(work, quick=quick, say=say))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out["quick"] = quick
    return out


__all__ = ["KEYS", "run"]
