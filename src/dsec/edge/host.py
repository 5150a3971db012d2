"""Node use as the edge reports it: cpu, memory and disk of the host.

Reads /proc and statvfs only (microseconds); cpu utilisation is the busy
share of all cores since the previous sample.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path


def _cpu_times() -> tuple[float, float]:
    """(busy, total) jiffies of all cpus."""
    with open("/proc/stat") as f:
        parts = f.readline().split()[1:]
    vals = [float(x) for x in parts]
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0.0)  # idle + iowait
    total = sum(vals[:8])  # guest time is already in user
    return total - idle, total


class HostSampler:
    def __init__(self, disk_path: Path) -> None:
        self.disk_path = disk_path
        self._last = _cpu_times()
        self._last_t = time.monotonic()
        self._util = 0.0

    def cpu_util(self) -> float:
        """Busy share of all cores (0..1) since the last call at least 0.5 s ago."""
        now = time.monotonic()
        if now - self._last_t >= 0.5:
            busy, total = _cpu_times()
            d_total = total - self._last[1]
            if d_total > 0:
                self._util = max(0.0, min(1.0, (busy - self._last[0]) / d_total))
            self._last = (busy, total)
            self._last_t = now
        return self._util

    def sample(self) -> dict[str, float]:
        mem: dict[str, int] = {}
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("MemTotal", "MemAvailable"):
                    mem[key] = int(rest.split()[0]) * 1024
        probe = self.disk_path
        while not probe.exists() and probe != probe.parent:
            probe = probe.parent
        disk = shutil.disk_usage(probe)
        return {
            "cpu_cores": float(os.cpu_count() or 1),
            "cpu_util": round(self.cpu_util(), 4),
            "load1": os.getloadavg()[0],
            "memory_total": float(mem.get("MemTotal", 0)),
            "memory_available": float(mem.get("MemAvailable", 0)),
            "disk_total": float(disk.total),
            "disk_free": float(disk.free),
        }
