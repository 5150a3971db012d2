"""What a container sandbox reaches of its node (the runtime), and nothing more."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from dsec.backends.common.network import NetworkManager
from dsec.backends.common.records import RecordBook
from dsec.backends.common.uppers import UpperStore
from dsec.backends.container import pause as pausing
from dsec.backends.container.cgroups import RuntimeCgroups
from dsec.backends.container.layerbook import NodeLayers
from dsec.backends.container.records import ContainerRecord
from dsec.backends.container.spawner import Spawner


class Node(Protocol):
    """What a sandbox reaches of its node (:class:`ContainerRuntime`), and nothing more."""

    cgroups: RuntimeCgroups
    net: NetworkManager
    uppers: UpperStore
    spawner: Spawner | None
    last_activity: dict[str, float]
    landlock_abi: int
    reclaim_method: pausing.ReclaimMethod
    wake_gate: Callable[[str], None] | None
    records: RecordBook[ContainerRecord]
    layers: NodeLayers

    async def ensure_spawner(self, *, check: bool = False) -> Spawner: ...
    def open_init(self, rec: ContainerRecord, *, check: bool = True) -> int | None: ...
    def track_name(self) -> str: ...


__all__ = ["Node"]
