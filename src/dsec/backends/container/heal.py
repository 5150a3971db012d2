"""The node's repairs: re-adopting sandboxes after a restart (reconcile) and making again
the host state it stands on when someone else removed it (heal). A part of
:class:`~dsec.backends.container.runtime.ContainerRuntime` (a mixin: these methods are the
node's own, kept apart from its lifecycle and dispatch)."""

from __future__ import annotations

import asyncio
import builtins
import collections
import contextlib
import json
import logging
import os
import time
from typing import TYPE_CHECKING, Protocol

from dsec.backends.base import HostFinding
from dsec.backends.common import claims
from dsec.backends.container import pause as pausing
from dsec.backends.container.node import Node
from dsec.backends.container.procs import pid_alive
from dsec.backends.container.records import ContainerRecord
from dsec.backends.container.sandbox import ContainerSandbox
from dsec.backends.container.skeletons import make_skeletons
from dsec.backends.container.slots import CLAIM_PREFIX, UidSlots
from dsec.errors import HostError
from dsec.spec import NetworkPolicy, SandboxState

if TYPE_CHECKING:
    from pathlib import Path

    from dsec.backends.container.sandbox import RecordView

log = logging.getLogger("dsec.runtime")



class RepairedNode(Node, Protocol):
    """What the repairs use of the node beyond what a sandbox does (the runtime satisfies it)."""

    name: str
    run_dir: Path
    stage_dir: Path
    records_dir: Path
    slots_dir: Path
    skel_dir: Path
    devskel_dir: Path
    empty_dir: Path
    sandboxes: RecordView
    _boxes: dict[str, ContainerSandbox]
    _claims: list[claims.Claim]
    slots: UidSlots
    host_problems: list[HostFinding]
    host_repairs: collections.deque[HostFinding]
    repair_counts: collections.Counter[str]
    _heal_lock: asyncio.Lock
    _problems_logged: set[str]
    _repair_gen: int
    _last_heal_start: float

    async def _teardown(self, rec: ContainerRecord) -> list[str]: ...
    async def _setup_uppers(self) -> HostFinding | None: ...
    # the repairs' own (NodeRepair's methods, seen through the protocol)
    def _note(self, kind: str, message: str, *, repaired: bool) -> HostFinding: ...
    async def heal(self, *, repair: bool = True) -> builtins.list[HostFinding]: ...
    def _check_books(self, repair: bool) -> builtins.list[tuple[str, str, bool]]: ...
    def _check_mounts(self, repair: bool) -> builtins.list[tuple[str, str, bool]]: ...
    def _adopt_freezer(self, rec: ContainerRecord) -> None: ...


class NodeRepair:
    def _init_repairs(self: RepairedNode) -> None:
        """The repairs' own state: ``host_problems`` (what the last :meth:`heal` pass found
        wrong and could not repair; empty: healthy), ``host_repairs`` (the latest repairs,
        oldest first), ``repair_counts`` (repairs since start, by kind)."""
        problems: list[HostFinding] = []
        repairs: collections.deque[HostFinding] = collections.deque(maxlen=32)
        counts: collections.Counter[str] = collections.Counter()
        logged: set[str] = set()
        self.host_problems, self.host_repairs, self.repair_counts = problems, repairs, counts
        self._heal_lock = asyncio.Lock()
        self._problems_logged = logged
        self._repair_gen = 0
        self._last_heal_start = float("-inf")
    # ----- reconcile after a crash -----

    async def _reconcile(self: RepairedNode) -> dict[str, builtins.list[str]]:
        """Re-adopt running sandboxes whose init survived; destroy everything else."""
        adopted: list[str] = []
        destroyed: list[str] = []
        for path in self.records.files():
            try:
                rec = ContainerRecord.from_json(json.loads(path.read_text()))
            except (OSError, ValueError, KeyError):
                path.unlink(missing_ok=True)
                continue
            alive = False
            if rec.state in (SandboxState.RUNNING, SandboxState.PAUSED) and rec.init_pid:
                fd = self.open_init(rec, check=False)
                if fd is not None:
                    os.close(fd)
                    alive = rec.init_pid in self.cgroups.pids(rec.id)
            if alive:
                self._boxes[rec.id] = ContainerSandbox(rec, self)
                if rec.net is not None:
                    pol = rec.net.get("policy")
                    self.net.adopt(rec.id, rec.net, None if pol is None else NetworkPolicy.model_validate(pol))
                self._adopt_freezer(rec)
                self.records.event(rec, "adopted")
                self.last_activity[rec.id] = time.monotonic()
                adopted.append(rec.id)
                continue
            # Half-made, stopping or dead: remove every trace.
            if rec.init_pid:
                fd = self.open_init(rec, check=False)
                if fd is None:
                    rec.init_pid = 0
                else:
                    os.close(fd)
            await self._teardown(rec)
            destroyed.append(rec.id)
        # Cgroups with no record (a crash between mkdir and the record write cannot
        # happen, but a hand-deleted state dir can): kill and remove.
        for orphan in self.cgroups.existing_children() - set(self.sandboxes):
            self.cgroups.kill_all(orphan)
            deadline = time.monotonic() + 5
            while self.cgroups.pids(orphan) and time.monotonic() < deadline:
                await asyncio.sleep(0.005)
            self.cgroups.remove(orphan)
            destroyed.append(orphan)
        # Writable layers on disk that no live sandbox holds (named after the sandbox).
        if self.uppers.ready:
            for name in set(self.uppers.names()) - set(self.sandboxes):
                with contextlib.suppress(OSError):
                    await asyncio.to_thread(self.uppers.destroy, name)
                    destroyed.append(name)
        # uid slots of this runtime that no live sandbox holds, and claims staged by processes gone.
        for slot_file in self.slots_dir.iterdir():
            with contextlib.suppress(OSError, ValueError):
                if slot_file.name.startswith(CLAIM_PREFIX):
                    if not pid_alive(int(slot_file.name[len(CLAIM_PREFIX):].split("-", 1)[0])):
                        slot_file.unlink()
                    continue
                owner = slot_file.read_text().split()
                if owner and owner[0] == self.name and owner[1] not in self.sandboxes:
                    slot_file.unlink()
        for rec in self.sandboxes.values():
            self.layers.shared.adopt(rec.id, rec.layers)
        self.layers.shared.release_unused_pins()
        for digest in self.layers.ephemeral():
            if digest not in self.layers.shared.users:
                self.layers.drop_ephemeral(digest)
        await asyncio.to_thread(self.layers.mounts.unmount_unused)
        return {"adopted": adopted, "destroyed": destroyed}

    # ----- host state: notice what vanished, repair what can be -----

    def _note(self: RepairedNode, kind: str, message: str, *, repaired: bool) -> HostFinding:
        """Record a finding: a repair is logged, counted and kept (``host_repairs``); a problem
        is logged once until it goes away (``host_problems`` holds the last pass's)."""
        found = HostFinding(kind, message, repaired)
        if repaired:
            self.host_repairs.append(found)
            self.repair_counts[kind] += 1
            self._repair_gen += 1
            log.warning("runtime %s: %s", self.name, message)
        elif message not in self._problems_logged:
            self._problems_logged.add(message)
            log.error("runtime %s: %s", self.name, message)
        return found

    def _cgroup_repaired(self: RepairedNode, message: str) -> None:
        self._note("cgroup", message, repaired=True)

    async def _repaired_since(self: RepairedNode, gen: int, t0: float) -> bool:
        """Whether host state was repaired since a create began (``gen``, ``t0``): a heal pass
        runs now unless one started after ``t0`` (a burst of failing creates shares one)."""
        if self._repair_gen == gen and self._last_heal_start < t0:
            await self.heal()
        return self._repair_gen != gen

    async def heal(self: RepairedNode, *, repair: bool = True) -> builtins.list[HostFinding]:
        """Check the host state this runtime stands on and, with ``repair``, make again what
        vanished: its claims (:mod:`claims`), directories (records and uid slots are written
        again), cgroup parents, the /dev skeleton, layer mounts, the writable-layer store's
        mount, the sandbox network's host tables and the spawner. Someone else's cleanup (an
        operator, a script, an older DSec sharing a name) is the usual cause. Returns this
        pass's findings; :attr:`host_problems` keeps what could not be repaired, each saying
        exactly what and where. A few stats, one mountinfo read and two nftables lookups."""
        async with self._heal_lock:
            self._last_heal_start = time.monotonic()
            found = [self._note(k, m, repaired=r) for k, m, r in self._check_books(repair)]
            if self.layers.mounts is not None:
                found += [self._note(k, m, repaired=r)
                          for k, m, r in await asyncio.to_thread(self._check_mounts, repair)]
            if self.uppers.ready and not self.uppers.mounted():
                what = f"the writable-layer store is not mounted at {self.uppers.mountpoint}"
                if not repair:
                    found.append(self._note("uppers", what, repaired=False))
                else:
                    try:
                        made = await self._setup_uppers()
                        found += [made] if made is not None else []
                    except (OSError, HostError) as exc:
                        found.append(self._note("uppers", f"{what} and cannot be mounted again: {exc}",
                                                repaired=False))
            sp = self.spawner
            if sp is not None and not sp.alive:
                what = f"dsec-spawner (pid {sp.pid}) has exited"
                if not repair:
                    found.append(self._note("spawner", what, repaired=False))
                else:
                    try:
                        await self.ensure_spawner(check=True)  # notes the repair
                    except (HostError, OSError) as exc:
                        found.append(self._note("spawner", f"{what} and cannot be started again: {exc}",
                                                repaired=False))
            if self.net.started:
                problems, repairs = await asyncio.to_thread(self.net.check_host, repair=repair)
                found += [self._note("network", m, repaired=False) for m in problems]
                found += [self._note("network", m, repaired=True) for m in repairs]
            self.host_problems = [f for f in found if not f.repaired]
            self._problems_logged &= {f.message for f in self.host_problems}
            return found

    def _check_books(self: RepairedNode, repair: bool) -> builtins.list[tuple[str, str, bool]]:
        """Claims and directories (on the loop: a few stats, unless something is rewritten)."""
        out: list[tuple[str, str, bool]] = []
        for i, c in enumerate(self._claims):
            if c.intact():
                continue
            again = claims.try_claim(c.path, self.name) if repair else None
            if again is not None:
                c.release()
                self._claims[i] = again
                out.append(("claim", f"took the claim {c.path} again (its file had been removed)", True))
            else:
                out.append(("claim", f"the claim file {c.path} was removed"
                            + (f" and {claims.holder(c.path) or 'another process'} holds it now: two runtimes "
                               "may share this name; stop one of them" if repair else ""), False))
        for d in (self.run_dir, self.stage_dir, self.records_dir, self.slots_dir):
            if d.is_dir():
                continue
            if not repair:
                out.append(("directory", f"directory {d} is gone", False))
                continue
            try:
                d.mkdir(parents=True, exist_ok=True)
                note = ""
                if d == self.records_dir:
                    for rec in self.sandboxes.values():
                        if rec.state is not SandboxState.CREATING:
                            self.records.save(rec)
                    note = f"; wrote the records of {len(self.sandboxes)} sandboxes again"
                elif d == self.slots_dir:
                    lost = []
                    for rec in self.sandboxes.values():
                        with self.slots.claiming(rec.id) as claim:
                            if not claim(rec.slot):
                                lost.append(rec.id)
                    note = f"; claimed the uid ranges of {len(self.sandboxes) - len(lost)} sandboxes again"
                    if lost:
                        out.append(("directory", f"uid ranges of {', '.join(lost[:5])} were claimed by another runtime "
                                    "while their slot files were gone: destroy those sandboxes", False))
                out.append(("directory", f"re-made directory {d} (it had been removed){note}", True))
            except OSError as exc:
                out.append(("directory", f"directory {d} is gone and cannot be made again: {exc}", False))
        return out

    def _check_mounts(self: RepairedNode, repair: bool) -> builtins.list[tuple[str, str, bool]]:
        """Cgroup parents, the /dev skeleton, layer mounts (in a thread)."""
        from dsec.images import sysmount

        out: list[tuple[str, str, bool]] = []
        missing = self.cgroups.missing_parents()
        if missing and repair:
            try:
                self.cgroups.repair_parents(notify=False)
                out += [("cgroup", f"re-made cgroup directory {p} (it had been removed)", True) for p in missing]
            except (OSError, HostError) as exc:
                out.append(("cgroup", f"cgroup directories {', '.join(map(str, missing))} are gone and cannot be "
                            f"made again: {exc}", False))
        elif missing:
            out.append(("cgroup", f"cgroup directories {', '.join(map(str, missing))} are gone", False))
        mounted = {m.mount_point for m in sysmount.mountinfo()}
        if str(self.skel_dir) not in mounted or not self.devskel_dir.is_dir() or not self.empty_dir.is_dir():
            what = f"the /dev skeleton at {self.skel_dir} is gone"
            if repair:
                try:
                    make_skeletons(self.skel_dir)
                    out.append(("skeleton", f"re-made the /dev skeleton at {self.skel_dir} (it had been removed)", True))
                except OSError as exc:
                    out.append(("skeleton", f"{what} and cannot be made again: {exc}", False))
            else:
                out.append(("skeleton", what, False))
        problems, repairs = self.layers.mounts.check(repair=repair)
        out += [("layer_mount", m, False) for m in problems] + [("layer_mount", m, True) for m in repairs]
        return out

    def _adopt_freezer(self: RepairedNode, rec: ContainerRecord) -> None:
        """After a restart the kernel's freezer state is the truth about pausedness: pause and
        resume write no record (a rename on a busy disk costs ms, too much for a group pause)."""
        frozen = pausing.freezer_state(self.cgroups, rec.id) in ("FROZEN", "FREEZING")
        if rec.state is SandboxState.PAUSED and not frozen:
            self.records.move(rec, SandboxState.RUNNING, save=False)
        elif rec.state is SandboxState.RUNNING and frozen:
            self.records.move(rec, SandboxState.PAUSED, save=False)  # paused (or frozen by a snapshot cut short)


__all__ = ["NodeRepair", "RepairedNode"]
