"""Shared test machinery: markers, runtime fixtures, failure trails and the leak check.

- ``@pytest.mark.root`` tests skip (with the reason) when not root or when the
  host lacks a kernel feature the container runtime needs.
- One busybox base layer is built per session; every runtime imports it into
  its own store (a copy of a 2 MB file), so runtimes never share pins.
- Runtimes are async; tests stay sync and drive them through
  :meth:`RuntimeHarness.run` (one ``asyncio.Runner`` per runtime, so the
  spawner's loop readers live as long as the runtime).
- A failing test prints a trail: every sandbox it created, with its record's
  events and cgroup stats.
- At the end of the session a leak check fails the run if any mount, cgroup,
  network namespace, process, record or uid-slot file of ours is left.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import pytest

T = TypeVar("T")

IS_ROOT = os.geteuid() == 0
SESSION_TOKEN = secrets.token_hex(3)
RT_PREFIX = f"t{SESSION_TOKEN}"
"""Every runtime a test starts is named ``<RT_PREFIX>-<suffix>``; the leak check looks for it."""
ENV_MARK = "DSEC_TEST_SESSION"
"""Set in this process, so spawners (and their sandbox inits) carry it in their environ."""
CGROUP_ROOT = Path("/sys/fs/cgroup")
CONTROLLERS = ("cpu", "memory", "pids", "freezer")
MiB = 1024 * 1024


# ---------------------------------------------------------------- markers ----


def _host_problem() -> str | None:
    """Why this host cannot run root tests, or None."""
    if not IS_ROOT:
        return "needs root (namespaces, cgroups, mounts)"
    try:
        from dsec.backends.container.cgroups import check_host as check_cgroups
        from dsec.backends.container.hostcheck import check_host

        check_host()
        check_cgroups()
    except Exception as exc:  # HostError, or an import problem on an odd host
        return f"host cannot run sandboxes: {exc}"
    return None


SESSION_TMP = Path(tempfile.gettempdir()) / f"dsec-test-s{SESSION_TOKEN}"
"""Every temporary directory of this session (TMPDIR points here for it and its children), so
the leak check tells this session's mounts from those of another test run on the same host."""


def pytest_configure(config: pytest.Config) -> None:
    os.environ[ENV_MARK] = SESSION_TOKEN
    SESSION_TMP.mkdir(mode=0o755, exist_ok=True)
    os.environ["TMPDIR"] = str(SESSION_TMP)
    tempfile.tempdir = str(SESSION_TMP)


def pytest_unconfigure(config: pytest.Config) -> None:
    # Only remove when nothing is mounted below it (the leak check unmounts what it can).
    if SESSION_TMP.is_dir() and not any(f" {SESSION_TMP}/" in ln for ln in mountinfo_lines()):
        shutil.rmtree(SESSION_TMP, ignore_errors=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not any(item.get_closest_marker("root") for item in items):
        return
    problem = _host_problem()
    if problem is None:
        return
    skip = pytest.mark.skip(reason=problem)
    for item in items:
        if item.get_closest_marker("root"):
            item.add_marker(skip)


# ------------------------------------------------------------ host probes ----


def loop_backing_files() -> dict[str, str]:
    """Attached loop devices and their backing files (/sys/block/loopN/loop/backing_file)."""
    out = {}
    for d in Path("/sys/block").glob("loop*"):
        with contextlib.suppress(OSError):
            out[f"/dev/{d.name}"] = (d / "loop" / "backing_file").read_text().strip()
    return out


def mountinfo_lines() -> list[str]:
    with open("/proc/self/mountinfo") as f:
        return f.read().splitlines()


def _mount_key(line: str) -> str:
    """A mountinfo line without its mount ids (which change on remount)."""
    return line.split(" ", 2)[2]


def proc_comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def proc_state(pid: int) -> str:
    try:
        data = Path(f"/proc/{pid}/stat").read_bytes()
        return data[data.rindex(b")") + 2 :].split()[0].decode()
    except (OSError, ValueError, IndexError):
        return ""


def proc_status(pid: int) -> dict[str, str]:
    out: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            k, _, v = line.partition(":")
            out[k] = v.strip()
    return out


def proc_cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def pid_alive(pid: int) -> bool:
    """Exists and is not a zombie."""
    st = proc_state(pid)
    return st not in ("", "Z", "X")


def all_pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _ours(pid: int) -> bool:
    """A process started (directly or not) by this test session."""
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        env = b""
    if f"{ENV_MARK}={SESSION_TOKEN}".encode() in env.split(b"\0"):
        return True
    try:
        cg = Path(f"/proc/{pid}/cgroup").read_text()
    except OSError:
        return False
    return f"/dsec/{RT_PREFIX}-" in cg


def dsec_processes() -> dict[int, str]:
    """Live dsec-spawner / dsec-init processes of this session: pid -> description."""
    found: dict[int, str] = {}
    for pid in all_pids():
        comm = proc_comm(pid)
        cmd = " ".join(proc_cmdline(pid))
        is_dsec = comm in ("dsec-init", "dsec-spawner") or "dsec-spawner" in cmd
        if is_dsec and pid_alive(pid) and _ours(pid):
            found[pid] = f"pid {pid} comm={comm} state={proc_state(pid)} cmdline={cmd!r}"
    return found


def netns_names() -> set[str]:
    try:
        return {n for n in os.listdir("/run/netns") if "dsec" in n}
    except OSError:
        return set()


def nft_tables() -> set[str]:
    """The host's nftables tables named for DSec (sandbox networks put theirs there)."""
    if not IS_ROOT or shutil.which("nft") is None:
        return set()
    out = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True).stdout
    return {ln.strip() for ln in out.splitlines() if "dsec" in ln}


def runtime_cgroups(prefix: str = RT_PREFIX) -> list[Path]:
    """cgroup dirs of our runtimes (``dsec/<prefix>*``) in every controller hierarchy."""
    out: list[Path] = []
    for hier in CGROUP_ROOT.iterdir():
        parent = hier / "dsec"
        with contextlib.suppress(OSError):
            out.extend(p for p in parent.iterdir() if p.is_dir() and p.name.startswith(prefix))
    return sorted(out)


def dsec_cgroup_roots() -> set[Path]:
    """``dsec`` directories at the top of any cgroup hierarchy (runtimes remove theirs when empty)."""
    return {p for p in CGROUP_ROOT.glob("*/dsec") if p.is_dir()}


def wait_until(pred: Callable[[], bool], timeout: float = 5.0, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        if pred():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)


# --------------------------------------------------------------- the probe ----

# A static helper uploaded into sandboxes: tries syscalls busybox cannot make and
# prints "<op> <return value> <errno name>" per argument ("op" or "op=arg").
PROBE_C = r"""
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/perf_event.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/ptrace.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <termios.h>
#include <time.h>
#include <unistd.h>

static long op(const char *name, const char *arg) {
    char buf[256];
    if (!strcmp(name, "mount")) return mount("none", "/tmp", "tmpfs", 0, "size=1m");
    if (!strcmp(name, "umount")) return umount2("/proc", MNT_DETACH);
    if (!strcmp(name, "pivot_root")) return syscall(SYS_pivot_root, "/tmp", "/tmp");
    if (!strcmp(name, "fsopen")) return syscall(SYS_fsopen, "tmpfs", 0);
    if (!strcmp(name, "open_tree")) return syscall(SYS_open_tree, AT_FDCWD, "/", 1);
    if (!strcmp(name, "unshare_user")) return unshare(CLONE_NEWUSER);
    if (!strcmp(name, "unshare_mnt")) return unshare(CLONE_NEWNS);
    if (!strcmp(name, "unshare_net")) return unshare(CLONE_NEWNET);
    if (!strcmp(name, "clone_newuser") || !strcmp(name, "clone_newns")) {
        long fl = !strcmp(name, "clone_newuser") ? CLONE_NEWUSER : CLONE_NEWNS;
        long r = syscall(SYS_clone, fl | SIGCHLD, 0, 0, 0, 0);
        if (r == 0) _exit(0);
        if (r > 0) waitpid((pid_t)r, NULL, 0);
        return r;
    }
    if (!strcmp(name, "clone3")) {
        uint64_t args[11] = {0};
        args[0] = CLONE_NEWUSER; args[4] = SIGCHLD;
        long r = syscall(SYS_clone3, args, 88);
        if (r == 0) _exit(0);
        if (r > 0) waitpid((pid_t)r, NULL, 0);
        return r;
    }
    if (!strcmp(name, "setns")) { int fd = open("/proc/self/ns/net", O_RDONLY); return setns(fd, 0); }
    if (!strcmp(name, "keyctl")) return syscall(SYS_keyctl, 0, -3, 0);
    if (!strcmp(name, "add_key")) return syscall(SYS_add_key, "user", "dsec", "x", 1, -3);
    if (!strcmp(name, "request_key")) return syscall(SYS_request_key, "user", "dsec", NULL, 0);
    if (!strcmp(name, "bpf")) return syscall(SYS_bpf, 0, NULL, 0);
    if (!strcmp(name, "perf_event_open")) {
        struct perf_event_attr a; memset(&a, 0, sizeof a);
        a.type = PERF_TYPE_SOFTWARE; a.size = sizeof a; a.config = PERF_COUNT_SW_CPU_CLOCK;
        return syscall(SYS_perf_event_open, &a, 0, -1, -1, 0);
    }
    if (!strcmp(name, "userfaultfd")) return syscall(SYS_userfaultfd, 0);
    if (!strcmp(name, "kexec_load")) return syscall(SYS_kexec_load, 0, 0, NULL, 0);
    if (!strcmp(name, "init_module")) return syscall(SYS_init_module, NULL, 0, "");
    if (!strcmp(name, "finit_module")) return syscall(SYS_finit_module, -1, "", 0);
    if (!strcmp(name, "delete_module")) return syscall(SYS_delete_module, "dsec_nonexistent", 0);
    if (!strcmp(name, "reboot")) return syscall(SYS_reboot, 0, 0, 0, NULL);  /* bad magic: harmless */
    if (!strcmp(name, "swapon")) return syscall(SYS_swapon, "/nonexistent", 0);
    if (!strcmp(name, "clock_settime")) {
        struct timespec ts; clock_gettime(CLOCK_REALTIME, &ts);
        return syscall(SYS_clock_settime, CLOCK_REALTIME, &ts);
    }
    if (!strcmp(name, "settimeofday")) return syscall(SYS_settimeofday, NULL, NULL);
    if (!strcmp(name, "open_by_handle_at")) return syscall(SYS_open_by_handle_at, AT_FDCWD, NULL, 0);
    if (!strcmp(name, "io_uring_setup")) { char p[120] = {0}; return syscall(SYS_io_uring_setup, 1, p); }
    if (!strcmp(name, "acct")) return syscall(SYS_acct, NULL);
    if (!strcmp(name, "syslog")) return syscall(SYS_syslog, 10, NULL, 0);
    if (!strcmp(name, "personality")) return syscall(SYS_personality, 0xffffffffUL);  /* query only */
    if (!strcmp(name, "kcmp")) return syscall(SYS_kcmp, getpid(), getpid(), 0, 0, 0);
    if (!strcmp(name, "kexec_file_load")) return syscall(SYS_kexec_file_load, -1, -1, 0, "", 0);
    if (!strcmp(name, "name_to_handle_at")) return syscall(SYS_name_to_handle_at, AT_FDCWD, "/", NULL, NULL, 0);
    if (!strcmp(name, "fanotify_init")) return syscall(SYS_fanotify_init, 0, 0);
    if (!strcmp(name, "process_madvise")) return syscall(SYS_process_madvise, -1, NULL, 0, 0, 0);
    if (!strcmp(name, "get_mempolicy")) { int m; return syscall(SYS_get_mempolicy, &m, NULL, 0, NULL, 0); }
    if (!strcmp(name, "set_mempolicy")) return syscall(SYS_set_mempolicy, 0, NULL, 0);
    if (!strcmp(name, "quotactl")) return syscall(SYS_quotactl, 0, "/", 0, NULL);
    if (!strcmp(name, "swapoff")) return syscall(SYS_swapoff, "/nonexistent");
    if (!strcmp(name, "io_uring_enter")) return syscall(SYS_io_uring_enter, -1, 0, 0, 0, NULL, 0);
    if (!strcmp(name, "int80_getpid")) {
        /* an i386 system call from a 64-bit process: the filter must kill it, not allow it */
        long r;
        __asm__ volatile("int $0x80" : "=a"(r) : "a"(20L) : "memory");
        return r;
    }
    if (!strcmp(name, "af_packet")) return socket(AF_PACKET, SOCK_RAW, 0);
    if (!strcmp(name, "raw_socket")) return socket(AF_INET, SOCK_RAW, 1);
    if (!strcmp(name, "netlink_route_raw")) return socket(AF_NETLINK, SOCK_RAW, 0 /* NETLINK_ROUTE */);
    if (!strcmp(name, "netlink_audit")) return socket(AF_NETLINK, SOCK_RAW, 9 /* NETLINK_AUDIT */);
    if (!strcmp(name, "tiocsti")) { char c = 'x'; return ioctl(0, TIOCSTI, &c); }
    if (!strcmp(name, "mknod")) return mknod("/tmp/dsec-probe-null", S_IFCHR | 0666, makedev(1, 3));
    if (!strcmp(name, "setuid0")) return setuid(0);
    /* the sandbox's init (pid 1) */
    if (!strcmp(name, "ptrace_init")) return ptrace(PTRACE_ATTACH, 1, 0, 0);
    if (!strcmp(name, "ptrace_seize_init")) return ptrace(PTRACE_SEIZE, 1, 0, 0);
    if (!strcmp(name, "vm_read_init")) {
        struct iovec l = {buf, 8}, r = {(void *)0x400000, 8};
        return process_vm_readv(1, &l, 1, &r, 1, 0);
    }
    if (!strcmp(name, "pidfd_getfd_init")) {
        long pfd = syscall(SYS_pidfd_open, 1, 0);
        if (pfd < 0) return pfd;
        return syscall(SYS_pidfd_getfd, pfd, 3, 0);
    }
    if (!strcmp(name, "pidfd_kill_init")) {
        long pfd = syscall(SYS_pidfd_open, 1, 0);
        if (pfd < 0) return pfd;
        return syscall(SYS_pidfd_send_signal, pfd, SIGKILL, NULL, 0);
    }
    if (!strcmp(name, "kill_init")) return kill(1, arg ? atoi(arg) : SIGKILL);
    if (!strcmp(name, "open_r") || !strcmp(name, "open_w")) {
        int fd = open(arg, !strcmp(name, "open_r") ? O_RDONLY : O_WRONLY);
        if (fd < 0) return -1;
        if (!strcmp(name, "open_r")) { long n = read(fd, buf, sizeof buf); if (n < 0) return -1; }
        return 0;
    }
    if (!strcmp(name, "readlink")) return readlink(arg, buf, sizeof buf);
    if (!strcmp(name, "opendir")) return open(arg, O_RDONLY | O_DIRECTORY);
    if (!strcmp(name, "access")) return access(arg, F_OK);
    if (!strcmp(name, "chroot_escape")) {
        /* the classic escape: chroot into a subdir, walk up from outside it, chroot "." */
        mkdir("/tmp/dsec-chroot", 0700);
        int keep = open("/", O_RDONLY | O_DIRECTORY);
        if (chroot("/tmp/dsec-chroot") < 0) return -1;
        if (fchdir(keep) < 0) return -1;
        for (int i = 0; i < 64; i++) if (chdir("..") < 0) return -1;
        if (chroot(".") < 0) return -1;
        return access(arg, F_OK);
    }
    if (!strcmp(name, "alloc")) {
        size_t mib = (size_t)atol(arg);
        for (size_t i = 0; i < mib; i++) {
            char *p = malloc(1 << 20);
            if (!p) return -1;
            memset(p, 1, 1 << 20);
        }
        return 0;
    }
    errno = EINVAL;
    return -2;
}

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    for (int i = 1; i < argc; i++) {
        char *shown = strdup(argv[i]);
        char *name = argv[i], *arg = strchr(name, '=');
        if (arg) *arg++ = 0;
        errno = 0;
        long r = op(name, arg);
        const char *e = r < 0 ? strerrorname_np(errno) : "OK";
        printf("%s %ld %s\n", shown, r, e ? e : "?");
    }
    return 0;
}
"""

PROBE_PATH = "/usr/bin/dsec-probe"


# ---------------------------------------------------------------- runtimes ----


class RuntimeHarness:
    """A started ContainerRuntime plus a private event loop and sync helpers."""

    def __init__(self, name: str, base: Path, seed: Path, probe: Path | None = None) -> None:
        self.name = name
        self.base = base
        self.state_dir = base / f"state-{name}"
        self.run_dir = base / "run"  # shared: uid slot files are node-wide
        self.seed = seed
        self.probe_binary = probe
        self.runner: asyncio.Runner | None = None
        self.rt: Any = None
        self.layer: Any = None

    # -- lifecycle --

    def prepare(self) -> RuntimeHarness:
        """Make the runtime object and import the base layer, without starting it."""
        from dsec.backends.container.runtime import ContainerRuntime

        self.rt = ContainerRuntime(name=self.name, state_dir=self.state_dir, run_dir=self.run_dir)
        self.layer = self.rt.store.add_erofs(self.seed, name="busybox", tag="test", kind="base")
        return self

    def start(self) -> RuntimeHarness:
        if self.rt is None:
            self.prepare()
        self.runner = asyncio.Runner()
        self.run(self.rt.start())
        return self

    def close(self, *, destroy_all: bool = True) -> None:
        if self.runner is None:
            return
        try:
            if self.rt is not None:
                self.run(self.rt.close(destroy_all=destroy_all))
        finally:
            self.runner.close()
            self.runner = None

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 120.0) -> T:
        assert self.runner is not None, "runtime harness is closed"
        return self.runner.run(asyncio.wait_for(coro, timeout))

    # -- sandboxes --

    def spec(self, *, env: dict[str, str] | None = None, output_cap: int | None = None, base: str = "busybox:test", **resources: Any) -> Any:
        from dsec.spec import ImageRef, Resources, SandboxSpec

        extra: dict[str, Any] = {}
        if env is not None:
            extra["env"] = env
        if output_cap is not None:
            extra["output_cap"] = output_cap
        return SandboxSpec(image=ImageRef(base=base), resources=Resources(**resources), **extra)

    def create(self, *, sandbox_id: str | None = None, **spec_kw: Any) -> Any:
        rec = self.run(self.rt.create(self.spec(**spec_kw), sandbox_id=sandbox_id))
        _TRAIL.append((self, rec.id))
        return rec

    def destroy(self, sid: str) -> bool:
        return bool(self.run(self.rt.destroy(sid)))

    @contextlib.contextmanager
    def sandbox(self, **spec_kw: Any) -> Iterator[Any]:
        rec = self.create(**spec_kw)
        try:
            yield rec
        except BaseException:
            # The trail is printed after the sandbox is gone: take it now.
            _SNAPSHOTS[rec.id] = self.trail(rec.id)
            raise
        finally:
            self.destroy(rec.id)

    def sh(self, sid: str, cmd: str | list[str], **kw: Any) -> Any:
        kw.setdefault("timeout", 60)
        return self.run(self.rt.exec(sid, cmd, **kw))

    def ok(self, sid: str, cmd: str | list[str], **kw: Any) -> str:
        """Run and require exit 0; return stdout as text."""
        r = self.sh(sid, cmd, **kw)
        assert r.exit_code == 0, f"{cmd!r} in {sid}: exit={r.exit_code} signal={r.signal} stderr={r.stderr!r}"
        return r.stdout.decode()

    def probe(self, sid: str, *ops: str, user: int | str = 0) -> dict[str, tuple[int, str]]:
        """Run the static probe inside ``sid``; op -> (return value, errno name or OK)."""
        if self.probe_binary is None:
            pytest.skip("the static probe could not be built (gcc -static)")
        files = self.rt.files(sid)
        if not files.exists(PROBE_PATH):
            files.write(PROBE_PATH, self.probe_binary.read_bytes(), mode=0o755)
        r = self.sh(sid, [PROBE_PATH, *ops], user=user)
        assert r.exit_code == 0, f"probe failed: {r}"
        out: dict[str, tuple[int, str]] = {}
        for line in r.stdout.decode().splitlines():
            name, ret, err = line.rsplit(" ", 2)
            out[name] = (int(ret), err)
        assert set(out) == set(ops), r.stdout
        return out

    # -- host-side views --

    def pids(self, sid: str) -> list[int]:
        return list(self.rt.cgroups.pids(sid))

    def cgroup_dirs(self, sid: str) -> list[Path]:
        return [p for p in (CGROUP_ROOT / c / "dsec" / self.name / sid for c in CONTROLLERS) if p.exists()]

    def records(self) -> list[Path]:
        d = self.state_dir / "sandboxes" / self.name
        return sorted(d.glob("*.json")) if d.is_dir() else []

    def slot_files(self) -> list[Path]:
        d = self.run_dir / "uid-slots"
        out = []
        if d.is_dir():
            for f in d.iterdir():
                with contextlib.suppress(OSError):
                    if f.read_text().split()[:1] == [self.name]:
                        out.append(f)
        return out

    def layer_mounts(self) -> list[str]:
        """Mounts of this runtime: its layers, /dev skeleton and writable-layer store."""
        root = str(self.run_dir / self.name) + "/"
        return [ln for ln in mountinfo_lines() if ln.split()[4].startswith(root)]

    def loop_devices(self) -> list[str]:
        """Loop devices backing this runtime's writable-layer store image."""
        return [d for d, f in loop_backing_files().items() if f.startswith(str(self.state_dir) + "/")]

    def inits(self) -> list[int]:
        """Live dsec-init processes in this runtime's cgroups."""
        out = []
        for pid in all_pids():
            if proc_comm(pid) == "dsec-init" and pid_alive(pid):
                with contextlib.suppress(OSError):
                    if f"/dsec/{self.name}/" in Path(f"/proc/{pid}/cgroup").read_text():
                        out.append(pid)
        return out

    def leftovers(self) -> list[str]:
        """Everything this runtime name still holds on the host (expected: nothing after close)."""
        left = [f"cgroup {p}" for p in runtime_cgroups(self.name) if p.name == self.name]
        left += [f"record {p}" for p in self.records()]
        left += [f"uid slot {p}" for p in self.slot_files()]
        left += [f"mount {ln}" for ln in self.layer_mounts()]
        left += [f"loop device {d}" for d in self.loop_devices()]
        left += [f"process dsec-init pid {p}" for p in self.inits()]
        return left

    def trail(self, sid: str) -> str:
        if sid in _SNAPSHOTS and (self.rt is None or sid not in self.rt.sandboxes):
            return _SNAPSHOTS[sid] + "\n  (taken when the test failed; destroyed since)"
        lines = [f"sandbox {sid} (runtime {self.name})"]
        rec = self.rt.sandboxes.get(sid) if self.rt is not None else None
        if rec is None:
            lines.append("  not in the runtime any more (destroyed or never made)")
        else:
            lines.append(f"  state={rec.state.value} init_pid={rec.init_pid} uid_base={rec.uid_base} reason={rec.reason!r}")
            try:
                lines.append(f"  stats={self.rt.stats(sid)}")
            except Exception as exc:
                lines.append(f"  stats unavailable: {exc!r}")
            for ev in rec.events[-20:]:
                lines.append(f"  event {json.dumps(ev, default=str)}")
        lines.append(f"  cgroup pids={self.pids(sid)}")
        return "\n".join(lines)


_TRAIL: list[tuple[RuntimeHarness, str]] = []
_SNAPSHOTS: dict[str, str] = {}


def pytest_runtest_setup(item: pytest.Item) -> None:
    _TRAIL.clear()
    _SNAPSHOTS.clear()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    if report.when == "call" and report.failed and _TRAIL:
        texts = []
        for harness, sid in _TRAIL:
            try:
                texts.append(harness.trail(sid))
            except Exception as exc:  # the trail must never hide the failure
                texts.append(f"sandbox {sid}: trail unavailable ({exc!r})")
        report.sections.append(("dsec sandbox trail", "\n".join(texts)))


# ---------------------------------------------------------------- fixtures ----


@pytest.fixture(scope="session")
def dsec_base() -> Iterator[Path]:
    base = Path(tempfile.mkdtemp(prefix="dsec-test-"))
    # searchable by others, as /run and /var/lib are: a microVM's QEMU runs as a uid of its own
    # and opens its disk under the run directory (no one can list the base: no r bit)
    base.chmod(0o711)
    yield base
    # Only remove when nothing is mounted below (the leak check unmounts what it can).
    if not any(str(base) in ln for ln in mountinfo_lines()):
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def _dsec_leak_check(dsec_base: Path) -> Iterator[None]:
    """Fail the run if anything of ours outlives it: mounts, cgroups, netns, processes, files.
    A run started by another test (``DSEC_LEAK_CHECK_BY_PARENT=1``, e.g. the E2B floor run against
    its parent's server) leaves this to that parent, which owns what such a run makes."""
    if os.environ.get("DSEC_LEAK_CHECK_BY_PARENT") == "1":
        yield
        return
    from ownership import NameWatch, own_cgroups, own_mount, own_netns, own_table

    before_mounts = {_mount_key(ln) for ln in mountinfo_lines() if "dsec" in ln}
    before_netns = netns_names()
    before_tables = nft_tables()
    before_procs = set(dsec_processes()) if IS_ROOT else set()
    before_roots = dsec_cgroup_roots()
    # the runtime names this session's processes claim (a user's own `dsec up`, or another
    # test run, may make and remove resources of its own meanwhile: not this run's leaks)
    watch = NameWatch(RT_PREFIX, _ours).start() if IS_ROOT else None
    yield
    if not IS_ROOT or watch is None:
        return
    watch.stop()

    def new_dsec_mounts() -> list[str]:
        return [ln for ln in mountinfo_lines() if "dsec" in ln and _mount_key(ln) not in before_mounts]

    def mounts() -> list[str]:
        # Ours: under this session's temporary directory (every tempdir of the session and
        # of the processes it starts), or in the run or state directory of one of its
        # runtimes (/run/dsec/<name>/...). Other new "dsec" mounts come from another
        # instance, test run or tool on a shared machine (a user's `dsec up`, another
        # session's /tmp/dsec-test-s<token>, benchmarks in /tmp/dsec-bench-*...): reported,
        # not failed.
        ours = (f"{SESSION_TMP}/", f"{dsec_base}/")
        return [ln for ln in new_dsec_mounts() if own_mount(ln, watch, ours)]

    def procs() -> dict[int, str]:
        return {p: d for p, d in dsec_processes().items() if p not in before_procs}

    def cgroups() -> list[Path]:
        return own_cgroups(CGROUP_ROOT, watch)

    def new_roots() -> list[Path]:
        # a `dsec` root this run made and left empty (one that holds another instance's
        # runtimes is that instance's)
        def empty(p: Path) -> bool:
            try:
                return not any(c.is_dir() for c in p.iterdir())
            except OSError:  # removed meanwhile
                return False

        return [p for p in sorted(dsec_cgroup_roots() - before_roots) if empty(p)]

    def files() -> list[Path]:
        out = []
        slots = dsec_base / "run" / "uid-slots"
        if slots.is_dir():
            out += list(slots.iterdir())
        out += list(dsec_base.glob("state-*/sandboxes/*/*.json"))
        out += list(Path("/run").glob(f"dsec-vm-{RT_PREFIX}*"))  # a microVM backend's socket directory
        return out

    # Processes and cgroups go away asynchronously; give them a moment.
    wait_until(lambda: not procs() and not cgroups(), timeout=5)
    problems: list[str] = []
    problems += [f"mount: {ln}" for ln in mounts()]
    problems += [f"cgroup: {p}" for p in cgroups()]
    problems += [f"cgroup: {p} (a dsec root this run made and left)" for p in new_roots()]
    problems += [f"process: {d}" for d in procs().values()]
    problems += [f"netns: {n}" for n in sorted(netns_names() - before_netns) if own_netns(n, SESSION_TOKEN)]
    problems += [f"nftables table: {t}" for t in sorted(nft_tables() - before_tables) if own_table(t, watch)]
    problems += [f"file: {p}" for p in files()]
    problems += [f"loop device: {d} ({f})" for d, f in loop_backing_files().items() if f.startswith(str(dsec_base))]
    foreign = [ln for ln in new_dsec_mounts() if ln not in mounts()]
    if foreign:
        warnings.warn(
            "new 'dsec' mounts not made by this test run (another process on this host?):\n  "
            + "\n  ".join(foreign),
            stacklevel=1,
        )
    if problems:
        _clean_up_leaks(dsec_base, procs(), cgroups(), mounts())
        pytest.fail("host resources leaked by the test run:\n  " + "\n  ".join(problems), pytrace=False)


def _clean_up_leaks(base: Path, procs: dict[int, str], cgroups: list[Path], mounts: list[str]) -> None:
    """Best effort, after the failure is recorded, so one leak does not poison the next run."""
    for pid in procs:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    for cg in sorted(cgroups, key=lambda p: -len(p.parts)):
        for child in sorted(cg.rglob("*"), key=lambda p: -len(p.parts)):
            if child.is_dir():
                with contextlib.suppress(OSError):
                    for pid in (child / "cgroup.procs").read_text().split():
                        os.kill(int(pid), signal.SIGKILL)
        for child in sorted((p for p in cg.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
            wait_until(lambda c=child: _rmdir(c), timeout=2)
        wait_until(lambda c=cg: _rmdir(c), timeout=2)
    for ln in mounts:
        mp = ln.split()[4]
        if str(base) in mp:
            subprocess.run(["umount", "-l", mp], capture_output=True)


def _rmdir(p: Path) -> bool:
    try:
        p.rmdir()
        return True
    except FileNotFoundError:
        return True
    except OSError:
        return False


@pytest.fixture(scope="session")
def busybox_seed(dsec_base: Path) -> Path:
    """The busybox base layer, built once; runtimes import this EROFS file."""
    if not IS_ROOT:
        pytest.skip("needs root")
    from dsec.errors import HostError
    from dsec.images import LocalLayerStore, build_busybox

    store = LocalLayerStore(dsec_base / "seed")
    try:
        layer = build_busybox(store, name="busybox", tag="test")
    except HostError as exc:
        pytest.skip(f"cannot build the busybox base layer: {exc}")
    return Path(store.blob_path(layer.digest))


@pytest.fixture(scope="session")
def probe_binary(dsec_base: Path) -> Path | None:
    src = dsec_base / "probe.c"
    out = dsec_base / "dsec-probe"
    src.write_text(PROBE_C)
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        return None
    proc = subprocess.run([gcc, "-static", "-O2", "-o", str(out), str(src)], capture_output=True, text=True)
    return out if proc.returncode == 0 else None


@pytest.fixture(scope="session")
def make_runtime(dsec_base: Path, busybox_seed: Path, probe_binary: Path | None) -> Callable[[str], RuntimeHarness]:
    """Factory: ``make_runtime("suffix")`` -> a harness (not started) for runtime ``<prefix>-suffix``."""

    def make(suffix: str) -> RuntimeHarness:
        name = f"{RT_PREFIX}-{suffix}"
        assert re.fullmatch(r"[a-z0-9][a-z0-9_-]{0,31}", name), name
        return RuntimeHarness(name, dsec_base, busybox_seed, probe_binary)

    return make


@pytest.fixture(scope="module")
def rtx(request: pytest.FixtureRequest, make_runtime: Callable[[str], RuntimeHarness]) -> Iterator[RuntimeHarness]:
    """One started runtime per test module; on the way out it must leave nothing behind."""
    suffix = request.module.__name__.rsplit(".", 1)[-1].removeprefix("test_runtime_")[:12]
    h = make_runtime(suffix).start()
    try:
        yield h
    finally:
        h.close()
    left = h.leftovers()
    assert not left, f"runtime {h.name} left after close(): {left}"


@pytest.fixture
def sb(rtx: RuntimeHarness) -> Iterator[Any]:
    """A default sandbox for one test, destroyed afterwards."""
    with rtx.sandbox() as rec:
        yield rec


# ------------------------------------------------------------ remote hosts ----

_REMOTE_SERVER = r"""
import socket, threading
def serve(port, reply):
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", port)); s.listen(64)
    while True:
        c, _ = s.accept()
        def handle(c=c):
            try:
                if reply == b"hold":  # a connection held open: sends a line, then waits
                    c.sendall(b"hello\n")
                    while c.recv(4096):
                        pass
                else:
                    c.recv(4096)
                    c.sendall(b"HTTP/1.0 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(reply), reply))
            finally:
                c.close()
        threading.Thread(target=handle, daemon=True).start()
for port, reply in ((8080, b"remote-8080"), (9090, b"remote-9090"), (7000, b"hold")):
    threading.Thread(target=serve, args=(port, reply), daemon=True).start()
print("ready", flush=True)
threading.Event().wait()
"""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


@contextlib.contextmanager
def remote_host(netns: str, link: str, host_ip: str, remote_ip: str) -> Iterator[str]:
    """A "remote host": network namespace ``netns`` joined to the host by a veth
    (host end ``link`` with ``host_ip``/30, ``eth0`` inside with ``remote_ip``/30 and a
    default route back), serving HTTP on 8080 and 9090 and a held-open TCP line on
    7000. The host routes between it and sandboxes like a router. Yields ``remote_ip``.
    ``link`` must not start with "dsec-" (that prefix means a sandbox's link)."""
    assert not link.startswith("dsec-") and "dsec" in netns
    _ip("netns", "del", netns, check=False)
    _ip("link", "del", link, check=False)
    _ip("netns", "add", netns)
    server: subprocess.Popen[str] | None = None
    try:
        _ip("link", "add", link, "type", "veth", "peer", "name", "eth0", "netns", netns)
        _ip("addr", "add", f"{host_ip}/30", "dev", link)
        _ip("link", "set", link, "up")
        for cmd in (["addr", "add", f"{remote_ip}/30", "dev", "eth0"], ["link", "set", "eth0", "up"],
                    ["link", "set", "lo", "up"], ["route", "add", "default", "via", host_ip]):
            _ip("netns", "exec", netns, "ip", *cmd)
        server = subprocess.Popen(["ip", "netns", "exec", netns, sys.executable, "-c", _REMOTE_SERVER],
                                  stdout=subprocess.PIPE, text=True)
        assert server.stdout is not None and server.stdout.readline().strip() == "ready"
        yield remote_ip
    finally:
        if server is not None:
            server.kill()
            server.wait()
            if server.stdout is not None:
                server.stdout.close()
        _ip("link", "del", link, check=False)
        _ip("netns", "del", netns, check=False)


# ------------------------------------------------------------ dsec up ----


@contextlib.contextmanager
def dsec_up(data: Path, env: dict[str, str], *extra: str) -> Iterator[dict[str, str]]:
    """``dsec up`` as a subprocess with ``data`` as its data directory; yields ``env`` with
    DSEC_URL/DSEC_TOKEN once it is ready: ``up.ready`` names the child (written when everything
    it starts is started, the registry of ``--registry`` included, as ``dsec up --detach``
    waits for) and an edge has registered. The control plane answers, and lists its edges,
    before that: a test going on then could miss what starts last.
    Stopped with Ctrl-C (SIGINT), which must exit 0 after destroying the sandboxes."""
    import httpx

    from dsec.cli.up import READY_FILE

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    ready = data / READY_FILE
    ready.unlink(missing_ok=True)
    log = open(data / "up.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([sys.executable, "-m", "dsec.cli.main", "up", "--data-dir", str(data), "--port", str(port),
                             *extra], env=env, stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    try:
        # A guard against a hang, not a figure: on a loaded machine (2 cores, CPU hogs, other
        # suites) a start took over 60 s.
        deadline = time.monotonic() + 180
        while not (ready.is_file() and ready.read_text().strip() == str(proc.pid)):
            assert proc.poll() is None, (data / "up.log").read_text()
            assert time.monotonic() < deadline, f"dsec up did not start: {(data / 'up.log').read_text()}"
            time.sleep(0.2)
        token = (data / "control/admin.token").read_text().strip()
        while True:  # the edge registers with the control plane a moment after it is up
            r = httpx.get(url + "/v1/edges", headers={"authorization": f"Bearer {token}"}, timeout=5)
            if r.status_code == 200 and r.json():
                break
            assert time.monotonic() < deadline, f"no edge registered: {r.status_code} {r.text[:300]}"
            time.sleep(0.1)
        yield {**env, "DSEC_URL": url, "DSEC_TOKEN": token}
    finally:
        proc.send_signal(signal.SIGINT)  # Ctrl-C: a clean stop that destroys the sandboxes
        try:
            assert proc.wait(60) == 0, (data / "up.log").read_text()
        finally:
            if proc.poll() is None:
                proc.kill()
            log.close()


@contextlib.contextmanager
def cli_all_in_one(prefix: str, *builds: list[str], extra: Sequence[str] = ()) -> Iterator[dict[str, str]]:
    """A throwaway data directory with the busybox image (and ``builds``: more
    ``dsec image build`` argument lists, run with ``--tag latest -q``), then :func:`dsec_up`
    on it; yields the environment the CLI needs."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        data = Path(tmp)
        env = {**os.environ, "DSEC_STATE_DIR": str(data)}
        for args in (["--busybox", "--name", "busybox"], *builds):
            build = subprocess.run([sys.executable, "-m", "dsec.cli.main", "image", "build", *args, "--tag", "latest",
                                    "-q"], env=env, capture_output=True, text=True, timeout=120)
            assert build.returncode == 0, build.stderr
        with dsec_up(data, env, *extra) as ready:
            yield ready


class ClusterHarness:
    """An in-process all-in-one (``start_cluster``) driven from sync tests through one runner."""

    def __init__(self, data: Path) -> None:
        self.runner = asyncio.Runner()
        self.data = data
        self.cluster: Any = None

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 120) -> T:
        return self.runner.run(asyncio.wait_for(coro, timeout))

    def client(self, token: str | None = None) -> Any:
        from dsec import AsyncClient

        return AsyncClient(self.cluster.url, token or self.cluster.admin_token)


@contextlib.contextmanager
def in_process_cluster(prefix: str) -> Iterator[ClusterHarness]:
    """:class:`ClusterHarness` over a throwaway data directory holding ``busybox:latest``."""
    from dsec.cli.up import start_cluster
    from dsec.images.build import build_busybox
    from dsec.images.store import LocalLayerStore

    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        data = Path(tmp)
        build_busybox(LocalLayerStore(data / "layers"), name="busybox", tag="latest")
        h = ClusterHarness(data)
        h.cluster = h.run(start_cluster(data, port=0))
        try:
            yield h
        finally:
            h.run(h.cluster.stop())
            h.runner.close()


# ------------------------------------------------------------ servers ----


@contextlib.asynccontextmanager
async def serve_asgi(app: Any, **config: Any) -> AsyncIterator[str]:
    """Serve the ASGI ``app`` in the running event loop with uvicorn on a free 127.0.0.1
    port (warnings only, no lifespan); yields its URL once it is started, and on the way
    out stops it and waits for it (10 s at most). ``config``: more ``uvicorn.Config``
    settings, or other values for these."""
    import uvicorn

    class Quiet(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield  # the test runner keeps its own signal handlers (Ctrl-C stops the run)

    settings: dict[str, Any] = {"host": "127.0.0.1", "port": 0, "log_level": "warning", "lifespan": "off",
                                **config}
    server = Quiet(uvicorn.Config(app, **settings))
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            raise RuntimeError(f"server did not start: {task.exception()}")
        await asyncio.sleep(0.005)
    host, port = server.servers[0].sockets[0].getsockname()[:2]
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)


# ------------------------------------------------------------ edges ----


def edge_config(dsec_base: Path, suffix: str, edge_id: str, key: bytes, **kw: Any) -> Any:
    """The EdgeConfig of a test edge ``<prefix>-<suffix>`` with the busybox layer in its
    store (skips the test when that layer cannot be built); ``kw`` are more settings."""
    from dsec.edge.config import EdgeConfig
    from dsec.edge.testing import prepare_busybox
    from dsec.errors import HostError

    name = f"{RT_PREFIX}-{suffix}"
    state = dsec_base / f"state-{name}"
    try:
        prepare_busybox(state)
    except HostError as exc:
        pytest.skip(f"cannot build the busybox layer: {exc}")
    kw.setdefault("destroy_on_shutdown", True)
    return EdgeConfig(edge_id=edge_id, cluster_key=key, port=0, state_dir=state, run_dir=dsec_base / "run",
                      runtime_name=name, **kw)


@contextlib.contextmanager
def running_edge(cfg: Any) -> Iterator[Any]:
    """An edge agent (an ``EdgeThread``) on ``cfg``, e.g. an :func:`edge_config`, started;
    on the way out it is stopped and must have left nothing on the host."""
    from dsec.edge.testing import EdgeThread, leftovers

    e = EdgeThread(cfg).start()
    try:
        yield e
    finally:
        e.stop()
    assert not leftovers(cfg), leftovers(cfg)
