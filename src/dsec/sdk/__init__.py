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
from dsec.sdk.sync import Client, Files, Sandbox, Session

__all__ = [
    "UNSET",
    "AsyncClient",
    "AsyncFiles",
    "AsyncSandbox",
    "AsyncSession",
    "Client",
    "CreateOutcome",
    "Files",
    "OutputChunk",
    "Sandbox",
    "Session",
]
