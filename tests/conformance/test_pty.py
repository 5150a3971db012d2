"""Terminals: ``start_tty`` runs a command on a new pseudo-terminal in the sandbox and hands back
its process and the terminal's master. Keys written to the master reach the program (it is on a
tty, of the size asked for, with env, cwd and user honoured), what it prints comes back whole;
a resize changes the size it reads and signals it (SIGWINCH); ^C reaches the foreground job, not
the shell; the exit status arrives; killing the process ends what it started."""

from __future__ import annotations

import asyncio
import os
import re
import secrets
import time
from collections.abc import Iterator
from typing import Any

import pytest

from dsec.backends.base import Capability, TtySize, set_tty_size
from dsec.errors import InvalidSpec

from .conftest import BackendHarness, wait_until

pytestmark = [pytest.mark.root, pytest.mark.timeout(90), pytest.mark.requires(Capability.PTY)]

N = 10_000 + secrets.randbelow(80_000)


class Term:
    """The host side of one terminal: type, and wait for the screen to show something."""

    def __init__(self, backend: BackendHarness, proc: Any, master: int) -> None:
        self.backend, self.proc, self.master = backend, proc, master
        self.screen = b""

    def type(self, data: bytes) -> None:
        os.write(self.master, data)

    def wait_for(self, pattern: bytes, timeout: float = 15.0) -> bytes:
        """Read until ``pattern`` (a regex) shows in what arrived since the last match; returns
        everything up to the match's end."""
        deadline = time.monotonic() + timeout
        while True:
            m = re.search(pattern, self.screen)
            if m:
                seen, self.screen = self.screen[: m.end()], self.screen[m.end():]
                return seen
            if time.monotonic() > deadline:
                raise AssertionError(f"{pattern!r} never showed; screen: {self.screen[-500:]!r}")
            try:
                chunk = os.read(self.master, 65536)
            except BlockingIOError:
                time.sleep(0.02)
                continue
            except OSError:  # EIO: the terminal's other side is closed (the program exited)
                raise AssertionError(f"terminal closed before {pattern!r}; screen: {self.screen[-500:]!r}") from None
            self.screen += chunk

    def exit(self, timeout: float = 15.0) -> Any:
        return self.backend.run(asyncio.wait_for(asyncio.shield(self.proc.exited), timeout))

    def close(self) -> None:
        if not self.proc.exited.done():
            self.proc.kill()
            self.exit()
        os.close(self.master)


@pytest.fixture
def term(backend: BackendHarness, sb: Any) -> Iterator[Term]:
    proc, master = backend.run(backend.impl.start_tty(sb.id, ["/bin/sh"], size=TtySize(30, 100),
                                                      env={"PS1": "PROMPT$ "}))
    t = Term(backend, proc, master)
    try:
        t.wait_for(rb"PROMPT\$ ")
        yield t
    finally:
        t.close()


def test_keys_in_screen_out_on_a_tty_of_the_size_asked(term: Term) -> None:
    term.type(b"tty; test -t 0 && test -t 1 && echo isatty=yes; stty size; echo $((6 * 7))\n")
    out = term.wait_for(rb"\n42\r?\n")
    assert re.search(rb"/dev/pts/\d+", out) and b"isatty=yes" in out, out
    assert re.search(rb"\n30 100\r?\n", out), out


def test_output_comes_back_whole(term: Term) -> None:
    term.type(b"head -c 200000 /dev/zero | tr '\\000' a; echo; echo END-OF-A\n")
    out = term.wait_for(rb"\nEND-OF-A\r?\n")
    assert out.count(b"a") >= 200000, out.count(b"a")  # (plus the echoed command line's)
    assert re.search(rb"a{200000}", out), "the run of 200000 'a' arrived broken"


def test_resize_changes_the_size_and_signals_the_program(term: Term) -> None:
    # The foreground program traps SIGWINCH (the shell's own line editor would take it at a prompt).
    term.type(b"sh -c 'trap \"echo GOT-WINCH; stty size\" WINCH; echo ar''med; while :; do sleep 0.2; done'\n")
    term.wait_for(rb"armed\r?\n")
    set_tty_size(term.master, TtySize(50, 132))
    term.wait_for(rb"GOT-WINCH\r?\n50 132\r?\n")
    term.type(b"\x03")
    term.wait_for(rb"PROMPT\$ ")
    term.type(b"stty size\n")
    term.wait_for(rb"\n50 132\r?\n")


def test_ctrl_c_reaches_the_foreground_job_not_the_shell(backend: BackendHarness, sb: Any, term: Term) -> None:
    term.type(f"echo run''ning; sleep 4{N}\n".encode())
    term.wait_for(rb"running")
    assert wait_until(lambda: bool(backend.sandbox_processes(sb.id, f"sleep 4{N}")), timeout=5)
    term.type(b"\x03")
    term.wait_for(rb"PROMPT\$ ")
    assert wait_until(lambda: not backend.sandbox_processes(sb.id, f"sleep 4{N}"), timeout=5)
    term.type(b"echo still-$((1 + 1))\n")
    term.wait_for(rb"still-2")
    assert not term.proc.exited.done()


def test_the_exit_status_arrives(term: Term) -> None:
    term.type(b"exit 7\n")
    status = term.exit()
    assert (status.exit_code, status.signal) == (7, None), status


def test_env_cwd_and_user(backend: BackendHarness, sb: Any) -> None:
    proc, master = backend.run(backend.impl.start_tty(sb.id, ["/bin/sh", "-c", 'echo "[$GREETING] $(pwd) $(id -u)"'],
                                                      size=TtySize(), env={"GREETING": "hi"}, cwd="/tmp", user=1000))
    t = Term(backend, proc, master)
    try:
        assert b"[hi] /tmp 1000" in t.wait_for(rb"\[hi\][^\n]*\n")
        assert t.exit().exit_code == 0
    finally:
        t.close()


def test_killing_the_terminal_ends_what_it_started(backend: BackendHarness, sb: Any, term: Term) -> None:
    term.type(f"sleep 5{N} & sleep 6{N}\n".encode())
    assert wait_until(lambda: len(backend.sandbox_processes(sb.id, f"{N}")) == 2, timeout=5)
    term.proc.kill()
    status = term.exit()
    assert status.exit_code != 0 or status.signal is not None, status
    assert wait_until(lambda: not backend.sandbox_processes(sb.id, f"{N}"), timeout=5), \
        backend.sandbox_processes(sb.id, f"{N}")
    assert backend.ok(sb.id, "echo sandbox-alive") == "sandbox-alive\n"


def test_two_terminals_are_independent(backend: BackendHarness, sb: Any, term: Term) -> None:
    proc, master = backend.run(backend.impl.start_tty(sb.id, ["/bin/sh"], size=TtySize(10, 40),
                                                      env={"PS1": "OTHER$ "}))
    other = Term(backend, proc, master)
    try:
        other.wait_for(rb"OTHER\$ ")
        other.type(b"X=other; stty size; tty\n")
        out_other = other.wait_for(rb"/dev/pts/\d+")
        term.type(b"echo \"[$X]\"; stty size; tty\n")
        out = term.wait_for(rb"/dev/pts/\d+")
        assert b"10 40" in out_other and b"30 100" in out and b"[]" in out, (out, out_other)
        assert re.findall(rb"/dev/pts/\d+", out)[-1] != re.findall(rb"/dev/pts/\d+", out_other)[-1]
    finally:
        other.close()


def test_a_bad_size_is_invalid(backend: BackendHarness, sb: Any) -> None:
    with pytest.raises(InvalidSpec):
        TtySize(0, 80)
    with pytest.raises(InvalidSpec):
        backend.run(backend.impl.start_tty(sb.id, [], size=TtySize()))
