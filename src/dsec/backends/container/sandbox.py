"""One container sandbox's live state in the runtime, beside its saved record.

The runtime keeps one :class:`LiveSandbox` per sandbox (``ContainerRuntime._boxes``)
instead of a dict per concern: its lock, open sessions, the stage switch in
progress, starts in flight, the pack/wake handshake of a snapshot, and the
limit counters already turned into events. Sessions, snapshots and pause talk
to it through the narrow methods here, never through the runtime's private
members. Everything here is in memory: the record (``rec``) is what survives a
restart.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dsec.backends.container.runtime import ContainerRecord
    from dsec.backends.container.sessions import Session


@dataclass(slots=True, eq=False)
class LiveSandbox:
    rec: ContainerRecord
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    """Held by create, destroy, pause/resume and a snapshot's pack: one of them at a time."""
    sessions: dict[str, Session] = field(default_factory=dict)
    limits_seen: list[int] = field(default_factory=lambda: [0, 0])
    """OOM kills and pids-limit hits already turned into events (the counters are cumulative)."""
    disk_commit: float | None = None
    """The activity stamp at which a full-looking disk was last committed and looked at again."""
    wake_gen: int = 0
    """Bumped by every wake: a pause that started before a wake does not reclaim after it."""
    stage_gate: asyncio.Event | None = None
    """Set while a stage switch kills the old stage's processes: new starts wait for it."""
    spawning: int = 0
    """Starts sent to the spawner whose child may not be in the cgroup yet."""
    packing: bool = False
    thaw_after_pack: bool = False

    # -- sessions --

    def add_session(self, sess: Session) -> None:
        self.sessions[sess.id] = sess

    def drop_session(self, session_id: str) -> Session | None:
        return self.sessions.pop(session_id, None)

    def take_sessions(self) -> list[Session]:
        """Every open session, now forgotten here (the caller closes them)."""
        out = list(self.sessions.values())
        self.sessions.clear()
        return out

    # -- starts and stage switches --

    @contextlib.contextmanager
    def starting(self) -> Iterator[None]:
        """Around a start sent to the spawner (a stage switch waits for these)."""
        self.spawning += 1
        try:
            yield
        finally:
            self.spawning -= 1

    async def wait_for_stage_switch(self) -> None:
        gate = self.stage_gate
        if gate is not None:
            await gate.wait()

    async def begin_stage_switch(self) -> asyncio.Event:
        """One switch at a time: waits for another in progress, then holds the gate."""
        while (busy := self.stage_gate) is not None:
            await busy.wait()
        gate = self.stage_gate = asyncio.Event()
        return gate

    def end_stage_switch(self, gate: asyncio.Event) -> None:
        if self.stage_gate is gate:
            self.stage_gate = None
        gate.set()

    # -- snapshots and wakes --

    def begin_pack(self) -> None:
        """A snapshot froze the sandbox to copy its writable layer: wakes wait for the end."""
        self.packing = True
        self.thaw_after_pack = False

    def end_pack(self) -> bool:
        """The copy is done; True if a request asked to wake the sandbox meanwhile."""
        self.packing = False
        woken, self.thaw_after_pack = self.thaw_after_pack, False
        return woken

    def wake_requested(self) -> bool:
        """A request wants the sandbox running: True if a pack holds it (it thaws at the end)."""
        self.wake_gen += 1
        if self.packing:
            self.thaw_after_pack = True
            return True
        return False


class RecordView(Mapping[str, "ContainerRecord"]):
    """``ContainerRuntime.sandboxes``: the records of the live sandboxes, read-only."""

    __slots__ = ("_boxes",)

    def __init__(self, boxes: dict[str, LiveSandbox]) -> None:
        self._boxes = boxes

    def __getitem__(self, sandbox_id: str) -> ContainerRecord:
        return self._boxes[sandbox_id].rec

    def get(self, sandbox_id: str, default: ContainerRecord | None = None) -> ContainerRecord | None:  # type: ignore[override]
        box = self._boxes.get(sandbox_id)
        return default if box is None else box.rec

    def __contains__(self, sandbox_id: object) -> bool:
        return sandbox_id in self._boxes

    def __iter__(self) -> Iterator[str]:
        return iter(self._boxes)

    def __len__(self) -> int:
        return len(self._boxes)

    def values(self) -> list[ContainerRecord]:  # type: ignore[override]
        return [b.rec for b in self._boxes.values()]
