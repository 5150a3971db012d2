"""The microVM backend: a QEMU microvm per sandbox, with its own kernel (docs/MICROVM.md).

Importing this package imports only the config (pure data). The backend itself,
:class:`dsec.backends.microvm.backend.MicroVMBackend`, is imported when an edge builds it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dsec.backends.microvm.config import MicroVMConfig

if TYPE_CHECKING:
    from dsec.backends import BackendContext
    from dsec.backends.base import Backend

__all__ = ["MicroVMConfig", "build_backend"]


def build_backend(config: MicroVMConfig, ctx: BackendContext) -> Backend:
    """The microVM backend ``config`` describes (not yet started): :meth:`MicroVMConfig.build`."""
    from dsec.backends.common.netconfig import NetworkConfig
    from dsec.backends.microvm.backend import MicroVMBackend

    # the platform's own addresses (this edge, the control plane) are never reachable from a
    # VM either, whatever its policy: the same block list as the container backend's
    network = (config.network or NetworkConfig()).with_platform(ctx.platform)
    return MicroVMBackend(config.model_copy(update={"network": network}), name=ctx.name, state_dir=ctx.state_dir,
                          run_dir=ctx.run_dir, id_prefix=ctx.id_prefix, store=ctx.store)
