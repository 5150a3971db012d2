"""The gVisor backend's red team: attack cases against :class:`GVisorBackend`, shared by
``tests/abuse/test_gvisor_abuse.py`` and ``dsec bench abuse``.

Each :class:`GVisorCase` attacks one fresh gVisor sandbox (small limits) while neighbour
gVisor sandboxes run ``/bin/true`` in a loop (:class:`~dsec.bench.abuse_cases.NeighbourLoad`)
and keep a marker process and a file. :func:`run_gvisor_case` records, as
:class:`~dsec.bench.abuse_cases.Check` objects that can each fail:

- the attack was contained: what it tried did not happen (no namespace made, nothing
  mounted, no process of the command alive after its timeout, no per-command cgroup left in
  the sandbox, a limit enforced, no host file read or written, a helper not traced...);
- the host stayed healthy: the backend still creates, execs and destroys; the attacked
  sandbox left nothing on the host (runsc state, cgroups, mounts, bundle, record, runsc
  processes); MemAvailable, load and the kernel log are sane; the neighbours' markers and
  files are intact and their execs did not fail; a host sentinel process lives.

The attacks that need system calls busybox cannot make use a small static program of their
own (:data:`GVABUSE_C`, uploaded into the attacked sandbox at :data:`GVABUSE_PATH`): every
argument is one operation, printed back as ``<op> <return value> <errno name or OK>``.
The tests in ``tests/integration/test_gvisor.py`` use it too.

For ``dsec bench abuse``: :func:`run_gvisor_suite` (its own backend and busybox layer) or
:func:`run_gvisor_cases` (a started backend) returns the outcomes, and
:func:`gvisor_outcomes_json` flattens them beside the container backend's (case names all
start with ``gvisor_``; the totals are prefixed ``gvisor_``).

Must never hurt the host when a defence is missing: every attack is bounded by the
sandbox's limits and a timeout, and destroying the sandbox ends whatever it left.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import io
import os
import shutil
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from dsec.bench.abuse_cases import (
    BAD_KMSG,
    Check,
    HelperOut,
    HostState,
    NeighbourLoad,
    Outcome,
    kmsg_records,
    memory_check,
    outcomes_json,
)
from dsec.bench.abuse_helper import build_static
from dsec.bench.stats import percentile
from dsec.errors import DsecError, ExecTimeout, FileAccessError
from dsec.spec import ImageRef, Resources, SandboxSpec
from dsec.spec.results import ExecResult

if TYPE_CHECKING:
    from dsec.backends.gvisor.backend import GVisorBackend

MiB = 1 << 20
GVABUSE_PATH = "/usr/bin/dsec-gvabuse"
"""Where the attack program lives inside an attacked sandbox."""
NEIGHBOUR_MARKER = "4711.75"
"""argv[1] of the ``sleep`` each neighbour sandbox keeps running: it must survive every case."""
Progress = Callable[[str], None]

GVABUSE_C = r"""
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/ptrace.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static char buf[4096];

static void step(const char *what, long r) {
    printf("step %s %ld %s\n", what, r, r < 0 ? strerrorname_np(errno) : "OK");
}

/* A raw clone(2) with FLAGS: the child exits at once. */
static long raw_clone(long flags) {
    long r = syscall(SYS_clone, flags | SIGCHLD, 0, 0, 0, 0);
    if (r == 0) _exit(0);
    if (r > 0) waitpid((pid_t)r, NULL, 0);
    return r;
}

static long raw_clone3(uint64_t flags) {
    uint64_t a[11] = {0};
    a[0] = flags;
    a[4] = SIGCHLD;
    long r = syscall(SYS_clone3, a, 88);
    if (r == 0) _exit(0);
    if (r > 0) waitpid((pid_t)r, NULL, 0);
    return r;
}

static long write_pid(int fd) {
    int n = snprintf(buf, sizeof buf, "%d\n", (int)getpid());
    return write(fd, buf, (size_t)n) == n ? 0 : -1;
}

static void print_cgroup(void) {
    int fd = open("/proc/self/cgroup", O_RDONLY);
    long n = fd >= 0 ? read(fd, buf, sizeof buf - 1) : -1;
    if (fd >= 0) close(fd);
    buf[n > 0 ? n : 0] = 0;
    for (char *l = strtok(buf, "\n"); l; l = strtok(NULL, "\n"))
        if (strstr(l, ":job:")) printf("cgroup %s\n", l);
}

/* Leave the session and the process tree (setsid, double fork): the grandchild, orphaned,
 * execs `sleep MARKER`. The caller goes on. */
static void detach_sleeper(const char *marker) {
    pid_t p = fork();
    if (p == 0) {
        setsid();
        if (fork() == 0) {
            char *av[] = {"sleep", (char *)marker, NULL};
            execv("/bin/sleep", av);
            _exit(1);
        }
        _exit(0);
    }
    if (p > 0) waitpid(p, NULL, 0);
}

/* The finding of issue 22: a user namespace of our own (full capabilities there), a mount
 * namespace owned by it, the sentry's cgroupfs mounted in it, our pid written to its root
 * cgroup.procs; then out of the session with a double fork. Every step is tried whatever
 * the previous one said, and the sleeper is left in any case: the timeout must end it. */
static long cgroup_escape(const char *marker) {
    long r, moved = -1;
    step("unshare_user", r = unshare(CLONE_NEWUSER));
    step("unshare_mnt", r = unshare(CLONE_NEWNS));
    mkdir("/tmp/dsec-cg", 0700);
    step("mount_cgroup", r = mount("none", "/tmp/dsec-cg", "cgroup", 0, "job"));
    if (r == 0) {
        int fd = open("/tmp/dsec-cg/cgroup.procs", O_WRONLY);
        step("open_root_procs", fd);
        if (fd >= 0) {
            step("move_to_root", moved = write_pid(fd));
            close(fd);
        }
    }
    print_cgroup();
    detach_sleeper(marker);
    printf("detached\n");
    fflush(stdout);
    return moved;
}

/* Race other commands' helpers for a cgroupfs descriptor: for SECS seconds, follow every
 * /proc/<pid>/fd/<n> whose target looks like cgroupfs and write our pid into it (a file) or
 * into its cgroup.procs (a directory). Prints what it reached; then detaches a sleeper. */
static long fd_race(const char *arg) {
    int secs = atoi(arg);
    const char *marker = strchr(arg, ':') ? strchr(arg, ':') + 1 : "3999";
    long seen = 0, moved = 0;
    pid_t me = getpid();
    struct timespec t0, t;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    do {
        DIR *d = opendir("/proc");
        struct dirent *e;
        while (d && (e = readdir(d))) {
            int p = atoi(e->d_name);
            if (p <= 1 || p == me) continue;
            char path[64];
            snprintf(path, sizeof path, "/proc/%d/fd", p);
            DIR *fds = opendir(path);
            if (!fds) continue;
            struct dirent *f;
            while ((f = readdir(fds))) {
                if (f->d_name[0] == '.') continue;
                char fdp[300], link[512];
                snprintf(fdp, sizeof fdp, "/proc/%d/fd/%s", p, f->d_name);
                long n = readlink(fdp, link, sizeof link - 1);
                if (n <= 0) continue;
                link[n] = 0;
                if (!strstr(link, "cgroup")) continue; /* a cgroupfs file or directory */
                seen++;
                int fd = open(fdp, O_WRONLY);
                if (fd < 0) {
                    int dfd = open(fdp, O_RDONLY | O_DIRECTORY);
                    if (dfd >= 0) {
                        fd = openat(dfd, "cgroup.procs", O_WRONLY);
                        close(dfd);
                    }
                }
                if (fd >= 0) {
                    if (write_pid(fd) == 0) {
                        moved++;
                        printf("moved via %s -> %s\n", fdp, link);
                    }
                    close(fd);
                }
            }
            closedir(fds);
        }
        if (d) closedir(d);
        clock_gettime(CLOCK_MONOTONIC, &t);
    } while (t.tv_sec - t0.tv_sec < secs && !moved);
    printf("cgroupfs_fds_seen %ld\n", seen);
    print_cgroup();
    detach_sleeper(marker);
    return moved;
}

/* Attach to every process whose command line names dsec-gvexec (our helpers, pid 1), for
 * SECS seconds: new ones too, before they have set themselves non-dumpable. */
static long ptrace_helpers(const char *arg) {
    int secs = arg ? atoi(arg) : 0;
    long tried = 0, got = 0;
    pid_t me = getpid();
    static char done[1 << 16];
    struct timespec t0, t;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    do {
        DIR *d = opendir("/proc");
        struct dirent *e;
        while (d && (e = readdir(d))) {
            int p = atoi(e->d_name);
            if (p <= 0 || p == me || p >= (int)sizeof done || done[p]) continue;
            char path[64];
            snprintf(path, sizeof path, "/proc/%d/cmdline", p);
            int fd = open(path, O_RDONLY);
            long n = fd >= 0 ? read(fd, buf, sizeof buf - 1) : -1;
            if (fd >= 0) close(fd);
            if (n <= 0) continue;
            buf[n] = 0;
            if (!strstr(buf, "dsec-gvexec")) continue;
            done[p] = 1;
            tried++;
            if (ptrace(PTRACE_ATTACH, p, 0, 0) == 0) {
                waitpid(p, NULL, __WALL);
                printf("attached %d %s\n", p, buf + (strlen(buf) + 1 < (size_t)n ? strlen(buf) + 1 : 0));
                ptrace(PTRACE_DETACH, p, 0, 0);
                got++;
            } else {
                printf("refused %d %s\n", p, strerrorname_np(errno));
            }
        }
        if (d) closedir(d);
        clock_gettime(CLOCK_MONOTONIC, &t);
    } while (t.tv_sec - t0.tv_sec < secs);
    printf("helpers_tried %ld\n", tried);
    return got;
}

/* Look for a cgroupfs through other processes' roots and cwds (the helpers' private mount
 * namespaces hold one at /sys/fs/cgroup) and write our pid into any cgroup.procs reached. */
static long root_hunt(void) {
    long moved = 0;
    pid_t me = getpid();
    DIR *d = opendir("/proc");
    struct dirent *e;
    while (d && (e = readdir(d))) {
        int p = atoi(e->d_name);
        if (p <= 0 || p == me) continue;
        const char *ways[] = {"root/sys/fs/cgroup/cgroup.procs", "root/sys/fs/cgroup/dsec/cgroup.procs",
                              "cwd/sys/fs/cgroup/cgroup.procs", NULL};
        for (int i = 0; ways[i]; i++) {
            char path[128];
            snprintf(path, sizeof path, "/proc/%d/%s", p, ways[i]);
            int fd = open(path, O_WRONLY);
            if (fd < 0) continue;
            if (write_pid(fd) == 0) {
                moved++;
                printf("moved via %s\n", path);
            }
            close(fd);
        }
    }
    if (d) closedir(d);
    print_cgroup();
    return moved;
}

static long op(const char *name, const char *arg) {
    /* -- namespaces: every one refused (clone3 with ENOSYS) -- */
    if (!strcmp(name, "unshare_user")) return unshare(CLONE_NEWUSER);
    if (!strcmp(name, "unshare_mnt")) return unshare(CLONE_NEWNS);
    if (!strcmp(name, "unshare_pid")) return unshare(CLONE_NEWPID);
    if (!strcmp(name, "unshare_net")) return unshare(CLONE_NEWNET);
    if (!strcmp(name, "unshare_ipc")) return unshare(CLONE_NEWIPC);
    if (!strcmp(name, "unshare_uts")) return unshare(CLONE_NEWUTS);
    if (!strcmp(name, "unshare_cgroup")) return unshare(CLONE_NEWCGROUP);
    if (!strcmp(name, "unshare_time")) return unshare(0x00000080);
    if (!strcmp(name, "clone_newuser")) return raw_clone(CLONE_NEWUSER);
    if (!strcmp(name, "clone_newns")) return raw_clone(CLONE_NEWNS);
    if (!strcmp(name, "clone_newpid")) return raw_clone(CLONE_NEWPID);
    if (!strcmp(name, "clone_newnet")) return raw_clone(CLONE_NEWNET);
    if (!strcmp(name, "clone_newcgroup")) return raw_clone(CLONE_NEWCGROUP);
    if (!strcmp(name, "clone_plain")) return raw_clone(0);
    if (!strcmp(name, "clone3_newuser")) return raw_clone3(CLONE_NEWUSER);
    if (!strcmp(name, "clone3_plain")) return raw_clone3(0);
    if (!strcmp(name, "fork")) { pid_t p = fork(); if (p == 0) _exit(0); if (p > 0) waitpid(p, NULL, 0); return p; }
    if (!strcmp(name, "setns_net")) {
        int fd = open("/proc/self/ns/net", O_RDONLY);
        return fd < 0 ? -1 : setns(fd, 0);
    }
    if (!strcmp(name, "setns_init_mnt")) {
        int fd = open("/proc/1/ns/mnt", O_RDONLY);
        return fd < 0 ? -1 : setns(fd, CLONE_NEWNS);
    }
    if (!strcmp(name, "setns_parent_mnt")) { /* the helper's private namespace: cgroupfs is mounted there */
        char path[64];
        snprintf(path, sizeof path, "/proc/%d/ns/mnt", (int)getppid());
        int fd = open(path, O_RDONLY);
        return fd < 0 ? -1 : setns(fd, CLONE_NEWNS);
    }
    /* -- mounts -- */
    if (!strcmp(name, "mount_tmpfs")) { mkdir("/tmp/dsec-m", 0700); return mount("none", "/tmp/dsec-m", "tmpfs", 0, "size=1m"); }
    if (!strcmp(name, "mount_cgroup")) { mkdir("/tmp/dsec-cg", 0700); return mount("none", "/tmp/dsec-cg", "cgroup", 0, "job"); }
    if (!strcmp(name, "mount_proc")) { mkdir("/tmp/dsec-p", 0700); return mount("proc", "/tmp/dsec-p", "proc", 0, NULL); }
    if (!strcmp(name, "remount_sys_rw")) return mount(NULL, "/sys", NULL, MS_REMOUNT, NULL);
    if (!strcmp(name, "bind_root")) { mkdir("/tmp/dsec-b", 0700); return mount("/", "/tmp/dsec-b", NULL, MS_BIND, NULL); }
    if (!strcmp(name, "umount_proc")) return umount2("/proc", MNT_DETACH);
    if (!strcmp(name, "umount_tmp")) return umount2("/tmp", MNT_DETACH);
    if (!strcmp(name, "pivot_root")) return syscall(SYS_pivot_root, "/tmp", "/tmp");
    if (!strcmp(name, "fsopen")) return syscall(SYS_fsopen, "cgroup", 0);
    if (!strcmp(name, "open_tree")) return syscall(SYS_open_tree, AT_FDCWD, "/", 1);
    if (!strcmp(name, "move_mount")) return syscall(SYS_move_mount, AT_FDCWD, "/tmp", AT_FDCWD, "/mnt", 0);
    if (!strcmp(name, "mount_setattr")) { uint64_t a[4] = {0}; return syscall(SYS_mount_setattr, AT_FDCWD, "/", 0, a, 32); }
    /* -- cgroups and processes -- */
    if (!strcmp(name, "cgroup")) { print_cgroup(); return 0; }
    if (!strcmp(name, "cgroup_escape")) return cgroup_escape(arg ? arg : "3998");
    if (!strcmp(name, "fd_race")) return fd_race(arg ? arg : "2");
    if (!strcmp(name, "root_hunt")) return root_hunt();
    if (!strcmp(name, "ptrace_helpers")) return ptrace_helpers(arg);
    if (!strcmp(name, "ptrace_pid")) return ptrace(PTRACE_ATTACH, atoi(arg), 0, 0);
    if (!strcmp(name, "kill")) { /* kill=<pid>:<signal> */
        const char *c = strchr(arg, ':');
        return kill(atoi(arg), c ? atoi(c + 1) : SIGKILL);
    }
    if (!strcmp(name, "kill_all")) return kill(-1, SIGKILL);
    if (!strcmp(name, "tkill_init")) return syscall(SYS_tkill, 1, SIGKILL);
    if (!strcmp(name, "tgkill_init")) return syscall(SYS_tgkill, 1, 1, SIGKILL);
    if (!strcmp(name, "sigqueue_init")) {
        siginfo_t si;
        memset(&si, 0, sizeof si);
        si.si_signo = SIGKILL;
        si.si_code = -1; /* SI_QUEUE */
        si.si_pid = getpid();
        return syscall(SYS_rt_sigqueueinfo, 1, SIGKILL, &si);
    }
    if (!strcmp(name, "sigio_init")) { /* SIGIO redirected: F_SETOWN 1, F_SETSIG arg, O_ASYNC, then input */
        int p[2];
        if (pipe(p) < 0) return -1;
        if (fcntl(p[0], F_SETOWN, 1) < 0 || fcntl(p[0], 10 /* F_SETSIG */, atoi(arg)) < 0) return -1;
        if (fcntl(p[0], F_SETFL, O_ASYNC | O_NONBLOCK) < 0) return -1;
        long r = write(p[1], "x", 1);
        usleep(200000);
        return r;
    }
    if (!strcmp(name, "orphan_exit_signal")) { /* a child whose exit signal is arg, orphaned to pid 1 */
        pid_t x = fork();
        if (x == 0) {
            long r = syscall(SYS_clone, (long)atoi(arg), 0, 0, 0, 0);
            if (r == 0) { usleep(300000); _exit(0); }
            _exit(r < 0 ? 1 : 0);
        }
        int st = 0;
        if (x > 0) waitpid(x, &st, 0);
        usleep(600000);
        return x < 0 ? -1 : (WIFEXITED(st) && WEXITSTATUS(st) == 0 ? 0 : (errno = EPERM, -1));
    }
    if (!strcmp(name, "pidfd_kill_init")) {
        long fd = syscall(SYS_pidfd_open, 1, 0);
        if (fd < 0) return -1;
        return syscall(SYS_pidfd_send_signal, (int)fd, SIGKILL, NULL, 0);
    }
    if (!strcmp(name, "procfd_kill_init")) {
        int fd = open("/proc/1", O_RDONLY | O_DIRECTORY);
        if (fd < 0) return -1;
        return syscall(SYS_pidfd_send_signal, fd, SIGKILL, NULL, 0);
    }
    if (!strcmp(name, "pause")) { for (;;) pause(); }
    if (!strcmp(name, "nodump")) return prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);
    if (!strcmp(name, "sleep")) { sleep(atoi(arg)); return 0; }
    if (!strcmp(name, "rewrite") || !strcmp(name, "rewrite_parent_exe")) {
        /* open a file read-write and write its first byte back unchanged: proves write access
         * without changing anything, should a defence be missing */
        char path[64];
        if (!arg) snprintf(path, sizeof path, "/proc/%d/exe", (int)getppid());
        const char *target = arg ? arg : path;
        int fd = open(target, O_RDWR);
        if (fd < 0) return -1;
        char c;
        long r = pread(fd, &c, 1, 0);
        if (r == 1) r = pwrite(fd, &c, 1, 0);
        close(fd);
        return r;
    }
    if (!strcmp(name, "open_r")) {
        int fd = open(arg, O_RDONLY);
        if (fd < 0) return -1;
        long n = read(fd, buf, sizeof buf);
        close(fd);
        return n;
    }
    if (!strcmp(name, "forkbomb")) {
        for (int i = 0; i < 1000000; i++)
            if (fork() < 0) pause();
        return 0;
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


def build_gvabuse(cache: Path) -> Path | None:
    """The attack program (``gcc -static``), built once per source hash; None without a compiler."""
    return build_static(GVABUSE_C, cache, "dsec-gvabuse", "the gVisor attack program")


def parse_ops(text: str, ops: Sequence[str]) -> dict[str, tuple[int, str]]:
    """``{op: (return value, errno name or OK)}`` from the attack program's output."""
    out: dict[str, tuple[int, str]] = {}
    for line in text.splitlines():
        parts = line.rsplit(" ", 2)
        if len(parts) == 3 and parts[0] in ops:
            with contextlib.suppress(ValueError):
                out[parts[0]] = (int(parts[1]), parts[2])
    return out


# ------------------------------------------------------------------ the lab ----


def sandbox_leftovers(backend: GVisorBackend, sid: str) -> list[str]:
    """Every host resource of one gVisor sandbox that still exists: cgroups, mounts, runsc
    state, bundle, record, runsc processes of its container, and processes in other mount
    namespaces (other sandboxes' sentries and gofers) that still hold its mounts."""
    cid = backend.container_id(sid)
    left = [f"cgroup {p}" for p in Path("/sys/fs/cgroup").glob(f"*/dsec/{backend.name}/{sid}")]
    mounts = Path("/proc/self/mountinfo").read_text().splitlines()
    left += [f"mount {ln.split()[4]}" for ln in mounts if f"/sb/{sid}/" in ln.split()[4] + "/"]
    if backend.runsc_root.exists():
        left += [f"runsc state {p}" for p in backend.runsc_root.glob(f"*{cid}*")]
    left += [f"bundle {p}" for p in [backend.bundle_dir(sid)] if p.exists()]
    left += [f"record {p}" for p in [backend.records_dir / f"{sid}.json"] if p.exists()]
    ours = os.readlink("/proc/self/ns/mnt")
    for p in (p for p in os.listdir("/proc") if p.isdigit()):
        with contextlib.suppress(OSError):
            if cid.encode() in Path(f"/proc/{p}/cmdline").read_bytes():
                left.append(f"runsc process {p}")
            elif os.readlink(f"/proc/{p}/ns/mnt") != ours and f"/sb/{sid}/" in Path(f"/proc/{p}/mountinfo").read_text():
                left.append(f"process {p} holds its mounts")
    return left


@dataclass
class GVisorLab:
    """What every case shares: a started gVisor backend, the attack program, neighbour
    sandboxes with a marker process and a file each, a host sentinel and a host secret."""

    backend: GVisorBackend
    image: str
    work: Path
    helper: Path | None = None
    quick: bool = True
    neighbours: list[str] = field(default_factory=list)
    secret: str = field(default_factory=lambda: f"DSEC-HOST-SECRET-{os.urandom(8).hex()}")
    sentinel: subprocess.Popen[bytes] | None = None

    @property
    def secret_file(self) -> Path:
        return self.work / "host-secret.txt"

    def spec(self, **resources: Any) -> SandboxSpec:
        res: dict[str, Any] = {"cpu": 1.0, "memory": 128 * MiB, "pids": 64, "disk": 32 * MiB, "nofile": 1024,
                               "disk_medium": "memory"}
        res.update(resources)
        return SandboxSpec(image=ImageRef(base=self.image), backend="gvisor", resources=Resources(**res))

    async def setup(self, k_neighbours: int) -> None:
        self.work.mkdir(parents=True, exist_ok=True)
        self.secret_file.write_text(self.secret + "\n")
        self.sentinel = subprocess.Popen(["sleep", "86400.75"])  # what no attack may reach
        await self.renew_neighbours(k_neighbours)

    async def renew_neighbours(self, k: int | None = None) -> None:
        """Destroy the neighbours and make ``k`` (default: as many) fresh ones. A gVisor sandbox's
        charged memory grows with every exec (gVisor 20240729: ~0.1 MiB per ``runsc exec``, ~0.2-0.25
        MiB per backend exec, never given back), so a neighbour looping ``/bin/true`` for a whole
        suite would reach its memory limit: each case gets fresh ones."""
        k = len(self.neighbours) if k is None else k
        await self.drop_neighbours()
        for _ in range(k):
            rec = await self.backend.create(self.spec(pids=32, disk=8 * MiB))
            self.neighbours.append(rec.id)
            self.backend.files(rec.id).write("/tmp/neighbour-secret", f"{rec.id}\n".encode())
            await self.backend.exec(rec.id, f"sleep {NEIGHBOUR_MARKER} >/dev/null 2>&1 &", timeout=30)

    async def drop_neighbours(self) -> None:
        for sid in self.neighbours:
            with contextlib.suppress(DsecError):
                await self.backend.destroy(sid)
        self.neighbours.clear()

    async def close(self) -> None:
        await self.drop_neighbours()
        if self.sentinel is not None:
            self.sentinel.kill()
            self.sentinel.wait()
            self.sentinel = None
        with contextlib.suppress(OSError):
            self.secret_file.unlink()

    async def processes(self, sid: str) -> str:
        """``ps`` inside a sandbox (pid, state, user, arguments), as root."""
        r = await self.backend.exec(sid, ["ps", "-o", "pid,stat,user,args"], timeout=30)
        return r.stdout_text

    async def marker_alive(self, sid: str) -> bool:
        return f"sleep {NEIGHBOUR_MARKER}" in await self.processes(sid)

    async def inner_cgroups(self, sid: str) -> list[str]:
        """The per-command cgroups inside a sandbox (gVisor's job hierarchy), listed by a
        privileged ``runsc exec`` that mounts the hierarchy in a mount namespace of its own."""
        script = ("mount --make-rprivate / && mount -t cgroup -o job none /sys/fs/cgroup && "
                  "{ [ ! -d /sys/fs/cgroup/dsec ] || find /sys/fs/cgroup/dsec -mindepth 1 -maxdepth 1 -type d; }")
        runsc = self.backend.runsc
        assert runsc is not None
        out = await runsc.call("exec", "--user=0:0", "--cap=CAP_SYS_ADMIN", self.backend.container_id(sid),
                               "/bin/unshare", "-m", "/bin/sh", "-c", script)
        return sorted(out.decode().split())


# ---------------------------------------------------------------- attacks ----


class GVisorAttack:
    """One case's handle on its sandbox: run things inside, record checks."""

    def __init__(self, lab: GVisorLab, case: GVisorCase, sid: str, outcome: Outcome) -> None:
        self.lab = lab
        self.case = case
        self.sid = sid
        self.backend = lab.backend
        self.outcome = outcome

    def check(self, what: str, ok: bool, detail: Any = "") -> bool:
        self.outcome.checks.append(Check(what, ok, detail))
        return bool(ok)

    async def run(self, cmd: str | list[str], *, timeout: float = 30.0, user: int | str = 0,
                  output_cap: int | None = None) -> ExecResult:
        """Run inside; a timeout is a result (the tree was killed), not an error."""
        try:
            return await self.backend.exec(self.sid, cmd, timeout=timeout, user=user, output_cap=output_cap)
        except ExecTimeout as exc:
            res = getattr(exc, "result", None)
            if not isinstance(res, ExecResult):
                raise
            return res

    async def helper(self, *ops: str, timeout: float = 30.0, user: int | str = 0) -> HelperOut:
        r = await self.run([GVABUSE_PATH, *ops], timeout=timeout, user=user)
        parsed = parse_ops(r.stdout_text, ops)
        return HelperOut(parsed, [ln for ln in r.stdout_text.splitlines() if ln.rsplit(" ", 2)[0] not in ops], r)

    async def alive(self) -> bool:
        r = await self.run("echo alive", timeout=30)
        return r.stdout_text.strip() == "alive"

    async def ps(self) -> str:
        return await self.lab.processes(self.sid)

    async def left_behind(self, *markers: str) -> list[str]:
        """``ps`` lines naming any of ``markers``, after giving the sandbox up to ~5 s to settle
        (a bound on a wait, never a timing check)."""
        left: list[str] = []
        for _ in range(25):
            left = [ln for ln in (await self.ps()).splitlines() if any(m in ln for m in markers)]
            if not left:
                break
            await asyncio.sleep(0.2)
        return left

    async def cgroups_left(self, before: Sequence[str] = ()) -> list[str]:
        """Per-command cgroups in the sandbox that were not there ``before``, after up to ~5 s."""
        left: list[str] = []
        for _ in range(25):
            left = [c for c in await self.lab.inner_cgroups(self.sid) if c not in before]
            if not left:
                break
            await asyncio.sleep(0.2)
        return left

    async def concurrent_starts(self, until: asyncio.Future[Any], *, user: int | str = 0) -> int:
        """Start ``true`` in the attacked sandbox, one after another, until ``until`` is done:
        other commands' helpers for a racing attacker to aim at. How many ran."""
        n = 0
        while not until.done():
            with contextlib.suppress(DsecError):
                await self.backend.exec(self.sid, ["true"], timeout=30, user=user)
                n += 1
        return n


CaseFn = Callable[[GVisorAttack], Awaitable[None]]


@dataclass(frozen=True)
class GVisorCase:
    name: str
    attack: str
    """What the attack tries."""
    asserts: str
    """What the case checks (the containment part)."""
    defence: str
    """What contains it."""
    fn: CaseFn
    resources: dict[str, Any] = field(default_factory=dict)
    heavy: bool = False
    """Long or CPU-hungry: ``slow`` in tests; shortened with ``quick``."""
    needs_helper: bool = True


GVISOR_CASES: list[GVisorCase] = []
USERS: tuple[tuple[str, int | str], ...] = (("root", 0), ("uid 1000", "1000:1000"))


def case(name: str, *, attack: str, asserts: str, defence: str, **kw: Any) -> Callable[[CaseFn], CaseFn]:
    def deco(fn: CaseFn) -> CaseFn:
        GVISOR_CASES.append(GVisorCase(name, attack, asserts, defence, fn, **kw))
        return fn

    return deco


def _step(out: HelperOut, name: str) -> str:
    """The attack program's ``step <name> <ret> <errno>`` line for a step (its errno name, or
    "OK"; "missing" when it never got there)."""
    for ln in out.lines:
        parts = ln.split()
        if len(parts) == 4 and parts[:2] == ["step", name]:
            return parts[3]
    return "missing"


def _job_line(out: HelperOut) -> str:
    return next((ln for ln in out.lines if ln.startswith("cgroup ")), "")


NAMESPACE_OPS = ("unshare_user", "unshare_mnt", "unshare_pid", "unshare_net", "unshare_ipc", "unshare_uts",
                 "unshare_cgroup", "unshare_time", "clone_newuser", "clone_newns", "clone_newpid", "clone_newnet",
                 "clone_newcgroup", "setns_net", "setns_init_mnt", "setns_parent_mnt")
MOUNT_OPS = ("mount_tmpfs", "mount_cgroup", "mount_proc", "remount_sys_rw", "bind_root", "umount_proc", "umount_tmp",
             "pivot_root", "fsopen", "open_tree", "move_mount", "mount_setattr")


# -- leaving the per-command cgroup, outliving a timeout ----------------------


async def _cgroup_escape(a: GVisorAttack, user: int | str, marker: str) -> None:
    before = await a.lab.inner_cgroups(a.sid)
    out = await a.helper(f"cgroup_escape={marker}", "pause", timeout=3.0, user=user)
    a.check("the attack ran to its end (setsid, double fork)", "detached" in out.lines, out.result)
    a.check("exec ended by its timeout", out.result.timed_out == "timeout", out.result)
    a.check("unshare(CLONE_NEWUSER) refused with EPERM", _step(out, "unshare_user") == "EPERM", out.lines)
    a.check("unshare(CLONE_NEWNS) refused with EPERM", _step(out, "unshare_mnt") == "EPERM", out.lines)
    a.check("cgroupfs mount refused with EPERM", _step(out, "mount_cgroup") == "EPERM", out.lines)
    a.check("never moved to the root cgroup", _step(out, "move_to_root") != "OK", out.lines)
    a.check("still in its own cgroup (job:/dsec/<helper>.<token>)", ":job:/dsec/" in _job_line(out),
            _job_line(out))
    a.check("no process of the command left after the timeout", not await a.left_behind(f"sleep {marker}"),
            await a.ps())
    a.check("no per-command cgroup left", not await a.cgroups_left(before), await a.lab.inner_cgroups(a.sid))
    a.check("sandbox still answers", await a.alive())


@case("gvisor_cgroup_escape_root",
      attack="as root: unshare(CLONE_NEWUSER) and a mount namespace it owns, mount the sentry's cgroupfs there, "
             "write its pid to the root cgroup.procs, setsid and double fork, then outlive the exec timeout",
      asserts="unshare and mount refused (EPERM); never out of its cgroup; nothing of it alive after the timeout; "
              "no per-command cgroup left",
      defence="the command's seccomp filter (unshare, setns, namespace clone flags, clone3, the mount family); "
              "kill by the command's own UTS namespace, cgroup and session")
async def _escape_root(a: GVisorAttack) -> None:
    await _cgroup_escape(a, 0, "3301")


@case("gvisor_cgroup_escape_user",
      attack="the same escape as uid 1000", asserts="as for root", defence="as for root; cgroup files are root's")
async def _escape_user(a: GVisorAttack) -> None:
    await _cgroup_escape(a, "1000:1000", "3302")


@case("gvisor_namespaces",
      attack="unshare every namespace kind, clone(2) with each namespace flag, clone3, setns into its own, the "
             "init's and its helper's mount namespace (where cgroupfs is mounted), busybox unshare/nsenter; "
             "as root and as uid 1000",
      asserts="every call refused with EPERM (clone3: ENOSYS, so libc falls back to clone); fork and a plain "
              "clone still work; the command runs under seccomp (Seccomp: 2)",
      defence="the command's seccomp filter, installed by dsec-gvexec right before execve (no_new_privs)")
async def _namespaces(a: GVisorAttack) -> None:
    ops = (*NAMESPACE_OPS, "clone3_newuser", "clone3_plain", "fork", "clone_plain")
    for label, user in USERS:
        out = await a.helper(*ops, user=user)
        wrong = {o: out.ops.get(o) for o in NAMESPACE_OPS if out.ops.get(o, (0, ""))[1] != "EPERM"}
        a.check(f"{label}: every namespace call refused with EPERM", not wrong, wrong)
        clone3 = {o: out.ops.get(o) for o in ("clone3_newuser", "clone3_plain")}
        a.check(f"{label}: clone3 says ENOSYS", all(v == (-1, "ENOSYS") for v in clone3.values()), clone3)
        a.check(f"{label}: fork and a plain clone still work", out.ret("fork") > 0 and out.ret("clone_plain") > 0,
                out.ops)
        r = await a.run("grep Seccomp /proc/self/status; unshare -U true && echo unshared; "
                        "unshare -m true && echo unshared; nsenter -t 1 -m true && echo entered; true", user=user)
        a.check(f"{label}: the command runs under a seccomp filter", "Seccomp:\t2" in r.stdout_text, r.stdout_text)
        a.check(f"{label}: busybox unshare and nsenter fail", "unshared" not in r.stdout_text
                and "entered" not in r.stdout_text, r)


@case("gvisor_mounts",
      attack="mount tmpfs, cgroupfs and proc, remount /sys rw, bind the root, umount /proc and /tmp, pivot_root, "
             "fsopen, open_tree, move_mount, mount_setattr, busybox mount; as root and as uid 1000",
      asserts="every call refused; the sandbox's mount table unchanged; no cgroupfs visible; host mount table "
              "did not grow",
      defence="the command's seccomp filter (the mount family: EPERM); no CAP_SYS_ADMIN")
async def _mounts(a: GVisorAttack) -> None:
    host_before = Path("/proc/self/mountinfo").read_text().count("\n")
    inside_before = (await a.run("cat /proc/self/mountinfo")).stdout_text
    for label, user in USERS:
        out = await a.helper(*MOUNT_OPS, user=user)
        done = {o: out.ops.get(o, (0, "MISSING")) for o in MOUNT_OPS if out.ops.get(o, (0, ""))[0] >= 0}
        a.check(f"{label}: every mount call refused", not done, done)
        r = await a.run("mkdir -p /tmp/bm; mount -t tmpfs x /tmp/bm && echo mounted; "
                        "mount -t cgroup -o job none /tmp/bm && echo mounted; true", user=user)
        a.check(f"{label}: busybox mount fails", "mounted" not in r.stdout_text, r)
    inside_after = (await a.run("cat /proc/self/mountinfo")).stdout_text
    a.check("the sandbox's mount table unchanged", inside_after == inside_before, inside_after)
    r = await a.run("ls -A /sys/fs/cgroup | wc -l; find / -xdev -name cgroup.procs 2>/dev/null | wc -l")
    a.check("no cgroupfs visible to a command", r.stdout_text.split() == ["0", "0"], r.stdout_text)
    host_after = Path("/proc/self/mountinfo").read_text().count("\n")
    a.check("host mount table did not grow", host_after - host_before < 5, f"{host_before} -> {host_after}")


@case("gvisor_cgroup_hunt",
      attack="look for a mounted cgroupfs through every process's /proc/<pid>/root and cwd (its helper's private "
             "mount namespace has one at /sys/fs/cgroup) and write its pid into any cgroup.procs reached; "
             "as root and as uid 1000",
      asserts="nothing reached; still in its own cgroup",
      defence="the helper is not dumpable (gVisor refuses its /proc root and cwd to others) and holds no "
              "cgroupfs descriptor while its command runs")
async def _cgroup_hunt(a: GVisorAttack) -> None:
    for label, user in USERS:
        out = await a.helper("root_hunt", user=user)
        moved = [ln for ln in out.lines if ln.startswith("moved ")]
        a.check(f"{label}: no cgroup.procs reached through /proc", not moved and out.ret("root_hunt") == 0, moved)
        a.check(f"{label}: still in its own cgroup", ":job:/dsec/" in _job_line(out), out.lines)


@case("gvisor_cgroup_fd_race",
      attack="spin over every /proc/<pid>/fd link while other commands start in the same sandbox, reopen any "
             "cgroupfs descriptor a helper holds for a moment and move into that cgroup (gVisor skips the "
             "ptrace check Linux makes there), setsid and double fork, then outlive the exec timeout; "
             "as root and as uid 1000",
      asserts="uid 1000 reopens nothing; root may move (a known gVisor gap) but nothing of it outlives its "
              "timeout; no per-command cgroup left once it is gone",
      defence="kill by the command's own UTS namespace, which its seccomp filter keeps it in whatever cgroup "
              "it reaches", heavy=True)
async def _fd_race(a: GVisorAttack) -> None:
    secs = 3 if a.lab.quick else 8
    before = await a.lab.inner_cgroups(a.sid)
    for (label, user), marker in zip(USERS, ("3311", "3312"), strict=True):
        attack = asyncio.ensure_future(a.helper(f"fd_race={secs}:{marker}", "pause", timeout=secs + 2.0, user=user))
        starts = await a.concurrent_starts(attack)
        out = await attack
        moved = [ln for ln in out.lines if ln.startswith("moved ")]
        a.check(f"{label}: other commands started meanwhile", starts > 0, starts)
        a.check(f"{label}: exec ended by its timeout", out.result.timed_out == "timeout", out.result)
        if user != 0:
            a.check(f"{label}: no cgroupfs descriptor reopened", not moved, moved)
        a.check(f"{label}: nothing of it alive after the timeout ({'moved' if moved else 'never moved'})",
                not await a.left_behind(f"sleep {marker}"), await a.ps())
    a.check("no per-command cgroup left", not await a.cgroups_left(before), await a.lab.inner_cgroups(a.sid))
    a.check("sandbox still answers", await a.alive())


TREE = ("(setsid sh -c 'sleep {m}1 & exec sleep {m}2' &) ; "       # out of the session, orphaned
        "(trap '' TERM HUP; sleep {m}3 & wait) & "                   # ignores SIGTERM and SIGHUP
        "sleep {m}4 & kill -STOP $! ; "                              # stopped
        "(setsid sh -c '(sleep {m}5 &) ; (setsid sleep {m}6 &)' &) ; "  # double forks, sessions of their own
        "nohup sleep {m}7 >/dev/null 2>&1 & "
        "echo started; sleep {m}8")


@case("gvisor_timeout_detach",
      attack="a tree that hides from a timeout: setsid and double forks orphaned to pid 1, children that ignore "
             "SIGTERM and SIGHUP, a SIGSTOP'd child, nohup; as root and as uid 1000",
      asserts="the exec ends at its timeout with SIGKILL; nothing of the tree left; no per-command cgroup left",
      defence="dsec-gvexec kill: every process of the command's UTS namespace, cgroup, session and descendants "
              "is stopped, then killed", needs_helper=False)
async def _timeout_detach(a: GVisorAttack) -> None:
    before = await a.lab.inner_cgroups(a.sid)
    for (label, user), m in zip(USERS, ("61", "62"), strict=True):
        r = await a.run(TREE.format(m=m), timeout=2.0, user=user)
        a.check(f"{label}: exec ended by its timeout with SIGKILL", r.timed_out == "timeout" and r.signal == 9, r)
        a.check(f"{label}: the tree had started", r.stdout_text == "started\n", r)
        left = await a.left_behind(*(f"sleep {m}{i}" for i in range(1, 9)))
        a.check(f"{label}: nothing of the tree left", not left, left)
    a.check("no per-command cgroup left", not await a.cgroups_left(before), await a.lab.inner_cgroups(a.sid))


@case("gvisor_helper_signals",
      attack="as root, SIGSTOP its own helper (the parent that reports its end) or SIGKILL it, detach a "
             "sleeper and run past the timeout; as uid 1000, signal the helper",
      asserts="the exec still ends (stopped helper: by its timeout; killed helper: at once) and nothing of the "
              "command is left; no helper left stopped; uid 1000 cannot signal it",
      defence="kill continues the helpers it spares (SIGCONT); a helper that never reports gets its command "
              "killed by namespace before the end is reported; helpers are root's")
async def _helper_signals(a: GVisorAttack) -> None:
    before = await a.lab.inner_cgroups(a.sid)
    detach = "(setsid sh -c 'sleep {m}' >/dev/null 2>&1 &) ; "
    r = await a.run("kill -STOP $PPID; " + detach.format(m="3321") + "sleep 3322", timeout=2.0)
    a.check("stopped helper: exec ended by its timeout", r.timed_out == "timeout", r)
    r2 = await a.run("kill -KILL $PPID; " + detach.format(m="3323") + "sleep 3324", timeout=30.0)
    a.check("killed helper: exec ended before its timeout", r2.timed_out is None, r2)
    left = await a.left_behind(*(f"sleep 332{i}" for i in range(1, 5)))
    a.check("nothing of either command left", not left, left)
    ps = await a.ps()
    stopped = [ln for ln in ps.splitlines() if "dsec-gvexec run" in ln and ln.split()[1].startswith("T")]
    a.check("no helper left stopped", not stopped, ps)
    r3 = await a.run("kill -STOP $PPID; kill -KILL $PPID; echo survived", user="1000:1000", timeout=30.0)
    a.check("uid 1000: signalling the helper refused", r3.stdout_text == "survived\n" and r3.exit_code == 0, r3)
    a.check("no per-command cgroup left", not await a.cgroups_left(before), await a.lab.inner_cgroups(a.sid))
    a.check("sandbox still answers", await a.alive())


@case("gvisor_ptrace_helpers",
      attack="as root, PTRACE_ATTACH to pid 1 and to every dsec-gvexec helper, spinning on /proc to catch new "
             "ones (started by other commands meanwhile) before they make themselves non-dumpable; uid 1000 too",
      asserts="no helper or init ever attached", defence="helpers hold capabilities the command lacks and make "
              "themselves non-dumpable first; gVisor's ptrace checks both", heavy=True)
async def _ptrace_helpers(a: GVisorAttack) -> None:
    secs = "2" if a.lab.quick else "6"
    for label, user in USERS:
        attack = asyncio.ensure_future(a.helper(f"ptrace_helpers={secs}", "ptrace_pid=1", timeout=30, user=user))
        await a.concurrent_starts(attack)
        out = await attack
        attached = [ln for ln in out.lines if ln.startswith("attached ")]
        tried = next((int(ln.split()[1]) for ln in out.lines if ln.startswith("helpers_tried ")), 0)
        a.check(f"{label}: helpers were there to attack", tried > 0, out.lines[-5:])
        a.check(f"{label}: no helper attached", not attached and out.ret(f"ptrace_helpers={secs}") == 0, attached)
        a.check(f"{label}: pid 1 refused", out.ret("ptrace_pid=1") < 0, out.ops)


INIT_KILLS = ("kill=1:9", "kill=1:19", "tkill_init", "tgkill_init", "sigqueue_init", "pidfd_kill_init",
              "sigio_init=9", "sigio_init=19")


@case("gvisor_init_and_neighbours",
      attack="SIGKILL and SIGSTOP pid 1 every way there is (kill, tkill, tgkill, rt_sigqueueinfo, a pidfd, SIGIO "
             "through F_SETOWN 1 and F_SETSIG, busybox kill); kill(-1, SIGKILL) and `kill -9 -1` as root and as "
             "uid 1000, with a bystander command of the other user running in the same sandbox",
      asserts="every signal to pid 1 refused, pid 1 alive and not stopped; uid 1000 kills only its own; root "
              "kills only this sandbox's; neighbour sandboxes' markers, the host sentinel and the sentry live",
      defence="the command's seccomp filter (signals to pid 1, F_SETSIG SIGKILL/SIGSTOP: gVisor delivers both "
              "to a namespace's init, Linux does not); gVisor's pid namespace; no CAP_KILL for uid 1000")
async def _init_and_neighbours(a: GVisorAttack) -> None:
    sentry = a.backend.get(a.sid).sandbox_pid
    for label, user in USERS:
        out = await a.helper(*INIT_KILLS, user=user, timeout=30)
        sent = {o: out.ops.get(o, (0, "MISSING")) for o in INIT_KILLS if out.ops.get(o, (0, ""))[0] >= 0}
        a.check(f"{label}: every signal to pid 1 refused", not sent, sent)
    await a.run("kill -9 1; kill -STOP 1; kill -SEGV 1; true", timeout=10)
    ps = await a.ps()
    init = [ln for ln in ps.splitlines() if ln.split()[:1] == ["1"]]
    a.check("pid 1 alive and not stopped", bool(init) and not init[0].split()[1].startswith("T"), ps)
    await a.run("sleep 3331 >/dev/null 2>&1 &", timeout=10)  # root's bystander
    await a.run("sleep 3332 >/dev/null 2>&1 &", timeout=10, user="1000:1000")
    await a.helper("kill_all", user="1000:1000", timeout=10)
    await a.run("kill -9 -1; true", user="1000:1000", timeout=10)
    ps = await a.ps()
    a.check("uid 1000's kill -1 spared root's processes", "sleep 3331" in ps, ps)
    a.check("uid 1000's kill -1 reached its own", not await a.left_behind("sleep 3332"), ps)
    await a.helper("kill_all", timeout=10)
    await a.run("kill -9 -1; true", timeout=10)
    a.check("root's kill -1 reached root's bystander", not await a.left_behind("sleep 3331"), await a.ps())
    a.check("sandbox still answers", await a.alive())
    a.check("the sentry lives", a.backend.get(a.sid).state.value == "running" and Path(f"/proc/{sentry}").exists())
    a.check("host sentinel alive", a.lab.sentinel is not None and a.lab.sentinel.poll() is None)
    for sid in a.lab.neighbours:
        a.check(f"neighbour {sid}: marker alive", await a.lab.marker_alive(sid))


# -- limits ---------------------------------------------------------------------


@case("gvisor_fork_bomb",
      attack="fork in a loop in every child until refused, then hold the slots until the timeout",
      asserts="the bomb's processes never exceed the pids limit (32); host tasks of the sandbox within the pids "
              "cgroup's bound; nothing of it left after the timeout; the sandbox answers",
      defence="RLIMIT_NPROC = pids in the sentry (root cannot raise it); a host pids cgroup at pids + headroom "
              "for the sentry's threads; the timeout kill", resources={"pids": 32}, heavy=True)
async def _fork_bomb(a: GVisorAttack) -> None:
    pids = 32
    bound = pids + a.backend.config.host_pids_headroom
    attack = asyncio.ensure_future(a.helper("forkbomb", timeout=3.0 if a.lab.quick else 8.0))
    peak_inside = peak_host = 0
    while not attack.done():
        peak_host = max(peak_host, a.backend.cgroups.host_tasks(a.sid))
        with contextlib.suppress(DsecError):  # `ps` is exec'd by the helper directly: no fork of root's needed
            r = await a.backend.exec(a.sid, ["ps", "-o", "args"], timeout=10)
            peak_inside = max(peak_inside, sum(ln.strip().startswith(GVABUSE_PATH) for ln in r.stdout_text.splitlines()))
        await asyncio.sleep(0.2)
    out = await attack
    a.check("exec ended by its timeout", out.result.timed_out == "timeout", out.result)
    a.check("the bomb grew (it ran)", peak_inside > 1, peak_inside)
    a.check(f"the bomb's processes never above the pids limit ({pids})", peak_inside <= pids, peak_inside)
    a.check(f"host tasks of the sandbox within the pids cgroup ({bound})", peak_host <= bound, peak_host)
    a.check("nothing of the bomb left", not await a.left_behind(GVABUSE_PATH), await a.ps())
    a.check("sandbox still answers", await a.alive())


@case("gvisor_memory_hog",
      attack="allocate and touch 512 MiB in a 96 MiB sandbox; fill /dev/shm (the sentry's memory)",
      asserts="the hog dies with limit=memory; the memory cgroup's peak within the limit; the lab's memory "
              "(its sandboxes' cgroups and process tree) did not grow by 256 MiB; the sandbox answers, or is "
              "failed with the memory reason",
      defence="the sandbox's memory cgroup (sentry, gofer and all sandbox memory; memsw = limit): the host's "
              "OOM killer acts inside it only", resources={"memory": 96 * MiB}, heavy=True)
async def _memory_hog(a: GVisorAttack) -> None:
    held0 = HostState.take(a.backend.cgroups.name)
    out = await a.helper("alloc=512", timeout=60)
    r = out.result
    a.check("the hog failed", r.exit_code != 0 or r.signal is not None, r)
    a.check("limit=memory reported", r.limit is not None and r.limit.kind == "memory", r.limit)
    if a.backend.get(a.sid).state.value == "running":
        r2 = await a.run("dd if=/dev/zero of=/dev/shm/fill bs=1M count=512 2>&1; rm -f /dev/shm/fill", timeout=60)
        a.check("/dev/shm fill did not get 512 MiB", "536870912 bytes" not in r2.stdout_text, r2.stdout_text[-300:])
    peak_file = a.backend.cgroups.dir("memory", a.sid) / "memory.max_usage_in_bytes"
    peak = int(peak_file.read_text()) if peak_file.exists() else 0
    a.check("memory cgroup peak within the 96 MiB limit", peak <= 96 * MiB, f"{peak >> 20} MiB")
    a.check(*memory_check(held0, HostState.take(a.backend.cgroups.name), 256 * MiB))
    rec = a.backend.get(a.sid)
    if rec.state.value == "running":
        a.check("sandbox still answers", await a.alive())
    else:
        a.check("a failed sandbox says the memory limit", rec.state.value == "failed" and "memory" in rec.reason,
                (rec.state, rec.reason))


@case("gvisor_disk_fill",
      attack="dd /dev/zero into the writable layer and its /tmp, and a 64 MiB write through the files API, in a "
             "16 MiB sandbox", asserts="ENOSPC at the quota from all three; host free space unchanged; space "
                                       "comes back after rm",
      defence="the writable layer is a tmpfs of Resources.disk bytes (memory medium); /tmp is bound from it",
      resources={"disk": 16 * MiB}, needs_helper=False)
async def _disk_fill(a: GVisorAttack) -> None:
    free = {p: os.statvfs(p) for p in ("/", tempfile.gettempdir(), str(a.lab.work))}
    for path in ("/root/fill", "/tmp/fill"):
        r = await a.run(f"dd if=/dev/zero of={path} bs=1M count=200; stat -c %s {path}; rm -f {path}", timeout=60)
        a.check(f"dd into {path} hit the quota (ENOSPC)", "No space left" in r.stderr.decode(errors="replace"),
                r.stderr[-300:])
        size = r.stdout_text.split()[-1] if r.stdout_text.split() else "-1"
        a.check(f"{path} stopped at the quota", size.isdigit() and int(size) <= 16 * MiB, size)
    try:
        await asyncio.to_thread(a.backend.files(a.sid).write, "/tmp/api-fill", b"\0" * (64 * MiB))
        a.check("files API write refused", False, "a 64 MiB write succeeded in a 16 MiB sandbox")
    except FileAccessError as exc:
        a.check("files API write refused with ENOSPC", exc.fields.get("errno") in (errno.ENOSPC, errno.EDQUOT)
                or "space" in str(exc).lower(), exc)
    for p, st in free.items():
        now = os.statvfs(p)
        lost = (st.f_bavail - now.f_bavail) * now.f_frsize
        a.check(f"host free space on {p} did not drop by 64 MiB", lost < 64 * MiB, f"{lost >> 20} MiB")
    r = await a.run("rm -f /tmp/api-fill; dd if=/dev/zero of=/tmp/again bs=1M count=4 2>/dev/null && "
                    "stat -c %s /tmp/again")
    a.check("space comes back after rm", r.stdout_text.strip() == str(4 * MiB), r)


# -- what the host shows, and what the sandbox can reach of it ----------------------


@case("gvisor_host_info",
      attack="read the host through /proc and /sys: kernel release and command line, mount tables, network "
             "devices, kernel symbols, the host secret through /proc/<pid>/root walks; as root and as uid 1000",
      asserts="none of it is the host's: the kernel is gVisor's, no host path in any mount table, loopback "
              "only, the secret never read", defence="the sentry implements /proc and /sys itself; the root is "
                                                    "our overlay; --network=none", needs_helper=False)
async def _host_info(a: GVisorAttack) -> None:
    host_release = os.uname().release
    host_cmdline = Path("/proc/cmdline").read_text().strip()
    host_paths = [str(a.backend.run_dir), str(a.backend.state_dir), str(a.lab.work)]
    secret = a.lab.secret_file
    for label, user in USERS:
        r = await a.run(f"uname -r; echo ---; cat /proc/cmdline; echo ---; cat /proc/self/mountinfo /proc/1/mountinfo "
                        f"/proc/mounts; echo ---; ls /sys/class/net; echo ---; cat /proc/net/dev; echo ---; "
                        f"head -c 4096 /proc/kallsyms; echo ---; cat {secret} /proc/1/root{secret} "
                        f"/proc/self/root{secret} /proc/1/cwd{secret}; true", user=user)
        parts = r.stdout_text.split("---\n")
        a.check(f"{label}: the script ran", len(parts) == 7, r)
        if len(parts) != 7:
            continue
        release, cmdline, mounts, net, netdev, _kallsyms, secrets = parts
        a.check(f"{label}: kernel release is not the host's", release.strip() != host_release, release)
        a.check(f"{label}: /proc/cmdline is not the host's", cmdline.strip() != host_cmdline or not host_cmdline,
                cmdline)
        leaked = [p for p in host_paths if p in mounts]
        a.check(f"{label}: no host path in the mount tables", not leaked, leaked)
        a.check(f"{label}: network devices: loopback only", net.split() in ([], ["lo"]), net)
        a.check(f"{label}: /proc/net/dev: loopback only",
                [ln.split(":")[0].strip() for ln in netdev.splitlines() if ":" in ln] in ([], ["lo"]), netdev)
        a.check(f"{label}: host secret not read", a.lab.secret not in secrets, secrets)


@case("gvisor_sysctls",
      attack="write host-looking sysctls and trigger files: vm.swappiness, kernel.core_pattern, kernel.panic, "
             "/proc/sysrq-trigger, drop_caches; as root",
      asserts="the host's values unchanged", defence="/proc/sys is the sentry's (writes refused or kept inside)",
      needs_helper=False)
async def _sysctls(a: GVisorAttack) -> None:
    paths = ["/proc/sys/vm/swappiness", "/proc/sys/kernel/core_pattern", "/proc/sys/kernel/panic"]
    before = {p: Path(p).read_text() for p in paths if Path(p).exists()}
    r = await a.run("echo 3 > /proc/sys/vm/swappiness; echo '|/tmp/x' > /proc/sys/kernel/core_pattern; "
                    "echo 7 > /proc/sys/kernel/panic; echo c > /proc/sysrq-trigger; "
                    "echo 3 > /proc/sys/vm/drop_caches; sysctl -w kernel.hostname=evil; echo end")
    a.check("the writes ran", "end" in r.stdout_text, r)
    changed = {p: (v, Path(p).read_text()) for p, v in before.items() if Path(p).read_text() != v}
    a.check("host sysctls unchanged", not changed, changed)
    a.check("host hostname unchanged", os.uname().nodename != "evil")


@case("gvisor_helper_binary",
      attack="open the helper's binary read-write through /proc/1/exe and its own helper's /proc/<pid>/exe "
             "(runc CVE-2019-5736 style) and write its first byte back (unchanged, should it work); as root and "
             "as uid 1000",
      asserts="refused; the host's dsec-gvexec unchanged", defence="the helper is loaded from a read-only host "
              "descriptor (runsc --exec-fd); nothing of it is in the sandbox's files")
async def _helper_binary(a: GVisorAttack) -> None:
    from dsec.backends.gvisor.build import helper_path

    host = helper_path(build=False)
    digest = hashlib.sha256(host.read_bytes()).hexdigest()
    ops = ("rewrite=/proc/1/exe", "rewrite_parent_exe")
    for label, user in USERS:
        out = await a.helper(*ops, user=user)
        opened = {o: out.ops.get(o, (0, "MISSING")) for o in ops if out.ops.get(o, (0, ""))[0] >= 0}
        a.check(f"{label}: the helpers' binaries cannot be opened for writing", not opened, opened)
    a.check("the host's helper binary unchanged", hashlib.sha256(host.read_bytes()).hexdigest() == digest)
    a.check("sandbox still answers", await a.alive())


def _tar(members: list[tuple[str, str, bytes | str]]) -> bytes:
    """members: (kind, name, data or link target); kind: file, symlink or hardlink."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as t:
        for kind, name, data in members:
            ti = tarfile.TarInfo(name)
            if kind == "file":
                assert isinstance(data, bytes)
                ti.size = len(data)
                t.addfile(ti, io.BytesIO(data))
                continue
            ti.type = tarfile.SYMTYPE if kind == "symlink" else tarfile.LNKTYPE
            ti.linkname = str(data)
            t.addfile(ti)
    return buf.getvalue()


@case("gvisor_files_escape",
      attack="plant symlinks out of the root (absolute, ../.., /proc/1/root, /proc/self/root, a host directory), "
             "then read, write, append, mkdir, rename and upload (tar-slip, hard links out) through the files "
             "API, race a directory/symlink swap under a write, and read a FIFO and /proc",
      asserts="no host file read, written or created; escaping tar members refused; the FIFO and /proc refused "
              "without a hang",
      defence="the files API resolves on the host with openat2(RESOLVE_IN_ROOT | NO_MAGICLINKS | NO_XDEV) "
              "against our overlay (the container backend's SandboxFiles)", needs_helper=False)
async def _files_escape(a: GVisorAttack) -> None:
    fs = a.backend.files(a.sid)
    host_dir = a.lab.work / f"host-target-{a.sid}"
    host_dir.mkdir(exist_ok=True)
    target = host_dir / "pwned"
    secret = a.lab.secret_file
    depth = "../" * 12
    await a.run(f"ln -s {secret} /tmp/abs; ln -s {depth}{str(secret).lstrip('/')} /tmp/rel; "
                f"ln -s /proc/1/root /tmp/initroot; ln -s {host_dir} /tmp/hostdir; ln -s {target} /tmp/wlink; "
                f"ln -s /proc/self/root/{str(secret).lstrip('/')} /tmp/selfroot; mkfifo /tmp/fifo")
    try:
        for p in ("/tmp/abs", "/tmp/rel", f"/tmp/initroot{secret}", "/tmp/selfroot", f"/../../..{secret}",
                  f"/proc/1/root{secret}"):
            try:
                got = await asyncio.to_thread(fs.read, p)
            except (DsecError, OSError):
                continue
            a.check(f"read {p}: no host content", a.lab.secret.encode() not in got, got[:200])
        writes: list[tuple[str, Callable[[], object]]] = [
            ("write via symlink", lambda: fs.write("/tmp/wlink", b"x")),
            ("write into symlinked dir", lambda: fs.write("/tmp/hostdir/pwned", b"x")),
            ("append via symlink", lambda: fs.append("/tmp/wlink", b"x")),
            ("mkdir via symlinked dir", lambda: fs.mkdir("/tmp/hostdir/pwned")),
            ("rename onto a host path", lambda: fs.rename("/tmp/abs", "/tmp/hostdir/pwned")),
            ("upload into symlinked dir", lambda: fs.upload("/tmp/hostdir", _tar([("file", "pwned", b"x")]))),
            ("tar-slip through a member symlink", lambda: fs.upload("/tmp/slip", _tar(
                [("symlink", "s", str(host_dir)), ("file", "s/pwned", b"x")]))),
        ]
        for label, fn in writes:
            with contextlib.suppress(DsecError, OSError):
                await asyncio.to_thread(fn)
            a.check(f"{label}: no host file created", not os.listdir(host_dir), os.listdir(host_dir))
        bad_tars: list[tuple[str, list[tuple[str, str, bytes | str]]]] = [
            ("absolute member", [("file", str(target), b"x")]),
            ("../ member", [("file", depth + str(target).lstrip("/"), b"x")]),
            ("hard link out of the tree", [("hardlink", "h", depth + str(secret).lstrip("/"))]),
        ]
        for label, members in bad_tars:
            try:
                await asyncio.to_thread(fs.upload, "/tmp/up", _tar(members))
                a.check(f"upload with {label} refused", False, "accepted")
            except DsecError as exc:
                a.check(f"upload with {label} refused", True, exc)
        racer = asyncio.ensure_future(a.run(
            f"end=$(( $(date +%s) + 2 )); while [ $(date +%s) -lt $end ]; do rm -rf /tmp/race; mkdir /tmp/race; "
            f"rm -rf /tmp/race; ln -s {host_dir} /tmp/race; done", timeout=20))
        tries = 0
        while not racer.done():
            tries += 1
            with contextlib.suppress(DsecError, OSError):
                await asyncio.to_thread(fs.write, "/tmp/race/pwned", b"x")
            await asyncio.sleep(0)
        await racer
        a.check("the swap race ran", tries > 10, tries)
        a.check("host directory untouched", os.listdir(host_dir) == [], os.listdir(host_dir))
        a.check("host secret unchanged", secret.read_text() == a.lab.secret + "\n")
        for label, path in (("FIFO", "/tmp/fifo"), ("/proc/self/environ", "/proc/self/environ")):
            try:
                await asyncio.wait_for(asyncio.to_thread(fs.read, path), 20)
                a.check(f"read {label} refused", False, "returned data")
            except DsecError as exc:
                a.check(f"read {label} refused with a typed error", True, exc)
            except TimeoutError:
                a.check(f"read {label} did not hang", False, "still running after 20 s")
    finally:
        shutil.rmtree(host_dir, ignore_errors=True)


@case("gvisor_session_escape",
      attack="in a persistent shell session: the cgroup escape and a detached tree, run past the session "
             "command's timeout", asserts="the command is killed, nothing of it left; the session lives on with "
                                        "its state", defence="the session's commands run under the shell's "
                                                             "filter and UTS namespace; kill spares the shell "
                                                             "only")
async def _session_escape(a: GVisorAttack) -> None:
    sess = await a.backend.open_session(a.sid)
    try:
        await sess.run("X=kept", timeout=30)
        with contextlib.suppress(ExecTimeout):
            await sess.run(f"{GVABUSE_PATH} cgroup_escape=3341 pause", timeout=2)
        with contextlib.suppress(ExecTimeout):
            await sess.run("(setsid sh -c 'sleep 3342' >/dev/null 2>&1 &) ; sleep 3343", timeout=2)
        a.check("nothing of the session's commands left", not await a.left_behind("sleep 334"), await a.ps())
        r = await sess.run("echo $X", timeout=30)
        a.check("the session lives on with its state", r.stdout == b"kept\n", r)
    finally:
        await sess.close()


# ------------------------------------------------------------------ runner ----


def case_named(name: str) -> GVisorCase:
    for c in GVISOR_CASES:
        if c.name == name:
            return c
    raise KeyError(name)


async def gv_host_healthy(lab: GVisorLab, before: HostState, outcome: Outcome, *,
                          neighbour_errors: list[str]) -> None:
    """The checks every case ends with."""
    add = outcome.checks.append
    b = lab.backend
    try:
        rec = await b.create(lab.spec())
        try:
            r = await b.exec(rec.id, "echo healthy", timeout=30)
            add(Check("backend: create + exec on a fresh sandbox", r.stdout_text.strip() == "healthy", repr(r)[:300]))
        finally:
            await b.destroy(rec.id)
        add(Check("backend: destroy left nothing", not sandbox_leftovers(b, rec.id), sandbox_leftovers(b, rec.id)))
    except DsecError as exc:
        add(Check("backend: create/exec/destroy", False, repr(exc)))
    now = HostState.take(b.cgroups.name)
    add(Check(*memory_check(before, now, 1 << 30)))
    add(Check("host: load average sane", now.load1 < before.load1 + 8 * now.ncpu, f"{before.load1:.1f} -> {now.load1:.1f}"))
    bad = [m for s, m in kmsg_records() if s > before.kmsg_seq and BAD_KMSG.search(m)]
    add(Check("host: kernel logged no BUG/Oops/lockup", not bad, bad[:5]))
    add(Check("host: sentinel process alive", lab.sentinel is None or lab.sentinel.poll() is None))
    for sid in lab.neighbours:
        try:
            add(Check(f"neighbour {sid}: marker process alive", await lab.marker_alive(sid)))
            data = lab.backend.files(sid).read("/tmp/neighbour-secret")
            add(Check(f"neighbour {sid}: files intact", data == f"{sid}\n".encode(), data[:100]))
        except DsecError as exc:
            add(Check(f"neighbour {sid}: alive and intact", False, repr(exc)))
    add(Check("neighbours: no exec failed during the case", not neighbour_errors, neighbour_errors[:5]))


async def run_gvisor_case(lab: GVisorLab, c: GVisorCase, *, load: NeighbourLoad | None = None,
                          timeout: float = 300.0) -> Outcome:
    """Create the attacked sandbox, run the case, destroy it, check the host. Never raises for
    the attack's sake: everything lands in the returned :class:`Outcome`."""
    out = Outcome(c.name)
    if c.needs_helper and lab.helper is None:
        out.skipped = "no static attack program (gcc -static unavailable)"
        return out
    before = HostState.take(lab.backend.cgroups.name)
    t0 = time.perf_counter()
    rec = None
    try:
        rec = await lab.backend.create(lab.spec(**c.resources))
        if c.needs_helper and lab.helper is not None:
            lab.backend.files(rec.id).write(GVABUSE_PATH, lab.helper.read_bytes(), mode=0o755)
        await asyncio.wait_for(c.fn(GVisorAttack(lab, c, rec.id, out)), timeout)
    except Exception as exc:  # the outcome records it; the suite goes on
        out.error = f"{type(exc).__name__}: {exc}"[:2000]
    finally:
        if rec is not None:
            try:
                await lab.backend.destroy(rec.id)
            except DsecError as exc:
                out.checks.append(Check("attacked sandbox destroyed", False, repr(exc)))
            left: list[str] = []
            for _ in range(25):  # the sentry's last threads leave its cgroup a moment after it dies
                left = sandbox_leftovers(lab.backend, rec.id)
                if not left:
                    break
                await asyncio.sleep(0.2)
            out.checks.append(Check("attacked sandbox left nothing on the host (runsc state, cgroups, mounts, "
                                    "bundle, record, processes)", not left, left))
    t1 = time.perf_counter()
    out.seconds = t1 - t0
    if load is not None:
        got = load.since(t0, t1)
        out.neighbour_execs = len(got)
        out.neighbour_p50_ms = percentile(got, 50) if got else None
    await gv_host_healthy(lab, before, out, neighbour_errors=load.errors_since(t0) if load is not None else [])
    return out


async def run_gvisor_cases(lab: GVisorLab, *, only: Sequence[str] | None = None, load: bool = True,
                           say: Progress = print) -> tuple[list[Outcome], float | None]:
    """Every case (or ``only`` those) against the lab's backend, its neighbours (set up
    already) running ``/bin/true`` in a loop when ``load``. The outcomes, and the neighbours'
    quiet exec p50 (ms) measured first (None without load)."""
    outcomes: list[Outcome] = []
    baseline = None
    if load and lab.neighbours:
        nl = NeighbourLoad(cast(Any, lab.backend), lab.neighbours)
        nl.start()
        try:
            baseline = await nl.baseline(3.0 if lab.quick else 10.0)
        finally:
            await nl.stop()
        say(f"gvisor: quiet neighbour exec p50 {baseline:.1f} ms" if baseline else "gvisor: no quiet samples")
    for c in GVISOR_CASES:
        if only and c.name not in only:
            continue
        o = await run_gvisor_case_under_load(lab, c) if load and lab.neighbours else await run_gvisor_case(lab, c)
        outcomes.append(o)
        verdict = "skipped" if o.skipped else ("contained" if o.contained else "NOT CONTAINED")
        ratio = f"{o.neighbour_p50_ms / baseline:.2f}x" if o.neighbour_p50_ms and baseline else "-"
        say(f"  {c.name:<28} {verdict:<14} neighbours {ratio:>6}  ({o.seconds:.1f}s)")
        for f in o.failures()[:5]:
            say(f"      {f}")
    return outcomes, baseline


async def run_gvisor_case_under_load(lab: GVisorLab, c: GVisorCase) -> Outcome:
    """One case with fresh neighbours (see :meth:`GVisorLab.renew_neighbours`) running
    ``/bin/true`` in a loop meanwhile."""
    await lab.renew_neighbours()
    nl = NeighbourLoad(cast(Any, lab.backend), lab.neighbours)
    nl.start()
    try:
        return await run_gvisor_case(lab, c, load=nl)
    finally:
        await nl.stop()


async def run_gvisor_suite(work: Path, *, quick: bool = True, only: Sequence[str] | None = None,
                           k_neighbours: int = 1, say: Progress = print) -> tuple[list[Outcome], float | None]:
    """The whole gVisor red team on its own: a gVisor backend (named after this process) with
    a busybox layer under ``work``, the attack program built into ``work``, ``k_neighbours``
    neighbours; everything destroyed at the end. Needs root and runsc. The outcomes and the
    neighbours' quiet exec p50 (for :func:`gvisor_outcomes_json`)."""
    from dsec.backends.gvisor.backend import GVisorBackend
    from dsec.backends.gvisor.config import GVisorConfig
    from dsec.images import LocalLayerStore, build_busybox

    work = work / "dsec-gvabuse"  # layer mounts must have "dsec" in their path (the leak checks find them by it)
    store = LocalLayerStore(work / "state" / "layers")
    layer = await asyncio.to_thread(build_busybox, store, name="gvabuse-busybox", tag="latest")
    helper = await asyncio.to_thread(build_gvabuse, work / "cache")
    backend = GVisorBackend(GVisorConfig(), name=f"gvab{os.getpid() % 100000}", state_dir=work / "state",
                            run_dir=work / "run", id_prefix="ga", store=store)
    async with backend:
        lab = GVisorLab(backend, layer.digest, work / "lab", helper=helper, quick=quick)
        await lab.setup(k_neighbours)
        try:
            return await run_gvisor_cases(lab, only=only, say=say)
        finally:
            await lab.close()


def gvisor_outcomes_json(outcomes: Sequence[Outcome], baseline_p50_ms: float | None) -> dict[str, Any]:
    """The flat JSON of the gVisor cases, to sit beside the container's in ``dsec bench abuse``:
    per case ``case_gvisor_<x>``, ``neighbour_ratio_gvisor_<x>`` and ``neighbour_samples_gvisor_<x>``
    (the names carry the prefix already), the totals as ``gvisor_cases_total`` and the like."""
    flat = outcomes_json(outcomes, baseline_p50_ms)
    per_case = {f"{p}{o.name}" for o in outcomes for p in ("case_", "neighbour_ratio_", "neighbour_samples_")}
    return {k if k in per_case else f"gvisor_{k}": v for k, v in flat.items()}
