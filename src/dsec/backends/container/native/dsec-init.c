/*
 * dsec-init: a sandbox's pid 1, exec'd by the spawner's create child once the
 * sandbox's mounts are in place and its root is switched (static: no library
 * of the sandbox's image is ever loaded).
 *
 * Why an exec and not the spawner's fork: a never-exec'd fork shares the
 * spawner's anonymous pages copy-on-write, so every page's reverse map grows
 * with the number of sandboxes, and the host's page-out monitor (DAMON) and
 * reclaim walk it (0.04 -> 1.28 ms per sandbox at high N).  An exec'd init
 * owns a fresh, tiny address space.
 *
 * It is exec'd as host root (so its memory stays owned by the host user
 * namespace: root inside the sandbox can neither ptrace it nor read it), then
 * enters the sandbox's user namespace, drops every capability, sets
 * no_new_privs, becomes non-dumpable, reports "ok" and reaps orphans forever.
 * Pid-namespace init drops signals it has no handler for, so processes in the
 * sandbox cannot kill it.
 *
 * fds on entry: 0-2 /dev/null, 3 the writable layer's directory (the host
 * reads it at /proc/PID/fd/3: kept), 4 the sandbox's user namespace, 5 the
 * report pipe ("ok", or stage NUL errno NUL message NUL, as the spawner's
 * create child writes).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <grp.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#ifndef SYS_close_range
#define SYS_close_range 436
#endif

enum { FD_UPPER = 3, FD_USERNS = 4, FD_REPORT = 5 };

/* capset(2)'s structures, spelled out: built with musl (no kernel headers) where it is
 * installed, for the smallest resident init. */
#define DSEC_CAP_V3 0x20080522
struct cap_header { uint32_t version; int pid; };
struct cap_data { uint32_t effective, permitted, inheritable; };

static void fail(const char *stage, const char *msg) __attribute__((noreturn));
static void fail(const char *stage, const char *msg) {
    int err = errno;
    char buf[600];
    int l1 = snprintf(buf, sizeof buf, "%s", stage) + 1;
    int l2 = snprintf(buf + l1, sizeof buf - l1, "%d", err) + 1;
    int l3 = snprintf(buf + l1 + l2, sizeof buf - l1 - l2, "%s", msg) + 1;
    if (write(FD_REPORT, buf, l1 + l2 + l3) < 0) { /* nothing else we can do */ }
    _exit(127);
}

static int drop_caps(void) {
    for (int c = 0; c <= 63; c++)
        if (prctl(PR_CAPBSET_DROP, c, 0, 0, 0) < 0 && errno != EINVAL) return -1;
    struct cap_header h = {.version = DSEC_CAP_V3, .pid = 0};
    struct cap_data d[2];
    memset(d, 0, sizeof d);
    if (syscall(SYS_capset, &h, d) < 0) return -1;
    prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0);
    return 0;
}

/* Once set up, the init's whole address space fits in one 2 MiB region: its loop runs on a
 * stack in its own .bss, and the kernel's stack, vDSO and vvar mappings (each in a region of
 * its own, far apart: three more branches of page tables) are unmapped. Page tables per
 * sandbox: 24 -> 12 KiB, and the stack's pages go (issue 29: ~10,000 inits on a node). The
 * loop makes only plain system calls (no vDSO call: musl's waitpid and sigwaitinfo are
 * syscalls). Where the stack cannot be switched (not x86_64 or aarch64) it stays as it was. */
static char loop_stack[8192] __attribute__((aligned(4096)));
/* /proc/self/maps is read into the bottom page of the loop's stack (the loop needs far less
 * than a page), which is given back once read: one resident page of stack, no buffer. */
#define maps loop_stack
#define MAPS_SIZE 4096

static void reap_forever(void) __attribute__((noreturn, used));

static unsigned long hex(const char **p) {
    unsigned long v = 0;
    for (;; (*p)++) {
        char c = **p;
        if (c >= '0' && c <= '9') v = v * 16 + (unsigned long)(c - '0');
        else if (c >= 'a' && c <= 'f') v = v * 16 + (unsigned long)(c - 'a' + 10);
        else return v;
    }
}

static void shed_mappings(void) {
    int fd = (int)syscall(SYS_open, "/proc/self/maps", 0 /* O_RDONLY */);
    if (fd < 0) return;  /* no /proc: keep them */
    ssize_t n = 0, r;
    while (n < MAPS_SIZE - 1 && (r = read(fd, maps + n, MAPS_SIZE - 1 - (size_t)n)) > 0) n += r;
    close(fd);
    if (n <= 0 || n >= MAPS_SIZE - 1) return;  /* unread or too long to trust: keep them */
    maps[n] = 0;
    for (const char *line = maps; *line;) {
        const char *end = strchr(line, '\n');
        if (!end) break;
        const char *p = line;
        unsigned long lo = hex(&p);
        p++;
        unsigned long hi = hex(&p);
        const char *name = memchr(line, '[', (size_t)(end - line));
        if (name && (!strncmp(name, "[stack]", 7) || !strncmp(name, "[vdso]", 6) || !strncmp(name, "[vvar", 5)))
            syscall(SYS_munmap, lo, hi - lo);
        line = end + 1;
    }
    syscall(SYS_madvise, maps, MAPS_SIZE, 4 /* MADV_DONTNEED */);
}

static void reap_forever(void) {
    shed_mappings();
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGCHLD);
    for (;;) {
        while (waitpid(-1, NULL, WNOHANG) > 0) {
        }
        siginfo_t si;
        sigwaitinfo(&set, &si);
    }
}

int main(void) {
    prctl(PR_SET_NAME, "dsec-init", 0, 0, 0);
    if (setns(FD_USERNS, CLONE_NEWUSER) < 0) fail("userns", "setns user");
    close(FD_USERNS);
    if (setgroups(0, NULL) < 0 || setresgid(0, 0, 0) < 0 || setresuid(0, 0, 0) < 0)
        fail("userns", "switch to sandbox root");
    if (drop_caps() < 0) fail("caps", "drop capabilities");
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0) fail("nnp", "no_new_privs");
    prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGCHLD);
    sigprocmask(SIG_BLOCK, &set, NULL);
    if (write(FD_REPORT, "ok", 3) != 3) _exit(126);
    syscall(SYS_close_range, FD_USERNS, ~0U, 0);
    char *top = loop_stack + sizeof loop_stack;
#if defined(__x86_64__)
    __asm__ volatile("mov %0, %%rsp\n\tcall reap_forever" : : "r"(top) : "memory");
#elif defined(__aarch64__)
    __asm__ volatile("mov sp, %0\n\tbl reap_forever" : : "r"(top) : "memory");
#else
    (void)top;
    for (;;) {
        while (waitpid(-1, NULL, WNOHANG) > 0) {
        }
        siginfo_t si;
        sigwaitinfo(&set, &si);
    }
#endif
    __builtin_unreachable();
}
