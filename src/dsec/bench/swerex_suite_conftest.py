"""conftest.py of SWE-ReX's own test suite, pointed at DSec (copied in beside its tests).

SWE-ReX's tests (swe-rex 1.4.0's ``tests/test_execution.py``, from its released sdist) get
their runtime from the fixtures ``remote_runtime`` and ``runtime_with_default_session``,
and their request types ``_Action`` / ``_Command`` (5 s timeouts) from this file. Upstream,
the runtime is a ``RemoteRuntime`` talking to ``swerex-remote`` on the test host; here it
is a :class:`~dsec.compat.swerex.DSecRuntime` over a fresh DSec sandbox for each test
($DSEC_URL, $DSEC_TOKEN; image $DSEC_SWEREX_IMAGE). The two fixtures and the two classes
are SWE-ReX's own, word for word but for where the runtime comes from. Run by
:mod:`dsec.bench.compat_swerex`; never imported by DSec itself.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator

import pytest
from swerex.runtime.abstract import (
    BashAction,
    CloseBashSessionRequest,
    Command,
    CreateBashSessionRequest,
)

from dsec.compat.swerex import DSecDeployment, DSecRuntime

TEST_API_KEY = "testkey"
"""Imported by SWE-ReX's server tests; no server runs here."""


@pytest.fixture(scope="session")
def remote_server() -> None:
    pytest.fail("no SWE-ReX server runs: DSecRuntime drives the sandbox through DSec's own API")


@pytest.fixture
async def remote_runtime() -> AsyncIterator[DSecRuntime]:
    d = DSecDeployment(image=os.environ["DSEC_SWEREX_IMAGE"], resources={"cpu": 1, "memory": 512 << 20},
                       labels={"suite": "swerex"})
    await d.start()
    try:
        yield d.runtime
    finally:
        await d.stop()


@pytest.fixture
async def runtime_with_default_session(remote_runtime: DSecRuntime) -> AsyncIterator[DSecRuntime]:
    await remote_runtime.create_session(CreateBashSessionRequest())
    try:
        yield remote_runtime
    finally:
        await remote_runtime.close_session(CloseBashSessionRequest())


class _Action(BashAction):
    timeout: float | None = 5


class _Command(Command):
    timeout: float | None = 5
