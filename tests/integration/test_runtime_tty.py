"""Interactive terminals: a real pty inside the sandbox, job control, resize, exit status."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from typing import Any

import pytest

from conftest import RuntimeHarness, mountinfo_lines
from dsec.backends.base import TtySize, set_tty_size
from dsec.backends.container.procs import Process
from dsec.errors import InvalidSpec

pytestmark = pytest.mark.root


class Term:
    """The host side of one pty: type, and wait for the screen to show something."""

    def __init__(self, h: RuntimeHarness, proc: Process, master: int) -> None:
        self.h, self.proc, self.master = h, proc, master
        self.screen = b""

    def type(self, data: bytes) -> None:
        os.write(self.master, data)

    def wait_for(self, pattern: bytes, timeout: float = 10.0) -> bytes:
        """Read until ``pattern`` (a regex) shows in what arrived since the last match."""
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
            except OSError:  # EIO: the slave side is closed (the shell exited)
                raise AssertionError(f"terminal closed before {pattern!r}; screen: {self.screen[-500:]!r}") from None
            self.screen += chunk

    def exit_status(self, timeout: float = 10.0) -> Any:
        return self.h.run(asyncio.wait_for(asyncio.shield(self.proc.exited), timeout))

    def close(self) -> None:
        if not self.proc.exited.done():
            self.proc.kill()
        os.close(self.master)


def _term(h: RuntimeHarness, sid: str, argv: list[str] | None = None, **kw: Any) -> Term:
    proc, master = h.run(h.rt.start_tty(sid, argv or ["/bin/sh"], size=kw.pop("size", TtySize(24, 80)), **kw))
    return Term(h, proc, master)


def _devpts_mounts() -> int:
    return sum(1 for ln in mountinfo_lines() if " - devpts " in ln)


def test_shell_on_a_pty_has_job_control_and_exit_status(rtx: RuntimeHarness, sb: Any) -> None:
    t = _term(rtx, sb.id, env={"PS1": "PROMPT$ "})
    try:
        t.wait_for(rb"PROMPT\$ ")
        t.type(b"tty; echo isatty=$(test -t 0 && echo yes)\n")
        out = t.wait_for(rb"isatty=\w+")
        assert b"/dev/pts/0" in out and b"isatty=yes" in out, out
        # ^C reaches the foreground command, not the shell: the session goes on.
        # (Once "running" shows, the shell has made the command the foreground job.)
        t.type(b"sh -c 'echo run''ning; exec sleep 100'\n")
        t.wait_for(rb"running")
        t.type(b"\x03")
        t.wait_for(rb"PROMPT\$ ")
        t.type(b"echo rc=$?\n")
        assert b"rc=130" in t.wait_for(rb"rc=\d+"), "sleep was not interrupted by ^C"
        # Input reaches an interactive program line by line.
        t.type(b"read line; echo got:$line\n")
        time.sleep(0.2)
        t.type(b"hello\n")
        assert b"got:hello" in t.wait_for(rb"got:\w+")
        # Resize: the shell sees it.
        set_tty_size(t.master, TtySize(40, 100))
        t.type(b"stty size\n")
        assert b"40 100" in t.wait_for(rb"\d+ \d+\r?\n")
        # ^D on an empty line ends `cat`; the exit status of the whole shell is real.
        t.type(b"cat\n")
        time.sleep(0.2)
        t.type(b"\x04")
        t.wait_for(rb"PROMPT\$ ")
        t.type(b"exit 3\n")
        ex = t.exit_status()
        assert ex.exit_code == 3
    finally:
        t.close()


def test_terminal_owner_and_devpts_only_on_demand(rtx: RuntimeHarness) -> None:
    before = _devpts_mounts()
    with rtx.sandbox() as rec:
        # No devpts at create (a superblock per sandbox costs the whole node, docs/PERFORMANCE.md).
        assert "devpts" not in rtx.ok(rec.id, "cat /proc/self/mountinfo")
        t = _term(rtx, rec.id, ["/bin/sh", "-c", "ls -ln $(tty); sleep 30"], user="1000:1000")
        try:
            out = t.wait_for(rb"/dev/pts/\d+\r?\n")
            # The pty belongs to the command's user inside, group tty (5).
            fields = out.decode().split()
            assert fields[2:4] == ["1000", "5"], out
        finally:
            t.close()
        # The devpts is the sandbox's own: a second terminal reuses it.
        t = _term(rtx, rec.id, ["/bin/sh", "-c", "echo n=$(ls /dev/pts | wc -l); sleep 30"])
        try:
            t.wait_for(rb"n=\d+")
        finally:
            t.close()
        assert rtx.ok(rec.id, "grep -c devpts /proc/self/mountinfo").strip() == "1"
        # Nothing shows on the host.
        assert _devpts_mounts() == before
    assert _devpts_mounts() == before


def test_a_killed_terminal_process_closes_the_master(rtx: RuntimeHarness, sb: Any) -> None:
    t = _term(rtx, sb.id, ["/bin/sh", "-c", "echo ready; exec sleep 100"])
    try:
        t.wait_for(rb"ready")
        t.proc.kill()
        ex = t.exit_status()
        assert ex.signal == signal.SIGKILL
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                if os.read(t.master, 4096) == b"":
                    break
            except BlockingIOError:
                time.sleep(0.05)
            except OSError:
                break  # EIO: no slave left
        else:
            raise AssertionError("the master never reported the slave gone")
    finally:
        t.close()


def test_bad_terminal_sizes_are_refused() -> None:
    for rows, cols in ((0, 80), (24, 0), (-1, 5), (24, 100_000)):
        with pytest.raises(InvalidSpec, match="rows and cols"):
            TtySize(rows, cols)


def test_commands_do_not_inherit_the_hosts_ignored_signals(make_runtime: Any) -> None:
    """A `dsec up &` from a script starts with SIGINT and SIGQUIT ignored (and nohup adds
    SIGHUP): ignored signals survive execve, so without a reset every command in every
    sandbox would ignore them (^C on a terminal would not stop anything)."""
    ignored = (signal.SIGINT, signal.SIGQUIT, signal.SIGHUP)
    saved = {s: signal.signal(s, signal.SIG_IGN) for s in ignored}
    try:
        h = make_runtime("sigign").start()  # its spawner starts now, with them ignored
        try:
            with h.sandbox() as rec:
                saved_now = {s: signal.signal(s, saved[s]) for s in ignored}  # the test process back to normal
                assert all(v == signal.SIG_IGN for v in saved_now.values())
                status = h.ok(rec.id, ["cat", "/proc/self/status"])
                sig_ign = int(next(ln.split()[1] for ln in status.splitlines() if ln.startswith("SigIgn:")), 16)
                for s in ignored:
                    assert not sig_ign & (1 << (s - 1)), f"{signal.Signals(s).name} ignored in the sandbox: {sig_ign:#x}"
                t = _term(h, rec.id, env={"PS1": "P$ "})
                try:
                    t.wait_for(rb"P\$ ")
                    t.type(b"sh -c 'echo run''ning; exec sleep 100'\n")
                    t.wait_for(rb"running")
                    t.type(b"\x03")
                    t.wait_for(rb"P\$ ")
                    t.type(b"echo rc=$?\n")
                    assert b"rc=130" in t.wait_for(rb"rc=\d+")
                finally:
                    t.close()
        finally:
            h.close()
    finally:
        for s, v in saved.items():
            signal.signal(s, v)
