"""Sandboxes whose host side is a few processes of a monitor (gVisor's sentry and gofer, a
microVM's QEMU): their cgroups (v1), named by us, read and cleaned up here.

``/sys/fs/cgroup/<hierarchy>/dsec/<backend-name>/<sandbox-id>`` in every v1 hierarchy. gVisor's
runsc creates a sandbox's directories from the OCI ``linux.cgroupsPath`` we give it and writes
the limits itself; the microVM backend makes them here (:meth:`SandboxCgroups.make`,
:meth:`SandboxCgroups.limit`) and starts QEMU inside them (:meth:`SandboxCgroups.enter`). This
module makes the parents (the memory one with ``use_hierarchy``, so children are charged to
it), reads usage, freezes and thaws, and removes what a crash left. It never touches another
name's tree.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path
from typing import Final

from dsec.backends.common import cgroupfs

CGROUP_ROOT: Final = Path("/sys/fs/cgroup")


def hierarchies() -> list[Path]:
    """The mounted cgroup v1 hierarchies (runsc makes a directory in each)."""
    out: list[Path] = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            parts = line.split()
            sep = parts.index("-")
            if parts[sep + 1] == "cgroup" and parts[4].startswith(str(CGROUP_ROOT) + "/"):
                out.append(Path(parts[4]))
    return sorted(set(out))


class SandboxCgroups:
    """The cgroups of one backend name: ``dsec/<name>`` in every hierarchy, a child per sandbox."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.hier = hierarchies()

    def path(self, sandbox_id: str) -> str:
        """The OCI ``linux.cgroupsPath`` of a sandbox."""
        return f"/dsec/{self.name}/{sandbox_id}"

    def parent(self, hierarchy: Path) -> Path:
        return hierarchy / "dsec" / self.name

    def dir(self, controller: str, sandbox_id: str) -> Path:
        return CGROUP_ROOT / controller / "dsec" / self.name / sandbox_id

    def setup(self) -> None:
        for h in self.hier:
            p = self.parent(h)
            p.mkdir(parents=True, exist_ok=True)
            use_h = p / "memory.use_hierarchy"
            if use_h.exists() and cgroupfs.read(use_h).strip() != "1":
                with contextlib.suppress(OSError):
                    cgroupfs.write(use_h, "1")

    def remove_parents(self) -> list[Path]:
        """Remove ``dsec/<name>`` where empty, and ``dsec`` itself where no other runtime uses
        it (as the container runtime does); the ones left (still holding sandboxes)."""
        left = []
        for h in self.hier:
            p = self.parent(h)
            try:
                p.rmdir()
            except FileNotFoundError:
                pass
            except OSError:
                left.append(p)
                continue
            with contextlib.suppress(OSError):  # another runtime's: stays
                p.parent.rmdir()
        return left

    def existing(self) -> set[str]:
        """Sandbox ids that have a cgroup directory in any hierarchy."""
        out: set[str] = set()
        for h in self.hier:
            with contextlib.suppress(OSError):
                out.update(e.name for e in os.scandir(self.parent(h)) if e.is_dir())
        return out

    def dirs(self, sandbox_id: str) -> list[Path]:
        return [d for d in (self.parent(h) / sandbox_id for h in self.hier) if d.is_dir()]

    def pids(self, sandbox_id: str) -> list[int]:
        """Host tasks (sentry, gofer, stubs) of a sandbox, from its pids cgroup."""
        for ctrl in ("pids", "memory", "freezer"):
            try:
                return [int(p) for p in cgroupfs.read(self.dir(ctrl, sandbox_id) / "cgroup.procs").split()]
            except FileNotFoundError:
                continue
        return []

    def kill_all(self, sandbox_id: str) -> None:
        for pid in self.pids(sandbox_id):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)

    async def remove(self, sandbox_id: str, *, wait_s: float = 5.0) -> list[Path]:
        """Kill what is left in a sandbox's cgroups, thaw them and remove them; the ones left."""
        import asyncio

        self.kill_all(sandbox_id)
        self.thaw(sandbox_id)
        deadline = time.monotonic() + wait_s
        while self.pids(sandbox_id) and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        left = []
        for d in sorted(self.dirs(sandbox_id), key=lambda p: -len(p.parts)):
            for _ in range(100):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    await asyncio.sleep(0.01)  # a dying task leaves its cgroup a moment later
            else:
                left.append(d)
        return left

    # ----- made here (a backend that starts its monitor itself) -----

    def make(self, sandbox_id: str) -> list[Path]:
        """A sandbox's directory in every hierarchy (the parents must exist: :meth:`setup`)."""
        made = []
        for h in self.hier:
            d = self.parent(h) / sandbox_id
            d.mkdir(exist_ok=True)
            if (d / "cpuset.cpus").exists():
                _inherit_cpuset(h, d)
            made.append(d)
        return made

    def limit(self, sandbox_id: str, *, memory_bytes: int | None = None, cpu: float | None = None,
              pids: int | None = None, cfs_period_us: int = 100_000) -> None:
        """Hard limits of the sandbox's host tasks: memory (with swap: none beyond it), CPU
        (a CFS quota of ``cpu`` cores) and host tasks."""
        if memory_bytes is not None:
            d = self.dir("memory", sandbox_id)
            cgroupfs.write(d / "memory.limit_in_bytes", str(memory_bytes))
            with contextlib.suppress(OSError):  # absent without swap accounting
                cgroupfs.write(d / "memory.memsw.limit_in_bytes", str(memory_bytes))
        if cpu is not None:
            d = self.dir("cpu", sandbox_id)
            cgroupfs.write(d / "cpu.cfs_period_us", str(cfs_period_us))
            cgroupfs.write(d / "cpu.cfs_quota_us", str(max(1000, int(cpu * cfs_period_us))))
        if pids is not None:
            cgroupfs.write(self.dir("pids", sandbox_id) / "pids.max", str(pids))

    def enter(self, sandbox_id: str, pid: int = 0) -> None:
        """Move ``pid`` (0: the calling process, e.g. a child before it execs) into the
        sandbox's directory of every hierarchy."""
        for h in self.hier:
            cgroupfs.write(self.parent(h) / sandbox_id / "cgroup.procs", str(pid or os.getpid()))

    # ----- freezer -----

    def freezer_state(self, sandbox_id: str) -> str:
        try:
            return cgroupfs.read(self.dir("freezer", sandbox_id) / "freezer.state").strip()
        except OSError:
            return ""

    def freeze(self, sandbox_id: str) -> None:
        cgroupfs.write(self.dir("freezer", sandbox_id) / "freezer.state", "FROZEN")

    def thaw(self, sandbox_id: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            cgroupfs.write(self.dir("freezer", sandbox_id) / "freezer.state", "THAWED")

    # ----- readings -----

    def memory_bytes(self, sandbox_id: str) -> int:
        try:
            return int(cgroupfs.read(self.dir("memory", sandbox_id) / "memory.usage_in_bytes"))
        except (OSError, ValueError):
            return 0

    def oom_kills(self, sandbox_id: str) -> int:
        try:
            for line in cgroupfs.read(self.dir("memory", sandbox_id) / "memory.oom_control").splitlines():
                k, _, v = line.partition(" ")
                if k == "oom_kill":
                    return int(v)
        except (OSError, ValueError):
            pass
        return 0

    def cpu_s(self, sandbox_id: str) -> float:
        try:
            return int(cgroupfs.read(self.dir("cpuacct", sandbox_id) / "cpuacct.usage")) / 1e9
        except (OSError, ValueError):
            return 0.0

    def host_tasks(self, sandbox_id: str) -> int:
        try:
            return int(cgroupfs.read(self.dir("pids", sandbox_id) / "pids.current"))
        except (OSError, ValueError):
            return 0


def _inherit_cpuset(root: Path, leaf: Path) -> None:
    """A new cpuset cgroup (v1) has no CPUs and no memory nodes, and refuses tasks (ENOSPC)
    until it is given some: each level from ``root`` down to ``leaf`` takes its parent's."""
    chain = [leaf]
    while chain[-1] != root and chain[-1].parent != chain[-1]:
        chain.append(chain[-1].parent)
    for d in reversed(chain[:-1]):
        for f in ("cpuset.cpus", "cpuset.mems"):
            if not cgroupfs.read(d / f).strip():
                cgroupfs.write(d / f, cgroupfs.read(d.parent / f).strip())
