"""Lifecycle: create -> get -> list -> destroy, destroy idempotent, and nothing of a destroyed
sandbox left on the host (process, mount, cgroup, file naming it). Pause and resume: a paused
sandbox's processes are frozen, resume (or any exec) lets them go on."""

from __future__ import annotations

import secrets
import time
from typing import Any

import pytest

from dsec.backends.base import Capability, EdgeMeta, SandboxRecord
from dsec.errors import SandboxNotFound, SandboxStateError
from dsec.spec import SandboxState

from .conftest import BackendHarness, cgroups_matching, processes_matching, wait_until

pytestmark = [pytest.mark.root, pytest.mark.timeout(90)]


@pytest.mark.requires(Capability.SANDBOXES)
def test_create_get_list_destroy(backend: BackendHarness) -> None:
    impl = backend.impl
    sid = f"cf-{secrets.token_hex(5)}"
    edge = EdgeMeta(labels={"suite": "conformance"}, task="t-1")
    rec = backend.run(impl.create(backend.spec(env={"K": "v"}), sandbox_id=sid, edge=edge))
    backend.made.append(sid)
    try:
        assert isinstance(rec, SandboxRecord) and rec.id == sid and rec.state is SandboxState.RUNNING, rec
        got = impl.get(sid)
        assert got.id == sid and got.spec == rec.spec and got.spec.env == {"K": "v"}
        assert got.edge.labels == {"suite": "conformance"} and got.edge.task == "t-1"  # kept, not read
        assert sid in {r.id for r in impl.list()} and sid in impl.sandboxes
        assert backend.ok(sid, "echo $K") == "v\n"
    finally:
        assert backend.run(impl.destroy(sid)) is True
    with pytest.raises(SandboxNotFound):
        impl.get(sid)
    assert sid not in {r.id for r in impl.list()}
    assert backend.run(impl.destroy(sid)) is False  # idempotent


@pytest.mark.requires(Capability.SANDBOXES)
def test_destroy_leaves_nothing(backend: BackendHarness) -> None:
    rec = backend.create()
    sid = rec.id
    backend.ok(sid, "echo data > /tmp/f; sleep 1000 >/dev/null 2>&1 & sleep 1001 >/dev/null 2>&1 &")
    # The host-side scans see the live sandbox (else seeing nothing afterwards would prove nothing).
    assert processes_matching(sid), "no host process found for a live sandbox"
    assert cgroups_matching(sid), "no cgroup found for a live sandbox"
    assert backend.run(backend.impl.destroy(sid)) is True
    assert wait_until(lambda: not backend.traces(sid), timeout=5), backend.traces(sid)
    assert backend.run(backend.impl.destroy(sid)) is False


@pytest.mark.requires(Capability.SANDBOXES)
def test_destroy_during_exec_ends_the_exec(backend: BackendHarness) -> None:
    import asyncio

    rec = backend.create()

    async def go() -> Any:
        run = asyncio.ensure_future(backend.impl.exec(rec.id, "sleep 1000", timeout=30))
        await asyncio.sleep(0.5)
        assert await backend.impl.destroy(rec.id) is True
        return await asyncio.wait_for(asyncio.gather(run, return_exceptions=True), 10)

    t0 = time.monotonic()
    (out,) = backend.run(go())
    assert time.monotonic() - t0 < 10
    from dsec.errors import DsecError

    assert isinstance(out, DsecError) or out.exit_code != 0, out
    assert wait_until(lambda: not backend.traces(rec.id), timeout=5), backend.traces(rec.id)


# ------------------------------------------------------------- pause ----

# written aside and renamed: a reader never sees the file between its truncation and its write
COUNTER = "i=0; while :; do i=$((i+1)); echo $i > /tmp/count.new; mv /tmp/count.new /tmp/count; sleep 0.05; done"


def _count(backend: BackendHarness, sid: str) -> int:
    return int(backend.ok(sid, "cat /tmp/count 2>/dev/null || echo 0"))


@pytest.mark.requires(Capability.PAUSE)
def test_paused_processes_are_frozen_and_resume_goes_on(backend: BackendHarness, sb: Any) -> None:
    impl = backend.impl
    backend.ok(sb.id, f"({COUNTER}) >/dev/null 2>&1 &")
    assert wait_until(lambda: _count(backend, sb.id) > 3, timeout=5)
    before = _count(backend, sb.id)
    backend.run(impl.pause(sb.id))
    assert impl.get(sb.id).state is SandboxState.PAUSED
    time.sleep(1.5)  # ~30 ticks if it were running
    backend.run(impl.resume(sb.id))
    assert impl.get(sb.id).state is SandboxState.RUNNING
    first = _count(backend, sb.id)
    assert first - before <= 10, (before, first)  # frozen: ~30 ticks if not; a few around pause and resume
    time.sleep(0.6)
    later = _count(backend, sb.id)
    assert later >= first + 4, (first, later)  # and it goes on


@pytest.mark.requires(Capability.PAUSE)
def test_exec_on_a_paused_sandbox_wakes_it(backend: BackendHarness, sb: Any) -> None:
    impl = backend.impl
    backend.ok(sb.id, f"({COUNTER}) >/dev/null 2>&1 &")
    assert wait_until(lambda: _count(backend, sb.id) > 3, timeout=5)
    before = _count(backend, sb.id)
    backend.run(impl.pause(sb.id))
    time.sleep(1.5)  # ~30 ticks if it were running
    after = _count(backend, sb.id)  # exec on a paused sandbox wakes it, then reads
    assert impl.get(sb.id).state is SandboxState.RUNNING  # the exec woke it
    assert after - before <= 10, (before, after)  # frozen: ~30 ticks if not; a few around pause and wake
    time.sleep(0.6)
    assert _count(backend, sb.id) >= after + 4  # and it runs on


@pytest.mark.requires(Capability.PAUSE)
def test_pausing_a_paused_sandbox_is_a_state_error(backend: BackendHarness, sb: Any) -> None:
    """paused -> paused is not a move of dsec.spec.TRANSITIONS; nor is resuming a running one."""
    with pytest.raises(SandboxStateError):
        backend.run(backend.impl.resume(sb.id))
    backend.run(backend.impl.pause(sb.id))
    with pytest.raises(SandboxStateError):
        backend.run(backend.impl.pause(sb.id))
    assert backend.impl.get(sb.id).state is SandboxState.PAUSED
    backend.run(backend.impl.resume(sb.id))
    assert backend.ok(sb.id, "echo running") == "running\n"


@pytest.mark.requires(Capability.PAUSE)
def test_destroy_a_paused_sandbox(backend: BackendHarness) -> None:
    rec = backend.create()
    backend.ok(rec.id, "sleep 1000 >/dev/null 2>&1 &")
    backend.run(backend.impl.pause(rec.id))
    assert backend.run(backend.impl.destroy(rec.id)) is True
    assert wait_until(lambda: not backend.traces(rec.id), timeout=5), backend.traces(rec.id)
