"""Exec: argv and shell commands, env, cwd, user, stdin, exit codes and signals, timeouts that
kill the whole process tree, the output cap, streamed output with backpressure, typed errors
for commands that cannot start."""

from __future__ import annotations

import asyncio
import hashlib
import secrets
import signal
import time
from typing import Any

import pytest

from dsec.backends.base import Capability
from dsec.errors import DsecError, ExecError, ExecTimeout, SandboxFailed, Unsupported

from .conftest import BackendHarness, host_processes_running, wait_until

pytestmark = [pytest.mark.root, pytest.mark.timeout(90), pytest.mark.requires(Capability.EXEC)]

N = 10_000 + secrets.randbelow(80_000)
"""Sleeps in this module last ``<digit><N>`` seconds: names no other process on the host has."""


def test_argv_is_passed_verbatim(backend: BackendHarness, sb: Any) -> None:
    r = backend.sh(sb.id, ["printf", "%s|", "a b", "'c'", "$HOME", "*", ""])
    assert (r.exit_code, r.stdout) == (0, b"a b|'c'|$HOME|*||"), r
    r = backend.sh(sb.id, ["/bin/sh", "-c", 'echo "$0-$1"', "zero", "one"])
    assert r.stdout == b"zero-one\n", r


def test_a_string_is_a_shell_command(backend: BackendHarness, sb: Any) -> None:
    r = backend.sh(sb.id, "x=6; echo $((x * 7)) | tr 4 y; echo err >&2")
    assert (r.exit_code, r.stdout, r.stderr) == (0, b"y2\n", b"err\n"), r
    assert (r.stdout_bytes, r.stderr_bytes, r.truncated) == (3, 4, False), r
    r = backend.sh(sb.id, "printf '\\000\\001\\377'")  # binary output is kept as bytes
    assert r.stdout == b"\x00\x01\xff", r


def test_env_merges_the_specs_and_the_commands(backend: BackendHarness) -> None:
    with backend.sandbox(env={"FROM_SPEC": "spec", "BOTH": "spec"}) as sb:
        out = backend.ok(sb.id, 'echo "$FROM_SPEC|$BOTH|$FOO"', env={"BOTH": "exec", "FOO": "bar baz"})
        assert out == "spec|exec|bar baz\n"
        assert "/bin" in backend.ok(sb.id, "echo $PATH").strip().split(":")
        assert backend.ok(sb.id, 'echo "[$FOO]"') == "[]\n"  # an exec's env is its own


def test_cwd(backend: BackendHarness, sb: Any) -> None:
    assert backend.ok(sb.id, "pwd", cwd="/tmp") == "/tmp\n"
    assert backend.ok(sb.id, ["pwd"], cwd="/usr/bin") == "/usr/bin\n"
    assert backend.ok(sb.id, "pwd") == "/\n"


def test_user_by_uid_and_by_name(backend: BackendHarness, sb: Any) -> None:
    assert backend.ok(sb.id, "id -u; id -g", user=1000).split() == ["1000", "1000"]
    assert backend.ok(sb.id, "id -u", user="1000").strip() == "1000"
    assert backend.ok(sb.id, "id -u; id -un", user="root").split() == ["0", "root"]
    assert backend.ok(sb.id, "id -u").strip() == "0"
    # An ordinary user really is one: root's files are closed to it, and what it makes is its own.
    r = backend.sh(sb.id, "echo x >> /etc/passwd", user=1000)
    assert r.exit_code != 0, r
    assert backend.ok(sb.id, "touch /tmp/mine && stat -c %u /tmp/mine", user=1000).strip() == "1000"


def test_stdin_bytes(backend: BackendHarness, sb: Any) -> None:
    assert backend.sh(sb.id, "cat", stdin=b"hello\n\x00world").stdout == b"hello\n\x00world"
    big = bytes(range(256)) * 8192  # 2 MiB: more than any pipe holds
    r = backend.sh(sb.id, "sha256sum", stdin=big)
    assert r.stdout.split()[0].decode() == hashlib.sha256(big).hexdigest(), r
    assert backend.sh(sb.id, "cat; echo eof", timeout=10).stdout == b"eof\n"  # no stdin: EOF at once
    assert backend.sh(sb.id, "echo early", stdin=big, timeout=10).stdout == b"early\n"  # unread stdin


def test_exit_codes(backend: BackendHarness, sb: Any) -> None:
    for code in (0, 1, 3, 126, 255):
        r = backend.sh(sb.id, f"exit {code}")
        assert (r.exit_code, r.signal, r.ok) == (code, None, code == 0), r
    assert backend.sh(sb.id, ["false"]).exit_code == 1


def test_signal_exit(backend: BackendHarness, sb: Any) -> None:
    r = backend.sh(sb.id, "kill -TERM $$")
    assert (r.exit_code, r.signal) == (None, signal.SIGTERM), r
    r = backend.sh(sb.id, "echo before; kill -KILL $$")
    assert (r.exit_code, r.signal, r.stdout) == (None, signal.SIGKILL, b"before\n"), r
    assert r.limit is None, r  # a command's own SIGKILL is not a limit


def _timeout_kills(backend: BackendHarness, sid: str, sleeps: list[str], cmd: str) -> None:
    """Run ``cmd`` (which starts ``sleep <s>`` for each of ``sleeps``, prints "started", then
    waits) with a 2 s timeout: it raises ExecTimeout with the partial output, every sleep is
    gone afterwards, inside the sandbox and on the host, and the sandbox lives on."""

    async def go() -> tuple[ExecTimeout, bytes, dict[str, list[int]]]:
        run = asyncio.ensure_future(backend.impl.exec(sid, cmd, timeout=2.0))
        await asyncio.sleep(0.8)
        inside = await backend.impl.exec(sid, ["ps", "-o", "args"], timeout=10)
        on_host = {s: host_processes_running(["sleep", s]) for s in sleeps}
        with pytest.raises(ExecTimeout) as ei:
            await run
        return ei.value, inside.stdout, on_host

    t0 = time.monotonic()
    err, inside, on_host = backend.run(go())
    assert time.monotonic() - t0 < 10
    assert all(f"sleep {s}".encode() in inside for s in sleeps), inside  # they were running
    assert err.reason == "timeout" and err.timeout == 2.0 and err.sandbox_id == sid, err.fields
    res = err.result
    assert res.timed_out == "timeout" and res.stdout == b"started\n" and res.signal == signal.SIGKILL, res
    assert res.limit is not None and (res.limit.kind, res.limit.value) == ("timeout", 2.0), res

    def host_left() -> list[int]:
        return [p for s in sleeps for p in host_processes_running(["sleep", s])]

    assert wait_until(lambda: not host_left(), timeout=5), f"left on the host: {host_left()} (before: {on_host})"
    left = [p for s in sleeps for p in backend.sandbox_processes(sid, f"sleep {s}")]
    assert left == [], f"left in the sandbox: {left}"
    assert backend.ok(sid, "echo alive") == "alive\n"


def test_a_timeout_kills_the_whole_tree(backend: BackendHarness, sb: Any) -> None:
    """Background children, one ignoring SIGTERM, one under a subshell, one orphaned at once."""
    s = [f"{d}{N}" for d in "1234"]
    _timeout_kills(backend, sb.id, s, f"sh -c 'trap \"\" TERM; sleep {s[0]}' & "
                                      f"(trap '' TERM; sleep {s[1]} & wait) & "
                                      f"(sh -c 'trap \"\" TERM HUP; sleep {s[2]}' &) ; "
                                      f"echo started; sleep {s[3]}")


def test_a_timeout_kills_processes_that_left_the_session(backend: BackendHarness, sb: Any) -> None:
    """``setsid``: out of the command's session and process group, and orphaned; still the command's."""
    s = [f"{d}{N}" for d in "67"]
    _timeout_kills(backend, sb.id, s, f"(setsid sleep {s[0]} &) ; setsid sh -c 'sleep {s[1]}' & "
                                      "echo started; sleep 1000")


def test_idle_timeout(backend: BackendHarness, sb: Any) -> None:
    t0 = time.monotonic()
    try:
        with pytest.raises(ExecTimeout) as ei:
            backend.sh(sb.id, f"echo start; sleep 5{N}", idle_timeout=0.5, timeout=20)
    except Unsupported as exc:
        pytest.skip(f"backend {backend.kind.name} has no idle timeout: {exc}")
    assert time.monotonic() - t0 < 8
    assert ei.value.reason == "idle_timeout" and ei.value.result.timed_out == "idle_timeout", ei.value.fields
    assert ei.value.result.stdout == b"start\n"
    assert backend.sandbox_processes(sb.id, f"5{N}") == []
    # Output keeps it from firing, however long the command runs.
    r = backend.sh(sb.id, "for i in 1 2 3 4 5 6; do echo $i; sleep 0.2; done", idle_timeout=0.8, timeout=20)
    assert r.ok and r.stdout.split() == [b"1", b"2", b"3", b"4", b"5", b"6"], r


def test_output_cap_keeps_head_and_tail(backend: BackendHarness, sb: Any) -> None:
    cmd = ("printf HEAD; yes | head -c 100000; printf TAIL; "
           "printf head >&2; yes e | head -c 50000 >&2; printf tail >&2")
    r = backend.sh(sb.id, cmd, output_cap=4096)
    assert r.exit_code == 0 and r.truncated, r
    assert (r.stdout_bytes, r.stderr_bytes) == (100_008, 50_008), r
    assert r.stdout.startswith(b"HEAD") and r.stdout.endswith(b"TAIL"), r.stdout[:20] + r.stdout[-20:]
    assert r.stderr.startswith(b"head") and r.stderr.endswith(b"tail"), r.stderr[:20] + r.stderr[-20:]
    assert 8192 <= len(r.stdout) < 8192 + 200 and 8192 <= len(r.stderr) < 8192 + 200, (len(r.stdout), len(r.stderr))
    assert r.limit is not None and (r.limit.kind, r.limit.value) == ("output_cap", 4096), r.limit
    r = backend.sh(sb.id, "yes | head -c 8192", output_cap=4096)  # exactly head + tail: nothing cut
    assert not r.truncated and r.stdout == b"y\n" * 4096 and r.limit is None, r


def test_output_is_streamed_in_order_before_the_result(backend: BackendHarness, sb: Any) -> None:
    seen: list[tuple[float, str, bytes]] = []
    t0 = time.monotonic()
    r = backend.sh(sb.id, "for i in 1 2 3 4; do echo out$i; echo err$i >&2; sleep 0.3; done",
                   on_output=lambda stream, chunk: seen.append((time.monotonic() - t0, stream, chunk)))
    assert r.ok, r
    assert b"".join(c for _, s, c in seen if s == "stdout") == r.stdout == b"out1\nout2\nout3\nout4\n"
    assert b"".join(c for _, s, c in seen if s == "stderr") == r.stderr == b"err1\nerr2\nerr3\nerr4\n"
    first = min(t for t, s, _ in seen if s == "stdout")
    assert first < r.duration_s - 0.6, (first, r.duration_s)  # arrived while it ran, not at the end
    assert {s for _, s, _ in seen} == {"stdout", "stderr"}


def test_a_full_consumer_pauses_reading_without_losing_bytes(backend: BackendHarness, sb: Any) -> None:
    """The consumer answers its 1st and 40th chunk with a future it resolves 0.7 s later: no
    chunk comes meanwhile, the command waits on its full pipe, and every byte arrives in order."""
    count = 1_000_000
    expected = b"".join(b"%d\n" % i for i in range(1, count + 1))  # 6.9 MB
    calls: list[float] = []
    pauses: list[tuple[float, float]] = []
    got = bytearray()
    hold = 0.7

    def consume(stream: str, chunk: bytes) -> asyncio.Future[None] | None:
        now = time.monotonic()
        calls.append(now)
        assert stream == "stdout", (stream, chunk[:200])
        got.extend(chunk)
        if len(calls) in (1, 40):
            loop = asyncio.get_running_loop()
            fut: asyncio.Future[None] = loop.create_future()
            loop.call_later(hold, fut.set_result, None)
            pauses.append((now, now + hold))
            return fut
        return None

    r = backend.sh(sb.id, f"seq 1 {count}", on_output=consume, output_cap=16 << 20, timeout=60)
    assert r.ok, r
    assert len(pauses) == 2, len(calls)
    assert bytes(got) == expected, (len(got), len(expected))
    assert r.stdout == expected and r.stdout_bytes == len(expected) and not r.truncated
    for start, end in pauses:
        during = [t for t in calls if start < t < end - 0.05]
        assert not during, f"{len(during)} chunks arrived while the consumer was full"
    assert r.duration_s >= 2 * hold - 0.1, r.duration_s  # the command itself was held back


@pytest.mark.parametrize("argv", [["no-such-binary-xyz", "arg"], ["/bin/not-here"]])
def test_a_missing_binary_is_an_exec_error(backend: BackendHarness, sb: Any, argv: list[str]) -> None:
    with pytest.raises(DsecError) as ei:
        backend.sh(sb.id, argv)
    assert type(ei.value) is ExecError, repr(ei.value)
    assert argv[0] in str(ei.value) and ei.value.sandbox_id == sb.id
    assert backend.ok(sb.id, "echo fine") == "fine\n"


def test_a_missing_cwd_is_an_exec_error(backend: BackendHarness, sb: Any) -> None:
    with pytest.raises(DsecError) as ei:
        backend.sh(sb.id, "pwd", cwd="/does/not/exist")
    assert type(ei.value) is ExecError and not isinstance(ei.value, SandboxFailed), repr(ei.value)
    assert "/does/not/exist" in str(ei.value)
    with pytest.raises(ExecError):
        backend.sh(sb.id, "pwd", cwd="/etc/passwd")  # not a directory
    assert backend.ok(sb.id, "echo fine") == "fine\n"
