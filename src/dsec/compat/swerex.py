"""SWE-ReX on DSec: ``DSecDeployment`` and ``DSecRuntime`` (swe-rex 1.4.0).

SWE-ReX's own deployments start a server (``swerex-remote``) inside the container and
talk HTTP to it; the server drives a bash on a pseudo-terminal with pexpect. Here nothing
runs in the sandbox but what the agent runs: each SWE-ReX bash session is one DSec
terminal (``sb.pty``: a real pty, bash with job control) driven from this process by
:class:`_Pty`, a small expect engine with pexpect's matching rules, and
:class:`_BashSession` speaks to it exactly as SWE-ReX's ``BashSession`` speaks to its
pexpect shell: the same PS1 protocol, exit-code probe, ``check`` modes, interactive
``expect``, and interrupt (^C up to ``n_retry`` times, then ^Z and ``kill -9 %1``). The
syntax check that precedes a command (``bash -n``) runs in the sandbox, by its bash, in one
DSec shell session per runtime (pipes keep its stdout and stderr apart, as SWE-ReX reports
them). ``execute`` is a DSec exec, files go through the files API.

Errors are SWE-ReX's (``CommandTimeoutError``, ``NonZeroExitCodeError``,
``BashIncorrectSyntaxError``, ``SessionDoesNotExistError``...) and the builtins its server
would transfer (``FileNotFoundError``; ``pexpect.EOF`` when the shell is gone, as a
RemoteRuntime raises it). Never blocks the event loop; everything is a coroutine on the
SDK's pooled connections.
"""

from __future__ import annotations

import asyncio
import atexit
import codecs
import contextlib
import errno
import functools
import io
import logging
import os
import re
import tarfile
import threading
from collections.abc import Callable, Coroutine
from copy import deepcopy
from pathlib import Path
from typing import Any, Concatenate, Literal, ParamSpec, TypeVar

import pexpect  # type: ignore[import-untyped]  # ships no type information
from pydantic import BaseModel, ConfigDict, Field
from swerex.deployment.abstract import AbstractDeployment
from swerex.deployment.hooks.abstract import CombinedDeploymentHook, DeploymentHook
from swerex.exceptions import (
    BashIncorrectSyntaxError,
    CommandTimeoutError,
    DeploymentNotStartedError,
    DeploymentStartupError,
    NoExitCodeError,
    NonZeroExitCodeError,
    SessionDoesNotExistError,
    SessionExistsError,
)
from swerex.runtime.abstract import (
    AbstractRuntime,
    Action,
    BashAction,
    BashInterruptAction,
    BashObservation,
    CloseBashSessionResponse,
    CloseResponse,
    CloseSessionRequest,
    CloseSessionResponse,
    Command,
    CommandResponse,
    CreateBashSessionRequest,
    CreateBashSessionResponse,
    CreateSessionRequest,
    CreateSessionResponse,
    IsAliveResponse,
    Observation,
    ReadFileRequest,
    ReadFileResponse,
    UploadRequest,
    UploadResponse,
    WriteFileRequest,
    WriteFileResponse,
)
from swerex.runtime.local import _split_bash_command, _strip_control_chars
from websockets.exceptions import ConnectionClosed

from dsec.compat._room import create_with_room
from dsec.errors import (
    Backpressure,
    DsecError,
    ExecError,
    ExecTimeout,
    FileAccessError,
    SessionClosed,
)
from dsec.sdk.client import AsyncClient, AsyncSandbox, AsyncSession
from dsec.sdk.sync import _Portal
from dsec.sdk.terminal import AsyncTerminal
from dsec.spec import ImageRef, NetworkPolicy, Resources, SandboxSpec

__all__ = ["DSecDeployment", "DSecDeploymentConfig", "DSecRuntime"]

SWEREX_VERSION = "1.4.0"
"""The swe-rex release this module implements (pinned in the ``compat`` extra)."""

_READY = "__DSEC_REX_PTY_READY__"
_SHELL_ARGV = ["/bin/sh", "-c", f"stty -echo 2>/dev/null; printf '%s %s\\n' '{_READY}' $$; exec /usr/bin/env bash"]
"""pexpect.spawn('/usr/bin/env bash', echo=False): echo is off before bash starts, so its
readline does not echo either (it echoes only when the terminal did). Nothing is typed
before the ready line: input that arrived while echo was still on would be echoed. The
ready line carries the shell's pid in the sandbox (``exec`` keeps it: bash's), for
:meth:`_BashSession.interrupt`."""

MiB = 1 << 20
T = TypeVar("T")
S = TypeVar("S")
P = ParamSpec("P")


_shared: _Portal | None = None
_shared_lock = threading.Lock()


def _shared_portal() -> _Portal:
    """The process's one loop (a daemon thread) for deployments' sandboxes: callers may come
    from any loop; the sandboxes' connections stay on this one. Stopped at exit."""
    global _shared
    with _shared_lock:
        if _shared is None or not _shared.loop.is_running():
            _shared = _Portal()
            atexit.register(_shared.stop)
        return _shared


async def _on(portal: _Portal | None, coro: Coroutine[Any, Any, T]) -> T:
    """Await ``coro`` on ``portal``'s loop (from any other loop), or here without one."""
    if portal is None or asyncio.get_running_loop() is portal.loop:
        return await coro
    if not portal.loop.is_running():
        coro.close()
        raise DeploymentNotStartedError("the process is shutting down: its DSec loop has stopped")  # type: ignore[no-untyped-call]
    return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, portal.loop))


def _on_portal(fn: Callable[Concatenate[S, P], Coroutine[Any, Any, T]]
               ) -> Callable[Concatenate[S, P], Coroutine[Any, Any, T]]:
    """A method whose work runs on its object's ``_portal`` loop (if it has one)."""

    @functools.wraps(fn)
    async def wrapper(self: S, /, *args: P.args, **kwargs: P.kwargs) -> T:
        return await _on(getattr(self, "_portal", None), fn(self, *args, **kwargs))

    return wrapper


def _logger(name: str) -> logging.Logger:
    """Ours, under ``dsec.compat.swerex``: SWE-ReX's own loggers print to the terminal."""
    return logging.getLogger(f"dsec.compat.swerex.{name}")


# ---------------------------------------------------------------- the pty ----


class _Pty:
    """pexpect's view of a terminal over a DSec terminal: ``send``, ``expect`` and
    ``read_nonblocking`` with its rules — patterns are regular expressions (``re.DOTALL``),
    the earliest match in the buffer wins (ties: the first pattern), ``before`` is what
    preceded it; a timeout keeps the buffer and raises ``pexpect.TIMEOUT``, the end of the
    output ``pexpect.EOF``.

    Output arrives in the background into ``_pending`` (pexpect: still in the pty, not read
    yet); an ``expect`` moves it into ``buffer`` (pexpect's buffer) and searches there."""

    def __init__(self, term: AsyncTerminal) -> None:
        self.term = term
        self.buffer = ""
        self.before = ""
        self.match: re.Match[str] | None = None
        """What the last successful ``expect`` matched (pexpect's ``match``)."""
        self._pending = ""
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="backslashreplace")
        self._arrived = asyncio.Event()
        self.eof = False
        self._pump = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        try:
            async for chunk in self.term.output():
                self._pending += self._decoder.decode(chunk.data)
                self._arrived.set()
        finally:
            self._pending += self._decoder.decode(b"", final=True)
            self.eof = True
            self._arrived.set()

    async def send(self, text: str) -> None:
        if self.eof:
            raise pexpect.EOF("End Of File (EOF): the shell has exited")
        try:
            await self.term.send(text.encode())
        except ConnectionClosed:  # the shell ended before the output said so
            raise pexpect.EOF("End Of File (EOF): the shell has exited") from None

    async def sendline(self, text: str = "") -> None:
        await self.send(text + os.linesep)

    async def _wait(self, deadline: float | None) -> bool:
        """Wait for more output until ``deadline`` (loop time); False when it passed."""
        loop = asyncio.get_running_loop()
        remaining = None if deadline is None else deadline - loop.time()
        if remaining is not None and remaining <= 0:
            return False
        self._arrived.clear()
        if self._pending or self.eof:
            return True
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(remaining):
                await self._arrived.wait()
        return True

    async def expect(self, patterns: list[str], timeout: float | None) -> int:
        compiled = [re.compile(p, re.DOTALL) for p in patterns]
        # A literal cannot match earlier than its length before where a search ended
        # without it: big outputs are searched once, not once per chunk from the start.
        literal = [None if re.escape(p) != p else len(p) for p in patterns]
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        buf, self.buffer = self.buffer, ""  # a local: += grows it in place
        searched = 0
        try:
            while True:
                if self._pending:
                    buf += self._pending
                    self._pending = ""
                best: tuple[int, re.Match[str]] | None = None
                for i, pattern in enumerate(compiled):
                    n = literal[i]
                    m = pattern.search(buf, 0 if n is None else max(0, searched - n + 1))
                    if m is not None and (best is None or m.start() < best[1].start()):
                        best = (i, m)
                if best is not None:
                    index, match = best
                    self.before = buf[: match.start()]
                    self.match = match
                    buf = buf[match.end() :]
                    return index
                searched = len(buf)
                if self.eof and not self._pending:
                    self.before, buf = buf, ""
                    raise pexpect.EOF("End Of File (EOF): the shell has exited")
                if not await self._wait(deadline):
                    self.before = buf
                    raise pexpect.TIMEOUT(f"Timeout exceeded ({timeout} s)")
        finally:
            self.buffer = buf

    async def read_nonblocking(self, timeout: float) -> str:
        """At most one character that no ``expect`` has read yet (pexpect's default size)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not self._pending:
            if self.eof:
                raise pexpect.EOF("End Of File (EOF): the shell has exited")
            if not await self._wait(deadline):
                raise pexpect.TIMEOUT("Timeout exceeded.")
        ch, self._pending = self._pending[:1], self._pending[1:]
        return ch

    async def close(self) -> None:
        """Hang up as pexpect's ``close`` does (bash passes SIGHUP on to its jobs), then go."""
        if not self.eof:
            with contextlib.suppress(Exception):
                await self.term.signal("HUP")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._pump), 2.0)
        with contextlib.suppress(Exception):
            await self.term.close()
        self._pump.cancel()
        with contextlib.suppress(BaseException):
            await self._pump


# ---------------------------------------------------------- bash sessions ----


class _BashSession:
    """SWE-ReX's ``swerex.runtime.local.BashSession`` (1.4.0), step for step, with the
    pexpect shell replaced by :class:`_Pty` and the syntax check run in the sandbox."""

    _UNIQUE_STRING = "UNIQUESTRING29234"

    def __init__(self, runtime: DSecRuntime, request: CreateBashSessionRequest, *,
                 logger: logging.Logger | None = None) -> None:
        self.request = request
        self._runtime = runtime
        self._ps1 = "SHELLPS1PREFIX"
        self._shell: _Pty | None = None
        self._shell_pid: int | None = None
        """bash's pid in the sandbox (from the ready line)."""
        self._lock = asyncio.Lock()
        self.logger = logger or _logger("rex-session")

    @property
    def shell(self) -> _Pty:
        if self._shell is None:
            raise RuntimeError("shell not initialized")
        return self._shell

    def _get_reset_commands(self) -> list[str]:
        return [f"export PS1='{self._ps1}'", "export PS2=''", "export PS0=''"]

    async def start(self) -> CreateBashSessionResponse:
        # The first prompt is not SWE-ReX's PS1 (an image without a bashrc would keep it and
        # the reset line's prompt would be left over for the first command): PS1 is set below.
        env = {"PS1": "", "PS2": "", "PS0": "", "TERM": "dumb", **self._runtime._session_env}
        term = await self._runtime.sandbox.pty(_SHELL_ARGV, env=env, cwd=self._runtime._cwd)
        self._shell = _Pty(term)
        await self.shell.expect([_READY + " ([0-9]+)\r?\n"], timeout=max(30.0, self.request.startup_timeout))
        if self.shell.match is not None:
            self._shell_pid = int(self.shell.match.group(1))
        cmds = []
        if self.request.startup_source:
            cmds += [f"source {path}" for path in self.request.startup_source] + ["sleep 0.3"]
        cmds += self._get_reset_commands()
        await self.shell.sendline(" ; ".join(cmds))
        await self.shell.expect([self._ps1], timeout=self.request.startup_timeout)
        return CreateBashSessionResponse(output=_strip_control_chars(self.shell.before))

    async def _eat_following_output(self, timeout: float = 0.5) -> str:
        await asyncio.sleep(timeout)
        try:
            output = await self.shell.read_nonblocking(timeout=0.1)
        except pexpect.TIMEOUT:
            return ""
        return _strip_control_chars(output)

    async def interrupt(self, action: BashInterruptAction) -> BashObservation:
        output = ""
        expect_strings = [*action.expect, self._ps1]
        for _ in range(action.n_retry):
            await self.shell.send("\x03")  # pexpect's sendintr: the terminal's VINTR
            try:
                expect_index = await self.shell.expect(expect_strings, timeout=action.timeout)
                matched_expect_string = expect_strings[expect_index]
            except Exception:
                await asyncio.sleep(0.2)
                continue
            output += _strip_control_chars(self.shell.before)
            output += await self._eat_following_output()
            output = output.strip()
            return BashObservation(output=output, exit_code=0, expect_string=matched_expect_string)
        # Fall back to putting the job in the background and killing it there:
        try:
            await self.shell.send("\x1a")  # ^Z
            await self.shell.expect(expect_strings, timeout=action.timeout)
            output += self.shell.before
            await self.shell.sendline("kill -9 %1")
            expect_index = await self.shell.expect(expect_strings, timeout=action.timeout)
            matched_expect_string = expect_strings[expect_index]
            output += self.shell.before
            output += await self._eat_following_output()
            await self._reap_killed_job()
            output = output.strip()
            return BashObservation(output=output, exit_code=0, expect_string=matched_expect_string)
        except pexpect.TIMEOUT:
            raise pexpect.TIMEOUT("Failed to interrupt session") from None

    async def _reap_killed_job(self) -> None:
        """Make bash take note of the job ``kill -9 %1`` ended, as SWE-ReX's bash would (it then
        says ``[1]+ Killed ...`` before the next command's prompt).

        bash's own race: ``kill %1`` marks a stopped job "not notified", so before its next
        prompt bash prints ``[1]+ Stopped ...`` again, and while it prints, a SIGCHLD is only
        counted (``notify_of_job_status`` queues it), never acted on. When the killed job dies
        during that print (it takes a scheduling round, ~1 ms: often just then), bash reaps it
        only at its next wait for a child, so a builtin as the next command (``echo``) shows
        no ``Killed`` line: SWE-ReX's ``test_interrupt_pager`` failed 1 in 4 runs here (and 1
        in 10 with pexpect on a local terminal). Half a second after the kill (the job is long
        dead), a SIGCHLD sent to the idle shell runs its handler, which reaps what is waiting
        and leaves the notice to the next prompt, as when the race goes the other way; when
        nothing is waiting it is a no-op. The kill is sent from a command of its own (bash's
        pid came with the ready line): the terminal's signals reach its foreground job."""
        if self._shell_pid is None:
            return
        with contextlib.suppress(Exception):  # best effort: the session goes on without it
            await self._runtime.sandbox.exec(["/bin/sh", "-c", f"kill -s CHLD {self._shell_pid}"], timeout=10)

    async def run(self, action: BashAction | BashInterruptAction) -> BashObservation:
        async with self._lock:  # one command at a time, as SWE-ReX's server serves them
            if isinstance(action, BashInterruptAction):
                return await self.interrupt(action)
            if action.is_interactive_command or action.is_interactive_quit:
                return await self._run_interactive(action)
            r = await self._run_normal(action)
            if action.check == "raise" and r.exit_code != 0:
                msg = f"Command {action.command!r} failed with exit code {r.exit_code}. Here is the output:\n{r.output!r}"
                if action.error_msg:
                    msg = f"{action.error_msg}: {msg}"
                raise NonZeroExitCodeError(msg)
            return r

    async def _run_interactive(self, action: BashAction) -> BashObservation:
        """No PS1 seeking and no exit code: the command goes to a running program."""
        await self.shell.sendline(action.command)
        expect_strings = [*action.expect, self._ps1]
        try:
            expect_index = await self.shell.expect(expect_strings, timeout=action.timeout)
            matched_expect_string = expect_strings[expect_index]
        except pexpect.TIMEOUT as e:
            msg = f"timeout after {action.timeout} seconds while running command {action.command!r}"
            raise CommandTimeoutError(msg) from e
        output: str = _strip_control_chars(self.shell.before)
        if action.is_interactive_quit:
            assert not action.is_interactive_command
            # pexpect's setecho(False) + waitnoecho() act on the terminal from outside; here
            # the line below turns echo off (SWE-ReX sends it too).
            await self.shell.sendline(f"stty -echo; echo '{self._UNIQUE_STRING}'")
            await self.shell.expect([self._UNIQUE_STRING], timeout=1)
            await self.shell.expect([self._ps1], timeout=1)
        else:
            output = output.lstrip().removeprefix(action.command).strip()
        return BashObservation(output=output, exit_code=0, expect_string=matched_expect_string)

    async def _run_normal(self, action: BashAction) -> BashObservation:
        action = deepcopy(action)
        await self._runtime._check_bash_command(action.command)

        fallback_terminator = False
        try:
            individual_commands = _split_bash_command(action.command)
        except Exception as e:  # bashlex raises all sorts (ParsingError, NotImplementedError, TypeError...)
            self.logger.error("Bashlex fail: %s", e)
            action.command += f"\n TMPEXITCODE=$? ; sleep 0.1; echo -n '{self._UNIQUE_STRING}' ; (exit $TMPEXITCODE)"
            fallback_terminator = True
        else:
            action.command = " ; ".join(individual_commands)
        await self.shell.sendline(action.command)
        expect_strings = [*action.expect, self._ps1] if not fallback_terminator else [self._UNIQUE_STRING]
        try:
            expect_index = await self.shell.expect(expect_strings, timeout=action.timeout)
            matched_expect_string = expect_strings[expect_index]
        except pexpect.TIMEOUT as e:
            msg = f"timeout after {action.timeout} seconds while running command {action.command!r}"
            raise CommandTimeoutError(msg) from e
        output: str = _strip_control_chars(self.shell.before)

        if action.check == "ignore":
            return BashObservation(output=output, exit_code=None, expect_string=matched_expect_string)

        exit_code: int | None
        try:
            prefix, suffix = "EXITCODESTART", "EXITCODEEND"
            await self.shell.sendline(f"\necho {prefix}$?{suffix}")
            try:
                await self.shell.expect([suffix], timeout=1)
            except pexpect.TIMEOUT:
                raise NoExitCodeError("timeout while getting exit code") from None
            exit_code_raw: str = _strip_control_chars(self.shell.before)
            found = re.findall(f"{prefix}([0-9]+)", exit_code_raw)
            if len(found) != 1:
                msg = (f"failed to parse exit code from output {exit_code_raw!r} (command: {action.command!r}, "
                       f"matches: {found})")
                raise NoExitCodeError(msg)
            output += exit_code_raw.split(prefix)[0]
            exit_code = int(found[0])
            try:  # at least one more PS1
                await self.shell.expect([self._ps1], timeout=0.1)
            except pexpect.TIMEOUT:
                raise CommandTimeoutError("Timeout while getting PS1 after exit code extraction") from None
            output = output.replace(self._UNIQUE_STRING, "").replace(self._ps1, "")
        except Exception:
            if action.check == "raise":
                raise
            exit_code = None
        return BashObservation(output=output, exit_code=exit_code, expect_string=matched_expect_string)

    async def close(self) -> CloseSessionResponse:
        if self._shell is not None:
            await self._shell.close()
            self._shell = None
        return CloseBashSessionResponse()


# ----------------------------------------------------------------- runtime ----


class DSecRuntime(AbstractRuntime):
    """SWE-ReX's ``AbstractRuntime`` over one DSec sandbox (``sandbox``: an
    :class:`~dsec.AsyncSandbox`). Closing the runtime ends its sessions; the sandbox is the
    deployment's (or the caller's) to delete.

    ``cwd``: where sessions start (SWE-ReX's server: its own working directory).
    ``session_env``: more variables for the sessions' bash. ``output_cap``: bytes kept of
    each of an ``execute``'s streams (head and tail; at most 64 MiB)."""

    def __init__(self, sandbox: AsyncSandbox, *, cwd: str = "/", session_env: dict[str, str] | None = None,
                 output_cap: int = 16 * MiB, logger: logging.Logger | None = None,
                 _portal: _Portal | None = None) -> None:
        self.sandbox = sandbox
        self._portal = _portal
        """The deployment's own loop, where the sandbox's connections live (None: the caller's)."""
        self._cwd = cwd
        self._session_env = dict(session_env or {})
        self._output_cap = output_cap
        self._sessions: dict[str, _BashSession] = {}
        self._checker: AsyncSession | None = None
        self._checker_lock = asyncio.Lock()
        self.logger = logger or _logger("rex-runtime")

    @property
    def sessions(self) -> dict[str, _BashSession]:
        return self._sessions

    @_on_portal
    async def is_alive(self, *, timeout: float | None = None) -> IsAliveResponse:
        try:
            async with asyncio.timeout(timeout):
                await self.sandbox.files.stat("/")
        except (DsecError, OSError, TimeoutError) as exc:
            return IsAliveResponse(is_alive=False, message=f"sandbox {self.sandbox.id}: {exc}")
        return IsAliveResponse(is_alive=True)

    # -- sessions --

    @_on_portal
    async def create_session(self, request: CreateSessionRequest) -> CreateSessionResponse:
        if request.session in self._sessions:
            raise SessionExistsError(f"session {request.session} already exists")
        if not isinstance(request, CreateBashSessionRequest):
            raise ValueError(f"unknown session type: {request!r}")
        session = _BashSession(self, request)
        self._sessions[request.session] = session
        try:
            return await session.start()
        except BaseException:
            # SWE-ReX keeps a session whose start failed; one left half-open here would hold a
            # terminal, so it is closed (a second create with the name is then allowed).
            self._sessions.pop(request.session, None)
            await session.close()
            raise

    @_on_portal
    async def run_in_session(self, action: Action) -> Observation:
        session = self._sessions.get(action.session)
        if session is None:
            raise SessionDoesNotExistError(f"session {action.session!r} does not exist")
        return await session.run(action)

    @_on_portal
    async def close_session(self, request: CloseSessionRequest) -> CloseSessionResponse:
        session = self._sessions.pop(request.session, None)
        if session is None:
            raise SessionDoesNotExistError(f"session {request.session!r} does not exist")
        return await session.close()

    async def _check_bash_command(self, command: str) -> None:
        """SWE-ReX's ``_check_bash_command``, by the sandbox's bash: BashIncorrectSyntaxError
        with ``extra_info`` ``bash_stdout`` / ``bash_stderr``."""
        unique = "SOUNIQUEEOF"
        # SWE-ReX runs `/usr/bin/env bash -n << ...`: the same bash and messages, one exec fewer
        cmd = f"bash -n << '{unique}'\n{command}\n{unique}"
        async with self._checker_lock:
            for attempt in range(2):
                if self._checker is None:
                    self._checker = await self.sandbox.session()
                try:
                    result = await self._checker.run(cmd, timeout=30.0)
                    break
                except SessionClosed:
                    self._checker = None  # its shell ended (a stage switch...): one more, once
                    if attempt:
                        raise
        if result.exit_code == 0:
            return
        stdout = result.stdout.decode(errors="backslashreplace")
        stderr = result.stderr.decode(errors="backslashreplace")
        msg = (f"Error (exit code {result.exit_code}) while checking bash command \n{command!r}\n"
               f"---- Stderr ----\n{stderr}\n---- Stdout ----\n{stdout}")
        raise BashIncorrectSyntaxError(msg, extra_info={"bash_stdout": stdout, "bash_stderr": stderr})

    # -- commands --

    @_on_portal
    async def execute(self, command: Command) -> CommandResponse:
        """As ``subprocess.run`` would in the sandbox: ``shell`` runs it under ``/bin/sh -c``,
        ``env`` replaces the environment, ``merge_output_streams`` sends stderr to stdout.

        Raises CommandTimeoutError, NonZeroExitCodeError (``check``), FileNotFoundError
        (no such program, as subprocess does)."""
        if command.shell:
            argv = ["/bin/sh", "-c", command.command] if isinstance(command.command, str) \
                else ["/bin/sh", "-c", *command.command]
        else:
            argv = [command.command] if isinstance(command.command, str) else list(command.command)
        if command.env is not None:
            argv = ["env", "-i", *(f"{k}={v}" for k, v in command.env.items()), *argv]
        if command.merge_output_streams:
            argv = ["/bin/sh", "-c", 'exec "$@" 2>&1', "sh", *argv]
        try:
            res = await self.sandbox.exec(argv, cwd=command.cwd or self._cwd, timeout=command.timeout,
                                          output_cap=self._output_cap)
        except ExecTimeout as exc:
            raise CommandTimeoutError(f"Timeout ({command.timeout}s) exceeded while running command") from exc
        except ExecError as exc:
            if exc.fields.get("errno") == errno.ENOENT:
                raise FileNotFoundError(errno.ENOENT, str(exc), argv[0]) from exc
            raise
        r = CommandResponse(
            stdout=res.stdout.decode(errors="backslashreplace"),
            stderr=res.stderr.decode(errors="backslashreplace"),
            exit_code=res.exit_code if res.exit_code is not None else -(res.signal or 0),
        )
        if command.check and r.exit_code != 0:
            msg = (f"Command {command.command!r} failed with exit code {r.exit_code}. "
                   f"Stdout:\n{r.stdout!r}\nStderr:\n{r.stderr!r}")
            if command.error_msg:
                msg = f"{command.error_msg}: {msg}"
            raise NonZeroExitCodeError(msg)
        return r

    # -- files --

    def _path(self, path: str) -> str:
        return path if path.startswith("/") else f"{self._cwd.rstrip('/')}/{path}"

    @_on_portal
    async def read_file(self, request: ReadFileRequest) -> ReadFileResponse:
        """``Path.read_text`` in the sandbox (text mode: universal newlines)."""
        data = await _files(self.sandbox.files.read(self._path(request.path)))
        text = io.TextIOWrapper(io.BytesIO(data), encoding=request.encoding or "utf-8",
                                errors=request.errors).read()
        return ReadFileResponse(content=text)

    @_on_portal
    async def write_file(self, request: WriteFileRequest) -> WriteFileResponse:
        """``Path.write_text`` with the parents made; an existing file keeps its mode."""
        path = self._path(request.path)
        mode = 0o644
        with contextlib.suppress(FileAccessError):
            st = await self.sandbox.files.stat(path)
            if st.type == "file":
                mode = st.mode & 0o7777
        await _files(self.sandbox.files.write(path, request.content.encode(), mode=mode, parents=True))
        return WriteFileResponse()

    @_on_portal
    async def upload(self, request: UploadRequest) -> UploadResponse:
        """A local file or directory into the sandbox (parents made; a directory is merged
        into ``target_path``, as SWE-ReX's server unpacks it); modes are kept."""
        source = Path(request.source_path).resolve()
        target = self._path(request.target_path)
        if source.is_dir():
            data = await asyncio.to_thread(_tar_dir, source)
            await _files(self.sandbox.files.upload(target, data))
        elif source.is_file():
            content = await asyncio.to_thread(source.read_bytes)
            await _files(self.sandbox.files.write(target, content, mode=source.stat().st_mode & 0o7777,
                                                  parents=True))
        else:
            raise ValueError(f"Source path {source} is not a file or directory")
        return UploadResponse()

    @_on_portal
    async def close(self) -> CloseResponse:
        """End every session (and the syntax checker's shell). The sandbox stays."""
        sessions, self._sessions = list(self._sessions.values()), {}
        for session in sessions:
            await session.close()
        if self._checker is not None:
            checker, self._checker = self._checker, None
            await checker.close()
        return CloseResponse()


async def _files(op: Any) -> Any:
    """Await a files-API call; its refusals become the OSError a local call raises."""
    try:
        return await op
    except FileAccessError as exc:
        code = exc.fields.get("errno")
        cls = {errno.ENOENT: FileNotFoundError, errno.EISDIR: IsADirectoryError, errno.ENOTDIR: NotADirectoryError,
               errno.EACCES: PermissionError, errno.EEXIST: FileExistsError}.get(code or 0, OSError)
        raise cls(code or errno.EIO, str(exc), exc.fields.get("path")) from exc


def _tar_dir(source: Path) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for child in sorted(source.iterdir()):
            tar.add(str(child), arcname=child.name)
    return buf.getvalue()


# -------------------------------------------------------------- deployment ----


class DSecDeploymentConfig(BaseModel):
    """How :class:`DSecDeployment` makes (or finds) its sandbox. Either ``image`` (a DSec
    layer ref, e.g. ``swerex-debian:bookworm``) with ``resources``/``env``/``allow``, or a
    whole ``spec`` (a :class:`~dsec.SandboxSpec` as a dict); or ``sandbox_id``: use a
    sandbox that exists (not deleted at ``stop`` unless ``delete_on_stop``)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["dsec"] = "dsec"
    """Discriminator, as SWE-ReX's deployment configs have one."""
    image: str = ""
    workspace: str | None = None
    toolkits: list[str] = Field(default_factory=list)
    """Toolkit layers stacked on ``image`` (e.g. ``tc-python:bookworm`` on ``tc-base:bookworm``)."""
    resources: dict[str, Any] = Field(default_factory=dict)
    """``dsec.Resources`` fields, e.g. ``{"cpu": 2, "memory": 4 << 30, "disk": 8 << 30}``."""
    env: dict[str, str] = Field(default_factory=dict)
    allow: list[str] = Field(default_factory=list)
    """Named network permissions of the edge (``pkgs``, ``dns``...); none: loopback only."""
    spec: dict[str, Any] | None = None
    sandbox_id: str | None = None
    delete_on_stop: bool | None = None
    """Default: True for a sandbox this deployment created, False for ``sandbox_id``."""
    url: str | None = None
    """The control plane ($DSEC_URL)."""
    token: str | None = None
    """An API token ($DSEC_TOKEN)."""
    labels: dict[str, str] = Field(default_factory=dict)
    task: str | None = None
    ttl_s: float = 3600.0
    startup_timeout: float = 180.0
    """For the sandbox to be created, waiting for room while the cluster answers Backpressure."""
    cwd: str = "/"
    session_env: dict[str, str] = Field(default_factory=dict)
    output_cap: int = 16 * MiB

    def get_deployment(self) -> DSecDeployment:
        return DSecDeployment.from_config(self)

    def sandbox_spec(self) -> SandboxSpec:
        if self.spec is not None:
            return SandboxSpec.model_validate(self.spec)
        if not self.image:
            raise ValueError("DSecDeploymentConfig: give an image (a DSec layer ref), a spec or a sandbox_id")
        return SandboxSpec(image=ImageRef(base=self.image, workspace=self.workspace, toolkits=tuple(self.toolkits)),
                           resources=Resources(**self.resources), env=self.env,
                           network=NetworkPolicy(allow=tuple(self.allow)) if self.allow else None)


class DSecDeployment(AbstractDeployment):
    """A SWE-ReX deployment whose runtime is a DSec sandbox::

        deployment = DSecDeployment(image="swerex-debian:bookworm")
        await deployment.start()
        await deployment.runtime.create_session(CreateBashSessionRequest())
        obs = await deployment.runtime.run_in_session(BashAction(command="ls /"))
        await deployment.stop()

    Keyword arguments: :class:`DSecDeploymentConfig`.

    The sandbox's connections (the terminals of its sessions, the SDK's pools) live on one
    event loop of this module's, in a daemon thread shared by the process's deployments:
    callers may come from any loop, and many do come from a new one each time
    (``asyncio.run(runtime.execute(...))`` per command, as mini-swe-agent's SWE-ReX
    environments do). ``client``: an :class:`~dsec.AsyncClient` to use instead, on the
    caller's loop (the deployment then leaves it open, and every call must come from
    that loop)."""

    def __init__(self, *, logger: logging.Logger | None = None, client: AsyncClient | None = None,
                 **kwargs: Any) -> None:
        self._config = DSecDeploymentConfig(**kwargs)
        self.logger = logger or _logger("rex-deploy")
        self._hooks = CombinedDeploymentHook()
        self._given_client = client
        self._client: AsyncClient | None = None
        self._sandbox: AsyncSandbox | None = None
        self._runtime: DSecRuntime | None = None
        self._portal: _Portal | None = None

    @classmethod
    def from_config(cls, config: DSecDeploymentConfig) -> DSecDeployment:
        return cls(**config.model_dump(exclude={"type"}))

    def add_hook(self, hook: DeploymentHook) -> None:
        self._hooks.add_hook(hook)

    @property
    def sandbox(self) -> AsyncSandbox:
        if self._sandbox is None:
            raise DeploymentNotStartedError()  # type: ignore[no-untyped-call]
        return self._sandbox

    @property
    def runtime(self) -> DSecRuntime:
        if self._runtime is None:
            raise DeploymentNotStartedError()  # type: ignore[no-untyped-call]
        return self._runtime

    async def is_alive(self, *, timeout: float | None = None) -> IsAliveResponse:
        return await self.runtime.is_alive(timeout=timeout)

    async def start(self) -> None:
        """Create the sandbox (or connect to ``sandbox_id``); no server to wait for."""
        if self._runtime is not None:
            return
        self._portal = None if self._given_client is not None else _shared_portal()
        await _on(self._portal, self._start())

    async def _start(self) -> None:
        cfg = self._config
        client = self._given_client or AsyncClient(cfg.url, cfg.token)
        self._client = client
        try:
            if cfg.sandbox_id is not None:
                self._hooks.on_custom_step(f"Connecting to sandbox {cfg.sandbox_id}")
                sandbox = await client.connect(cfg.sandbox_id)
            else:
                self._hooks.on_custom_step("Starting sandbox")
                spec = cfg.sandbox_spec()
                try:  # a full cluster answers Backpressure: wait for room, as docker run would wait
                    sandbox = await create_with_room(client, spec, timeout=cfg.startup_timeout,
                                                     labels={"swerex": "1", **cfg.labels}, task=cfg.task,
                                                     ttl_s=cfg.ttl_s)
                except (TimeoutError, Backpressure) as exc:
                    raise DeploymentStartupError(f"no sandbox within {cfg.startup_timeout} s: {exc}") from exc
                self.logger.info("Started DSec sandbox %s (%s)", sandbox.id, spec.image.base)
        except BaseException:
            await self._close_client()
            raise
        self._sandbox = sandbox
        self._runtime = DSecRuntime(sandbox, cwd=cfg.cwd, session_env=cfg.session_env, output_cap=cfg.output_cap,
                                    logger=self.logger, _portal=self._portal)

    async def stop(self) -> None:
        """Close the runtime's sessions and delete the sandbox. Idempotent."""
        if self._runtime is not None or self._client is not None:
            await _on(self._portal, self._stop())

    async def _stop(self) -> None:
        runtime, sandbox = self._runtime, self._sandbox
        self._runtime = self._sandbox = None
        try:
            if runtime is not None:
                with contextlib.suppress(DsecError, OSError):
                    await runtime.close()
            delete = self._config.delete_on_stop
            if delete is None:
                delete = self._config.sandbox_id is None
            if sandbox is not None and delete:
                await sandbox.close()
        finally:
            await self._close_client()

    async def _close_client(self) -> None:
        client, self._client = self._client, None
        if client is not None and client is not self._given_client:
            await client.aclose()
