"""SandboxFusion's request and response bodies, as its released client (``sandbox-fusion`` on
PyPI) and its server send and read them. Pure data: field names, defaults and enum values
are the wire contract and must not drift (tests/e2e/test_sandboxfusion_e2e.py checks them
with the released client).

What DSec adds is marked: the ``c`` language, and ``cpu_time`` filled in (the client's
model has the field; SandboxFusion's server leaves it empty).
"""

from __future__ import annotations

import enum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

Language = Literal[
    "python", "python2", "pytest", "cpp", "c", "nodejs", "go", "go_test", "java", "php", "csharp", "bash",
    "typescript", "sql", "rust", "cuda", "lua", "R", "perl", "D_ut", "ruby", "scala", "julia", "junit",
    "kotlin_script", "jest", "verilog", "python_gpu", "lean", "swift", "racket", "gtest", "react",
]
"""Every language SandboxFusion's client names (plus ``c``): a request naming another is a
422, as from SandboxFusion; one DSec does not run is answered ``SandboxError`` saying which
it runs (languages.py)."""


class _Body(BaseModel):
    # SandboxFusion's server ignores fields it does not know; so do we (clients of several
    # versions send more or fewer).
    model_config = ConfigDict(extra="ignore")


class RunStatus(enum.StrEnum):
    Success = "Success"
    """Every stage finished with exit code 0."""
    Failed = "Failed"
    """A stage exited non-zero or ran past its time limit."""
    SandboxError = "SandboxError"
    """The service could not run the code (the clients retry these)."""


class CommandRunStatus(enum.StrEnum):
    Finished = "Finished"
    Error = "Error"
    TimeLimitExceeded = "TimeLimitExceeded"


class CommandRunResult(_Body):
    status: CommandRunStatus
    execution_time: float | None = None
    return_code: int | None = None
    """The exit code; minus the signal number when a signal ended it (as Python's subprocess
    reports it); None after a time limit."""
    stdout: str | None = None
    stderr: str | None = None
    cpu_time: float | None = None
    """DSec: user + system CPU seconds of the stage."""


Seconds = Annotated[float, Field(gt=0, allow_inf_nan=False)]


class RunCodeRequest(_Body):
    compile_timeout: Seconds = 10
    run_timeout: Seconds = 10
    memory_limit_MB: int = -1
    """The sandbox's memory limit (every stage together); -1: the service's default."""
    code: str
    stdin: str | None = None
    language: Language
    files: dict[str, str | None] = Field(default_factory=dict)
    """Path (relative to the working directory, or absolute) -> base64 content; None: skipped."""
    fetch_files: list[str] = Field(default_factory=list)
    """Paths to send back (base64) after the run; missing ones are left out."""


class RunCodeResponse(_Body):
    status: RunStatus
    message: str
    compile_result: CommandRunResult | None = None
    run_result: CommandRunResult | None = None
    executor_pod_name: str | None = None
    """DSec: the id of the sandbox that ran it (its events stay listable for a while)."""
    files: dict[str, str] = Field(default_factory=dict)


class RunJupyterRequest(_Body):
    cells: list[str]
    cell_timeout: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 0
    """Seconds one cell may run (0: no limit of its own); a cell past it is interrupted."""
    total_timeout: Seconds = 45
    memory_limit_MB: int = -1
    kernel: Literal["python3"] = "python3"
    files: dict[str, str | None] = Field(default_factory=dict)
    fetch_files: list[str] = Field(default_factory=list)


class CellRunResult(_Body):
    stdout: str
    stderr: str
    display: list[dict[str, Any]]
    """``data`` of each ``execute_result`` and ``display_data`` message: MIME type -> content."""
    error: list[dict[str, Any]]
    """``content`` of each ``error`` message: ``ename``, ``evalue``, ``traceback``."""


class RunJupyterResponse(_Body):
    status: RunStatus
    message: str
    driver: CommandRunResult | None = None
    cells: list[CellRunResult] = Field(default_factory=list)
    executor_pod_name: str | None = None
    files: dict[str, str] = Field(default_factory=dict)


def run_status(*stages: CommandRunResult | None) -> tuple[RunStatus, str]:
    """The overall status of staged results, as SandboxFusion decides it: a stage that could
    not run at all makes it ``SandboxError`` (with that stage's stderr as the message); a time
    limit or a non-zero exit code ``Failed``; otherwise ``Success``."""
    ran = [s for s in stages if s is not None]
    for s in ran:
        if s.status is CommandRunStatus.Error:
            return RunStatus.SandboxError, s.stderr or ""
    if any(s.status is CommandRunStatus.TimeLimitExceeded for s in ran):
        return RunStatus.Failed, ""
    if any(s.return_code not in (None, 0) for s in ran):
        return RunStatus.Failed, ""
    return RunStatus.Success, ""
