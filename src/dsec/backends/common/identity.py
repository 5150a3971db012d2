"""A sandbox's own ``/etc/hostname`` and ``/etc/hosts``, the same in every backend.

Docker gives each container both, whatever its image holds: the container's name in
``/etc/hostname``, and an ``/etc/hosts`` where ``localhost`` and that name resolve. A
sandbox gets the same, written into its writable layer (its upper) when it is made, before
the overlay is mounted over it: an image without them (a debootstrap minbase has no
``/etc/hosts``; a layer built from a bare directory has no ``/etc`` at all) still resolves
``localhost``, and an image whose files name the machine it was built on does not hand that
name out. They are the sandbox's files: its root may edit them; a snapshot keeps them, and a
sandbox made from the snapshot (a fork's child too) writes its own again.

The container backend writes them in its spawner (``native/mounts.c``, ``write_identity``:
no Python on its create path); the gVisor backend with :func:`write_identity`.
``tests/conformance/test_identity.py`` holds every backend to :func:`hosts_text` and
:func:`hostname_text`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Final

from dsec.images.debootstrap import NEUTRAL_HOSTS

LOOPBACK_HOSTS: Final = NEUTRAL_HOSTS
"""The lines every sandbox's ``/etc/hosts`` starts with (Docker's, and what image builders
write): ``localhost`` on 127.0.0.1 and ::1, and the IPv6 multicast names."""
HOSTNAME_ADDRESS: Final = "127.0.1.1"
"""Where a sandbox's own name resolves (Debian's convention for a machine's name without a
fixed address; a sandbox's network, when it has one, is the host's business)."""


def hostname_text(hostname: str) -> str:
    return f"{hostname}\n"


def hosts_text(hostname: str) -> str:
    return f"{LOOPBACK_HOSTS}{HOSTNAME_ADDRESS}\t{hostname}\n"


def write_identity(upper: Path, hostname: str, uid: int) -> None:
    """Write ``etc/hostname`` and ``etc/hosts`` into ``upper``, a new (empty) upper directory,
    owned by ``uid`` (the sandbox's root as the host sees it). Follows no symlink; raises
    FileExistsError if ``upper`` holds either already."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    top = os.open(upper, flags)
    try:
        os.mkdir("etc", 0o755, dir_fd=top)
        os.chown("etc", uid, uid, dir_fd=top, follow_symlinks=False)
        etc = os.open("etc", flags, dir_fd=top)
    finally:
        os.close(top)
    try:
        for name, text in (("hostname", hostname_text(hostname)), ("hosts", hosts_text(hostname))):
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644,
                         dir_fd=etc)
            try:
                os.write(fd, text.encode())
                os.fchown(fd, uid, uid)
            finally:
                os.close(fd)
    finally:
        os.close(etc)


__all__ = ["HOSTNAME_ADDRESS", "LOOPBACK_HOSTS", "hostname_text", "hosts_text", "write_identity"]
