"""Sessions: a persistent shell whose state (cwd, variables, functions) carries from one
command to the next, each command with its own exit code; a timeout kills the command, not
the session; closing ends the shell and what it started."""

from __future__ import annotations

import secrets
from typing import Any

import pytest

from dsec.backends.base import Capability
from dsec.errors import ExecTimeout, SessionClosed

from .conftest import BackendHarness, host_processes_running, wait_until

pytestmark = [pytest.mark.root, pytest.mark.timeout(90), pytest.mark.requires(Capability.SESSIONS)]

N = 10_000 + secrets.randbelow(80_000)


def test_state_carries_across_commands(backend: BackendHarness, sb: Any) -> None:
    async def go() -> None:
        s = await backend.impl.open_session(sb.id)
        other = await backend.impl.open_session(sb.id)
        try:
            r = await s.run("cd /tmp && export X=42 && f() { echo fn-$1; }; Y=local")
            assert r.exit_code == 0, r
            r = await s.run('pwd; echo "$X $Y"; f a')
            assert (r.exit_code, r.stdout) == (0, b"/tmp\n42 local\nfn-a\n"), r
            r = await other.run('pwd; echo "[$X]"')  # sessions do not share state
            assert r.stdout == b"/\n[]\n", r
        finally:
            await s.close()
            await other.close()

    backend.run(go())


def test_each_command_has_its_exit_code(backend: BackendHarness, sb: Any) -> None:
    async def go() -> None:
        s = await backend.impl.open_session(sb.id)
        try:
            assert (await s.run("false")).exit_code == 1
            r = await s.run("echo to-err >&2; (exit 7)")
            assert (r.exit_code, r.stdout, r.stderr) == (7, b"", b"to-err\n"), r
            assert (await s.run("true")).exit_code == 0
            r = await s.run("cat; echo after-cat", timeout=10)  # a command cannot eat the session's input
            assert (r.exit_code, r.stdout) == (0, b"after-cat\n"), r
        finally:
            await s.close()

    backend.run(go())


def test_session_env_cwd_and_user(backend: BackendHarness, sb: Any) -> None:
    async def go() -> None:
        s = await backend.impl.open_session(sb.id, env={"GREETING": "hi"}, cwd="/tmp", user=1000)
        try:
            r = await s.run('echo "$GREETING"; pwd; id -u')
            assert r.stdout.split() == [b"hi", b"/tmp", b"1000"], r
        finally:
            await s.close()

    backend.run(go())


def test_a_timeout_kills_the_command_not_the_session(backend: BackendHarness, sb: Any) -> None:
    async def go() -> None:
        s = await backend.impl.open_session(sb.id)
        try:
            await s.run("cd /usr && export KEEP=yes")
            with pytest.raises(ExecTimeout) as ei:
                await s.run(f"echo partial; sleep 1{N}", timeout=0.7)
            assert ei.value.sandbox_id == sb.id
            res = ei.value.fields.get("result")
            assert res is None or res.stdout.startswith(b"partial"), res
            r = await s.run('echo "$KEEP"; pwd')
            assert (r.exit_code, r.stdout) == (0, b"yes\n/usr\n"), r
        finally:
            await s.close()

    backend.run(go())
    assert wait_until(lambda: not host_processes_running(["sleep", f"1{N}"]), timeout=5)
    assert backend.sandbox_processes(sb.id, f"1{N}") == []


def test_closing_ends_the_shell_and_its_children(backend: BackendHarness, sb: Any) -> None:
    async def go() -> Any:
        s = await backend.impl.open_session(sb.id)
        r = await s.run(f"sleep 2{N} >/dev/null 2>&1 & echo started")
        assert r.stdout == b"started\n", r
        running = await backend.impl.exec(sb.id, ["ps", "-o", "args"], timeout=10)
        assert f"sleep 2{N}".encode() in running.stdout, running.stdout
        await s.close()
        await s.close()  # idempotent
        with pytest.raises(SessionClosed):
            await s.run("echo after close")
        return s

    backend.run(go())
    assert wait_until(lambda: not backend.sandbox_processes(sb.id, f"2{N}"), timeout=5), \
        backend.sandbox_processes(sb.id, f"2{N}")
    assert not host_processes_running(["sleep", f"2{N}"])
    assert backend.ok(sb.id, "echo sandbox-alive") == "sandbox-alive\n"
