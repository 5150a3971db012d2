"""Image layers as a backend on this host uses them: which digests a sandbox stacks, and
which of the node's shared layer mounts the backend holds.

:func:`stack` turns an ``ImageRef`` into the digests to mount, top first: a snapshot
stands for itself plus its lineage (as ``base`` it expands to it; anywhere else the
layers given beneath it must be exactly that lineage), the bottom must be a system
(a base or a snapshot), and no more than the mount can take.

:class:`SharedLayers` is the backend's use of the node's :class:`LayerMounts`: one store
pin per layer (the backend's ``holder``) while any of its sandboxes runs on it, kept a
grace period after the last one leaves so that a create/destroy loop does not pay an
index write each time; a layer someone unmounted under us is mounted again.

Owns no sandbox and no record. Never blocks the event loop: mounts and store writes run
in a thread (``use``); the rest is bookkeeping and callbacks of the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dsec.errors import InvalidSpec
from dsec.images.layer import LayerKind
from dsec.images.mounts import IDLE_PIN_GRACE_S

if TYPE_CHECKING:
    from dsec.images.mounts import LayerMounts
    from dsec.spec import ImageRef


def stack(
    image: ImageRef,
    *,
    resolve: Callable[[str], str],
    kind_of: Callable[[str], LayerKind],
    lineage_of: Callable[[str], Sequence[str] | None],
    max_layers: int,
) -> list[str]:
    """The digests to stack for ``image``, top first. ``resolve``: a layer ref to its digest;
    ``kind_of``: a digest's kind; ``lineage_of``: a snapshot's parents (top first), None for
    any other kind. InvalidSpec when the bottom is not a system, a snapshot sits over other
    layers than its own, or the stack is deeper than ``max_layers``."""
    digests = [resolve(ref) for ref in image.layers_top_first()]
    kind = kind_of(digests[-1])
    if kind not in (LayerKind.BASE, LayerKind.SNAPSHOT):
        # It would start, and every command would fail "not found in PATH": say so now.
        ws = kind is LayerKind.WORKSPACE
        raise InvalidSpec(
            f"layer {image.base!r} is a {kind.value} layer, not a base: it has no system to run commands "
            f"in. Stack it over a base image: "
            f"{'--workspace' if ws else '--toolkit'} {image.base} (ImageRef(base=..., "
            f"{'workspace=' if ws else 'toolkits=['}{image.base!r}{'' if ws else ']'}))",
            field="image.base",
        )
    layers: list[str] = []  # bottom first
    for d in reversed(digests):
        lineage = lineage_of(d)
        if lineage is not None:
            expected = list(reversed(lineage))
            if not layers:
                layers = expected
            elif layers != expected:
                raise InvalidSpec(
                    f"snapshot {d} was taken over other layers than the ones given beneath it; "
                    f"start from it alone: ImageRef(base={d!r}) (it brings its lineage)",
                    field="image",
                )
        layers.append(d)
    if len(layers) > max_layers:
        raise InvalidSpec(
            f"this image stacks {len(layers)} layers; a sandbox can mount at most {max_layers}",
            field="image",
        )
    return list(reversed(layers))


def is_mount(path: Path) -> bool:
    """``path`` is the root of a mount (its device differs from its parent's): two stats."""
    try:
        return os.stat(path).st_dev != os.stat(path.parent).st_dev
    except OSError:
        return False


class SharedLayers:
    """One backend's pins on the node's shared layer mounts, and which sandbox uses which.

    ``mounts`` is set by the backend when it starts (None before, and after a close that
    drops it). A layer with no user left is handed to ``on_idle`` after ``grace_s``
    (default: :meth:`release`; a backend with more to do once a layer is idle passes its
    own, which calls :meth:`release` first)."""

    def __init__(self, holder: str, *, grace_s: float = IDLE_PIN_GRACE_S,
                 on_idle: Callable[[str], object] | None = None) -> None:
        self.holder = holder
        self.grace_s = grace_s
        self.mounts: LayerMounts | None = None
        self.users: dict[str, set[str]] = {}
        """Digest -> the sandboxes using it; an empty set: idle, its pin held until released."""
        self.paths: dict[str, Path] = {}
        self._on_idle: Callable[[str], object] = on_idle if on_idle is not None else self.release

    def _mounted(self) -> LayerMounts:
        if self.mounts is None:
            raise RuntimeError(f"{self.holder}: the layer mounts are not set up (start the backend first)")
        return self.mounts

    def path(self, digest: str) -> Path:
        """Where a layer is mounted on the host (whether or not it is in use)."""
        known = self.paths.get(digest)
        return Path(known) if known is not None else Path(self._mounted().mountpoint(digest))

    async def use(self, digest: str, sandbox_id: str) -> tuple[Path, bool]:
        """The layer's mountpoint, pinned while ``sandbox_id`` uses it, and whether it had been
        unmounted under us (by hand, a cleanup script) and was mounted again: a repair for the
        caller to report."""
        mounts = self._mounted()
        users = self.users.setdefault(digest, set())
        known = self.paths.get(digest)
        remounted = False
        if known is None:
            path = Path(await asyncio.to_thread(mounts.acquire, digest, self.holder))
            self.paths[digest] = path
        elif not is_mount(known):  # two stats tell; a mount fixes it
            path, remounted = await asyncio.to_thread(mounts.remount, digest)
        else:
            path = known
        users.add(sandbox_id)
        return path, remounted

    def unuse(self, digest: str, sandbox_id: str) -> None:
        """``sandbox_id`` is done with the layer; the last user leaves its pin to ``on_idle``
        after the grace period."""
        users = self.users.get(digest)
        if users is None:
            return
        users.discard(sandbox_id)
        if not users:
            asyncio.get_running_loop().call_later(self.grace_s, self._on_idle, digest)

    def release(self, digest: str) -> bool | None:
        """Drop the pin of a layer nobody uses. None: it is in use again (or the mounts are
        gone), nothing done; else whether this call held it (False: released already)."""
        if self.users.get(digest) or self.mounts is None:
            return None
        held = digest in self.users
        self.users.pop(digest, None)
        self.paths.pop(digest, None)
        with contextlib.suppress(Exception):
            self.mounts.release(digest, self.holder)
        return held

    def release_idle(self) -> None:
        """Hand every layer nobody uses to ``on_idle`` now (at close: no grace left to wait)."""
        for digest in [d for d, users in self.users.items() if not users]:
            self._on_idle(digest)

    def adopt(self, sandbox_id: str, digests: Iterable[str]) -> None:
        """A sandbox re-adopted at start uses these layers (pinned by the run before us)."""
        mounts = self._mounted()
        for d in digests:
            self.users.setdefault(d, set()).add(sandbox_id)
            self.paths[d] = mounts.mountpoint(d)

    def release_unused_pins(self) -> None:
        """Pins the store holds for us on layers no sandbox of ours uses (left by a run that
        died): dropped, so the layers can be removed."""
        mounts = self._mounted()
        store = mounts.store
        for layer in store.list():
            if self.holder in store.holders(layer.digest) and layer.digest not in self.users:
                mounts.release(layer.digest, self.holder)


def stack_in_store(image: ImageRef, store: Any, *, max_layers: int) -> list[str]:
    """:func:`stack` over a layer store: refs resolved by it, snapshots expanded to their lineage."""
    def lineage(digest: str) -> tuple[str, ...] | None:
        layer = store.get(digest)
        return tuple(layer.parents) if layer.kind is LayerKind.SNAPSHOT else None

    return stack(image, resolve=lambda ref: str(store.resolve(ref).digest), kind_of=lambda d: store.get(d).kind,
                 lineage_of=lineage, max_layers=max_layers)
