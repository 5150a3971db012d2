"""The VMM driver: one QEMU process per microVM, controlled over QMP.

:class:`VmDriver` is what the backend needs of a VMM (start a machine, stop and continue it,
save its device state, restore into it, end it); :class:`QemuDriver` is its one implementation
(QEMU 10 from bookworm-backports). Another VMM (Firecracker, cloud-hypervisor) is another
class behind the same protocol, added where it can be installed and tested.

QMP is spoken with the QEMU project's own asyncio client (``qemu.qmp``), not a hand-written
one: it negotiates capabilities, matches answers to requests and queues events, which a
small client would each have to get right again. A QEMU process starts inside the sandbox's
cgroups (moved there before it does any work), as an unprivileged uid (``-run-with user=``)
and under its seccomp filter (``-sandbox on``); its QMP socket is the host's only.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from qemu.qmp import QMPClient
from qemu.qmp.error import QMPError

from dsec.backends.common.netfilter import enter_netns
from dsec.backends.microvm.records import proc_start as _proc_start
from dsec.errors import HostError

MIGRATE_POLL_S = 0.001


class VmDriverError(HostError):
    """The VMM failed or answered an error (what QEMU said is in the message)."""


@dataclass(frozen=True, slots=True)
class VmExit:
    code: int | None
    signal: int | None
    log_tail: str


class VmDriver(Protocol):
    """One running (or incoming) machine of a VMM."""

    pid: int

    async def start(self, *, deadline_s: float) -> None: ...
    async def stop(self) -> None: ...
    async def cont(self) -> None: ...
    async def save(self, state_file: Path, *, ignore_shared: bool) -> float: ...
    async def restore(self, state_file: Path, *, ignore_shared: bool) -> None: ...
    async def quit(self, *, timeout_s: float = 5.0) -> VmExit: ...
    def kill(self) -> None: ...
    def alive(self) -> bool: ...


class QemuDriver:
    """A QEMU process: started by :meth:`start` (into ``cgroup_enter``'s cgroups), driven over
    QMP, ended by :meth:`quit` or :meth:`kill`. Its stdout/stderr go to ``log``."""

    def __init__(self, argv: Sequence[str], *, qmp_socket: Path, log: Path,
                 cgroup_enter: Any = None, env: Mapping[str, str] | None = None,
                 netns_fd: int | None = None, pass_fds: Sequence[int] = ()) -> None:
        """``netns_fd``: the network namespace QEMU starts in (its sandbox's); ``pass_fds``:
        fds QEMU inherits under their numbers (the NIC's tap)."""
        self.argv = list(argv)
        self._netns_fd = netns_fd
        self._pass_fds = tuple(pass_fds)
        self.qmp_socket = qmp_socket
        self.log = log
        self._enter = cgroup_enter
        self._env = dict(env or {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"})
        self._proc: asyncio.subprocess.Process | None = None
        self._qmp: QMPClient | None = None
        self.pid = 0
        self._adopted_start = 0
        """For a QEMU this process did not start (adopted after a restart): its start time."""

    # ----- life -----

    async def start(self, *, deadline_s: float = 10.0) -> None:
        """Start QEMU and connect to its QMP socket (QEMU makes it within ~20-30 ms)."""
        with open(self.log, "ab") as out:
            netns = self._netns_fd
            self._proc = await asyncio.create_subprocess_exec(
                *self.argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out, env=self._env,
                start_new_session=True, pass_fds=self._pass_fds,
                preexec_fn=None if netns is None else (lambda: enter_netns(netns)),
            )
        self.pid = self._proc.pid
        if self._enter is not None:
            try:
                self._enter(self.pid)
            except OSError as exc:
                self.kill()
                await self._reap(1.0)
                raise VmDriverError(f"cannot move QEMU (pid {self.pid}) into its cgroups: {exc}") from None
        deadline = time.monotonic() + deadline_s
        while True:
            if self._proc.returncode is not None or not self.alive():
                await self._reap(1.0)
                raise VmDriverError(f"QEMU exited at start (code {self._proc.returncode}): {self.log_tail()}")
            if self.qmp_socket.exists():
                qmp = QMPClient(f"dsec-{self.pid}")
                try:
                    await qmp.connect(str(self.qmp_socket))
                    self._qmp = qmp
                    return
                except (QMPError, OSError):
                    with contextlib.suppress(Exception):
                        await qmp.disconnect()
            if time.monotonic() > deadline:
                self.kill()
                await self._reap(1.0)
                raise VmDriverError(f"QEMU's QMP socket did not answer within {deadline_s:g} s: {self.log_tail()}")
            await asyncio.sleep(0.002)

    async def adopt(self, pid: int, start: int, *, timeout_s: float = 5.0) -> None:
        """Take over a QEMU a previous process started (``pid`` with its ``start`` time) and
        connect to its QMP socket, which QEMU reopens once its old client has gone."""
        if _proc_start(pid) != start or start == 0:
            raise VmDriverError(f"QEMU (pid {pid}) is gone")
        self.pid, self._adopted_start = pid, start
        qmp = QMPClient(f"dsec-{pid}")
        try:
            async with asyncio.timeout(timeout_s):
                await qmp.connect(str(self.qmp_socket))
        except (QMPError, OSError, TimeoutError) as exc:
            with contextlib.suppress(Exception):
                await qmp.disconnect()
            raise VmDriverError(f"QEMU (pid {pid}): its QMP socket {self.qmp_socket} does not answer: {exc!r}") from None
        self._qmp = qmp

    def alive(self) -> bool:
        if self._adopted_start:
            return _proc_start(self.pid) == self._adopted_start
        return self._proc is not None and self._proc.returncode is None

    def kill(self) -> None:
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)

    async def _reap(self, timeout_s: float) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self._wait_exit()

    async def _wait_exit(self) -> None:
        if self._proc is not None:
            await self._proc.wait()
            return
        while self._adopted_start and self.alive():  # not our child: its exit is seen by polling
            await asyncio.sleep(0.2)

    async def quit(self, *, timeout_s: float = 5.0) -> VmExit:
        """End the machine: QMP ``quit``, SIGKILL past ``timeout_s``."""
        if self._qmp is not None and self.alive():
            with contextlib.suppress(Exception):
                async with asyncio.timeout(min(1.0, timeout_s)):
                    await self._qmp.execute("quit")
        await self._close_qmp()
        await self._reap(timeout_s)
        self.kill()
        await self._reap(timeout_s)
        return self.exit_status()

    async def let_go(self) -> None:
        """Close the QMP connection and leave QEMU running (another process will adopt it)."""
        await self._close_qmp()

    async def wait(self) -> VmExit:
        await self._wait_exit()
        await self._close_qmp()
        return self.exit_status()

    def exit_status(self) -> VmExit:
        rc = None if self._proc is None else self._proc.returncode
        code, sig = (rc, None) if rc is None or rc >= 0 else (None, -rc)
        return VmExit(code, sig, self.log_tail())

    async def _close_qmp(self) -> None:
        qmp, self._qmp = self._qmp, None
        if qmp is not None:
            with contextlib.suppress(Exception):
                await qmp.disconnect()

    def log_tail(self, n: int = 2000) -> str:
        try:
            with open(self.log, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - n))
                return f.read().decode(errors="replace").strip() or "(no output)"
        except OSError:
            return "(no log)"

    # ----- control -----

    async def execute(self, cmd: str, args: Mapping[str, object] | None = None) -> Any:
        if self._qmp is None:
            raise VmDriverError(f"QEMU (pid {self.pid}) has no QMP connection (not started, or ended)")
        try:
            return await self._qmp.execute(cmd, args)
        except QMPError as exc:
            raise VmDriverError(f"QEMU (pid {self.pid}) refused {cmd}: {exc}") from None
        except (OSError, EOFError) as exc:
            raise VmDriverError(f"QEMU (pid {self.pid}) gone during {cmd}: {exc!r}; {self.log_tail()}") from None

    async def stop(self) -> None:
        await self.execute("stop")

    async def cont(self) -> None:
        await self.execute("cont")

    async def _caps(self, ignore_shared: bool) -> None:
        await self.execute("migrate-set-capabilities", {"capabilities": [
            {"capability": "x-ignore-shared", "state": ignore_shared}]})

    async def _wait_migration(self, what: str, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            info = await self.execute("query-migrate")
            status = info.get("status") if isinstance(info, dict) else None
            if status == "completed":
                return dict(info)
            if status in ("failed", "cancelled"):
                raise VmDriverError(f"{what} {status}: {info.get('error-desc', info)}")
            if time.monotonic() > deadline:
                raise VmDriverError(f"{what} not done within {timeout_s:g} s (status {status})")
            await asyncio.sleep(MIGRATE_POLL_S)

    async def _pass_fd(self, name: str, fd: int) -> None:
        """Hand QEMU an open file (SCM_RIGHTS, then ``getfd``): QEMU, running as an
        unprivileged uid, never opens a path of ours itself."""
        if self._qmp is None:
            raise VmDriverError(f"QEMU (pid {self.pid}) has no QMP connection")
        self._qmp.send_fd_scm(fd)
        await self.execute("getfd", {"fdname": name})

    async def save(self, state_file: Path, *, ignore_shared: bool, timeout_s: float = 60.0) -> float:
        """Stop the machine and write its state to ``state_file``; seconds it took.
        ``ignore_shared``: RAM in a shared file is not written (a template: the file is kept)."""
        t0 = time.perf_counter()
        await self._caps(ignore_shared)
        await self.stop()
        fd = os.open(state_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o444)
        try:
            await self._pass_fd("dsec-state", fd)
        finally:
            os.close(fd)
        await self.execute("migrate", {"uri": "fd:dsec-state"})
        await self._wait_migration("saving the machine", timeout_s)
        return time.perf_counter() - t0

    async def restore(self, state_file: Path, *, ignore_shared: bool, timeout_s: float = 60.0) -> None:
        """Load ``state_file`` into this incoming machine (started with ``incoming=True``) and run it."""
        await self._caps(ignore_shared)
        fd = os.open(state_file, os.O_RDONLY | os.O_CLOEXEC)
        try:
            await self._pass_fd("dsec-state", fd)
        finally:
            os.close(fd)
        await self.execute("migrate-incoming", {"uri": "fd:dsec-state"})
        await self._wait_migration("restoring the machine", timeout_s)
        await self.cont()


def qemu_build(qemu: Path) -> str:
    """A QEMU build's identity: its version line, size and mtime (a template saved by one
    build is restored by the same build only)."""
    try:
        out = subprocess.run([str(qemu), "--version"], capture_output=True, text=True, timeout=10, check=True)
        st = qemu.stat()
    except (OSError, subprocess.SubprocessError) as exc:
        raise HostError(f"QEMU at {qemu} does not run ({exc}); install qemu-system-x86 from "
                        "bookworm-backports (scripts/setup.sh does)") from None
    return f"{out.stdout.splitlines()[0].strip()} size={st.st_size} mtime={int(st.st_mtime)}"
