"""``dsec shell`` and ``dsec exec -i/-t``: a local terminal (or stdin) wired to a sandbox.

With a terminal (``tty``) the local one goes to raw mode: every keystroke goes to the
sandbox's pty as typed (^C, ^Z, ^D are the remote program's, as over ssh), the screen
comes back as produced, a local resize is forwarded, and the local terminal is restored
however the session ends. Ctrl-P Ctrl-Q detaches from a named terminal (docker's keys);
it keeps running and ``dsec shell ID`` attaches to it again.

Without a terminal, stdin is streamed to the command (EOF closes its stdin) and its
stdout and stderr come back on ours.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import termios
import tty as ttymod
from collections.abc import Sequence
from typing import Any

DETACH_KEYS = b"\x10\x11"  # Ctrl-P Ctrl-Q


def _size() -> tuple[int, int]:
    try:
        sz = os.get_terminal_size(sys.stdout.fileno())
        return max(1, sz.lines), max(1, sz.columns)
    except OSError:
        return 24, 80


async def _session(url: str | None, token: str | None, sandbox_id: str, cmd: Sequence[str] | str | None, *,
                   use_tty: bool, name: str | None, cwd: str, user: str, env: dict[str, str]) -> int:
    from dsec.sdk import AsyncClient

    async with AsyncClient(url, token) as c:
        sb = await c.connect(sandbox_id)
        if use_tty:
            rows, cols = _size()
            term_env = {"TERM": os.environ.get("TERM", "xterm-256color"), **env}
            term = await sb.pty(cmd, rows=rows, cols=cols, name=name, env=term_env, cwd=cwd, user=user)
        else:
            if cmd is None:
                cmd = ["/bin/sh", "-c", "if command -v bash >/dev/null 2>&1; then exec bash; else exec sh; fi"]
            term = await sb.attach(cmd, env=env, cwd=cwd, user=user)
        if name is not None and sys.stderr.isatty():
            what = "attached to the running" if not term.new else "new"
            print(f"[{what} terminal {name!r} in {sandbox_id}: Ctrl-P Ctrl-Q detaches, `exit` ends it]",
                  file=sys.stderr, end="\r\n" if use_tty else "\n", flush=True)
        return await _pump(term, use_tty=use_tty, detachable=name is not None)


async def _pump(term: Any, *, use_tty: bool, detachable: bool) -> int:
    loop = asyncio.get_running_loop()
    stdin = sys.stdin.fileno()
    out = sys.stdout.buffer
    err = sys.stderr.buffer
    inbox: asyncio.Queue[bytes | None] = asyncio.Queue()
    detached = False

    def on_stdin() -> None:
        try:
            data = os.read(stdin, 65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            loop.remove_reader(stdin)
        inbox.put_nowait(data or None)

    async def send_input() -> None:
        nonlocal detached
        pending = b""
        while True:
            data = await inbox.get()
            if data is None:
                await term.eof()
                return
            if detachable:
                data = pending + data
                pending = b""
                if DETACH_KEYS in data:
                    before = data[: data.index(DETACH_KEYS)]
                    if before:
                        await term.send(before)
                    detached = True
                    await term.detach()
                    return
                if data.endswith(DETACH_KEYS[:1]):
                    pending, data = data[-1:], data[:-1]
            if data:
                await term.send(data)

    async def show_output() -> None:
        async for chunk in term.output():
            stream = out if chunk.stream == "stdout" else err
            stream.write(chunk.data)
            stream.flush()

    os.set_blocking(stdin, False)
    loop.add_reader(stdin, on_stdin)
    if use_tty:
        loop.add_signal_handler(signal.SIGWINCH, lambda: asyncio.ensure_future(term.resize(*_size())))
    sender = asyncio.ensure_future(send_input())
    try:
        await show_output()
    finally:
        with contextlib.suppress(Exception):
            loop.remove_reader(stdin)
        if use_tty:
            loop.remove_signal_handler(signal.SIGWINCH)
        sender.cancel()
        with contextlib.suppress(BaseException):
            await sender
        os.set_blocking(stdin, True)
        with contextlib.suppress(Exception):
            await term.close()
    if detached:
        if sys.stderr.isatty():
            print(f"\r\n[detached from terminal {term.name!r}: `dsec shell {term.sandbox.id}` attaches again]",
                  file=sys.stderr, end="\r\n")
        return 0
    ex = term.exit
    if ex is None:
        print("dsec: the connection to the sandbox closed before the command ended", file=sys.stderr)
        return 255
    if ex.exit_code is not None:
        return int(ex.exit_code)
    return 128 + int(ex.signal or 0)


def run_interactive(sandbox_id: str, cmd: Sequence[str] | str | None, *, use_tty: bool, name: str | None = None,
                    cwd: str = "/", user: str = "0", env: dict[str, str] | None = None) -> int:
    """Run the session; returns the exit code to leave with (the command's, or 128+signal)."""
    from dsec.cli.paths import local_token

    url, token = os.environ.get("DSEC_URL"), local_token()
    saved = None
    if use_tty and sys.stdin.isatty():
        saved = termios.tcgetattr(sys.stdin.fileno())
        ttymod.setraw(sys.stdin.fileno())
    try:
        return asyncio.run(_session(url, token, sandbox_id, cmd, use_tty=use_tty, name=name, cwd=cwd, user=user,
                                    env=env or {}))
    finally:
        if saved is not None:
            termios.tcsetattr(sys.stdin.fileno(), termios.TCSADRAIN, saved)
