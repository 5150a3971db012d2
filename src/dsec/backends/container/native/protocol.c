/*
 * The wire (see spawner.h): a request's tokens and fds, replies and events to the
 * runtime, and the report a child writes on its pipe ("stage\0errno\0message").
 * Parses and formats only: it starts nothing.  parse_create and parse_exec are the one
 * reading of those requests (do_create/do_exec act on what they return; `dsec-spawner
 * --parse` prints it, for tests/integration/test_spawner_wire.py).
 */
#include "spawner.h"

const char *req_get(struct req *r, const char *key) {
    for (int i = 2; i + 1 < r->ntok; i += 2)
        if (strcmp(r->tok[i], key) == 0) return r->tok[i + 1];
    return NULL;
}

/* Every value of key, in order, into out[0..max-1] and a NULL after them: the count, or
 * -1 when there are more than max (the caller refuses the request: nothing is dropped). */
int req_all(struct req *r, const char *key, char **out, int max) {
    int n = 0, all = 0;
    for (int i = 2; i + 1 < r->ntok; i += 2)
        if (strcmp(r->tok[i], key) == 0) {
            if (n < max) out[n++] = r->tok[i + 1];
            all++;
        }
    out[n] = NULL;
    return all > max ? -1 : n;
}

/* ---------- replies ---------- */

int sock_fd;

/* Attach one fd to a message (SCM_RIGHTS); ``space`` must outlive the sendmsg. */
union fd_space {
    char b[CMSG_SPACE(sizeof(int))];
    struct cmsghdr align;
};

static void attach_fd(struct msghdr *m, union fd_space *space, int fd) {
    memset(space, 0, sizeof *space);
    m->msg_control = space->b;
    m->msg_controllen = sizeof space->b;
    struct cmsghdr *c = CMSG_FIRSTHDR(m);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(c), &fd, sizeof fd);
}

int send_msg_fd(int sock, const char *msg, int fd) {
    struct iovec iov = {.iov_base = (void *)msg, .iov_len = strlen(msg) + 1};
    union fd_space cm;
    struct msghdr msg_h = {.msg_iov = &iov, .msg_iovlen = 1};
    if (fd >= 0) attach_fd(&msg_h, &cm, fd);
    return sendmsg(sock, &msg_h, MSG_NOSIGNAL) < 0 ? -1 : 0;
}

void send_tokens(const char **toks, int n, int fd_to_pass) {
    char buf[4096];
    size_t len = 0;
    for (int i = 0; i < n; i++) {
        size_t l = strlen(toks[i]);
        if (len + l + 1 > sizeof buf) break;
        memcpy(buf + len, toks[i], l + 1);
        len += l + 1;
    }
    struct iovec iov = {.iov_base = buf, .iov_len = len};
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1};
    union fd_space cm;
    if (fd_to_pass >= 0) attach_fd(&msg, &cm, fd_to_pass);
    while (sendmsg(sock_fd, &msg, MSG_NOSIGNAL) < 0) {
        if (errno == EINTR) continue;
        if (errno == EPIPE || errno == ECONNRESET) _exit(0);
        break;
    }
}

void reply_err(const char *rid, const char *stage, int err, const char *fmt, ...) {
    char e[16], m[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(m, sizeof m, fmt, ap);
    va_end(ap);
    snprintf(e, sizeof e, "%d", err);
    const char *t[] = {"err", rid, stage, e, m};
    send_tokens(t, 5, -1);
}

void reply_ok_pid(const char *rid, pid_t pid, int pidfd) {
    char p[16];
    snprintf(p, sizeof p, "%d", (int)pid);
    const char *t[] = {"ok", rid, "pid", p};
    send_tokens(t, 4, pidfd);
}

void reply_err_pid(const char *rid, const char *stage, int err, int pid, const char *msg) {
    char e[16], pid_s[16];
    snprintf(e, sizeof e, "%d", err);
    snprintf(pid_s, sizeof pid_s, "%d", pid);
    const char *t[] = {"err", rid, stage, e, msg, pid_s};
    send_tokens(t, 6, -1);
}

/* A child reports failure as "stage\0errno\0message" on its report pipe. */
void child_fail(int rfd, const char *stage, const char *fmt, ...) __attribute__((noreturn));
void child_fail(int rfd, const char *stage, const char *fmt, ...) {
    int err = errno;
    char buf[1200], m[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(m, sizeof m, fmt, ap);
    va_end(ap);
    int l1 = snprintf(buf, sizeof buf, "%s", stage) + 1;
    int l2 = snprintf(buf + l1, sizeof buf - l1, "%d", err) + 1;
    int l3 = snprintf(buf + l1 + l2, sizeof buf - l1 - l2, "%s", m) + 1;
    if (write(rfd, buf, l1 + l2 + l3) < 0) { /* nothing else we can do */ }
    _exit(127);
}

/* ---------- receiving a request ---------- */

_Static_assert(MAX_FDS == 8 && MAX_TOK == 8192 && MAX_MSG == 512 * 1024, "recv_req's messages name these caps");

int recv_req(struct req *r, char *buf) {
    struct iovec iov = {.iov_base = buf, .iov_len = MAX_MSG - 1};
    union {
        char b[CMSG_SPACE(sizeof(int) * MAX_FDS)];
        struct cmsghdr align;
    } cm;
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = cm.b, .msg_controllen = sizeof cm.b};
    ssize_t n = recvmsg(sock_fd, &msg, MSG_CMSG_CLOEXEC);
    if (n <= 0) return (int)n;
    buf[n] = 0;
    r->nfds = 0;
    r->overflow = NULL;
    if (msg.msg_flags & MSG_TRUNC) r->overflow = "the request is over 512 KiB";
    if (msg.msg_flags & MSG_CTRUNC) r->overflow = "the request carries more than 8 fds";
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c)) {
        if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
            int k = (int)((c->cmsg_len - CMSG_LEN(0)) / sizeof(int));
            for (int i = 0; i < k; i++) {
                int fd;
                memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
                if (r->nfds < MAX_FDS) r->fds[r->nfds++] = fd;
                else { close(fd); r->overflow = "the request carries more than 8 fds"; }
            }
        }
    }
    r->ntok = 0;
    ssize_t off = 0;
    for (; off < n && r->ntok < MAX_TOK; off += (ssize_t)strlen(buf + off) + 1) r->tok[r->ntok++] = buf + off;
    if (off < n) r->overflow = "the request has more than 8192 tokens";
    return 1;
}

/* ---------- parsing a request ---------- */

static int refuse(struct parse_err *e, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int refuse(struct parse_err *e, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->msg, sizeof e->msg, fmt, ap);
    va_end(ap);
    e->stage = "request";
    e->err = EINVAL;
    return -1;
}

/* The checks every request gets, then its op. */
enum op req_op(struct req *r, struct parse_err *e) {
    if (r->ntok < 2) return OP_NONE;
    if (r->overflow) {
        refuse(e, "%s: refused (nothing is ever truncated)", r->overflow);
        return OP_BAD;
    }
    if (strcmp(r->tok[0], "create") == 0) return OP_CREATE;
    if (strcmp(r->tok[0], "exec") == 0) return OP_EXEC;
    if (strcmp(r->tok[0], "ping") == 0) return OP_PING;
    refuse(e, "unknown op %s", r->tok[0]);
    return OP_BAD;
}

/* create: id, stage (the template's mountpoint), uid_base, uid_count, disk, inodes, devskel,
 * empty, upper (optional: no upper is the memory medium), lower (1..MAX_LAYERS, top first),
 * cg (0..MAX_CGROUPS), hidepid (optional, "1"); at most one fd, a prepared network namespace. */
int parse_create(struct req *r, struct create_req *c, struct parse_err *e) {
    c->id = req_get(r, "id"); c->stage = req_get(r, "stage");
    c->uid_base = req_get(r, "uid_base"); c->uid_count = req_get(r, "uid_count");
    c->disk = req_get(r, "disk"); c->inodes = req_get(r, "inodes");
    c->upper = req_get(r, "upper"); c->devskel = req_get(r, "devskel"); c->empty = req_get(r, "empty");
    c->hidepid = req_get(r, "hidepid");
    c->net_fd = r->nfds >= 1 ? r->fds[0] : -1;
    if ((c->nlowers = req_all(r, "lower", c->lowers, MAX_LAYERS)) < 0 ||
        (c->ncgs = req_all(r, "cg", c->cgs, MAX_CGROUPS)) < 0)
        return refuse(e, "create takes at most %d layers and %d cgroups", MAX_LAYERS, MAX_CGROUPS);
    if (!c->id || !c->stage || !c->uid_base || !c->uid_count || !c->disk || !c->inodes || !c->devskel || !c->empty)
        return refuse(e, "create needs id, stage, uid_base, uid_count, disk, inodes, devskel, empty");
    if (c->hidepid && strcmp(c->hidepid, "1") != 0) return refuse(e, "create: hidepid takes 1");
    return 0;
}

/* exec: a (argv, 1..MAX_ARGS), e (KEY=VALUE, 0..MAX_ARGS), cwd, uid, gid, seccomp ("0": off),
 * setsid ("0": stay in the spawner's session), cg, rl (RESOURCE:SOFT:HARD), ld and lr (Landlock
 * default class and CLASS:/path rules), ipid, pl and pp (pristine layers and paths), tty,
 * rows, cols; exactly 4 fds (see struct exec_req). */
int parse_exec(struct req *r, struct exec_req *x, struct parse_err *e) {
    if (r->nfds != 4)
        return refuse(e, "exec needs 4 fds (init pidfd, stdin, stdout, stderr), got %d", r->nfds);
    x->initpidfd = r->fds[0]; x->in = r->fds[1]; x->out = r->fds[2]; x->err = r->fds[3];
    static char *argv[MAX_TOK], *envp[MAX_TOK];
    x->argv = argv; x->envp = envp;
    const struct { const char *key, *what; int max; char **out; int *n; } lists[] = {
        {"lr", "file rules (Landlock)", MAX_LL_RULES, x->lr, &x->nlr},
        {"pl", "image layers", MAX_LAYERS, x->pl, &x->npl},
        {"pp", "pristine paths", MAX_PRISTINE, x->pp, &x->npp},
        {"cg", "cgroups", MAX_CGROUPS, x->cgs, &x->ncgs},
        {"rl", "rlimits", MAX_RLIMITS, x->rl, &x->nrl}};
    for (size_t i = 0; i < sizeof lists / sizeof lists[0]; i++)
        if ((*lists[i].n = req_all(r, lists[i].key, lists[i].out, lists[i].max)) < 0)
            return refuse(e, "more than %d %s in one command", lists[i].max, lists[i].what);
    if ((x->argc = req_all(r, "a", argv, MAX_ARGS)) < 0 || (x->envc = req_all(r, "e", envp, MAX_ARGS)) < 0)
        return refuse(e, "more than %d arguments or environment variables", MAX_ARGS);
    x->cwd = req_get(r, "cwd"); x->uid = req_get(r, "uid"); x->gid = req_get(r, "gid");
    x->seccomp = req_get(r, "seccomp"); x->setsid = req_get(r, "setsid");
    x->ld = req_get(r, "ld"); x->ipid = req_get(r, "ipid"); x->tty = req_get(r, "tty");
    x->rows = req_get(r, "rows"); x->cols = req_get(r, "cols");
    if (x->argc == 0 || !x->cwd || !x->uid || !x->gid) return refuse(e, "exec needs argv, cwd, uid, gid");
    return 0;
}
