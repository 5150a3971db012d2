"""The abuse suite's cases, shared by ``tests/abuse`` and ``dsec bench abuse``.

Each :class:`Case` attacks one sandbox (root inside, small limits) while
neighbour sandboxes run a steady exec workload (:class:`NeighbourLoad`).
:func:`run_case` records, as :class:`Check` objects that can each fail:

- the attack was contained: the specific thing it tried did not happen (a host
  sysctl unchanged, no host file written, a limit enforced, no process of a
  neighbour touched, ...);
- the host stayed healthy: the runtime still creates, execs and destroys; the
  host has free memory and a sane load; the kernel logged no BUG/Oops; the
  attacked sandbox left no cgroup, process, record or mount behind; the
  neighbours' marker processes and files are intact and their execs did not fail;
- the neighbours' exec p50 during the case (a figure, never a check).

Cases must not hurt the host even when a defence is missing: every attack is
capped by the sandbox's limits *and* by a timeout, and destructive calls use
harmless arguments (``reboot`` with Ctrl-Alt-Del-off, ``clock_settime`` to the
current time, ``init_module`` with a bogus image).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import errno
import functools
import hashlib
import io
import json
import os
import re
import secrets
import socket
import subprocess
import tarfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dsec.bench.abuse_helper import HELPER_PATH
from dsec.bench.stats import percentile
from dsec.errors import DsecError, ExecTimeout, FileAccessError
from dsec.spec import FileRules, ImageRef, Resources, SandboxSpec, Stage
from dsec.spec.results import ExecResult

if TYPE_CHECKING:
    from dsec.backends.container.runtime import ContainerRuntime

MiB = 1 << 20
NEIGHBOUR_MARKER = "4711.25"
"""argv[1] of the ``sleep`` each neighbour keeps running: it must survive every case."""
MIN_RATIO_SAMPLES = 20
"""Neighbour execs a case must span for its ratio to count in ``neighbour_p50_ratio_max``."""
BAD_KMSG = re.compile(r"\bBUG:|Oops|general protection fault|Kernel panic|soft lockup|hung_task")


# ------------------------------------------------------------------ results ----


@dataclass
class Check:
    what: str
    ok: bool
    detail: Any = ""

    def __post_init__(self) -> None:
        self.ok = bool(self.ok)
        self.detail = "" if self.ok else str(self.detail)[:2000]


@dataclass
class Outcome:
    """What one case did. ``contained`` is the verdict; the rest explains it."""

    name: str
    checks: list[Check] = field(default_factory=list)
    error: str | None = None
    skipped: str | None = None
    seconds: float = 0.0
    neighbour_p50_ms: float | None = None
    neighbour_execs: int = 0
    notes: list[str] = field(default_factory=list)
    """What the case saw of a channel the docs name as shared (reported, never a verdict)."""

    @property
    def contained(self) -> bool:
        return self.skipped is None and self.error is None and bool(self.checks) and all(c.ok for c in self.checks)

    def failures(self) -> list[str]:
        out = [f"{c.what}: {c.detail}" for c in self.checks if not c.ok]
        if self.error:
            out.insert(0, f"error: {self.error}")
        return out

    def report(self) -> str:
        lines = [f"case {self.name}: {'contained' if self.contained else 'NOT CONTAINED'} in {self.seconds:.1f}s"]
        if self.skipped:
            lines.append(f"  skipped: {self.skipped}")
        if self.error:
            lines.append(f"  error: {self.error}")
        lines += [f"  [{'ok' if c.ok else 'FAIL'}] {c.what}{': ' + str(c.detail) if c.detail else ''}" for c in self.checks]
        lines += [f"  [note] {n}" for n in self.notes]
        return "\n".join(lines)


# ------------------------------------------------------------- environment ----


@dataclass
class EdgeTarget:
    """A real edge HTTP server on loopback (its own runtime, its own event loop)."""

    url: str
    key: bytes

    def token(self, sandbox_id: str, *, admin: bool = False, key: bytes | None = None, ttl_s: float = 3600.0) -> str:
        from dsec.http.auth import mint

        tok, _ = mint(key or self.key, sandbox_id="*" if admin else sandbox_id, project="", ttl_s=ttl_s,
                      scope="edge-admin" if admin else "sandbox")
        return tok

    def headers(self, sandbox_id: str = "*", *, admin: bool = False) -> dict[str, str]:
        return {"authorization": f"Bearer {self.token(sandbox_id, admin=admin)}"}

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1].split("/")[0])


def network_supported(rt: Any) -> bool:
    """Network policies landed in the runtime (``set_policy``)."""
    return callable(getattr(rt, "set_policy", None))


@dataclass
class Lab:
    """What every case shares: the runtime, the helper binary, neighbours, an edge, host markers."""

    rt: ContainerRuntime
    image: str
    work: Path
    helper: Path | None = None
    edge: EdgeTarget | None = None
    quick: bool = True
    neighbours: list[str] = field(default_factory=list)
    secret: str = field(default_factory=lambda: f"DSEC-HOST-SECRET-{secrets.token_hex(8)}")
    sentinel: subprocess.Popen[bytes] | None = None

    @property
    def secret_file(self) -> Path:
        return self.work / "host-secret.txt"

    def spec(self, **resources: Any) -> SandboxSpec:
        res: dict[str, Any] = {"cpu": 1.0, "memory": 128 * MiB, "pids": 64, "disk": 32 * MiB, "nofile": 1024}
        res.update(resources)
        return SandboxSpec(image=ImageRef(base=self.image), resources=Resources(**res))

    async def setup(self, k_neighbours: int) -> None:
        self.work.mkdir(parents=True, exist_ok=True)
        self.secret_file.write_text(self.secret + "\n")
        # A host process any "kill everything" attack must not reach.
        self.sentinel = subprocess.Popen(["sleep", "86400.5"])
        for _ in range(k_neighbours):
            rec = await self.rt.create(self.spec(cpu=1.0, memory=64 * MiB, pids=32, disk=8 * MiB))
            self.neighbours.append(rec.id)
            self.rt.files(rec.id).write("/tmp/neighbour-secret", f"{rec.id}\n".encode())
            await self.rt.exec(rec.id, f"sleep {NEIGHBOUR_MARKER} >/dev/null 2>&1 &", timeout=10)

    async def close(self) -> None:
        for sid in self.neighbours:
            with contextlib.suppress(DsecError):
                await self.rt.destroy(sid)
        self.neighbours.clear()
        if self.sentinel is not None:
            self.sentinel.kill()
            self.sentinel.wait()
            self.sentinel = None
        with contextlib.suppress(OSError):
            self.secret_file.unlink()

    def neighbour_marker_pids(self, sid: str) -> list[int]:
        out = []
        for pid in self.rt.cgroups.pids(sid):
            with contextlib.suppress(OSError):
                if Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[1:2] == [NEIGHBOUR_MARKER.encode()]:
                    out.append(pid)
        return out


# ----------------------------------------------------------- neighbours ----


class NeighbourLoad:
    """Each neighbour runs ``/bin/true`` in a loop (one in flight, a short gap): the steady
    workload whose latency an attack must not ruin. Samples are (end time, ms)."""

    def __init__(self, rt: ContainerRuntime, sids: Sequence[str], *, gap_s: float = 0.02) -> None:
        self.rt = rt
        self.sids = list(sids)
        self.gap_s = gap_s
        self.samples: list[tuple[float, float]] = []
        self.errors: list[tuple[float, str]] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._stop = False

    async def _loop(self, sid: str) -> None:
        while not self._stop:
            t0 = time.perf_counter()
            try:
                await self.rt.exec(sid, ["/bin/true"], timeout=30)
            except DsecError as exc:
                self.errors.append((time.perf_counter(), f"{sid}: {exc}"))
            else:
                t1 = time.perf_counter()
                self.samples.append((t1, (t1 - t0) * 1000))
            await asyncio.sleep(self.gap_s)

    def start(self) -> None:
        self._stop = False
        self._tasks = [asyncio.ensure_future(self._loop(s)) for s in self.sids]

    async def stop(self) -> None:
        self._stop = True
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []

    def since(self, t0: float, t1: float | None = None) -> list[float]:
        end = t1 if t1 is not None else float("inf")
        return [ms for t, ms in self.samples if t0 <= t <= end]

    def errors_since(self, t0: float) -> list[str]:
        return [e for t, e in self.errors if t >= t0]

    async def baseline(self, seconds: float) -> float | None:
        """Neighbour exec p50 with nothing else going on (the load must be running)."""
        t0 = time.perf_counter()
        await asyncio.sleep(seconds)
        got = self.since(t0)
        return percentile(got, 50) if got else None


# ------------------------------------------------------------- host state ----


def _meminfo() -> dict[str, int]:
    out: dict[str, int] = {}
    with open("/proc/meminfo") as f:
        for line in f:
            k, v = line.split(":", 1)
            out[k] = int(v.split()[0]) * 1024
    return out


def kmsg_records() -> list[tuple[int, str]]:
    """(sequence, text) of the kernel log records still in the ring buffer."""
    out: list[tuple[int, str]] = []
    try:
        fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return out
    try:
        while True:
            try:
                rec = os.read(fd, 8192)
            except BlockingIOError:
                break
            except OSError:  # EPIPE: overwritten while we read; go on
                continue
            if not rec:
                break
            head, _, msg = rec.decode(errors="replace").partition(";")
            with contextlib.suppress(ValueError, IndexError):
                out.append((int(head.split(",")[1]), msg.split("\n", 1)[0]))
    finally:
        os.close(fd)
    return out


MEMORY_CGROUPS = Path("/sys/fs/cgroup/memory/dsec")


def _rss_of(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _children(pid: int) -> list[int]:
    out: list[int] = []
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError, ValueError), open(f"/proc/{pid}/task/{tid}/children") as f:
                out.extend(int(x) for x in f.read().split())
    return out


def memory_held(runtime_name: str, root_pid: int | None = None) -> int:
    """Bytes a lab holds: its sandboxes' memory (the usage of ``memory/dsec/<runtime_name>``,
    hierarchical: every sandbox of the runtime, with its page cache and kernel memory) and
    the resident memory of the processes of ``root_pid``'s tree (default: this process)
    outside those cgroups (the runtime's helpers, the edge, anything that left its cgroup
    but not the tree). What a case is judged by, not the host's MemAvailable: other
    processes on a shared host (a user's own ``dsec up``, another suite) move that."""
    root = MEMORY_CGROUPS / runtime_name
    try:
        held = int((root / "memory.usage_in_bytes").read_text())
    except (OSError, ValueError):
        held = 0
    mark = f"/dsec/{runtime_name}/"
    todo, seen = [root_pid or os.getpid()], set()
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        todo.extend(_children(pid))
        try:
            cg = Path(f"/proc/{pid}/cgroup").read_text()
        except OSError:
            continue
        if not any(line.split(":", 2)[1] == "memory" and mark in line.split(":", 2)[2] + "/"
                   for line in cg.splitlines() if line.count(":") >= 2):
            held += _rss_of(pid)
    return held


@dataclass
class HostState:
    mem_available: int
    """The host's, for the record: other processes move it, so no check stands on it."""
    load1: float
    kmsg_seq: int
    ncpu: int
    held: int = 0
    """What the lab holds (:func:`memory_held`): what memory checks compare."""

    @classmethod
    def take(cls, runtime_name: str | None = None) -> HostState:
        recs = kmsg_records()
        return cls(_meminfo()["MemAvailable"], os.getloadavg()[0], max((s for s, _ in recs), default=-1),
                   os.cpu_count() or 1, memory_held(runtime_name) if runtime_name else 0)


def memory_check(before: HostState, now: HostState, limit: int) -> tuple[str, bool, str]:
    """The check that a case and its sandboxes did not grow by ``limit`` bytes: (name, ok, detail)."""
    grew = now.held - before.held
    return (f"lab: the case and its sandboxes hold less than {limit >> 20} MiB more (their memory cgroups "
            "and process tree)", grew < limit,
            f"{before.held >> 20} -> {now.held >> 20} MiB (host MemAvailable {before.mem_available >> 20} -> "
            f"{now.mem_available >> 20} MiB, not judged: other processes move it)")


def host_ipv4() -> list[str]:
    """The host's non-loopback IPv4 addresses."""
    try:
        out = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True, check=False).stdout
    except OSError:
        return []
    addrs = re.findall(r"inet (\d+\.\d+\.\d+\.\d+)/", out)
    return sorted({a for a in addrs if not a.startswith("127.")})


def _sid_leftovers(rt: ContainerRuntime, sid: str) -> list[str]:
    left: list[str] = []
    for hier in Path("/sys/fs/cgroup").iterdir():
        d = hier / "dsec" / rt.name / sid
        if d.exists():
            left.append(f"cgroup {d}")
    rec = rt.records_dir / f"{sid}.json"
    if rec.exists():
        left.append(f"record {rec}")
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        with contextlib.suppress(OSError):
            if f"/dsec/{rt.name}/{sid}" in Path(f"/proc/{pid}/cgroup").read_text():
                left.append(f"process {pid}")
    with open("/proc/self/mountinfo") as f:
        left += [f"mount {ln.split()[4]}" for ln in f if sid in ln]
    if rt.slots_dir.is_dir():
        for s in rt.slots_dir.iterdir():
            with contextlib.suppress(OSError):
                if sid in s.read_text().split():
                    left.append(f"uid slot {s}")
    return left


# ---------------------------------------------------------------- attacks ----


@dataclass
class HelperOut:
    ops: dict[str, tuple[int, str]]
    lines: list[str]
    result: ExecResult

    def ret(self, op: str) -> int:
        return self.ops[op][0]

    def err(self, op: str) -> str:
        return self.ops[op][1]

    def denied(self, *ops: str) -> dict[str, tuple[int, str]]:
        """The ops among ``ops`` that did *not* fail (empty when all were refused)."""
        return {o: self.ops.get(o, (0, "MISSING")) for o in ops if self.ops.get(o, (0, ""))[0] >= 0}


class Attack:
    """One case's handle on its sandbox: run things inside, record checks."""

    def __init__(self, lab: Lab, case: Case, sid: str, outcome: Outcome) -> None:
        self.lab = lab
        self.case = case
        self.sid = sid
        self.rt = lab.rt
        self.outcome = outcome

    def check(self, what: str, ok: bool, detail: Any = "") -> bool:
        self.outcome.checks.append(Check(what, ok, detail))
        return bool(ok)

    async def run(self, cmd: str | list[str], *, timeout: float = 30.0, user: int = 0,
                  output_cap: int | None = None) -> ExecResult:
        """Run inside; a timeout is a result (killed), not an error."""
        try:
            return await self.rt.exec(self.sid, cmd, timeout=timeout, user=user, output_cap=output_cap)
        except ExecTimeout as exc:
            res = getattr(exc, "result", None)
            if not isinstance(res, ExecResult):
                raise
            return res

    async def helper(self, *ops: str, timeout: float = 30.0, user: int = 0) -> HelperOut:
        r = await self.run([HELPER_PATH, *ops], timeout=timeout, user=user)
        parsed: dict[str, tuple[int, str]] = {}
        extra: list[str] = []
        for line in r.stdout_text.splitlines():
            parts = line.rsplit(" ", 2)
            if len(parts) == 3 and parts[0] in ops:
                with contextlib.suppress(ValueError):
                    parsed[parts[0]] = (int(parts[1]), parts[2])
                    continue
            extra.append(line)
        return HelperOut(parsed, extra, r)

    async def alive(self) -> bool:
        r = await self.run("echo alive", timeout=20)
        return r.stdout_text.strip() == "alive"


CaseFn = Callable[[Attack], Awaitable[None]]


@dataclass(frozen=True)
class Case:
    name: str
    attack: str
    """What the attack tries."""
    asserts: str
    """What the case checks (the containment part)."""
    defence: str
    """What contains it."""
    fn: CaseFn
    resources: dict[str, Any] = field(default_factory=dict)
    heavy: bool = False
    """Long or CPU-hungry: ``slow`` in tests; shortened with ``--quick``."""
    needs_helper: bool = True
    needs_edge: bool = False
    needs_network: bool = False
    needs_stages: bool = False
    spec_update: dict[str, Any] = field(default_factory=dict)
    """Applied to the attacked sandbox's spec (e.g. its stages)."""
    known_bug: str | None = None
    """Set while the case is known to get through (a tracked bug): tests mark it xfail(strict)."""


CASES: list[Case] = []


def case(name: str, *, attack: str, asserts: str, defence: str, **kw: Any) -> Callable[[CaseFn], CaseFn]:
    def deco(fn: CaseFn) -> CaseFn:
        CASES.append(Case(name, attack, asserts, defence, fn, **kw))
        return fn

    return deco


# -- resource exhaustion -----------------------------------------------------


async def _sample_pids(a: Attack, stop: asyncio.Event, seen: list[int]) -> None:
    while not stop.is_set():
        with contextlib.suppress(OSError, ValueError, DsecError):
            seen.append(a.rt.stats(a.sid)["pids"])
        await asyncio.sleep(0.05)


@case("fork_bomb", attack="fork in a loop in every child until the kernel refuses",
      asserts="pids in the sandbox never exceed pids.max; the limit was hit; the tree is gone after the timeout; "
              "host process count bounded", defence="pids cgroup (pids.max), exec timeout kills the tracked tree",
      resources={"pids": 64})
async def _fork_bomb(a: Attack) -> None:
    procs_before = len([p for p in os.listdir("/proc") if p.isdigit()])
    stop = asyncio.Event()
    seen: list[int] = []
    sampler = asyncio.ensure_future(_sample_pids(a, stop, seen))
    peak_host = procs_before
    try:
        task = asyncio.ensure_future(a.helper("forkbomb", timeout=3.0 if a.lab.quick else 8.0))
        while not task.done():
            peak_host = max(peak_host, len([p for p in os.listdir("/proc") if p.isdigit()]))
            await asyncio.sleep(0.1)
        out = await task
    finally:
        stop.set()
        await sampler
    st = a.rt.stats(a.sid)
    a.check("exec was killed by its timeout", out.result.timed_out == "timeout", out.result)
    a.check("pids.max was hit", st["pids_limit_hits"] > 0, st)
    a.check("sandbox pids never above pids.max (64)", max(seen, default=0) <= 64, max(seen, default=0))
    a.check("host process count grew by at most pids.max + slack", peak_host - procs_before <= 64 + 50,
            f"{procs_before} -> {peak_host}")
    left = [p for p in a.rt.cgroups.pids(a.sid)]
    a.check("the bomb's tree is gone (only the init is left)", len(left) <= 1, left)
    a.check("sandbox still answers", await a.alive())


@case("memory_hog", attack="allocate and touch 512 MiB (malloc, then mlock) in a 64 MiB sandbox",
      asserts="OOM kill inside the sandbox only; usage never above the limit; the lab's memory (its sandboxes' "
              "cgroups and process tree) did not grow by 256 MiB",
      defence="memory cgroup limit (memory + memsw), OOM killer scoped to the cgroup",
      resources={"memory": 64 * MiB})
async def _memory_hog(a: Attack) -> None:
    before = HostState.take(a.rt.name)
    r1 = (await a.helper("alloc=512", timeout=30)).result
    r2 = (await a.helper("rlimit_memlock_max", "mlock_alloc=512", timeout=30)).result
    after = HostState.take(a.rt.name)
    st = a.rt.stats(a.sid)
    a.check("malloc hog was SIGKILLed", r1.signal == 9, r1)
    a.check("mlock hog did not get 512 MiB", r2.signal == 9 or b"mlock_alloc=512 -1" in r2.stdout, r2)
    a.check("OOM kills counted in the sandbox", st["oom_kills"] >= 1, st)
    a.check("peak usage within the 64 MiB limit", st["memory_max_bytes"] <= 64 * MiB, st)
    a.check(*memory_check(before, after, 256 * MiB))
    a.check("sandbox init survived", Path(f"/proc/{a.rt.get(a.sid).init_pid}").exists())
    a.check("sandbox still answers", await a.alive())


@case("disk_fill", attack="dd /dev/zero into the writable layer, and a 64 MiB write through the files API",
      asserts="ENOSPC/EDQUOT at the 16 MiB quota from both; host filesystems' free space unchanged; space comes back",
      defence="a hard quota on the writable layer: a btrfs qgroup limit (disk medium, EDQUOT) or tmpfs size= "
              "(memory medium, ENOSPC)",
      resources={"disk": 16 * MiB})
async def _disk_fill(a: Attack) -> None:
    free = {p: os.statvfs(p) for p in ("/", "/tmp", str(a.rt.state_dir))}
    r = await a.run("dd if=/dev/zero of=/tmp/fill bs=1M count=200; stat -c %s /tmp/fill", timeout=30)
    a.check("dd hit the quota (ENOSPC/EDQUOT)", b"No space left" in r.stderr or b"Disk quota exceeded" in r.stderr,
            r.stderr[-300:])
    size = int(r.stdout_text.strip().splitlines()[-1]) if r.stdout_text.strip() else -1
    a.check("file stopped at the quota", 0 <= size <= 16 * MiB, size)
    try:
        await asyncio.to_thread(a.rt.files(a.sid).write, "/tmp/api-fill", b"\0" * (64 * MiB))
        a.check("files API write refused", False, "a 64 MiB write succeeded in a 16 MiB sandbox")
    except FileAccessError as exc:
        a.check("files API write refused with ENOSPC/EDQUOT", exc.errno in (errno.ENOSPC, errno.EDQUOT), exc)
    for p, st in free.items():
        now = os.statvfs(p)
        lost = (st.f_bavail - now.f_bavail) * now.f_frsize
        a.check(f"host free space on {p} did not drop by 64 MiB", lost < 64 * MiB, f"{lost >> 20} MiB")
    r = await a.run("rm -f /tmp/fill && dd if=/dev/zero of=/tmp/again bs=1M count=4 2>/dev/null && stat -c %s /tmp/again")
    a.check("space comes back after rm", r.stdout_text.strip() == str(4 * MiB), r)


@case("output_flood", attack="`yes` on stdout and stderr at once until the timeout",
      asserts="captured output bounded by 2 x output_cap per stream; host process memory bounded; tree killed",
      defence="bounded output capture (head + tail), exec timeout", heavy=False, needs_helper=False)
async def _output_flood(a: Attack) -> None:
    await _flood(a, seconds=2.0)


@case("output_flood_long", attack="`yes` on both streams for 20 s (tens of GB on a fast machine)",
      asserts="as output_flood, over a long run", defence="bounded output capture, exec timeout",
      heavy=True, needs_helper=False)
async def _output_flood_long(a: Attack) -> None:
    await _flood(a, seconds=5.0 if a.lab.quick else 20.0)


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


async def _flood(a: Attack, *, seconds: float) -> None:
    cap = 64 * 1024
    rss0 = _rss()
    r = await a.run("yes >&2 & exec yes", timeout=seconds, output_cap=cap)
    grown = _rss() - rss0
    a.check("killed by the timeout", r.timed_out == "timeout", r.timed_out)
    a.check("yes really flooded (> 16 x cap)", r.stdout_bytes > 16 * cap, r.stdout_bytes)
    a.check("stdout kept <= 2 x cap", len(r.stdout) <= 2 * cap + 200, len(r.stdout))
    a.check("stderr kept <= 2 x cap", len(r.stderr) <= 2 * cap + 200, len(r.stderr))
    a.check("output marked truncated", r.truncated)
    a.check("host process grew by < 64 MiB", grown < 64 * MiB, f"{grown >> 20} MiB for {r.stdout_bytes >> 20} MiB of output")
    await asyncio.sleep(0.1)
    left = list(a.rt.cgroups.pids(a.sid))
    a.check("both yes processes are gone", len(left) <= 1, left)
    a.check("sandbox still answers", await a.alive())


@case("cpu_spin", attack="spin 4 processes (more than the host's cores) in a 0.5-cpu sandbox",
      asserts="CPU used <= quota x wall (+ slack); the CFS quota throttled it", defence="cpu cgroup CFS quota and shares",
      resources={"cpu": 0.5}, heavy=True)
async def _cpu_spin(a: Attack) -> None:
    secs = 3 if a.lab.quick else 6
    t0 = time.perf_counter()
    out = await a.helper(f"spin=4:{secs}", timeout=secs * 6 + 10)
    wall = time.perf_counter() - t0
    r = out.result
    used = r.cpu_user_s + r.cpu_system_s
    st = a.rt.stats(a.sid)
    a.check("CFS throttled the sandbox", st["cpu_throttled"] > 0, st)
    a.check("CPU used within 0.5 x wall (x1.5 + 0.5 s)", used <= 0.5 * wall * 1.5 + 0.5, f"used {used:.2f}s in {wall:.2f}s")
    a.check("sandbox still answers", await a.alive())


@case("grep_everything", attack="`grep -r` a host secret over /, /proc and /sys",
      asserts="the host secret (in a host file and in the edge's key) is never found; the host kernel logs no BUG",
      defence="mount namespace from the host-free template (no host path), masked /proc entries, empty /sys, pid namespace",
      needs_helper=False)
async def _grep_everything(a: Attack) -> None:
    # The bracket keeps the pattern itself out of grep's own /proc/self/cmdline.
    pat = a.lab.secret[:-1] + "[" + a.lab.secret[-1] + "]"
    r = await a.run(f"grep -r -l -s -e '{pat}' / /proc /sys 2>/dev/null; echo done-$?",
                    timeout=8 if a.lab.quick else 30)
    found = [ln for ln in r.stdout_text.splitlines() if ln.startswith("/")]
    a.check("secret not found anywhere", a.lab.secret.encode() not in r.stdout and not found, r.stdout_text[-1000:])
    if a.lab.edge is not None:
        key = a.lab.edge.key.hex()
        r = await a.run(f"grep -r -l -s -e '{key[:-1]}[{key[-1]}]' /etc /tmp /proc/self /proc/1 2>/dev/null; true")
        a.check("edge cluster key not found", not r.stdout_text.strip(), r.stdout_text[:500])
    a.check("sandbox still answers", await a.alive())


# -- network ---------------------------------------------------------------


class _Listeners:
    """TCP listeners on the host (loopback and every host address) that count accepted connections."""

    def __init__(self, addrs: Sequence[str]) -> None:
        self.socks: list[socket.socket] = []
        self.accepted = 0
        self.port = 0
        for addr in ["127.0.0.1", *addrs]:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((addr, self.port))
            except OSError:
                s.close()
                continue
            s.listen(64)
            s.setblocking(False)
            self.port = s.getsockname()[1]
            self.socks.append(s)

    def poll(self) -> int:
        for s in self.socks:
            while True:
                try:
                    c, _ = s.accept()
                except (BlockingIOError, OSError):
                    break
                self.accepted += 1
                c.close()
        return self.accepted

    def close(self) -> None:
        for s in self.socks:
            s.close()


async def _scan(a: Attack, targets: list[str], *, timeout: float = 60) -> list[str]:
    out = await a.helper(*[f"scan={t}" for t in targets], timeout=timeout)
    return [ln for ln in out.lines if ln.startswith("open ")]


@case("port_scan", attack="connect to every TCP port of 127.0.0.1 and ::1, and to host addresses, the edge port, "
                          "listeners on the host, 169.254.169.254 and private gateways",
      asserts="nothing answers but what the sandbox itself listens on; host listeners accept nothing",
      defence="network namespace with loopback only (no route out)",
      heavy=True)  # ~50 s; dsec bench abuse runs it, and the conformance network cases (host, metadata, siblings) every run
async def _port_scan(a: Attack) -> None:
    addrs = host_ipv4()
    lst = _Listeners(addrs)
    try:
        ports = sorted({lst.port, 22, 80, 443, 7070, 7071, a.lab.edge.port if a.lab.edge else 7072})
        targets = ["127.0.0.1:1-65535"] if not a.lab.quick else ["127.0.0.1:1-5000", f"127.0.0.1:{lst.port}"]
        targets += ["::1:1-1024" if not a.lab.quick else "::1:1-200", f"::1:{lst.port}"]
        for addr in [*addrs, "169.254.169.254", "10.0.0.1", "172.17.0.1", "192.168.0.1"]:
            targets += [f"{addr}:{p}" for p in ports]
        out = await a.helper(*[f"scan={t}" for t in targets], timeout=120)
        opened = [ln for ln in out.lines if ln.startswith("open ")]
        a.check("every scan ran", set(out.ops) == {f"scan={t}" for t in targets} and
                all(v[0] >= 0 or v[1] == "EAFNOSUPPORT" for v in out.ops.values()), out.ops)
        await asyncio.sleep(0.2)
        a.check("no port answered", not opened, opened[:20])
        a.check("host listeners accepted no connection", lst.poll() == 0, lst.accepted)
    finally:
        lst.close()
    r = await a.run("wget -q -T 2 -O - http://169.254.169.254/latest/meta-data/ 2>&1; echo rc=$?")
    a.check("metadata address unreachable", "rc=0" not in r.stdout_text, r.stdout_text)


@case("port_scan_policy", attack="with a network policy (eth0 + nftables): scan the host's addresses, the edge port, "
                                 "neighbour sandboxes, 169.254.169.254 and everything not allowed",
      asserts="nothing on the host (its addresses, the gateway, the edge port), a networked peer sandbox or "
              "169.254.169.254 answers",
      defence="per-sandbox veth with nftables default-deny; always-blocked host/sandbox/link-local sets",
      needs_network=True)
async def _port_scan_policy(a: Attack) -> None:
    from dsec.spec import NetRule, NetworkPolicy

    addrs = host_ipv4()
    lst = _Listeners(addrs)
    # A networked peer sandbox listening on 8080: sandbox-to-sandbox must be refused.
    peer = await a.rt.create(a.lab.spec().model_copy(update={"network": NetworkPolicy(
        rules=(NetRule(cidr="192.0.2.1/32", ports=("443",)),))}))
    try:
        await a.rt.exec(peer.id, "nc -ll -p 8080 -e echo peer >/dev/null 2>&1 </dev/null &", timeout=10)
        for _ in range(50):  # until the listener is up
            if "8080" in (await a.rt.exec(peer.id, "netstat -ltn", timeout=10)).stdout_text:
                break
            await asyncio.sleep(0.05)
        peer_ip = (a.rt.network_info(peer.id) or {}).get("ip")
        own_ip = (a.rt.network_info(a.sid) or {}).get("ip")
        a.check("attacker and peer have addresses", bool(peer_ip) and bool(own_ip), (peer_ip, own_ip))
        ports = sorted({lst.port, 22, 53, 80, 443, 7070, 7071, 8080, a.lab.edge.port if a.lab.edge else 7072})
        r = await a.run("ifconfig -a; route -n", timeout=10)
        gw = sorted(set(re.findall(r"^0\.0\.0\.0\s+(\d+\.\d+\.\d+\.\d+)", r.stdout_text, re.M)))
        a.check("the sandbox has eth0 and a default route", "eth0" in r.stdout_text and bool(gw), r.stdout_text)
        targets: list[str] = []
        for addr in [*addrs, *gw, "169.254.169.254", *([peer_ip] if peer_ip else [])]:
            targets += [f"{addr}:{p}" for p in ports]
        targets += [f"{g}:1-2000" for g in gw]
        if peer_ip:
            targets.append(f"{peer_ip}:1-10000")
        opened = await _scan(a, targets, timeout=180)
        await asyncio.sleep(0.2)
        a.check("no host, gateway, metadata or peer port answered", not opened, opened[:20])
        a.check("host listeners accepted no connection", lst.poll() == 0, lst.accepted)
        r = await a.rt.exec(peer.id, "nc -w 2 127.0.0.1 8080 </dev/null", timeout=10)
        a.check("the peer's listener really listens (the scan could have found it)", "peer" in r.stdout_text, r)
    finally:
        lst.close()
        await a.rt.destroy(peer.id)


@case("forged_edge_calls", attack="reach the edge's HTTP API (loopback, host addresses) and the host's abstract "
                                  "unix sockets from inside, with wget and raw connects",
      asserts="no connection to the edge or any host socket; no unix socket visible inside",
      defence="network namespace (own loopback, own abstract socket namespace); no DSec process inside")
async def _forged_edge(a: Attack) -> None:
    port = a.lab.edge.port if a.lab.edge else 7071
    r = await a.run(f"wget -q -T 2 -O - http://127.0.0.1:{port}/v1/sandboxes 2>&1; echo rc=$?")
    a.check("edge not reachable on 127.0.0.1", "rc=0" not in r.stdout_text, r.stdout_text)
    targets = [f"{ip}:{port}" for ip in ["127.0.0.1", *host_ipv4()]]
    opened = await _scan(a, targets)
    a.check("edge port closed on every address", not opened, opened)
    names = []
    with contextlib.suppress(OSError):
        for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
            parts = line.split()
            if len(parts) >= 8 and parts[7].startswith("@"):
                names.append(parts[7][1:])
    names = sorted(set(names))[:200]
    if names:
        out = await a.helper(*[f"abstract={n}" for n in names])
        got = {o: v for o, v in out.ops.items() if v[0] >= 0}
        a.check(f"none of the host's {len(names)} abstract unix sockets connectable", not got, got)
    r = await a.run("cat /proc/net/unix | wc -l")
    a.check("no unix socket in the sandbox's namespace", r.stdout_text.strip() == "1", r.stdout_text)


# -- kernel interfaces -------------------------------------------------------

SYSCTLS = ["/proc/sys/vm/swappiness", "/proc/sys/kernel/panic", "/proc/sys/kernel/pid_max",
           "/proc/sys/fs/file-max", "/proc/sys/net/ipv4/ip_forward", "/proc/sys/kernel/core_pattern",
           "/proc/sys/kernel/modprobe", "/proc/sys/vm/drop_caches", "/proc/sys/kernel/sysrq"]


@case("sysctl_writes", attack="write global sysctls (/proc/sys, sysctl -w, core_pattern, modprobe) and sysrq",
      asserts="every write refused; host values unchanged", defence="/proc/sys and sysrq-trigger read-only mounts; "
              "non-root host uid; sysctls owned by the host user namespace")
async def _sysctls(a: Attack) -> None:
    before = {p: Path(p).read_text() for p in SYSCTLS if os.access(p, os.R_OK)}
    out = await a.helper(*[f"open_w={p}" for p in before], "open_w=/proc/sysrq-trigger")
    a.check("helper writes refused", not out.denied(*out.ops), out.denied(*out.ops))
    r = await a.run("sysctl -w vm.swappiness=3; echo '|/tmp/x' > /proc/sys/kernel/core_pattern; "
                    "echo c > /proc/sysrq-trigger; echo 3 > /proc/sys/vm/drop_caches; echo end")
    a.check("shell writes reported errors", r.stderr.count(b"\n") >= 3, r.stderr)
    changed = {p: (v, Path(p).read_text()) for p, v in before.items() if p != "/proc/sys/vm/drop_caches"
               and Path(p).read_text() != v}
    a.check("host sysctls unchanged", not changed, changed)


@case("mount_games", attack="mount, remount /proc/sys rw, umount /proc and /proc/sys, pivot_root, new mount API",
      asserts="every call refused; /proc/sys stays read-only inside; no new host mount",
      defence="seccomp (mount family EPERM); mount namespace owned by the host user namespace")
async def _mounts(a: Attack) -> None:
    ops = ["mount", "remount_proc_sys_rw", "umount_proc", "umount_proc_sys", "pivot_root", "fsopen",
           "open_tree", "move_mount", "mount_setattr"]
    host_before = Path("/proc/self/mountinfo").read_text().count("\n")
    out = await a.helper(*ops)
    a.check("all refused", not out.denied(*ops), out.denied(*ops))
    r = await a.run("mkdir -p /tmp/m; mount -t tmpfs x /tmp/m; mount -o remount,rw /proc/sys; umount -l /proc/sys; "
                    "grep ' /proc/sys ' /proc/self/mountinfo")
    a.check("/proc/sys still read-only inside", " ro" in r.stdout_text or "ro," in r.stdout_text, r.stdout_text)
    host_after = Path("/proc/self/mountinfo").read_text()
    a.check("no host mount mentions the sandbox", a.sid not in host_after)
    a.check("host mount count did not grow much", host_after.count("\n") - host_before < 20,
            f"{host_before} -> {host_after.count(chr(10))}")


@case("namespaces", attack="unshare/clone every namespace kind, clone3, setns, open the init's namespaces, sethostname",
      asserts="every call refused (clone3 with ENOSYS)", defence="seccomp (unshare, setns, clone NEW* flags, clone3); "
              "namespaces owned by the host user namespace")
async def _namespaces(a: Attack) -> None:
    ops = ["unshare_user", "unshare_mnt", "unshare_net", "unshare_pid", "unshare_cgroup", "unshare_time",
           "clone_newuser", "clone_newpid", "clone3", "setns_self", "open_init_ns", "sethostname"]
    out = await a.helper(*ops)
    a.check("all refused", not out.denied(*ops), out.denied(*ops))
    a.check("clone3 says ENOSYS (libc falls back to clone)", out.ops.get("clone3", (0, ""))[1] == "ENOSYS", out.ops.get("clone3"))
    r = await a.run("unshare -r true; unshare -n true; nsenter -t 1 -m true; hostname evil; hostname")
    a.check("busybox unshare/nsenter/hostname fail", r.stdout_text.strip() == a.sid, r)


@case("ptrace", attack="PTRACE_ATTACH every pid it can name, the init, write /proc/<pid>/mem and process_vm_writev "
                       "into the init and (as uid 1000) into root's processes",
      asserts="only the sandbox's own processes can be traced; the init, neighbours and host never; "
              "neighbours' processes untouched (TracerPid 0)",
      defence="pid namespace; non-dumpable init owned by the host user namespace; per-sandbox uid range")
async def _ptrace(a: Attack) -> None:
    await a.run("sleep 4712.5 >/dev/null 2>&1 &")
    out = await a.helper("ptrace_all=65536", "ptrace_pid=1", "proc_mem_w=1", "vm_write=1", timeout=60)
    attached = [ln for ln in out.lines if ln.startswith("attached ")]
    bad = [ln for ln in attached if NEIGHBOUR_MARKER in ln or "dsec" in ln or "pytest" in ln or "python" in ln
           or ln.split()[1] == "1"]
    a.check("nothing but own processes traced", not bad, bad)
    a.check("init refused (ptrace, /proc/1/mem, vm_writev)",
            not out.denied("ptrace_pid=1", "proc_mem_w=1", "vm_write=1"), out.ops)
    root_sleep = (await a.run("pidof sleep")).stdout_text.split()
    if root_sleep:
        p = root_sleep[0]
        out2 = await a.helper(f"ptrace_pid={p}", f"proc_mem_w={p}", f"vm_write={p}", user=1000)
        a.check("uid 1000 cannot trace or write root's processes", not out2.denied(*out2.ops), out2.ops)
    for sid in a.lab.neighbours:
        for pid in a.lab.neighbour_marker_pids(sid):
            with contextlib.suppress(OSError):
                tracer = [ln for ln in Path(f"/proc/{pid}/status").read_text().splitlines() if ln.startswith("TracerPid")]
                a.check(f"neighbour {sid} process {pid} not traced", tracer == ["TracerPid:\t0"], tracer)


@case("kernel_surfaces", attack="bpf map create, keyctl/add_key, perf_event_open, userfaultfd, io_uring",
      asserts="every call refused", defence="seccomp")
async def _kernel_surfaces(a: Attack) -> None:
    ops = ["bpf_map", "keyctl", "add_key", "perf_event_open", "userfaultfd", "io_uring_setup"]
    out = await a.helper(*ops)
    a.check("all refused", not out.denied(*ops), out.denied(*ops))
    out = await a.helper(*ops, user=1000)
    a.check("all refused as uid 1000", not out.denied(*ops), out.denied(*ops))


@case("kernel_modules", attack="init_module, finit_module, delete_module, kexec_file_load",
      asserts="every call refused; host module list unchanged", defence="seccomp; no CAP_SYS_MODULE")
async def _modules(a: Attack) -> None:
    before = Path("/proc/modules").read_text() if Path("/proc/modules").exists() else ""
    ops = ["init_module", "finit_module", "delete_module", "kexec_file_load"]
    out = await a.helper(*ops)
    a.check("all refused", not out.denied(*ops), out.denied(*ops))
    r = await a.run("modprobe dummy; insmod /bin/busybox; rmmod loop; echo end")
    a.check("busybox module tools fail", r.stderr.strip() != b"", r)
    after = Path("/proc/modules").read_text() if Path("/proc/modules").exists() else ""
    a.check("host module list unchanged", {ln.split()[0] for ln in before.splitlines()} ==
            {ln.split()[0] for ln in after.splitlines()})


@case("clock", attack="clock_settime, settimeofday, adjtimex and clock_adjtime (to the current values), `date -s`",
      asserts="every call refused; host wall clock did not jump", defence="seccomp; no CAP_SYS_TIME")
async def _clock(a: Attack) -> None:
    skew0 = time.time() - time.monotonic()
    ops = ["clock_settime", "settimeofday", "adjtimex", "clock_adjtime"]
    out = await a.helper(*ops)
    a.check("all refused", not out.denied(*ops), out.denied(*ops))
    r = await a.run("date -s '2001-01-01 00:00:00'; echo rc=$?")
    a.check("date -s fails", b"can't set date" in r.stderr or "rc=0" not in r.stdout_text, r)
    a.check("host clock did not jump", abs((time.time() - time.monotonic()) - skew0) < 1.0)


@case("reboot", attack="reboot(2) with the real magic, busybox reboot/halt/poweroff -f, `kill -9 1`",
      asserts="refused; the sandbox init and the host live on", defence="seccomp (reboot); pid 1 ignores signals "
              "without a handler")
async def _reboot(a: Attack) -> None:
    init = a.rt.get(a.sid).init_pid
    out = await a.helper("reboot", "kill_init")
    a.check("reboot refused", out.ret("reboot") < 0, out.ops)
    await a.run("reboot -f; halt -f; poweroff -f; kill -9 1; true", timeout=10)
    await asyncio.sleep(0.1)
    a.check("init alive", Path(f"/proc/{init}").exists())
    a.check("sandbox still answers", await a.alive())


@case("raw_sockets", attack="raw IPv4/IPv6, AF_PACKET raw and dgram, SOCK_PACKET sockets; ip link/addr changes",
      asserts="every socket refused; interfaces unchanged", defence="seccomp (AF_PACKET, SOCK_RAW); no CAP_NET_RAW/ADMIN "
              "over a host-owned network namespace")
async def _raw(a: Attack) -> None:
    ops = ["raw_socket", "raw6_socket", "af_packet", "af_packet_dgram", "sock_packet"]
    out = await a.helper(*ops)
    a.check("all refused", not out.denied(*ops), out.denied(*ops))
    # busybox ip needs a netlink socket (SOCK_RAW: refused too); ifconfig uses ioctls.
    r = await a.run("ip link add d0 type dummy; ifconfig lo 10.9.9.9; ifconfig lo down; ifconfig -a; "
                    "cat /proc/net/dev")
    a.check("no new link", "d0" not in r.stdout_text, r.stdout_text)
    a.check("no new address", "10.9.9.9" not in r.stdout_text, r.stdout_text)
    a.check("lo still up", " UP " in r.stdout_text, r.stdout_text)


@case("proc_tricks", attack="/proc/1/root, /proc/1/cwd, /proc/1/fd/*, /proc/1/environ, /proc/1/mem, /proc/1/exe, "
                            "/proc/self/root/.. walks, chroot to /proc/1/root",
      asserts="nothing of the init readable; walks end at the sandbox root; no host file read",
      defence="non-dumpable init owned by the host user namespace; the overlay moved over a host-free template namespace's root")
async def _proc(a: Attack) -> None:
    ops = ["open_r=/proc/1/root/etc/passwd", "readlink=/proc/1/root", "readlink=/proc/1/cwd", "readlink=/proc/1/exe",
           "opendir=/proc/1/fd", "readlink=/proc/1/fd/3", "open_r=/proc/1/fd/3", "open_r=/proc/1/environ",
           "open_r=/proc/1/mem", "open_w=/proc/1/exe", "open_r=/proc/1/maps", "opendir=/proc/1/map_files"]
    out = await a.helper(*ops)
    a.check("init's /proc entries refused", not out.denied(*ops), out.denied(*ops))
    r = await a.run("ls /proc/self/root/../../../..; echo ---; ls /")
    top, _, root = r.stdout_text.partition("---")
    a.check("/proc/self/root/.. walks end at the sandbox root", top.split() == root.split(), r.stdout_text)
    r = await a.run(f"cat {a.lab.secret_file} /proc/self/root/{a.lab.secret_file} /proc/1/root{a.lab.secret_file}; "
                    "chroot /proc/1/root /bin/true; echo end")
    a.check("host secret not read", a.lab.secret.encode() not in r.stdout, r.stdout)
    a.check("chroot into /proc/1/root refused", b"end" in r.stdout and bool(r.stderr), r)


@case("chroot_escape", attack="as root (CAP_SYS_CHROOT): chroot into a subdirectory keeping the cwd outside, walk "
                             "'..' with chdir and with O_PATH opens, chroot there; list what was reached",
      asserts="every walk ends at the sandbox's own root or is refused; nothing of the node's template namespace "
              "(r, u, l0...) or the host reached",
      defence="the sandbox's root is the overlay moved over its mount namespace's root (a copy of a template that "
              "holds one read-only tmpfs with one empty directory, mode 0700, owned by host root: unmapped in the "
              "sandbox, so not searchable by its root; and '..' from the overlay's root stays there)")
async def _chroot_escape(a: Attack) -> None:
    for op in ("chroot_escape", "opath_escape"):
        out = await a.helper(op)
        marks = {k: v for k, _, v in (ln.partition(" ") for ln in out.lines) if k in ("root", "end")}
        reached = [ln.split(" ", 1)[1] for ln in out.lines if ln.startswith(("entry ", "reached "))]
        a.check(f"{op}: refused, or ends at the sandbox's own root",
                out.ret(op) < 0 or (marks.get("end") is not None and marks.get("end") == marks.get("root")),
                (out.ops, marks))
        a.check(f"{op}: nothing of the node's template namespace reached",
                not ({"r", "u", "l0", "empty"} & set(reached)), reached)
    r = await a.run(f"cat {a.lab.secret_file} /tmp/dsec-ce/{a.lab.secret_file}; echo end")
    a.check("host secret not read", a.lab.secret.encode() not in r.stdout, r.stdout)


@case("device_nodes", attack="mknod /dev/null, /dev/mem, /dev/kmsg and sda; fill /dev/shm",
      asserts="mknod refused; /dev holds only the safe set; /dev/shm bounded",
      defence="no CAP_MKNOD; a read-only /dev skeleton with the host's null, zero, full, random, urandom, tty "
              "bound on it, and /dev/shm inside the writable layer's quota")
async def _devices(a: Attack) -> None:
    ops = ["mknod_null", "mknod_mem", "mknod_sda", "mknod_kmsg"]
    out = await a.helper(*ops)
    a.check("mknod refused", not out.denied(*ops), out.denied(*ops))
    r = await a.run("ls /dev")
    allowed = {"null", "zero", "full", "random", "urandom", "tty", "pts", "ptmx", "shm", "fd", "stdin", "stdout",
               "stderr", "console", "core", "mqueue"}
    extra = set(r.stdout_text.split()) - allowed
    a.check("/dev holds only the safe set", not extra, extra)
    r = await a.run("dd if=/dev/zero of=/dev/shm/fill bs=1M count=512 2>&1; stat -c %s /dev/shm/fill")
    size = int(r.stdout_text.split()[-1]) if r.stdout_text.split()[-1:] and r.stdout_text.split()[-1].isdigit() else -1
    quota = a.rt.get(a.sid).spec.resources.disk
    a.check(f"/dev/shm stopped at the writable layer's quota ({quota >> 20} MiB)", 0 <= size <= quota, size)


@case("inode_exhaustion", attack="create a million empty files in the writable layer",
      asserts="creation stops at the layer's cap (tmpfs nr_inodes, or the quota's bytes on disk) with "
              "ENOSPC/EDQUOT; host inodes untouched; cleanup works",
      defence="memory medium: tmpfs nr_inodes=; disk medium: every inode costs metadata bytes inside the "
              "btrfs qgroup quota", resources={"disk": 16 * MiB})
async def _inodes(a: Attack) -> None:
    host = os.statvfs(str(a.rt.state_dir))
    out = await a.helper("files=1000000", timeout=60)
    n = int(next((ln.split()[1] for ln in out.lines if ln.startswith("files ")), "-1"))
    a.check("stopped with ENOSPC", out.err("files=1000000") == "OK" and 0 < n < 1000000, (n, out.ops))
    if a.rt.get(a.sid).spec.resources.disk_medium == "memory":
        a.check("stopped at the inode cap (16384)", n <= 16384, n)
    else:  # no inode count on btrfs: an empty file costs ~300-400 bytes of metadata in the quota
        a.check("stopped by the 16 MiB quota (<= 1 file per 256 bytes)", n <= 16 * MiB // 256, n)
    now = os.statvfs(str(a.rt.state_dir))
    a.check("host free inodes unchanged (+-5000)", abs(host.f_favail - now.f_favail) < 5000,
            f"{host.f_favail} -> {now.f_favail}")
    r = await a.run("rm -rf /tmp/dsec-inodes && touch /tmp/ok && echo ok", timeout=60)
    a.check("cleanup works", r.stdout_text.strip() == "ok", r)


@case("thread_exhaustion", attack="create 100,000 threads", asserts="stopped at pids.max; limit counted",
      defence="pids cgroup counts threads", resources={"pids": 64})
async def _threads(a: Attack) -> None:
    out = await a.helper("threads=100000", timeout=30)
    n = int(next((ln.split()[1] for ln in out.lines if ln.startswith("threads ")), "-1"))
    st = a.rt.stats(a.sid)
    a.check("threads stopped at pids.max (64)", 0 < n <= 64, n)
    a.check("pids.max hit counted", st["pids_limit_hits"] > 0, st)
    a.check("sandbox still answers", await a.alive())


@case("huge_rlimits", attack="raise RLIMIT_NOFILE/NPROC/MEMLOCK to infinity, then open fds without end",
      asserts="NOFILE cannot be raised past the sandbox's hard limit; fds stop at it",
      defence="hard RLIMIT_NOFILE set by the spawner; no CAP_SYS_RESOURCE in the host user namespace",
      resources={"nofile": 256})
async def _rlimits(a: Attack) -> None:
    out = await a.helper("rlimit_nofile_max", "rlimit_nofile_1m", "rlimit_nproc_max", "rlimit_memlock_max", "open_fds")
    a.check("RLIMIT_NOFILE cannot be raised", not out.denied("rlimit_nofile_max", "rlimit_nofile_1m"), out.ops)
    a.check("fds stop at the hard limit (256)", 0 < out.ret("open_fds") <= 256, out.ops.get("open_fds"))
    r = await a.run("ulimit -n 100000; ulimit -n")
    a.check("ulimit -n cannot go past 256", r.stdout_text.strip().splitlines()[-1:] == ["256"], r)


@case("kill_everything", attack="`kill -9 -1` and kill(-1, SIGKILL) as root inside",
      asserts="only the sandbox's own processes die: init, neighbours and a host sentinel live",
      defence="pid namespace; pid 1 ignores signals without a handler")
async def _kill_all(a: Attack) -> None:
    init = a.rt.get(a.sid).init_pid
    await a.run("sleep 4713.5 >/dev/null 2>&1 &")
    await a.helper("kill_all", timeout=10)
    await a.run("kill -9 -1", timeout=10)
    await asyncio.sleep(0.2)
    a.check("init alive", Path(f"/proc/{init}").exists())
    a.check("own background sleep killed", "4713.5" not in (await a.run("ps -o args")).stdout_text)
    a.check("host sentinel alive", a.lab.sentinel is not None and a.lab.sentinel.poll() is None)
    for sid in a.lab.neighbours:
        a.check(f"neighbour {sid} marker alive", bool(a.lab.neighbour_marker_pids(sid)))


@case("memfd_exec", attack="copy a binary into a memfd and execveat() it (fileless exec), then mount and unshare",
      asserts="the new image keeps no_new_privs and seccomp; mount/unshare still refused",
      defence="no_new_privs + seccomp are inherited across execve")
async def _memfd(a: Attack) -> None:
    out = await a.helper("memfd_exec")
    lines = {ln.split()[0]: ln for ln in out.result.stdout_text.splitlines() if ln}
    a.check("memfd exec ran", "nnp" in lines, out.result.stdout_text)
    a.check("no_new_privs kept", lines.get("nnp", "") == "nnp 1 OK", lines.get("nnp"))
    a.check("seccomp kept", lines.get("seccomp", "") == "seccomp 2 OK", lines.get("seccomp"))
    a.check("mount still refused", "EPERM" in lines.get("mount_after_exec", ""), lines.get("mount_after_exec"))
    a.check("unshare still refused", "EPERM" in lines.get("unshare_after_exec", ""), lines.get("unshare_after_exec"))


@case("exe_overwrite_race", attack="while the host execs into the sandbox, open /proc/<pid>/exe of every process "
                                   "whose binary is the host's (the runc CVE-2019-5736 pattern) for writing",
      asserts="never opened; the host spawner binary unchanged",
      defence="exec children are non-dumpable host-owned processes until execve; the spawner binary is outside")
async def _exe_race(a: Attack) -> None:
    # The init runs the spawner's binary; /proc/<pid>/exe reads it even if a rebuild replaced the file.
    spawner = Path(f"/proc/{a.rt.get(a.sid).init_pid}/exe")
    digest = hashlib.sha256(spawner.read_bytes()).hexdigest()
    secs = 2 if a.lab.quick else 5
    race = asyncio.ensure_future(a.helper(f"exe_race={secs}", timeout=secs + 20))
    n = 0
    while not race.done():
        await a.run(["/bin/true"], timeout=10)
        n += 1
    out = await race
    a.check("host binary never opened for writing", out.ret(f"exe_race={secs}") == 0 and
            not [ln for ln in out.lines if ln.startswith("exe_opened")], out.lines[:10])
    a.check(f"host execs ran during the race ({n})", n > 5, n)
    a.check("spawner binary unchanged", hashlib.sha256(spawner.read_bytes()).hexdigest() == digest)


@case("personality", attack="personality(ADDR_NO_RANDOMIZE|READ_IMPLIES_EXEC) and PER_LINUX32",
      asserts="affects the caller only: the init and neighbours keep personality 0",
      defence="personality is per process (allowed, as in Docker); 32-bit syscalls are killed by seccomp")
async def _personality(a: Attack) -> None:
    out = await a.helper("personality", "personality32")
    a.check("calls ran (allowed by design)", set(out.ops) == {"personality", "personality32"}, out.ops)
    init = a.rt.get(a.sid).init_pid
    pids = [init] + [p for s in a.lab.neighbours for p in a.lab.neighbour_marker_pids(s)]
    bad = {p: Path(f"/proc/{p}/personality").read_text().strip() for p in pids
           if Path(f"/proc/{p}/personality").exists() and Path(f"/proc/{p}/personality").read_text().strip() != "00000000"}
    a.check("init and neighbours keep personality 0", not bad, bad)


# -- the files API -----------------------------------------------------------


def _tar(members: list[tuple[str, str, bytes | str]]) -> bytes:
    """members: (kind, name, data-or-linkname); kind in file, symlink, hardlink, dir."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as t:
        for kind, name, data in members:
            ti = tarfile.TarInfo(name)
            if kind == "file":
                assert isinstance(data, bytes)
                ti.size = len(data)
                t.addfile(ti, io.BytesIO(data))
                continue
            if kind == "dir":
                ti.type = tarfile.DIRTYPE
            else:
                ti.type = tarfile.SYMTYPE if kind == "symlink" else tarfile.LNKTYPE
                ti.linkname = str(data)
            t.addfile(ti)
    return buf.getvalue()


@case("files_api_links", attack="plant symlinks to host paths (absolute, ../.., /proc/1/root) and race a dir/symlink "
                                "swap, then read, write, append, mkdir, upload (tar-slip, hard links out) and "
                                "download through the files API",
      asserts="no host file read, written or created; escaping tar members refused",
      defence="openat2(RESOLVE_IN_ROOT | NO_MAGICLINKS | NO_XDEV), *at() on the final component, O_NOFOLLOW, "
              "tar members checked before writing", needs_helper=False)
async def _files_links(a: Attack) -> None:
    fs = a.rt.files(a.sid)
    host_dir = a.lab.work / f"host-target-{a.sid}"
    host_dir.mkdir(exist_ok=True)
    target = host_dir / "pwned"
    secret = a.lab.secret_file
    depth = "../" * 12
    await a.run(f"ln -s {secret} /tmp/abs; ln -s {depth}{str(secret).lstrip('/')} /tmp/rel; "
                f"ln -s /proc/1/root /tmp/initroot; ln -s {host_dir} /tmp/hostdir; ln -s {target} /tmp/wlink; "
                f"ln -s /proc/self/root/{str(secret).lstrip('/')} /tmp/selfroot")

    def attempt(label: str, fn: Callable[[], object]) -> None:
        try:
            got = fn()
        except (FileAccessError, DsecError, OSError):
            return
        leaked = isinstance(got, bytes) and a.lab.secret.encode() in got
        a.check(f"{label}: no host content", not leaked, got if isinstance(got, bytes) else "")

    for p in ("/tmp/abs", "/tmp/rel", "/tmp/initroot/etc/passwd", f"/tmp/initroot{secret}", "/tmp/selfroot",
              f"/../../..{secret}", f"/proc/1/root{secret}"):
        attempt(f"read {p}", functools.partial(fs.read, p))
    attempt("download /tmp", functools.partial(fs.download, "/tmp"))
    writes: list[tuple[str, Callable[[], object]]] = [
        ("write via symlink", lambda: fs.write("/tmp/wlink", b"x")),
        ("write into symlinked dir", lambda: fs.write("/tmp/hostdir/pwned", b"x")),
        ("append via symlink", lambda: fs.append("/tmp/wlink", b"x")),
        ("mkdir via symlinked dir", lambda: fs.mkdir("/tmp/hostdir/pwned")),
        ("rename onto host path", lambda: fs.rename("/tmp/abs", "/tmp/hostdir/pwned")),
        ("upload into symlinked dir", lambda: fs.upload("/tmp/hostdir", _tar([("file", "pwned", b"x")]))),
        ("tar-slip through a member symlink", lambda: fs.upload("/tmp/slip", _tar([("symlink", "s", str(host_dir)),
                                                                                  ("file", "s/pwned", b"x")]))),
    ]
    for label, fn in writes:
        with contextlib.suppress(FileAccessError, DsecError, OSError):
            await asyncio.to_thread(fn)
        a.check(f"{label}: no host file created", not target.exists() and not os.listdir(host_dir), os.listdir(host_dir))
    bad_tars: list[tuple[str, list[tuple[str, str, bytes | str]]]] = [
        ("absolute member", [("file", str(target), b"x")]),
        ("../ member", [("file", depth + str(target).lstrip("/"), b"x")]),
        ("hard link out of the tree", [("hardlink", "h", depth + str(secret).lstrip("/"))]),
        ("absolute hard link", [("hardlink", "h2", str(secret))]),
    ]
    for label, members in bad_tars:
        try:
            fs.upload("/tmp/up", _tar(members))
            a.check(f"upload with {label} refused", False, "accepted")
        except (FileAccessError, DsecError) as exc:
            a.check(f"upload with {label} refused", True, exc)
    # Race: flip /tmp/race between a directory and a symlink to the host dir while writing through it.
    racer = asyncio.ensure_future(a.run(
        f"end=$(( $(date +%s) + 2 )); while [ $(date +%s) -lt $end ]; do rm -rf /tmp/race; mkdir /tmp/race; "
        f"rm -rf /tmp/race; ln -s {host_dir} /tmp/race; done",
        timeout=10))
    tries = 0
    while not racer.done():
        tries += 1
        with contextlib.suppress(FileAccessError, DsecError, OSError):
            await asyncio.to_thread(fs.write, "/tmp/race/pwned", b"x")
        await asyncio.sleep(0)
    await racer
    a.check("the race ran", tries > 10, tries)
    a.check("host directory untouched", sorted(os.listdir(host_dir)) == [], os.listdir(host_dir))
    a.check("host secret unchanged", secret.read_text() == a.lab.secret + "\n")
    with contextlib.suppress(OSError):
        host_dir.rmdir()


@case("files_api_special", attack="files API on a FIFO, a 64 GiB sparse file (read and tar download), /proc and /dev "
                                  "paths, NUL bytes, 64 KiB paths",
      asserts="typed errors, no hang, no host memory blow-up", defence="O_NONBLOCK open + type check; size caps on read "
              "and download; RESOLVE_NO_XDEV", needs_helper=False)
async def _files_special(a: Attack) -> None:
    fs = a.rt.files(a.sid)
    await a.run("mkfifo /tmp/fifo; mkdir -p /tmp/sp; truncate -s 64G /tmp/sp/sparse; ls -la /tmp/sp")
    rss0 = _rss()
    for label, fn in [
        ("read FIFO", lambda: fs.read("/tmp/fifo")),
        ("read sparse 64 GiB", lambda: fs.read("/tmp/sp/sparse")),
        ("download sparse 64 GiB", lambda: fs.download("/tmp/sp")),
        ("read /proc/self/environ", lambda: fs.read("/proc/self/environ")),
        ("read /dev/zero", lambda: fs.read("/dev/zero")),
        ("read NUL path", lambda: fs.read("/etc/pass\0wd")),
        ("read 64 KiB path", lambda: fs.read("/" + "a/" * 32768)),
    ]:
        try:
            got = await asyncio.wait_for(asyncio.to_thread(fn), 20)
            a.check(f"{label} refused", False, f"returned {len(got)} bytes")
        except (FileAccessError, DsecError) as exc:
            a.check(f"{label} refused with a typed error", True, exc)
        except TimeoutError:
            a.check(f"{label} did not hang", False, "still running after 20 s")
    grown = _rss() - rss0
    a.check("host process grew by < 256 MiB", grown < 256 * MiB, f"{grown >> 20} MiB")


# -- stages: file rules that bind root ----------------------------------------

_STAGES = {"setup": Stage(),
           "rollout": Stage(files=FileRules(hidden=("/tests",), read_only=("/workspace",)))}
_TEST_SECRET = "expected-answer-42"


@case("stage_escape", attack="in a stage with /tests hidden and /workspace read-only, as root: read, list, hard-link "
                             "(also links made before the switch, whose file gets the answer after it), symlink, rename, "
                             "chmod, copy /tests; write, "
                             "delete, rename /workspace files; keep a /tests fd open across the switch",
      asserts="the hidden file's content never comes out; /workspace unchanged; the fd holder did not survive the switch",
      defence="Landlock rules on every exec'd process (root cannot lift them); set_stage kills every process but the "
              "init; hard links split by access class", needs_helper=False, needs_stages=True,
      spec_update={"stages": _STAGES, "stage": "setup"})
async def _stage_escape(a: Attack) -> None:
    fs = a.rt.files(a.sid)
    # What the agent can read in "setup" is its own; the answer arrives after the switch
    # (written whole, and appended to the placeholder's inode), so every way in is a real escape.
    fs.write("/tests/answer.txt", b"placeholder\n", make_parents=True)
    fs.write("/tests/appended.txt", b"placeholder\n")
    fs.write("/workspace/solution.py", b"print('original')\n", make_parents=True)
    await a.run("ln /tests/answer.txt /tmp/early-link; ln /tests/appended.txt /tmp/early-link2; "
                "ln -s /tests/appended.txt /tmp/early-sym; "
                "sleep 4714.5 < /tests/appended.txt >/dev/null 2>&1 &")
    await a.rt.set_stage(a.sid, "rollout")
    fs.write("/tests/answer.txt", f"{_TEST_SECRET}\n".encode())
    fs.append("/tests/appended.txt", f"{_TEST_SECRET}\n".encode())
    holders = [p for p in a.rt.cgroups.pids(a.sid) if b"4714.5" in Path(f"/proc/{p}/cmdline").read_bytes()]
    a.check("the process holding /tests open did not survive the switch", not holders, holders)
    r = await a.run(
        "cat /tests/answer.txt /tests/appended.txt; cat /tmp/early-link /tmp/early-link2 /tmp/early-sym; "
        "ln /tests/answer.txt /tmp/late-link; "
        "cat /tmp/late-link; ln -s /tests/answer.txt /tmp/sym; cat /tmp/sym; cat /proc/self/root/tests/answer.txt; "
        "mv /tests /tmp/moved; cat /tmp/moved/answer.txt; chmod 777 /tests /tests/answer.txt; "
        "cp /tests/answer.txt /tmp/copy; cat /tmp/copy; cd /tests && cat answer.txt; "
        "for f in /proc/[0-9]*/fd/*; do cat $f 2>/dev/null | grep -a expected; done; true", timeout=30)
    a.check("the hidden file never read", _TEST_SECRET not in r.stdout_text, r.stdout_text[:500])
    r = await a.run("echo hacked > /workspace/solution.py; rm -f /workspace/solution.py; "
                    "mv /workspace/solution.py /tmp/; touch /workspace/new; true")
    a.check("/workspace file unchanged", fs.read("/workspace/solution.py") == b"print('original')\n")
    a.check("no new /workspace file", not fs.exists("/workspace/new"))
    await a.rt.set_stage(a.sid, "setup")
    r = await a.run("cat /tests/answer.txt")
    a.check("back in setup the answer is readable (the rules were what stopped it)", _TEST_SECRET in r.stdout_text, r)


@case("pristine_eval", attack="replace /bin/sh (and /bin/busybox's neighbours) with a script that prints "
                              "'ALL TESTS PASSED', then let the evaluator run its command",
      asserts="an evaluation with pristine=['/bin'] runs the image's real shell, not the agent's",
      defence="exec(pristine=...): read-only copies of chosen paths from the image layers for that command",
      needs_helper=False, needs_stages=True)
async def _pristine(a: Attack) -> None:
    await a.run("rm -f /bin/sh /bin/cat && printf '#!/bin/busybox ash\necho ALL TESTS PASSED\nexit 0\n' > /bin/sh && "
                "chmod 755 /bin/sh && cp /bin/sh /bin/cat")
    r = await a.run("echo real-evaluation; exit 3")
    a.check("the agent's /bin/sh is what a plain exec gets (the attack is real)", "ALL TESTS PASSED" in r.stdout_text, r)
    r2 = await a.rt.exec(a.sid, "echo real-evaluation; exit 3", pristine=["/bin"], timeout=30)
    a.check("pristine /bin runs the image's shell", r2.stdout_text.strip() == "real-evaluation" and r2.exit_code == 3, r2)
    r3 = await a.rt.exec(a.sid, ["cat", "/etc/hostname"], pristine=["/bin"], timeout=30)
    a.check("pristine /bin/cat is the image's", "ALL TESTS PASSED" not in r3.stdout_text, r3)


# -- the platform's own secrets and the edge ----------------------------------


@case("platform_secrets", attack="look for the platform's tokens, keys, logs and sockets: environment, /proc/1/environ, "
                                 "inherited fds, mountinfo, host paths",
      asserts="no DSec variable or key in the environment; nothing inherited beyond stdio; no host path visible",
      defence="clean exec environment; close_range before execve; non-dumpable init; mount namespace from the host-free template",
      needs_helper=False)
async def _secrets(a: Attack) -> None:
    r = await a.run("env; echo ---; cat /proc/1/environ; echo ---; ls -l /proc/self/fd/; echo ---; "
                    "cat /proc/self/mountinfo")
    env, init_env, fds, mi = ([*r.stdout_text.split("---"), "", "", "", ""])[:4]
    names = [ln.split("=", 1)[0] for ln in env.splitlines() if "=" in ln]
    a.check("no DSEC_* / token / key variable", not [n for n in names if re.search(r"DSEC|TOKEN|KEY|SECRET", n)], names)
    a.check("/proc/1/environ unreadable", init_env.strip() == "", init_env[:300])
    fd_nums = sorted(int(m) for m in re.findall(r"(\d+) -> ", fds))
    a.check("only stdio (and ls's own dir fd) inherited", [f for f in fd_nums if f > 3] == [], fds)
    leaked_paths = [p for p in (str(a.rt.state_dir), str(a.rt.run_dir), str(a.lab.work), "/var/lib/dsec", "/run/dsec")
                    if p in mi]
    a.check("no host path in mountinfo", not leaked_paths, leaked_paths)
    if a.lab.edge is not None:
        tok = a.lab.edge.token(a.sid)
        a.check("no edge token in the environment", tok not in env)


@case("edge_malformed", attack="malformed requests to the real edge HTTP server: bad and deeply nested JSON, a 64 MiB "
                               "JSON body, NUL bytes in argv, path traversal in ids and file paths, "
                               "missing/garbage/expired/foreign-key tokens, another sandbox's token, sandbox tokens "
                               "on admin routes",
      asserts="every request gets a 4xx (never 5xx, never a host file); the edge still serves afterwards",
      defence="FastAPI validation, signed tokens bound to one sandbox, files API confinement, JSON bodies refused "
              "over 16 MiB before parsing (413), bounded request heads (dsec/http/limits.py)",
      needs_helper=False, needs_edge=True)
async def _edge_malformed(a: Attack) -> None:
    import httpx

    assert a.lab.edge is not None
    e = a.lab.edge
    admin = e.headers(admin=True)
    spec = {"image": {"base": a.lab.image}, "resources": {"cpu": 0.5, "memory": 64 * MiB, "disk": 16 * MiB}}
    async with httpx.AsyncClient(base_url=e.url, timeout=60) as c:
        made = [(await c.post("/v1/sandboxes", json={"spec": spec}, headers=admin)) for _ in range(2)]
        for m in made:
            a.check("edge creates sandboxes", m.status_code == 201, m.text[:300])
        ids = [m.json()["id"] for m in made if m.status_code == 201]
        if len(ids) < 2:
            return
        s1, s2 = ids
        try:
            own = e.headers(s1)
            host_passwd = Path("/etc/passwd").read_bytes()
            reqs: list[tuple[str, str, str, dict[str, Any]]] = [
                ("bad JSON", "POST", "/v1/sandboxes", {"content": b"{", "headers": {**admin, "content-type": "application/json"}}),
                ("nested JSON", "POST", "/v1/sandboxes", {"content": b"[" * 200000 + b"]" * 200000,
                                                         "headers": {**admin, "content-type": "application/json"}}),
                ("64 MiB JSON", "POST", f"/v1/sandboxes/{s1}/exec", {"content": b'{"cmd": "' + b"a" * (64 * MiB) + b'"}',
                                                                    "headers": {**own, "content-type": "application/json"}}),
                ("NUL in argv", "POST", f"/v1/sandboxes/{s1}/exec", {"json": {"cmd": ["echo", "a\u0000b"]}, "headers": own}),
                ("wrong types", "POST", f"/v1/sandboxes/{s1}/exec", {"json": {"cmd": {"$ne": 1}, "timeout": "x"}, "headers": own}),
                ("traversal id", "GET", "/v1/sandboxes/..%2F..%2Fetc%2Fpasswd", {"headers": admin}),
                ("traversal id files", "GET", "/v1/sandboxes/../../etc/files?path=/etc/passwd", {"headers": admin}),
                ("NUL id", "GET", "/v1/sandboxes/a%00b", {"headers": admin}),
                ("no token", "GET", f"/v1/sandboxes/{s1}", {}),
                ("garbage token", "GET", f"/v1/sandboxes/{s1}", {"headers": {"authorization": "Bearer garbage.x.y"}}),
                ("basic auth", "GET", f"/v1/sandboxes/{s1}", {"headers": {"authorization": "Basic YTpi"}}),
                ("foreign key", "GET", f"/v1/sandboxes/{s1}",
                 {"headers": {"authorization": f"Bearer {e.token(s1, key=secrets.token_bytes(32))}"}}),
                ("expired token", "GET", f"/v1/sandboxes/{s1}",
                 {"headers": {"authorization": f"Bearer {e.token(s1, ttl_s=-10)}"}}),
                ("other sandbox's token: exec", "POST", f"/v1/sandboxes/{s2}/exec", {"json": {"cmd": "id"}, "headers": own}),
                ("other sandbox's token: read", "GET", f"/v1/sandboxes/{s2}/files?path=/etc/passwd", {"headers": own}),
                ("other sandbox's token: delete", "DELETE", f"/v1/sandboxes/{s2}", {"headers": own}),
                ("sandbox token on admin create", "POST", "/v1/sandboxes", {"json": {"spec": spec}, "headers": own}),
                ("sandbox token on admin list", "GET", "/v1/sandboxes", {"headers": own}),
                ("sandbox token on group pause", "POST", "/v1/pause?label=x=y", {"headers": own}),
                ("admin token for another sandbox via sid *", "GET", f"/v1/sandboxes/{s2}",
                 {"headers": {"authorization": f"Bearer {e.token('*')}"}}),
                ("path traversal in file path", "GET", f"/v1/sandboxes/{s1}/files?path=../../../../../../etc/shadow", {"headers": own}),
                ("/proc in file path", "GET", f"/v1/sandboxes/{s1}/files?path=/proc/1/environ", {"headers": own}),
            ]
            for label, method, url, kw in reqs:
                try:
                    resp = await c.request(method, url, **kw)
                    code, body = resp.status_code, resp.content
                except httpx.HTTPError as exc:  # the server may close on oversized headers: fine
                    code, body = 0, str(exc).encode()
                ok = code == 0 or 400 <= code < 500
                if label.startswith("path traversal"):
                    ok = ok or (code == 200 and body != host_passwd)
                a.check(f"{label}: refused ({code})", ok and host_passwd not in body, body[:200])
            r = await c.get(f"/v1/sandboxes/{s1}/files", params={"path": "../../../../../etc/passwd"}, headers=own)
            a.check("traversal in file path serves the sandbox's own /etc/passwd",
                    r.status_code == 200 and r.content != host_passwd and r.content.startswith(b"root:x:0:0:root:/root:/bin/sh"),
                    r.content[:200])
            r = await c.post(f"/v1/sandboxes/{s2}/exec", json={"cmd": "echo fine"}, headers=e.headers(s2))
            a.check("edge still serves after the barrage", r.status_code == 200 and
                    base64.b64decode(r.json().get("stdout_b64", "")) == b"fine\n", r.text[:300])
            r = await c.get("/v1/health", headers=admin)
            a.check("edge health OK", r.status_code == 200, r.text[:300])
        finally:
            for sid in ids:
                await c.delete(f"/v1/sandboxes/{sid}", headers=admin)


@case("edge_header_flood", attack="requests to the real edge with an 8 MiB header and with 10,000 headers, "
                                  "before any authentication",
      asserts="refused (431/400 or the connection closed), never processed; the edge still serves",
      defence="the servers' HTTP protocol counts each request head as it arrives: 431 and close past 64 KiB or "
              "128 headers (dsec/http/limits.py)", needs_helper=False, needs_edge=True)
async def _edge_headers(a: Attack) -> None:
    import httpx

    assert a.lab.edge is not None
    e = a.lab.edge
    # Raw bytes on a socket, as an attacker would send them: building 10,000 headers
    # with httpx costs the *client* ~4 s of CPU (its header merging is quadratic), and
    # here the client shares a process with the neighbours' driver.
    host, port = e.url.split("//", 1)[1].rsplit(":", 1)
    auth = "".join(f"{k}: {v}\r\n" for k, v in e.headers(admin=True).items())
    for label, extra in [("8 MiB header", "x-big: " + "a" * (8 << 20) + "\r\n"),
                         ("10,000 headers", "".join(f"x-h{i}: v\r\n" for i in range(10000)))]:
        raw = f"GET /v1/health HTTP/1.1\r\nhost: {host}\r\n{auth}{extra}\r\n".encode()
        code = 0
        try:
            reader, writer = await asyncio.open_connection(host, int(port))
            try:
                writer.write(raw)
                with contextlib.suppress(ConnectionError):
                    await writer.drain()
                line = await asyncio.wait_for(reader.readline(), 10)
                code = int(line.split()[1]) if line.startswith(b"HTTP/1.1 ") else 0
            finally:
                writer.close()
        except (ConnectionError, TimeoutError, ValueError, IndexError):
            code = 0  # the connection was cut: refused too
        a.check(f"{label}: refused before processing ({code})", code in (0, 400, 413, 431), code)
    async with httpx.AsyncClient(base_url=e.url, timeout=60) as c:
        r = await c.get("/v1/health", headers=e.headers(admin=True))
        a.check("edge still serves", r.status_code == 200, r.text[:200])


@case("edge_oversized_upload", attack="PUT a 512 MiB body to the files route of a 16 MiB sandbox (the whole body is "
                                      "buffered in the edge before the quota says no)",
      asserts="refused with 413 before the body is buffered: the edge process grows by < 64 MiB",
      defence="file and tar bodies are read capped at the sandbox's disk quota (+1 MiB; tar: twice that): a "
              "larger Content-Length is refused with 413 before reading, a streamed body at the cap "
              "(dsec/http/limits.read_body)", needs_helper=False, needs_edge=True)
async def _edge_upload(a: Attack) -> None:
    import httpx

    assert a.lab.edge is not None
    e = a.lab.edge
    admin = e.headers(admin=True)
    spec = {"image": {"base": a.lab.image}, "resources": {"cpu": 0.5, "memory": 64 * MiB, "disk": 16 * MiB}}
    async with httpx.AsyncClient(base_url=e.url, timeout=120) as c:
        m = await c.post("/v1/sandboxes", json={"spec": spec}, headers=admin)
        a.check("edge creates a sandbox", m.status_code == 201, m.text[:300])
        if m.status_code != 201:
            return
        sid = m.json()["id"]
        try:
            chunk = b"\0" * MiB
            peak = [0]
            rss0 = _rss()

            async def body() -> Any:
                for _ in range(512):
                    peak[0] = max(peak[0], _rss() - rss0)
                    yield chunk

            try:
                r = await c.put(f"/v1/sandboxes/{sid}/files", params={"path": "/tmp/big"}, content=body(),
                                headers={**e.headers(sid), "content-length": str(512 * MiB)})
                code = r.status_code
            except httpx.HTTPError as exc:
                code = -1
                a.check("upload answered", False, exc)
            peak[0] = max(peak[0], _rss() - rss0)
            a.check("refused with 413", code == 413, code)
            a.check("edge grew by < 64 MiB while receiving", peak[0] < 64 * MiB, f"{peak[0] >> 20} MiB")
        finally:
            await c.delete(f"/v1/sandboxes/{sid}", headers=admin)


# ------------------------------------------------------------------ runner ----


def case_named(name: str) -> Case:
    for c in CASES:
        if c.name == name:
            return c
    raise KeyError(name)


async def host_healthy(lab: Lab, before: HostState, outcome: Outcome, *, neighbour_errors: list[str]) -> None:
    """The checks every case ends with."""
    add = outcome.checks.append
    rt = lab.rt
    # The runtime still creates, execs and destroys.
    try:
        rec = await rt.create(lab.spec())
        try:
            r = await rt.exec(rec.id, "echo healthy", timeout=30)
            add(Check("runtime: create + exec on a fresh sandbox", r.stdout_text.strip() == "healthy", repr(r)[:300]))
        finally:
            await rt.destroy(rec.id)
        add(Check("runtime: destroy left nothing", not _sid_leftovers(rt, rec.id), str(_sid_leftovers(rt, rec.id))))
    except DsecError as exc:
        add(Check("runtime: create/exec/destroy", False, repr(exc)))
    now = HostState.take(rt.name)
    add(Check(*memory_check(before, now, 1 << 30)))
    add(Check("host: load average sane", now.load1 < before.load1 + 8 * now.ncpu, f"{before.load1:.1f} -> {now.load1:.1f}"))
    bad = [m for s, m in kmsg_records() if s > before.kmsg_seq and BAD_KMSG.search(m)]
    add(Check("host: kernel logged no BUG/Oops/lockup", not bad, bad[:5]))
    add(Check("host: sentinel process alive", lab.sentinel is None or lab.sentinel.poll() is None))
    for sid in lab.neighbours:
        alive = bool(lab.neighbour_marker_pids(sid))
        add(Check(f"neighbour {sid}: marker process alive", alive))
        try:
            data = lab.rt.files(sid).read("/tmp/neighbour-secret")
            add(Check(f"neighbour {sid}: files intact", data == f"{sid}\n".encode(), data[:100]))
        except DsecError as exc:
            add(Check(f"neighbour {sid}: files intact", False, repr(exc)))
    add(Check("neighbours: no exec failed during the case", not neighbour_errors, neighbour_errors[:5]))


async def run_case(lab: Lab, c: Case, *, load: NeighbourLoad | None = None, timeout: float = 240.0) -> Outcome:
    """Create the attacked sandbox, run the case, destroy it, check the host. Never raises for the
    attack's sake: everything lands in the returned :class:`Outcome`."""
    out = Outcome(c.name)
    if c.needs_helper and lab.helper is None:
        out.skipped = "no static helper (gcc -static unavailable)"
        return out
    if c.needs_edge and lab.edge is None:
        out.skipped = "no edge server in this run"
        return out
    if c.needs_network and not network_supported(lab.rt):
        out.skipped = "network policies are not in the runtime yet"
        return out
    if c.needs_stages and not callable(getattr(lab.rt, "set_stage", None)):
        out.skipped = "stages are not in the runtime yet"
        return out
    before = HostState.take(lab.rt.name)
    t0 = time.perf_counter()
    spec = lab.spec(**c.resources)
    if c.spec_update:
        spec = spec.model_copy(update=c.spec_update)
    if c.needs_network:
        from dsec.spec import NetRule, NetworkPolicy

        spec = spec.model_copy(update={"network": NetworkPolicy(rules=(NetRule(cidr="192.0.2.1/32", ports=("443",)),))})
    rec = None
    try:
        rec = await lab.rt.create(spec)
        if c.needs_helper and lab.helper is not None:
            lab.rt.files(rec.id).write(HELPER_PATH, lab.helper.read_bytes(), mode=0o755)
        await asyncio.wait_for(c.fn(Attack(lab, c, rec.id, out)), timeout)
    except Exception as exc:  # the outcome records it; the suite goes on
        out.error = f"{type(exc).__name__}: {exc}"[:2000]
    finally:
        if rec is not None:
            try:
                await lab.rt.destroy(rec.id)
            except DsecError as exc:
                out.checks.append(Check("attacked sandbox destroyed", False, repr(exc)))
            await asyncio.sleep(0.05)
            left = _sid_leftovers(lab.rt, rec.id)
            out.checks.append(Check("attacked sandbox left nothing (cgroups, processes, record, mounts, uid slot)",
                                    not left, left))
    t1 = time.perf_counter()
    out.seconds = t1 - t0
    if load is not None:
        got = load.since(t0, t1)
        out.neighbour_execs = len(got)
        out.neighbour_p50_ms = percentile(got, 50) if got else None
    await host_healthy(lab, before, out, neighbour_errors=load.errors_since(t0) if load is not None else [])
    return out


def outcomes_json(outcomes: Sequence[Outcome], baseline_p50_ms: float | None) -> dict[str, Any]:
    """The flat per-case part of ``dsec bench abuse --json``."""
    res: dict[str, Any] = {}
    ran = [o for o in outcomes if o.skipped is None]
    res["cases_total"] = len(ran)
    res["cases_contained"] = sum(1 for o in ran if o.contained)
    res["cases_skipped"] = len(outcomes) - len(ran)
    res["neighbour_p50_quiet_ms"] = baseline_p50_ms
    ratios: list[tuple[float, str]] = []
    for o in outcomes:
        res[f"case_{o.name}"] = None if o.skipped else o.contained
        ratio = (o.neighbour_p50_ms / baseline_p50_ms) if (o.neighbour_p50_ms and baseline_p50_ms) else None
        res[f"neighbour_ratio_{o.name}"] = round(ratio, 3) if ratio is not None else None
        res[f"neighbour_samples_{o.name}"] = o.neighbour_execs
        # A p50 of a handful of execs (a case over in 0.1 s) says nothing: the max is over
        # cases with enough samples; every per-case ratio is still written.
        if ratio is not None and o.neighbour_execs >= MIN_RATIO_SAMPLES:
            ratios.append((ratio, o.name))
    top = max(ratios, default=None)
    res["neighbour_p50_ratio_max"] = round(top[0], 3) if top else None
    res["neighbour_p50_ratio_max_case"] = top[1] if top else None
    res["neighbour_ratio_min_samples"] = MIN_RATIO_SAMPLES
    res["cases_not_contained"] = ",".join(o.name for o in ran if not o.contained)
    res["cases_with_documented_channel"] = ",".join(o.name for o in ran if o.notes)
    return res


def dump_outcomes(outcomes: Sequence[Outcome]) -> str:
    return json.dumps([{"name": o.name, "contained": o.contained, "skipped": o.skipped, "error": o.error,
                        "failures": o.failures()} for o in outcomes], indent=2)
