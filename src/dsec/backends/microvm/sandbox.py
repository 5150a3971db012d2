"""One microVM sandbox: its QEMU process, its agent connection, and its commands.

Lives on the backend's VM loop (:mod:`~dsec.backends.microvm.vmloop`). Commands are started
with the caller's fds as their stdio, as in every backend (``start_process``): a bridge here
copies the caller's stdin fd into the agent's channel and the channel's output into the
caller's stdout/stderr fds, with backpressure both ways (a caller that stops reading stops
the guest's process at its output window; a guest that stops reading stops the caller's
writes at the agent's stdin window). So the backends' shared code (``collect`` for exec
with its timeouts and caps, persistent sessions) runs unchanged over a VM.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import secrets
import shutil
import signal
import struct
import termios
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dsec.backends.common.command import check_argv, command_env, user_ids
from dsec.backends.common.fdio import set_done, write_all
from dsec.backends.common.output import BoundedCapture, Collected
from dsec.backends.common.procstat import cpu_ticks
from dsec.backends.microvm.agent import AgentClient, AgentProcess
from dsec.backends.microvm.machine import Disk, RamFile, Sockets, qemu_argv
from dsec.backends.microvm.qemu import QemuDriver
from dsec.errors import HostError, SandboxFailed
from dsec.spec.results import LimitHit

if TYPE_CHECKING:
    from dsec.backends.microvm.backend import MicroVMBackend
    from dsec.backends.microvm.templates import Template

HELLO_TIMEOUT_S = 15.0
_CLK_TCK = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True, slots=True)
class VmExit:
    """A command's end as ``collect`` and sessions read it."""

    exit_code: int | None
    signal: int | None
    utime_s: float = 0.0
    stime_s: float = 0.0
    oom_kills: int = 0
    pids_hits: int = 0
    disk_free: int = -1
    inodes_free: int = -1


@dataclass(frozen=True, slots=True)
class Reclaim:
    before: int
    after: int
    swapped: int = 0


@dataclass(frozen=True, slots=True)
class ForkPoint:
    """A running VM saved for a fork: its whole state (RAM included) and a copy of its disk,
    both from the same instant (the VM stopped)."""

    state: Path
    disk: Path


@dataclass(frozen=True, slots=True)
class PauseResult:
    freeze_s: float
    seconds: float
    reclaim: Reclaim | None


class VmProcess:
    """A command in a VM as the caller's loop sees it: ``pid`` (the guest's), ``exited``
    (a future of the caller's loop), ``kill(tree=)``."""

    def __init__(self, vm: MicroVM, proc: AgentProcess, caller: asyncio.AbstractEventLoop) -> None:
        self.vm = vm
        self.proc = proc
        self.pid = proc.pid
        self.started_at = time.monotonic()
        self.start_latency_s = 0.0
        self._caller = caller
        self.exited: asyncio.Future[VmExit] = caller.create_future()

    def _done(self, ex: VmExit | BaseException) -> None:
        def put() -> None:
            if self.exited.done():
                return
            if isinstance(ex, BaseException):
                self.exited.set_exception(ex)
            else:
                self.exited.set_result(ex)
        self._caller.call_soon_threadsafe(put)

    def kill(self, *, tree: bool = True) -> None:
        """SIGKILL the command (``tree``: everything it started, through its cgroup in the guest)."""
        self.vm.spawn(self._kill(tree))

    async def _kill(self, tree: bool) -> None:
        with contextlib.suppress(Exception):
            await self.proc.signal(signal.SIGKILL, tree=tree)

    async def wait(self) -> VmExit:
        return await self.exited

    def signal_job(self, sig: int) -> None:
        """``sig`` to what a terminal's ^C would reach: on a tty, its foreground job (the
        agent asks the guest's pty); otherwise everything the command started. Its pid is the
        guest's: nothing on the host may be signalled by it (edge terminals call this)."""
        self.vm.spawn(self._signal_job(sig))

    async def _signal_job(self, sig: int) -> None:
        with contextlib.suppress(Exception):
            await self.proc.signal(sig, tree=not self.tty)

    tty = False


class MicroVM:
    """A running microVM: made by :meth:`restore` (a clone of a template), ended by :meth:`close`."""

    def __init__(self, sandbox_id: str, vdir: Path, sockets: Sockets, template: Template, layers: Sequence[Path], *,
                 uid: int, enter: Callable[[int], None]) -> None:
        self.id = sandbox_id
        self.dir = vdir
        self.template = template
        self.layers = list(layers)
        self.uid = uid
        self.sockets = sockets
        self.disk = vdir / "disk.qcow2"
        self._enter = enter
        self.driver: QemuDriver = QemuDriver([], qmp_socket=self.sockets.qmp, log=vdir / "qemu.log")
        self.agent: AgentClient | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._on_exit: list[Callable[[], None]] = []
        self._closing = False
        self.paused = False
        self.last_used = time.monotonic()
        self.quiet_stopped = False
        self._samples: list[tuple[float, int]] = []
        self.timings: dict[str, float] = {}
        """Seconds of each step of the last restore: QEMU up (QMP), state loaded and running,
        the agent's hello, the new identity."""

    # ----- life -----

    @staticmethod
    async def wait_booted(driver: QemuDriver, sockets: Sockets, timeout: float) -> None:
        """Until a freshly booted VM's agent says hello (raises past ``timeout``)."""
        deadline = time.monotonic() + timeout
        agent = await AgentClient.connect(sockets.agent, timeout=timeout)
        try:
            await agent.hello(timeout=max(0.1, deadline - time.monotonic()))
        finally:
            await agent.close()

    async def save_for_fork(self, where: Path) -> ForkPoint:
        """Stop the VM, save its whole state and copy its disk (same instant), and leave it
        stopped: the caller continues it (or not, when it was paused)."""
        state, disk = where / "state", where / "disk.qcow2"
        if not self.paused:
            await self.ensure_running()
        await self.driver.save(state, ignore_shared=False)
        await asyncio.to_thread(shutil.copyfile, self.disk, disk)
        return ForkPoint(state, disk)

    async def cont_after_save(self) -> None:
        """Run again after :meth:`save_for_fork` (its disks are taken back for writing)."""
        await self.driver.cont()

    async def forget_paths(self, paths: Sequence[str]) -> None:
        agent = self._agent()
        for p in paths:
            with contextlib.suppress(Exception):
                await agent.remove(p if p.startswith("/") else "/" + p, recursive=True)

    async def _warm_up(self) -> None:
        """Run one short command: under TCG each clone translates the guest's code afresh, and
        the first command's fork, exec and exit paths cost ~200 ms of translation. Paid here,
        it is paid before a pool hands the VM out, not by the user's first command."""
        agent = self._agent()
        with contextlib.suppress(Exception):
            proc = await agent.exec(["sh", "-c", ":"], cwd="/")
            await proc.wait(timeout=30)

    async def restore(self, *, hostname: str, warm: bool = False, fork_of: ForkPoint | None = None,
                      netns_fd: int | None = None, tap_fd: int | None = None) -> None:
        """Start this VM as a clone of its template (its RAM a copy-on-write map of the
        template's), or, with ``fork_of``, as a child of a running VM saved at that instant
        (its RAM loaded whole from the parent's state, its disk a copy of the parent's).
        ``netns_fd``/``tap_fd``: the sandbox's network namespace, where QEMU runs, and the
        NIC's tap in it (:mod:`dsec.backends.microvm.network`); the caller keeps both fds."""
        tmpl = self.template
        src = tmpl.overlay_seed if fork_of is None else fork_of.disk
        await asyncio.to_thread(shutil.copyfile, src, self.disk)
        # QEMU (as the VM's uid) opens its writable disk again when the restored machine
        # starts (an incoming machine's disks are held read-only until then): the disk and
        # its directory are the VM's uid's, and nobody else's
        os.chown(self.disk, self.uid, self.uid)
        os.chmod(self.disk, 0o600)
        os.chown(self.dir, self.uid, self.uid)
        disks = [*(Disk(p, f"dsec-l{i}") for i, p in enumerate(self.layers)),
                 Disk(self.disk, "dsec-up", readonly=False, format="qcow2")]
        ram = RamFile(tmpl.ram, shared=False) if fork_of is None else RamFile(None, shared=False)
        argv = qemu_argv(tmpl.machine, disks, self.sockets, ram=ram, incoming=True,
                         name=f"dsec-{self.id}", run_as=(self.uid, self.uid), tap_fd=tap_fd)
        self.driver = QemuDriver(argv, qmp_socket=self.sockets.qmp, log=self.dir / "qemu.log",
                                 cgroup_enter=self._enter, netns_fd=netns_fd,
                                 pass_fds=() if tap_fd is None else (tap_fd,))
        marks = [time.perf_counter()]
        await self.driver.start()
        marks.append(time.perf_counter())
        self.spawn(self._watch())
        # connect to the agent's socket while the state loads (the guest's read simply goes on)
        connecting = asyncio.ensure_future(AgentClient.connect(self.sockets.agent, timeout=HELLO_TIMEOUT_S,
                                                               sandbox_id=self.id))
        try:
            if fork_of is None:
                await self.driver.restore(tmpl.state, ignore_shared=True)
            else:
                await self.driver.restore(fork_of.state, ignore_shared=False)
            marks.append(time.perf_counter())
            self.agent = await connecting
            if fork_of is not None:
                # The child's agent holds the parent's channels (its sessions, commands in flight)
                # as if its host were still there: a disconnect makes it let go of them (their
                # output is dropped from then on), and the new connection starts clean.
                await self.agent.close()
                self.agent = await AgentClient.connect(self.sockets.agent, timeout=HELLO_TIMEOUT_S,
                                                       sandbox_id=self.id)
        except BaseException:
            connecting.cancel()
            with contextlib.suppress(BaseException):
                agent = await connecting
                await agent.close()
            raise
        await self.agent.hello(timeout=HELLO_TIMEOUT_S)
        marks.append(time.perf_counter())
        # a clone must not share the template's identity: hostname, machine-id, RNG, clock
        await self.agent.identity(hostname, machine_id=secrets.token_hex(16), seed=os.urandom(64),
                                  realtime_ns=time.time_ns())
        marks.append(time.perf_counter())
        if warm:
            await self._warm_up()
            marks.append(time.perf_counter())
        steps = ("start", "restore", "hello", "identity", "warm")
        self.timings = {k: round(b - a, 6) for k, a, b in zip(steps, marks, marks[1:], strict=False)}

    async def attach(self, pid: int, start: int, *, paused: bool = False) -> None:
        """Adopt this sandbox's VM after a restart of the backend: its QEMU over QMP, its agent
        (which greets the new connection). A VM whose vCPUs are stopped (paused, stopped for
        being quiet, or left stopped by a backend killed in the middle of a fork, after the
        save: QEMU's "postmigrate") runs for the greeting; a paused one is stopped again."""
        await self.driver.adopt(pid, start)
        status = await self.driver.execute("query-status")
        if isinstance(status, dict) and status.get("status") != "running":
            await self.driver.cont()
        self.spawn(self._watch())
        self.agent = await AgentClient.connect(self.sockets.agent, timeout=HELLO_TIMEOUT_S, sandbox_id=self.id)
        await self.agent.hello(timeout=HELLO_TIMEOUT_S)
        if paused:
            await self.driver.stop()

    async def _watch(self) -> None:
        await self.driver.wait()
        if not self._closing:
            for cb in self._on_exit:
                cb()

    def on_exit(self, cb: Callable[[], None]) -> None:
        self._on_exit.append(cb)

    def alive(self) -> bool:
        return self.driver.alive() and self.agent is not None and self.agent.alive

    def spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        self._closing = True
        if self.agent is not None:
            with contextlib.suppress(Exception):
                await self.agent.close()
        await self.driver.quit(timeout_s=2.0)
        for t in list(self._tasks):
            t.cancel()

    async def detach(self) -> None:
        """Let go of the VM without ending it (the backend is closing to be restarted)."""
        self._closing = True
        if self.agent is not None:
            with contextlib.suppress(Exception):
                await self.agent.close()
        await self.driver.let_go()
        for t in list(self._tasks):
            t.cancel()

    def _agent(self) -> AgentClient:
        if self.agent is None or not self.agent.alive:
            raise SandboxFailed(f"sandbox {self.id}: its VM's agent is gone", sandbox_id=self.id, reason="agent_gone")
        return self.agent

    # ----- pause -----

    async def pause(self, *, reclaim: bool, freeze: Callable[[bool], None],
                    push_out: Callable[[], tuple[int, int]]) -> PauseResult:
        """Stop the vCPUs (QMP ``stop``), freeze QEMU's threads (its cgroup: no host CPU at
        all), then push its memory out to swap (``push_out``: before, after)."""
        t0 = time.perf_counter()
        await self.ensure_running()
        await self.driver.stop()
        freeze(True)
        frozen = time.perf_counter() - t0
        self.paused = True
        figures = await asyncio.to_thread(push_out) if reclaim else None
        return PauseResult(frozen, time.perf_counter() - t0, Reclaim(*figures) if figures else None)

    async def resume(self, *, freeze: Callable[[bool], None]) -> None:
        freeze(False)
        await self.driver.cont()
        self.paused = False
        self.touch()

    # ----- quiet VMs stop until they are needed -----

    def touch(self) -> None:
        self.last_used = time.monotonic()

    async def ensure_running(self) -> None:
        """A VM stopped for being quiet runs again (QMP ``cont``, ~1 ms) before anything reaches it."""
        self.touch()
        if self.quiet_stopped:
            self.quiet_stopped = False
            await self.driver.cont()

    async def stop_if_quiet(self, idle_s: float, cpu_frac: float, now: float) -> bool:
        """Stop the VM (its clock stands still) when nothing reached it for ``idle_s`` and its
        QEMU used under ``cpu_frac`` of a core meanwhile: an idle clone then costs no CPU.
        A VM busy on its own (a build in the background) keeps running."""
        if self.paused or self.quiet_stopped or not self.driver.alive() or self.agent is None or \
                self.agent.open_channels:
            return False
        ticks = cpu_ticks(self.driver.pid)
        self._samples.append((now, ticks))
        while len(self._samples) > 1 and now - self._samples[1][0] >= idle_s:
            self._samples.pop(0)
        if now - self.last_used < idle_s or now - self._samples[0][0] < idle_s:
            return False
        used = (ticks - self._samples[0][1]) / _CLK_TCK / (now - self._samples[0][0])
        if used >= cpu_frac:
            return False
        self.quiet_stopped = True
        try:
            await self.driver.stop()
        except Exception:
            self.quiet_stopped = False
            raise
        return True

    # ----- commands -----

    async def start_process(self, argv: Sequence[str], *, stdin: int, stdout: int, stderr: int,
                            env: Mapping[str, str], cwd: str, user: int | str,
                            caller: asyncio.AbstractEventLoop, tty: bool = False,
                            size: tuple[int, int] = (24, 80)) -> VmProcess:
        """Start ``argv`` with the caller's fds as stdio (dup'ed here: the caller may close
        its copies at once); its handle."""
        check_argv(self.id, argv, cwd)
        uid, gid = user_ids(user)
        merged = command_env({}, env)
        agent = self._agent()
        t0 = time.perf_counter()
        proc = await agent.exec(argv, env=list(merged.items()), cwd=cwd, uid=uid, gid=gid, stdin=stdin >= 0,
                                tty=tty, size=size)
        handle = VmProcess(self, proc, caller)
        handle.tty = tty
        handle.start_latency_s = time.perf_counter() - t0
        fds = [os.dup(fd) if fd >= 0 else -1 for fd in (stdin, stdout, stderr)]
        for fd in fds:
            if fd >= 0:
                os.set_blocking(fd, False)
        self.spawn(self._bridge(handle, *fds))
        return handle

    async def run(self, argv: Sequence[str], *, env: Mapping[str, str], cwd: str, user: int | str,
                  stdin: bytes | None, limit: float | None, idle_timeout: float | None, cap: int) -> Collected[VmExit]:
        """A command to its end, on the VM loop, its output kept (head and tail, ``cap`` each)
        straight from the agent's frames: no pipes, one hand-over each way. ``limit`` and
        ``idle_timeout`` kill its whole tree (what :func:`collect` does for a streamed exec)."""
        check_argv(self.id, argv, cwd)
        uid, gid = user_ids(user)
        merged = command_env({}, env)
        agent = self._agent()
        caps = {1: BoundedCapture(cap), 2: BoundedCapture(cap)}
        last = [time.monotonic()]

        def feed(fd: int) -> Callable[[bytes], None]:
            def take(data: bytes) -> None:
                caps[fd].feed(data)
                last[0] = time.monotonic()
            return take

        t0 = time.monotonic()
        proc = await agent.exec(argv, env=list(merged.items()), cwd=cwd, uid=uid, gid=gid, stdin=stdin is not None,
                                on_stdout=feed(1), on_stderr=feed(2))
        timed_out: list[str] = []

        async def kill(reason: str) -> None:
            timed_out.append(reason)
            with contextlib.suppress(Exception):
                await proc.signal(signal.SIGKILL, tree=True)

        async def watch() -> None:
            while True:
                now = time.monotonic()
                waits = []
                if limit is not None:
                    waits.append((t0 + limit - now, "timeout"))
                if idle_timeout is not None:
                    waits.append((last[0] + idle_timeout - now, "idle_timeout"))
                wait, why = min(waits)
                if wait <= 0:
                    await kill(why)
                    return
                await asyncio.sleep(wait)

        watcher = asyncio.ensure_future(watch()) if limit is not None or idle_timeout is not None else None
        try:
            if stdin is not None:
                await proc.write_stdin(stdin)
                await proc.close_stdin()
            ex = await proc.wait()
        except BaseException:
            self.spawn(kill("cancelled"))
            raise
        finally:
            if watcher is not None:
                watcher.cancel()
        exit_ = VmExit(None if ex.signal else ex.code, ex.signal or None, ex.utime_s, ex.stime_s, ex.oom_kills,
                       ex.pids_hits, ex.disk_free, ex.inodes_free)
        return Collected(exit_, caps[1], caps[2], timed_out[0] if timed_out else None, time.monotonic() - t0)

    async def _bridge(self, h: VmProcess, in_fd: int, out_fd: int, err_fd: int) -> None:
        proc = h.proc
        feeder = asyncio.ensure_future(self._feed(proc, in_fd)) if in_fd >= 0 else None
        sizer = asyncio.ensure_future(self._follow_size(proc, out_fd)) if h.tty and out_fd >= 0 else None
        outs = {1: out_fd, 2: err_fd}
        try:
            async for fd, data in proc.output():
                target = outs.get(fd, -1)
                if target < 0:
                    continue
                try:
                    await write_all(target, data)
                except OSError:  # the reader is gone: drop what follows on that stream
                    os.close(target)
                    outs[fd] = -1
            ex = await proc.wait()
            h._done(VmExit(None if ex.signal else ex.code, ex.signal or None, ex.utime_s, ex.stime_s,
                           ex.oom_kills, ex.pids_hits, ex.disk_free, ex.inodes_free))
        except BaseException as exc:
            h._done(exc if isinstance(exc, HostError) else HostError(f"sandbox {self.id}: lost the command: {exc!r}",
                                                                   sandbox_id=self.id))
            if isinstance(exc, asyncio.CancelledError):
                raise
        finally:
            for fd in outs.values():
                if fd >= 0:
                    os.close(fd)
            if feeder is not None:
                feeder.cancel()
            if sizer is not None:
                sizer.cancel()

    async def _follow_size(self, proc: AgentProcess, slave: int) -> None:
        """A terminal's size, as its host side was last set (``TIOCSWINSZ`` on the master the
        caller holds), carried to the guest's pty, which signals the program (SIGWINCH). The
        host's pty has no session to tell: its size is looked at 20 times a second."""
        last = None
        while True:
            try:
                rows, cols = struct.unpack("HHHH", fcntl.ioctl(slave, termios.TIOCGWINSZ, b"\0" * 8))[:2]
            except OSError:
                return
            if last is not None and (rows, cols) != last and rows > 0 and cols > 0:
                with contextlib.suppress(Exception):
                    await self.ensure_running()
                    await proc.resize(rows, cols)
            last = (rows, cols)
            await asyncio.sleep(0.05)

    async def _feed(self, proc: AgentProcess, fd: int) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                try:
                    data = os.read(fd, 65536)
                except BlockingIOError:
                    ready = loop.create_future()
                    loop.add_reader(fd, set_done, ready)
                    try:
                        await ready
                    finally:
                        loop.remove_reader(fd)
                    continue
                except OSError:
                    data = b""
                await self.ensure_running()
                if not data:
                    await proc.close_stdin()
                    return
                await proc.write_stdin(data)
        except HostError:
            pass
        finally:
            os.close(fd)


class VmSessionHost:
    """One microVM sandbox as its persistent sessions see it (``SessionHost``)."""

    def __init__(self, backend: MicroVMBackend, sandbox_id: str) -> None:
        self._backend = backend
        self._sid = sandbox_id

    async def start_process(self, argv: Sequence[str], *, stdin: int, stdout: int, stderr: int,
                            env: Mapping[str, str] | None = None, cwd: str = "/", user: int | str = 0) -> VmProcess:
        proc: VmProcess = await self._backend.start_process(self._sid, argv, stdin=stdin, stdout=stdout,
                                                            stderr=stderr, env=env, cwd=cwd, user=user)
        return proc

    def wake(self) -> bool:
        return self._backend.wake(self._sid)

    def limit_baseline(self) -> object | None:
        return None

    def limit_hit(self, before: Any, **kw: Any) -> LimitHit | None:
        return None

    def kill_command(self, shell: Any) -> None:
        """Kill what the shell runs now, not the shell: everything in the shell's cgroup in
        the guest but the shell itself."""
        shell.vm.spawn(_kill_children(shell))

    def touch(self) -> None:
        self._backend.last_activity[self._sid] = time.monotonic()

    def drop_session(self, session_id: str) -> None:
        return None


async def _kill_children(shell: VmProcess) -> None:
    with contextlib.suppress(Exception):
        await shell.proc.signal(signal.SIGKILL, tree=True, spare=True)
