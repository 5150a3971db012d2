"""Wire models of the control plane that ``dsec.spec.api`` does not have (yet).

Pure data, importable without the server side (the SDK imports it lazily).
They extend the shared models rather than change them: an older SDK parsing a
``ProjectInfo`` or a ``SnapshotInfo`` strictly keeps working. They belong in
``dsec.spec.api`` once the storage dimension and stored snapshots are part of
the shared contract.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from dsec.spec import Stage
from dsec.spec.api import NAME_PATTERN, CreateTask, Quota, SnapshotInfo, TaskInfo

_STAGE_NAME = re.compile(r"^[a-z][a-z0-9_-]{0,62}$")


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ProjectQuota(Quota):
    """A project's quota with its snapshot storage (bytes of snapshot images)."""

    storage: Annotated[int | None, Field(ge=0, le=1 << 60)] = None
    """Bytes of snapshots the project may keep, carved out of the parent's like the other
    dimensions. Creating: None means 0 (no snapshots). Changing: None leaves it as it is."""


class CreateProjectBody(_Wire):
    """Body of ``POST /v1/projects``: the quota (and storage) is carved out of the parent's."""

    name: Annotated[str, Field(pattern=NAME_PATTERN)]
    parent: Annotated[str | None, Field(pattern=NAME_PATTERN)] = None
    quota: ProjectQuota


class UpdateProjectBody(_Wire):
    """Body of ``PATCH /v1/projects/{name}``."""

    quota: ProjectQuota


class StorageInfo(_Wire):
    """``GET /v1/projects/{name}/storage``: snapshot storage of one project, in bytes."""

    project: str
    quota: int
    used: int
    """Held by the project's snapshots (a snapshot being taken holds an upper bound)."""
    reserved: int
    """Carved out by the child projects."""
    available: int
    snapshots: int


class StoredSnapshot(SnapshotInfo):
    """A snapshot as the control plane records it: whose it is and where it lives."""

    project: str
    edge_id: str


def _check_stages(stages: dict[str, Stage] | None, stage: str | None) -> None:
    for name in stages or {}:
        if not _STAGE_NAME.match(name):
            raise ValueError(f"stage name {name!r} must match {_STAGE_NAME.pattern}")
    if stage is not None and stage not in (stages or {}):
        known = ", ".join(sorted(stages or {})) or "none declared"
        raise ValueError(f"stage {stage!r} is not one of the declared stages ({known})")


PriorityName = Literal["background", "training", "evaluation"]
PRIORITY_VALUES = {"background": 100, "training": 200, "evaluation": 300}
"""The named priorities (``dsec.control.sched.PRIORITIES`` holds the same table)."""


class CreateTaskBody(CreateTask):
    """Body of ``POST /v1/tasks``: a task may declare stages its sandboxes inherit, and its
    scheduling (docs/CONTROL.md, "Scheduling"). On an existing task, a field left out (None)
    keeps its value (``quota`` excepted: it is always set, as before)."""

    project: Annotated[str | None, Field(pattern=NAME_PATTERN)] = None
    """The task's project: the caller's (default) or one below it. A priority above
    ``training`` and a ``min`` are set by an ancestor project's token (or the root's), as quotas are."""
    priority: int | PriorityName | None = None
    """``background`` (100), ``training`` (200, the default), ``evaluation`` (300), or 0..1000."""
    preemption: Literal["pause", "destroy", "never"] | None = None
    """What may happen to the task's sandboxes when a more urgent create needs their room:
    ``pause`` (the default: memory to swap, resumed later), ``destroy``, or ``never``."""
    min: Quota | None = None
    """The guaranteed minimum (reserved capacity of the primary pool): creates inside it always
    find room (taking other tasks' elastic part if they must) and its sandboxes are never
    preempted below it. All zero: none. ``quota`` is the task's max (best effort)."""
    burst: bool | None = None
    """Its creates may go to the burst pool above the utilisation threshold (default true)."""

    @field_validator("priority")
    @classmethod
    def _priority(cls, v: int | str | None) -> int | str | None:
        if isinstance(v, int) and not isinstance(v, bool) and not 0 <= v <= 1000:
            raise ValueError("priority: 0..1000, or background / training / evaluation")
        return v

    def priority_value(self) -> int | None:
        if self.priority is None:
            return None
        return PRIORITY_VALUES[self.priority] if isinstance(self.priority, str) else int(self.priority)

    stages: Annotated[dict[str, Stage] | None, Field(max_length=32)] = None
    """Named stages (network policy + file rules). Sandboxes of the task whose spec declares
    no stages get these. None on an existing task: leave its stages as they are."""
    stage: str | None = None
    """The stage new sandboxes start in (one of ``stages``); None: the first declared."""

    @model_validator(mode="after")
    def _stage_known(self) -> CreateTaskBody:
        _check_stages(self.stages, self.stage)
        return self


class TaskDetail(TaskInfo):
    """A task with its stages and its scheduling."""

    stages: dict[str, Stage] = Field(default_factory=dict)
    stage: str | None = None
    """The stage new sandboxes of the task start in (the last one switched to)."""
    priority: int = 200
    preemption: str = "pause"
    min: Quota | None = None
    burst: bool = True
    active: Quota | None = None
    """The capacity its sandboxes hold now (``used`` less what preemption paused)."""


class SchedEvent(_Wire):
    """What the scheduler did (``GET /v1/sched/events``)."""

    id: int
    at: float
    kind: Literal["preempted", "resumed", "burst_on", "burst_off", "node_requested", "node_released"]
    project: str | None = None
    task: str | None = None
    sandbox_id: str | None = None
    action: Literal["pause", "destroy"] | None = None
    """``preempted``: what was done to the sandbox."""
    priority: int | None = None
    """The sandbox's priority (``preempted``, ``resumed``)."""
    by_priority: int | None = None
    """``preempted``: the priority of the create that needed the room."""
    reason: str = ""
    detail: dict[str, Any] = Field(default_factory=dict)


class PoolStatus(_Wire):
    edges: int
    capacity: Quota
    committed: Quota


class SchedStatus(_Wire):
    """``GET /v1/sched``: the scheduler's picture now."""

    utilisation: float
    """The primary pool's dominant committed share (sandboxes, cpu, memory)."""
    burst_threshold: float
    burst_active: bool
    """New eligible creates go to the burst pool now."""
    primary: PoolStatus
    burst: PoolStatus
    reserved: Quota
    """Held back for the tasks' unmet minimums."""
    preempted: int
    """Sandboxes paused by preemption now (the caller's subtree)."""
    provider: str = ""


class SetStageBody(_Wire):
    """Body of ``POST /v1/tasks/{name}/stage`` and ``POST /v1/sandboxes/{id}/stage``."""

    stage: Annotated[str, Field(pattern=r"^[a-z][a-z0-9_-]{0,62}$")]
