"""The container backend's record: what survives a runtime restart, one JSON file a sandbox.

The neutral part (:class:`dsec.backends.base.SandboxRecord`) plus the container's own:
its uid slot, layers, init process and network. Written by the runtime
(:meth:`ContainerRuntime._save`) before any host resource is made.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Final

from dsec.backends.base import EdgeMeta, SandboxRecord
from dsec.backends.common.command import UID_RANGE
from dsec.spec import NetworkPolicy, SandboxSpec, SandboxState

UID_FIRST_BASE: Final = 1 << 24  # well above any host account
UID_SLOTS: Final = 60000


@dataclass(slots=True, kw_only=True)
class ContainerRecord(SandboxRecord):
    """The container backend's record: the neutral part plus its uid slot, layers, init
    process and network."""

    slot: int = -1
    layers: list[str] = field(default_factory=list)
    init_pid: int = 0
    init_start: int = 0
    net: dict[str, Any] | None = None
    """Its network when it has one beyond loopback: slot, ip, ifname, policy (JSON)."""
    disk_full: bool = False
    """Its writable layer was full when last looked at (:meth:`ContainerRuntime.disk_room`);
    not saved: it only tells the next command's limit verdict where it started from."""

    backend: ClassVar[str] = "container"

    def layer_stack(self) -> tuple[str, ...]:
        return tuple(self.layers)

    @property
    def uid_base(self) -> int:
        return UID_FIRST_BASE + self.slot * UID_RANGE

    def current_policy(self) -> NetworkPolicy | None:
        pol = (self.net or {}).get("policy")
        return None if pol is None else NetworkPolicy.model_validate(pol)

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "backend": self.backend,
            "state": self.state.value,
            "spec": _spec_json(self.spec),
            "slot": self.slot,
            "layers": self.layers,
            "created_at": self.created_at,
            "init_pid": self.init_pid,
            "init_start": self.init_start,
            "reason": self.reason,
            "edge": self.edge.to_json(),
            "stage": self.stage,
            "net": self.net,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ContainerRecord:
        edge = d.get("edge")
        if edge is None:  # written before records had a typed edge part
            edge = (d.get("meta") or {}).get("edge")
        return cls(
            id=d["id"],
            state=SandboxState(d["state"]),
            spec=SandboxSpec.model_validate(d["spec"]),
            slot=int(d["slot"]),
            layers=list(d["layers"]),
            created_at=float(d["created_at"]),
            init_pid=int(d.get("init_pid", 0)),
            init_start=int(d.get("init_start", 0)),
            reason=str(d.get("reason", "")),
            edge=EdgeMeta.from_json(edge),
            stage=d.get("stage"),
            net=d.get("net"),
        )


_SPEC_JSON: dict[int, tuple[SandboxSpec, dict[str, Any]]] = {}


def _spec_json(spec: SandboxSpec) -> dict[str, Any]:
    """model_dump is ~100 us; specs are immutable and usually shared by many sandboxes."""
    hit = _SPEC_JSON.get(id(spec))
    if hit is not None and hit[0] is spec:
        return hit[1]
    if len(_SPEC_JSON) > 256:
        _SPEC_JSON.clear()
    dumped = spec.model_dump(mode="json")
    _SPEC_JSON[id(spec)] = (spec, dumped)
    return dumped


__all__ = ["UID_FIRST_BASE", "UID_SLOTS", "ContainerRecord"]
