"""The FnCall backend as an edge sees it: function calls, and no sandboxes of its own.

Its worker sandboxes live in the edge's container backend (labelled
``dsec.fncall=worker``); this backend holds none, so every sandbox operation is
refused with :class:`~dsec.errors.Unsupported` (a create) or not found (a get),
decided before any work. ``call`` and ``call_many`` delegate to the
:class:`~dsec.backends.fncall.pool.FnCallPool`.
"""

from __future__ import annotations

import builtins
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, ClassVar, cast

from dsec.backends.base import (
    UNSET,
    BackendBase,
    Capabilities,
    Capability,
    EdgeMeta,
    HostFinding,
    SandboxRecord,
    Usage,
    _Unset,
)
from dsec.backends.fncall.config import FnCallConfig
from dsec.backends.fncall.pool import FnCallPool
from dsec.backends.fncall.workers import WorkerHost
from dsec.errors import HostError, SandboxNotFound
from dsec.spec import ImageRef, SandboxSpec
from dsec.spec.fncall import FnCall, FnOutcome, FnResult

if TYPE_CHECKING:
    from dsec.backends import BackendContext
    from dsec.spec.results import ExecResult

ISOLATION = ("each call: a fresh fork of a warm template in a container sandbox, as its own uid, "
             "with its own empty scratch directory; rlimits and an IPC seccomp filter per call")


class FnCallBackend(BackendBase):
    """``kind="fncall"``: :meth:`call` / :meth:`call_many` on warm workers per image."""

    kind: ClassVar[str] = "fncall"

    def __init__(self, config: FnCallConfig, *, name: str = "fncall", host: WorkerHost | None = None,
                 ctx: BackendContext | None = None) -> None:
        """``host`` is the container backend the workers live in; with ``ctx`` (an edge's
        backends) it is looked up there at :meth:`start` (so it may be built after this one)."""
        self.config = config
        self.name = name
        self.capabilities = Capabilities(kind="fncall", ops=frozenset({Capability.FNCALL}), isolation=ISOLATION)
        self.last_activity: dict[str, float] = {}
        self.reconciled: dict[str, builtins.list[str]] = {}
        self._host = host
        self._ctx = ctx
        self.pool: FnCallPool | None = None

    @property
    def sandboxes(self) -> Mapping[str, SandboxRecord]:
        return MappingProxyType({})

    @property
    def host_repairs(self) -> Sequence[HostFinding]:
        return ()

    # -- lifetime --

    async def start(self) -> None:
        host = self._host
        if host is None and self._ctx is not None:
            container = self._ctx.backends.get("container")
            if container is not None and not all(callable(getattr(container, m, None))
                                                 for m in ("child_cgroups", "set_net_sysctls")):
                raise HostError("the fncall backend needs a container backend that gives a sandbox child cgroups "
                                "(a memory cgroup per call slot)", backend="fncall")
            host = cast("WorkerHost | None", container)
        if host is None:
            raise HostError("the fncall backend runs its workers in the container backend: configure one "
                            "(kind: container) before it", backend="fncall")
        self.pool = FnCallPool(self.config, host, name=self.name)
        await self.pool.start()

    async def close(self, *, destroy_all: bool = True) -> None:
        # Workers are always destroyed: they hold no user state, and a restarted edge
        # removes any that a crash left (FnCallPool.start).
        if self.pool is not None:
            await self.pool.close()

    def _pool(self) -> FnCallPool:
        if self.pool is None:
            raise HostError("the fncall backend is not started", backend="fncall")
        return self.pool

    # -- the calls --

    async def call(self, image: ImageRef | str, source: str, args: Sequence[Any] = (),
                   kwargs: Mapping[str, Any] | None = None, *, entry: str | None = None,
                   timeout: float | _Unset | None = UNSET, memory: int | None = None,
                   output_cap: int | None = None) -> FnResult:
        return await self._pool().call(image, source, args, kwargs, entry=entry, timeout=timeout, memory=memory,
                                       output_cap=output_cap)

    async def call_many(self, image: ImageRef | str, calls: Sequence[FnCall | str], *,
                        timeout: float | _Unset | None = UNSET, memory: int | None = None,
                        output_cap: int | None = None) -> builtins.list[FnOutcome]:
        return await self._pool().call_many(image, calls, timeout=timeout, memory=memory, output_cap=output_cap)

    # -- sandboxes: none --

    async def create(self, spec: SandboxSpec, *, sandbox_id: str | None = None,
                     edge: EdgeMeta | None = None) -> SandboxRecord:
        raise self._unsupported("sandboxes (it serves function calls: POST /v1/fncall)")

    async def destroy(self, sandbox_id: str) -> bool:
        return False

    def get(self, sandbox_id: str) -> SandboxRecord:
        raise SandboxNotFound(f"sandbox {sandbox_id} not found (the fncall backend holds none)",
                              sandbox_id=sandbox_id)

    def list(self) -> builtins.list[SandboxRecord]:
        return []

    def update(self, sandbox_id: str, *, spec: SandboxSpec | None = None,
               edge: EdgeMeta | None = None) -> SandboxRecord:
        return self.get(sandbox_id)

    async def exec(self, sandbox_id: str, cmd: str | Sequence[str], **_: Any) -> ExecResult:
        raise self._unsupported("exec")

    def usage(self, sandbox_id: str) -> Usage:
        self.get(sandbox_id)
        return Usage()
