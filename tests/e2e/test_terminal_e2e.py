"""Terminals and streamed stdin through the SDK: ``sb.pty()``, ``sb.attach()``, named reattach."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from typing import TypeVar

import pytest

from conftest import ClusterHarness as Harness
from conftest import in_process_cluster
from dsec import AsyncTerminal, Client, ImageRef, Resources, SandboxSpec
from dsec.errors import InvalidSpec, SandboxNotFound

pytestmark = pytest.mark.root
T = TypeVar("T")

SPEC = SandboxSpec(image=ImageRef(base="busybox:latest"), resources=Resources(cpu=0.5, memory=128 << 20, disk=32 << 20))


@pytest.fixture(scope="module")
def svc() -> Iterator[Harness]:
    with in_process_cluster("dsec-test-term-") as h:
        yield h


class Screen:
    """Collects a terminal's output; ``until`` waits for a pattern in what arrived."""

    def __init__(self, term: AsyncTerminal) -> None:
        self.term = term
        self.buf = b""
        self._it = term.output().__aiter__()

    async def until(self, pattern: bytes, timeout: float = 15.0) -> bytes:
        async def read() -> bytes:
            while not (m := re.search(pattern, self.buf)):
                chunk = await self._it.__anext__()
                self.buf += chunk.data
            seen, self.buf = self.buf[: m.end()], self.buf[m.end():]
            return seen

        return await asyncio.wait_for(read(), timeout)

    async def rest(self) -> bytes:
        async for chunk in self._it:
            self.buf += chunk.data
        return self.buf


def test_pty_shell_job_control_resize_and_exit(svc: Harness) -> None:
    async def go() -> None:
        async with svc.client() as c, await c.create(SPEC) as sb, \
                await sb.pty(rows=30, cols=90, env={"PS1": "P$ "}) as term:
                scr = Screen(term)
                await scr.until(rb"P\$ ")
                await term.send("stty size; tty\n")
                out = await scr.until(rb"/dev/pts/\d+")
                assert b"30 90" in out, out
                await term.send("sh -c 'echo run''ning; exec sleep 100'\n")
                await scr.until(rb"running")  # the shell made it the foreground job
                await term.send(b"\x03")  # ^C: the foreground job, not the shell
                await scr.until(rb"P\$ ")
                await term.send("echo rc=$?\n")
                assert b"rc=130" in await scr.until(rb"rc=\d+")
                await term.resize(50, 120)
                await term.send("stty size\n")
                assert b"50 120" in await scr.until(rb"50 120|\d+ \d+\r\n")
                # Output arrives while the command runs, not when it ends.
                await term.send("echo first; sleep 3; echo second\n")
                await scr.until(rb"first\r\n")
                assert b"second" not in scr.buf
                await scr.until(rb"second")
                await term.send("exit 7\n")
                await scr.rest()
                assert term.exit is not None and term.exit.exit_code == 7

    svc.run(go())


def test_named_terminal_survives_the_connection_and_replays(svc: Harness) -> None:
    async def go() -> None:
        async with svc.client() as c, await c.create(SPEC) as sb:
            term = await sb.pty(name="work", env={"PS1": "W$ "})
            assert term.new
            scr = Screen(term)
            await scr.until(rb"W\$ ")
            await term.send("cd /tmp; X=kept; echo marker-$X\n")
            await scr.until(rb"marker-kept")
            await term.close()  # the connection goes; the shell stays
            again = await sb.pty(name="work")
            assert not again.new and again.pid == term.pid
            scr2 = Screen(again)
            await scr2.until(rb"marker-kept")  # the recent screen is replayed
            await again.send("echo pwd=$(pwd) x=$X\n")
            assert b"pwd=/tmp x=kept" in await scr2.until(rb"pwd=\S+ x=\w+")
            await again.detach()
            # Listed while it runs; gone once its shell exits.
            r = await sb._request("GET", "/terminals")
            assert [t["name"] for t in r.json()] == ["work"]
            last = await sb.pty(name="work")
            await last.send("exit\n")
            await last.wait()
            assert last.exit is not None and last.exit.exit_code == 0
            r = await sb._request("GET", "/terminals")
            assert r.json() == []
            # The event log tells who attached to what, who left it running, and how it ended.
            evs = [e for e in await sb.events() if str(e.get("event", "")).startswith("terminal_")]
            kinds = [(e["event"], e.get("new"), e.get("still_running"), e.get("exit_code")) for e in evs]
            assert kinds[0] == ("terminal_attached", True, None, None), kinds
            assert ("terminal_left", None, True, None) in kinds and ("terminal_attached", False, None, None) in kinds
            assert kinds[-1] == ("terminal_ended", None, None, 0), kinds
            assert all(e.get("name") == "work" for e in evs)

    svc.run(go())


def test_attach_streams_stdin_and_separates_stderr(svc: Harness) -> None:
    async def go() -> None:
        async with svc.client() as c, await c.create(SPEC) as sb:
            term = await sb.attach(["sh", "-c", "while read l; do echo out:$l; echo err:$l >&2; done; exit 4"])
            chunks: list[tuple[str, bytes]] = []

            async def collect() -> None:
                async for ch in term.output():
                    chunks.append((ch.stream, ch.data))

            reader = asyncio.ensure_future(collect())
            await term.send(b"a\n")
            await asyncio.sleep(0.3)
            # Line one comes back before stdin ends: it is streamed, not sent at the end.
            assert b"out:a" in b"".join(d for s, d in chunks if s == "stdout")
            await term.send(b"b\n")
            await term.eof()
            await asyncio.wait_for(reader, 15)
            assert b"".join(d for s, d in chunks if s == "stdout") == b"out:a\nout:b\n"
            assert b"".join(d for s, d in chunks if s == "stderr") == b"err:a\nerr:b\n"
            assert term.exit is not None and term.exit.exit_code == 4
            # A CPU-bound command reports its CPU time.
            burn = await sb.attach(["sh", "-c", "i=0; while [ $i -lt 300000 ]; do i=$((i+1)); done"])
            ex = await burn.wait()
            assert ex.exit_code == 0 and ex.cpu_user_s + ex.cpu_system_s > 0.05, ex

    svc.run(go())


def test_bad_requests_are_typed_errors(svc: Harness) -> None:
    async def go() -> None:
        async with svc.client() as c, await c.create(SPEC) as sb:
            with pytest.raises(InvalidSpec, match=r"rows|cols|less than or equal"):
                await sb.pty(rows=0)
            with pytest.raises(InvalidSpec, match="name"):
                await sb.pty(name="bad name!")
            sid = sb.id
        with pytest.raises((SandboxNotFound, Exception)) as ei:
            await sb.pty()
        assert "Traceback" not in str(ei.value)
        assert sid

    svc.run(go())


def test_sync_client_has_the_terminal_too(svc: Harness) -> None:
    def sync() -> int | None:
        with Client(svc.cluster.url, svc.cluster.admin_token) as c, c.create(SPEC) as sb:
            term = sb.pty(["sh", "-c", "read x; echo got-$x; exit 2"])
            term.send("hi\n")
            return term.wait().exit_code

    # The cluster's loop runs on this thread: the blocking client runs beside it.
    assert svc.run(asyncio.to_thread(sync)) == 2


def test_exec_results_carry_cpu_time_and_start_latency(svc: Harness) -> None:
    async def go() -> None:
        async with svc.client() as c, await c.create(SPEC) as sb:
            busy = await sb.exec("i=0; while [ $i -lt 300000 ]; do i=$((i+1)); done")
            idle = await sb.exec("sleep 0.3")
            # CPU time is the command's own (rusage), not wall time and not zero.
            assert busy.cpu_user_s + busy.cpu_system_s > 0.05, busy
            assert idle.cpu_user_s + idle.cpu_system_s < 0.05, idle
            assert idle.duration_s >= 0.3
            assert 0 < busy.start_latency_s < busy.duration_s, busy

    svc.run(go())
