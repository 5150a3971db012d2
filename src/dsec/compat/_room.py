"""Creating a sandbox for another project's harness: wait for room as DSec asks.

Harnesses (SWE-ReX deployments, mini-swe-agent and Harbor environments) start one sandbox
and expect it to come up, as ``docker run`` does; DSec answers a full cluster with
``Backpressure`` and a ``retry_after``. These wait and retry (jittered, growing, the same
``request_id`` so a retried create makes one sandbox) until ``timeout``, then raise the
last ``Backpressure``. A create given up (cancelled, or past ``timeout``) leaves no
sandbox: the one the control plane may have made meanwhile is found and deleted.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
import uuid
from collections.abc import Mapping
from typing import Any

from dsec.errors import Backpressure, DsecError
from dsec.sdk.client import AsyncClient, AsyncSandbox
from dsec.sdk.sync import Client, Sandbox
from dsec.spec import SandboxSpec


def _wait(exc: Backpressure, attempt: int) -> float:
    retry_after = float(exc.fields.get("retry_after") or 1.0)
    return min(10.0, retry_after * (1 + 0.5 * attempt)) * random.uniform(0.5, 1.5)


async def create_with_room(client: AsyncClient, spec: SandboxSpec, *, timeout: float,
                           labels: Mapping[str, str] | None = None, **kw: Any) -> AsyncSandbox:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    request_id = uuid.uuid4().hex
    attempt = 0
    while True:
        try:
            async with asyncio.timeout_at(deadline):
                return await client.create(spec, labels=labels, request_id=request_id, **kw)
        except Backpressure as exc:
            attempt += 1
            wait = _wait(exc, attempt)
            if loop.time() + wait > deadline:
                raise
            await asyncio.sleep(wait)
        except (asyncio.CancelledError, TimeoutError):
            # The create may have reached the control plane, which goes on without us: the
            # same request_id gives that sandbox back (or makes it), and it is deleted.
            await asyncio.shield(_reap(client, spec, labels, request_id, kw))
            raise


async def _reap(client: AsyncClient, spec: SandboxSpec, labels: Mapping[str, str] | None, request_id: str,
                kw: dict[str, Any]) -> None:
    try:
        async with asyncio.timeout(60):
            sandbox = await client.create(spec, labels=labels, request_id=request_id, **kw)
    except (DsecError, OSError, TimeoutError):
        return  # none was made (a full cluster answers Backpressure), or it cannot be told: its TTL ends it
    with contextlib.suppress(DsecError, OSError):
        await sandbox.close()


def create_with_room_sync(client: Client, spec: SandboxSpec, *, timeout: float,
                          labels: Mapping[str, str] | None = None, **kw: Any) -> Sandbox:
    deadline = time.monotonic() + timeout
    request_id = uuid.uuid4().hex
    attempt = 0
    while True:
        try:
            sandbox: Sandbox = client.create(spec, labels=labels, request_id=request_id, **kw)
            return sandbox
        except Backpressure as exc:
            attempt += 1
            wait = _wait(exc, attempt)
            if time.monotonic() + wait > deadline:
                raise
            time.sleep(wait)
