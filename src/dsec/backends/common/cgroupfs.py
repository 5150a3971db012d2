"""cgroup control files (v1), read and written the way the kernel wants them.

A write is one ``write(2)`` of the whole value on a file opened without a Python file
object: the kernel parses each write on its own, so buffering that splits or joins
values would change what it reads. Errors (EINVAL, EBUSY, ENOENT of a removed group)
reach the caller. Blocking but small: callers that must not block run it in a thread.
"""

from __future__ import annotations

import os
from pathlib import Path


def read(path: Path) -> str:
    """A control file's whole text."""
    with open(path) as f:
        return f.read()


def write(path: Path, value: str) -> None:
    """Write ``value`` to a control file in one ``write(2)``."""
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)
