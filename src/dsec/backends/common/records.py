"""A backend's sandbox records on disk and their state moves (``spec.TRANSITIONS``).

One JSON file a sandbox under the backend's records directory, written before any host
resource is made, so that a restart finds every sandbox it must re-adopt or clean up.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

from dsec.errors import SandboxStateError
from dsec.spec import SandboxState, can_move

MAX_EVENTS = 1000
"""A record keeps its latest events; beyond this the oldest 100 go."""


class Record(Protocol):
    id: str
    state: SandboxState
    reason: str
    events: list[dict[str, Any]]

    def to_json(self) -> dict[str, Any]: ...


R = TypeVar("R", bound=Record)


class RecordBook(Generic[R]):
    """The records of one backend instance, in ``directory``."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def path(self, sandbox_id: str) -> Path:
        return self.directory / f"{sandbox_id}.json"

    def save(self, rec: R) -> None:
        path = self.path(rec.id)
        data = json.dumps(rec.to_json()).encode()
        try:
            # First write: create it in place (one inode, no rename: file creation is
            # the slow part on a busy ext4 journal). A torn first write reads as
            # unparsable and the reconciler cleans the sandbox up by its host resources.
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except FileExistsError:
            # Rewrite in place with one pwrite, padded with spaces (JSON ignores trailing
            # whitespace) to the old size: no truncation, no rename, so no ext4 journal
            # work (~10 us against ~250 us for temp file + rename, measured in
            # docs/RUNTIME.md), and a process crash leaves either the old or the new
            # record, never a mix (one syscall into the page cache).
            fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
            try:
                old = os.fstat(fd).st_size
                if len(data) < old:
                    data += b" " * (old - len(data))
                os.pwrite(fd, data, 0)
            finally:
                os.close(fd)
            return
        try:
            os.write(fd, data)
        finally:
            os.close(fd)

    def remove(self, sandbox_id: str) -> None:
        self.path(sandbox_id).unlink(missing_ok=True)

    def files(self) -> Iterator[Path]:
        """Every record file, in name order."""
        yield from sorted(self.directory.glob("*.json"))

    @staticmethod
    def event(rec: R, kind: str, **data: Any) -> None:
        """Add to the sandbox's event log."""
        rec.events.append({"t": time.time(), "event": kind, **data})
        if len(rec.events) > MAX_EVENTS:
            del rec.events[:100]

    def move(self, rec: R, dst: SandboxState, *, reason: str = "", save: bool = True) -> None:
        """Move along the transition table (SandboxStateError for a move it does not have),
        log it, and save the record unless ``save`` is False."""
        if not can_move(rec.state, dst):
            raise SandboxStateError(f"sandbox {rec.id} cannot go from {rec.state.value} to {dst.value}",
                                    sandbox_id=rec.id, state=rec.state.value)
        rec.state = dst
        if reason:
            rec.reason = reason
        self.event(rec, "state", state=dst.value, reason=reason)
        if save:
            self.save(rec)

    def mark_failed(self, rec: R, reason: str) -> None:
        """Failed, saying why (nothing if the record cannot fail from where it is)."""
        if can_move(rec.state, SandboxState.FAILED):
            self.move(rec, SandboxState.FAILED, reason=reason)


__all__ = ["MAX_EVENTS", "Record", "RecordBook"]
