"""DSec: sandbox infrastructure for agentic RL training at scale."""

from dsec.errors import (
    Backpressure,
    DsecError,
    ExecError,
    ExecTimeout,
    FileAccessError,
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
from dsec.spec import ImageRef, Resources, SandboxSpec, SandboxState

__version__ = "0.1.0"

__all__ = [
    "Backpressure",
    "DsecError",
    "ExecError",
    "ExecTimeout",
    "FileAccessError",
    "HostError",
    "ImageError",
    "ImageRef",
    "InvalidSpec",
    "LayerInUse",
    "LayerNotFound",
    "QuotaExceeded",
    "Resources",
    "SandboxFailed",
    "SandboxNotFound",
    "SandboxSpec",
    "SandboxState",
    "SandboxStateError",
    "SessionClosed",
    "__version__",
]
