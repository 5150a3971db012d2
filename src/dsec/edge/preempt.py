"""Sandboxes this edge paused for the control plane's scheduler (preemption).

A preemption pause is a pause whose memory the edge stops counting: the sandbox is
frozen and its memory pushed to swap, and admission gives its cpu and memory back to
the budgets (``Admission.suspend``) so a more urgent sandbox fits in its place. It keeps
its slot and its disk. Such a sandbox must not wake up by itself — any request used to
resume a paused sandbox, and that would overcommit the node — so the backends' wake
asks :meth:`Preempted.gate` first, which refuses with ``SandboxPreempted``; only an
explicit resume (the control plane's, once the scheduler found it room) takes the cpu
and memory back (``Admission.unsuspend``, refused when they no longer fit).

Owns the set of such sandboxes and its file (``<state_dir>/preempted-<runtime>.json``),
so an edge restart keeps them suspended. Never pauses, resumes or destroys anything
itself: :class:`dsec.edge.service.EdgeService` does.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from pathlib import Path

from dsec.errors import SandboxPreempted

log = logging.getLogger("dsec.edge.preempt")

EVICTED_REASON = "preempted"
"""Tombstone reason of a sandbox the scheduler destroyed: data-path calls get ``SandboxEvicted``."""


class Preempted:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.by_id: dict[str, dict[str, float | int | str]] = {}
        """sandbox id -> {"at": when, "by_priority": ...}"""
        try:
            data = json.loads(path.read_text())
            self.by_id = {str(k): dict(v) for k, v in (data.get("sandboxes") or {}).items()}
        except FileNotFoundError:
            pass
        except (OSError, ValueError, AttributeError, TypeError) as exc:
            log.warning("preemption file %s unreadable (%s): no sandbox is held as preempted", path, exc)

    def __contains__(self, sandbox_id: object) -> bool:
        return sandbox_id in self.by_id

    def add(self, sandbox_id: str, *, at: float, by_priority: int | None, reason: str) -> None:
        self.by_id[sandbox_id] = {"at": at, "by_priority": by_priority if by_priority is not None else -1,
                                  "reason": reason}
        self._save()

    def discard(self, sandbox_id: str) -> bool:
        if self.by_id.pop(sandbox_id, None) is None:
            return False
        self._save()
        return True

    def keep_only(self, live: Iterable[str]) -> None:
        """Forget sandboxes that are gone (at start, after the backends re-adopted theirs)."""
        alive = set(live)
        gone = [sid for sid in self.by_id if sid not in alive]
        for sid in gone:
            del self.by_id[sid]
        if gone:
            self._save()

    def gate(self, sandbox_id: str) -> None:
        """Called by a backend before it wakes a paused sandbox: a preempted one stays paused."""
        info = self.by_id.get(sandbox_id)
        if info is None:
            return
        by = info.get("by_priority")
        raise SandboxPreempted(
            f"sandbox {sandbox_id} was paused to make room for more urgent work (priority {by}); resume it "
            "through the control plane (sb.resume(), `dsec resume`), which brings it back when its edge has room",
            sandbox_id=sandbox_id, by_priority=by,
        )

    def _save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        with open(tmp, "w") as f:
            json.dump({"sandboxes": self.by_id}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
