"""Commands in a container sandbox: started through the spawner into the sandbox's
namespaces and cgroups, under its stage's file rules, collected with their limits judged.
A part of :class:`~dsec.backends.container.sandbox.ContainerSandbox` (a mixin over the
:class:`CommandSandbox` protocol)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from dsec.backends.base import UNSET, OutputCallback, TtySize, _Unset, command_line
from dsec.backends.common import limits as limit_evidence
from dsec.backends.common.command import check_argv, command_env, user_ids
from dsec.backends.common.output import check_exec, check_timed_out, collect, start_piped
from dsec.backends.container import stages as staging
from dsec.backends.container import wire
from dsec.backends.container.procs import Process
from dsec.backends.container.records import ContainerRecord
from dsec.backends.container.spawner import SpawnError
from dsec.errors import ExecError, InvalidSpec, SandboxFailed
from dsec.spec.results import ExecResult, LimitHit

if TYPE_CHECKING:
    from dsec.backends.container.node import Node


class CommandSandbox(Protocol):
    """What commands use of their sandbox."""

    @property
    def id(self) -> str: ...
    @property
    def node(self) -> Node: ...
    def running(self, *, resume: bool = True) -> ContainerRecord: ...
    def current(self) -> ContainerRecord | None: ...
    async def wait_for_stage_switch(self) -> None: ...
    def starting(self) -> contextlib.AbstractContextManager[None]: ...
    def limit_baseline(self) -> limit_evidence.Baseline | None: ...
    def limit_hit(self, before: limit_evidence.Baseline | None, *, exit_code: int | None, sig: int | None,
                  timed_out: str | None = None, timeout_s: float | None = None, idle_timeout_s: float | None = None,
                  truncated: bool = False, output_cap: int = 0, output: tuple[bytes, ...] = ()) -> LimitHit | None: ...
    def note_limits(self, rec: ContainerRecord, counters: limit_evidence.Counters | None = None) -> None: ...
    # the commands' own, seen through the protocol
    def _pristine(self, rec: ContainerRecord, pristine: Sequence[str]) -> wire.Pristine: ...
    async def start_process(self, argv: Sequence[str], *, stdin: int, stdout: int, stderr: int,
                            env: Mapping[str, str] | None = None, cwd: str = "/", user: int | str = 0,
                            seccomp: bool = True, tracked: bool = True, pristine: Sequence[str] = (),
                            tty: TtySize | None = None) -> Process: ...
    def _exec_error(self, argv: Sequence[str], cwd: str, uid: int, exc: SpawnError) -> Exception: ...
    async def _collect(self, proc: Process, in_w: int, out_r: int, err_r: int, stdin: bytes | None,
                       limit: float | None, idle_timeout: float | None, on_output: OutputCallback | None,
                       cap: int, before: limit_evidence.Baseline | None = None) -> ExecResult: ...


class SandboxCommands:
    __slots__ = ()

    def _pristine(self: CommandSandbox, rec: ContainerRecord, pristine: Sequence[str]) -> wire.Pristine:
        """What the spawner needs for pristine paths: the image layers (never snapshot layers:
        those hold the agent's own writes) as host mounts, top first, and the paths."""
        paths = staging.check_pristine(pristine)
        image = self.node.layers.image_paths(rec)
        if not image:
            raise InvalidSpec(f"sandbox {rec.id} has no image layers to take pristine copies from",
                              field="pristine", sandbox_id=rec.id)
        return wire.Pristine(image, paths)


    async def start_process(
        self: CommandSandbox,
        argv: Sequence[str],
        *,
        stdin: int,
        stdout: int,
        stderr: int,
        env: Mapping[str, str] | None = None,
        cwd: str = "/",
        user: int | str = 0,
        seccomp: bool = True,
        tracked: bool = True,
        pristine: Sequence[str] = (),
        tty: TtySize | None = None,
    ) -> Process:
        """Start ``argv`` in the sandbox with the given host fds as its stdio.

        ``tracked`` puts the command in its own freezer cgroup so that
        :meth:`Process.kill` reaches every process it started. The current
        stage's file rules bind it (Landlock); ``pristine`` paths are the
        image's own (see :meth:`exec`). With ``tty`` the stdio fds are
        ignored: use :meth:`start_tty`."""
        spawner = await self.node.ensure_spawner()
        await self.wait_for_stage_switch()  # it kills the old stage's processes
        rec = self.running()
        box = self
        check_argv(self.id, argv, cwd)
        uid, gid = user_ids(user)
        merged = command_env(rec.spec.env, env)
        res = rec.spec.resources
        stage = rec.stage or rec.spec.stage
        landlock = None if stage is None else staging.landlock(rec.spec.stages[stage].files)
        image_copies = self._pristine(rec, pristine) if pristine else None  # checked before a cgroup is made
        cg_dirs = self.node.cgroups.dirs(self.id)
        track: Path | None = None
        if tracked:
            track = self.node.cgroups.make_track(self.id, self.node.track_name())
            cg_dirs = [d for d in cg_dirs if d != self.node.cgroups.parents["freezer"] / self.id] + [track]
        init_fd = self.node.open_init(rec)
        assert init_fd is not None
        started = time.monotonic()
        try:
            with box.starting():
                spawned = await spawner.send(wire.ExecRequest(
                    init_pidfd=init_fd, stdin=stdin, stdout=stdout, stderr=stderr, argv=tuple(argv),
                    env=tuple(merged.items()), cwd=cwd, uid=uid, gid=gid, seccomp=seccomp, cgroups=tuple(cg_dirs),
                    rlimits=(wire.Rlimit(7, res.nofile, res.nofile),),  # RLIMIT_NOFILE
                    landlock=landlock, pristine=image_copies,
                    init_pid=rec.init_pid if image_copies is not None or tty is not None else None,
                    # The sandbox's tty group (gid 5 inside) in host ids: devpts takes the mounter's.
                    tty=None if tty is None else wire.Tty(rec.uid_base + 5, tty.rows, tty.cols)))
        except SpawnError as exc:
            if track is not None:
                self.node.cgroups.drop_track(track)
            raise self._exec_error(argv, cwd, uid, exc) from None
        except BaseException:
            if track is not None:
                self.node.cgroups.drop_track(track)
            raise
        finally:
            os.close(init_fd)
        os.close(spawned.pidfd)
        self.node.last_activity[self.id] = time.monotonic()
        self.node.records.event(rec, "exec_started", pid=spawned.pid, argv0=argv[0], cmd=command_line(argv))
        return Process(self.id, spawned.pid, spawner.exit_future(spawned.pid), started, track,
                       start_latency_s=time.monotonic() - started)


    async def start_tty(
        self: CommandSandbox,
        argv: Sequence[str],
        *,
        size: TtySize,
        env: Mapping[str, str] | None = None,
        cwd: str = "/",
        user: int | str = 0,
    ) -> tuple[Process, int]:
        """Start ``argv`` on a new pseudo-terminal in the sandbox: a session leader with the
        pty as its controlling terminal (job control, ^C/^Z as signals to its foreground
        group). Returns the process and the pty's master (a host fd, non-blocking, the
        caller's to close): write the keystrokes, read the screen, resize with
        :func:`set_tty_size`. The sandbox's devpts is mounted on the first call."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        devnull = os.open("/dev/null", os.O_RDWR | os.O_CLOEXEC)
        try:
            proc = await self.start_process(
                argv, stdin=theirs.fileno(), stdout=devnull, stderr=devnull, env=env, cwd=cwd,
                user=user, tty=size,
            )
            theirs.close()
            ours.setblocking(False)
            try:
                _, fds, _, _ = socket.recv_fds(ours, 8, 1)
            except OSError:
                fds = []
            if not fds:
                proc.kill()
                raise ExecError(f"sandbox {self.id}: the terminal's master never arrived", sandbox_id=self.id,
                                stage="tty")
            os.set_blocking(fds[0], False)
            return proc, fds[0]
        finally:
            ours.close()
            theirs.close()
            os.close(devnull)


    def _exec_error(self: CommandSandbox, argv: Sequence[str], cwd: str, uid: int, exc: SpawnError) -> Exception:
        if exc.stage == "exec":
            hint = "not found in the sandbox's PATH" if exc.errno == 2 else os.strerror(exc.errno)
            return ExecError(f"cannot run {argv[0]!r} in sandbox {self.id}: {hint}", sandbox_id=self.id, stage="exec", errno=exc.errno)
        if exc.stage == "cwd":
            return ExecError(
                f"working directory {cwd!r} does not exist in sandbox {self.id} ({os.strerror(exc.errno)})",
                sandbox_id=self.id, stage="cwd", errno=exc.errno,
            )
        if exc.stage == "user":
            return ExecError(f"user {uid} cannot be used in sandbox {self.id}: {exc.detail}", sandbox_id=self.id, stage="user")
        if exc.stage == "pristine":
            return ExecError(f"pristine paths in sandbox {self.id}: {exc.detail} ({os.strerror(exc.errno)})",
                             sandbox_id=self.id, stage="pristine", errno=exc.errno)
        if exc.stage == "landlock":
            return ExecError(f"cannot apply the stage's file rules in sandbox {self.id}: {exc}",
                             sandbox_id=self.id, stage="landlock", errno=exc.errno)
        if exc.stage in ("setns", "died"):
            rec = self.current()
            if rec is not None:
                fd = self.node.open_init(rec, check=False)
                if fd is None:  # the init is gone: say so in the record, as every other path does
                    self.node.records.mark_failed(rec, "the sandbox's init process is gone")
                else:
                    os.close(fd)
            return SandboxFailed(f"sandbox {self.id} is gone: {exc}", sandbox_id=self.id, reason=exc.stage)
        return ExecError(f"cannot start command in sandbox {self.id}: {exc}", sandbox_id=self.id, stage=exc.stage)


    async def exec(
        self: CommandSandbox,
        cmd: Sequence[str] | str,
        *,
        env: Mapping[str, str] | None = None,
        cwd: str = "/",
        user: int | str = 0,
        stdin: bytes | None = None,
        timeout: float | _Unset | None = UNSET,
        idle_timeout: float | None = None,
        on_output: OutputCallback | None = None,
        output_cap: int | None = None,
        pristine: Sequence[str] = (),
    ) -> ExecResult:
        """Run a command to completion and return its result.

        ``cmd`` is an argv list, or a string run by ``/bin/sh -c``. ``timeout``
        (default 600 s; ``None`` for none) and ``idle_timeout`` (no output for
        that long) kill the command's whole process tree, never the sandbox, and
        raise :class:`ExecTimeout` carrying the partial result. ``on_output`` is
        called with ("stdout"|"stderr", chunk) as output is produced.
        ``pristine`` paths are replaced, for this command only, by read-only copies
        from the sandbox's image layers (docs/SECURITY.md, "Pristine paths").
        """
        argv, limit = check_exec(cmd, timeout=timeout, idle_timeout=idle_timeout, output_cap=output_cap)
        rec = self.running()
        cap = output_cap or rec.spec.output_cap
        before = self.limit_baseline()
        proc, in_w, out_r, err_r = await start_piped(lambda i, o, e: self.start_process(
            argv, stdin=i, stdout=o, stderr=e, env=env, cwd=cwd, user=user, pristine=pristine))
        return await self._collect(proc, in_w, out_r, err_r, stdin, limit, idle_timeout, on_output, cap, before)


    async def _collect(
        self: CommandSandbox,
        proc: Process,
        in_w: int,
        out_r: int,
        err_r: int,
        stdin: bytes | None,
        limit: float | None,
        idle_timeout: float | None,
        on_output: OutputCallback | None,
        cap: int,
        before: limit_evidence.Baseline | None = None,
    ) -> ExecResult:
        """:func:`dsec.backends.common.output.collect`, then what this runtime makes of the
        result: the limit that ended it, an ``exec_ended`` event, ExecTimeout."""
        try:
            got = await collect(proc, in_w, out_r, err_r, stdin, limit, idle_timeout, on_output, cap)
        except asyncio.CancelledError:
            rec = self.current()
            if rec is not None:
                self.node.records.event(rec, "exec_ended", pid=proc.pid, exit_code=None, signal=signal.SIGKILL,
                            duration_s=round(time.monotonic() - proc.started_at, 6), cancelled=True)
            raise
        finally:
            if self.node.spawner is not None:
                self.node.spawner.forget_exit(proc.pid)
            if proc.track is not None:
                self.node.cgroups.drop_track(proc.track)  # stays while background jobs run
        self.node.last_activity[self.id] = time.monotonic()
        result = got.result(proc.start_latency_s)
        rec = self.current()
        if rec is not None:
            result.limit = self.limit_hit(before, exit_code=result.exit_code, sig=result.signal,
                                          timed_out=result.timed_out, timeout_s=limit, idle_timeout_s=idle_timeout,
                                          truncated=result.truncated, output_cap=cap,
                                          output=(result.stderr, result.stdout))
            self.node.records.event(rec, "exec_ended", pid=proc.pid, exit_code=result.exit_code, signal=result.signal,
                        duration_s=round(result.duration_s, 6), timed_out=result.timed_out,
                        output_truncated=result.truncated,
                        limit=None if result.limit is None else result.limit.kind)
            if not limit_evidence.failed(result.exit_code, result.signal) or result.timed_out:
                # two cgroup reads: off the reply path
                asyncio.get_running_loop().call_soon(self.note_limits, rec)
        check_timed_out(result, self.id, limit=limit, idle_timeout=idle_timeout)
        return result


__all__ = ["CommandSandbox", "SandboxCommands"]
