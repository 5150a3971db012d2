"""The layers a node's container sandboxes stand on: refs resolved, stacks planned, the
runtime's pins on the node's shared mounts, and forks' ephemeral layers.

One :class:`NodeLayers` per runtime. The store holds one pin per layer for the runtime
(its ``holder``) while any sandbox uses it: one index write per layer, not per sandbox;
records rebuild the users after a crash (``shared.adopt``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

from dsec.backends.common.layers import SharedLayers
from dsec.backends.common.layers import stack as stack_layers
from dsec.backends.container import wire
from dsec.backends.container.records import ContainerRecord
from dsec.errors import DsecError, InvalidSpec, LayerNotFound
from dsec.images.layer import Layer, LayerKind
from dsec.images.mounts import IDLE_PIN_GRACE_S
from dsec.spec import ImageRef

log = logging.getLogger("dsec.runtime")

LAYER_RELEASE_GRACE_S: Final = IDLE_PIN_GRACE_S
"""A layer's pin outlives its last sandbox this long (a create/destroy loop pays no index write)."""
LAYER_REMOVAL_POLL_S: Final = 1.0
"""How often an idle, still mounted layer is looked up in the store: a removed one is unmounted."""


class NodeLayers:
    def __init__(self, holder: str, store: Callable[[], Any], ephemeral_dir: Path, *,
                 on_remount: Callable[[str, Path], object]) -> None:
        """``store``: the layer store (the runtime opens it lazily); ``on_remount(digest,
        path)``: a layer was found unmounted under us and mounted again (a repair)."""
        self.shared = SharedLayers(holder, grace_s=LAYER_RELEASE_GRACE_S, on_idle=self.maybe_release)
        self._store = store
        self.ephemeral_dir = ephemeral_dir
        self._on_remount = on_remount
        self._resolved: dict[str, tuple[float, str]] = {}
        self._lineage: dict[str, tuple[str, ...] | None] = {}
        self._kinds: dict[str, LayerKind] = {}

    @property
    def mounts(self) -> Any:
        """The node's layer mounts the runtime uses (set at start, None after close)."""
        return self.shared.mounts

    def resolve(self, ref: str) -> str:
        """Layer ref -> digest. Digests are immutable; a name:tag is re-read after 1 s."""
        if ref.startswith("sha256:") and len(ref) == 71:
            hit = self._resolved.get(ref)
            if hit is None:
                self._resolved[ref] = (float("inf"), self._store().resolve(ref).digest)
            return ref
        now = time.monotonic()
        hit = self._resolved.get(ref)
        if hit is not None and hit[0] > now:
            return hit[1]
        digest: str = self._store().resolve(ref).digest
        self._resolved[ref] = (now + 1.0, digest)
        return digest

    def kind(self, digest: str) -> LayerKind:
        """A layer's kind (layers are immutable: cached)."""
        kind = self._kinds.get(digest)
        if kind is None:
            kind = self._kinds[digest] = self._store().get(digest).kind
        return kind

    def lineage(self, digest: str) -> tuple[str, ...] | None:
        """A snapshot's parents (top first), None for other kinds; layers are immutable, so cached."""
        if digest not in self._lineage:
            layer: Layer = self._store().get(digest)
            self._lineage[digest] = tuple(layer.parents) if layer.kind is LayerKind.SNAPSHOT else None
        return self._lineage[digest]

    def stack_for(self, image: ImageRef) -> list[str]:
        """The digests to stack (top first): :func:`dsec.backends.common.layers.stack`."""
        return stack_layers(image, resolve=self.resolve, kind_of=self.kind, lineage_of=self.lineage,
                            max_layers=wire.MAX_LAYERS)

    def path(self, digest: str) -> Path:
        """Where a layer the runtime uses is mounted on the host."""
        return self.shared.path(digest)

    def image_paths(self, rec: ContainerRecord) -> tuple[Path, ...]:
        """The host mounts of the sandbox's image layers (never snapshot layers: those hold
        the agent's own writes), top first: where pristine copies come from."""
        return tuple(self.shared.path(d) for d in rec.layers if self.lineage(d) is None)

    async def use(self, digest: str, sandbox_id: str) -> Path:
        known, remounted = await self.shared.use(digest, sandbox_id)
        if remounted:
            self._on_remount(digest, known)
        return known

    def maybe_release(self, digest: str) -> None:
        """A layer no sandbox uses (after the grace, or at close): its pin is dropped, a fork's
        layer removed, and a layer gone from the store unmounted."""
        held = self.shared.release(digest)  # False: an earlier timer released it already
        if held is None:
            return
        if (self.ephemeral_dir / digest.split(":", 1)[1]).exists():
            self.drop_ephemeral(digest)
        if held:
            self.unmount_if_removed(digest)

    def unmount_if_removed(self, digest: str) -> None:
        """An idle layer stays mounted as a cache while the store has it; once it is removed
        (`dsec image rm` in another process, a dropped fork snapshot) it is unmounted, which
        frees its disk. Looked up every LAYER_REMOVAL_POLL_S while idle: one index read."""
        mounts = self.mounts
        if mounts is None or digest in self.shared.users:
            return  # in use again: its next release watches it again
        try:
            if mounts.unmount_if_removed(digest):
                return
        except DsecError as exc:
            log.warning("cannot unmount removed layer %s: %s", digest, exc)
            return
        with contextlib.suppress(RuntimeError):  # no running loop (called from a test): no watch
            asyncio.get_running_loop().call_later(LAYER_REMOVAL_POLL_S, self.unmount_if_removed, digest)

    def mark_ephemeral(self, digest: str) -> None:
        """A fork's layer: removed once no sandbox uses it (:meth:`drop_ephemeral`)."""
        self.ephemeral_dir.mkdir(parents=True, exist_ok=True)
        (self.ephemeral_dir / digest.split(":", 1)[1]).touch()

    def ephemeral(self) -> list[str]:
        """The digests of forks' layers still marked."""
        if not self.ephemeral_dir.is_dir():
            return []
        return [f"sha256:{m.name}" for m in self.ephemeral_dir.iterdir()]

    def drop_ephemeral(self, digest: str) -> bool:
        """Remove an unnamed (fork) snapshot if nothing uses it any more; True if removed."""
        marker = self.ephemeral_dir / digest.split(":", 1)[1]
        if self.shared.users.get(digest):
            return False
        try:
            self._store().remove(digest)
        except (LayerNotFound, InvalidSpec):
            pass
        except DsecError:
            return False  # pinned by another runtime, or a snapshot was taken on top of it
        marker.unlink(missing_ok=True)
        self._lineage.pop(digest, None)
        self._kinds.pop(digest, None)
        self._resolved.pop(digest, None)
        return True


__all__ = ["LAYER_RELEASE_GRACE_S", "LAYER_REMOVAL_POLL_S", "NodeLayers"]
