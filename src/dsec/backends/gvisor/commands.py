"""Commands in a gVisor sandbox through ``runsc exec`` of the helper, and their limits. A part of
:class:`~dsec.backends.gvisor.backend.GVisorBackend` (a mixin over the :class:`GVisorNode`
protocol)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import signal
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from dsec.backends.base import (
    UNSET,
    DiskRoom,
    OutputCallback,
    SandboxRecord,
    Usage,
    _Unset,
    command_line,
)
from dsec.backends.common import limits as limit_evidence
from dsec.backends.common.command import check_argv, command_env, user_ids
from dsec.backends.common.output import check_exec, check_timed_out, collect, start_piped
from dsec.backends.gvisor.process import Command
from dsec.backends.gvisor.records import (
    _FORK_FAILED,
    _HELPER_STAGES,
    HELPER_CAPS,
    PIDS_SLACK,
    GVisorRecord,
)
from dsec.backends.gvisor.runsc import RunscError, Watched, spawn
from dsec.errors import (
    ExecError,
    HostError,
    InvalidSpec,
    SandboxFailed,
    SandboxStateError,
)
from dsec.spec import SandboxState
from dsec.spec.results import ExecResult, LimitHit

if TYPE_CHECKING:
    from dsec.backends.gvisor.node import GVisorNode


log = logging.getLogger("dsec.gvisor")


class GVisorCommands:
    # ----- running commands -----

    async def start_process(self: GVisorNode, sandbox_id: str, argv: Sequence[str], *, stdin: int, stdout: int, stderr: int,
                            env: Mapping[str, str] | None = None, cwd: str = "/",
                            user: int | str = 0) -> Command:
        """Start ``argv`` in the sandbox with the given host fds as its stdio (they go to the
        sentry as they are). The handle's ``kill(tree=True)`` reaches every process it started."""
        runsc = self._require_started()
        rec = await self._running_async(sandbox_id)
        check_argv(sandbox_id, argv, cwd)
        uid, gid = user_ids(user)
        merged = command_env(rec.spec.env, env)
        if any("\0" in a for a in argv) or "\0" in cwd:
            raise InvalidSpec("command or cwd contains a NUL byte", field="cmd")
        # The helper starts as root with CAP_SYS_ADMIN to put the command in a cgroup of its own
        # (named after the helper's pid and this token), then drops to uid:gid and the
        # container's capabilities before the command runs (native/dsec-gvexec.c).
        token = secrets.token_hex(8)
        args = ["exec", "--exec-fd=3", "--pass-fd=4:3", "--user=0:0", f"--cap={HELPER_CAPS}", "--cwd=/"]
        args += [f"--env={k}={v}" for k, v in merged.items()]
        args += [rec.container_id, "dsec-gvexec", "run", str(uid), str(gid), token, cwd, *argv]
        status_r, status_w = os.pipe2(os.O_CLOEXEC)
        try:
            pid = spawn(runsc.argv(*args), {0: stdin, 1: stdout, 2: stderr, 3: self._helper_fd, 4: status_w})
        except BaseException:
            os.close(status_r)
            raise
        finally:
            os.close(status_w)
        proc = Command(sandbox_id, Watched(pid, asyncio.get_running_loop()), status_r, self._kill_command,
                       cgroup_token=token)
        self.last_activity[sandbox_id] = time.monotonic()
        self.records.event(rec, "exec_started", pid=pid, argv0=argv[0], cmd=command_line(argv))
        return proc

    async def _helper_exec(self: GVisorNode, rec: GVisorRecord, *args: str, timeout: float = 30.0,
                           cgroups: bool = False) -> bytes:
        """Run the helper as root in the sandbox (kill, count) and wait for it; its output.
        ``cgroups``: with CAP_SYS_ADMIN, to mount the commands' cgroup hierarchy for itself."""
        runsc = self._require_started()
        caps = [f"--cap={HELPER_CAPS}"] if cgroups else []
        try:
            return await runsc.call("exec", "--exec-fd=3", "--user=0:0", *caps, "--cwd=/", rec.container_id,
                                    "dsec-gvexec", *args, timeout=timeout, what=f"exec (helper {args[0]})",
                                    extra_fds={3: self._helper_fd})
        except (RunscError, TimeoutError) as exc:
            log.warning("gvisor %s: %s in %s: %s", self.name, args[0], rec.id, exc)
            return b""

    async def _pids_hit(self: GVisorNode, rec: GVisorRecord, result: ExecResult) -> LimitHit | None:
        """The pids verdict gVisor needs: no host counter sees a fork refused inside the sentry
        (RLIMIT_NPROC), so the evidence is the command's own word for it (EAGAIN from a fork) and
        a user of the sandbox at the limit now. Asked only of a failed command that says so."""
        said = any(t in out for out in (result.stderr, result.stdout) for t in _FORK_FAILED)
        if not said or not limit_evidence.failed(result.exit_code, result.signal):
            return None
        counts = [ln.split() for ln in (await self._helper_exec(rec, "count", timeout=10)).decode().splitlines()]
        top = max((int(c[1]) for c in counts if len(c) == 2 and c[1].isdigit()), default=0)
        # At the limit when the fork failed; since then the shell whose fork failed and our helper
        # have exited: a user within PIDS_SLACK of the limit now was at it.
        return LimitHit.of("pids", rec.spec.resources.pids) if top + PIDS_SLACK >= rec.spec.resources.pids else None

    async def _kill_command(self: GVisorNode, proc: Command, tree: bool) -> None:
        rec = self._sandboxes.get(proc.sandbox_id)
        if rec is None or rec.state not in (SandboxState.RUNNING, SandboxState.PAUSED):
            return
        if rec.state is SandboxState.PAUSED:
            with contextlib.suppress(SandboxStateError):
                await self.resume(rec.id)
        if proc.inner_pid <= 0 or not self._sentry_alive(rec):
            return  # never started, or the sandbox is gone with it
        # Everything in the command's UTS namespace and cgroup, however it detached (setsid,
        # orphaned), and of its session and their descendants; the helper (spared) lives to
        # report its end.
        await self._helper_exec(rec, "kill", proc.cgroup, proc.namespace, str(proc.inner_pid), str(proc.inner_pid),
                                cgroups=True)

    async def kill_children(self: GVisorNode, proc: Command) -> None:
        """Kill what a session's shell started, not the shell (the session lives on)."""
        rec = self._sandboxes.get(proc.sandbox_id)
        if rec is not None and proc.command_pid > 0 and rec.state is SandboxState.RUNNING:
            await self._helper_exec(rec, "kill", proc.cgroup, proc.namespace, str(proc.inner_pid),
                                    str(proc.inner_pid), str(proc.command_pid), cgroups=True)

    async def exec(self: GVisorNode, sandbox_id: str, cmd: str | Sequence[str], *, env: Mapping[str, str] | None = None,
                   cwd: str = "/", user: int | str = 0, stdin: bytes | None = None,
                   timeout: float | _Unset | None = UNSET, idle_timeout: float | None = None,
                   on_output: OutputCallback | None = None, output_cap: int | None = None,
                   pristine: Sequence[str] = ()) -> ExecResult:
        """Run a command to completion: argv list, or a string run by ``/bin/sh -c``.
        ``timeout`` (default 600 s; None: none) and ``idle_timeout`` kill the command's whole
        tree (never the sandbox) and raise :class:`ExecTimeout` with the partial result."""
        if pristine:
            raise self._unsupported("pristine paths")
        argv, limit = check_exec(cmd, timeout=timeout, idle_timeout=idle_timeout, output_cap=output_cap)
        rec = await self._running_async(sandbox_id)
        cap = output_cap or rec.spec.output_cap
        before = self.limit_baseline(rec)
        proc, in_w, out_r, err_r = await start_piped(lambda i, o, e: self.start_process(
            sandbox_id, argv, stdin=i, stdout=o, stderr=e, env=env, cwd=cwd, user=user))
        got = await collect(proc, in_w, out_r, err_r, stdin, limit, idle_timeout, on_output, cap)
        await proc.wait_killed()
        self.last_activity[sandbox_id] = time.monotonic()
        ex = got.exit
        if ex.error is not None:
            err, stage = ex.error
            if stage == "cwd":
                raise ExecError(f"working directory {cwd!r} does not exist in sandbox {sandbox_id} "
                                f"({os.strerror(err)})", sandbox_id=sandbox_id, stage="cwd", errno=err)
            if stage in _HELPER_STAGES:
                what = _HELPER_STAGES[stage].format(user=user)
                raise ExecError(f"cannot run {argv[0]!r} in sandbox {sandbox_id}: {what} ({os.strerror(err)})",
                                sandbox_id=sandbox_id, stage=stage, errno=err)
            hint = "not found in the sandbox's PATH" if err == 2 else os.strerror(err)
            raise ExecError(f"cannot run {argv[0]!r} in sandbox {sandbox_id}: {hint}", sandbox_id=sandbox_id,
                            stage=stage, errno=err)
        result = got.result(proc.start_latency_s)
        if ex.lost and not self._sentry_alive(rec):
            self._sentry_gone(rec.id, rec.sandbox_start)
            if self.cgroups.oom_kills(rec.id) > rec.oom_baseline or "memory limit" in rec.reason:
                result.exit_code, result.signal = None, signal.SIGKILL
                result.limit = LimitHit("memory", rec.spec.resources.memory,
                                        LimitHit.of("memory", rec.spec.resources.memory).message
                                        + " (under gVisor the whole sandbox is ended)")
            else:
                raise SandboxFailed(f"sandbox {sandbox_id} died while running the command ({rec.reason})",
                                    sandbox_id=sandbox_id, reason="sentry_exited")
        elif ex.lost and proc.inner_pid == 0:
            text = result.stderr.decode(errors="replace").strip().splitlines()
            raise ExecError(f"cannot start command in sandbox {sandbox_id}: {text[-1] if text else 'runsc exec failed'}",
                            sandbox_id=sandbox_id, stage="runsc")
        else:
            result.limit = self.limit_hit(rec, before, exit_code=result.exit_code, sig=result.signal,
                                          timed_out=result.timed_out, timeout_s=limit, idle_timeout_s=idle_timeout,
                                          truncated=result.truncated, output_cap=cap,
                                          output=(result.stderr, result.stdout))
            if result.limit is None or result.limit.kind == "output_cap":
                result.limit = await self._pids_hit(rec, result) or result.limit
        self.records.event(rec, "exec_ended", pid=proc.pid, exit_code=result.exit_code, signal=result.signal,
                    duration_s=round(result.duration_s, 6), timed_out=result.timed_out,
                    output_truncated=result.truncated, limit=None if result.limit is None else result.limit.kind)
        check_timed_out(result, sandbox_id, limit=limit, idle_timeout=idle_timeout)
        return result

    # ----- limits -----

    def limit_baseline(self: GVisorNode, rec: SandboxRecord) -> limit_evidence.Baseline:
        counters = limit_evidence.Counters(self.cgroups.oom_kills(rec.id), 0)
        return limit_evidence.Baseline(counters, False)

    def limit_hit(self: GVisorNode, rec: SandboxRecord, before: limit_evidence.Baseline | None, *, exit_code: int | None,
                  sig: int | None, timed_out: str | None = None, timeout_s: float | None = None,
                  idle_timeout_s: float | None = None, truncated: bool = False, output_cap: int = 0,
                  output: tuple[bytes, ...] = ()) -> LimitHit | None:
        """Which limit ended a command (``ExecResult.limit``), from the same evidence rules as the
        container backend. gVisor refuses forks past ``pids`` inside the sentry without a counter
        the host can read, so a pids verdict is never given."""
        after = disk = None
        if limit_evidence.failed(exit_code, sig) and timed_out is None:
            after = limit_evidence.Counters(self.cgroups.oom_kills(rec.id), 0)
            start = None if before is None else before.counters
            if start is not None and after.oom_kills > start.oom_kills:
                # The host's OOM killer ends the systrap stub that maps the process's memory;
                # the sentry then reports the process as exited (status 1, measured), not as
                # SIGKILL: the counter's growth while it ran is the evidence here.
                hit = LimitHit.of("memory", rec.spec.resources.memory)
                return LimitHit("memory", hit.value, hit.message + " (gVisor: the host's OOM killer ended it; "
                                "the sentry's own memory counts against the limit too)")
            disk = self.disk_room(rec)
        return limit_evidence.judge(rec.spec.resources, exit_code=exit_code, sig=sig, timed_out=timed_out,
                                    timeout_s=timeout_s, idle_timeout_s=idle_timeout_s, truncated=truncated,
                                    output_cap=output_cap, before=before, after=after, disk=disk, output=output)

    def disk_room(self: GVisorNode, rec: SandboxRecord) -> DiskRoom | None:
        if not isinstance(rec, GVisorRecord):
            return None
        try:
            if rec.medium == "disk":
                if self._uppers is None:
                    return None
                use = self._uppers.usage(rec.id)
                return DiskRoom(use.free, -1, use.free < limit_evidence.DISK_FULL_BYTES)
            st = os.statvfs(self.bundle_dir(rec.id) / "upper")
        except (OSError, ValueError, HostError):
            return None
        free = st.f_bavail * st.f_frsize
        return DiskRoom(free, int(st.f_favail), free < limit_evidence.DISK_FULL_BYTES or st.f_favail == 0)

    def usage(self: GVisorNode, sandbox_id: str) -> Usage:
        """Memory (sentry, gofer and the sandbox's memory, as the memory cgroup charges it),
        host tasks (the sandbox's processes are not host processes: this counts the sentry's
        threads, the gofer and the systrap stubs), CPU seconds and the writable layer's bytes."""
        rec = self.get(sandbox_id)
        disk = 0
        room = self.disk_room(rec)
        if room is not None:
            total = rec.spec.resources.disk
            disk = max(0, total - room.bytes_free)
        return Usage(memory_bytes=self.cgroups.memory_bytes(sandbox_id), pids=self.cgroups.host_tasks(sandbox_id),
                     cpu_s=self.cgroups.cpu_s(sandbox_id), disk_bytes=disk)

    def store_space(self: GVisorNode) -> tuple[int, int] | None:
        if self._uppers is None:
            return None
        with contextlib.suppress(OSError):
            return self._uppers.space()  # type: ignore[no-any-return]
        return None


__all__ = ["GVisorCommands"]
