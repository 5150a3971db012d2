"""cgroup v1 control for sandboxes: one directory per sandbox per controller.

Layout: ``/sys/fs/cgroup/<controller>/dsec/<runtime>/<sandbox-id>``, so a
reconciler finds every sandbox's cgroups by name after a crash. Only this
module writes under /sys/fs/cgroup.
"""

from __future__ import annotations

import contextlib
import errno
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from dsec.backends.common import cgroupfs
from dsec.errors import HostError
from dsec.spec import Resources

CGROUP_ROOT = Path("/sys/fs/cgroup")
CONTROLLERS = ("cpu", "memory", "pids", "freezer")
CFS_PERIOD_US = 100_000
HOST_CPUS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _read_small(path: str) -> bytes:
    """One read of a small control file, without a Python file object (half the cost)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.read(fd, 4096)
    finally:
        os.close(fd)


def check_host() -> None:
    missing = [c for c in CONTROLLERS if not (CGROUP_ROOT / c / "tasks").exists()]
    if missing:
        raise HostError(
            f"cgroup v1 controllers not mounted: {', '.join(missing)} (expected under {CGROUP_ROOT})",
            missing=missing,
        )


@dataclass(frozen=True, slots=True)
class CgroupStats:
    memory_bytes: int
    memory_max_bytes: int
    memory_failcnt: int
    oom_kills: int
    pids: int
    pids_limit_hits: int
    cpu_throttled: int
    cpu_throttled_s: float


def favor_dynmods() -> bool:
    """Switch the kernel's cgroup threadgroup lock to favour migrations.

    Every sandbox process is moved into its cgroups at birth; with the default
    per-cpu rwsem each move may wait an RCU grace period (0.3-2 ms measured).
    ``favordynmods`` (a documented cgroup2 mount option whose lock is global,
    so it also speeds up v1 migrations) trades a little fork/exit cost for it.
    Applied by remounting the cgroup2 mount if there is one; a no-op otherwise.
    """
    unified = CGROUP_ROOT / "unified"
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                parts = line.split()
                if parts[4] == str(unified) and "cgroup2" in line:
                    if "favordynmods" in parts[-1]:
                        return True
                    import subprocess

                    return subprocess.run(
                        ["mount", "-o", "remount,favordynmods", str(unified)], capture_output=True
                    ).returncode == 0
    except OSError:
        pass
    return False


class RuntimeCgroups:
    """The per-runtime parent directories and the per-sandbox children below them."""

    def __init__(self, runtime_name: str, *, on_repair: Callable[[str], None] | None = None) -> None:
        """``on_repair`` hears of a parent directory made again on the way (someone removed it)."""
        self.runtime_name = runtime_name
        self.parents = {c: CGROUP_ROOT / c / "dsec" / runtime_name for c in CONTROLLERS}
        self.on_repair = on_repair

    def setup(self, *, tune_host: bool = True) -> None:
        check_host()
        if tune_host:
            favor_dynmods()
            from dsec.backends.container.hostcheck import tune_inotify

            tune_inotify()
        for ctrl, path in self.parents.items():
            path.mkdir(parents=True, exist_ok=True)
            if ctrl == "memory":
                # Children must be charged to (and limited by) their parents.
                use_h = path / "memory.use_hierarchy"
                if use_h.exists() and cgroupfs.read(use_h).strip() != "1":
                    with contextlib.suppress(OSError):
                        cgroupfs.write(use_h, "1")

    def missing_parents(self) -> list[Path]:
        return [p for p in self.parents.values() if not p.is_dir()]

    def repair_parents(self, *, notify: bool = True) -> list[Path]:
        """Make the parent directories that are gone again (an empty parent can be removed by
        anyone: an operator, a cleanup script); returns those made (``on_repair`` hears of
        each unless ``notify`` is False)."""
        missing = self.missing_parents()
        if missing:
            self.setup(tune_host=False)
            for p in missing:
                if notify and self.on_repair is not None:
                    self.on_repair(f"re-made cgroup directory {p} (it had been removed)")
        return missing

    def dirs(self, sandbox_id: str) -> list[Path]:
        return [p / sandbox_id for p in self.parents.values()]

    def existing_children(self) -> set[str]:
        found: set[str] = set()
        for p in self.parents.values():
            if p.is_dir():
                found.update(e.name for e in os.scandir(p) if e.is_dir())
        return found

    def create(self, sandbox_id: str, res: Resources) -> list[Path]:
        made: list[Path] = []
        try:
            for ctrl, parent in self.parents.items():
                d = parent / sandbox_id
                try:
                    d.mkdir()
                except FileNotFoundError:
                    self.repair_parents()  # the parent was removed under us: make it again, once
                    d.mkdir()
                made.append(d)
                if ctrl == "cpu":
                    # The period is the kernel default (100 ms); shares default to 1024.
                    # A quota write walks every task group on the host (370 us at 10,000
                    # groups): skip it when the limit is no limit (as many cores as the host).
                    if res.cpu < HOST_CPUS:
                        cgroupfs.write(d / "cpu.cfs_quota_us", str(max(1000, int(res.cpu * CFS_PERIOD_US))))
                    if res.cpu_weight != 1024:
                        cgroupfs.write(d / "cpu.shares", str(res.cpu_weight))
                elif ctrl == "memory":
                    cgroupfs.write(d / "memory.limit_in_bytes", str(res.memory))
                elif ctrl == "pids":
                    cgroupfs.write(d / "pids.max", str(res.pids))
        except OSError as exc:
            for d in reversed(made):
                self._rmdir(d)
            raise HostError(f"cannot set up cgroups for {sandbox_id}: {exc}", sandbox_id=sandbox_id) from exc
        return made

    def make_children(self, sandbox_id: str, controller: str, names: Sequence[str]) -> list[Path]:
        """Child cgroups of one controller below the sandbox's own (a backend's own division of
        its sandbox, e.g. FnCall's per-slot memory cgroups): charged to and bounded by the
        sandbox's, removed with it (:meth:`remove`). Made afresh: an existing one is an error."""
        parent = self.parents[controller] / sandbox_id
        made: list[Path] = []
        try:
            for name in names:
                if not name or "/" in name or name.startswith("."):
                    raise ValueError(f"cgroup name {name!r}")
                d = parent / name
                d.mkdir()
                made.append(d)
        except OSError as exc:
            for d in reversed(made):
                self._rmdir(d)
            raise HostError(f"cannot make cgroups below {parent}: {exc}", sandbox_id=sandbox_id) from exc
        return made

    def pids(self, sandbox_id: str) -> list[int]:
        try:
            text = cgroupfs.read(self.parents["pids"] / sandbox_id / "cgroup.procs")
        except FileNotFoundError:
            return []
        return [int(x) for x in text.split()]

    def freeze(self, sandbox_id: str, frozen: bool) -> None:
        cgroupfs.write(self.parents["freezer"] / sandbox_id / "freezer.state", "FROZEN" if frozen else "THAWED")

    def kill_all(self, sandbox_id: str) -> None:
        """SIGKILL every task in the sandbox's cgroup (frozen first, so nothing forks meanwhile)."""
        with contextlib.suppress(OSError):
            self.freeze(sandbox_id, True)
        for pid in self.pids(sandbox_id):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)
        with contextlib.suppress(OSError):
            self.freeze(sandbox_id, False)

    # Each command gets its own freezer cgroup below the sandbox's, so a timeout
    # kills everything it started, even processes that left its process group
    # (setsid + double fork): cgroup membership cannot be shed from inside.

    def track_dir(self, sandbox_id: str, name: str) -> Path:
        return self.parents["freezer"] / sandbox_id / name

    def make_track(self, sandbox_id: str, name: str) -> Path:
        d = self.track_dir(sandbox_id, name)
        d.mkdir()
        return d

    def kill_tracked(self, track: Path) -> None:
        self.kill_tracked_path(track)

    @staticmethod
    def kill_tracked_path(track: Path) -> None:
        """SIGKILL every process of one command (frozen first, so none forks meanwhile)."""
        state = track / "freezer.state"
        try:
            cgroupfs.write(state, "FROZEN")
        except OSError:
            return
        try:
            for _ in range(3):
                pids = [int(x) for x in cgroupfs.read(track / "cgroup.procs").split()]
                if not pids:
                    break
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, 9)
        finally:
            with contextlib.suppress(OSError):
                cgroupfs.write(state, "THAWED")

    def drop_track(self, track: Path) -> bool:
        """Remove a command's cgroup if nothing of it still runs (background jobs keep it)."""
        try:
            track.rmdir()
            return True
        except OSError:
            return False

    def remove(self, sandbox_id: str, *, timeout: float = 5.0) -> list[Path]:
        """Remove the sandbox's cgroups; returns the directories that could not be removed."""
        left: list[Path] = []
        for parent in self.parents.values():
            d = parent / sandbox_id
            if d.is_dir():
                for sub in os.scandir(d):
                    if sub.is_dir(follow_symlinks=False):
                        self._rmdir(Path(sub.path), timeout=timeout)
            if not self._rmdir(d, timeout=timeout):
                left.append(d)
        return left

    def remove_parents(self) -> None:
        for path in self.parents.values():
            for p in (path, path.parent):
                with contextlib.suppress(OSError):
                    p.rmdir()

    @staticmethod
    def _rmdir(d: Path, *, timeout: float = 5.0) -> bool:
        deadline = time.monotonic() + timeout
        delay = 0.0005
        while True:
            try:
                d.rmdir()
                return True
            except FileNotFoundError:
                return True
            except OSError as exc:
                if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                    return False
                time.sleep(delay)
                delay = min(delay * 2, 0.05)

    def limit_counters(self, sandbox_id: str) -> tuple[int, int]:
        """(OOM kills, pids-limit hits): two small reads (~7 us each), cheap enough before
        and after every exec."""
        oom = _read_small(f"{self.parents['memory']}/{sandbox_id}/memory.oom_control")
        i = oom.find(b"oom_kill ")
        kills = int(oom[i + 9 :].split()[0]) if i >= 0 else 0
        try:
            ev = _read_small(f"{self.parents['pids']}/{sandbox_id}/pids.events")
            hits = int(ev.split()[1]) if ev.startswith(b"max") else 0
        except OSError:
            hits = 0
        return kills, hits

    def stats(self, sandbox_id: str) -> CgroupStats:
        mem = self.parents["memory"] / sandbox_id
        pids = self.parents["pids"] / sandbox_id
        cpu = self.parents["cpu"] / sandbox_id
        oom = dict(line.split() for line in cgroupfs.read(mem / "memory.oom_control").splitlines())
        events = dict(line.split() for line in cgroupfs.read(pids / "pids.events").splitlines()) if (pids / "pids.events").exists() else {}
        cs = dict(line.split() for line in cgroupfs.read(cpu / "cpu.stat").splitlines())
        return CgroupStats(
            memory_bytes=int(cgroupfs.read(mem / "memory.usage_in_bytes")),
            memory_max_bytes=int(cgroupfs.read(mem / "memory.max_usage_in_bytes")),
            memory_failcnt=int(cgroupfs.read(mem / "memory.failcnt")),
            oom_kills=int(oom.get("oom_kill", 0)),
            pids=int(cgroupfs.read(pids / "pids.current")),
            pids_limit_hits=int(events.get("max", 0)),
            cpu_throttled=int(cs.get("nr_throttled", 0)),
            cpu_throttled_s=int(cs.get("throttled_time", 0)) / 1e9,
        )


_CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of these processes (and of their reaped children), from /proc."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        total += sum(int(x) for x in fields[11:15])  # utime stime cutime cstime
    return total / _CLK_TCK
