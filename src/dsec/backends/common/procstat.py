"""A host process's identity and CPU time, read from ``/proc/<pid>/stat``: what the backends
whose sandboxes are monitor processes (gVisor's sentry, a microVM's QEMU) keep in their
records to tell their own process from a later one with the same pid, and how much CPU it
used. Never raises for a process that is gone."""

from __future__ import annotations


def _fields(pid: int) -> list[bytes] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    return data[data.rindex(b")") + 2:].split()


def proc_start(pid: int, *, zombie: bool = False) -> int:
    """Start time of ``pid`` (clock ticks since boot): with the pid, a process identity; 0 if
    gone (or exited and not reaped yet, unless ``zombie``)."""
    fields = _fields(pid)
    if fields is None:
        return 0
    return 0 if fields[0] in (b"Z", b"X") and not zombie else int(fields[19])


def cpu_ticks(pid: int) -> int:
    """utime + stime of ``pid`` in clock ticks (0 when gone)."""
    fields = _fields(pid)
    try:
        return int(fields[11]) + int(fields[12]) if fields is not None else 0
    except (IndexError, ValueError):
        return 0
