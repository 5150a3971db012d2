"""The one registration of backends: the union of their configs (``EdgeConfig.backends``).

Each member is a kind's pure-data config with ``build(ctx)``; the backend's own code is
imported only when an edge builds it.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from dsec.backends.common.netconfig import NetworkConfig, Permission
from dsec.backends.container.config import ContainerConfig
from dsec.backends.fncall.config import FnCallConfig
from dsec.backends.gvisor.config import GVisorConfig
from dsec.backends.microvm.config import MicroVMConfig

BackendConfig = Annotated[ContainerConfig | GVisorConfig | FnCallConfig | MicroVMConfig, Field(discriminator="kind")]
"""Every backend an edge can run, by ``kind``."""

__all__ = ["BackendConfig", "ContainerConfig", "FnCallConfig", "GVisorConfig", "MicroVMConfig", "NetworkConfig", "Permission"]
