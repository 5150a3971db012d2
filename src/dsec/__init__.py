"""DSec: sandbox infrastructure for agentic RL training at scale."""

from dsec.errors import (
    AuthError,
    Backpressure,
    DsecError,
    ExecError,
    ExecTimeout,
    FileAccessError,
    Forbidden,
    HostError,
    ImageError,
    InvalidSpec,
    LayerInUse,
    LayerNotFound,
    QuotaExceeded,
    SandboxFailed,
    SandboxNotFound,
    SandboxStateError,
    SessionClosed,
)
from dsec.sdk import (
    AsyncClient,
    AsyncSandbox,
    AsyncSession,
    Client,
    CreateOutcome,
    OutputChunk,
    Sandbox,
    Session,
)
from dsec.spec import ImageRef, Resources, SandboxSpec, SandboxState
from dsec.spec.results import ExecResult

__version__ = "0.1.0"

__all__ = [
    "AsyncClient",
    "AsyncSandbox",
    "AsyncSession",
    "AuthError",
    "Backpressure",
    "Client",
    "CreateOutcome",
    "DsecError",
    "ExecError",
    "ExecResult",
    "ExecTimeout",
    "FileAccessError",
    "Forbidden",
    "HostError",
    "ImageError",
    "ImageRef",
    "InvalidSpec",
    "LayerInUse",
    "LayerNotFound",
    "OutputChunk",
    "QuotaExceeded",
    "Resources",
    "Sandbox",
    "SandboxFailed",
    "SandboxNotFound",
    "SandboxSpec",
    "SandboxState",
    "SandboxStateError",
    "Session",
    "SessionClosed",
    "__version__",
]
