/*
 * dsec-gvexec: the in-sandbox half of the gVisor backend (dsec/backends/gvisor/).
 *
 * It runs inside the gVisor sandbox, never on the host: as the container's pid 1, and for
 * every command, loaded from a host file descriptor (`runsc exec --exec-fd`), so the
 * sandbox's filesystem holds no copy of it. Static (musl), no allocation beyond a few
 * fixed tables.
 *
 * Why it exists: `runsc exec` reports "128+n" for a command killed by signal n (as a
 * shell does: indistinguishable from `exit 128+n`), forwards no signal to the command
 * and cannot kill a process tree; and every process it starts shares one resource
 * limit set (a `ulimit` in one command would bind the next). Here:
 *
 *   init                 pid 1: reaps orphans, forever.
 *   run UID GID TOKEN CWD ARGV...
 *                        Started by runsc as root with the container's capabilities plus
 *                        CAP_SYS_ADMIN; fd 3 is the host's status pipe. Starts the command
 *                        (a vfork-like clone) in a cgroup of its own, "<own pid>.TOKEN", and
 *                        a UTS namespace of its own (below), as UID:GID (no supplementary
 *                        groups) with the capabilities runsc would have given that user, in
 *                        CWD, under a seccomp filter. Writes one line per event:
 *                          "P <own pid> <command pid> <uts ns>"   started
 *                          "E <errno> <stage>"                  could not start (fork, cgroup,
 *                                                               namespace, creds, cwd, seccomp,
 *                                                               exec)
 *                          "X <code> <utime us> <stime us>"      exited
 *                          "K <signal> <utime us> <stime us>"    killed by a signal
 *                        It blocks the catchable signals a command may send its own group
 *                        (`kill 0`), so it lives to report; it leads the command's session;
 *                        it removes the cgroup once the command has ended, if nothing of it
 *                        is left (else a later helper does, once the rest has ended).
 *   kill CG NS ROOT [KEEP...]
 *                        SIGKILL, except the KEEPs, pid 1 and itself, every process of UTS
 *                        namespace NS, of cgroup CG and, as well, of session or process group
 *                        ROOT and every descendant of ROOT, of a KEEP or of one of those. All
 *                        are stopped first (SIGSTOP) and all read again until no new one
 *                        appears, so nothing forks its way out; then they are killed and the
 *                        KEEPs continued (SIGCONT: a command may have stopped its helper); it
 *                        waits until CG holds nothing but the KEEPs and removes it if empty.
 *                        Runs as root with CAP_SYS_ADMIN too. CG "-" (or no cgroupfs), NS "-":
 *                        without them. (A command: `kill CG NS H H`; a session's command, the
 *                        shell S living on: `kill CG NS H H S`.)
 *   count                One line "<uid> <processes>" per user: how close each is to
 *                        RLIMIT_NPROC (the sandbox's pids limit) after a failed fork.
 *
 * What binds a command. Its child, before execve: joins its cgroup, goes back to the
 * container's mount namespace, unshares a UTS namespace of its own (a copy: same host and
 * domain name, which no command can change, lacking CAP_SYS_ADMIN; the cheapest namespace
 * there is, and one that shows in /proc/<pid>/ns/uts), becomes UID:GID without
 * CAP_SYS_ADMIN, and installs a seccomp filter (no_new_privs) that refuses unshare, setns,
 * clone with any namespace flag (clone3: ENOSYS, so libc falls back to clone, whose flags a
 * filter can read), the whole mount family, and signals to pid 1 (below). gVisor runs the
 * filter in the sentry for the command and everything it starts; nothing can remove it. So
 * a command's processes can never leave its UTS namespace, whatever else they do (setsid,
 * double forks, orphans reparented to pid 1, a cgroup move), and kill finds them all by it.
 * (Without the filter, gVisor 20240729 let a command unshare a user namespace, gain every
 * capability over a mount namespace it owned, mount the sentry's cgroupfs there and move
 * itself out of its cgroup: issue 22.)
 *
 * Per-command cgroups. gVisor's sentry implements cgroupfs; its "job" hierarchy (gVisor's
 * own controller: an id, no accounting) always exists, held by the sentry. The helper mounts
 * it only in a private mount namespace of its own; the command, born there, joins its
 * cgroup and leaves that namespace before it execs. The helper drops CAP_SYS_ADMIN too and
 * is not dumpable (gVisor then refuses /proc/<helper>/root and cwd, and ptrace, to others).
 * gVisor (20240729) lets a process follow another one's /proc/<pid>/fd links without the
 * ptrace check Linux makes, so while a helper holds a cgroupfs file open, a root process
 * (CAP_DAC_OVERRIDE; the files are root's, 0644) that races for it can reopen it and move
 * itself to another cgroup (measured: within a few starts of other commands). That no
 * longer lets it outlive its command's kill (the UTS namespace does not change), but it
 * is why cgroupfs is held open only for the few calls that need it, never while the
 * helper's own command runs.
 *
 * Must never: write to fd 3 in "kill" modes, follow symlinks outside /proc, block on
 * anything but wait(2) (and kill's bounded wait for its victims to go), hold cgroupfs open
 * while its command runs, or exec a command that holds CAP_SYS_ADMIN, sees cgroupfs, shares
 * a UTS namespace with anything but its own descendants or runs without the filter.
 */
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
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define MAXP 65536
#define CAP_SYS_ADMIN_BIT 21
#define CG_MOUNT "/sys/fs/cgroup" /* in the helper's private mount namespace only */
#define CG_PARENT CG_MOUNT "/dsec"

/* One status line to the host: a tag and up to three numbers, or a tag, a number and a word. */
static void say(char tag, long a, long b, long c, int count, const char *word) {
    char buf[128];
    int n;
    if (word) n = snprintf(buf, sizeof buf, "%c %ld %s\n", tag, a, word);
    else if (count == 2) n = snprintf(buf, sizeof buf, "%c %ld %ld\n", tag, a, b);
    else n = snprintf(buf, sizeof buf, "%c %ld %ld %ld\n", tag, a, b, c);
    if (write(3, buf, (size_t)n) != n) { /* the host went away: nothing to tell */ }
}

static long us(struct timeval tv) { return (long)tv.tv_sec * 1000000L + tv.tv_usec; }

__attribute__((noreturn)) static void do_init(void) {
    sigset_t all;
    sigfillset(&all);
    sigprocmask(SIG_BLOCK, &all, NULL);
    for (;;) {
        int st;
        if (wait(&st) < 0 && errno == ECHILD) {
            int sig;
            sigwait(&all, &sig); /* SIGCHLD: an orphan arrived, reap it */
        }
    }
}

/* ---- capabilities (no libcap, no kernel headers under musl) ---- */

struct cap_header { uint32_t version; int pid; };
struct cap_data { uint32_t effective, permitted, inheritable; };
#define CAP_V3 0x20080522

static int caps_get(struct cap_data d[2]) {
    struct cap_header h = {CAP_V3, 0};
    return (int)syscall(SYS_capget, &h, d);
}

static int caps_set(struct cap_data d[2]) {
    struct cap_header h = {CAP_V3, 0};
    return (int)syscall(SYS_capset, &h, d);
}

/* Give up CAP_SYS_ADMIN for good (bounding, permitted, effective) and every inheritable
 * capability: what is left is the container's set, as runsc gives it to its commands. */
static int drop_sys_admin(void) {
    if (prctl(PR_CAPBSET_DROP, CAP_SYS_ADMIN_BIT, 0, 0, 0) < 0 && errno != EINVAL) return -1;
    struct cap_data d[2];
    if (caps_get(d) < 0) return -1;
    for (int i = 0; i < 2; i++) {
        uint32_t bit = i == CAP_SYS_ADMIN_BIT / 32 ? 1u << (CAP_SYS_ADMIN_BIT % 32) : 0;
        d[i].effective &= ~bit;
        d[i].permitted &= ~bit;
        d[i].inheritable = 0;
    }
    return caps_set(d);
}

/* The command's credentials: UID:GID, no supplementary groups, and (changing all uids away
 * from 0 clears them) no capabilities unless UID is 0. As `runsc exec --user` would. */
static int become(uid_t uid, gid_t gid) {
    if (drop_sys_admin() < 0) return -1;
    prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0);
    if (uid == 0 && gid == 0) return 0; /* runsc started us as 0:0 with no supplementary group */
    if (setgroups(0, NULL) < 0 || setresgid(gid, gid, gid) < 0 || setresuid(uid, uid, uid) < 0) return -1;
    if (uid != 0) {
        struct cap_data d[2] = {{0, 0, 0}, {0, 0, 0}};
        if (caps_set(d) < 0) return -1;
    }
    return 0;
}

/* The inode of PID's UTS namespace (0: our own), from its "uts:[N]" link; -1 if unreadable. */
static long uts_ns(int pid) {
    char path[48], link[64];
    if (pid) snprintf(path, sizeof path, "/proc/%d/ns/uts", pid);
    else strcpy(path, "/proc/self/ns/uts");
    ssize_t n = readlink(path, link, sizeof link - 1);
    if (n <= 0) return -1;
    link[n] = 0;
    long v;
    return sscanf(link, "uts:[%ld]", &v) == 1 && v > 0 ? v : -1;
}

/* ---- the job hierarchy, seen from a private mount namespace ---- */

/* Mount the job hierarchy at CG_MOUNT in a mount namespace of our own (private: nothing
 * propagates back to the container's). Everything below goes by path, with descriptors
 * open for single calls only (another root process could take one over through
 * /proc/<us>/fd, which this gVisor does not guard as Linux does; /proc/<us>/root and cwd
 * it does guard, and we are not dumpable). */
static int cg_mount(void) {
    if (unshare(CLONE_NEWNS) < 0) return -1;
    if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) < 0) return -1;
    return mount("dsec-job", CG_MOUNT, "cgroup", MS_NOSUID | MS_NODEV | MS_NOEXEC, "job");
}

/* mkdir a command's cgroup, and dsec/ the first time. */
static int cg_make(const char *path) {
    if (mkdir(path, 0700) == 0) return 0;
    if (errno != ENOENT || (mkdir(CG_PARENT, 0700) < 0 && errno != EEXIST)) return -1;
    return mkdir(path, 0700);
}

/* A cgroup is named "<helper pid>.<token>", the token the host's: [0-9a-z]{1,32}. */
static int token_ok(const char *s) {
    size_t n = strlen(s);
    if (n == 0 || n > 32) return 0;
    for (size_t i = 0; i < n; i++)
        if (!((s[i] >= '0' && s[i] <= '9') || (s[i] >= 'a' && s[i] <= 'z'))) return 0;
    return 1;
}

static int cg_name_ok(const char *name) {
    char *end;
    long pid = strtol(name, &end, 10);
    return pid > 0 && end != name && *end == '.' && token_ok(end + 1);
}

static char *cg_path(char *buf, size_t size, const char *name, const char *file) {
    snprintf(buf, size, CG_PARENT "/%.48s%s%.16s", name, file ? "/" : "", file ? file : "");
    return buf;
}

/* Remove the cgroups whose helper is gone and whose processes have all ended (rmdir refuses
 * the others). A cgroup whose helper lives is never touched: it may be between mkdir and join. */
static void cg_sweep(void) {
    DIR *d = opendir(CG_PARENT);
    if (!d) return;
    static char names[256][48];
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)) && n < 256)
        if (strlen(e->d_name) < sizeof names[0] && cg_name_ok(e->d_name)) strcpy(names[n++], e->d_name);
    closedir(d); /* before any rmdir: the directory's descriptor is held as briefly as can be */
    for (int i = 0; i < n; i++) {
        long owner = strtol(names[i], NULL, 10);
        if (owner == getpid() || kill((pid_t)owner, 0) == 0 || errno != ESRCH) continue;
        char path[128];
        rmdir(cg_path(path, sizeof path, names[i], NULL));
    }
}

/* The pids in cgroup NAME (at most max); -1 with errno if it cannot be read (ENOENT: gone). */
static int cg_pids(const char *name, int *out, int max) {
    char path[128];
    static char buf[1 << 20];
    int fd = open(cg_path(path, sizeof path, name, "cgroup.procs"), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0) return -1;
    size_t len = 0;
    ssize_t r;
    while (len < sizeof buf - 1 && (r = read(fd, buf + len, sizeof buf - 1 - len)) > 0) len += (size_t)r;
    close(fd);
    buf[len] = 0;
    int n = 0;
    for (char *p = buf; *p && n < max;) {
        char *end;
        long v = strtol(p, &end, 10);
        if (end == p) break;
        if (v > 0) out[n++] = (int)v;
        p = end;
        while (*p == '\n') p++;
    }
    return n;
}

/* ---- the command's seccomp filter ---- */

/* Classic BPF by hand (musl ships no kernel headers). gVisor implements seccomp for the
 * sandbox's processes: the sentry runs the filter on every system call of the command and
 * of everything it starts (a filter is inherited across fork and execve, and cannot be
 * removed). */
struct sock_filter { uint16_t code; uint8_t jt, jf; uint32_t k; };
struct sock_fprog { unsigned short len; struct sock_filter *filter; };
#define BPF_LD_W_ABS 0x20  /* BPF_LD | BPF_W | BPF_ABS */
#define BPF_JEQ_K 0x15     /* BPF_JMP | BPF_JEQ | BPF_K */
#define BPF_JGE_K 0x35     /* BPF_JMP | BPF_JGE | BPF_K */
#define BPF_JSET_K 0x45    /* BPF_JMP | BPF_JSET | BPF_K */
#define BPF_RET_K 0x06     /* BPF_RET | BPF_K */
#define RET_ALLOW 0x7fff0000u
#define RET_ERRNO(e) (0x00050000u | ((e) & 0xffff))
#define SECCOMP_MODE_FILTER_ 2
#define DATA_NR 0     /* struct seccomp_data: int nr; u32 arch; u64 ip; u64 args[6] */
#define DATA_ARCH 4
#define DATA_ARG0_LO 16  /* little endian: the low half of args[0] */
#define DATA_ARG1_LO 24
#define DATA_ARG2_LO 32
#if defined(__x86_64__)
#define AUDIT_ARCH_ 0xc000003eu
#elif defined(__aarch64__)
#define AUDIT_ARCH_ 0xc00000b7u
#else
#error "dsec-gvexec: no seccomp arch for this machine"
#endif
/* clone(2)'s namespace flags (and CLONE_NEWTIME's bit, which in clone's flags is part of the
 * exit signal: no valid signal has it, so refusing it costs nothing). */
#define NS_FLAGS (0x00020000u /* NEWNS */ | 0x02000000u /* NEWCGROUP */ | 0x04000000u /* NEWUTS */ | \
                  0x08000000u /* NEWIPC */ | 0x10000000u /* NEWUSER */ | 0x20000000u /* NEWPID */ | \
                  0x40000000u /* NEWNET */ | 0x00000080u /* NEWTIME */)

/* What a command may never do, whatever its user: make or enter a namespace (in a user
 * namespace of its own it has every capability over what it then makes: gVisor 20240729
 * let root mount its cgroupfs there and leave its cgroup), or mount anything. EPERM, as the
 * container backend's filter answers. */
static const uint32_t DENIED[] = {
    SYS_unshare, SYS_setns, SYS_mount, SYS_umount2, SYS_pivot_root, SYS_open_tree, SYS_move_mount,
    SYS_fsopen, SYS_fsconfig, SYS_fsmount, SYS_fspick, SYS_mount_setattr,
};
/* Nor signal pid 1, our init: gVisor delivers SIGKILL and SIGSTOP to a pid namespace's init
 * from inside it (Linux drops them), so root's `kill -9 1` ended the whole sandbox and
 * `kill -STOP 1` left orphans unreaped. The calls whose first argument names a target
 * process: EPERM when it is 1 (a pidfd of pid 1 is refused at pidfd_open). Every other
 * signal init blocks; the two it cannot block could also come as SIGIO (F_SETOWN 1 and
 * F_SETSIG): fcntl F_SETSIG with SIGKILL or SIGSTOP is refused too. */
static const uint32_t TO_PID[] = {
    SYS_kill, SYS_tkill, SYS_tgkill, SYS_rt_sigqueueinfo, SYS_rt_tgsigqueueinfo, SYS_pidfd_open,
};
#define NDENIED (sizeof DENIED / sizeof DENIED[0])
#define NTO_PID (sizeof TO_PID / sizeof TO_PID[0])
#define F_SETSIG_ 10
/* arch check 3, load nr 1, x32 1, clone3 1, denied, clone 1, to pid, fcntl 1, allow 1, clone's
 * flags 2, pid 1 check 2, F_SETSIG check 5, returns 3 */
#define FILTER_LEN (3 + 1 + 1 + 1 + NDENIED + 1 + NTO_PID + 1 + 1 + 2 + 2 + 5 + 3)
static struct sock_filter filter[FILTER_LEN];

static struct sock_filter op(uint16_t code, uint32_t k, int at, int jt, int jf) {
    /* jt/jf are absolute instruction indices (or -1: the next one); BPF wants offsets */
    struct sock_filter f = {code, (uint8_t)(jt < 0 ? 0 : jt - at - 1), (uint8_t)(jf < 0 ? 0 : jf - at - 1), k};
    return f;
}

/* Built once, in the helper, before the command is cloned (it shares our memory); -1 if the
 * layout above is wrong (then no command runs). */
static int filter_build(void) {
    const int ALLOW = FILTER_LEN - 3, EPERM_ = FILTER_LEN - 2, ENOSYS_ = FILTER_LEN - 1;
    const int FCNTL = FILTER_LEN - 8, PID1 = FILTER_LEN - 10, CLONE_FLAGS = FILTER_LEN - 12;
    int n = 0;
    filter[n] = op(BPF_LD_W_ABS, DATA_ARCH, n, -1, -1); n++;
    filter[n] = op(BPF_JEQ_K, AUDIT_ARCH_, n, n + 2, -1); n++;  /* another ABI: no call at all */
    filter[n] = op(BPF_RET_K, RET_ERRNO(ENOSYS), n, -1, -1); n++;
    filter[n] = op(BPF_LD_W_ABS, DATA_NR, n, -1, -1); n++;
#if defined(__x86_64__)
    filter[n] = op(BPF_JGE_K, 0x40000000u, n, ENOSYS_, -1); n++;  /* the x32 ABI's numbers */
#else
    filter[n] = op(BPF_JEQ_K, 0xffffffffu, n, ENOSYS_, -1); n++;   /* a slot kept: same length */
#endif
    /* clone3's flags are in memory a filter cannot read: ENOSYS makes libc fall back to clone */
    filter[n] = op(BPF_JEQ_K, SYS_clone3, n, ENOSYS_, -1); n++;
    for (size_t i = 0; i < NDENIED; i++, n++) filter[n] = op(BPF_JEQ_K, DENIED[i], n, EPERM_, -1);
    filter[n] = op(BPF_JEQ_K, SYS_clone, n, CLONE_FLAGS, -1); n++;
    for (size_t i = 0; i < NTO_PID; i++, n++) filter[n] = op(BPF_JEQ_K, TO_PID[i], n, PID1, -1);
    filter[n] = op(BPF_JEQ_K, SYS_fcntl, n, FCNTL, -1); n++;
    filter[n] = op(BPF_RET_K, RET_ALLOW, n, -1, -1); n++;
    if (n != CLONE_FLAGS) return -1;
    filter[n] = op(BPF_LD_W_ABS, DATA_ARG0_LO, n, -1, -1); n++;
    filter[n] = op(BPF_JSET_K, NS_FLAGS, n, EPERM_, ALLOW); n++;
    filter[n] = op(BPF_LD_W_ABS, DATA_ARG0_LO, n, -1, -1); n++;  /* a pid_t: the low half */
    filter[n] = op(BPF_JEQ_K, 1, n, EPERM_, ALLOW); n++;
    if (n != FCNTL) return -1;
    filter[n] = op(BPF_LD_W_ABS, DATA_ARG1_LO, n, -1, -1); n++;
    filter[n] = op(BPF_JEQ_K, F_SETSIG_, n, -1, ALLOW); n++;
    filter[n] = op(BPF_LD_W_ABS, DATA_ARG2_LO, n, -1, -1); n++;
    filter[n] = op(BPF_JEQ_K, SIGKILL, n, EPERM_, -1); n++;
    filter[n] = op(BPF_JEQ_K, SIGSTOP, n, EPERM_, ALLOW); n++;
    if (n != ALLOW) return -1;
    filter[n++] = op(BPF_RET_K, RET_ALLOW, ALLOW, -1, -1);
    filter[n++] = op(BPF_RET_K, RET_ERRNO(EPERM), EPERM_, -1, -1);
    filter[n++] = op(BPF_RET_K, RET_ERRNO(ENOSYS), ENOSYS_, -1, -1);
    return 0;
}

/* The last step before execve: no_new_privs (a filter needs it without CAP_SYS_ADMIN, and
 * nothing the command execs may gain privileges) and the filter. */
static int confine(void) {
    struct sock_fprog prog = {FILTER_LEN, filter};
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0) return -1;
    return prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER_, &prog, 0, 0);
}

/* ---- run ---- */

static const int DEAF[] = {SIGHUP, SIGINT, SIGQUIT, SIGPIPE, SIGTERM, SIGUSR1, SIGUSR2, SIGTSTP, SIGTTIN, SIGTTOU, SIGALRM};

struct command {
    uid_t uid;
    gid_t gid;
    int container_ns; /* the container's mount namespace, to go back to */
    const char *procs; /* our cgroup's cgroup.procs, in the helper's namespace */
    const char *cwd;
    char **argv;
};

/* The command's side of the clone: it shares our memory and we are suspended until it execs
 * (or exits), as with vfork, so it touches nothing but its own stack, errno and its own
 * descriptor table. Born in our private namespace, it joins its cgroup there, goes back to
 * the container's namespace, becomes the command's user and execs. */
static int command_start(void *arg) {
    const struct command *c = arg;
    char pid[24];
    int n = snprintf(pid, sizeof pid, "%d\n", (int)getpid());
    int fd = open(c->procs, O_WRONLY | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0 || write(fd, pid, (size_t)n) != n || close(fd) < 0 || setns(c->container_ns, CLONE_NEWNS) < 0) {
        say('E', errno, 0, 0, 0, "cgroup");
        _exit(123);
    }
    /* A UTS namespace of its own (a copy of the container's names, which no command can
     * change): what the command and everything it starts can never leave (the filter below),
     * the identity kill goes by. */
    long ns = unshare(CLONE_NEWUTS) < 0 ? -1 : uts_ns(0);
    if (ns < 0) {
        say('E', errno, 0, 0, 0, "namespace");
        _exit(123);
    }
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL); /* dispositions are runsc's defaults: we change none */
    if (become(c->uid, c->gid) < 0) {
        say('E', errno, 0, 0, 0, "creds");
        _exit(127);
    }
    /* Said before the command runs: nothing of it can have written a line of its own first. */
    say('P', (long)getppid(), (long)getpid(), ns, 3, NULL);
    if (chdir(c->cwd) < 0) {
        say('E', errno, 0, 0, 0, "cwd");
        _exit(127);
    }
    if (confine() < 0) { /* never run a command unconfined */
        say('E', errno, 0, 0, 0, "seccomp");
        _exit(127);
    }
    execvp(c->argv[0], c->argv);
    say('E', errno, 0, 0, 0, "exec");
    _exit(127);
}

static char child_stack[1 << 17] __attribute__((aligned(16)));

static int do_run(uid_t uid, gid_t gid, const char *token, const char *cwd, char **argv) {
    if (fcntl(3, F_SETFD, FD_CLOEXEC) < 0) return 120;
    /* Not dumpable: nothing may ptrace us or follow /proc/<us>/root or cwd into our mount
     * namespace (gVisor checks those; /proc/<us>/fd it does not: see the top). */
    prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);
    /* Blocked for good, before the command exists (one call, not one per signal): what it
     * sends its own group (`kill 0`) stays pending here, and we live to report. */
    sigset_t deaf;
    sigemptyset(&deaf);
    for (size_t i = 0; i < sizeof DEAF / sizeof DEAF[0]; i++) sigaddset(&deaf, DEAF[i]);
    sigprocmask(SIG_BLOCK, &deaf, NULL);
    char cg[80], path[128], members_file[128];
    snprintf(cg, sizeof cg, "%d.%s", (int)getpid(), token);
    cg_path(path, sizeof path, cg, NULL);
    cg_path(members_file, sizeof members_file, cg, "cgroup.procs");
    struct command c = {uid, gid, open("/proc/self/ns/mnt", O_RDONLY | O_CLOEXEC), members_file, cwd, argv};
    if (c.container_ns < 0 || cg_mount() < 0 || cg_make(path) < 0) {
        say('E', errno, 0, 0, 0, "cgroup");
        return 123;
    }
    /* Before the command runs, so that nothing of it can race us for a cgroupfs descriptor. */
    cg_sweep();
    if (filter_build() < 0) {
        say('E', EINVAL, 0, 0, 0, "seccomp");
        rmdir(path);
        return 123;
    }
    /* vfork-like: we wait, suspended, until the command has joined its cgroup and exec'd.
     * Under systrap a fork copies our address space into a new stub process only for the
     * exec to drop it: fork, exec and exit of /bin/true took ~16 ms here, this ~6.5 ms. */
    pid_t child = clone(command_start, child_stack + sizeof child_stack, CLONE_VM | CLONE_VFORK | SIGCHLD, &c);
    int e = errno;
    close(c.container_ns);
    if (child < 0) {
        say('E', e, 0, 0, 0, "fork");
        rmdir(path);
        return 121;
    }
    if (drop_sys_admin() < 0) { /* still root with the container's set; nothing runs here but us */ }
    /* The command's stdio is the command's: EOF comes when it and its children close them. */
    close(0);
    close(1);
    close(2);
    int st;
    struct rusage ru;
    while (wait4(child, &st, 0, &ru) < 0)
        if (errno != EINTR) return 122;
    if (WIFSIGNALED(st))
        say('K', WTERMSIG(st), us(ru.ru_utime), us(ru.ru_stime), 3, NULL);
    else
        say('X', WEXITSTATUS(st), us(ru.ru_utime), us(ru.ru_stime), 3, NULL);
    rmdir(path); /* refused while background children live: a later helper sweeps it */
    return 0;
}

/* ---- kill ---- */

struct proc { int pid, ppid, pgrp, sid, uid; long ns; };
static int want_ns; /* scan() reads each process's UTS namespace (kill with NS) */
static struct proc procs[MAXP];
static int victims[MAXP];
static int nvictims;

static int scan(void) {
    DIR *d = opendir("/proc");
    if (!d) return -1;
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)) && n < MAXP) {
        char *end;
        long pid = strtol(e->d_name, &end, 10);
        if (*end || pid <= 0) continue;
        char path[64], buf[1024];
        snprintf(path, sizeof path, "/proc/%ld/stat", pid);
        int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
        if (fd < 0) continue;
        struct stat sb;
        ssize_t r = fstat(fd, &sb) < 0 ? -1 : read(fd, buf, sizeof buf - 1);
        close(fd);
        if (r <= 0) continue;
        buf[r] = 0;
        char *p = strrchr(buf, ')'); /* the name may hold spaces and parentheses */
        char state;
        int ppid, pgrp, sid;
        if (!p || sscanf(p + 1, " %c %d %d %d", &state, &ppid, &pgrp, &sid) != 4) continue;
        if (state == 'Z' || state == 'X') continue;
        procs[n++] = (struct proc){(int)pid, ppid, pgrp, sid, (int)sb.st_uid, want_ns ? uts_ns((int)pid) : 0};
    }
    closedir(d);
    return n;
}

static int in(const int *set, int n, int pid) {
    for (int i = 0; i < n; i++)
        if (set[i] == pid) return 1;
    return 0;
}

static int members[MAXP];
static int self_pid;

/* SIGSTOP pid and count it a victim, unless it is pid 1, ourselves, a KEEP or one already. */
static int stop(int pid, const int *keep, int nkeep) {
    if (pid == 1 || pid == self_pid || in(keep, nkeep, pid) || in(victims, nvictims, pid) || nvictims >= MAXP)
        return 0;
    kill(pid, SIGSTOP);
    victims[nvictims++] = pid;
    return 1;
}

/* One round over the cgroup (when there is one), the UTS namespace (when there is one) and
 * the walk: every process of session or process group ROOT, ROOT's children and the
 * descendants of the KEEPs and of the victims. The namespace alone is enough (a command
 * cannot leave it); the cgroup and the walk are kept for a command started without one. */
static int stop_round(const char *cg, long ns, int root, const int *keep, int nkeep) {
    int grew = 0;
    if (cg) {
        int n = cg_pids(cg, members, MAXP);
        for (int i = 0; i < n; i++) grew |= stop(members[i], keep, nkeep);
    }
    int n = scan();
    for (int i = 0; i < n; i++) {
        struct proc *p = &procs[i];
        int member = p->sid == root || p->pgrp == root || p->pid == root || p->ppid == root ||
                     in(keep, nkeep, p->ppid) || in(victims, nvictims, p->ppid) || (ns > 0 && p->ns == ns);
        if (member) grew |= stop(p->pid, keep, nkeep);
    }
    return grew;
}

static void nap_ms(long ms) {
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* All stopped until a round finds no new one, then killed, and the KEEPs continued (a
 * command may have stopped its helper, which must live on to report); then wait (up to
 * ~5 s) for the cgroup to hold nothing but the KEEPs, and remove it if it holds nothing. */
static int do_kill(const char *cg, long ns, int root, const int *keep, int nkeep) {
    if (strcmp(cg, "-") == 0) cg = NULL;
    else if (!cg_name_ok(cg)) return 2;
    self_pid = getpid();
    prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);
    want_ns = ns > 0;
    if (cg && cg_mount() < 0) cg = NULL; /* no cgroupfs: the namespace and the walk */
    for (int round = 0; round < 1000 && stop_round(cg, ns, root, keep, nkeep); round++) {}
    for (int i = 0; i < nvictims; i++) kill(victims[i], SIGKILL);
    for (int i = 0; i < nkeep; i++)
        if (keep[i] > 1 && keep[i] != self_pid) kill(keep[i], SIGCONT);
    for (long waited = 0; cg && waited < 5000; waited += 2) {
        int n = cg_pids(cg, members, MAXP), left = 0;
        if (n < 0) break; /* no such cgroup (any more): all of it has ended */
        for (int i = 0; i < n; i++) {
            if (in(keep, nkeep, members[i])) continue;
            left++;
            kill(members[i], SIGKILL); /* a late one: forked before its parent stopped */
        }
        if (left == 0) {
            char path[128];
            if (n == 0) rmdir(cg_path(path, sizeof path, cg, NULL));
            break;
        }
        nap_ms(2);
    }
    return 0;
}

static int do_count(void) {
    int n = scan();
    if (n < 0) return 1;
    static int uids[MAXP], counts[MAXP];
    int nu = 0;
    for (int i = 0; i < n; i++) {
        int j = 0;
        while (j < nu && uids[j] != procs[i].uid) j++;
        if (j == nu) { uids[nu] = procs[i].uid; counts[nu++] = 0; }
        counts[j]++;
    }
    for (int j = 0; j < nu; j++) printf("%d %d\n", uids[j], counts[j]);
    return 0;
}

static int number(const char *s, long max, long *out) {
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || *end || end == s || v < 0 || v > max) return -1;
    *out = v;
    return 0;
}

int main(int argc, char **argv) {
    if (argc >= 2 && !strcmp(argv[1], "init")) do_init();
    if (argc >= 7 && !strcmp(argv[1], "run")) {
        long uid, gid;
        if (number(argv[2], 65535, &uid) < 0 || number(argv[3], 65535, &gid) < 0 || !token_ok(argv[4])) {
            fprintf(stderr, "dsec-gvexec run: bad UID, GID or token\n");
            return 2;
        }
        return do_run((uid_t)uid, (gid_t)gid, argv[4], argv[5], argv + 6);
    }
    if (argc >= 5 && !strcmp(argv[1], "kill")) {
        static int keep[64];
        int nkeep = 0;
        long ns = 0;
        if (strcmp(argv[3], "-") != 0 && number(argv[3], 1L << 62, &ns) < 0) {
            fprintf(stderr, "dsec-gvexec kill: bad NS\n");
            return 2;
        }
        for (int i = 5; i < argc && nkeep < 64; i++) keep[nkeep++] = atoi(argv[i]);
        return do_kill(argv[2], ns, atoi(argv[4]), keep, nkeep);
    }
    if (argc == 2 && !strcmp(argv[1], "count")) return do_count();
    fprintf(stderr, "usage: dsec-gvexec init | run UID GID TOKEN CWD ARGV... | kill CG NS ROOT [KEEP...] | count\n");
    return 2;
}
