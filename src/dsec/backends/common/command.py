"""A command as every backend on this host checks it before starting it: who it runs as,
its environment, its argv and working directory. Pure: no I/O.

Sandboxes have their own uids: ``0 .. UID_RANGE - 1`` inside, whatever they map to on the
host. Users are given by number (``1000``, ``"1000:1000"``) or as ``"root"``; names are not
looked up (that would mean reading the sandbox's /etc/passwd on the host).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Final

from dsec.errors import InvalidSpec

UID_RANGE: Final = 65536
"""uids and gids a sandbox has (its user namespace maps this many)."""
DEFAULT_ENV: Final = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/root",
    "LANG": "C.UTF-8",
    "TERM": "dumb",
}
"""Every command's environment before the spec's and the call's own."""


def user_ids(user: int | str) -> tuple[int, int]:
    """(uid, gid) inside the sandbox of ``user``: a number, ``"uid[:gid]"`` or ``"root"``."""
    if isinstance(user, int):
        uid = gid = user
    elif user == "root":
        uid = gid = 0
    elif re.fullmatch(r"\d+(:\d+)?", user):
        a, _, b = user.partition(":")
        uid, gid = int(a), int(b or a)
    else:
        raise InvalidSpec(f"user {user!r}: give a numeric uid, 'uid:gid' or 'root' (names are not looked up)",
                          field="user")
    if not (0 <= uid < UID_RANGE and 0 <= gid < UID_RANGE):
        raise InvalidSpec(f"uid/gid must be within 0..{UID_RANGE - 1}", field="user")
    return uid, gid


def check_argv(sandbox_id: str, argv: Sequence[str], cwd: str) -> None:
    """InvalidSpec for an empty command or a relative working directory."""
    if not argv or not argv[0]:
        raise InvalidSpec("empty command", field="cmd", sandbox_id=sandbox_id)
    if not cwd.startswith("/"):
        raise InvalidSpec(f"cwd {cwd!r} must be an absolute path", field="cwd")


def command_env(spec_env: Mapping[str, str], env: Mapping[str, str] | None) -> dict[str, str]:
    """:data:`DEFAULT_ENV`, then the sandbox spec's, then the call's own; InvalidSpec for a
    name that is empty or holds ``=`` or NUL, or a value that holds NUL."""
    merged = {**DEFAULT_ENV, **spec_env, **(env or {})}
    for k, v in merged.items():
        if not k or "=" in k or "\0" in k or "\0" in v:
            raise InvalidSpec(f"bad environment variable {k!r}", field="env")
    return merged
