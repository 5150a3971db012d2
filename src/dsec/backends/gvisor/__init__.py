"""The gVisor backend: sandboxes under runsc (docs/GVISOR.md).

Importing this package imports only the config (pure data). The backend itself,
:class:`dsec.backends.gvisor.backend.GVisorBackend`, is imported when an edge builds it::

    from dsec.backends.gvisor.backend import GVisorBackend
    backend = GVisorBackend(config, name=..., state_dir=..., run_dir=..., id_prefix=..., store=...)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dsec.backends.gvisor.config import GVisorConfig

if TYPE_CHECKING:
    from dsec.backends import BackendContext
    from dsec.backends.base import Backend

__all__ = ["GVisorConfig", "build_backend"]


def build_backend(config: GVisorConfig, ctx: BackendContext) -> Backend:
    """The gVisor backend ``config`` describes (not yet started): :meth:`GVisorConfig.build`."""
    from dsec.backends.gvisor.backend import GVisorBackend

    return GVisorBackend(config, name=ctx.name, state_dir=ctx.state_dir, run_dir=ctx.run_dir,
                         id_prefix=ctx.id_prefix, store=ctx.store)
