"""``ExecResult.limit``: which limit ended a command, judged from kernel evidence (issue 10).

Every limit is hit for real on the real kernel (no counters faked): a shell that grows
past its memory limit, a fork loop at the pids limit, commands past their timeouts, ``yes``
past the output cap, ``dd`` past the writable layer's quota. Commands that fail or die for
their own reasons carry no limit, even right after a limit was hit in the same sandbox.
"""

from __future__ import annotations

import shlex
import signal
from typing import get_args

import pytest

from conftest import MiB, RuntimeHarness, wait_until
from dsec.errors import ExecTimeout
from dsec.spec import Resources

pytestmark = pytest.mark.root

HOG = "x=$(head -c 400000000 /dev/zero | tr '\\0' a); echo ${#x}"
"""A shell holding 400 MB in a variable: anonymous memory no page cache can stand in for."""


def _kinds(rtx: RuntimeHarness, sid: str) -> list[str]:
    return [str(e["event"]) for e in rtx.rt.events(sid)]


def test_plain_results_carry_no_limit(rtx: RuntimeHarness, sb) -> None:
    assert rtx.sh(sb.id, "true").limit is None
    r = rtx.sh(sb.id, "echo no >&2; exit 1")
    assert (r.exit_code, r.limit) == (1, None)
    r = rtx.sh(sb.id, "kill -9 $$")  # SIGKILL, but not by the OOM killer
    assert (r.signal, r.limit) == (signal.SIGKILL, None)
    r = rtx.sh(sb.id, "exit 137")  # a shell's "child died by SIGKILL" status, no OOM either
    assert (r.exit_code, r.limit) == (137, None)


def test_memory_limit(rtx: RuntimeHarness) -> None:
    with rtx.sandbox(memory=64 * MiB) as sb:
        r = rtx.sh(sb.id, HOG)
        assert r.signal == signal.SIGKILL and r.exit_code is None, r
        assert r.limit is not None and r.limit.kind == "memory", r
        assert r.limit.value == 64 * MiB
        assert r.limit.message == "dsec: killed by the memory limit (64 MiB): raise it with --memory / Resources.memory"
        assert "\n" not in r.limit.message
        assert "oom" in _kinds(rtx, sb.id)  # the audit's event, from the same read
        ended = [e for e in rtx.rt.events(sb.id) if e["event"] == "exec_ended"][-1]
        assert ended["limit"] == "memory"
        # A shell reporting its child's OOM kill (exit 137) is the same verdict.
        r = rtx.sh(sb.id, f"sh -c {shlex.quote(HOG)}; exit $?")
        assert r.exit_code == 137 and r.limit is not None and r.limit.kind == "memory", r
        # The counter grew before this command, not during it: no verdict.
        r = rtx.sh(sb.id, "kill -9 $$")
        assert r.signal == signal.SIGKILL and r.limit is None, r
        assert rtx.sh(sb.id, "exit 1").limit is None


def test_pids_limit(rtx: RuntimeHarness) -> None:
    with rtx.sandbox(pids=16) as sb:
        r = rtx.sh(sb.id, "i=0; while [ $i -lt 100 ]; do sleep 60 >/dev/null 2>&1 & i=$((i+1)); done", timeout=60)
        assert r.exit_code != 0, r
        assert r.limit is not None and r.limit.kind == "pids", r
        assert r.limit.value == 16
        assert r.limit.message == "dsec: the pids limit (16 processes) refused a fork: raise it with --pids / Resources.pids"
        assert "pids_limit" in _kinds(rtx, sb.id)
        # The sleeps still fill the cgroup, but this command forks nothing: no verdict.
        assert rtx.sh(sb.id, "exit 1").limit is None
        rtx.sh(sb.id, ["killall", "-9", "sleep"])
        assert wait_until(lambda: len(rtx.pids(sb.id)) <= 2, timeout=5), rtx.pids(sb.id)
        assert rtx.sh(sb.id, "echo a | cat").limit is None


def test_timeouts(rtx: RuntimeHarness, sb) -> None:
    with pytest.raises(ExecTimeout) as ei:
        rtx.sh(sb.id, "sleep 30", timeout=0.5)
    hit = ei.value.result.limit
    assert hit is not None and (hit.kind, hit.value) == ("timeout", 0.5)
    assert hit.message == "dsec: killed by the timeout (0.5 s): raise it with --timeout / timeout="
    with pytest.raises(ExecTimeout) as ei:
        rtx.sh(sb.id, "echo started; sleep 30", timeout=30, idle_timeout=0.4)
    hit = ei.value.result.limit
    assert hit is not None and (hit.kind, hit.value) == ("idle_timeout", 0.4)
    assert "no output for 0.4 s" in hit.message and "idle_timeout=" in hit.message


def test_output_cap(rtx: RuntimeHarness, sb) -> None:
    r = rtx.sh(sb.id, "yes | head -c 1000000", output_cap=4096)
    assert r.exit_code == 0 and r.truncated, r
    assert r.limit is not None and (r.limit.kind, r.limit.value) == ("output_cap", 4096)
    assert "(4 KiB" in r.limit.message and "--output-cap / SandboxSpec.output_cap" in r.limit.message
    assert rtx.sh(sb.id, "yes | head -c 1000", output_cap=4096).limit is None


_MEDIUM = Resources.model_fields.get("disk_medium")
MEDIA: tuple[str | None, ...] = get_args(_MEDIUM.annotation) if _MEDIUM is not None else (None,)
"""Every medium a writable layer can have (None: the one there is)."""


@pytest.mark.parametrize("medium", MEDIA)
def test_disk_full(rtx: RuntimeHarness, medium: str | None) -> None:
    with rtx.sandbox(disk=8 * MiB, **({} if medium is None else {"disk_medium": medium})) as sb:
        r = rtx.sh(sb.id, "dd if=/dev/zero of=/tmp/big bs=1M count=20")
        assert r.exit_code != 0, r
        assert b"No space left on device" in r.stderr or b"Disk quota exceeded" in r.stderr, r
        assert r.limit is not None and (r.limit.kind, r.limit.value) == ("disk_full", 8 * MiB), r
        assert r.limit.message == "dsec: the writable layer is full (disk quota 8 MiB): raise it with --disk / Resources.disk"
        # A command that succeeds on a full layer was not ended by it; one that fails for
        # its own reasons neither; one that fails writing again was.
        assert rtx.sh(sb.id, "echo still here").limit is None
        assert rtx.sh(sb.id, "exit 3").limit is None
        r = rtx.sh(sb.id, "echo more >> /tmp/big")
        assert r.exit_code != 0 and r.limit is not None and r.limit.kind == "disk_full", r
        # On the disk medium a quota's usage is counted at the next commit: sync makes it now.
        rtx.ok(sb.id, "rm -f /tmp/big && sync")
        assert rtx.sh(sb.id, "exit 1").limit is None


def test_session_commands_carry_limits(rtx: RuntimeHarness) -> None:
    with rtx.sandbox(memory=64 * MiB) as sb:
        async def go() -> list[object]:
            sess = await rtx.rt.open_session(sb.id)
            try:
                hog = await sess.run(f"sh -c {shlex.quote(HOG)}")
                plain = await sess.run("false")
                try:
                    await sess.run("sleep 30", timeout=0.5)
                except ExecTimeout as exc:
                    slow = exc.fields["result"]
                return [hog, plain, slow]
            finally:
                await rtx.rt.close_session(sb.id, sess.id)

        hog, plain, slow = rtx.run(go())
        assert hog.exit_code == 137 and hog.limit is not None and hog.limit.kind == "memory", hog
        assert plain.exit_code == 1 and plain.limit is None, plain
        assert slow.limit is not None and (slow.limit.kind, slow.limit.value) == ("timeout", 0.5), slow
