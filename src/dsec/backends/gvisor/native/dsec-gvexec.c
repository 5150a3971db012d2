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
 *                        (a vfork-like clone) in a cgroup of its own, "<own pid>.TOKEN"
 *                        (below), as UID:GID (no supplementary groups) with the capabilities
 *                        runsc would have given that user, in CWD. Writes one line per event:
 *                          "P <own pid> <command pid>"          started
 *                          "E <errno> <stage>"                  could not start (fork, cgroup,
 *                                                               creds, cwd, exec)
 *                          "X <code> <utime us> <stime us>"      exited
 *                          "K <signal> <utime us> <stime us>"    killed by a signal
 *                        It blocks the catchable signals a command may send its own group
 *                        (`kill 0`), so it lives to report; it leads the command's session;
 *                        it removes the cgroup once the command has ended, if nothing of it
 *                        is left (else a later helper does, once the rest has ended).
 *   kill CG ROOT [KEEP...]
 *                        SIGKILL, except the KEEPs, pid 1 and itself, every process of cgroup
 *                        CG and, as well, every process of session or process group ROOT and
 *                        every descendant of ROOT, of a KEEP or of one of those. All are stopped
 *                        first (SIGSTOP) and both read again until no new one appears, so
 *                        nothing forks its way out; then it waits until CG holds nothing but
 *                        the KEEPs and removes it if empty. Runs as root with CAP_SYS_ADMIN
 *                        too. CG "-" (or no cgroupfs): the walk alone. (A command:
 *                        `kill CG H H`; a session's command, the shell S living on:
 *                        `kill CG H H S`.)
 *   count                One line "<uid> <processes>" per user: how close each is to
 *                        RLIMIT_NPROC (the sandbox's pids limit) after a failed fork.
 *
 * Per-command cgroups. gVisor's sentry implements cgroupfs; its "job" hierarchy (gVisor's
 * own controller: an id, no accounting) always exists, held by the sentry. A command's
 * processes all stay in dsec/<cgroup> of that hierarchy whatever they do (setsid, double
 * forks, orphans): leaving takes a write to a cgroupfs file, and a command has no cgroupfs
 * mounted and cannot mount one (no CAP_SYS_ADMIN, root's commands neither). The helper
 * mounts the hierarchy only in a private mount namespace of its own; the command, born
 * there, joins its cgroup, goes back to the container's namespace (setns) and gives up
 * CAP_SYS_ADMIN before it execs. The helper drops CAP_SYS_ADMIN too and is not dumpable
 * (gVisor then refuses /proc/<helper>/root and cwd to others).
 *
 * The one way out, for root only: gVisor (20240729) lets a process follow another one's
 * /proc/<pid>/fd links without the ptrace check Linux makes, so while a helper holds a
 * cgroupfs file open, a root process (CAP_DAC_OVERRIDE; the files are root's, 0644) that
 * races for it can reopen it and move itself (measured: a root process spinning on /proc
 * did within a few starts of other commands). Hence: cgroupfs is held open only for the
 * few calls that need it, and never while the helper's own command runs (a command needs
 * another command's helper to race), and kill also walks the session, group and
 * descendants, which such a process escapes only if it also left its session and was
 * orphaned.
 *
 * Must never: write to fd 3 in "kill" modes, follow symlinks outside /proc, block on
 * anything but wait(2) (and kill's bounded wait for its victims to go), hold cgroupfs open
 * while its command runs, or exec a command that holds CAP_SYS_ADMIN or sees cgroupfs.
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
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL); /* dispositions are runsc's defaults: we change none */
    if (become(c->uid, c->gid) < 0) {
        say('E', errno, 0, 0, 0, "creds");
        _exit(127);
    }
    /* Said before the command runs: nothing of it can have written a line of its own first. */
    say('P', (long)getppid(), (long)getpid(), 0, 2, NULL);
    if (chdir(c->cwd) < 0) {
        say('E', errno, 0, 0, 0, "cwd");
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

struct proc { int pid, ppid, pgrp, sid, uid; };
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
        procs[n++] = (struct proc){(int)pid, ppid, pgrp, sid, (int)sb.st_uid};
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

/* One round over the cgroup (when there is one) and the walk: every process of session or
 * process group ROOT, ROOT's children and the descendants of the KEEPs and of the victims.
 * The walk alone misses an orphan that left the session; the cgroup alone would miss a root
 * process that moved itself out (see the top): a command's process escapes only both. */
static int stop_round(const char *cg, int root, const int *keep, int nkeep) {
    int grew = 0;
    if (cg) {
        int n = cg_pids(cg, members, MAXP);
        for (int i = 0; i < n; i++) grew |= stop(members[i], keep, nkeep);
    }
    int n = scan();
    for (int i = 0; i < n; i++) {
        struct proc *p = &procs[i];
        int member = p->sid == root || p->pgrp == root || p->pid == root || p->ppid == root ||
                     in(keep, nkeep, p->ppid) || in(victims, nvictims, p->ppid);
        if (member) grew |= stop(p->pid, keep, nkeep);
    }
    return grew;
}

static void nap_ms(long ms) {
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* All stopped until a round finds no new one, then killed; then wait (up to ~5 s) for the
 * cgroup to hold nothing but the KEEPs, and remove it if it holds nothing. */
static int do_kill(const char *cg, int root, const int *keep, int nkeep) {
    if (strcmp(cg, "-") == 0) cg = NULL;
    else if (!cg_name_ok(cg)) return 2;
    self_pid = getpid();
    prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);
    if (cg && cg_mount() < 0) cg = NULL; /* no cgroupfs: the walk alone */
    for (int round = 0; round < 1000 && stop_round(cg, root, keep, nkeep); round++) {}
    for (int i = 0; i < nvictims; i++) kill(victims[i], SIGKILL);
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
    if (argc >= 4 && !strcmp(argv[1], "kill")) {
        static int keep[64];
        int nkeep = 0;
        for (int i = 4; i < argc && nkeep < 64; i++) keep[nkeep++] = atoi(argv[i]);
        return do_kill(argv[2], atoi(argv[3]), keep, nkeep);
    }
    if (argc == 2 && !strcmp(argv[1], "count")) return do_count();
    fprintf(stderr, "usage: dsec-gvexec init | run UID GID TOKEN CWD ARGV... | kill CG ROOT [KEEP...] | count\n");
    return 2;
}
