"""Which host resources belong to this test session: the leak check counts only those.

The suite may run beside a user's own ``dsec up`` (the README's demo instance left running)
or another test session. Every host resource a DSec runtime makes is named after the
runtime (cgroups ``dsec/<name>``, its run directory ``/run/dsec/<name>/`` and the mounts
there, nftables tables ``dsec_host_<tag>``/``dsec_nat_<tag>`` with ``tag =
claims.net_tag(name)``), and every runtime claims its name host-wide at start: a file
``runtime-<name>`` in the claims directory, which says ``<name> pid <holder>``
(:mod:`dsec.backends.common.claims`).

So a :class:`NameWatch` reads those claim files while the session runs and keeps the names
whose holder is this session's: this process, or a process carrying the session's
environment mark (every ``dsec up`` and edge the tests start inherits it). Names with the
session's runtime prefix are the session's too. A resource is the session's when it is named
after one of those names (a named network namespace: named for the session's token, or for
none); anything else on the host (another instance's mounts, cgroups and
tables, made or removed while the tests ran) is not the run's to report.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

from dsec.backends.common.claims import claims_dir, net_tag

TABLE_RE = re.compile(r"^table (?:inet|ip|ip6) dsec_(?:host|nat)_([0-9a-f]{4})$")
"""A runtime's host tables (network.py: ``dsec_host_<tag>``, ``dsec_nat_<tag>``)."""


class NameWatch:
    """The runtime names this session's processes claimed (see the module docstring)."""

    def __init__(self, prefix: str, ours: Callable[[int], bool], *, interval: float = 0.2) -> None:
        """``prefix``: runtime names that start with it are the session's; ``ours(pid)``: the
        process is the session's. Polls every ``interval`` s in a daemon thread once started."""
        self.prefix = prefix
        self.ours = ours
        self.interval = interval
        self.names: set[str] = set()
        self._dirs: set[Path] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> NameWatch:
        self.poll()
        self._thread = threading.Thread(target=self._run, name="dsec-test-namewatch", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.poll()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            with contextlib.suppress(Exception):  # a probe must never break the session
                self.poll()

    def poll(self) -> None:
        """Read the claims directories (the host's, and any a test pointed ``$DSEC_CLAIMS_DIR`` at)."""
        self._dirs.add(claims_dir())
        for d in list(self._dirs):
            try:
                entries = os.listdir(d)
            except OSError:
                continue
            for entry in entries:
                if not entry.startswith("runtime-"):
                    continue
                name = entry[len("runtime-"):]
                if name in self.names:
                    continue
                if name.startswith(self.prefix) or self._held_by_us(d / entry):
                    self.names.add(name)

    def _held_by_us(self, path: Path) -> bool:
        try:
            words = path.read_text().split()
        except OSError:
            return False
        if len(words) >= 3 and words[-2] == "pid" and words[-1].isdigit():
            pid = int(words[-1])
            return pid == os.getpid() or self.ours(pid)
        return False

    def owns(self, name: str) -> bool:
        return name.startswith(self.prefix) or name in self.names

    def tags(self) -> set[str]:
        return {net_tag(n) for n in self.names}


def own_mount(line: str, watch: NameWatch, dirs: Iterable[str]) -> bool:
    """A mountinfo line of the session: under one of its ``dirs`` (its temporary directories,
    anywhere in the line: mount point or source), or mounted in a run or state directory of one
    of its runtimes (``/run/dsec/<name>/...``, ``/var/lib/dsec/<name>/...``)."""
    if any(d in line for d in dirs):
        return True
    fields = line.split(" ")
    point = fields[4] if len(fields) > 4 else ""
    for base in ("/run/dsec/", "/var/lib/dsec/"):
        if point.startswith(base):
            first = point[len(base):].split("/", 1)[0]
            return watch.owns(first)
    return False


def own_table(table: str, watch: NameWatch) -> bool:
    """An nftables table (``nft list tables`` line) of the session: a runtime table whose tag is
    one of the session's runtimes' (tags are claimed host-wide, so no two live runtimes share
    one); a DSec table of another form is counted as the session's (it names no runtime)."""
    m = TABLE_RE.match(table.strip())
    return m is None or m.group(1) in watch.tags()


SESSION_SUFFIX_RE = re.compile(r"-([0-9a-f]{6})$")
"""A network namespace named for a test session (``dsec-cfnet-<session token>``)."""


def own_netns(name: str, token: str) -> bool:
    """A named network namespace of the session: one named for its token, or one named for no
    session at all (a test's fixed name); one named for another session's token is that one's."""
    m = SESSION_SUFFIX_RE.search(name)
    return m is None or m.group(1) == token


def own_cgroups(root: Path, watch: NameWatch) -> list[Path]:
    """``<hierarchy>/dsec/<name>`` directories of the session's runtimes under cgroup ``root``."""
    out: list[Path] = []
    for hier in root.iterdir():
        with contextlib.suppress(OSError):
            out.extend(p for p in (hier / "dsec").iterdir() if p.is_dir() and watch.owns(p.name))
    return sorted(out)
