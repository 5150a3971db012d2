"""uid ranges: one per sandbox, claimed host-wide by a file per slot, so that two runtimes
(two edges on one host) never share a range."""

from __future__ import annotations

import contextlib
import itertools
import os
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Final

from dsec.backends.container.records import UID_SLOTS, ContainerRecord
from dsec.errors import HostError

CLAIM_PREFIX: Final = ".claim-"
"""A uid slot's file staged before it is linked into place (``.claim-<pid>-<sandbox id>``)."""


class UidSlots:
    def __init__(self, owner: str, directory: Path) -> None:
        self.owner = owner
        """The runtime's name: written into every slot file it claims."""
        self.directory = directory
        self._free: list[int] = []

    def claim(self, sandbox_id: str) -> int:
        """A free slot, now ``sandbox_id``'s. Recently freed slots first: the spawner keeps
        their user namespaces."""
        start = secrets.randbelow(UID_SLOTS)
        recent = list(reversed(self._free))
        self._free.clear()
        candidates = itertools.chain(recent, ((start + i) % UID_SLOTS for i in range(UID_SLOTS)))
        with self.claiming(sandbox_id) as claim:
            for slot in candidates:
                if claim(slot):
                    return slot
        raise HostError("no free uid range for a new sandbox (60,000 in use)")

    @contextlib.contextmanager
    def claiming(self, sandbox_id: str) -> Iterator[Callable[[int], bool]]:
        """``claim(slot)`` -> whether this runtime took the slot for ``sandbox_id``. A slot file is
        written whole and then linked into place, never created empty and written after: an edge
        killed between the two left an empty file no reconcile could tell the owner of (a uid range
        lost until the host's next boot). The staging file names this process (``.claim-<pid>-``):
        the reconcile removes those of processes that are gone."""
        tmp = self.directory / f"{CLAIM_PREFIX}{os.getpid()}-{sandbox_id}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, f"{self.owner} {sandbox_id}\n".encode())
        finally:
            os.close(fd)

        def claim(slot: int) -> bool:
            try:
                os.link(tmp, self.directory / str(slot))
            except FileExistsError:
                return False
            return True

        try:
            yield claim
        finally:
            tmp.unlink(missing_ok=True)

    def release(self, rec: ContainerRecord) -> None:
        path = self.directory / str(rec.slot)
        with contextlib.suppress(OSError):
            if path.read_text().split() == [self.owner, rec.id]:
                path.unlink()
                self._free.append(rec.slot)
                del self._free[:-1024]


__all__ = ["CLAIM_PREFIX", "UidSlots"]
