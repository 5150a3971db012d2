"""The container backend's part of an edge's configuration (``EdgeConfig.backends``)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from dsec.backends.common.netconfig import NetworkConfig

if TYPE_CHECKING:
    from dsec.backends import BackendContext
    from dsec.backends.base import Backend



class ContainerConfig(BaseModel):
    """Namespaces + seccomp + cgroups, the default backend (docs/RUNTIME.md)."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["container"] = "container"
    zram_size: Annotated[int, Field(ge=0)] = 0
    """Bytes of compressed RAM swap (zram) set up at start for paused sandboxes' memory;
    0: none (pause then freezes and drops only page cache). docs/SNAPSHOTS.md, "Swap"."""
    reclaim_method: Literal["pageout+force_empty", "force_empty", "pageout", "none"] = "pageout+force_empty"
    """How a pause pushes memory out (docs/SNAPSHOTS.md, "Pause")."""
    uppers_path: Path | None = None
    """An existing btrfs mount for writable layers on disk; default the runtime's own image
    in ``state_dir/uppers`` (docs/RUNTIME.md, "Writable layer on disk")."""
    shrinker_reserve: Annotated[int, Field(ge=0, le=90_000)] | None = None
    """Memory-cgroup shrinker ids to reserve once per boot at start, so that the kernel never
    reallocates every memory cgroup's shrinker table while the node fills (docs/RUNTIME.md,
    "Shrinker reserve"). None: 3 per sandbox of the edge's ``max_sandboxes`` (+64), none
    when that is not set; 0: none."""
    network: NetworkConfig | None = None
    """Sandbox networking: named permissions, always-blocked ranges, the prepared-namespace
    pool (docs/EDGE.md, "Network"). None: every sandbox is loopback-only and a create or
    ``set_policy`` with a policy is refused. The edge adds its own and the control plane's
    addresses to ``blocked`` when it starts."""

    def reserve_for(self, max_sandboxes: int | None) -> int:
        """Shrinker ids to reserve on an edge of that capacity (:attr:`shrinker_reserve`)."""
        if self.shrinker_reserve is not None:
            return self.shrinker_reserve
        from dsec.backends.container.shrinkers import ids_for

        return ids_for(max_sandboxes or 0)

    def build(self, ctx: BackendContext) -> Backend:
        """The node runtime this config describes (not yet started)."""
        from dsec.backends.container import build_backend  # the backend's own code, imported now

        return build_backend(self, ctx)
