"""mount(2)/umount2(2) through ctypes, and /proc/self/mountinfo parsing.

The only kernel-touching code of the image subsystem. mount(2) is called
directly, never util-linux ``mount``: given an image *file* as the source,
the kernel mounts EROFS in file-backed mode, while ``mount -t erofs`` would
attach a loop device first.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import re
from dataclasses import dataclass

MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MNT_DETACH = 0x2

_libc: ctypes.CDLL | None = None


def _lib() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        lib.mount.argtypes = [
            ctypes.c_char_p,
            ctypes.c_char_p,
            ctypes.c_char_p,
            ctypes.c_ulong,
            ctypes.c_void_p,
        ]
        lib.mount.restype = ctypes.c_int
        lib.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
        lib.umount2.restype = ctypes.c_int
        _libc = lib
    return _libc


def mount(source: str, target: str, fstype: str, flags: int, data: str | None = None) -> None:
    """mount(2); raises OSError with the kernel's errno."""
    rc = _lib().mount(
        os.fsencode(source),
        os.fsencode(target),
        fstype.encode(),
        flags,
        ctypes.c_char_p(data.encode()) if data is not None else None,
    )
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), target)


def umount(target: str, flags: int = 0) -> None:
    """umount2(2); raises OSError with the kernel's errno."""
    if _lib().umount2(os.fsencode(target), flags) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), target)


@dataclass(frozen=True)
class MountEntry:
    """One line of /proc/<pid>/mountinfo."""

    mount_id: int
    parent_id: int
    root: str
    mount_point: str
    options: str
    fstype: str
    source: str
    super_options: str


_ESCAPE = re.compile(r"\\([0-7]{3})")


def _unescape(field: str) -> str:
    # The kernel octal-escapes space, tab, newline and backslash in paths.
    return _ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), field)


def parse_mountinfo(text: str) -> list[MountEntry]:
    out: list[MountEntry] = []
    for line in text.splitlines():
        fields = line.split(" ")
        try:
            sep = fields.index("-", 6)
        except ValueError:
            continue
        out.append(
            MountEntry(
                mount_id=int(fields[0]),
                parent_id=int(fields[1]),
                root=_unescape(fields[3]),
                mount_point=_unescape(fields[4]),
                options=fields[5],
                fstype=fields[sep + 1],
                source=_unescape(fields[sep + 2]),
                super_options=fields[sep + 3] if len(fields) > sep + 3 else "",
            )
        )
    return out


def mountinfo(pid: int | str = "self") -> list[MountEntry]:
    with open(f"/proc/{pid}/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
        return parse_mountinfo(f.read())


__all__ = [
    "MNT_DETACH",
    "MS_NODEV",
    "MS_NOSUID",
    "MS_RDONLY",
    "MountEntry",
    "mount",
    "mountinfo",
    "parse_mountinfo",
    "umount",
]
