"""Baselines for ``dsec bench runtime``: crun and bubblewrap on the same rootfs.

What is measured, and how it is kept fair:

- Every crun/bwrap command is started and timed by a small *runner* process
  (this file run as a script, stdlib only, ``python -I -S``): the benchmark
  process may be big, and fork cost grows with the parent's RSS, so neither
  tool is ever launched from it. The runner starts each command with
  ``subprocess`` (vfork where CPython can) and waits on a pidfd, so a sample
  is the tool's own wall time plus one vfork+exec, the same for both tools.
- crun 1.8.1 refuses cgroup v1 hosts that also mount cgroup2 ("hybrid"). The
  crun runner therefore lives in a private mount namespace (``unshare -m``)
  where a throwaway tmpfs hides ``/sys/fs/cgroup/unified``; the namespace is
  set up once, so its cost is not in any sample. crun still writes its
  ``unified/<id>/cgroup.procs`` bookkeeping, now into that tmpfs, which dies
  with the runner.
- Both runners see the rootfs through a bind mount made inside their own
  private mount namespace at ``<bench dir>/rootfs``, so a rootfs under a 0700
  directory still works for unprivileged sandboxes and the host mount table is
  never touched.
- "All isolation on", for both: user namespace with sandbox root mapped to host
  uid ``host_uid`` (default 200000; ``None`` keeps host root), pid, mount, ipc,
  uts, net and cgroup namespaces, read-only rootfs, fresh /proc, minimal /dev,
  tmpfs /tmp, mqueue, no_new_privs. crun additionally applies cgroup v1 limits
  (memory 256 MiB, pids 256, cpu 1 core), its default masked/read-only /proc
  paths and a 3-capability set: these are part of crun's cost. bwrap has no
  cgroup support; it runs unprivileged as ``host_uid`` (the runner switches
  to that uid, keeping only saved id 0 for its own cleanup, before launching
  it), which is how bwrap gives a non-root host uid: bwrap maps one uid only.
  Neither gets a seccomp filter.
- "create" means: until the sandbox's first process runs. For the latency
  figures that is ``/bin/true`` run to completion (crun run / bwrap, both
  tearing the sandbox down before they return). For the create-and-keep rates
  it is until the sandbox's shell has written ``ready`` to a pipe.
- Create-and-keep (:class:`Keeper`) holds its ``n`` sandboxes between
  :meth:`Keeper.spawn` and :meth:`Keeper.teardown`, so the caller can measure
  them while they idle (host memory, a sandbox's mounts). Each crun container
  holds one process (its shell, pid 1); a bwrap sandbox holds the same shell
  under bwrap's own pid-1 init, plus the outer bwrap that waits for it.
- Create-and-keep and its teardown run :data:`KEEP_CONCURRENCY` sandboxes at
  once (threads inside the runner, each starting and waiting for one sandbox
  at a time, started in index order), the same number DSec's keep phase has
  in flight: a rate measured one at a time beside one measured eight at a
  time compares concurrency, not runtimes. Each sandbox keeps its own ready
  and removed timestamps, so the decile figures mean what they did. The
  latency series stay one at a time (they are latencies).

Every temporary path, container id and cgroup made here contains
``dsec-bench``; everything is removed before a function returns, also on
errors and KeyboardInterrupt. Must never: launch crun/bwrap from the calling
process, or leave a mount, cgroup, process or state directory behind.

This file doubles as the runner script, hence stdlib-only imports at the top.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import resource
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as _wait_futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

__all__ = [
    "BENCH_HOST_UID",
    "KEEP_CONCURRENCY",
    "BaselineError",
    "Keeper",
    "bwrap_create_latency",
    "bwrap_create_rate",
    "crun_config",
    "crun_create_latency",
    "crun_create_rate",
    "crun_exec_latency",
    "decile_rates",
    "prepare_busybox_rootfs",
]

BENCH_HOST_UID = 200_000
"""Host uid (and gid) that sandbox root maps to, for both tools."""
ID_RANGE = 65_536
"""Size of crun's uid/gid mapping (bwrap maps a single uid)."""
MEMORY_LIMIT = 256 * 1024 * 1024
PIDS_LIMIT = 256
CPU_QUOTA_US = 100_000
CPU_PERIOD_US = 100_000
WARMUP = 3
"""Uncounted runs before each latency series (page cache, dynamic loader)."""
COMMAND_TIMEOUT_S = 60.0
READY_TIMEOUT_S = 30.0
KEEP_CONCURRENCY = 8
"""Sandboxes in flight during create-and-keep and its teardown, for DSec, crun and bwrap
alike (``dsec bench runtime`` uses it for all three and records it as ``keep_concurrency``)."""
_MAX_WORKERS = 64
"""Most threads one runner starts (a concurrency above it is clamped)."""

_BUSYBOX_APPLETS = ("sh", "true", "sleep", "cat", "echo", "ls")
_ROOTFS_DIRS = ("bin", "proc", "dev", "sys", "tmp", "etc")
_CGROUP_ROOT = Path("/sys/fs/cgroup")
_CGROUP2_MASK = _CGROUP_ROOT / "unified"
_PREFIX = "dsec-bench-"
_WAIT_SCRIPT = "echo ready; read x"
"""The kept sandboxes' shell: report readiness, then block on stdin."""

# mount(2) flags
_MS_RDONLY = 1
_MS_REMOUNT = 32
_MS_BIND = 4096
_MS_REC = 16384
_MNT_DETACH = 2
_PR_SET_CHILD_SUBREAPER = 36


class BaselineError(RuntimeError):
    """A baseline tool could not be run or did not behave; ``detail`` holds its log tail."""

    def __init__(self, message: str, *, detail: str = "") -> None:
        super().__init__(f"{message}\n{detail}".rstrip())
        self.detail = detail


# ------------------------------------------------------------------ rootfs --


def prepare_busybox_rootfs(dest: Path) -> Path:
    """A minimal rootfs at ``dest``: static busybox plus a few applet links.

    ``bin/busybox`` with ``sh true sleep cat echo ls`` linked to it, and empty
    ``proc dev sys tmp etc`` mount points. Returns ``dest``.
    """
    busybox = shutil.which("busybox") or "/bin/busybox"
    if not os.path.exists(busybox):
        raise BaselineError("busybox not found (install busybox-static)")
    dest.mkdir(parents=True, exist_ok=True)
    dest.chmod(0o755)
    for name in _ROOTFS_DIRS:
        (dest / name).mkdir(mode=0o755, exist_ok=True)
    (dest / "tmp").chmod(0o1777)
    target = dest / "bin" / "busybox"
    shutil.copy2(busybox, target)
    target.chmod(0o755)
    for applet in _BUSYBOX_APPLETS:
        link = dest / "bin" / applet
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to("busybox")
    return dest


# ------------------------------------------------------------- crun config --


def crun_config(
    rootfs: Path, args: Sequence[str], *, host_uid: int | None = BENCH_HOST_UID
) -> dict[str, Any]:
    """The OCI config used for crun: crun's own template plus all namespaces and limits.

    Based on ``crun spec --rootless`` (3 capabilities, masked and read-only
    /proc paths, deny-all device cgroup with crun's defaults), with: cgroup and
    (when ``host_uid`` is set) user namespaces, uid/gid 0 mapped to
    ``host_uid``, memory/pids/cpu limits, read-only ``rootfs``, tmpfs /tmp, and
    no /sys (bwrap does not mount it either). No ``cgroupsPath``: crun then
    names the cgroup after the container id (``dsec-bench-...``).
    """
    caps = ["CAP_AUDIT_WRITE", "CAP_KILL", "CAP_NET_BIND_SERVICE"]
    namespaces = ["pid", "network", "ipc", "uts", "mount", "cgroup"]
    linux: dict[str, Any] = {
        "resources": {
            "devices": [{"allow": False, "access": "rwm"}],
            "memory": {"limit": MEMORY_LIMIT},
            "pids": {"limit": PIDS_LIMIT},
            "cpu": {"quota": CPU_QUOTA_US, "period": CPU_PERIOD_US},
        },
        "namespaces": [{"type": ns} for ns in namespaces],
        "maskedPaths": [
            "/proc/acpi",
            "/proc/asound",
            "/proc/kcore",
            "/proc/keys",
            "/proc/latency_stats",
            "/proc/timer_list",
            "/proc/timer_stats",
            "/proc/sched_debug",
            "/sys/firmware",
            "/proc/scsi",
        ],
        "readonlyPaths": ["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger"],
    }
    if host_uid is not None:
        linux["namespaces"].append({"type": "user"})
        mapping = [{"containerID": 0, "hostID": host_uid, "size": ID_RANGE}]
        linux["uidMappings"] = mapping
        linux["gidMappings"] = [dict(m) for m in mapping]
    return {
        "ociVersion": "1.0.2",
        "process": {
            "terminal": False,
            "user": {"uid": 0, "gid": 0},
            "args": list(args),
            "env": ["PATH=/bin", "HOME=/"],
            "cwd": "/",
            "capabilities": {
                k: list(caps) for k in ("bounding", "effective", "permitted", "ambient")
            }
            | {"inheritable": []},
            "rlimits": [{"type": "RLIMIT_NOFILE", "hard": 1024, "soft": 1024}],
            "noNewPrivileges": True,
        },
        "root": {"path": str(rootfs), "readonly": True},
        "hostname": "dsec-bench",
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {
                "destination": "/dev",
                "type": "tmpfs",
                "source": "tmpfs",
                "options": ["nosuid", "strictatime", "mode=755", "size=65536k"],
            },
            {
                "destination": "/dev/pts",
                "type": "devpts",
                "source": "devpts",
                "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"],
            },
            {
                "destination": "/dev/shm",
                "type": "tmpfs",
                "source": "shm",
                "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"],
            },
            {
                "destination": "/dev/mqueue",
                "type": "mqueue",
                "source": "mqueue",
                "options": ["nosuid", "noexec", "nodev"],
            },
            {
                "destination": "/tmp",
                "type": "tmpfs",
                "source": "tmpfs",
                "options": ["nosuid", "nodev", "mode=1777", "size=65536k"],
            },
        ],
        "linux": linux,
    }


def _bwrap_argv(rootfs: Path, args: Sequence[str], *, info_fd: str | None = None) -> list[str]:
    """bwrap with every namespace, sandbox uid 0 (mapped to the runner's uid)."""
    argv = [
        "bwrap",
        "--unshare-all",  # user(try), ipc, pid, net, uts, cgroup(try)
        "--unshare-user",  # not "try": fail rather than silently share
        "--die-with-parent",
        "--new-session",
        "--cap-drop", "ALL",
        "--uid", "0",
        "--gid", "0",
        "--hostname", "dsec-bench",
        "--ro-bind", str(rootfs), "/",
        "--proc", "/proc",
        "--dev", "/dev",
        "--mqueue", "/dev/mqueue",
        "--tmpfs", "/tmp",
        "--clearenv",
        "--setenv", "PATH", "/bin",
        "--chdir", "/",
    ]  # fmt: skip
    if info_fd is not None:
        argv += ["--info-fd", info_fd]
    return [*argv, *args]


# ----------------------------------------------------------- public API -----


def crun_create_latency(
    rootfs: Path,
    n: int,
    *,
    host_uid: int | None = BENCH_HOST_UID,
    workdir: Path | None = None,
) -> list[float]:
    """ms per ``crun run`` of a container running ``/bin/true`` to completion.

    Each sample is create + start + exit + delete (``crun run`` in the
    foreground removes the container before it returns); each sample uses a
    fresh container id. ``WARMUP`` uncounted runs come first.
    """
    _check_n(n)
    with _Session("crun", rootfs, host_uid=host_uid, workdir=workdir) as s:
        bundle = s.bundle("true", ["/bin/true"])
        argv = s.crun_argv("run", "--bundle", str(bundle), "{id}")
        s.runner.call("time", argv=argv, n=WARMUP, id_prefix=s.cid("warm"))
        return [float(x) for x in s.runner.call("time", argv=argv, n=n, id_prefix=s.cid("lat"))]


def bwrap_create_latency(
    rootfs: Path,
    n: int,
    *,
    host_uid: int | None = BENCH_HOST_UID,
    workdir: Path | None = None,
) -> list[float]:
    """ms per ``bwrap ... /bin/true`` run to completion, all namespaces on.

    bwrap is launched as ``host_uid`` (unprivileged), so ``--unshare-user
    --uid 0`` maps sandbox root to that host uid, like crun's mapping. As host
    root (``host_uid=None``) bwrap would map sandbox root back to host root.
    ``WARMUP`` uncounted runs come first.
    """
    _check_n(n)
    with _Session("bwrap", rootfs, host_uid=host_uid, workdir=workdir) as s:
        argv = _bwrap_argv(s.view, ["/bin/true"])
        s.runner.call("time", argv=argv, n=WARMUP, id_prefix=s.cid("warm"))
        return [float(x) for x in s.runner.call("time", argv=argv, n=n, id_prefix=s.cid("lat"))]


def crun_create_rate(
    rootfs: Path,
    n: int,
    *,
    host_uid: int | None = BENCH_HOST_UID,
    workdir: Path | None = None,
    concurrency: int = KEEP_CONCURRENCY,
) -> dict[str, float]:
    """Create ``n`` crun containers, ``concurrency`` at a time, and keep them; then delete all.

    Each container runs ``sh -c 'echo ready; read x'`` with its stdin on a
    pipe the runner holds open; a container counts as created when
    ``crun run -d`` has returned and its shell has printed ``ready``.
    Teardown is ``crun delete -f`` per container (SIGKILL, wait, remove
    cgroups and state), ``concurrency`` at a time, plus reaping the dead shells.

    Returns ``rate``, ``first_decile_rate``, ``last_decile_rate``,
    ``last_decile_ratio``, ``ready_p50_ms``, ``ready_p99_ms``, ``create_s``,
    ``teardown_rate``, ``teardown_s`` and ``n`` (defined in :func:`_rate_summary`).
    """
    _check_n(n)
    with Keeper("crun", rootfs, host_uid=host_uid, workdir=workdir, concurrency=concurrency) as k:
        k.spawn(n)
        return k.teardown()


def bwrap_create_rate(
    rootfs: Path,
    n: int,
    *,
    host_uid: int | None = BENCH_HOST_UID,
    workdir: Path | None = None,
    concurrency: int = KEEP_CONCURRENCY,
) -> dict[str, float]:
    """Start ``n`` bwrap sandboxes, ``concurrency`` at a time, and keep them; then kill all.

    Same shell and readiness signal as :func:`crun_create_rate`. Teardown
    SIGKILLs the sandbox's pid-1 (bwrap's in-namespace init, from
    ``--info-fd``), which takes the whole pid namespace down, and reaps the
    outer bwrap. Returns the same keys as :func:`crun_create_rate`.
    """
    _check_n(n)
    with Keeper("bwrap", rootfs, host_uid=host_uid, workdir=workdir, concurrency=concurrency) as k:
        k.spawn(n)
        return k.teardown()


class Keeper:
    """Create-and-keep for one tool, with the sandboxes held between the calls.

    ``with Keeper("crun", rootfs) as k:`` starts the runner (and nothing
    else, so host memory can be read before :meth:`spawn`); :meth:`spawn`
    creates ``n`` sandboxes, ``concurrency`` at a time (see :func:`crun_create_rate`
    and :func:`bwrap_create_rate` for what "created" and "teardown" mean);
    :meth:`sandbox_pid` names a kept sandbox's pid 1 as the host sees it;
    :meth:`teardown` removes them all and returns :func:`_rate_summary`.
    Leaving the block without :meth:`teardown` still removes everything.
    """

    def __init__(
        self,
        tool: str,
        rootfs: Path,
        *,
        host_uid: int | None = BENCH_HOST_UID,
        workdir: Path | None = None,
        concurrency: int = KEEP_CONCURRENCY,
    ) -> None:
        if tool not in ("crun", "bwrap"):
            raise ValueError(f"tool must be crun or bwrap, got {tool!r}")
        if not 1 <= concurrency <= _MAX_WORKERS:
            raise ValueError(f"concurrency must be 1..{_MAX_WORKERS}, got {concurrency}")
        self.tool = tool
        self.concurrency = concurrency
        self._session = _Session(tool, rootfs, host_uid=host_uid, workdir=workdir)
        self._created: dict[str, Any] | None = None
        self.n = 0

    def __enter__(self) -> Keeper:
        self._session.__enter__()
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self._session.__exit__(exc_type, exc, tb)

    def spawn(self, n: int) -> None:
        """Create ``n`` sandboxes and keep them (once per Keeper)."""
        _check_n(n)
        if self._created is not None:
            raise RuntimeError("Keeper.spawn runs once")
        s = self._session
        # crun: the shell per container; bwrap: outer bwrap, its pid-1 init and the shell.
        _ensure_pid_headroom((2 if self.tool == "crun" else 4) * n)
        script = ["/bin/sh", "-c", _WAIT_SCRIPT, str(s.bench_dir)]
        if self.tool == "crun":
            bundle = s.bundle("wait", script)
            argv = s.crun_argv("run", "-d", "--bundle", str(bundle), "{id}")
        else:
            argv = _bwrap_argv(s.view, script, info_fd="{info_fd}")
        self._created = s.runner.call(
            "spawn",
            kind=self.tool,
            argv=argv,
            n=n,
            id_prefix=s.cid("keep"),
            concurrency=self.concurrency,
        )
        self.n = n

    def done_s(self) -> list[float]:
        """Seconds from the start of :meth:`spawn` until each sandbox was ready, in order."""
        if self._created is None:
            raise RuntimeError("nothing spawned yet")
        return [float(t) for t in self._created["done"]]

    def ready_ms(self) -> list[float]:
        """Each sandbox's create-to-ready time (ms), with ``concurrency`` in flight, in order."""
        if self._created is None:
            raise RuntimeError("nothing spawned yet")
        return [float(t) for t in self._created["ms"]]

    def began(self) -> float:
        """When :meth:`spawn`'s series began, on :func:`time.perf_counter`'s clock (CLOCK_MONOTONIC:
        the same in every process of the host)."""
        if self._created is None:
            raise RuntimeError("nothing spawned yet")
        return float(self._created["t_begin"])

    def sandbox_pid(self, index: int) -> int:
        """Host pid of kept sandbox ``index``'s pid 1 (crun: the shell; bwrap: its init)."""
        return int(self._session.runner.call("pid", index=index))

    def teardown(self) -> dict[str, float]:
        """Remove every kept sandbox; the whole series' :func:`_rate_summary`."""
        if self._created is None:
            raise RuntimeError("nothing spawned yet")
        removed = self._session.runner.call("teardown", concurrency=self.concurrency)
        return _rate_summary(self.n, self._created, removed)


def crun_exec_latency(
    rootfs: Path,
    n: int,
    *,
    host_uid: int | None = BENCH_HOST_UID,
    workdir: Path | None = None,
) -> list[float]:
    """ms per ``crun exec <id> /bin/true`` into one running container.

    (bwrap has no exec into a running sandbox, so there is no bwrap twin.)
    """
    _check_n(n)
    with _Session("crun", rootfs, host_uid=host_uid, workdir=workdir) as s:
        bundle = s.bundle("wait", ["/bin/sh", "-c", _WAIT_SCRIPT, str(s.bench_dir)])
        cid = s.cid("exec-0")
        s.runner.call(
            "spawn",
            kind="crun",
            argv=s.crun_argv("run", "-d", "--bundle", str(bundle), "{id}"),
            n=1,
            id_prefix=s.cid("exec"),
        )
        argv = s.crun_argv("exec", cid, "/bin/true")
        s.runner.call("time", argv=argv, n=WARMUP, id_prefix=s.cid("warm"))
        samples = [float(x) for x in s.runner.call("time", argv=argv, n=n, id_prefix=cid)]
        s.runner.call("teardown")
        return samples


# ------------------------------------------------------------- helpers ------


def _check_n(n: int) -> None:
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")


def decile_rates(done_s: Sequence[float]) -> tuple[float, float]:
    """Creation rate over the first and over the last tenth of a series (per second).

    ``done_s``: when each sandbox was ready, in seconds since the series
    began (any order). A decile is ``max(1, n // 10)`` sandboxes; the first
    decile's rate counts from the series' start, the last decile's from the
    sandbox just before it. Pure; raises ``ValueError`` on an empty series.
    """
    done = sorted(float(t) for t in done_s)
    n = len(done)
    if n == 0:
        raise ValueError("no samples")
    k = max(1, n // 10)
    first_span = done[k - 1]
    last_span = done[-1] - (done[n - k - 1] if n > k else 0.0)
    tiny = 1e-9  # two sandboxes ready within the clock's resolution
    return k / max(first_span, tiny), k / max(last_span, tiny)


def _rate_summary(n: int, created: dict[str, Any], removed: dict[str, Any]) -> dict[str, float]:
    """Rates from the runner's per-sandbox completion times (seconds since the series began).

    - ``rate``: sandboxes created per second over the whole series.
    - ``first_decile_rate`` / ``last_decile_rate``: the same over the first /
      last tenth of the series (at least one sandbox each); their ratio
      ``last_decile_ratio`` < 1 means creation slows as sandboxes accumulate.
    - ``ready_p50_ms`` / ``ready_p99_ms``: per-sandbox create-to-ready time.
    - ``teardown_rate``: sandboxes removed per second.
    """
    from dsec.bench.stats import percentile

    done = [float(t) for t in created["done"]]
    if len(done) != n:
        raise BaselineError(f"runner created {len(done)} sandboxes, expected {n}")
    first, last = decile_rates(done)
    gone = [float(t) for t in removed["done"]]
    create_s = max(done)  # several in flight: the last one started need not be the last ready
    teardown_s = max(gone, default=0.0)
    out = {
        "n": float(n),
        "create_s": create_s,
        "rate": n / create_s,
        "first_decile_rate": first,
        "last_decile_rate": last,
        "ready_p50_ms": percentile(created["ms"], 50),
        "ready_p99_ms": percentile(created["ms"], 99),
        "teardown_s": teardown_s,
        "teardown_rate": len(gone) / teardown_s if gone else 0.0,
    }
    out["last_decile_ratio"] = out["last_decile_rate"] / out["first_decile_rate"]
    return out


def _ensure_pid_headroom(extra: int) -> None:
    """Raise kernel.pid_max if ``extra`` more tasks would come close to it (never lowers it)."""
    path = Path("/proc/sys/kernel/pid_max")
    try:
        pid_max = int(path.read_text())
        tasks = int(Path("/proc/loadavg").read_text().split()[3].split("/")[1])
    except (OSError, ValueError, IndexError):
        return
    need = tasks + extra + 1024
    if need > pid_max * 0.9:
        path.write_text(str(min(4_194_304, 2 * need)))


def _cgroup2_hides_v1() -> bool:
    """True on a cgroup v1 "hybrid" host where crun 1.8.1 refuses to run."""
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields = left.split()
            if len(fields) > 4 and fields[4] == str(_CGROUP2_MASK) and right.startswith("cgroup2 "):
                return True
    return False


def _traversable_by_others(path: Path) -> bool:
    """Every ancestor of ``path`` is world-executable (so a mapped uid can reach it)."""
    p = path.resolve()
    return all(os.stat(d).st_mode & stat.S_IXOTH for d in [p, *p.parents])


class _RunnerClient:
    """The parent's end of one runner process: JSON lines over a pipe."""

    def __init__(self, argv: list[str], log_path: Path) -> None:
        self.log_path = log_path
        self._log = open(log_path, "ab")  # noqa: SIM115 - closed in close()
        try:
            self.proc = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=self._log,
                start_new_session=True,  # no terminal ^C: the parent decides how to stop
            )
        except BaseException:
            self._log.close()
            raise

    def log_tail(self, limit: int = 4000) -> str:
        try:
            data = self.log_path.read_bytes()
        except OSError:
            return ""
        return data[-limit:].decode(errors="replace")

    def call(self, op: str, **kwargs: Any) -> Any:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(json.dumps({"op": op, **kwargs}).encode() + b"\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except BrokenPipeError:
            line = b""
        if not line:
            raise BaselineError("benchmark runner died", detail=self.log_tail())
        reply = json.loads(line)
        if not reply["ok"]:
            raise BaselineError(
                f"runner {op!r} failed: {reply['error']}", detail=reply.get("detail", "")
            )
        return reply["result"]

    def close(self, *, graceful: bool) -> None:
        """Make the runner tear down whatever it still holds, and exit."""
        try:
            if graceful and self.proc.poll() is None:
                with contextlib.suppress(BaselineError, OSError, ValueError):
                    self.call("cleanup")
            elif self.proc.poll() is None:
                # Interrupts whatever op is running; the runner then cleans up and exits.
                self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(OSError):
                if self.proc.stdin is not None:
                    self.proc.stdin.close()
            try:
                self.proc.wait(timeout=300)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            if self.proc.stdout is not None:
                self.proc.stdout.close()
        finally:
            self._log.close()


class _Session:
    """One bench dir + one runner, torn down completely on exit."""

    def __init__(
        self, tool: str, rootfs: Path, *, host_uid: int | None, workdir: Path | None
    ) -> None:
        self.tool = tool
        self.rootfs = Path(rootfs).resolve()
        self.host_uid = host_uid
        self.workdir = workdir
        self.bench_dir = Path()
        self.token = ""
        self._runner: _RunnerClient | None = None
        self._bundles = 0

    # Paths and names
    @property
    def view(self) -> Path:
        """Where the runner's mount namespace shows the rootfs."""
        return self.bench_dir / "rootfs"

    @property
    def crun_root(self) -> Path:
        return self.bench_dir / "crun-state"

    @property
    def runner(self) -> _RunnerClient:
        assert self._runner is not None
        return self._runner

    def cid(self, kind: str) -> str:
        return f"{_PREFIX}{self.token}-{kind}"

    def crun_argv(self, *args: str) -> list[str]:
        return ["crun", "--root", str(self.crun_root), "--cgroup-manager", "cgroupfs", *args]

    def bundle(self, name: str, args: Sequence[str]) -> Path:
        path = self.bench_dir / "bundles" / name
        path.mkdir(parents=True)
        config = crun_config(self.view, args, host_uid=self.host_uid)
        (path / "config.json").write_text(json.dumps(config, indent=1))
        return path

    # Lifetime
    def __enter__(self) -> _Session:
        if not self.rootfs.is_dir():
            raise BaselineError(f"rootfs {self.rootfs} is not a directory")
        if shutil.which(self.tool) is None:
            raise BaselineError(f"{self.tool} is not installed")
        parent = str(self.workdir) if self.workdir is not None else None
        self.bench_dir = Path(tempfile.mkdtemp(prefix=_PREFIX, dir=parent)).resolve()
        try:
            self.token = self.bench_dir.name.removeprefix(_PREFIX).replace("_", "x").lower()
            self.bench_dir.chmod(0o755)
            self.view.mkdir(mode=0o755)
            self.crun_root.mkdir(mode=0o700)
            if self.host_uid is not None and not _traversable_by_others(self.bench_dir):
                raise BaselineError(
                    f"{self.bench_dir} is not reachable by uid {self.host_uid}: "
                    "pass a workdir whose ancestors are all world-executable"
                )
            self._runner = _RunnerClient(self._runner_argv(), self.bench_dir / "runner.log")
            self.runner.call("ping")
        except BaseException:
            self._teardown(graceful=False)
            raise
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self._teardown(graceful=exc_type is None)

    def _runner_argv(self) -> list[str]:
        argv = [
            sys.executable, "-I", "-S", str(Path(__file__).resolve()), "serve",
            "--tool", self.tool,
            "--bench-dir", str(self.bench_dir),
            "--rootfs", str(self.rootfs),
            "--crun-root", str(self.crun_root),
            "--cgroup-prefix", self.cid(""),
        ]  # fmt: skip
        if self.tool == "bwrap" and self.host_uid is not None:
            argv += ["--drop-to-uid", str(self.host_uid)]
        if self.tool == "crun" and _cgroup2_hides_v1():
            argv.append("--mask-cgroup2")
        # One private mount namespace for the runner's lifetime: the rootfs view
        # (and crun's cgroup2 mask) live there, never in the host's table.
        return ["unshare", "--mount", "--propagation", "private", "--", *argv]

    def _teardown(self, *, graceful: bool) -> None:
        errors: list[str] = []
        if self._runner is not None:
            try:
                self._runner.close(graceful=graceful)
            except Exception as exc:  # keep going: the sweeps below still run
                errors.append(f"runner close: {exc}")
            self._runner = None
        if self.bench_dir != Path() and self.tool == "crun":
            try:
                _sweep_crun_state(self.crun_root)
            except Exception as exc:
                errors.append(f"crun state sweep: {exc}")
        if self.token:
            try:
                _sweep_cgroups(self.cid(""))
            except Exception as exc:
                errors.append(f"cgroup sweep: {exc}")
        if self.bench_dir != Path():
            # The view is only ever mounted in the runner's namespace, so here it
            # is an empty directory; refuse to recurse into it if it is not.
            with contextlib.suppress(FileNotFoundError):
                if _is_mountpoint(self.view) or any(self.view.iterdir()):
                    errors.append(f"{self.view} is mounted or not empty; left in place")
                else:
                    shutil.rmtree(self.bench_dir, ignore_errors=True)
        if errors and graceful:
            raise BaselineError("baseline cleanup incomplete", detail="\n".join(errors))


def _sweep_crun_state(crun_root: Path) -> None:
    """Last resort when the runner could not delete its containers (it died or hung)."""
    try:
        leftovers = [p.name for p in crun_root.iterdir() if p.is_dir()]
    except FileNotFoundError:
        return
    if not leftovers:
        return
    argv = [
        "unshare", "--mount", "--propagation", "private", "--",
        sys.executable, "-I", "-S", str(Path(__file__).resolve()), "sweep",
        "--crun-root", str(crun_root),
    ]  # fmt: skip
    if _cgroup2_hides_v1():
        argv.append("--mask-cgroup2")
    subprocess.run(argv, check=True, timeout=300, stdin=subprocess.DEVNULL, capture_output=True)


def _sweep_cgroups(prefix: str) -> None:
    """Remove cgroups named ``prefix*`` in every v1 hierarchy (kill what is left inside)."""
    leftovers: list[Path] = []
    with contextlib.suppress(FileNotFoundError):
        for hier in _CGROUP_ROOT.iterdir():
            if hier.name == _CGROUP2_MASK.name or not hier.is_dir():
                continue
            leftovers += [d for d in hier.glob(prefix + "*") if d.is_dir()]
    for cg in sorted(leftovers, key=lambda p: len(p.parts), reverse=True):
        for _ in range(100):
            with contextlib.suppress(FileNotFoundError):
                for pid in (cg / "cgroup.procs").read_text().split():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(pid), signal.SIGKILL)
            try:
                cg.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:
                time.sleep(0.01)
        else:
            raise BaselineError(f"cannot remove cgroup {cg}")


# ------------------------------------------------------------- the runner ---
#
# Runs as `unshare -m ... python -I -S baselines.py serve ...`. Reads one JSON
# request per line on stdin, answers one JSON line on stdout. On EOF, SIGTERM,
# or parent death it tears down everything it started before exiting.


class _Terminate(BaseException):
    """Raised from the SIGTERM handler to abort the current op."""


@dataclass
class _Box:
    """One kept sandbox: crun container id or bwrap process, plus its stdin pipe."""

    name: str
    stdin_w: int = -1
    started: bool = False
    """Its tool was launched (so there may be something to remove)."""
    removed: bool = False
    proc: subprocess.Popen[bytes] | None = None
    init_pid: int | None = None

    def close_stdin(self) -> None:
        if self.stdin_w >= 0:
            with contextlib.suppress(OSError):
                os.close(self.stdin_w)
            self.stdin_w = -1


@dataclass
class _Runner:
    tool: str
    crun_root: str
    boxes: list[_Box] = field(default_factory=list)
    parent: int = field(default_factory=os.getppid)
    abort: threading.Event = field(default_factory=threading.Event)
    """Set on SIGTERM: no new sandbox starts; those in flight finish, then cleanup runs."""
    shielded: bool = False
    """While true, SIGTERM only sets :attr:`abort` (the handler must not interrupt a submit)."""
    width: int = KEEP_CONCURRENCY
    """Threads for teardown and cleanup: the last spawn's concurrency."""
    _pool: ThreadPoolExecutor | None = None
    _inflight: list[Future[None]] = field(default_factory=list)

    # -- process plumbing

    def _check_parent(self) -> None:
        if os.getppid() != self.parent:
            raise _Terminate

    def _wait(self, proc: subprocess.Popen[bytes], timeout: float = COMMAND_TIMEOUT_S) -> int:
        """Wait for exit without Popen.wait(timeout)'s polling sleeps (pidfd + poll)."""
        pidfd = os.pidfd_open(proc.pid)
        try:
            poller = select.poll()
            poller.register(pidfd, select.POLLIN)
            if not poller.poll(timeout * 1000):
                proc.kill()
                proc.wait()
                raise TimeoutError(f"{proc.args!r} did not finish in {timeout:.0f}s")
        finally:
            os.close(pidfd)
        return proc.wait()

    def _run(self, argv: list[str], what: str) -> float:
        """Run ``argv`` to completion; its wall time in ms. Non-zero exit raises, with its stderr."""
        err = _stderr_capture()
        try:
            t0 = time.perf_counter()
            proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err
            )
            rc = self._wait(proc)
            elapsed = (time.perf_counter() - t0) * 1000.0
            if rc != 0:
                raise _CommandFailed(f"{what}: {argv[0]} exited {rc}", _captured(err))
        finally:
            os.close(err)
        return elapsed

    @staticmethod
    def _read_until(fd: int, token: bytes, what: str) -> bytes:
        poller = select.poll()  # not select(): kept sandboxes push fds past 1024
        poller.register(fd, select.POLLIN)
        buf = b""
        deadline = time.monotonic() + READY_TIMEOUT_S
        while token not in buf:
            left = deadline - time.monotonic()
            if left <= 0 or not poller.poll(left * 1000):
                raise TimeoutError(f"{what}: no {token!r} within {READY_TIMEOUT_S:.0f}s")
            chunk = os.read(fd, 4096)
            if not chunk:
                raise _CommandFailed(
                    f"{what}: pipe closed before {token!r}", buf.decode(errors="replace")
                )
            buf += chunk
        return buf

    def _reap_orphans(self) -> None:
        """Reap dead children that are not tracked by a Popen (containers re-parented to us).

        Only between ops, never while pool threads run: ``waitpid(-1)`` could
        steal the status of a ``crun`` another thread is waiting for.
        """
        tracked = {
            b.proc.pid for b in self.boxes if b.proc is not None and b.proc.returncode is None
        }
        if tracked:
            return  # waitpid(-1) could steal a tracked child's status; reap later
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return

    # -- concurrency

    def _in_parallel(
        self, count: int, width: int, work: Callable[[int], None], *, best_effort: bool = False
    ) -> list[BaseException]:
        """Call ``work(i)`` for i in 0..count-1, ``width`` at a time, started in index order.

        The threads come from one pool that lives as long as the runner:
        bwrap's ``--die-with-parent`` is a parent-death signal, which Linux
        sends when the *thread* that started bwrap exits, so a thread must
        outlive the sandboxes it started. After the first failure, or once
        :attr:`abort` is set, nothing new starts (unless ``best_effort``: then
        every ``i`` is tried); what is in flight finishes (each step is bounded
        by the command and readiness timeouts) before this returns. Returns
        the failures, in the order they happened.
        """
        if count <= 0:
            return []
        width = max(1, min(width, count, _MAX_WORKERS))
        if self._pool is None:
            self._pool = ThreadPoolExecutor(
                max_workers=_MAX_WORKERS, thread_name_prefix="dsec-bench"
            )
        lock = threading.Lock()
        claimed = 0
        failures: list[BaseException] = []

        def loop() -> None:
            nonlocal claimed
            while True:
                with lock:
                    stop = not best_effort and (bool(failures) or self.abort.is_set())
                    if claimed >= count or stop:
                        return
                    i = claimed
                    claimed += 1
                try:
                    work(i)
                except BaseException as exc:
                    with lock:
                        failures.append(exc)

        self.shielded = True
        try:
            self._inflight = [self._pool.submit(loop) for _ in range(width)]
        finally:
            self.shielded = False
        self.wait_inflight()
        if self.abort.is_set() and not best_effort:
            raise _Terminate
        return failures

    def wait_inflight(self) -> None:
        """Until no pool thread is working (a SIGTERM interrupts this wait; call it again)."""
        _wait_futures(self._inflight)
        self._inflight = []

    @staticmethod
    def _raise_first(failures: list[BaseException]) -> None:
        """Any failure ends the op: the first one, with its stderr, and how many others there were."""
        if not failures:
            return
        for exc in failures:
            if isinstance(exc, _Terminate):
                raise exc
        first = failures[0]
        if len(failures) == 1:
            raise first
        more = f" (and {len(failures) - 1} more failure{'s' if len(failures) > 2 else ''})"
        detail = getattr(first, "detail", "")
        what = (
            str(first) if isinstance(first, _CommandFailed) else f"{type(first).__name__}: {first}"
        )
        raise _CommandFailed(f"{what}{more}", detail) from first

    # -- ops

    def op_ping(self, req: dict[str, Any]) -> str:
        return "pong"

    def op_time(self, req: dict[str, Any]) -> list[float]:
        argv = [str(a) for a in req["argv"]]
        out: list[float] = []
        for i in range(int(req["n"])):
            name = f"{req['id_prefix']}-{i}"
            out.append(self._run([a.replace("{id}", name) for a in argv], name))
            self._reap_orphans()
            self._check_parent()
        return out

    def op_spawn(self, req: dict[str, Any]) -> dict[str, Any]:
        """``n`` sandboxes, ``concurrency`` in flight; per sandbox its ready time and create-to-ready ms."""
        kind = req["kind"]
        argv = [str(a) for a in req["argv"]]
        n = int(req["n"])
        self.width = max(1, int(req.get("concurrency", 1)))
        boxes = [_Box(f"{req['id_prefix']}-{i}") for i in range(n)]
        self.boxes.extend(boxes)  # before anything starts: cleanup must know every one
        done = [0.0] * n
        ms = [0.0] * n
        t_begin = time.perf_counter()

        def one(i: int) -> None:
            box = boxes[i]
            t0 = time.perf_counter()
            if kind == "crun":
                self._spawn_crun([a.replace("{id}", box.name) for a in argv], box)
            else:
                self._spawn_bwrap(argv, box)
            t1 = time.perf_counter()
            ms[i] = (t1 - t0) * 1000.0
            done[i] = t1 - t_begin
            self._check_parent()

        self._raise_first(self._in_parallel(n, self.width, one))
        # t_begin: perf_counter is CLOCK_MONOTONIC, one clock for the whole host, so the
        # caller can place its own samples (host memory) on this series' time line
        return {"done": done, "ms": ms, "t_begin": t_begin}

    def _spawn_crun(self, argv: list[str], box: _Box) -> None:
        in_r, box.stdin_w = os.pipe()
        out_r, out_w = os.pipe()
        err = _stderr_capture()
        try:
            try:
                box.started = True
                proc = subprocess.Popen(argv, stdin=in_r, stdout=out_w, stderr=err)
            finally:
                os.close(in_r)
                os.close(out_w)
            rc = self._wait(proc)
            if rc != 0:
                raise _CommandFailed(f"{box.name}: crun run -d exited {rc}", _captured(err))
            try:
                self._read_until(out_r, b"ready\n", box.name)
            except (_CommandFailed, TimeoutError) as exc:
                raise _CommandFailed(f"{exc}", _captured(err)) from exc
        finally:
            os.close(out_r)
            os.close(err)

    def _spawn_bwrap(self, argv: list[str], box: _Box) -> None:
        in_r, box.stdin_w = os.pipe()
        out_r, out_w = os.pipe()
        info_r, info_w = os.pipe()
        err = _stderr_capture()
        try:
            try:
                box.started = True
                box.proc = subprocess.Popen(
                    [a.replace("{info_fd}", str(info_w)) for a in argv],
                    stdin=in_r,
                    stdout=out_w,
                    stderr=err,
                    pass_fds=(info_w,),
                )
            finally:
                os.close(in_r)
                os.close(out_w)
                os.close(info_w)
            try:
                info = self._read_until(info_r, b"}", box.name)
                box.init_pid = int(json.loads(info[: info.index(b"}") + 1])["child-pid"])
                self._read_until(out_r, b"ready\n", box.name)
            except (_CommandFailed, TimeoutError) as exc:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    box.proc.wait(timeout=1)
                status = (
                    f" (bwrap exit status {box.proc.returncode})" if box.proc.returncode else ""
                )
                raise _CommandFailed(f"{exc}{status}", _captured(err)) from exc
        finally:
            os.close(out_r)
            os.close(info_r)
            os.close(err)

    def op_pid(self, req: dict[str, Any]) -> int:
        """Host pid of kept box ``index``'s pid 1."""
        box = self.boxes[int(req["index"])]
        if self.tool == "bwrap":
            if box.init_pid is None:
                raise RuntimeError(f"{box.name}: no pid from bwrap --info-fd")
            return box.init_pid
        crun = ["crun", "--root", self.crun_root, "--cgroup-manager", "cgroupfs"]
        state = subprocess.run(
            [*crun, "state", box.name],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=COMMAND_TIMEOUT_S,
            check=True,
        )
        return int(json.loads(state.stdout)["pid"])

    def op_teardown(self, req: dict[str, Any]) -> dict[str, list[float]]:
        """Remove every kept box, ``concurrency`` at a time; per box seconds until it was gone."""
        width = max(1, int(req.get("concurrency", 1)))
        boxes = list(self.boxes)
        done = [0.0] * len(boxes)
        t_begin = time.perf_counter()

        def one(i: int) -> None:
            self._remove(boxes[i])
            done[i] = time.perf_counter() - t_begin

        failures = self._in_parallel(len(boxes), width, one)
        self.boxes = [b for b in self.boxes if not b.removed]
        self._reap_orphans()
        self._raise_first(failures)
        return {"done": done}

    def _remove(self, box: _Box) -> None:
        if box.removed:
            return
        if not box.started:
            box.close_stdin()
        elif self.tool == "crun":
            crun = ["crun", "--root", self.crun_root, "--cgroup-manager", "cgroupfs"]
            self._run([*crun, "delete", "-f", box.name], f"delete {box.name}")
            box.close_stdin()
        elif box.proc is None:  # Popen itself failed
            box.close_stdin()
        else:
            with contextlib.suppress(ProcessLookupError):
                if box.init_pid is not None:
                    # pid 1 of the sandbox: the kernel kills the rest of its pid namespace
                    os.kill(box.init_pid, signal.SIGKILL)
                else:
                    box.proc.kill()
            self._wait(box.proc)
            box.close_stdin()
        box.removed = True

    def op_cleanup(self, req: dict[str, Any]) -> dict[str, int]:
        """Best effort: remove every sandbox this runner knows of (or crun lists), all tried."""
        boxes = list(self.boxes)
        removed = 0
        failures: list[str] = []
        lock = threading.Lock()

        def one(i: int) -> None:
            nonlocal removed
            box = boxes[i]
            try:
                self._remove(box)
                with lock:
                    removed += 1 if box.started else 0
            except Exception as exc:
                with lock:
                    failures.append(f"{box.name}: {exc}")
                if box.proc is not None:
                    with contextlib.suppress(OSError, subprocess.TimeoutExpired):
                        box.proc.kill()
                        box.proc.wait(timeout=10)
                box.close_stdin()

        self._in_parallel(len(boxes), self.width, one, best_effort=True)
        self.boxes = []
        if self.tool == "crun":
            removed += _crun_delete_all(self.crun_root)
        self._reap_orphans()
        if failures:
            raise RuntimeError(
                "; ".join(failures[:20])
                + (f" (+{len(failures) - 20})" if len(failures) > 20 else "")
            )
        return {"removed": removed}


def _stderr_capture() -> int:
    """An anonymous file for one command's stderr: with several commands in flight a shared
    log could not tell whose lines are whose. A kept container holds its copy (tiny)."""
    return os.memfd_create("dsec-bench-stderr")


def _captured(fd: int, limit: int = 4000) -> str:
    """The last ``limit`` bytes written to a :func:`_stderr_capture` file."""
    try:
        size = os.fstat(fd).st_size
        return os.pread(fd, limit, max(0, size - limit)).decode(errors="replace")
    except OSError:
        return ""


class _CommandFailed(RuntimeError):
    def __init__(self, message: str, detail: str) -> None:
        super().__init__(message)
        self.detail = detail


def _crun_delete_all(crun_root: str) -> int:
    """``crun delete -f`` every container under ``crun_root``; how many there were."""
    if not os.path.isdir(crun_root):
        return 0
    crun = ["crun", "--root", crun_root, "--cgroup-manager", "cgroupfs"]
    listed = subprocess.run(
        [*crun, "list", "-q"], capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, check=True
    )
    ids = listed.stdout.split()
    for cid in ids:
        subprocess.run(
            [*crun, "delete", "-f", cid],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=COMMAND_TIMEOUT_S,
            check=False,
        )
    return len(ids)


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _mount(source: str, target: str, fstype: str | None, flags: int, data: str | None) -> None:
    rc = _libc().mount(
        source.encode(),
        target.encode(),
        fstype.encode() if fstype else None,
        ctypes.c_ulong(flags),
        data.encode() if data else None,
    )
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {source} on {target}: {os.strerror(err)}")


def _prepare_namespace(*, mask_cgroup2: bool, rootfs: str | None, view: str | None) -> None:
    """Inside the runner's private mount namespace: cgroup2 mask and rootfs view."""
    if mask_cgroup2:
        _mount("dsec-bench-cgroup2-mask", str(_CGROUP2_MASK), "tmpfs", 0, "mode=0755,size=256m")
    if rootfs and view:
        _mount(rootfs, view, None, _MS_BIND | _MS_REC, None)
        _mount("none", view, None, _MS_BIND | _MS_REMOUNT | _MS_RDONLY, None)


def _become_subreaper() -> None:
    """Containers that crun detaches re-parent to us (we reap them), not to host init."""
    _libc().prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def _raise_nofile() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _drop_to(uid: int) -> None:
    """Run as ``uid``, keeping saved ids 0 so the runner can clean up as root later.

    Programs it starts get ``uid`` in all three ids (execve copies the effective
    id into the saved one), so bwrap runs fully unprivileged.
    """
    os.setgroups([])
    os.setresgid(uid, uid, 0)
    os.setresuid(uid, uid, 0)


def _regain_root() -> None:
    os.setresuid(0, 0, 0)
    os.setresgid(0, 0, 0)


def _is_mountpoint(path: Path) -> bool:
    """From mountinfo: ``os.path.ismount`` misses bind mounts within one filesystem."""
    target = str(path)
    with open("/proc/self/mountinfo") as f:
        for line in f:
            point = line.split()[4].replace("\\040", " ").replace("\\011", "\t")
            if point == target:
                return True
    return False


def _remove_bench_dir(bench_dir: Path) -> None:
    """Unmount the rootfs view in our namespace first: rmtree must never reach the rootfs."""
    view = bench_dir / "rootfs"
    while _is_mountpoint(view):
        if _libc().umount2(str(view).encode(), _MNT_DETACH) != 0:
            return
    shutil.rmtree(bench_dir, ignore_errors=True)


def _serve(args: argparse.Namespace, stdin: IO[bytes], stdout: IO[bytes]) -> int:
    runner = _Runner(tool=args.tool, crun_root=args.crun_root)

    def on_term(signum: int, frame: object) -> None:
        runner.abort.set()  # pool threads start nothing new
        if not runner.shielded:
            raise _Terminate

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _become_subreaper()
    _raise_nofile()
    _prepare_namespace(
        mask_cgroup2=args.mask_cgroup2,
        rootfs=args.rootfs,
        view=str(Path(args.bench_dir) / "rootfs"),
    )
    if args.drop_to_uid is not None:
        _drop_to(args.drop_to_uid)
    ops = {
        "ping": runner.op_ping,
        "time": runner.op_time,
        "spawn": runner.op_spawn,
        "pid": runner.op_pid,
        "teardown": runner.op_teardown,
        "cleanup": runner.op_cleanup,
    }
    try:
        for line in stdin:
            req = json.loads(line)
            try:
                reply = {"ok": True, "result": ops[req["op"]](req)}
            except _Terminate:
                raise
            except Exception as exc:
                reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
                reply["detail"] = getattr(exc, "detail", "")
            stdout.write(json.dumps(reply).encode() + b"\n")
            stdout.flush()
    except (_Terminate, BrokenPipeError):
        pass
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # cleanup must not be interrupted
        runner.abort.set()
        runner.wait_inflight()  # a sandbox still starting must be known before cleanup runs
        status = 0
        try:
            runner.op_cleanup({})
        except Exception as exc:
            print(f"runner cleanup: {exc}", file=sys.stderr)
            status = 1
        if os.getppid() != runner.parent:
            # Orphaned (the benchmark process was killed): nobody else will sweep.
            if args.drop_to_uid is not None:
                _regain_root()
            with contextlib.suppress(Exception):
                _sweep_cgroups(args.cgroup_prefix)
            _remove_bench_dir(Path(args.bench_dir))
    return status


def _main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="dsec-bench-runner")
    sub = parser.add_subparsers(dest="cmd", required=True)
    serve = sub.add_parser("serve")
    serve.add_argument("--tool", choices=("crun", "bwrap"), required=True)
    serve.add_argument("--bench-dir", required=True)
    serve.add_argument("--rootfs", required=True)
    serve.add_argument("--crun-root", required=True)
    serve.add_argument("--cgroup-prefix", required=True)
    serve.add_argument("--drop-to-uid", type=int)
    serve.add_argument("--mask-cgroup2", action="store_true")
    sweep = sub.add_parser("sweep")
    sweep.add_argument("--crun-root", required=True)
    sweep.add_argument("--mask-cgroup2", action="store_true")
    args = parser.parse_args(argv)
    if args.cmd == "sweep":
        _become_subreaper()
        _prepare_namespace(mask_cgroup2=args.mask_cgroup2, rootfs=None, view=None)
        _crun_delete_all(args.crun_root)
        with contextlib.suppress(ChildProcessError):
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        return 0
    return _serve(args, sys.stdin.buffer, sys.stdout.buffer)


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
