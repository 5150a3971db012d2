"""Running commands in a sandbox: results, timeouts, stdin, env/cwd/user, streaming, sessions."""

from __future__ import annotations

import asyncio
import hashlib
import signal
import time

import pytest

from conftest import RuntimeHarness, pid_alive, proc_cmdline, wait_until
from dsec.errors import ExecError, ExecTimeout, InvalidSpec, SandboxNotFound, SessionClosed

pytestmark = pytest.mark.root


def _cmdlines(h: RuntimeHarness, sid: str) -> dict[int, list[str]]:
    return {p: proc_cmdline(p) for p in h.pids(sid)}


# ---------------------------------------------------------------- results ----


def test_exit_codes_signals_and_streams(rtx: RuntimeHarness, sb) -> None:
    r = rtx.sh(sb.id, "echo out; echo err >&2; exit 3")
    assert (r.exit_code, r.signal) == (3, None)
    assert r.stdout == b"out\n" and r.stderr == b"err\n"
    assert r.stdout_bytes == 4 and r.stderr_bytes == 4 and not r.truncated
    assert not r.ok
    r = rtx.sh(sb.id, "kill -TERM $$")
    assert (r.exit_code, r.signal) == (None, signal.SIGTERM)
    r = rtx.sh(sb.id, "kill -KILL $$")
    assert (r.exit_code, r.signal) == (None, signal.SIGKILL)
    r = rtx.sh(sb.id, ["true"])
    assert r.ok and r.duration_s >= 0
    # argv is passed verbatim, no shell in between.
    r = rtx.sh(sb.id, ["printf", "%s|", "a b", "'c'", "$HOME", "*"])
    assert r.stdout == b"a b|'c'|$HOME|*|"
    # Binary output survives.
    r = rtx.sh(sb.id, "printf '\\000\\001\\377'")
    assert r.stdout == b"\x00\x01\xff"


def test_concurrent_execs_in_one_sandbox(rtx: RuntimeHarness, sb) -> None:
    async def many() -> list:
        return await asyncio.gather(*(rtx.rt.exec(sb.id, f"sleep 0.2; echo {i}", timeout=30) for i in range(20)))

    t0 = time.monotonic()
    results = rtx.run(many())
    assert [r.stdout for r in results] == [f"{i}\n".encode() for i in range(20)]
    assert time.monotonic() - t0 < 3.5  # they ran side by side, not one after another (20 x 0.2 s = 4 s)


# --------------------------------------------------------------- timeouts ----

TREE = (
    "sh -c 'trap \"\" TERM; sleep 1001' & "  # a background child that ignores SIGTERM
    "(trap '' TERM; sleep 1002 & wait) & "  # a grandchild under a TERM-ignoring subshell
    "(sh -c 'trap \"\" TERM HUP; sleep 1003' &) ; "  # orphaned at once: reparented to the sandbox init
    "echo started; sleep 1000"
)


def test_timeout_kills_the_whole_tree(rtx: RuntimeHarness, sb) -> None:
    t0 = time.monotonic()
    with pytest.raises(ExecTimeout) as ei:
        rtx.sh(sb.id, TREE, timeout=1.0)
    assert time.monotonic() - t0 < 8
    err = ei.value
    assert err.reason == "timeout" and err.timeout == 1.0 and err.sandbox_id == sb.id
    assert err.result.timed_out == "timeout"
    assert err.result.stdout == b"started\n"  # partial output is kept
    assert err.result.signal == signal.SIGKILL

    def tree_left() -> dict[int, list[str]]:
        return {p: c for p, c in _cmdlines(rtx, sb.id).items() if any(a.startswith("100") for a in c[-1:])}

    assert wait_until(lambda: not tree_left(), timeout=3), f"left behind: {tree_left()}"
    assert rtx.pids(sb.id) == [sb.init_pid]
    assert pid_alive(sb.init_pid)
    assert rtx.ok(sb.id, "echo alive").strip() == "alive"


def test_timeout_kills_detached_processes_too(rtx: RuntimeHarness, sb) -> None:
    """A process that leaves the process group and the tree (setsid + orphaned) is still
    the command's: it sits in the command's own freezer cgroup, which a timeout empties.
    Background jobs of a command that ended normally are left alone."""
    rtx.sh(sb.id, "setsid sleep 1201 & sleep 1202 & echo ok", timeout=10)
    with pytest.raises(ExecTimeout):
        rtx.sh(sb.id, "setsid sh -c 'sleep 1301' & (setsid sleep 1302 &) ; sleep 1300", timeout=1.0)

    def sleeping() -> set[str]:
        return {c[-1] for c in _cmdlines(rtx, sb.id).values() if c and c[0] == "sleep"}

    assert wait_until(lambda: sleeping() == {"1201", "1202"}, timeout=3), sleeping()


def test_idle_timeout(rtx: RuntimeHarness, sb) -> None:
    t0 = time.monotonic()
    with pytest.raises(ExecTimeout) as ei:
        rtx.sh(sb.id, "echo start; sleep 30", idle_timeout=0.5, timeout=20)
    assert time.monotonic() - t0 < 5
    assert ei.value.reason == "idle_timeout"
    assert ei.value.result.timed_out == "idle_timeout"
    assert ei.value.result.stdout == b"start\n"
    # Output keeps an idle timer from firing, however long the command runs.
    r = rtx.sh(sb.id, "for i in 1 2 3 4 5 6; do echo $i; sleep 0.2; done", idle_timeout=0.8, timeout=20)
    assert r.ok and r.stdout.split() == [b"1", b"2", b"3", b"4", b"5", b"6"]
    assert rtx.pids(sb.id) == [sb.init_pid]


def test_bad_timeouts_are_refused(rtx: RuntimeHarness, sb) -> None:
    for bad in (0, -1):
        with pytest.raises(InvalidSpec) as ei:
            rtx.sh(sb.id, "true", timeout=bad)
        assert ei.value.field == "timeout"
    # None means no timeout at all (and the call still returns).
    assert rtx.sh(sb.id, "echo x", timeout=None).stdout == b"x\n"


# ------------------------------------------------------------------ stdin ----


def test_stdin_is_delivered(rtx: RuntimeHarness, sb) -> None:
    r = rtx.sh(sb.id, "cat", stdin=b"hello\nworld\n")
    assert r.stdout == b"hello\nworld\n"
    big = bytes(range(256)) * 8192  # 2 MiB: more than a pipe holds
    r = rtx.sh(sb.id, "sha256sum; ", stdin=big)
    assert r.stdout.split()[0].decode() == hashlib.sha256(big).hexdigest()
    # No stdin: EOF at once, never a hang.
    r = rtx.sh(sb.id, "cat; echo done", timeout=10)
    assert r.stdout == b"done\n"
    # A command that ignores its stdin does not block the writer.
    r = rtx.sh(sb.id, "echo early", stdin=big, timeout=10)
    assert r.stdout == b"early\n"


# ---------------------------------------------------------- env, cwd, user ----


def test_env_cwd_and_user(rtx: RuntimeHarness) -> None:
    with rtx.sandbox(env={"FROM_SPEC": "spec", "BOTH": "spec"}) as sb:
        r = rtx.ok(sb.id, 'echo "$FROM_SPEC|$BOTH|$FOO|$HOME|$PATH"', env={"BOTH": "exec", "FOO": "bar baz"})
        fields = r.rstrip("\n").split("|")
        assert fields[:4] == ["spec", "exec", "bar baz", "/root"]
        assert "/bin" in fields[4].split(":")
        assert rtx.ok(sb.id, "pwd", cwd="/tmp").strip() == "/tmp"
        assert rtx.ok(sb.id, "pwd").strip() == "/"
        assert rtx.ok(sb.id, "id -u; id -g", user=1000).split() == ["1000", "1000"]
        assert rtx.ok(sb.id, "id -u; id -g", user="1000:2000").split() == ["1000", "2000"]
        assert rtx.ok(sb.id, "id -u", user="root").strip() == "0"
        assert rtx.ok(sb.id, "id -u", user="65534").strip() == "65534"
        # user 1000 is an ordinary user: root's files are closed to it.
        r = rtx.sh(sb.id, "ls /root", user=1000)
        assert r.exit_code != 0 and b"Permission denied" in r.stderr
        r = rtx.sh(sb.id, "echo x > /etc/passwd", user=1000)
        assert r.exit_code != 0
        assert rtx.ok(sb.id, "touch /tmp/mine; stat -c %u /tmp/mine", user=1000).strip() == "1000"


def test_exec_errors_are_typed_and_clear(rtx: RuntimeHarness, sb) -> None:
    with pytest.raises(ExecError) as ei:
        rtx.sh(sb.id, ["no-such-binary-xyz", "arg"])
    assert "no-such-binary-xyz" in str(ei.value) and ei.value.stage == "exec" and ei.value.errno == 2
    with pytest.raises(ExecError) as ei:
        rtx.sh(sb.id, ["/bin/not-here"])
    assert "/bin/not-here" in str(ei.value)
    with pytest.raises(ExecError) as ei:
        rtx.sh(sb.id, "pwd", cwd="/does/not/exist")
    assert "/does/not/exist" in str(ei.value) and ei.value.stage == "cwd"
    with pytest.raises(ExecError) as ei:
        rtx.sh(sb.id, ["/etc/passwd"])  # not executable
    assert ei.value.errno == 13
    for bad_user in ("alice", "1000:bob", -1, 70000, "65536"):
        with pytest.raises(InvalidSpec) as ei2:
            rtx.sh(sb.id, "true", user=bad_user)
        assert ei2.value.field == "user"
    with pytest.raises(InvalidSpec):
        rtx.sh(sb.id, "pwd", cwd="relative/dir")
    with pytest.raises(InvalidSpec):
        rtx.sh(sb.id, [])
    with pytest.raises(InvalidSpec):
        rtx.sh(sb.id, "true", env={"A=B": "x"})
    with pytest.raises(SandboxNotFound):
        rtx.sh("sb-does-not-exist", "true")
    # None of that left a process behind, and the sandbox works.
    assert rtx.pids(sb.id) == [sb.init_pid]
    assert rtx.ok(sb.id, "echo ok").strip() == "ok"


# -------------------------------------------------------------- streaming ----


def test_output_is_streamed_as_produced(rtx: RuntimeHarness, sb) -> None:
    seen: list[tuple[float, str, bytes]] = []
    t0 = time.monotonic()
    r = rtx.sh(
        sb.id, "for i in 1 2 3; do echo out$i; echo err$i >&2; sleep 0.3; done",
        on_output=lambda stream, chunk: seen.append((time.monotonic() - t0, stream, chunk)),
    )
    assert r.ok
    assert b"".join(c for _, s, c in seen if s == "stdout") == r.stdout == b"out1\nout2\nout3\n"
    assert b"".join(c for _, s, c in seen if s == "stderr") == r.stderr == b"err1\nerr2\nerr3\n"
    first_out = min(t for t, s, _ in seen if s == "stdout")
    assert first_out < r.duration_s - 0.4, (first_out, r.duration_s)  # arrived before the end


# --------------------------------------------------------------- sessions ----


def test_session_keeps_shell_state(rtx: RuntimeHarness, sb) -> None:
    async def go() -> None:
        s1 = await rtx.rt.open_session(sb.id)
        s2 = await rtx.rt.open_session(sb.id)
        try:
            r = await s1.run("cd /tmp && export X=42 && f() { echo fn-$1; }; Y=local")
            assert r.exit_code == 0
            r = await s1.run('pwd; echo "$X $Y"; f a')
            assert r.stdout == b"/tmp\n42 local\nfn-a\n", r
            r = await s1.run("false")
            assert r.exit_code == 1
            r = await s1.run("echo to-err >&2; (exit 7)")
            assert (r.exit_code, r.stderr) == (7, b"to-err\n")
            # Sessions are independent of each other.
            r = await s2.run('pwd; echo "[$X]"')
            assert r.stdout == b"/\n[]\n"
            # A command cannot eat the session's protocol from stdin.
            r = await s1.run("cat; echo after-cat", timeout=5)
            assert r.stdout == b"after-cat\n"
            # A timeout kills the command, not the session.
            with pytest.raises(ExecTimeout):
                await s1.run("sleep 1000", timeout=0.5)
            r = await s1.run("echo $X; pwd")
            assert r.stdout == b"42\n/tmp\n"
            assert not any("1000" in " ".join(proc_cmdline(p)) for p in rtx.pids(sb.id))
            assert len(rtx.rt.sessions(sb.id)) == 2
        finally:
            await s1.close()
            await s1.close()  # idempotent
        with pytest.raises(SessionClosed):
            await s1.run("true")
        # The shell itself exiting ends the session with a typed error too.
        await s2.run("exit 3")
        with pytest.raises(SessionClosed):
            await s2.run("true")
        await s2.close()

    rtx.run(go())
    assert wait_until(lambda: rtx.pids(sb.id) == [sb.init_pid], timeout=3), rtx.pids(sb.id)
