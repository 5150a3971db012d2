"""Snapshots and forks (docs/SNAPSHOTS.md): a sandbox's disk packed into a layer, and N new
sandboxes from one sandbox's disk now. A part of
:class:`~dsec.backends.container.runtime.ContainerRuntime` (a mixin over the
:class:`ForkingNode` protocol)."""

from __future__ import annotations

import asyncio
import builtins
import secrets
from collections.abc import Sequence
from typing import Any, Protocol

from dsec.backends.base import EdgeMeta, SandboxRecord
from dsec.backends.common.records import RecordBook
from dsec.backends.container import snapshot as snapshots
from dsec.backends.container.layerbook import NodeLayers
from dsec.backends.container.records import ContainerRecord
from dsec.backends.container.sandbox import ContainerSandbox
from dsec.backends.container.snapshot import SnapshotNode
from dsec.errors import InvalidSpec, SandboxStateError
from dsec.images.layer import Layer
from dsec.spec import ImageRef, SandboxSpec, SandboxState


class ForkingNode(SnapshotNode, Protocol):
    records: RecordBook[ContainerRecord]
    layers: NodeLayers
    _boxes: dict[str, ContainerSandbox]

    def get(self, sandbox_id: str) -> ContainerRecord: ...
    def live(self, sandbox_id: str) -> ContainerSandbox: ...
    async def create(self, spec: SandboxSpec, *, sandbox_id: str | None = None,
                     edge: EdgeMeta | None = None) -> ContainerRecord: ...
    async def destroy(self, sandbox_id: str) -> bool: ...
    async def snapshot(self, sandbox_id: str, *, name: str | None = None, tag: str | None = None,
                       exclude: Sequence[str] = (), max_layers: int | None = None,
                       ephemeral: bool = False) -> Layer: ...
    @staticmethod
    def fork_spec(rec: ContainerRecord, layer: str) -> SandboxSpec: ...


class NodeForks:
    async def snapshot(
        self: SnapshotNode,
        sandbox_id: str,
        *,
        name: str | None = None,
        tag: str | None = None,
        exclude: Sequence[str] = (),
        max_layers: int | None = None,
        ephemeral: bool = False,
    ) -> Layer:
        """Pack the sandbox's writable layer (running or paused) into a new snapshot layer.

        The layer's ``parents`` are the sandbox's layers (its lineage); start new
        sandboxes from it with ``ImageRef(base=<its ref or digest>)``. The sandbox is
        frozen while its writable layer is copied out (docs/SNAPSHOTS.md).
        ``exclude`` leaves paths out (``/abs/path``, globs, or bare names such as
        ``__pycache__``). ``ephemeral`` layers are removed once no sandbox uses them.
        Raises StorageFull (an ImageError) if the layer store fills up."""
        info = await snapshots.make_snapshot(self, sandbox_id, name=name, tag=tag, exclude=exclude,
                                             max_layers=max_layers, ephemeral=ephemeral)
        return info.layer

    async def snapshot_info(
        self: SnapshotNode, sandbox_id: str, *, name: str | None = None, tag: str | None = None, exclude: Sequence[str] = (),
        max_layers: int | None = None, ephemeral: bool = False,
    ) -> snapshots.SnapshotInfo:
        """Like :meth:`snapshot`, with the packing figures (bytes, frozen time, collapse)."""
        return await snapshots.make_snapshot(self, sandbox_id, name=name, tag=tag, exclude=exclude,
                                             max_layers=max_layers, ephemeral=ephemeral)

    async def fork(
        self: ForkingNode,
        sandbox_id: str,
        children: int | Sequence[str],
        *,
        edges: Sequence[EdgeMeta] | None = None,
        exclude: Sequence[str] = (),
    ) -> builtins.list[SandboxRecord]:
        """New sandboxes whose disks equal this one's now (running or paused): ``children``
        is how many, or their ids; ``edges`` (one per child) is kept with their records.

        Each child gets a fresh identity — its id as hostname, a new /etc/machine-id,
        no inherited random seed — and its own writable layer, so siblings never see
        each other's writes. Children start where the parent is now: its current stage,
        else its current network policy. All or nothing: if one child fails, the others
        are destroyed, the fork's layer is dropped and the error raised. Forking a failed
        sandbox raises SandboxStateError. The only fork: the edge calls this one."""
        ids: builtins.list[str | None] = (
            [None] * children if isinstance(children, int) else builtins.list(children))
        if not 1 <= len(ids) <= 10000:
            raise InvalidSpec("fork needs 1 <= n <= 10000", field="n")
        taken = [c for c in ids if c is not None and c in self._boxes]
        if taken or len({c for c in ids if c is not None}) != sum(1 for c in ids if c is not None):
            # create() is idempotent per id: a live sandbox would come back as a "child".
            raise InvalidSpec(f"fork children need new, distinct ids: {', '.join(taken) or 'an id given twice'} "
                              "names a sandbox that exists or repeats", field="children", sandbox_id=sandbox_id)
        metas = builtins.list(edges) if edges is not None else [EdgeMeta() for _ in ids]
        if len(metas) != len(ids):
            raise InvalidSpec(f"fork got {len(ids)} children but {len(metas)} edge parts", field="edges")
        rec = self.get(sandbox_id)
        if rec.state not in (SandboxState.RUNNING, SandboxState.PAUSED):
            raise SandboxStateError(
                f"sandbox {sandbox_id} is {rec.state.value}"
                + (f" ({rec.reason})" if rec.reason else "") + ": only a running or paused sandbox can be forked",
                sandbox_id=sandbox_id, state=rec.state.value,
            )
        layer = await self.snapshot(sandbox_id, name=snapshots.FORK_NAME, tag=f"{sandbox_id}-{secrets.token_hex(3)}",
                                    exclude=exclude, ephemeral=True)
        spec = self.fork_spec(rec, layer.digest)
        results = await asyncio.gather(*(self.create(spec, sandbox_id=cid, edge=meta) for cid, meta in zip(ids, metas, strict=True)),
                                       return_exceptions=True)
        made: builtins.list[SandboxRecord] = [r for r in results if isinstance(r, ContainerRecord)]
        failure = next((r for r in results if isinstance(r, BaseException)), None)
        if failure is None:
            try:
                for child in made:
                    await asyncio.to_thread(snapshots.fresh_identity, self.live(child.id).files(platform=True))
                    assert isinstance(child, ContainerRecord)
                    self.records.event(child, "forked", parent=sandbox_id, layer=layer.digest)
            except Exception as exc:
                failure = exc
        if failure is not None:
            await asyncio.gather(*(self.destroy(c.id) for c in made), return_exceptions=True)
            for c in made:
                self.layers.shared.users.get(layer.digest, set()).discard(c.id)
            self.layers.maybe_release(layer.digest)
            self.layers.drop_ephemeral(layer.digest)
            raise failure
        self.records.event(rec, "fork", children=[c.id for c in made], layer=layer.digest)
        return made

    @staticmethod
    def fork_spec(rec: ContainerRecord, layer: str) -> SandboxSpec:
        """The spec of ``rec``'s fork children: its layer as their image, and the stage in
        force now (else the network policy in force now)."""
        update: dict[str, Any] = {"image": ImageRef(base=layer)}
        current = rec.stage or rec.spec.stage
        if current is not None:
            update["stage"] = current
        elif rec.net is not None:
            update["network"] = rec.current_policy()
        return rec.spec.model_copy(update=update)

    def refresh_identity(self: ForkingNode, sandbox_id: str) -> None:
        """Give a sandbox started from another's disk its own machine-id (fork does this)."""
        snapshots.fresh_identity(self.live(sandbox_id).files(platform=True))


__all__ = ["ForkingNode", "NodeForks"]
