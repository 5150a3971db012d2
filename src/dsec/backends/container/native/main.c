/*
 * The spawner's event loop: requests from the runtime, report pipes of children
 * being set up, and reaping exec children ("exit" events).  Never waits on one
 * sandbox: slow steps report back through pipes that poll() watches.
 */
#include "spawner.h"

int inherited_ign[64], n_inherited_ign; /* signals ignored when we started (main) */
int init_bin_fd = -1; /* the static dsec-init beside this binary (-1: keep forks as inits) */

/* DSEC_SPAWNER_TRACE=1 prints per-step timings of sandbox creation to stderr (profiling aid). */
int trace_on;
struct timespec trace_t0;
void trace(const char *what) {
    if (!trace_on) return;
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    fprintf(stderr, "dsec-trace %-12s %7.1f us\n", what,
            (t.tv_sec - trace_t0.tv_sec) * 1e6 + (t.tv_nsec - trace_t0.tv_nsec) / 1e3);
}

int self_pidns_fd = -1;

/* ---------- pending work watched by the poll loop ---------- */

struct pending pend[MAX_PENDING];
int npend;

int add_pending(int fd, int kind, pid_t pid, int pidfd, const char *rid) {
    if (npend >= MAX_PENDING) return -1;
    pend[npend].fd = fd;
    pend[npend].kind = kind;
    pend[npend].pid = pid;
    pend[npend].pidfd = pidfd;
    snprintf(pend[npend].rid, sizeof pend[npend].rid, "%s", rid);
    npend++;
    return 0;
}

pid_t clone_pidfd(unsigned long flags, int *pidfd) {
    return (pid_t)syscall(SYS_clone, flags | CLONE_PIDFD | SIGCHLD, NULL, pidfd, NULL, NULL);
}

/* Wait until a killed child has exited.  An exec child is ours: reap it.  A sandbox init
 * is the runtime's child (CLONE_PARENT): wait for its pidfd, the runtime reaps it (the
 * error reply carries its pid). */
static void wait_gone(struct pending *p) {
    if (p->kind != P_CREATE) {
        waitpid(p->pid, NULL, 0);
        return;
    }
    struct pollfd q = {.fd = p->pidfd, .events = POLLIN};
    while (poll(&q, 1, 10000) < 0 && errno == EINTR) {
    }
}

/* A report pipe became readable: the child either failed ("stage\0errno\0msg"), said "ok", or exec'd (EOF). */
static void finish_pending(int i) {
    struct pending p = pend[i];
    pend[i] = pend[--npend];
    char buf[1300];
    ssize_t n;
    do n = read(p.fd, buf, sizeof buf - 1); while (n < 0 && errno == EINTR);
    close(p.fd);
    if (n < 0) n = 0;
    buf[n] = 0;
    int success = (p.kind == P_EXEC && n == 0) || (p.kind == P_CREATE && n == 3 && strcmp(buf, "ok") == 0);
    if (success) {
        trace("reply");
        reply_ok_pid(p.rid, p.pid, p.pidfd);
    } else if (n == 0) {
        kill(p.pid, SIGKILL);
        wait_gone(&p); /* gone before the caller hears of it */
        reply_err_pid(p.rid, "died", ECHILD, p.kind == P_CREATE ? p.pid : 0, "child exited before it was ready");
    } else {
        const char *stage = buf;
        const char *err = stage + strlen(stage) + 1;
        const char *msg = (err < buf + n) ? err + strlen(err) + 1 : "";
        if (err >= buf + n) err = "0";
        if (msg >= buf + n) msg = "";
        char e[16];
        snprintf(e, sizeof e, "%s", err);
        /* The failed child exits at once: reap it first, so that when the caller
         * hears of the failure nothing of the attempt is left in the sandbox. */
        kill(p.pid, SIGKILL);
        wait_gone(&p);
        char pid_s[16];
        snprintf(pid_s, sizeof pid_s, "%d", p.kind == P_CREATE ? (int)p.pid : 0);
        const char *t[] = {"err", p.rid, stage, e, msg, pid_s};
        send_tokens(t, 6, -1);
    }
    close(p.pidfd);
}

static void reap(void) {
    for (;;) {
        int st;
        struct rusage ru;
        pid_t pid = wait4(-1, &st, WNOHANG, &ru);
        if (pid <= 0) return;
        char a[16], b[16], c[24], d[24], e[24];
        snprintf(a, sizeof a, "%d", (int)pid);
        snprintf(b, sizeof b, "%d", st);
        snprintf(c, sizeof c, "%lld", (long long)ru.ru_utime.tv_sec * 1000000 + ru.ru_utime.tv_usec);
        snprintf(d, sizeof d, "%lld", (long long)ru.ru_stime.tv_sec * 1000000 + ru.ru_stime.tv_usec);
        snprintf(e, sizeof e, "%ld", ru.ru_maxrss);
        const char *t[] = {"exit", a, b, c, d, e};
        send_tokens(t, 6, -1);
    }
}

int main(int argc, char **argv) {
    if (argc == 2 && strcmp(argv[1], "--parse") == 0) return parse_only_main();
    if (argc < 2) {
        fprintf(stderr, "usage: dsec-spawner SOCKET_FD [NETNS_POOL]  (started by the DSec runtime)\n");
        return 2;
    }
    sock_fd = atoi(argv[1]);
    trace_on = getenv("DSEC_SPAWNER_TRACE") != NULL;
    prctl(PR_SET_NAME, "dsec-spawner", 0, 0, 0);
    if (build_seccomp() < 0) {
        fprintf(stderr, "dsec-spawner: cannot build seccomp filter\n");
        return 1;
    }
    self_pidns_fd = open("/proc/self/ns/pid", O_RDONLY | O_CLOEXEC);
    if (self_pidns_fd < 0) { perror("dsec-spawner: open own pid namespace"); return 1; }
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0) { rl.rlim_cur = rl.rlim_max; setrlimit(RLIMIT_NOFILE, &rl); }
    /* Signals the runtime's own parent left ignored (a `cmd &` from a script ignores SIGINT
     * and SIGQUIT; nohup SIGHUP) stay ignored across execve: commands in sandboxes must
     * not inherit them (^C would not stop a command on a terminal).  Noted once here,
     * reset in each exec child. */
    for (int sig = 1; sig < 65; sig++) {
        struct sigaction sa;
        if (sig != SIGKILL && sig != SIGSTOP && sigaction(sig, NULL, &sa) == 0 && sa.sa_handler == SIG_IGN &&
            n_inherited_ign < (int)(sizeof inherited_ign / sizeof inherited_ign[0]))
            inherited_ign[n_inherited_ign++] = sig;
    }
    signal(SIGPIPE, SIG_IGN);
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGCHLD);
    sigprocmask(SIG_BLOCK, &set, NULL);
    int sfd = signalfd(-1, &set, SFD_CLOEXEC | SFD_NONBLOCK);
    {
        int target = argc > 2 ? atoi(argv[2]) : 0;
        netpool_start(target > 1024 ? 1024 : target);
    }
    userns_keeper_start();
    {
        char exe[4096];
        ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 16);
        if (n > 0) {
            exe[n] = 0;
            char *slash = strrchr(exe, '/');
            if (slash) {
                strcpy(slash + 1, "dsec-init");
                init_bin_fd = open(exe, O_RDONLY | O_CLOEXEC);
            }
        }
    }
    char *buf = malloc(MAX_MSG);
    static struct pollfd pfds[MAX_PENDING + 2];
    struct req *r = malloc(sizeof *r);
    if (!buf || !r || sfd < 0) return 1;
    for (;;) {
        pfds[0].fd = sock_fd;
        pfds[0].events = POLLIN;
        pfds[1].fd = sfd;
        pfds[1].events = POLLIN;
        for (int i = 0; i < npend; i++) {
            pfds[i + 2].fd = pend[i].fd;
            pfds[i + 2].events = POLLIN;
        }
        int n = poll(pfds, (nfds_t)npend + 2, -1);
        if (n < 0) {
            if (errno == EINTR) continue;
            return 1;
        }
        /* Report pipes first, so "ok" for an exec precedes its "exit" event. */
        for (int i = npend - 1; i >= 0; i--)
            if (pfds[i + 2].revents) finish_pending(i);
        if (pfds[1].revents) {
            struct signalfd_siginfo si;
            while (read(sfd, &si, sizeof si) == sizeof si) {
            }
            reap();
        }
        if (pfds[0].revents & POLLIN) {
            int rc = recv_req(r, buf);
            if (rc == 0) { netpool_stop(); userns_keeper_stop(); return 0; } /* the runtime went away: sandboxes live on */
            if (rc < 0) continue;
            struct parse_err pe;
            switch (req_op(r, &pe)) {
            case OP_NONE: break;
            case OP_BAD: reply_err(r->tok[1], pe.stage, pe.err, "%s", pe.msg); break;
            case OP_CREATE: do_create(r); break;
            case OP_EXEC: do_exec(r); break;
            case OP_PING: {
                const char *t[] = {"ok", r->tok[1]};
                send_tokens(t, 2, -1);
                break;
            }
            }
            for (int i = 0; i < r->nfds; i++) close(r->fds[i]);
        } else if (pfds[0].revents & (POLLHUP | POLLERR)) {
            netpool_stop();
            userns_keeper_stop();
            return 0;
        }
    }
}
