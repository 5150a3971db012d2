"""Wire models of the control plane that ``dsec.spec.api`` does not have (yet).

Pure data, importable without the server side (the SDK imports it lazily).
They extend the shared models rather than change them: an older SDK parsing a
``ProjectInfo`` or a ``SnapshotInfo`` strictly keeps working. They belong in
``dsec.spec.api`` once the storage dimension and stored snapshots are part of
the shared contract.
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, model_validator

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


class CreateTaskBody(CreateTask):
    """Body of ``POST /v1/tasks``: a task may declare stages its sandboxes inherit."""

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
    """A task with its stages."""

    stages: dict[str, Stage] = Field(default_factory=dict)
    stage: str | None = None
    """The stage new sandboxes of the task start in (the last one switched to)."""


class SetStageBody(_Wire):
    """Body of ``POST /v1/tasks/{name}/stage`` and ``POST /v1/sandboxes/{id}/stage``."""

    stage: Annotated[str, Field(pattern=r"^[a-z][a-z0-9_-]{0,62}$")]
