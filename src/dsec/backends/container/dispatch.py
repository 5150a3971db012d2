"""The Backend protocol's per-sandbox operations of the container backend, each handed to
the sandbox object (:class:`~dsec.backends.container.sandbox.ContainerSandbox`): the node
looks the sandbox up, the sandbox does the work. A part of
:class:`~dsec.backends.container.runtime.ContainerRuntime` (a mixin)."""

from __future__ import annotations

import builtins
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from dsec.backends.base import DiskRoom, EdgeMeta, NetworkFacts, SandboxRecord, Usage
from dsec.backends.common.fsops import SandboxFiles
from dsec.backends.common.sessions import Session
from dsec.backends.common.uppers import UpperUsage
from dsec.backends.container.procs import Process
from dsec.backends.container.records import ContainerRecord
from dsec.backends.container.sandbox import ContainerSandbox, PauseResult
from dsec.spec import NetworkPolicy, SandboxSpec
from dsec.spec.results import ExecResult


class DispatchNode(Protocol):
    _boxes: dict[str, ContainerSandbox]

    def live(self, sandbox_id: str) -> ContainerSandbox: ...


class SandboxDispatch:
    async def exec(self: DispatchNode, sandbox_id: str, cmd: Sequence[str] | str, **kw: Any) -> ExecResult:
        """:meth:`ContainerSandbox.exec`."""
        return await self.live(sandbox_id).exec(cmd, **kw)

    async def start_process(self: DispatchNode, sandbox_id: str, argv: Sequence[str], **kw: Any) -> Process:
        """:meth:`ContainerSandbox.start_process`."""
        return await self.live(sandbox_id).start_process(argv, **kw)

    async def start_tty(self: DispatchNode, sandbox_id: str, argv: Sequence[str], **kw: Any) -> tuple[Process, int]:
        """:meth:`ContainerSandbox.start_tty`."""
        return await self.live(sandbox_id).start_tty(argv, **kw)

    def files(self: DispatchNode, sandbox_id: str, *, platform: bool = False) -> SandboxFiles:
        """:meth:`ContainerSandbox.files`."""
        return self.live(sandbox_id).files(platform=platform)

    async def set_policy(self: DispatchNode, sandbox_id: str, policy: NetworkPolicy | None) -> ContainerRecord:
        """:meth:`ContainerSandbox.set_policy`."""
        return await self.live(sandbox_id).set_policy(policy)

    def network_info(self: DispatchNode, sandbox_id: str) -> NetworkFacts | None:
        return self.live(sandbox_id).network_info()

    def current_stage(self: DispatchNode, sandbox_id: str) -> str | None:
        return self.live(sandbox_id).current_stage()

    async def set_stage(self: DispatchNode, sandbox_id: str, name: str) -> ContainerRecord:
        """:meth:`ContainerSandbox.set_stage`."""
        return await self.live(sandbox_id).set_stage(name)

    async def pause(self: DispatchNode, sandbox_id: str, *, reclaim: bool = True) -> PauseResult:
        """:meth:`ContainerSandbox.pause`."""
        return await self.live(sandbox_id).pause(reclaim=reclaim)

    async def resume(self: DispatchNode, sandbox_id: str) -> ContainerRecord:
        return await self.live(sandbox_id).resume()

    def wake(self: DispatchNode, sandbox_id: str) -> bool:
        """:meth:`ContainerSandbox.wake`; False for a sandbox that is gone."""
        box = self._boxes.get(sandbox_id)
        return False if box is None else box.wake()

    def update(self: DispatchNode, sandbox_id: str, *, spec: SandboxSpec | None = None, edge: EdgeMeta | None = None) -> ContainerRecord:
        return self.live(sandbox_id).update(spec=spec, edge=edge)

    def stats(self: DispatchNode, sandbox_id: str) -> dict[str, Any]:
        return self.live(sandbox_id).stats()

    def usage(self: DispatchNode, sandbox_id: str) -> Usage:
        return self.live(sandbox_id).usage()

    def disk_usage(self: DispatchNode, sandbox_id: str) -> UpperUsage:
        return self.live(sandbox_id).disk_usage()

    def disk_room(self: DispatchNode, rec: SandboxRecord) -> DiskRoom | None:
        box = self._boxes.get(rec.id)
        return None if box is None else box.disk_room(rec)

    def check_limits(self: DispatchNode, rec: SandboxRecord) -> None:
        box = self._boxes.get(rec.id)
        if box is not None:
            box.check_limits(rec)

    def require_running(self: DispatchNode, sandbox_id: str) -> ContainerRecord:
        return self.live(sandbox_id).running()

    def upper_path(self: DispatchNode, sandbox_id: str) -> Path:
        return self.live(sandbox_id).upper_path()

    def root_path(self: DispatchNode, sandbox_id: str) -> Path:
        return self.live(sandbox_id).root_path()

    def child_cgroups(self: DispatchNode, sandbox_id: str, controller: str, names: Sequence[str]) -> builtins.list[Path]:
        return self.live(sandbox_id).child_cgroups(controller, names)

    def set_net_sysctls(self: DispatchNode, sandbox_id: str, values: Mapping[str, str]) -> None:
        self.live(sandbox_id).set_net_sysctls(values)

    async def open_session(
        self: DispatchNode, sandbox_id: str, *, env: Mapping[str, str] | None = None, cwd: str = "/", user: int | str = 0
    ) -> Session:
        """:meth:`ContainerSandbox.open_session`."""
        return await self.live(sandbox_id).open_session(env=env, cwd=cwd, user=user)

    async def close_session(self: DispatchNode, sandbox_id: str, session_id: str) -> bool:
        """Kill a session's shell and everything it started; False if there was no such session."""
        box = self._boxes.get(sandbox_id)
        sess = None if box is None else box.drop_session(session_id)
        if sess is None:
            return False
        await sess.close()
        return True

    def sessions(self: DispatchNode, sandbox_id: str) -> builtins.list[Session]:
        box = self._boxes.get(sandbox_id)
        return [] if box is None else list(box.sessions.values())


__all__ = ["DispatchNode", "SandboxDispatch"]
