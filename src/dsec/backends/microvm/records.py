"""The microVM backend's sandbox record, and its constants."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Final

from dsec.backends.base import EdgeMeta, SandboxRecord
from dsec.backends.common.procstat import proc_start
from dsec.spec import NetworkPolicy, SandboxSpec, SandboxState

__all__ = ["ISOLATION", "MAX_LAYERS", "MicroVMRecord", "proc_start"]

MAX_LAYERS: Final = 6
"""Layer disks a VM gets (virtio-mmio transports are few: serial, rng, upper and these)."""
ISOLATION: Final = ("a virtual machine per sandbox (QEMU microvm, its own Linux kernel); QEMU itself runs "
                    "as a uid of its own, in the sandbox's cgroups and network namespace, under its seccomp filter")


@dataclass(slots=True)
class MicroVMRecord(SandboxRecord):
    """A microVM sandbox: its QEMU process, its layers and its template."""

    layers: list[str] = field(default_factory=list)
    """Layer digests, top first."""
    qemu_pid: int = 0
    qemu_start: int = 0
    """The QEMU process's start time (clock ticks since boot): with the pid, its identity."""
    template: str = ""
    uid: int = 0
    vcpus: int = 1
    memory_mib: int = 0
    restore_s: float = 0.0
    net: dict[str, Any] | None = None
    """Its network namespace's lease (slot, ip, ifname) and the policy in force (JSON, or None:
    nothing beyond loopback)."""

    backend: ClassVar[str] = "microvm"

    def current_policy(self) -> NetworkPolicy | None:
        pol = (self.net or {}).get("policy")
        return None if pol is None else NetworkPolicy.model_validate(pol)

    def layer_stack(self) -> tuple[str, ...]:
        return tuple(self.layers)

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id, "state": self.state.value, "spec": self.spec.model_dump(mode="json"),
            "created_at": self.created_at, "reason": self.reason, "edge": self.edge.to_json(),
            "stage": self.stage, "layers": self.layers, "qemu_pid": self.qemu_pid, "qemu_start": self.qemu_start,
            "template": self.template, "uid": self.uid, "vcpus": self.vcpus, "memory_mib": self.memory_mib,
            "net": self.net,
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> MicroVMRecord:
        return cls(
            id=d["id"], state=SandboxState(d["state"]), spec=SandboxSpec.model_validate(d["spec"]),
            created_at=d["created_at"], reason=d.get("reason", ""), edge=EdgeMeta.from_json(d.get("edge")),
            stage=d.get("stage"), layers=list(d.get("layers", [])), qemu_pid=int(d.get("qemu_pid", 0)),
            qemu_start=int(d.get("qemu_start", 0)), template=d.get("template", ""), uid=int(d.get("uid", 0)),
            vcpus=int(d.get("vcpus", 1)), memory_mib=int(d.get("memory_mib", 0)), net=d.get("net"),
        )
