"""DSec: sandbox infrastructure for agentic RL training at scale.

The errors are imported with the package; the SDK and the spec models (pydantic,
httpx: ~0.25 s of CPU) only when first used (``dsec.Client``, ``from dsec import
SandboxSpec``), so that a process that needs neither (``dsec exec`` from a shell)
does not pay for them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from dsec.errors import (
    AuthError,
    Backpressure,
    DsecError,
    ExceedsCapacity,
    ExecError,
    ExecTimeout,
    FileAccessError,
    FnCallError,
    FnCallFailed,
    FnCallOOM,
    FnCallOutputTooLarge,
    FnCallTimeout,
    FnCallWorkerLost,
    Forbidden,
    HostError,
    ImageError,
    InvalidSpec,
    LayerInUse,
    LayerNotFound,
    QuotaExceeded,
    SandboxEvicted,
    SandboxFailed,
    SandboxLost,
    SandboxNotFound,
    SandboxPreempted,
    SandboxStateError,
    SessionClosed,
    Unavailable,
    Unsupported,
)

if TYPE_CHECKING:
    from dsec.sdk import (
        AsyncClient,
        AsyncSandbox,
        AsyncSession,
        AsyncTerminal,
        Client,
        CreateOutcome,
        OutputChunk,
        Sandbox,
        Session,
        Terminal,
        TerminalExit,
    )
    from dsec.spec import (
        FileRules,
        ImageRef,
        NetRule,
        NetworkPolicy,
        Resources,
        SandboxSpec,
        SandboxState,
        Stage,
    )
    from dsec.spec.fncall import FnCall, FnResult
    from dsec.spec.results import ExecResult, LimitHit

_LAZY = {
    **dict.fromkeys(("AsyncClient", "AsyncSandbox", "AsyncSession", "AsyncTerminal", "Client", "CreateOutcome",
                     "OutputChunk", "Sandbox", "Session", "Terminal", "TerminalExit"), "dsec.sdk"),
    **dict.fromkeys(("FileRules", "ImageRef", "NetRule", "NetworkPolicy", "Resources", "SandboxSpec",
                     "SandboxState", "Stage"), "dsec.spec"),
    **dict.fromkeys(("ExecResult", "LimitHit"), "dsec.spec.results"),
    **dict.fromkeys(("FnCall", "FnResult"), "dsec.spec.fncall"),
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'dsec' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once: later reads are plain module attributes
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__version__ = "0.1.0"

__all__ = [
    "AsyncClient",
    "AsyncSandbox",
    "AsyncSession",
    "AsyncTerminal",
    "AuthError",
    "Backpressure",
    "Client",
    "CreateOutcome",
    "DsecError",
    "ExceedsCapacity",
    "ExecError",
    "ExecResult",
    "ExecTimeout",
    "FileAccessError",
    "FileRules",
    "FnCall",
    "FnCallError",
    "FnCallFailed",
    "FnCallOOM",
    "FnCallOutputTooLarge",
    "FnCallTimeout",
    "FnCallWorkerLost",
    "FnResult",
    "Forbidden",
    "HostError",
    "ImageError",
    "ImageRef",
    "InvalidSpec",
    "LayerInUse",
    "LayerNotFound",
    "LimitHit",
    "NetRule",
    "NetworkPolicy",
    "OutputChunk",
    "QuotaExceeded",
    "Resources",
    "Sandbox",
    "SandboxEvicted",
    "SandboxFailed",
    "SandboxLost",
    "SandboxNotFound",
    "SandboxPreempted",
    "SandboxSpec",
    "SandboxState",
    "SandboxStateError",
    "Session",
    "SessionClosed",
    "Stage",
    "Terminal",
    "TerminalExit",
    "Unavailable",
    "Unsupported",
    "__version__",
]
