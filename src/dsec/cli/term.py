"""The CLI's terminal output: rich consoles made on first use, and plain one-line messages.

Importing rich costs ~40 ms; ``dsec exec`` and ``dsec cp`` print no tables and must
not pay it. Messages a person reads on stderr (errors, limit notices) are one plain
line each, never wrapped at the terminal's width: a script can match them.
"""

from __future__ import annotations

import sys
from typing import Any


class _LazyConsole:
    """A ``rich.console.Console`` made at its first use."""

    def __init__(self, **kw: Any) -> None:
        self._kw = kw
        self._console: Any = None

    def get(self) -> Any:
        """The console itself (what rich's own classes take: ``Progress(console=console.get())``)."""
        if self._console is None:
            from rich.console import Console

            self._console = Console(**self._kw)
        return self._console

    def __getattr__(self, name: str) -> Any:
        return getattr(self.get(), name)


console: Any = _LazyConsole(stderr=True)
"""Progress and tables for a person, on stderr."""
out: Any = _LazyConsole()
"""Tables and JSON on stdout."""


def table(*columns: str, **kw: Any) -> Any:
    """A ``rich.table.Table`` with these columns."""
    from rich.table import Table

    t = Table(**kw)
    for c in columns:
        t.add_column(c)
    return t


def say(message: str) -> None:
    """One plain line on stderr (newlines in ``message`` become spaces), after stdout's pending bytes."""
    sys.stdout.flush()
    sys.stderr.write(" ".join(message.splitlines()) + "\n")
    sys.stderr.flush()


def human_size(n: float) -> str:
    """Bytes as a person writes them on the command line: 16M, 1.5G, 512K, 100 (powers of 1024)."""
    for unit, size in (("T", 1 << 40), ("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= size:
            v = n / size
            return f"{v:.0f}{unit}" if v == int(v) else f"{v:.1f}{unit}"
    return f"{n:.0f}"


def age(seconds: float) -> str:
    """A duration as `dsec ls` shows it: 45s, 12m, 3h, 2d."""
    s = int(max(seconds, 0))
    return f"{s}s" if s < 120 else f"{s // 60}m" if s < 7200 else f"{s // 3600}h" if s < 172800 else f"{s // 86400}d"


STDIN_FILE_MAX = 8 << 20
"""A regular file on stdin up to this size goes with the request (the lean path); larger
ones are streamed."""


def stdin_source() -> str:
    """What ``dsec exec`` forwards from its stdin: ``"file"`` (a non-empty regular file of
    at most :data:`STDIN_FILE_MAX`: sent with the request), ``"pipe"`` (a pipe or socket
    with data or EOF ready now, or a larger file: streamed), ``"none"`` (a terminal,
    /dev/null, or a pipe nothing was written to yet — an agent harness's inherited stdin;
    ``-i`` streams it anyway). (Here, not in cli/interactive.py: `dsec exec` asks it every
    time, and importing the interactive path costs asyncio.)"""
    import os
    import select
    import stat

    try:
        fd = sys.stdin.fileno()
        st = os.fstat(fd)
    except (OSError, ValueError):
        return "none"
    if stat.S_ISREG(st.st_mode):
        if st.st_size <= 0:
            return "none"
        return "file" if st.st_size <= STDIN_FILE_MAX else "pipe"
    if stat.S_ISFIFO(st.st_mode) or stat.S_ISSOCK(st.st_mode):
        ready, _, _ = select.select([fd], [], [], 0)
        return "pipe" if ready else "none"
    return "none"
