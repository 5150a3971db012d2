"""Sandbox backends, one folder each, behind :class:`dsec.backends.base.Backend`.

A backend's module is imported only when an edge's configuration names it
(:func:`build`), so an edge without gVisor never imports gVisor code. To add a
backend: a folder ``dsec/backends/<kind>/`` with a config model (``kind:
Literal["<kind>"]``) added to :data:`dsec.edge.config.BackendConfig`, a class
satisfying the protocol, and a branch in :func:`build`; then run
``tests/conformance`` against it (docs/BACKENDS.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dsec.backends.base import Backend


@dataclass(frozen=True, slots=True)
class BackendContext:
    """What every backend on an edge gets besides its own config."""

    name: str
    """Names every host resource of the backend (cgroups, run directory, records)."""
    state_dir: Path
    run_dir: Path
    id_prefix: str
    store: Any
    """The edge's layer store, shared by its backends."""
    backends: dict[str, Backend]
    """The edge's other backends, by kind (FnCall runs its workers in the container backend)."""
    max_sandboxes: int | None = None
    """The edge's configured capacity (``EdgeConfig.max_sandboxes``), None when not set."""


def build(config: Any, ctx: BackendContext) -> Backend:
    """A (not yet started) backend for one member of ``EdgeConfig.backends``."""
    kind = config.kind
    if kind == "container":
        from dsec.backends.container.runtime import ContainerRuntime

        return ContainerRuntime(
            name=ctx.name, state_dir=ctx.state_dir, run_dir=ctx.run_dir, layer_store=ctx.store, id_prefix=ctx.id_prefix,
            zram_size=config.zram_size, reclaim_method=config.reclaim_method, uppers_path=config.uppers_path,
            network=config.network, shrinker_reserve=_shrinker_reserve(config, ctx),
        )
    if kind == "gvisor":
        from dsec.backends.gvisor.backend import GVisorBackend

        return GVisorBackend(config, name=ctx.name, state_dir=ctx.state_dir, run_dir=ctx.run_dir,
                             id_prefix=ctx.id_prefix, store=ctx.store)
    if kind == "fncall":
        from dsec.backends.fncall.backend import FnCallBackend

        return FnCallBackend.from_context(config, ctx)
    raise ValueError(f"no backend of kind {kind!r}")


def _shrinker_reserve(config: Any, ctx: BackendContext) -> int:
    if config.shrinker_reserve is not None:
        return int(config.shrinker_reserve)
    from dsec.backends.container.shrinkers import ids_for

    return ids_for(ctx.max_sandboxes or 0)
