"""The container backend: namespaces, cgroups v1, overlay over shared EROFS layers.

Privileged code lives in small modules: ``native/*.c``, the dsec-spawner (clone, mounts,
setns, seccomp, capabilities; ``wire`` builds its requests), ``cgroups`` (v1 hierarchy). ``runtime`` is the node,
``sandbox`` one sandbox; the pieces gVisor shares (files, uppers, limits, sessions) are in
``dsec.backends.common``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dsec.backends import BackendContext
    from dsec.backends.base import Backend
    from dsec.backends.container.config import ContainerConfig


def build_backend(config: ContainerConfig, ctx: BackendContext) -> Backend:
    """The node runtime ``config`` describes (not yet started): :meth:`ContainerConfig.build`."""
    from dsec.backends.container.runtime import ContainerRuntime

    return ContainerRuntime(
        name=ctx.name, state_dir=ctx.state_dir, run_dir=ctx.run_dir, layer_store=ctx.store, id_prefix=ctx.id_prefix,
        zram_size=config.zram_size, reclaim_method=config.reclaim_method, uppers_path=config.uppers_path,
        network=None if config.network is None else config.network.with_platform(ctx.platform),
        shrinker_reserve=config.reserve_for(ctx.max_sandboxes),
    )
