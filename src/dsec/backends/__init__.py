"""Sandbox backends, one folder each, behind :class:`dsec.backends.base.Backend`.

A backend's module is imported only when an edge's configuration names it
(:func:`build`), so an edge without gVisor never imports gVisor code. To add a
backend: a folder ``dsec/backends/<kind>/`` with a config model (``kind:
Literal["<kind>"]``, and ``build(ctx)`` that makes the backend) added to the one union,
:data:`dsec.backends.registry.BackendConfig`, and a class satisfying the protocol;
then run ``tests/conformance`` against it (docs/BACKENDS.md).
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
    platform: tuple[str, ...] = ()
    """The platform's own IPv4 addresses (``a.b.c.d/32``: this edge, the control plane): no
    sandbox may reach them, whatever its policy says."""


def build(config: Any, ctx: BackendContext) -> Backend:
    """A (not yet started) backend for one member of ``EdgeConfig.backends``: its config
    builds it (:data:`dsec.backends.registry.BackendConfig` is the one registration)."""
    if not callable(getattr(config, "build", None)):
        raise ValueError(f"no backend of kind {getattr(config, 'kind', config)!r}")
    backend: Backend = config.build(ctx)
    return backend
