/*
 * dsec-gvexec: the in-sandbox half of the gVisor backend (dsec/backends/gvisor/).
 *
 * It runs inside the gVisor sandbox, never on the host: as the container's pid 1
 * (bind-mounted read-only at /dev/.dsec-gvexec), and for every command, loaded from a
 * host file descriptor (`runsc exec --exec-fd`), so the sandbox's filesystem holds no
 * copy of it. Static (musl), no allocation beyond a few fixed tables.
 *
 * Why it exists: `runsc exec` reports "128+n" for a command killed by signal n (as a
 * shell does: indistinguishable from `exit 128+n`), forwards no signal to the command
 * and cannot kill a process tree; and every process it starts shares one resource
 * limit set (a `ulimit` in one command would bind the next). Here:
 *
 *   init                 pid 1: reaps orphans, forever.
 *   run CWD ARGV...      fd 3 is the host's status pipe. Forks the command (in CWD, default
 *                        signal dispositions, fd 3 closed) and writes one line per event:
 *                          "P <own pid> <command pid>"          started
 *                          "E <errno> <stage>"                  could not start (fork, cwd, exec)
 *                          "X <code> <utime us> <stime us>"      exited
 *                          "K <signal> <utime us> <stime us>"    killed by a signal
 *                        It ignores the catchable signals a command may send its own group
 *                        (`kill 0`), so it lives to report; and it leads the command's session.
 *                        It is not a child subreaper: with this runsc, an orphan that exits
 *                        while its exec'd subreaper exits is taken for the namespace's init
 *                        and the whole sandbox is killed (measured), so a process that both
 *                        leaves the session (setsid) and is orphaned escapes a tree kill.
 *   kill ROOT [KEEP...]  SIGKILL every process of session or process group ROOT and every
 *                        descendant of ROOT or of a KEEP, except ROOT and the KEEPs themselves,
 *                        pid 1 and itself. All are stopped first (SIGSTOP), the scan repeated
 *                        until no new one appears, then killed: nothing forks its way out.
 *                        (A command: `kill H H`; a session's command, the shell S living on:
 *                        `kill H H S`; a whole session: `kill H` kills H too.)
 *   count                One line "<uid> <processes>" per user: how close each is to
 *                        RLIMIT_NPROC (the sandbox's pids limit) after a failed fork.
 *
 * Must never: write to fd 3 in "kill" modes, follow symlinks outside /proc, or block on
 * anything but wait(2).
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#define MAXP 65536

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

static const int IGNORED[] = {SIGHUP, SIGINT, SIGQUIT, SIGPIPE, SIGTERM, SIGUSR1, SIGUSR2, SIGTSTP, SIGTTIN, SIGTTOU, SIGALRM};

static int do_run(const char *cwd, char **argv) {
    if (fcntl(3, F_SETFD, FD_CLOEXEC) < 0) return 120;
    pid_t child = fork();
    if (child < 0) {
        say('E', errno, 0, 0, 0, "fork");
        return 121;
    }
    if (child == 0) {
        sigset_t none;
        sigemptyset(&none);
        sigprocmask(SIG_SETMASK, &none, NULL);
        for (int s = 1; s < NSIG; s++) signal(s, SIG_DFL);
        if (chdir(cwd) < 0) {
            say('E', errno, 0, 0, 0, "cwd");
            _exit(127);
        }
        execvp(argv[0], argv);
        say('E', errno, 0, 0, 0, "exec");
        _exit(127);
    }
    for (size_t i = 0; i < sizeof IGNORED / sizeof IGNORED[0]; i++) signal(IGNORED[i], SIG_IGN);
    /* The command's stdio is the command's: EOF comes when it and its children close them. */
    close(0);
    close(1);
    close(2);
    say('P', (long)getpid(), (long)child, 0, 2, NULL);
    int st;
    struct rusage ru;
    while (wait4(child, &st, 0, &ru) < 0)
        if (errno != EINTR) return 122;
    if (WIFSIGNALED(st))
        say('K', WTERMSIG(st), us(ru.ru_utime), us(ru.ru_stime), 3, NULL);
    else
        say('X', WEXITSTATUS(st), us(ru.ru_utime), us(ru.ru_stime), 3, NULL);
    return 0;
}

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

static int do_kill(int root, const int *keep, int nkeep) {
    int self = getpid();
    for (int round = 0; round < 1000; round++) {
        int n = scan(), grew = 0;
        if (n < 0) return 1;
        for (int i = 0; i < n; i++) {
            struct proc *p = &procs[i];
            if (p->pid == 1 || p->pid == self || in(keep, nkeep, p->pid) || in(victims, nvictims, p->pid)) continue;
            int member = p->sid == root || p->pgrp == root || p->pid == root || p->ppid == root ||
                         in(keep, nkeep, p->ppid) || in(victims, nvictims, p->ppid);
            if (!member || nvictims >= MAXP) continue;
            kill(p->pid, SIGSTOP);
            victims[nvictims++] = p->pid;
            grew = 1;
        }
        if (!grew) break;
    }
    for (int i = 0; i < nvictims; i++) kill(victims[i], SIGKILL);
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

int main(int argc, char **argv) {
    if (argc >= 2 && !strcmp(argv[1], "init")) do_init();
    if (argc >= 4 && !strcmp(argv[1], "run")) return do_run(argv[2], argv + 3);
    if (argc >= 3 && !strcmp(argv[1], "kill")) {
        static int keep[64];
        int nkeep = 0;
        for (int i = 3; i < argc && nkeep < 64; i++) keep[nkeep++] = atoi(argv[i]);
        return do_kill(atoi(argv[2]), keep, nkeep);
    }
    if (argc == 2 && !strcmp(argv[1], "count")) return do_count();
    fprintf(stderr, "usage: dsec-gvexec init | run CWD ARGV... | kill ROOT [KEEP...] | count\n");
    return 2;
}
