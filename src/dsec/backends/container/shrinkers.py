"""The kernel's memory-cgroup shrinker tables, sized once at start while that is cheap.

Linux (>= 6.7) gives every memory cgroup a table of one ~1 KiB unit per 64 memcg-aware
shrinker ids (per NUMA node), up to the boot's high-water mark ``shrinker_nr_max``, which
only grows until reboot. Every superblock is such a shrinker: a sandbox here has three (its
overlay, its ``/proc``, its IPC namespace's mqueue). Each time the mark crosses a multiple of
64, the kernel reallocates every memory cgroup's table: at N sandboxes that is O(N) work
every ~21 creates, which grows with N and bends the create rate down on a freshly booted
node (docs/PERFORMANCE.md, "Node density"). At N sandboxes the tables end the same size
either way; raising the mark once at start, while few memory cgroups exist, does the
reallocation when it costs nothing.

:func:`reserve` mounts that many superblocks at once (tmpfs, each on a directory of its own) in a
private mount namespace of a short-lived child process, which then exits: its namespace and
every mount in it die with it, the ids are free again, and the mark stays. Once per boot
(``/run`` is a tmpfs; the mark cannot fall): a later call for no more ids does nothing.

The price: every memory cgroup made afterwards carries the whole table (``ids / 64`` KiB),
so the reserve follows the node's configured capacity (``EdgeConfig.max_sandboxes``), never
more (docs/RUNTIME.md, "Shrinker reserve").

Owns: the reserve and its per-boot record. Must never: leave a mount or a process behind,
or run beside a loaded node (callers do it at start).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Final

SUPERBLOCKS_PER_SANDBOX: Final = 3
"""Memcg-aware shrinkers a container sandbox holds: overlay, proc, mqueue (docs/RUNTIME.md)."""
HOST_MARGIN: Final = 64
"""One unit of 64 ids. The mark a node reaches is its actual peak (the host's superblocks and 3 per
sandbox): a reserve above it would only make every table bigger, and a few reallocations at the
very end cost nothing."""
MOUNT_MAX: Final = 90_000
"""Below ``fs.mount-max`` (100,000 by default): one child's namespace holds at most this."""
RECORD: Final = Path("/run/dsec/shrinker-reserve")
"""The ids reserved this boot (``/run`` is cleared at boot, as the kernel's mark is)."""
_CLONE_NEWNS: Final = 0x00020000
_MS_REC: Final = 0x4000
_MS_PRIVATE: Final = 1 << 18


def ids_for(sandboxes: int) -> int:
    """The reserve a node of ``sandboxes`` container sandboxes needs (0 for none)."""
    return 0 if sandboxes <= 0 else sandboxes * SUPERBLOCKS_PER_SANDBOX + HOST_MARGIN


def reserved() -> int:
    """Ids reserved this boot by any runtime (0 if none, or unreadable)."""
    try:
        return int(RECORD.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def reserve(ids: int, *, timeout: float = 120.0) -> int:
    """Raise the shrinker-id high-water mark to at least ``ids`` (blocking, ~35 us an id;
    run it in a thread). Returns the ids this call mounted (0: already reserved this boot,
    or nothing asked). Raises OSError when the child fails."""
    ids = min(int(ids), MOUNT_MAX)
    if ids <= 0 or reserved() >= ids:
        return 0
    proc = subprocess.run([sys.executable, "-I", "-c", _CHILD, str(ids)], capture_output=True, text=True,
                          timeout=timeout, check=False)
    if proc.returncode != 0:
        raise OSError(f"shrinker reserve of {ids} ids failed: {proc.stderr.strip()[-500:]}")
    RECORD.parent.mkdir(parents=True, exist_ok=True)
    tmp = RECORD.with_name(f".{RECORD.name}.{os.getpid()}")
    tmp.write_text(f"{ids}\n")
    os.replace(tmp, RECORD)
    return ids


# The child: a private mount namespace, N tmpfs superblocks, each on a directory of its own,
# then exit (the namespace dies with its last process, and every mount in it). Standalone,
# standard library only, so that nothing of the caller's process is copied or touched.
_CHILD = f"""
import ctypes, os, sys
n = int(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
def check(rc, what):
    if rc != 0:
        e = ctypes.get_errno()
        sys.exit(what + ": " + os.strerror(e))
check(libc.unshare({_CLONE_NEWNS}), "unshare(CLONE_NEWNS)")
check(libc.mount(b"none", b"/", b"none", {_MS_REC | _MS_PRIVATE}, None), "mount --make-rprivate /")
check(libc.mount(b"dsec-shrinker-reserve", b"/tmp", b"tmpfs", 0, b"size=1m,nr_inodes=%d" % (n + 64)), "mount /tmp")
for i in range(n):  # a directory each: mounts stacked on one directory cost O(n) each (20,000: 9 s, not 0.2)
    d = b"/tmp/%d" % i
    os.mkdir(d)
    check(libc.mount(b"dsec-shrinker-reserve", d, b"tmpfs", 0, b"size=4k,nr_inodes=8"), "mount")
"""


def main(argv: list[str]) -> int:  # python -m dsec.backends.container.shrinkers [SANDBOXES]
    n = int(argv[1]) if len(argv) > 1 else 10_000
    with contextlib.suppress(KeyboardInterrupt):
        got = reserve(ids_for(n))
        print(f"reserved {got} shrinker ids for {n} sandboxes" if got else f"already reserved: {reserved()} ids")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
