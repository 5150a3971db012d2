"""libdsec: the Python SDK. Async at the core (``AsyncClient``); ``Client`` is derived."""

from dsec.sdk.client import (
    UNSET,
    AsyncClient,
    AsyncFiles,
    AsyncSandbox,
    AsyncSession,
    CreateOutcome,
    OutputChunk,
)
from dsec.sdk.leases import AsyncLease
from dsec.sdk.sync import Client, Files, Lease, Sandbox, Session, Terminal
from dsec.sdk.terminal import AsyncTerminal, TerminalExit

__all__ = [
    "UNSET",
    "AsyncClient",
    "AsyncFiles",
    "AsyncLease",
    "AsyncSandbox",
    "AsyncSession",
    "AsyncTerminal",
    "Client",
    "CreateOutcome",
    "Files",
    "Lease",
    "OutputChunk",
    "Sandbox",
    "Session",
    "Terminal",
    "TerminalExit",
]
