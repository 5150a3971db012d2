"""``dsec bench runtime``: the node runtime beside crun and bwrap, in one run, at the same N.

Every figure is measured on the same busybox rootfs in the same process run,
so ratios hold on a noisy machine. Figures, not assertions.

How the three runtimes are kept comparable:

- **Same N.** DSec, crun and bwrap each create-and-keep the same number of
  sandboxes (``-n``; full mode 10,000, or the largest N that MemAvailable
  holds, said so in the output; ``--quick`` 200), and the keys say it:
  ``keep_n``, ``crun_keep_n``, ``bwrap_keep_n``. A kept sandbox holds one idle
  process: DSec's an idle shell waiting on stdin (started with the runtime's
  ``start_process``), crun's and bwrap's the same shell as their pid 1 / under
  bwrap's init (:class:`dsec.bench.baselines.Keeper`). Per runtime at that N:
  the create rate, its first and last decile and their ratio, the teardown
  rate, and host memory per idle sandbox (the drop in MemAvailable).
- **Same concurrency.** Each runtime's create-and-keep and its teardown have
  :data:`~dsec.bench.baselines.KEEP_CONCURRENCY` sandboxes in flight (DSec:
  an asyncio semaphore; crun and bwrap: threads in their runner process, each
  launching one ``crun run -d`` / bwrap at a time), recorded as
  ``keep_concurrency``: a rate ratio between a runtime driven eight at a time
  and one driven one at a time would measure the driving, not the runtime.
- **Rotating order.** The runtimes run one after another, each its whole
  block (latency, exec, create-and-keep), in an order that changes from run
  to run (a counter under ``$DSEC_STATE_DIR/bench``; ``--order`` fixes it):
  some kernel state that a runtime grows outlives its sandboxes, so the one
  that always came last would always pay for the others. The key ``order``
  records the order used.
- **Kernel state.** Every superblock (each tmpfs, proc, overlay, devpts,
  mqueue mount that is not a bind) registers one memcg-aware shrinker, and the
  kernel's shrinker ids have a high-water mark (``shrinker_nr_max``) that
  **only grows until reboot**: every memory cgroup then carries a map of that
  many ids (one 1 KiB slab object per 64 ids per NUMA node), made anew for each
  new memcg and walked by its reclaim. There is no counter for it (this kernel
  has no shrinker debugfs, CONFIG_SHRINKER_DEBUG, nor /proc/kcore), so
  ``shrinkers_*`` estimate it from the outside: create 32 empty probe memcgs
  and count the kmalloc-1k objects they take, x64 (:func:`shrinker_id_hwm`;
  resolution 64 ids, repeated reads agree within about 2 units; others making
  or freeing memcgs at the same moment disturb it). ``shrinkers_before`` / ``shrinkers_after`` bound the whole bench,
  ``<rt>shrinkers_keep_before`` / ``_after`` each runtime's keep phase.
  ``<rt>superblocks_per_sandbox`` counts the superblocks made for one idle
  sandbox: the devices in its mount namespace (mountinfo's major:minor) and
  of its pid 1's open files, less those the host or a second sandbox of the
  same runtime also has (:func:`own_superblocks`).
- **Writable-layer media** (DSec only, after the three blocks):
  ``Resources(disk_medium="disk" | "memory")`` create latency, memory per idle
  sandbox after each of K sandboxes wrote 50 MiB of incompressible data, write
  throughput, teardown. Each medium has its own K: the memory medium holds
  its 50 MiB in RAM, so its K is at most what MemAvailable holds
  (``written_50mb_n_memory``); the disk medium's written data is page cache
  (reclaimable, written back), so its K (``written_50mb_n_disk``, also
  ``written_50mb_n``) is the full 1,000 (quick 50) whenever the disk under the
  state directory, and the runtime's btrfs filesystem, have room for K x 50 MiB
  plus a margin (:func:`disk_fit_n`).

Must never: leave a sandbox, mount, cgroup (its probe memcgs included) or
process behind; create more sandboxes than MemAvailable holds with headroom,
nor write more than the disk holds with headroom.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import math
import os
import re
import resource
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Coroutine, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from dsec.bench.baselines import KEEP_CONCURRENCY, decile_rates
from dsec.bench.report import Figure, Series, SeriesData, deciles, memory_per_sandbox, rate_curve
from dsec.bench.stats import percentile

Progress = Callable[[str], None]
Medium = Literal["disk", "memory"]

MiB = 1 << 20
RUNTIMES = ("dsec", "crun", "bwrap")
ORDERS: tuple[tuple[str, ...], ...] = (
    ("dsec", "crun", "bwrap"),
    ("crun", "bwrap", "dsec"),
    ("bwrap", "dsec", "crun"),
    ("dsec", "bwrap", "crun"),
    ("bwrap", "crun", "dsec"),
    ("crun", "dsec", "bwrap"),
)
"""Six runs put each runtime in each place twice and after each other runtime equally
often, and no two runs in a row start with the same runtime."""
FULL_N = 10_000
QUICK_GVISOR_N = 10
FULL_GVISOR_N = 50
"""gVisor sandboxes kept idle for its memory figure (each ~12 MiB: its sentry and gofer)."""
QUICK_N = 200
FULL_WRITTEN_N = 1_000
QUICK_WRITTEN_N = 50
WRITE_BYTES = 50 * MiB
"""What each sandbox of the written phase writes (from /dev/urandom: incompressible)."""
DISK_SLACK_BYTES = 1 * MiB
"""Disk a written sandbox takes besides its data (btrfs subvolume and extent metadata), generously."""
THROUGHPUT_MIB = 256
"""One sandbox writes this many MiB with dd conv=fsync: a build artifact flushed to stable storage."""
IDLE_MIB_BUDGET = 1.0
"""Host memory of one idle sandbox, any runtime, besides its memcg's shrinker map. Measured at
N=1,000: DSec 0.87, crun 0.65, bwrap 0.74 MiB, the first two including a 0.46 MiB map."""
SUPERBLOCKS_BUDGET = 8
"""Superblocks one sandbox makes, at most (measured: DSec 2, or 3 with the memory medium;
bwrap 5; crun 7)."""
_PROBES = 8
_PROBE_ROUNDS = 7


def key(runtime: str, name: str) -> str:
    """A runtime's key: DSec's bare (``keep_n``), the baselines' prefixed (``crun_keep_n``)."""
    if runtime not in RUNTIMES:
        raise ValueError(f"unknown runtime {runtime!r}")
    return name if runtime == "dsec" else f"{runtime}_{name}"


# ------------------------------------------------------------------- order --


def parse_order(text: str) -> tuple[str, ...]:
    """``"crun,dsec,bwrap"`` -> ``("crun", "dsec", "bwrap")``: each of the three runtimes once."""
    names = tuple(p.strip().lower() for p in text.split(",") if p.strip())
    if sorted(names) != sorted(RUNTIMES):
        raise ValueError(f"order must name each of {', '.join(RUNTIMES)} once, got {text!r}")
    return names


def rotated_order(counter: int) -> tuple[str, ...]:
    """The order of run number ``counter`` (cycles through :data:`ORDERS`)."""
    return ORDERS[counter % len(ORDERS)]


def next_run_counter(directory: Path) -> tuple[int, str]:
    """This run's number from a counter file in ``directory`` (then bumped); with where it came from.

    Falls back to the current minute when the file cannot be kept (read-only state dir).
    """
    path = directory / "runtime-bench-runs"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        try:
            counter = int(path.read_text().strip() or 0)
        except (FileNotFoundError, ValueError):
            counter = 0
        tmp = path.with_suffix(".tmp")
        tmp.write_text(f"{counter + 1}\n")
        tmp.replace(path)
        return counter, f"rotation, run {counter}"
    except OSError:
        minute = int(time.time() // 60)
        return minute, "current minute"


# ---------------------------------------------------------------- memory ----


def _meminfo() -> dict[str, int]:
    info: dict[str, int] = {}
    with open("/proc/meminfo") as f:
        for line in f:
            k, v = line.split(":", 1)
            info[k] = int(v.split()[0]) * 1024
    return info


def _mem_available() -> int:
    return _meminfo()["MemAvailable"]


def headroom_bytes(mem_total: int) -> int:
    """Memory a bench leaves alone: 1 GiB or 5 % of the machine, the larger (others share it)."""
    return max(1 << 30, mem_total // 20)


def mib_per_sandbox(n: int, *, hwm_ids: int, nodes: int = 1, extra_mib: float = 0.0) -> float:
    """Host memory one of ``n`` kept sandboxes is budgeted (MiB).

    :data:`IDLE_MIB_BUDGET` plus its memcg's shrinker map: 1 KiB per 64 shrinker
    ids per node, with the ids' high-water mark at least what ``n`` sandboxes of
    :data:`SUPERBLOCKS_BUDGET` superblocks each push it to (so the whole grows
    as n squared: 10,000 sandboxes about 2.2 MiB each), plus ``extra_mib``.
    """
    ids = max(hwm_ids, SUPERBLOCKS_BUDGET * n)
    return IDLE_MIB_BUDGET + nodes * math.ceil(ids / 64) / 1024 + extra_mib


def disk_headroom_bytes(free_bytes: int) -> int:
    """Disk a bench leaves alone: 2 GiB or a tenth of what is free, the larger (others share it)."""
    return max(2 << 30, free_bytes // 10)


def disk_fit_n(want: int, free_bytes: int, per_sandbox_bytes: int = WRITE_BYTES + DISK_SLACK_BYTES) -> int:
    """The largest k <= ``want`` whose k x ``per_sandbox_bytes`` fit in ``free_bytes`` less
    :func:`disk_headroom_bytes` (0 if none)."""
    room = free_bytes - disk_headroom_bytes(free_bytes)
    return max(0, min(want, room // per_sandbox_bytes))


def disk_free_bytes(paths: Iterable[Path]) -> int:
    """Bytes an unprivileged writer could still put on the emptiest of ``paths``' filesystems."""
    free = []
    for path in paths:
        st = os.statvfs(path)
        free.append(st.f_bavail * st.f_frsize)
    if not free:
        raise ValueError("no paths")
    return min(free)


def fit_n(want: int, free_bytes: int, per_sandbox_mib: Callable[[int], float]) -> int:
    """The largest n <= ``want`` whose ``n * per_sandbox_mib(n)`` MiB fit in ``free_bytes`` (0 if none).

    ``per_sandbox_mib`` must not decrease with n.
    """
    lo, hi = 0, max(0, want)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if mid * per_sandbox_mib(mid) * MiB <= free_bytes:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _ensure_pid_max(need: int, say: Progress) -> None:
    path = Path("/proc/sys/kernel/pid_max")
    cur = int(path.read_text())
    if cur < need:
        path.write_text(str(min(4194304, need * 2)))
        say(f"raised kernel.pid_max from {cur} to {path.read_text().strip()} for this run")


def _raise_nofile() -> None:
    """N kept sandboxes are N stdin pipes held by this process."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


class MemSampler:
    """MemAvailable read from a thread every ``period_s`` while a keep phase runs: the
    memory-against-N curve (the flat keys keep only the drop with all N idle).

    ``with MemSampler() as m: ...``; then :meth:`relative` places the samples on a series'
    time line. One read of /proc/meminfo four times a second: nothing beside the creates.
    """

    def __init__(self, period_s: float = 0.25) -> None:
        self.period_s = period_s
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="dsec-bench-mem", daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(OSError, KeyError, ValueError):
                self.samples.append((time.perf_counter(), _mem_available()))
            self._stop.wait(self.period_s)

    def __enter__(self) -> MemSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        with contextlib.suppress(OSError, KeyError, ValueError):
            self.samples.append((time.perf_counter(), _mem_available()))  # the last point: all N made

    def relative(self, t0: float, mem0: int) -> list[list[float]]:
        """``[[seconds since t0, bytes used since mem0], ...]`` from ``t0`` on (perf_counter's clock)."""
        return [[round(t - t0, 3), mem0 - avail] for t, avail in self.samples if t >= t0]


# ---------------------------------------------------- shrinkers & superblocks --


def _slab_objects(cache: str) -> int:
    """Active objects of slab cache ``cache`` (/proc/slabinfo, root only)."""
    with open("/proc/slabinfo") as f:
        for line in f:
            fields = line.split()
            if fields and fields[0] == cache:
                return int(fields[1])
    raise LookupError(f"no slab cache {cache!r}")


def _memcg_root() -> Path | None:
    v1 = Path("/sys/fs/cgroup/memory")
    if (v1 / "memory.limit_in_bytes").exists():
        return v1
    v2 = Path("/sys/fs/cgroup")
    with contextlib.suppress(OSError):
        if "memory" in (v2 / "cgroup.subtree_control").read_text().split():
            return v2
    return None


def _possible_nodes() -> int:
    count = 0
    with contextlib.suppress(OSError):
        for part in Path("/sys/devices/system/node/possible").read_text().strip().split(","):
            a, _, b = part.partition("-")
            count += int(b or a) - int(a) + 1
    return max(1, count)


def _kernel_at_least(major: int, minor: int) -> bool:
    m = re.match(r"(\d+)\.(\d+)", os.uname().release)
    return m is not None and (int(m.group(1)), int(m.group(2))) >= (major, minor)


def units_to_ids(objects_per_memcg: float, nodes: int) -> int:
    """kmalloc-1k objects one new memcg takes -> shrinker ids (64 per object per node)."""
    return 64 * round(objects_per_memcg / nodes)


def _settled_slab(cache: str, *, quiet: int = 16, timeout: float = 3.0) -> None:
    """Wait until ``cache`` stops moving (memcgs of torn-down sandboxes are freed asynchronously)."""
    deadline = time.monotonic() + timeout
    last = _slab_objects(cache)
    while time.monotonic() < deadline:
        time.sleep(0.05)
        now = _slab_objects(cache)
        if abs(now - last) <= quiet:
            return
        last = now


def shrinker_id_hwm() -> int | None:
    """Estimate of the kernel's memcg shrinker id high-water mark; None when not measurable.

    Linux >= 6.7 gives every memcg, per NUMA node, one ``shrinker_info_unit``
    (64 deferred counters and a 64-bit map, a kmalloc-1k object) per 64
    shrinker ids up to the high-water mark (``shrinker_nr_max``, which never
    falls until reboot). Making a few empty memcgs and counting the kmalloc-1k
    objects they took reads it. The window is kept short (8 memcgs) and the
    median of 7 rounds taken, because memcgs being freed meanwhile (ours of the
    round before, a teardown's) give objects back and hide some: one 32-memcg
    round read 16 units where 8-memcg rounds read 472. Probe memcgs are named
    ``dsec-bench-probe-*`` and removed before returning.
    """
    root = _memcg_root()
    if root is None or not _kernel_at_least(6, 7):
        return None
    rounds: list[float] = []
    try:
        _settled_slab("kmalloc-1k")
        for r in range(_PROBE_ROUNDS):
            made: list[Path] = []
            try:
                before = _slab_objects("kmalloc-1k")
                for i in range(_PROBES):
                    p = root / f"dsec-bench-probe-{os.getpid()}-{r}-{i}"
                    p.mkdir()
                    made.append(p)
                after = _slab_objects("kmalloc-1k")
            finally:
                for p in made:
                    for _ in range(100):
                        try:
                            p.rmdir()
                            break
                        except FileNotFoundError:
                            break
                        except OSError:
                            time.sleep(0.01)
            rounds.append((after - before) / _PROBES)
            time.sleep(0.02)
    except (OSError, LookupError):
        return None
    return units_to_ids(statistics.median(rounds), _possible_nodes())


def mountinfo_devs(text: str) -> dict[str, str]:
    """``{"major:minor": fstype}`` of every mount in a mountinfo text (one superblock each)."""
    devs: dict[str, str] = {}
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        fields = left.split()
        if not sep or len(fields) < 3 or not right:
            continue
        devs.setdefault(fields[2], right.split()[0])
    return devs


_FS_MAGIC = {
    0x01021994: "tmpfs", 0x794C7630: "overlay", 0x9FA0: "proc", 0x1CD1: "devpts",
    0x19800202: "mqueue", 0xE0F5E1E2: "erofs", 0x9123683E: "btrfs", 0x62656572: "sysfs",
    0x50495045: "pipefs", 0x534F434B: "sockfs", 0x6E736673: "nsfs", 0x09041934: "anon_inodefs",
    0xEF53: "ext4", 0x73717368: "squashfs", 0x27E0EB: "cgroup", 0x63677270: "cgroup2",
}  # fmt: skip
_SUBVOLUME_DEVS = {"btrfs"}
"""Filesystems whose files report a per-subvolume st_dev: not a superblock each."""


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _fs_type(path: str) -> str:
    buf = ctypes.create_string_buffer(256)  # struct statfs; f_type is its first word
    if _libc().statfs(path.encode(), buf) != 0:
        return "?"
    magic = int.from_bytes(buf.raw[: ctypes.sizeof(ctypes.c_long)], "little", signed=True) & 0xFFFFFFFF
    return _FS_MAGIC.get(magic, hex(magic))


def sandbox_devs(pid: int) -> dict[str, str]:
    """Superblocks one sandbox can reach, from its pid 1 ``pid``: ``{"major:minor": fstype}``.

    The mounts of its mount namespace, and the devices of the files pid 1 holds
    open (DSec's init keeps the writable layer's tmpfs open behind the overlay,
    where no mountinfo shows it). A btrfs file's st_dev names its subvolume, not
    a superblock: those are left out.
    """
    devs = mountinfo_devs(Path(f"/proc/{pid}/mountinfo").read_text())
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            link = f"/proc/{pid}/fd/{fd}"
            try:
                st = os.stat(link)
            except OSError:
                continue
            dev = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
            if dev not in devs:
                kind = _fs_type(link)
                if kind not in _SUBVOLUME_DEVS:
                    devs[dev] = kind
    return devs


def own_superblocks(one: Mapping[str, str], other: Mapping[str, str], host: Iterable[str]) -> dict[str, str]:
    """The superblocks of sandbox ``one`` made for it: neither the host's nor a second sandbox's.

    ``other`` is a sandbox of the same runtime; what both reach (a shared base
    layer, pipefs, nsfs) was not made per sandbox.
    """
    shared = set(other) | set(host)
    return {d: t for d, t in one.items() if d not in shared}


def kinds_summary(devs: Mapping[str, str]) -> str:
    """``{"0:51": "tmpfs", "0:52": "tmpfs", "0:53": "proc"}`` -> ``"proc:1 tmpfs:2"``."""
    counts: dict[str, int] = {}
    for kind in devs.values():
        counts[kind] = counts.get(kind, 0) + 1
    return " ".join(f"{k}:{v}" for k, v in sorted(counts.items()))


def _host_devs() -> set[str]:
    return set(mountinfo_devs(Path("/proc/self/mountinfo").read_text()))


# ------------------------------------------------------------ keep figures --


def keep_keys(runtime: str, *, n: int, done_s: Sequence[float], idle_bytes: float, teardown_s: float,
              superblocks: Mapping[str, str]) -> dict[str, Any]:
    """One runtime's create-and-keep keys, named after it (:func:`key`).

    ``done_s``: when each sandbox was ready, seconds since the series began;
    ``idle_bytes``: the drop in MemAvailable with all ``n`` idle.
    """
    if len(done_s) != n:
        raise ValueError(f"{runtime}: {len(done_s)} ready times for n={n}")
    first, last = decile_rates(done_s)
    return {
        key(runtime, "keep_n"): n,
        key(runtime, "create_rate"): n / max(done_s),
        key(runtime, "create_rate_first_decile"): first,
        key(runtime, "create_rate_last_decile"): last,
        key(runtime, "create_rate_last_decile_ratio"): last / first,
        key(runtime, "idle_mib_per_sandbox"): idle_bytes / n / MiB,
        key(runtime, "teardown_rate"): n / teardown_s,
        key(runtime, "superblocks_per_sandbox"): len(superblocks),
        key(runtime, "superblocks_per_sandbox_kinds"): kinds_summary(superblocks),
    }


# -------------------------------------------------------------- rootfs ------


def debian_rootfs(cache: Path, say: Progress) -> Path:
    """A Debian bookworm minbase rootfs with python3, made once and cached (debootstrap, ~1 min)."""
    from dsec.images.debootstrap import find_mirror, run_debootstrap, scrub_build_host, slim_rootfs

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
    scrub_build_host(target)  # the build machine's hostname and resolver out, a neutral /etc/hosts in
    done.write_text("ok\n")
    return target


# ------------------------------------------------------------------ DSec ----


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


async def _all(coros: Iterable[Coroutine[Any, Any, None]]) -> None:
    """Run them all; on the first failure cancel the rest (no sandbox made after the cleanup)."""
    async with asyncio.TaskGroup() as tg:
        for c in coros:
            tg.create_task(c)


class _Idlers:
    """Kept DSec sandboxes, each with an idle shell on a stdin pipe this process holds."""

    def __init__(self, rt: Any) -> None:
        self.rt = rt
        self.ids: list[str] = []
        self.ready: list[float] = []
        self.ready_ms: list[float] = []
        self._stdins: list[int] = []
        self._devnull = os.open("/dev/null", os.O_RDWR | os.O_CLOEXEC)

    async def add(self, spec: Any, t_start: float, *, before_idle: Callable[[str], Any] | None = None) -> None:
        t_add = time.perf_counter()
        sb = await self.rt.create(spec)
        self.ids.append(sb.id)  # before anything else can fail: close() must find it
        if before_idle is not None:
            await before_idle(sb.id)
        r, w = os.pipe2(os.O_CLOEXEC)
        try:
            self._stdins.append(w)
            await self.rt.start_process(sb.id, ["/bin/sh"], stdin=r, stdout=self._devnull, stderr=self._devnull)
        finally:
            os.close(r)
        now = time.perf_counter()
        self.ready.append(now - t_start)
        self.ready_ms.append((now - t_add) * 1000)

    async def teardown(self, concurrency: int = 16) -> float:
        """Destroy them all, ``concurrency`` at a time; seconds taken."""
        self._close_stdins()
        sem = asyncio.Semaphore(concurrency)

        async def kill(i: str) -> None:
            async with sem:
                await self.rt.destroy(i)

        t0 = time.perf_counter()
        await asyncio.gather(*(kill(i) for i in self.ids))
        took = time.perf_counter() - t0
        self.ids.clear()
        return took

    def _close_stdins(self) -> None:
        for w in self._stdins:
            with contextlib.suppress(OSError):
                os.close(w)
        self._stdins.clear()

    async def close(self) -> None:
        """Whatever is left (after an error): destroyed, fds closed."""
        self._close_stdins()
        for i in self.ids:
            with contextlib.suppress(Exception):
                await self.rt.destroy(i)
        self.ids.clear()
        with contextlib.suppress(OSError):
            os.close(self._devnull)


def _put(series: SeriesData | None, name: str, runtime: str, values: Any) -> None:
    """One runtime's series ``name`` (rounded floats: a side file, not a figure)."""
    if series is None:
        return
    if isinstance(values, list) and values and not isinstance(values[0], list):
        values = [round(float(v), 4) for v in values]
    series.setdefault(name, {})[runtime] = values


async def _dsec_side(rootfs: Path, work: Path, *, n_lat: int, n_keep: int, n_exec: int, host: set[str],
                     say: Progress, debian: Path | None = None, series: SeriesData | None = None) -> dict[str, Any]:
    from dsec.backends.container import shrinkers
    from dsec.backends.container.runtime import ContainerRuntime
    from dsec.images.build import build_from_dir
    from dsec.spec import ImageRef, Resources, SandboxSpec

    out: dict[str, Any] = {}
    # As an edge whose max_sandboxes is the N it keeps (EdgeConfig.max_sandboxes): the reserve
    # is made at start, before any sandbox (dsec.backends.container.shrinkers).
    reserve = shrinkers.ids_for(n_keep)
    out["shrinker_reserve_ids"] = reserve
    out["shrinker_reserved_before"] = shrinkers.reserved()
    async with ContainerRuntime(name="bench", state_dir=work / "state", run_dir=work / "run",
                                shrinker_reserve=reserve) as rt:
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
        _put(series, "create_ms", "dsec", lat)

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
        _put(series, "exec_ms", "dsec", ex)
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

        out["shrinkers_keep_before"] = await asyncio.to_thread(shrinker_id_hwm)
        say(f"dsec: create-and-keep {n_keep} sandboxes, each with a shell waiting on stdin")
        idlers = _Idlers(rt)
        try:
            sem = asyncio.Semaphore(KEEP_CONCURRENCY)  # crun's and bwrap's runners have as many in flight

            async def keep(t_start: float) -> None:
                async with sem:
                    await idlers.add(spec, t_start)

            mem0 = _mem_available()
            with MemSampler() as sampler:
                t0 = time.perf_counter()
                await _all(keep(t0) for _ in range(n_keep))
            await asyncio.sleep(1.0)  # let lazily freed memory settle
            idle = mem0 - _mem_available()
            _put(series, "keep_ready_s", "dsec", idlers.ready)
            _put(series, "keep_ready_ms", "dsec", idlers.ready_ms)
            _put(series, "keep_mem", "dsec", sampler.relative(t0, mem0))
            own = own_superblocks(sandbox_devs(rt.get(idlers.ids[0]).init_pid),
                                  sandbox_devs(rt.get(idlers.ids[-1]).init_pid), host)
            say(f"dsec: teardown of {n_keep}")
            took = await idlers.teardown(KEEP_CONCURRENCY)
        finally:
            await idlers.close()
        out.update(keep_keys("dsec", n=n_keep, done_s=idlers.ready, idle_bytes=idle, teardown_s=took,
                             superblocks=own))
        out["idle_n"] = n_keep
        out["keep_disk_medium"] = spec.resources.disk_medium
        out["shrinkers_keep_after"] = await asyncio.to_thread(shrinker_id_hwm)
        with contextlib.suppress(Exception):
            rt.store.remove(layer.digest)
    return out


async def _dsec_media(rootfs: Path, work: Path, *, n_lat: int, k: Mapping[Medium, int], media: Sequence[Medium],
                      host: set[str], say: Progress, series: SeriesData | None = None) -> dict[str, Any]:
    """The writable layer on ``disk`` vs in ``memory``: latency, written density, throughput, teardown.

    ``k``: how many sandboxes of each medium write :data:`WRITE_BYTES` and idle. The disk
    medium's is further capped, just before its written phase, by what the state directory's
    disk and the runtime's btrfs filesystem hold (:func:`disk_fit_n`).
    """
    from dsec.backends.container.runtime import ContainerRuntime
    from dsec.images.build import build_from_dir
    from dsec.spec import ImageRef, Resources, SandboxSpec

    out: dict[str, Any] = {}
    async with ContainerRuntime(name="bench", state_dir=work / "state", run_dir=work / "run") as rt:
        layer = await asyncio.to_thread(build_from_dir, rt.store, rootfs, name="bench-busybox", tag="latest", kind="base")

        def spec(medium: Medium, *, memory: int = 256 * MiB, disk: int = 128 * MiB) -> SandboxSpec:
            return SandboxSpec(image=ImageRef(base=layer.digest),
                               resources=Resources(cpu=1, memory=memory, pids=256, disk=disk, disk_medium=medium))

        async def run_ok(sid: str, script: str) -> float:
            t0 = time.perf_counter()
            res = await rt.exec(sid, ["/bin/busybox", "sh", "-c", script])
            took = time.perf_counter() - t0
            if res.exit_code != 0:
                raise RuntimeError(f"sandbox {sid}: {script!r} exited {res.exit_code}/{res.signal}: "
                                   f"{res.stderr[-400:].decode(errors='replace')}")
            return took

        for m in media:
            await _dsec_latency(rt, spec(m), 3)
        say(f"dsec media: create + first exec, {n_lat} samples each, {' and '.join(media)} alternating")
        lat: dict[str, list[float]] = {m: [] for m in media}
        for _ in range(n_lat):
            for m in media:
                lat[m] += (await _dsec_latency(rt, spec(m), 1))[0]
        for m in media:
            out[f"create_p50_ms_{m}"] = percentile(lat[m], 50)
            _put(series, "create_ms_medium", m, lat[m])

        for m in media:
            say(f"dsec media: one sandbox writes {THROUGHPUT_MIB} MiB with dd conv=fsync ({m})")
            sb = await rt.create(spec(m, memory=(THROUGHPUT_MIB + 256) * MiB, disk=(THROUGHPUT_MIB + 128) * MiB))
            try:
                took = await run_ok(sb.id, f"busybox dd if=/dev/zero of=/w bs=1048576 count={THROUGHPUT_MIB} "
                                           "conv=fsync 2>/dev/null")
            finally:
                await rt.destroy(sb.id)
            out[f"write_mib_s_{m}"] = THROUGHPUT_MIB / took

        write = f"busybox mkdir -p /root && busybox head -c {WRITE_BYTES} /dev/urandom > /root/f"

        async def written(medium: Medium, count: int) -> tuple[float, float, dict[str, str]]:
            """``count`` sandboxes that each wrote WRITE_BYTES, then idle: MiB each, teardown rate, own superblocks."""
            idlers = _Idlers(rt)
            sem = asyncio.Semaphore(4)  # /dev/urandom and the copy take a core each

            async def one(t_start: float) -> None:
                async with sem:
                    await idlers.add(spec(medium), t_start, before_idle=lambda sid: run_ok(sid, write))

            try:
                mem0 = _mem_available()
                await _all(one(time.perf_counter()) for _ in range(count))
                await asyncio.sleep(1.0)
                mib = (mem0 - _mem_available()) / count / MiB
                own = own_superblocks(sandbox_devs(rt.get(idlers.ids[0]).init_pid),
                                      sandbox_devs(rt.get(idlers.ids[-1]).init_pid), host) if count > 1 else {}
                took = await idlers.teardown()
            finally:
                await idlers.close()
            return mib, count / took, own

        n_written: dict[Medium, int] = {}
        for m in media:
            n_written[m] = k[m]
            if m == "disk":
                free = disk_free_bytes([work / "state", *([rt.uppers.mountpoint] if rt.uppers.ready else [])])
                cap = disk_fit_n(max(k[m], FULL_WRITTEN_N), free)
                out["written_50mb_n_disk_cap"] = cap
                if cap < k[m]:
                    say(f"note: the disk holds {cap:,} sandboxes that wrote {WRITE_BYTES // MiB} MiB each "
                        f"({free / (1 << 30):,.1f} GiB free): written_50mb_n_disk = {cap:,}, not {k[m]:,}")
                if cap < 1:
                    raise RuntimeError(f"the disk holds not one sandbox of the written phase ({free / MiB:,.0f} "
                                       "MiB free)")
                n_written[m] = min(k[m], cap)
            say(f"dsec media: {n_written[m]:,} sandboxes ({m}) each write {WRITE_BYTES // MiB} MiB, then idle")
            mib, rate, own = await written(m, n_written[m])
            out[f"idle_mib_per_sandbox_written_50mb_{m}"] = mib
            out[f"teardown_rate_{m}"] = rate
            out[f"superblocks_per_sandbox_{m}"] = len(own)
            out[f"superblocks_per_sandbox_{m}_kinds"] = kinds_summary(own)
        with contextlib.suppress(Exception):
            rt.store.remove(layer.digest)
    for m in media:
        out[f"written_50mb_n_{m}"] = n_written[m]
    out["written_50mb_n"] = n_written.get("disk", 0)
    out["media_order"] = ",".join(media)
    out["create_disk_vs_memory_ratio"] = out["create_p50_ms_disk"] / out["create_p50_ms_memory"]
    return out


# ------------------------------------------------------------- baselines ----


def _baseline_side(tool: str, rootfs: Path, *, n_lat: int, n_keep: int, n_exec: int, host: set[str],
                   say: Progress, debian: Path | None = None, series: SeriesData | None = None) -> dict[str, Any]:
    from dsec.bench import baselines

    out: dict[str, Any] = {}
    latency = baselines.crun_create_latency if tool == "crun" else baselines.bwrap_create_latency
    say(f"{tool}: create + first exec, {n_lat} samples")
    lat = latency(rootfs, n_lat)
    out[key(tool, "create_p50_ms")] = percentile(lat, 50)
    out[key(tool, "create_p95_ms")] = percentile(lat, 95)
    _put(series, "create_ms", tool, lat)
    if debian is not None:
        say(f"{tool}: create + first exec on the Debian rootfs, {n_lat} samples")
        out[f"debian_{tool}_create_p50_ms"] = percentile(latency(debian, n_lat), 50)
    if tool == "crun":
        say(f"crun: exec round trip, {n_exec} samples")
        ex = baselines.crun_exec_latency(rootfs, n_exec)
        out["crun_exec_p50_ms"] = percentile(ex, 50)
        _put(series, "exec_ms", "crun", ex)

    out[key(tool, "shrinkers_keep_before")] = shrinker_id_hwm()
    say(f"{tool}: create-and-keep {n_keep}, each with a shell waiting on stdin")
    with baselines.Keeper(tool, rootfs, concurrency=KEEP_CONCURRENCY) as kept:
        mem0 = _mem_available()
        with MemSampler() as sampler:
            kept.spawn(n_keep)
        time.sleep(1.0)  # as for DSec: let lazily freed memory settle
        idle = mem0 - _mem_available()
        _put(series, "keep_ready_s", tool, kept.done_s())
        _put(series, "keep_ready_ms", tool, kept.ready_ms())
        _put(series, "keep_mem", tool, sampler.relative(kept.began(), mem0))
        own = own_superblocks(sandbox_devs(kept.sandbox_pid(0)), sandbox_devs(kept.sandbox_pid(n_keep - 1)), host)
        say(f"{tool}: teardown of {n_keep}")
        summary = kept.teardown()
        done = kept.done_s()
    out.update(keep_keys(tool, n=n_keep, done_s=done, idle_bytes=idle, teardown_s=summary["teardown_s"],
                         superblocks=own))
    out[key(tool, "shrinkers_keep_after")] = shrinker_id_hwm()
    return out


# ------------------------------------------------------------------- run ----


def in_table_order(results: Mapping[str, Any]) -> dict[str, Any]:
    """The same keys in an order that does not depend on the run's order: the run's facts and
    DSec's figures, then crun's, bwrap's, then the ratios and what the kernel kept."""
    def group(k: str) -> int:
        if k.startswith("crun_") or k.startswith("debian_crun_"):
            return 1
        if k.startswith("bwrap_") or k.startswith("debian_bwrap_"):
            return 2
        if "_vs_" in k or k in ("shrinkers_after", "cpus", "mem_total_mib"):
            return 3
        return 0

    return dict(sorted(results.items(), key=lambda kv: group(kv[0])))  # stable within a group


def _ratio(results: dict[str, Any], a: str, b: str) -> float:
    try:
        return float(results[a]) / float(results[b])
    except (KeyError, TypeError, ZeroDivisionError):
        return float("nan")


def run(*, quick: bool = False, n_keep: int | None = None, order: Sequence[str] | None = None,
        written_n: int | None = None, debian: bool | None = None, cache_dir: Path | None = None,
        gvisor: bool | None = None, say: Progress = print, series: SeriesData | None = None) -> dict[str, Any]:
    """The whole suite; ``gvisor`` (default: when runsc is installed) adds the gVisor backend's
    figures beside the container backend's, measured in the same run (dsec.bench.gvisor).

    ``series``, when given, receives the per-sample data the flat keys summarise (each
    runtime's ready times and memory samples of its keep, its latencies: :func:`figures`)."""
    from dsec.bench import baselines

    n_lat = 30 if quick else 200
    n_exec = 50 if quick else 300
    state_dir = Path(os.environ.get("DSEC_STATE_DIR", "/var/lib/dsec"))
    counter, counter_source = next_run_counter(state_dir / "bench")
    run_order = tuple(order) if order is not None else rotated_order(counter)
    media: tuple[Medium, Medium] = ("disk", "memory") if counter % 2 == 0 else ("memory", "disk")
    results: dict[str, Any] = {"quick": quick, "order": ",".join(run_order),
                               "order_source": "--order" if order is not None else counter_source}

    _raise_nofile()
    info = _meminfo()
    nodes = _possible_nodes()
    hwm0 = shrinker_id_hwm()
    results["shrinkers_before"] = hwm0
    with contextlib.suppress(OSError, ValueError, IndexError):
        results["uptime_s"] = round(float(Path("/proc/uptime").read_text().split()[0]))
    free = info["MemAvailable"] - headroom_bytes(info["MemTotal"])
    want = n_keep if n_keep is not None else (QUICK_N if quick else FULL_N)
    cap = fit_n(max(want, FULL_N), free, lambda n: mib_per_sandbox(n, hwm_ids=hwm0 or 0, nodes=nodes))
    keep = min(want, cap)
    if keep < want:
        say(f"note: MemAvailable {info['MemAvailable'] / MiB:,.0f} MiB holds {cap:,} sandboxes per runtime "
            f"(budget {mib_per_sandbox(cap, hwm_ids=hwm0 or 0, nodes=nodes):.2f} MiB each, headroom "
            f"{headroom_bytes(info['MemTotal']) / MiB:,.0f} MiB): N = {keep:,}, not {want:,}")
    if keep < 10:
        raise RuntimeError(f"MemAvailable {info['MemAvailable'] / MiB:,.0f} MiB holds no useful N ({keep})")
    for rt_name in RUNTIMES:
        results[key(rt_name, "keep_n")] = keep
    results["keep_n_wanted"] = want
    results["keep_n_memory_cap"] = cap
    results["keep_concurrency"] = KEEP_CONCURRENCY
    say(f"order {results['order']} ({results['order_source']}); N = {keep:,} for each runtime, "
        f"{KEEP_CONCURRENCY} in flight")
    say("note: shrinkers_* estimate the kernel's memcg shrinker id high-water mark (64 x kmalloc-1k "
        "objects per new memcg); it only grows until reboot, so every later memcg on this boot pays for it")

    _ensure_pid_max(keep * 4 + 2000, say)
    with tempfile.TemporaryDirectory(prefix="dsec-bench-") as tmp:
        work = Path(tmp)
        rootfs = baselines.prepare_busybox_rootfs(work / "rootfs")
        deb_root = None
        if debian if debian is not None else not quick:
            cache = cache_dir or state_dir / "cache"
            deb_root = debian_rootfs(cache, say)
        host = _host_devs()
        for rt_name in run_order:
            if rt_name == "dsec":
                results.update(asyncio.run(_dsec_side(rootfs, work, n_lat=n_lat, n_keep=keep, n_exec=n_exec,
                                                      host=host, say=say, debian=deb_root, series=series)))
            else:
                results.update(_baseline_side(rt_name, rootfs, n_lat=n_lat, n_keep=keep, n_exec=n_exec,
                                              host=host, say=say, debian=deb_root, series=series))

        k_want = written_n if written_n is not None else (QUICK_WRITTEN_N if quick else FULL_WRITTEN_N)
        info = _meminfo()
        hwm = shrinker_id_hwm() or 0
        mem_free = info["MemAvailable"] - headroom_bytes(info["MemTotal"])
        # The memory medium keeps what it wrote in RAM; the disk medium's is page cache (reclaimable),
        # so only its idle sandboxes count against memory; the disk's room is checked in _dsec_media.
        k_cap = fit_n(max(k_want, FULL_WRITTEN_N), mem_free,
                      lambda n: mib_per_sandbox(n, hwm_ids=hwm, nodes=nodes, extra_mib=WRITE_BYTES / MiB))
        k_cap_disk = fit_n(max(k_want, FULL_WRITTEN_N), mem_free, lambda n: mib_per_sandbox(n, hwm_ids=hwm, nodes=nodes))
        if k_cap < k_want:
            say(f"note: MemAvailable holds {k_cap:,} sandboxes that wrote {WRITE_BYTES // MiB} MiB each in memory: "
                f"written_50mb_n_memory = {k_cap:,}, not {k_want:,}")
        if k_cap_disk < k_want:
            say(f"note: MemAvailable holds {k_cap_disk:,} idle sandboxes: written_50mb_n_disk = {k_cap_disk:,} "
                f"at most, not {k_want:,}")
        if k_cap < 1:
            raise RuntimeError("MemAvailable holds not one sandbox of the written phase")
        results["written_50mb_n_memory_cap"] = k_cap
        results["written_50mb_n_wanted"] = k_want
        k_media: dict[Medium, int] = {"disk": min(k_want, k_cap_disk), "memory": min(k_want, k_cap)}
        results.update(asyncio.run(_dsec_media(rootfs, work, n_lat=n_lat, k=k_media, media=media,
                                               host=host, say=say, series=series)))

    if gvisor is not False and shutil.which("runsc") is not None:
        from dsec.bench import gvisor as gv_bench

        gv_n = QUICK_GVISOR_N if quick else FULL_GVISOR_N
        say(f"gvisor: {gv_n} idle sandboxes beside the container backend's {gv_n} (same run)")
        gv = asyncio.run(gv_bench.measure(gv_n, n_lat=n_lat // 4 or 10, n_exec=n_exec // 4 or 10, say=say))
        results.update({k: v for k, v in gv.items()})
        results["gvisor_idle_n"] = gv_n
    elif gvisor:
        raise RuntimeError("--gvisor asked for, but runsc is not installed (scripts/setup.sh installs it)")
    results["create_p50_vs_crun"] = _ratio(results, "create_p50_ms", "crun_create_p50_ms")
    results["create_exec_destroy_p50_vs_crun"] = _ratio(results, "create_exec_destroy_p50_ms", "crun_create_p50_ms")
    results["create_p50_vs_bwrap"] = _ratio(results, "create_p50_ms", "bwrap_create_p50_ms")
    results["create_rate_vs_crun"] = _ratio(results, "create_rate", "crun_create_rate")
    results["create_rate_last_decile_vs_crun"] = _ratio(results, "create_rate_last_decile", "crun_create_rate_last_decile")
    results["teardown_rate_vs_crun"] = _ratio(results, "teardown_rate", "crun_teardown_rate")
    results["exec_p50_vs_crun"] = _ratio(results, "exec_p50_ms", "crun_exec_p50_ms")
    if deb_root is not None:
        results["debian_create_p50_vs_crun"] = _ratio(results, "debian_create_p50_ms", "debian_crun_create_p50_ms")
    results["shrinkers_after"] = shrinker_id_hwm()
    results["cpus"] = os.cpu_count() or 0
    results["mem_total_mib"] = info["MemTotal"] // MiB
    say("note: the shrinker id high-water mark (shrinkers_after) stays until reboot: the next run starts there")
    return in_table_order(results)


# ---------------------------------------------------------------- figures ---


_COLORS = {"dsec": "C0", "crun": "C1", "bwrap": "C2", "disk": "C4", "memory": "C5"}


def _label(runtime: str) -> str:
    return {"dsec": "DSec", "crun": "crun", "bwrap": "bwrap"}.get(runtime, runtime)


def _s(runtime: str, x: Sequence[float] = (), y: Sequence[float] = ()) -> Series:
    return Series(_label(runtime), x, y, color=_COLORS.get(runtime))


def figures(results: Mapping[str, Any], series: SeriesData) -> list[Figure]:
    """The report's charts (:mod:`dsec.bench.report`): create rate and memory per sandbox
    against N for each runtime, latency histograms; bars of the flat keys when a run's
    series are not at hand (an older JSON)."""
    n = results.get("keep_n", "?")
    order = results.get("order", "?")
    ready: Mapping[str, Sequence[float]] = series.get("keep_ready_s", {})
    mem: Mapping[str, Sequence[Sequence[float]]] = series.get("keep_mem", {})
    present = [r for r in RUNTIMES if r in ready]

    def ratio(rt: str) -> str:
        v = results.get(key(rt, "create_rate_last_decile_ratio"))
        return f"{_label(rt)} {v:.2f}" if isinstance(v, (int, float)) else ""

    at_n = f" (N = {n:,})" if isinstance(n, int) else ""
    figs: list[Figure] = []
    if present:
        figs.append(Figure(
            title=f"Create-and-keep rate per decile against N (N = {n:,} each)" if isinstance(n, int)
            else "Create-and-keep rate per decile against N",
            kind="line", xlabel="sandboxes kept (end of decile)", ylabel="creates / s in the decile",
            series=tuple(_s(r, *deciles(ready[r])) for r in present), name="runtime-create-rate-deciles",
            caption=f"Each runtime alone, {results.get('keep_concurrency', '?')} in flight, order {order}. "
                    "Last ÷ first decile: " + ", ".join(x for x in map(ratio, present) if x) +
                    " (target ≥ 0.7: flat)."))
        figs.append(Figure(
            title="Create-and-keep rate against N (50 slices)", kind="line",
            xlabel="sandboxes kept", ylabel="creates / s in the slice",
            series=tuple(_s(r, *rate_curve(ready[r], 50)) for r in present), name="runtime-create-rate-curve",
            caption="The same series cut finer: where along N the rate falls."))
    if any(r in mem for r in present):
        figs.append(Figure(
            title="Host memory per idle sandbox against N", kind="line",
            xlabel="sandboxes kept", ylabel="MiB per sandbox (drop in MemAvailable ÷ N)",
            series=tuple(_s(r, *memory_per_sandbox(ready[r], mem[r], min_n=max(10, len(ready[r]) // 100)))
                         for r in present if r in mem), name="runtime-memory-per-sandbox",
            refs=(("target 1.0 MiB", IDLE_MIB_BUDGET),),
            caption="MemAvailable sampled 4 times a second during each keep, placed on its ready times; "
                    "the flat key idle_mib_per_sandbox is the value with all N idle, after 1 s."))
    for name, title, xl, cap in (
        ("create_ms", "Create + first exec latency, one at a time", "ms",
         "DSec: create + exec(true) through the runtime; crun run / bwrap: to the first command's exit."),
        ("keep_ready_ms", "Create-to-ready latency during the keep", "ms",
         "Every sandbox of the create-and-keep, with the others in flight and N growing."),
        ("exec_ms", "Exec round trip in a running sandbox", "ms", "DSec's exec vs `crun exec` of /bin/true."),
        ("create_ms_medium", "Create + first exec by writable-layer medium (DSec)", "ms",
         "Resources.disk_medium: a btrfs subvolume on the node's disk vs tmpfs."),
    ):
        got: Mapping[str, Sequence[float]] = series.get(name, {})
        if got:
            rts = sorted(got, key=lambda r: (*RUNTIMES, "disk", "memory", r).index(r))
            figs.append(Figure(title=title, kind="hist", xlabel=xl, ylabel="samples", logx=name == "keep_ready_ms",
                               series=tuple(_s(r, x=got[r]) for r in rts if got[r]), caption=cap,
                               name=f"runtime-{name.replace('_', '-')}"))
    # from the flat keys alone: every run has these
    rts = [r for r in RUNTIMES if key(r, "create_rate_first_decile") in results]
    if rts:
        figs.append(Figure(
            title=f"Create-and-keep rate: whole series, first and last decile{at_n}", kind="bar",
            categories=tuple(_label(r) for r in rts), ylabel="creates / s",
            series=tuple(Series(lbl, y=tuple(float(results[key(r, k)]) for r in rts)) for lbl, k in (
                ("whole series", "create_rate"), ("first decile", "create_rate_first_decile"),
                ("last decile", "create_rate_last_decile"))),
            caption=f"Order {order}, {results.get('keep_concurrency', '?')} in flight.", name="runtime-create-rate-bars"))
    if all(key(r, "idle_mib_per_sandbox") in results for r in rts) and rts:
        figs.append(Figure(
            title=f"Host memory per idle sandbox{at_n}", kind="bar", categories=tuple(_label(r) for r in rts),
            ylabel="MiB", refs=(("target 1.0 MiB", IDLE_MIB_BUDGET),), name="runtime-memory-bars",
            series=(Series("MiB per sandbox", y=tuple(float(results[key(r, "idle_mib_per_sandbox")]) for r in rts)),)))
    if all(key(r, "teardown_rate") in results for r in rts) and rts:
        figs.append(Figure(
            title=f"Teardown rate{at_n}", kind="bar", categories=tuple(_label(r) for r in rts), ylabel="sandboxes / s",
            name="runtime-teardown-bars",
            series=(Series("removed / s", y=tuple(float(results[key(r, "teardown_rate")]) for r in rts)),)))
    return figs
