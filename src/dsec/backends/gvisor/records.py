"""The gVisor backend's records, its constants, and what its parts share."""

from __future__ import annotations

import builtins
import contextlib
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Final

from dsec.backends.base import EdgeMeta, SandboxRecord
from dsec.backends.gvisor import bundle as bundles
from dsec.spec import SandboxSpec, SandboxState

MAX_LOWERS: Final = 15
ORPHAN_SWEEP_S: Final = 1.0
"""How often zombies of runsc processes reparented to us are reaped."""
PIDS_SLACK: Final = 2
_FORK_FAILED: Final = (b"Resource temporarily unavailable", b"can't fork", b"fork: retry", b"Cannot fork")
"""strerror(EAGAIN) in glibc's and musl's words, busybox's and bash's: a fork refused at RLIMIT_NPROC."""
HELPER_CAPS: Final = ",".join((*bundles.CAPABILITIES, "CAP_SYS_ADMIN"))
"""``runsc exec --cap`` of the helper's run and kill modes: the container's capabilities (what
the command gets, as root) and CAP_SYS_ADMIN, which the helper keeps only to mount cgroupfs in a
mount namespace of its own; the command never has it."""
_HELPER_STAGES: Final = {
    "fork": "the helper could not fork it",
    "cgroup": "its own cgroup could not be made",
    "namespace": "its own UTS namespace could not be made",
    "creds": "user {user!r} could not be set",
    "seccomp": "its seccomp filter could not be installed",
}
"""The helper's steps before the command runs (native/dsec-gvexec.c), as ``ExecError.stage``."""
ISOLATION: Final = ("gVisor application kernel (runsc, systrap): the sandbox's system calls are served by "
                    "the sentry in user space, not the host kernel; commands under a seccomp filter (no "
                    "namespaces, mounts or signals to pid 1); loopback-only network")


@dataclass(slots=True)
class GVisorRecord(SandboxRecord):
    """A gVisor sandbox: the runsc container, its layers and its sentry process."""

    layers: list[str] = field(default_factory=list)
    """Layer digests, top first."""
    container_id: str = ""
    sandbox_pid: int = 0
    """Host pid of the runsc sandbox process (the sentry)."""
    sandbox_start: int = 0
    medium: str = "memory"
    """Where the writable layer is: "memory" (tmpfs) or "disk" (btrfs subvolume)."""
    oom_baseline: int = 0

    backend: ClassVar[str] = "gvisor"

    def layer_stack(self) -> tuple[str, ...]:
        return tuple(self.layers)

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id, "state": self.state.value, "spec": self.spec.model_dump(mode="json"),
            "created_at": self.created_at, "reason": self.reason, "edge": self.edge.to_json(),
            "stage": self.stage, "layers": self.layers, "container_id": self.container_id,
            "sandbox_pid": self.sandbox_pid, "sandbox_start": self.sandbox_start, "medium": self.medium,
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> GVisorRecord:
        return cls(
            id=str(d["id"]), state=SandboxState(d["state"]), spec=SandboxSpec.model_validate(d["spec"]),
            created_at=float(d["created_at"]), reason=str(d.get("reason", "")),
            edge=EdgeMeta.from_json(d.get("edge")), stage=d.get("stage"),
            layers=[str(x) for x in d.get("layers", [])], container_id=str(d.get("container_id", "")),
            sandbox_pid=int(d.get("sandbox_pid", 0)), sandbox_start=int(d.get("sandbox_start", 0)),
            medium=str(d.get("medium", "memory")),
        )


@dataclass(frozen=True, slots=True)
class PauseResult:
    sandbox_id: str
    freeze_s: float
    reclaim: None
    """gVisor sandboxes' memory is not pushed out on pause (it is the sentry's memory file)."""
    seconds: float


def _our_zombie(pid: int) -> bool:
    """``pid`` is an exited, unreaped child of this process that runsc made (its binary re-executed
    as ``exe``, or named runsc-*)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return False
    comm = data[data.index(b"(") + 1:data.rindex(b")")]
    fields = data[data.rindex(b")") + 2:].split()
    return fields[0] == b"Z" and int(fields[1]) == os.getpid() and (comm == b"exe" or comm.startswith(b"runsc"))


def _children() -> builtins.list[int]:
    out: list[int] = []
    for t in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError), open(f"/proc/self/task/{t}/children") as f:
            out.extend(int(x) for x in f.read().split())
    return out


__all__ = ["HELPER_CAPS", "ISOLATION", "MAX_LOWERS", "ORPHAN_SWEEP_S", "PIDS_SLACK", "GVisorRecord", "PauseResult"]
