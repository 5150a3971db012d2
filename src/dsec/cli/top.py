"""``dsec top``: each edge's admission budget and each sandbox's use, refreshed; q quits.

The edge row's cpu/memory/disk are the *admission budget*: the limits promised to the
sandboxes placed there against what the edge admits (``cpu_capacity`` may exceed the
cores on purpose, see docs/EDGE.md "Admission"), not what they use. What they use is in
the sandbox rows: CPU as a share of one core over the last interval (from
``Sandbox.stats()``), memory, writable-layer bytes and processes, each beside its limit.
"""

from __future__ import annotations

import contextlib
import os
import select
import sys
import time
from collections.abc import Iterator
from typing import Any

from dsec.cli.term import age, human_size, table


class Sampler:
    """Reads the edges and the newest ``rows`` live sandboxes; keeps the last CPU reading of each
    so the next one gives a rate."""

    def __init__(self, client: Any, rows: int) -> None:
        self.c = client
        self.rows = rows
        self._boxes: dict[str, Any] = {}
        self._cpu: dict[str, tuple[float, float]] = {}  # id -> (monotonic time, cpu seconds)
        self.sandboxes: list[dict[str, Any]] = []
        self.more = 0

    def sample(self) -> None:
        live = [i for i in self.c.list() if i.state.value in ("running", "paused", "creating")]
        live.sort(key=lambda i: i.created_at, reverse=True)
        self.more = max(0, len(live) - self.rows)
        now = time.time()
        out: list[dict[str, Any]] = []
        for info in live[: self.rows]:
            row: dict[str, Any] = {"id": info.id, "state": info.state.value, "age": age(now - info.created_at)}
            try:
                sb = self._boxes.get(info.id) or self.c.connect(info.id)
                self._boxes[info.id] = sb
                st = sb.stats()
            except Exception:  # gone meanwhile: the next refresh no longer lists it
                self._boxes.pop(info.id, None)
                continue
            t = time.monotonic()
            prev = self._cpu.get(info.id)
            self._cpu[info.id] = (t, st.cpu_s)
            row["cpu"] = None if prev is None or t <= prev[0] else max(0.0, (st.cpu_s - prev[1]) / (t - prev[0]))
            row["stats"] = st
            out.append(row)
        self.sandboxes = out

    def render(self) -> Any:
        from rich.console import Group

        edges = table("edge", "sandboxes", "cpu budget", "memory budget", "disk budget", "disk used", "host",
                      "pools", title=f"dsec top — {time.strftime('%H:%M:%S')}",
                      caption="budget: the limits admitted on the edge / what it admits (not use); q quits")
        for e in self.c.edges():
            h = e.get("health") or e
            host = h.get("host") or {}
            total, free = host.get("store_total"), host.get("store_free")
            used = f"{human_size(total - free)}/{human_size(total)}" if total and free is not None else "?"
            cores = host.get("cpu_cores")
            util = host.get("cpu_util")
            host_txt = (f"{cores:.0f} cores" if cores else "") + (f", {100 * util:.0f}% busy" if util is not None else "")
            edges.add_row(str(e.get("id", h.get("edge_id"))),
                          f"{h.get('sandboxes', '?')}/{h.get('capacity_sandboxes', '?')}",
                          f"{h.get('cpu_committed', 0):.1f}/{h.get('cpu_capacity', 0):.0f} cores",
                          f"{human_size(h.get('memory_committed', 0))}/{human_size(h.get('memory_capacity', 0))}",
                          f"{human_size(h.get('disk_committed', 0))}/{human_size(h.get('disk_capacity', 0))}",
                          used, host_txt or "?", ", ".join(f"{k}:{v}" for k, v in (h.get("pools") or {}).items()))
        boxes = table("id", "state", "age", "cpu", "memory", "disk", "pids",
                      caption=f"and {self.more} more (--rows)" if self.more else None)
        for r in self.sandboxes:
            st = r["stats"]
            cpu = "-" if r["cpu"] is None else f"{100 * r['cpu']:.0f}%"
            boxes.add_row(r["id"], r["state"], r["age"], f"{cpu} of {st.cpu_limit:g}",
                          f"{human_size(st.memory_bytes)}/{human_size(st.memory_limit)}",
                          f"{human_size(st.disk_bytes)}/{human_size(st.disk_limit)}", f"{st.pids}/{st.pids_limit}")
        return Group(edges, boxes)


@contextlib.contextmanager
def _keys() -> Iterator[bool]:
    """Single keypresses from a terminal on stdin (cbreak, no echo), restored on the way out;
    yields whether there is one."""
    if not sys.stdin.isatty():
        yield False
        return
    import termios
    import tty

    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    try:
        tty.setcbreak(fd)
        yield True
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def _wait_for_q(seconds: float, keys: bool) -> bool:
    """Wait ``seconds``; True when q (or Q, or Ctrl-D) was pressed meanwhile."""
    if not keys:
        time.sleep(seconds)
        return False
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        ready, _, _ = select.select([sys.stdin], [], [], left)
        if ready:
            ch = os.read(sys.stdin.fileno(), 1)
            if ch in (b"q", b"Q", b"", b"\x04"):
                return True
    return False


def run_top(client: Any, *, interval: float, once: bool, rows: int) -> None:
    from rich.console import Console
    from rich.live import Live

    s = Sampler(client, rows)
    out = Console()
    if once:
        s.sample()
        time.sleep(min(interval, 1.0))  # a second reading, for the CPU rates
        s.sample()
        out.print(s.render())
        return
    s.sample()
    with _keys() as keys, Live(s.render(), console=out, refresh_per_second=4) as live:
        try:
            while not _wait_for_q(interval, keys):
                s.sample()
                live.update(s.render())
        except KeyboardInterrupt:
            pass
