/*
 * exec: a child forked into the sandbox's pid namespace that enters the sandbox
 * from the host side (cgroups, namespaces, Landlock, ids, rlimits, a terminal,
 * capabilities, seccomp) and execs the command.
 */
#include "spawner.h"

#ifndef TIOCGPTPEER
#define TIOCGPTPEER 0x5441
#endif

/* The sandbox's devpts, mounted on the first terminal asked for (a superblock of its own,
 * so not at create: docs/PERFORMANCE.md): a new instance, its ptys in the sandbox's tty
 * group.  In the sandbox's mount namespace, as host root. */
static int devpts_ensure(const char *gid) {
    struct stat d, p;
    if (stat("/dev", &d) < 0 || stat("/dev/pts", &p) < 0) return -1;
    if (d.st_dev != p.st_dev) return 0; /* mounted already */
    char opts[96];
    snprintf(opts, sizeof opts, "newinstance,ptmxmode=0666,mode=0620,gid=%s", gid);
    return mount("devpts", "/dev/pts", "devpts", MS_NOSUID | MS_NOEXEC, opts);
}

/* As the command's user: a new pty on the sandbox's devpts; the slave becomes stdio and
 * the controlling terminal of a new session, the master goes back to the runtime over
 * the socket at fd sock (SCM_RIGHTS). */
static void tty_attach(struct exec_args *a, int rfd) {
    int m = open("/dev/pts/ptmx", O_RDWR | O_NOCTTY | O_CLOEXEC | O_NOFOLLOW);
    if (m < 0) child_fail(rfd, "tty", "open /dev/pts/ptmx");
    int unlock = 0;
    if (ioctl(m, TIOCSPTLCK, &unlock) < 0) child_fail(rfd, "tty", "unlock pty");
    struct winsize ws = {.ws_row = a->rows ? a->rows : 24, .ws_col = a->cols ? a->cols : 80};
    if (ioctl(m, TIOCSWINSZ, &ws) < 0) child_fail(rfd, "tty", "window size");
    int s = ioctl(m, TIOCGPTPEER, O_RDWR | O_NOCTTY);
    if (s < 0) child_fail(rfd, "tty", "open the pty's slave");
    if (setsid() < 0) child_fail(rfd, "tty", "setsid");
    if (ioctl(s, TIOCSCTTY, 0) < 0) child_fail(rfd, "tty", "make it the controlling terminal");
    if (send_msg_fd(a->in, "m", m) < 0) child_fail(rfd, "tty", "hand the master over");
    close(m);
    close(a->in);
    if (dup2(s, 0) < 0 || dup2(s, 1) < 0 || dup2(s, 2) < 0) child_fail(rfd, "stdio", "dup2");
    if (s > 2) close(s);
}

static void exec_child(struct exec_args *a) __attribute__((noreturn));
static void exec_child(struct exec_args *a) {
    int rfd = a->report_fd;
    trace("x-forked");
    if (join_cgroups(a->cgs, 0) < 0) child_fail(rfd, "cgroup", "join sandbox cgroups");
    trace("x-cgroups");
    if (a->pristine[0] || a->tty_gid) {
        /* User namespace last: the pristine mounts and the devpts belong to a mount namespace the host owns. */
        char up[64];
        snprintf(up, sizeof up, "/proc/%s/ns/user", a->init_pid ? a->init_pid : "0");
        int uns = open(up, O_RDONLY | O_CLOEXEC);
        if (uns < 0 || syscall(SYS_pidfd_send_signal, a->initpidfd, 0, NULL, 0) < 0)
            child_fail(rfd, "setns", "sandbox init is gone");
        int img = a->pristine[0] ? pristine_layers(a->plowers, uns, rfd) : -1;
        if (setns(a->initpidfd, CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWCGROUP) < 0)
            child_fail(rfd, "setns", "enter sandbox namespaces");
        if (a->tty_gid && devpts_ensure(a->tty_gid) < 0) child_fail(rfd, "tty", "mount the sandbox's devpts");
        if (img >= 0) {
            pristine_mount(img, a->pristine, rfd);
            close(img);
        }
        if (setns(uns, CLONE_NEWUSER) < 0) child_fail(rfd, "setns", "enter sandbox user namespace");
        close(uns);
    } else if (setns(a->initpidfd, CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS |
                                       CLONE_NEWCGROUP) < 0) {
        child_fail(rfd, "setns", "enter sandbox namespaces");
    }
    trace("x-setns");
    /* Walked now, in the sandbox's mount namespace, before the uid switch can hide a directory. */
    int ruleset = ll_build(a->ll_default, a->ll_rules, rfd);
    if (ruleset >= 0) trace("x-landlock-rules");
    if (setgroups(0, NULL) < 0) child_fail(rfd, "user", "setgroups");
    if (setresgid(a->gid, a->gid, a->gid) < 0) child_fail(rfd, "user", "gid %u is not mapped in the sandbox", a->gid);
    if (setresuid(a->uid, a->uid, a->uid) < 0) child_fail(rfd, "user", "uid %u is not mapped in the sandbox", a->uid);
    for (int i = 0; a->rlimits[i]; i++) {
        int res;
        unsigned long long soft, hard;
        if (rlimit_parse(a->rlimits[i], &res, &soft, &hard) < 0) child_fail(rfd, "rlimit", "bad rlimit");
        struct rlimit rl = {.rlim_cur = soft, .rlim_max = hard};
        if (setrlimit(res, &rl) < 0) child_fail(rfd, "rlimit", "setrlimit %d", res);
    }
    if (chdir(a->cwd) < 0) child_fail(rfd, "cwd", "%s", a->cwd);
    if (a->tty_gid) {
        tty_attach(a, rfd);
    } else {
        if (a->new_session && setsid() < 0) child_fail(rfd, "setsid", "setsid");
        if (dup2(a->in, 0) < 0 || dup2(a->out, 1) < 0 || dup2(a->err, 2) < 0) child_fail(rfd, "stdio", "dup2");
    }
    syscall(SYS_close_range, 3, ~0U, CLOSE_RANGE_CLOEXEC);
    trace("x-ids+cwd");
    if (set_caps(a->uid == 0) < 0) child_fail(rfd, "caps", "set capabilities");
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0) child_fail(rfd, "nnp", "no_new_privs");
    if (ruleset >= 0 && syscall(SYS_landlock_restrict_self, ruleset, 0) < 0)
        child_fail(rfd, "landlock", "restrict self");
    if (a->use_seccomp && prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &seccomp_prog) < 0)
        child_fail(rfd, "seccomp", "load filter");
    for (int i = 0; i < n_inherited_ign; i++) signal(inherited_ign[i], SIG_DFL);
    signal(SIGPIPE, SIG_DFL);
    trace("x-caps+secc");
    extern char **environ;
    environ = a->envp;
    execvp(a->argv[0], a->argv);
    child_fail(rfd, "exec", "%s", a->argv[0]);
}

/* What the exec child is given from the request (report_fd is the caller's to fill in). */
void exec_args_init(struct exec_args *a, const struct exec_req *x) {
    *a = (struct exec_args){
        .initpidfd = x->initpidfd, .in = x->in, .out = x->out, .err = x->err, .report_fd = -1,
        .argv = x->argv, .envp = x->envp, .cgs = (char **)x->cgs, .rlimits = (char **)x->rl, .cwd = x->cwd,
        .uid = (uid_t)strtoul(x->uid, NULL, 10), .gid = (gid_t)strtoul(x->gid, NULL, 10),
        .use_seccomp = !x->seccomp || strcmp(x->seccomp, "0") != 0,
        .new_session = !x->setsid || strcmp(x->setsid, "0") != 0,
        .ll_default = (char *)x->ld, .ll_rules = (char **)x->lr, .plowers = (char **)x->pl,
        .pristine = (char **)x->pp, .init_pid = x->ipid, .tty_gid = x->tty,
        .rows = (unsigned short)strtoul(x->rows ? x->rows : "0", NULL, 10),
        .cols = (unsigned short)strtoul(x->cols ? x->cols : "0", NULL, 10)};
}

/* An "rl" value, RESOURCE:SOFT:HARD (decimal): 0, or -1 when it is not one. */
int rlimit_parse(const char *s, int *res, unsigned long long *soft, unsigned long long *hard) {
    return sscanf(s, "%d:%llu:%llu", res, soft, hard) == 3 ? 0 : -1;
}

void do_exec(struct req *r) {
    const char *rid = r->tok[1];
    struct exec_req x;
    struct parse_err pe;
    if (parse_exec(r, &x, &pe) < 0) {
        reply_err(rid, pe.stage, pe.err, "%s", pe.msg);
        return;
    }
    clock_gettime(CLOCK_MONOTONIC, &trace_t0);
    int rep[2];
    if (pipe2(rep, O_CLOEXEC) < 0) { reply_err(rid, "exec", errno, "pipe"); return; }
    /* Children forked now land in the sandbox's pid namespace; switch back right after. */
    if (setns(x.initpidfd, CLONE_NEWPID) < 0) {
        int e = errno;
        close(rep[0]); close(rep[1]);
        reply_err(rid, "setns", e, "sandbox is gone (its init has exited)");
        return;
    }
    int pidfd = -1;
    pid_t pid = clone_pidfd(0, &pidfd);
    if (pid == 0) {
        close(rep[0]);
        close(sock_fd);
        struct exec_args a;
        exec_args_init(&a, &x);
        a.report_fd = rep[1];
        sigset_t none;
        sigemptyset(&none);
        sigprocmask(SIG_SETMASK, &none, NULL);
        exec_child(&a);
    }
    int e = errno;
    if (setns(self_pidns_fd, CLONE_NEWPID) < 0) {
        /* Cannot happen for our own namespace; refusing to go on is safer than nesting sandboxes. */
        perror("dsec-spawner: restore pid namespace");
        _exit(2);
    }
    close(rep[1]);
    trace("x-parent");
    if (pid < 0) {
        close(rep[0]);
        reply_err(rid, "clone", e, "fork exec child");
        return;
    }
    if (add_pending(rep[0], P_EXEC, pid, pidfd, rid) < 0) {
        kill(pid, SIGKILL);
        close(rep[0]); close(pidfd);
        reply_err(rid, "busy", EAGAIN, "too many operations in flight");
    }
}
