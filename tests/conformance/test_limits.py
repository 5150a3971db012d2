"""Limits, hit for real: a memory limit OOM-kills the command and the result says so, a pids
limit makes fork fail, a disk quota gives ENOSPC; the sandbox survives each."""

from __future__ import annotations

import signal

import pytest

from dsec.backends.base import Capability
from dsec.spec import SandboxState

from .conftest import BackendHarness, wait_until

pytestmark = [pytest.mark.root, pytest.mark.timeout(90), pytest.mark.requires(Capability.EXEC)]

MiB = 1 << 20
HOG = "x=$(head -c 400000000 /dev/zero | tr '\\0' a); echo ${#x}"
"""A shell holding 400 MB in a variable: anonymous memory no page cache can stand in for."""
MEMORY = 128 * MiB
"""The memory limit under test: small, and taken by every backend (a microVM's guest kernel
needs at least 96 MiB of RAM to boot)."""


def test_memory_limit_oom_kills_and_says_so(backend: BackendHarness) -> None:
    with backend.sandbox(memory=MEMORY) as sb:
        r = backend.sh(sb.id, HOG, timeout=60)
        assert r.signal == signal.SIGKILL and r.exit_code is None, r
        assert r.limit is not None and (r.limit.kind, r.limit.value) == ("memory", MEMORY), r
        assert "memory limit" in r.limit.message
        # The sandbox lives on (container), or, where the OOM kill takes the whole sandbox
        # (gVisor's sentry), it is failed and says why: never a silent, broken "running".
        rec = backend.impl.get(sb.id)
        if rec.state is SandboxState.RUNNING:
            assert backend.ok(sb.id, "echo survived") == "survived\n"
            assert backend.sh(sb.id, "exit 1").limit is None  # the next plain failure is not blamed on it
        else:
            assert rec.state is SandboxState.FAILED and "memory" in rec.reason, (rec.state, rec.reason)


FORKS = "i=0; while [ $i -lt 64 ]; do sleep 600 >/dev/null 2>&1 & i=$((i+1)); done"


def test_pids_limit_makes_fork_fail(backend: BackendHarness) -> None:
    with backend.sandbox(pids=16) as sb:
        r = backend.sh(sb.id, FORKS, timeout=60)
        assert r.exit_code != 0, r
        assert b"fork" in r.stderr.lower() or b"resource temporarily unavailable" in r.stderr.lower(), r
        backend.sh(sb.id, ["killall", "-9", "sleep"])
        assert wait_until(lambda: backend.sh(sb.id, "echo ok").ok, timeout=5)
        assert backend.ok(sb.id, "echo a | cat") == "a\n"


def test_the_pids_limit_is_named_in_the_result(backend: BackendHarness) -> None:
    with backend.sandbox(pids=16) as sb:
        r = backend.sh(sb.id, FORKS, timeout=60)
        assert r.exit_code != 0, r
        assert r.limit is not None and (r.limit.kind, r.limit.value) == ("pids", 16), r
        backend.sh(sb.id, ["killall", "-9", "sleep"])
        assert wait_until(lambda: backend.sh(sb.id, "echo a | cat").limit is None, timeout=5)


def test_disk_quota_gives_enospc(backend: BackendHarness) -> None:
    with backend.sandbox(disk=8 * MiB) as sb:
        r = backend.sh(sb.id, "dd if=/dev/zero of=/tmp/big bs=1M count=32", timeout=60)
        assert r.exit_code != 0, r
        assert b"No space left on device" in r.stderr or b"Disk quota exceeded" in r.stderr, r
        assert r.limit is not None and (r.limit.kind, r.limit.value) == ("disk_full", 8 * MiB), r
        size = int(backend.ok(sb.id, "stat -c %s /tmp/big"))
        assert size <= 8 * MiB, size
        backend.ok(sb.id, "rm -f /tmp/big && sync")
        backend.ok(sb.id, "dd if=/dev/zero of=/tmp/small bs=1M count=2")  # room again once freed
