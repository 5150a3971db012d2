"""A sandbox's host parts as the node makes and removes them: cgroups, the writable layer
on disk, and the teardown that kills its processes and gives everything back; the node's
writable-layer store and swap. A part of
:class:`~dsec.backends.container.runtime.ContainerRuntime` (a mixin over the
:class:`HostedNode` protocol)."""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import os
import signal
import time
from pathlib import Path
from typing import Any, Protocol

from dsec.backends.base import HostFinding
from dsec.backends.common import cgroupfs
from dsec.backends.common.fdio import set_done as _set_done
from dsec.backends.common.zram import ZramStats, ZramSwap
from dsec.backends.container import pause as pausing
from dsec.backends.container.node import Node
from dsec.backends.container.records import ContainerRecord
from dsec.backends.container.sandbox import RecordView, open_netns
from dsec.backends.container.slots import UidSlots
from dsec.errors import HostError
from dsec.spec import SandboxState


class HostedNode(Node, Protocol):
    """What the host parts use of the node beyond what a sandbox does."""

    sandboxes: RecordView
    slots: UidSlots
    swap: ZramSwap
    _uppers_lock: asyncio.Lock

    def _note(self, kind: str, message: str, *, repaired: bool) -> HostFinding: ...
    async def _kill_init(self, rec: ContainerRecord) -> None: ...
    def _remove_host_parts(self, rec: ContainerRecord) -> builtins.list[str]: ...
    def _make_cgroups(self, sandbox_id: str, res: Any) -> builtins.list[Path]: ...


class NodeHostParts:
    async def _teardown(self: HostedNode, rec: ContainerRecord) -> list[str]:
        """Kill, unmount (the mount namespace dies with its last process), remove cgroups,
        release layers, uid range and record. Safe to call on a half-made sandbox."""
        sid = rec.id
        # A networked sandbox's namespace outlives it when we hold an fd: it is reset and
        # goes back to the pool (no veth to make, no namespace teardown: both are slow).
        keep_netns = open_netns(self, rec, check=False) if rec.net is not None and rec.init_pid else None
        if rec.state is SandboxState.PAUSED or pausing.freezer_state(self.cgroups, sid) not in ("THAWED", ""):
            self.cgroups.kill_all(sid)  # frozen: kill, then thaw, or the init never exits
        if rec.init_pid:
            await self._kill_init(rec)
        if self.cgroups.pids(sid):
            self.cgroups.kill_all(sid)
            deadline = time.monotonic() + 5
            while self.cgroups.pids(sid) and time.monotonic() < deadline:
                await asyncio.sleep(0.002)
        left = await asyncio.to_thread(self._remove_host_parts, rec)
        for d in set(rec.layers):
            self.layers.shared.unuse(d, sid)
        if rec.slot >= 0:
            self.slots.release(rec)
        if keep_netns is not None and not self.cgroups.pids(sid):
            self.net.recycle(sid, keep_netns)  # takes the fd
        elif keep_netns is not None:
            os.close(keep_netns)
        if rec.net is not None or sid in self.net.sandboxes:
            self.net.forget(sid)  # the namespace and its veth die with the last process
        if not left:
            self.records.remove(sid)
        return left


    async def _kill_init(self: HostedNode, rec: ContainerRecord) -> None:
        fd = self.open_init(rec, check=False)
        if fd is None:
            return
        try:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(fd, signal.SIGKILL)
            # A pidfd polls readable once the process has exited (after its namespace is emptied).
            loop = asyncio.get_running_loop()
            done: asyncio.Future[None] = loop.create_future()
            loop.add_reader(fd, _set_done, done)
            try:
                await asyncio.wait_for(done, 10)
            except TimeoutError:
                pass
            finally:
                loop.remove_reader(fd)
            if done.done():
                # The init is this process's child (the spawner clones it with CLONE_PARENT);
                # one adopted from an earlier runtime process is not, and is reaped by init.
                with contextlib.suppress(ChildProcessError, OSError):
                    os.waitid(os.P_PIDFD, fd, os.WEXITED | os.WNOHANG)
        finally:
            os.close(fd)
        if self.spawner is not None:
            self.spawner.forget_exit(rec.init_pid)


    async def _setup_uppers(self: HostedNode) -> HostFinding | None:
        """Set up the writable-layer store, or mount it again when someone unmounted it (the
        repair is returned). One at a time: a create and a heal pass may both find it gone."""
        async with self._uppers_lock:
            if not self.uppers.ready:
                await asyncio.to_thread(self.uppers.setup)
            elif not self.uppers.mounted():
                await asyncio.to_thread(self.uppers.remount)
                return self._note("uppers", f"re-mounted the writable-layer store at {self.uppers.mountpoint} "
                                  "(it had been unmounted)", repaired=True)
        return None


    def _make_host_parts(self: HostedNode, sandbox_id: str, res: Any, uid_base: int) -> tuple[builtins.list[Path], Path | None]:
        """The sandbox's cgroups and, on the disk medium, its writable layer (one thread hop)."""
        dirs = self._make_cgroups(sandbox_id, res)
        if res.disk_medium != "disk":
            return dirs, None
        return dirs, self.uppers.create(sandbox_id, quota=res.disk, uid=uid_base)


    def _remove_host_parts(self: HostedNode, rec: ContainerRecord) -> builtins.list[str]:
        """Remove the sandbox's cgroups and writable layer (one thread hop); what could not go."""
        left = [str(p) for p in self.cgroups.remove(rec.id)]
        # A memory-medium sandbox has no subvolume (a crash's leftover is the reconciler's).
        if self.uppers.ready and rec.spec.resources.disk_medium == "disk":
            try:
                self.uppers.destroy(rec.id)
            except OSError as exc:
                left.append(f"writable layer {self.uppers.path(rec.id)} ({exc})")
        return left


    def _make_cgroups(self: HostedNode, sandbox_id: str, res: Any) -> builtins.list[Path]:
        dirs = self.cgroups.create(sandbox_id, res)
        # With swap on the host, a memory limit alone would let a sandbox grow into swap
        # past it; memory+swap = the limit keeps it hard. Pausing moves pages from memory
        # to swap, which leaves memory+swap unchanged, so pause is not limited by it.
        memsw = self.cgroups.parents["memory"] / sandbox_id / "memory.memsw.limit_in_bytes"
        with contextlib.suppress(OSError):
            cgroupfs.write(memsw, str(res.memory))
        return dirs


    async def _setup_swap(self: HostedNode) -> None:
        if self.swap.size > 0:
            await asyncio.to_thread(self.swap.ensure)
            return
        # Not asked for: a device left by an earlier run goes, unless paused sandboxes use it.
        if self.swap.find() is not None and not any(r.state is SandboxState.PAUSED for r in self.sandboxes.values()):
            with contextlib.suppress(HostError):
                await asyncio.to_thread(self.swap.teardown)


    def swap_stats(self: HostedNode) -> ZramStats | None:
        """The zram device's figures (None without one)."""
        return self.swap.stats()


__all__ = ["HostedNode", "NodeHostParts"]
