/*
 * create: the sandbox's init, a clone of the spawner in new pid, ipc, uts, cgroup,
 * network and mount namespaces, joined to its cgroups before it runs, entering its
 * user namespace last (or handing over to the static dsec-init).
 */
#include "spawner.h"

int write_file(const char *path, const char *data) {
    int fd = open(path, O_WRONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    ssize_t n = write(fd, data, strlen(data));
    int saved = errno;
    close(fd);
    errno = saved;
    return n == (ssize_t)strlen(data) ? 0 : -1;
}

int join_cgroups(char **cgs, pid_t pid) {
    char path[4096], val[32];
    snprintf(val, sizeof val, "%d", (int)pid);
    for (int i = 0; cgs[i]; i++) {
        snprintf(path, sizeof path, "%s/cgroup.procs", cgs[i]);
        if (write_file(path, val) < 0) return -1;
    }
    return 0;
}

static void init_loop(void) __attribute__((noreturn));
static void init_loop(void) {
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGCHLD);
    sigprocmask(SIG_BLOCK, &set, NULL);
    for (;;) {
        while (waitpid(-1, NULL, WNOHANG) > 0) {
        }
        siginfo_t si;
        sigwaitinfo(&set, &si);
    }
}

static void create_child(struct create_args *a) __attribute__((noreturn));
static void create_child(struct create_args *a) {
    int rfd = a->report_fd;
    char c;
    if (read(a->go_fd, &c, 1) != 1) _exit(126);
    close(a->go_fd);
    prctl(PR_SET_NAME, "dsec-init", 0, 0, 0);
    /* Joined the cgroups already (parent did): the cgroup namespace is rooted there. */
    trace("go");
    if (unshare(CLONE_NEWCGROUP) < 0) child_fail(rfd, "cgroupns", "unshare(CLONE_NEWCGROUP)");
    if (sethostname(a->id, strlen(a->id)) < 0) child_fail(rfd, "hostname", "sethostname");
    if (a->net_fd >= 0) {
        if (setns(a->net_fd, CLONE_NEWNET) < 0) child_fail(rfd, "network", "enter pooled netns");
        close(a->net_fd);
    } else if (unshare(CLONE_NEWNET) < 0 || lo_up() < 0) {
        child_fail(rfd, "network", "new netns with lo up");
    }
    trace("hostname+lo");
    int upper_fd = sandbox_root(a);
    if (init_bin_fd >= 0) {
        /* Hand over to the static dsec-init (see dsec-init.c for why an exec): fds 3-5 as it
         * expects them, everything else closed by the exec. */
        int devnull = open("dev/null", O_RDWR | O_CLOEXEC);
        int u = fcntl(upper_fd, F_DUPFD, 10), n = fcntl(a->userns_fd, F_DUPFD, 10), p = fcntl(rfd, F_DUPFD, 10);
        if (devnull < 0 || u < 0 || n < 0 || p < 0) child_fail(rfd, "init", "prepare fds");
        if (dup2(devnull, 0) < 0 || dup2(devnull, 1) < 0 || dup2(devnull, 2) < 0 || dup2(u, 3) < 0 ||
            dup2(n, 4) < 0 || dup2(p, 5) < 0)
            child_fail(p, "init", "place fds");
        syscall(SYS_close_range, 6, ~0U, CLOSE_RANGE_CLOEXEC);
        char *argv[] = {"dsec-init", NULL}, *envp[] = {NULL};
        syscall(SYS_execveat, init_bin_fd, "", argv, envp, AT_EMPTY_PATH);
        child_fail(p, "init", "exec dsec-init");
    }
    /* No dsec-init binary: this fork stays the init.  Become the sandbox's root: an
     * unprivileged host uid from here on. */
    if (setns(a->userns_fd, CLONE_NEWUSER) < 0) child_fail(rfd, "userns", "setns user");
    close(a->userns_fd);
    if (setgroups(0, NULL) < 0 || setresgid(0, 0, 0) < 0 || setresuid(0, 0, 0) < 0)
        child_fail(rfd, "userns", "switch to sandbox root");
    if (set_caps(0) < 0) child_fail(rfd, "caps", "drop capabilities");
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0) child_fail(rfd, "nnp", "no_new_privs");
    prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);

    trace("userns+caps");
    /* Keep only the upper's handle at fd 3 (the host reads it at /proc/PID/fd/3). */
    if (dup2(upper_fd, 3) < 0) child_fail(rfd, "mount", "dup upper");
    int devnull = open("/dev/null", O_RDWR);
    if (devnull >= 0) {
        dup2(devnull, 0);
        dup2(devnull, 1);
        dup2(devnull, 2);
    }
    if (write(rfd, "ok", 3) != 3) _exit(126);
    syscall(SYS_close_range, 4, ~0U, 0);
    init_loop();
}

/* What the init is given from the request (its fds are the caller's to fill in). */
void create_args_init(struct create_args *a, const struct create_req *c) {
    *a = (struct create_args){
        .id = c->id, .lowers = (char **)c->lowers, .cgs = (char **)c->cgs,
        .uid_base = strtoul(c->uid_base, NULL, 10), .disk = strtoull(c->disk, NULL, 10),
        .inodes = strtoull(c->inodes, NULL, 10), .upper = c->upper, .devskel = c->devskel, .empty = c->empty,
        .hidepid = c->hidepid != NULL, .userns_fd = -1, .go_fd = -1, .report_fd = -1, .net_fd = -1};
}

void do_create(struct req *r) {
    const char *rid = r->tok[1];
    struct create_req c;
    struct parse_err pe;
    if (parse_create(r, &c, &pe) < 0) {
        reply_err(rid, pe.stage, pe.err, "%s", pe.msg);
        return;
    }
    const char *stage = c.stage, *ub = c.uid_base, *uc = c.uid_count;
    clock_gettime(CLOCK_MONOTONIC, &trace_t0);
    trace("request");
    /* 1. The user namespace holding the sandbox's uid range. One per uid range,
     *    kept open and reused by the next sandbox of the same range: it owns no
     *    other namespace (those are created by the host), so nothing of the old
     *    sandbox survives in it, and making one costs ~0.5 ms on the hot path. */
    if (tmpl_fd < 0) {
        const char *what = "";
        tmpl_fd = tmpl_make(stage, &what);
        if (tmpl_fd < 0) { reply_err(rid, "template", errno, "%s (at %s)", what, stage); return; }
    }
    int userns_fd = userns_get(rid, ub, uc);
    if (userns_fd < 0) return;
    trace("userns");
    /* 2. The init: every namespace but user (entered last, so the host owns them all) and
     *    mount (the child enters a copy of the template's). */
    int go[2], rep[2];
    if (pipe2(go, O_CLOEXEC) < 0) { close(userns_fd); reply_err(rid, "clone", errno, "pipe"); return; }
    if (pipe2(rep, O_CLOEXEC) < 0) {
        close(userns_fd); close(go[0]); close(go[1]);
        reply_err(rid, "clone", errno, "pipe");
        return;
    }
    int pidfd = -1;
    /* A networked sandbox brings its prepared netns (veth, address, nftables) as the
     * request's one fd; others take a loopback-only one from the pool. */
    int net_fd = c.net_fd >= 0 ? fcntl(c.net_fd, F_DUPFD_CLOEXEC, 3) : netpool_take();
    /* CLONE_PARENT: the init is the runtime's child, not ours.  We reap exec children with
     * wait4(-1), which walks every child we have: with 10,000 inits among them, each exec's
     * exit cost O(sandboxes).  The runtime reaps an init through its pidfd on destroy. */
    pid_t pid = clone_pidfd(CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_PARENT, &pidfd);
    if (pid == 0) {
        close(go[1]);
        close(rep[0]);
        close(sock_fd);
        struct create_args a;
        create_args_init(&a, &c);
        a.userns_fd = userns_fd, a.go_fd = go[0], a.report_fd = rep[1], a.net_fd = net_fd;
        sigset_t none;
        sigemptyset(&none);
        sigprocmask(SIG_SETMASK, &none, NULL);
        create_child(&a);
    }
    close(userns_fd);
    if (net_fd >= 0) close(net_fd);
    close(go[0]);
    close(rep[1]);
    if (pid < 0) {
        close(go[1]); close(rep[0]);
        reply_err(rid, "clone", errno, "clone sandbox init");
        return;
    }
    if (join_cgroups(c.cgs, pid) < 0) {
        int e = errno;
        kill(pid, SIGKILL);
        close(go[1]); close(rep[0]); close(pidfd);
        reply_err(rid, "cgroup", e, "attach init to cgroups");
        return;
    }
    trace("clone+cgroup");
    if (write(go[1], "g", 1) != 1) { /* child died; the report pipe tells */ }
    close(go[1]);
    if (add_pending(rep[0], P_CREATE, pid, pidfd, rid) < 0) {
        kill(pid, SIGKILL);
        close(rep[0]); close(pidfd);
        reply_err(rid, "busy", EAGAIN, "too many operations in flight");
    }
}
