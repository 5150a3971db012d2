"""Reconcile after a restart and heal what vanished, for the gVisor backend. A part of
:class:`~dsec.backends.gvisor.backend.GVisorBackend` (a mixin over the :class:`GVisorNode`
protocol)."""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import json
import time
from typing import TYPE_CHECKING, Any, Final

from dsec.backends.base import (
    HostFinding,
)
from dsec.backends.common.names import ID_RE
from dsec.backends.gvisor.records import (
    GVisorRecord,
)
from dsec.errors import (
    HostError,
)
from dsec.spec import ImageRef, SandboxSpec, SandboxState

if TYPE_CHECKING:
    from dsec.backends.gvisor.node import GVisorNode


class GVisorRepair:
    # ----- reconcile after a crash -----

    async def _reconcile(self: GVisorNode) -> dict[str, builtins.list[str]]:
        """Re-adopt sandboxes whose sentry still runs; remove every trace of the others."""
        runsc = self._require_started()
        adopted: list[str] = []
        destroyed: list[str] = []
        containers = set(runsc.container_ids())
        mounted = {m.mount_point for m in await asyncio.to_thread(_mountinfo)}
        for path in self.records.files():
            try:
                rec = GVisorRecord.from_json(json.loads(path.read_text()))
            except (OSError, ValueError, KeyError):
                path.unlink(missing_ok=True)
                continue
            alive = (rec.state in (SandboxState.RUNNING, SandboxState.PAUSED) and rec.container_id in containers
                     and self._sentry_alive(rec) and str(self.rootfs(rec.id)) in mounted)
            if alive and rec.medium == "disk":
                try:
                    await self._setup_uppers()
                except HostError:
                    alive = False
            if alive:
                if self.config.pause_method == "freezer":
                    frozen = self.cgroups.freezer_state(rec.id) == "FROZEN"
                    rec.state = SandboxState.PAUSED if frozen else SandboxState.RUNNING
                rec.oom_baseline = self.cgroups.oom_kills(rec.id)
                self._sandboxes[rec.id] = rec
                self._layers.adopt(rec.id, rec.layers)
                self._watch(rec)
                self.records.event(rec, "adopted")
                self.records.save(rec)
                self.last_activity[rec.id] = time.monotonic()
                adopted.append(rec.id)
                continue
            await self._teardown(rec)
            destroyed.append(rec.id)
        # Anything of this name without a live record: runsc containers, cgroups, bundles, uppers.
        prefix = f"{self.name}-"
        for cid in containers:
            sid = cid[len(prefix):]
            if cid.startswith(prefix) and sid not in self._sandboxes:
                await self._teardown(GVisorRecord(sid, SandboxState.FAILED, _ORPHAN_SPEC, 0.0, container_id=cid))
                destroyed.append(sid)
        orphans = set(self.cgroups.existing()) | {p.name for p in self.bundles_dir.iterdir() if p.is_dir()}
        for sid in sorted(orphans - set(self._sandboxes) - set(destroyed)):
            if ID_RE.match(sid):
                await self._teardown(GVisorRecord(sid, SandboxState.FAILED, _ORPHAN_SPEC, 0.0))
                destroyed.append(sid)
        if self._uppers is not None:
            for sid in set(self._uppers.names()) - set(self._sandboxes):
                with contextlib.suppress(OSError, HostError):
                    await asyncio.to_thread(self._uppers.destroy, sid)
        self._layers.release_unused_pins()
        await asyncio.to_thread(self._mounts.unmount_unused)
        return {"adopted": adopted, "destroyed": destroyed}

    async def heal(self: GVisorNode, *, repair: bool = True) -> builtins.list[HostFinding]:
        """Layer mounts that someone unmounted are mounted again (running sandboxes keep
        theirs: the overlay holds its lowers)."""
        if self._mounts is None:
            return []
        problems, repairs = await asyncio.to_thread(self._mounts.check, repair=repair)
        found = [HostFinding("layer_mount", m, False) for m in problems]
        found += [HostFinding("layer_mount", m, True) for m in repairs]
        self._repairs.extend(f for f in found if f.repaired)
        return found


_ORPHAN_SPEC: Final = SandboxSpec(image=ImageRef(base="orphan:none"), backend="gvisor")
"""The spec of a leftover found by name only (its record is gone): never run, only torn down."""


def _mountinfo() -> builtins.list[Any]:
    from dsec.images import sysmount

    return list(sysmount.mountinfo())


__all__ = ["GVisorRepair"]
