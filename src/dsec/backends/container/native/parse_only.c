/*
 * `dsec-spawner --parse`: a test mode.  Reads ONE request from stdin, which must be
 * one end of a SOCK_SEQPACKET socketpair (the wire needs datagram boundaries and
 * SCM_RIGHTS), runs it through the real receiving and parsing code (recv_req, req_op,
 * parse_create / parse_exec, create_args_init / exec_args_init, rlimit_parse,
 * ll_rule_ok), prints what the spawner would act on as one JSON object on stdout, and
 * exits.  It starts, mounts and enters nothing; fds it is sent are only fstat'ed
 * (device and inode, so a test can tell which fd landed in which role).
 *
 * Output: {"op", "rid", "nfds", and "create" or "exec" (the parsed request)}, or
 * {"rid", "error": {"stage", "errno", "message"}} for a refused request (the "err"
 * reply the spawner would send), or {"dropped": true} for one it would ignore.
 * Exit status 0 when a request was read, 2 when none was.
 */
#include "spawner.h"

static void j_str(const char *s) {
    if (!s) { fputs("null", stdout); return; }
    putchar('"');
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        if (*p == '"' || *p == '\\') printf("\\%c", *p);
        else if (*p < 0x20 || *p == 0x7f) printf("\\u%04x", *p);
        else putchar(*p); /* UTF-8 passes through as is */
    }
    putchar('"');
}

/* Objects: j_open, then j_key before each value, then j_close. */
static int j_first;

static void j_open(void) {
    putchar('{');
    j_first = 1;
}

static void j_close(void) {
    putchar('}');
    j_first = 0;
}

static void j_key(const char *k) {
    if (!j_first) fputs(", ", stdout);
    j_first = 0;
    j_str(k);
    fputs(": ", stdout);
}

static void j_strs(char *const *v) {
    putchar('[');
    for (int i = 0; v[i]; i++) {
        if (i) fputs(", ", stdout);
        j_str(v[i]);
    }
    putchar(']');
}

static void j_fd(int fd) {
    struct stat st;
    if (fd < 0) fputs("null", stdout);
    else if (fstat(fd, &st) < 0) printf("{\"fd\": %d, \"errno\": %d}", fd, errno);
    else printf("{\"dev\": %llu, \"ino\": %llu}", (unsigned long long)st.st_dev, (unsigned long long)st.st_ino);
}

static void print_create(const struct create_req *c) {
    struct create_args a;
    create_args_init(&a, c);
    char map[128]; /* what make_userns writes to uid_map and gid_map */
    snprintf(map, sizeof map, "0 %s %s\n", c->uid_base, c->uid_count);
    j_open();
    j_key("id"); j_str(a.id);
    j_key("stage"); j_str(c->stage);
    j_key("uid_base"); printf("%lu", a.uid_base);
    j_key("uid_map"); j_str(map);
    j_key("disk"); printf("%llu", a.disk);
    j_key("inodes"); printf("%llu", a.inodes);
    j_key("upper"); j_str(a.upper);
    j_key("devskel"); j_str(a.devskel);
    j_key("empty"); j_str(a.empty);
    j_key("lowers"); j_strs(a.lowers);
    j_key("cgroups"); j_strs(a.cgs);
    j_key("net_fd"); j_fd(c->net_fd);
    j_key("hidepid"); printf("%d", a.hidepid);
    j_close();
}

static void print_exec(const struct exec_req *x) {
    struct exec_args a;
    exec_args_init(&a, x);
    j_open();
    j_key("argv"); j_strs(a.argv);
    j_key("env"); j_strs(a.envp);
    j_key("cwd"); j_str(a.cwd);
    j_key("uid"); printf("%u", (unsigned)a.uid);
    j_key("gid"); printf("%u", (unsigned)a.gid);
    j_key("seccomp"); fputs(a.use_seccomp ? "true" : "false", stdout);
    j_key("setsid"); fputs(a.new_session ? "true" : "false", stdout);
    j_key("cgroups"); j_strs(a.cgs);
    j_key("rlimits"); putchar('[');
    for (int i = 0; a.rlimits[i]; i++) {
        int res;
        unsigned long long soft, hard;
        if (i) fputs(", ", stdout);
        if (rlimit_parse(a.rlimits[i], &res, &soft, &hard) == 0) {
            printf("[%d, %llu, %llu]", res, soft, hard);
        } else {
            j_open(); j_key("bad"); j_str(a.rlimits[i]); j_close();
        }
    }
    putchar(']');
    j_key("landlock"); /* ll_build: no "ld", no Landlock (any "lr" is then unused) */
    if (!a.ll_default) {
        fputs("null", stdout);
    } else {
        j_open();
        j_key("default"); j_str(a.ll_default);
        j_key("rules"); putchar('[');
        for (int i = 0; a.ll_rules[i]; i++) {
            if (i) fputs(", ", stdout);
            if (ll_rule_ok(a.ll_rules[i])) {
                char cls[2] = {a.ll_rules[i][0], 0};
                putchar('['); j_str(cls); fputs(", ", stdout); j_str(a.ll_rules[i] + 2); putchar(']');
            } else {
                j_open(); j_key("bad"); j_str(a.ll_rules[i]); j_close();
            }
        }
        putchar(']');
        j_close();
    }
    j_key("init_pid"); j_str(a.init_pid);
    j_key("pristine_layers"); j_strs(a.plowers);
    j_key("pristine_paths"); j_strs(a.pristine);
    j_key("tty");
    if (!a.tty_gid) {
        fputs("null", stdout);
    } else {
        j_open();
        j_key("gid"); j_str(a.tty_gid);
        j_key("rows"); printf("%u", a.rows);
        j_key("cols"); printf("%u", a.cols);
        j_close();
    }
    j_key("fds");
    j_open();
    j_key("init_pidfd"); j_fd(a.initpidfd);
    j_key("stdin"); j_fd(a.in);
    j_key("stdout"); j_fd(a.out);
    j_key("stderr"); j_fd(a.err);
    j_close();
    j_close();
}

int parse_only_main(void) {
    sock_fd = 0;
    char *buf = malloc(MAX_MSG);
    struct req *r = malloc(sizeof *r);
    if (!buf || !r) return 2;
    int rc = recv_req(r, buf);
    if (rc <= 0) {
        fprintf(stderr, "dsec-spawner --parse: no request on stdin (%s): stdin must be a SOCK_SEQPACKET socket\n",
                rc < 0 ? strerror(errno) : "end of file");
        return 2;
    }
    struct parse_err pe;
    enum op op = req_op(r, &pe);
    if (op == OP_NONE) {
        fputs("{\"dropped\": true}\n", stdout);
        return 0;
    }
    static struct create_req c;
    static struct exec_req x;
    int bad = op == OP_BAD || (op == OP_CREATE && parse_create(r, &c, &pe) < 0) ||
              (op == OP_EXEC && parse_exec(r, &x, &pe) < 0);
    j_open();
    j_key("rid"); j_str(r->tok[1]);
    if (bad) {
        j_key("error");
        j_open();
        j_key("stage"); j_str(pe.stage);
        j_key("errno"); printf("%d", pe.err);
        j_key("message"); j_str(pe.msg);
        j_close();
    } else {
        j_key("op"); j_str(r->tok[0]);
        j_key("nfds"); printf("%d", r->nfds);
        if (op == OP_CREATE) { j_key("create"); print_create(&c); }
        if (op == OP_EXEC) { j_key("exec"); print_exec(&x); }
    }
    j_close();
    putchar('\n');
    return 0;
}
