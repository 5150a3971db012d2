"""`dsec shell` and `dsec exec -i/-t` driven from a real local terminal (a pty), as a person types."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import cli_all_in_one

pytestmark = pytest.mark.root
DSEC = [sys.executable, "-m", "dsec.cli.main"]


@pytest.fixture(scope="module")
def up() -> Iterator[dict[str, str]]:
    with cli_all_in_one("dsec-test-cli-") as ready:
        yield ready


@pytest.fixture()
def sid(up: dict[str, str]) -> Iterator[str]:
    r = subprocess.run([*DSEC, "create", "busybox"], env=up, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    yield r.stdout.strip()
    subprocess.run([*DSEC, "rm", r.stdout.strip()], env=up, capture_output=True, timeout=60)


class LocalTerminal:
    """A CLI process on a pty of our own: what a person's terminal emulator gives it."""

    def __init__(self, env: dict[str, str], *args: str) -> None:
        self.master, slave = os.openpty()
        os.set_blocking(self.master, False)
        self.proc = subprocess.Popen([*DSEC, *args], env={**env, "TERM": "xterm"}, stdin=slave, stdout=slave,
                                     stderr=slave, start_new_session=True)
        os.close(slave)
        self.screen = b""

    def type(self, data: bytes) -> None:
        os.write(self.master, data)

    def wait_for(self, pattern: bytes, timeout: float = 20.0) -> bytes:
        deadline = time.monotonic() + timeout
        while not (m := re.search(pattern, self.screen)):
            if time.monotonic() > deadline:
                raise AssertionError(f"{pattern!r} never showed; screen: {self.screen[-800:]!r}")
            try:
                self.screen += os.read(self.master, 65536)
            except BlockingIOError:
                time.sleep(0.02)
            except OSError:
                time.sleep(0.02)
        seen, self.screen = self.screen[: m.end()], self.screen[m.end():]
        return seen

    def exit_code(self, timeout: float = 20.0) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            os.close(self.master)


def test_shell_is_a_real_terminal(up: dict[str, str], sid: str) -> None:
    t = LocalTerminal(up, "shell", sid)
    t.wait_for(rb"new terminal 'shell'")
    t.wait_for(rb"# ")
    t.type(b"tty\r")
    assert re.search(rb"/dev/pts/\d+", t.wait_for(rb"/dev/pts/\d+"))
    # ^C interrupts the remote command; the client and the session stay.
    t.type(b"sh -c 'echo run''ning; exec sleep 100'\r")
    t.wait_for(rb"running")  # the shell has made it the foreground job
    t.type(b"\x03")
    t.wait_for(rb"# ")
    t.type(b"echo rc=$?\r")
    assert b"rc=130" in t.wait_for(rb"rc=\d+")
    # Output shows while the command runs.
    t.type(b"echo one; sleep 2; echo two\r")
    t.wait_for(rb"one\r\n")
    assert b"two" not in t.screen
    t.wait_for(rb"two")
    # Ctrl-P Ctrl-Q detaches: the client exits 0, the shell (and its state) stays.
    t.type(b"cd /tmp; K=kept\r")
    t.wait_for(rb"# ")
    t.type(b"\x10\x11")
    t.wait_for(rb"detached from terminal 'shell'")
    assert t.exit_code() == 0
    t = LocalTerminal(up, "shell", sid)
    t.wait_for(rb"attached to the running terminal 'shell'")
    t.type(b"echo k=$K pwd=$(pwd)\r")
    assert b"k=kept pwd=/tmp" in t.wait_for(rb"k=\w+ pwd=\S+")
    # `exit N` ends the shell and dsec shell exits with N; nothing Python shows up.
    t.type(b"exit 3\r")
    assert t.exit_code() == 3
    assert b"Traceback" not in t.screen and b"Aborted" not in t.screen


def test_exec_tty_and_piped_stdin(up: dict[str, str], sid: str) -> None:
    t = LocalTerminal(up, "exec", "-t", sid, "--", "sh", "-c", "read -p 'name? ' n; echo hello-$n; exit 9")
    t.wait_for(rb"name\? ")
    t.type(b"ada\r")
    assert b"hello-ada" in t.wait_for(rb"hello-\w+")
    assert t.exit_code() == 9
    # A pipe is forwarded as stdin (it was /dev/null before), stdout and stderr kept apart.
    r = subprocess.run([*DSEC, "exec", sid, "--", "sh", "-c", "while read l; do echo o:$l; echo e:$l >&2; done; exit 5"],
                       env=up, input="a\nb\n", capture_output=True, text=True, timeout=60)
    assert (r.returncode, r.stdout, r.stderr) == (5, "o:a\no:b\n", "e:a\ne:b\n")
    # --no-stdin: the command reads nothing.
    r = subprocess.run([*DSEC, "exec", "--no-stdin", sid, "--", "sh", "-c", "cat; echo end"], env=up, input="x\n",
                       capture_output=True, text=True, timeout=60)
    assert (r.returncode, r.stdout) == (0, "end\n")
    # Lines piped to `dsec shell` are run by the sandbox's shell.
    r = subprocess.run([*DSEC, "shell", sid], env=up, input="cd /etc; echo in-$(pwd)\nexit 4\n", capture_output=True,
                       text=True, timeout=60)
    assert (r.returncode, r.stdout) == (4, "in-/etc\n"), r.stderr
    # -t without a terminal is a usage error, in one line.
    r = subprocess.run([*DSEC, "exec", "-t", sid, "--", "true"], env=up, stdin=subprocess.DEVNULL,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "-t needs a terminal" in r.stderr and "Traceback" not in r.stderr


def test_exec_stdin_sources(up: dict[str, str], sid: str, tmp_path: Path) -> None:
    # A file on stdin goes with the request (the lean path: --timeout and --output-cap still apply).
    f = tmp_path / "in.txt"
    f.write_bytes(b"line1\nline2\n")
    with f.open("rb") as fh:
        r = subprocess.run([*DSEC, "exec", "--timeout", "30", sid, "--", "sh", "-c", "wc -l; exit 3"], env=up,
                           stdin=fh, capture_output=True, text=True, timeout=60)
    assert (r.returncode, r.stdout.strip()) == (3, "2"), r.stderr
    # A pipe nobody has written to (an agent harness's inherited stdin) is not waited for.
    p = subprocess.Popen([*DSEC, "exec", sid, "--", "echo", "no-wait"], env=up, stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert p.stdin is not None and p.stdout is not None and p.stderr is not None
    try:
        out, err = p.stdout.read(), p.stderr.read()  # to EOF, with our end of its stdin still open
        assert p.wait(30) == 0 and out == b"no-wait\n", err
    finally:
        p.stdin.close()
    # -i streams such a pipe anyway: a producer that starts later is read as it writes.
    p = subprocess.Popen([*DSEC, "exec", "-i", sid, "--", "sh", "-c", "read a; echo got-$a"], env=up,
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    time.sleep(1.0)
    out, err = p.communicate(b"late\n", timeout=60)
    assert (p.returncode, out) == (0, b"got-late\n"), err
