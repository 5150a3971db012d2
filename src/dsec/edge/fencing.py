"""The edge's fencing epoch: the control plane's word on what this edge may still hold.

When the control plane loses an edge (unreachable past its bound), it declares
the edge's sandboxes lost, returns their quota and raises the edge's epoch.
If the edge comes back, it must not let those sandboxes run on as if nothing
happened: a ``POST /v1/fence {"epoch": E}`` (from the watcher, or from the
answer to its own heartbeat) makes it destroy every sandbox it made for the
control plane before epoch E. Each sandbox records the epoch it was made in
(``EdgeMeta.epoch``), and the epoch only ever goes up, so a fence is
idempotent and a late or replayed one never touches what was made after it.

Owns the epoch and its file (``<state_dir>/fence-<runtime>.json``, written
before anything is destroyed, so a crash mid-fence finishes at the next start).
Never destroys anything itself: :class:`dsec.edge.service.EdgeService` does.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

log = logging.getLogger("dsec.edge.fencing")

LOST_REASON = "lost"
"""Tombstone reason of a sandbox destroyed by a fence: data-path calls on it get ``SandboxLost``."""


class FenceEpoch:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.epoch = 0
        try:
            self.epoch = int(json.loads(path.read_text()).get("epoch", 0))
        except FileNotFoundError:
            pass
        except (OSError, ValueError, AttributeError) as exc:
            log.warning("fence file %s unreadable (%s): starting at epoch 0", path, exc)

    def raise_to(self, epoch: int) -> bool:
        """Move to ``epoch`` if it is higher (durably, before any sandbox is destroyed)."""
        if epoch <= self.epoch:
            return False
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        with open(tmp, "w") as f:
            json.dump({"epoch": epoch}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        log.warning("fencing epoch %d -> %d", self.epoch, epoch)
        self.epoch = epoch
        return True


def fenced_out(epoch_of_sandbox: int | None, project: str | None, pooled: bool, fence: int) -> bool:
    """A sandbox the control plane made before the fence (warm-pool members and sandboxes made
    directly on the edge, without a project, are not the control plane's to fence)."""
    return project is not None and not pooled and (epoch_of_sandbox or 0) < fence
