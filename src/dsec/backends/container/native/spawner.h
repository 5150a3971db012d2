/*
 * dsec-spawner: the only native code of the container backend (this header is shared by
 * every file of it; dsec-init.c is a separate, static program).
 *
 * One spawner runs per node runtime, as root, started by the Python runtime
 * with one end of a SOCK_SEQPACKET socketpair.  It does the two things Python
 * cannot do cheaply: clone() sandboxes (a fork of a 1 MiB C process, not of a
 * 100 MiB Python service) and enter a sandbox's namespaces to exec a command.
 *
 * It keeps no per-sandbox state: every exec request carries a pidfd of the
 * sandbox's init, so a restarted spawner serves sandboxes it never created.
 *
 * The sandbox init is a fork of this process that never execs: it keeps the
 * host as the owner of its memory (mm->user_ns), is non-dumpable, holds no
 * socket and writes no log, so processes in the sandbox - even its root - can
 * neither ptrace it, read its memory or fds, nor signal it (pid-namespace init
 * drops signals it has no handler for).
 *
 * Wire format: one datagram per message, NUL-separated tokens.
 *   request:  op, rid, then key, value pairs (keys may repeat)
 *   reply:    "ok", rid, key, value...            (+ SCM_RIGHTS pidfd)
 *             "err", rid, stage, errno, message
 *   event:    "exit", pid, wait-status, utime_us, stime_us, maxrss_kib
 * It must never block on one sandbox: slow steps (mount set-up, exec) report
 * back through pipes that the main poll loop watches.
 *
 * Files (each can be read in one sitting):
 *   spawner.h   this header: the wire's limits, shared structs, prototypes
 *   protocol.c  request tokens and fds, replies and events, a child's report pipe
 *   main.c      the event loop: requests, report pipes, reaping exec children
 *   create.c    create: the sandbox's init (clone, cgroups, user namespace, dsec-init)
 *   mounts.c    the template mount namespace and a sandbox's tree of detached mounts
 *   nspools.c   namespaces made ahead: the netns pool and the user-namespace keeper
 *   exec.c      exec: enter a sandbox from the host side and exec a command
 *   landlock.c  a stage's file rules as a Landlock ruleset
 *   pristine.c  pristine paths: the image's own copies in an exec's mount namespace
 *   confine.c   the seccomp filter and capability sets
 *   parse_only.c  `dsec-spawner --parse`: one request from stdin through the parser, as JSON
 */
#ifndef DSEC_SPAWNER_H
#define DSEC_SPAWNER_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <linux/capability.h>
#include <linux/filter.h>
#include <linux/sched.h>
#include <linux/seccomp.h>
#include <net/if.h>
#include <poll.h>
#include <sched.h>
#include <seccomp.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#ifndef SYS_open_tree
#define SYS_open_tree 428
#endif
#ifndef SYS_move_mount
#define SYS_move_mount 429
#endif
#ifndef SYS_mount_setattr
#define SYS_mount_setattr 442
#endif
#ifndef SYS_close_range
#define SYS_close_range 436
#endif
#ifndef OPEN_TREE_CLONE
#define OPEN_TREE_CLONE 1
#endif
#ifndef OPEN_TREE_CLOEXEC
#define OPEN_TREE_CLOEXEC O_CLOEXEC
#endif
#ifndef MOVE_MOUNT_F_EMPTY_PATH
#define MOVE_MOUNT_F_EMPTY_PATH 0x00000004
#endif
#ifndef MOUNT_ATTR_IDMAP
#define MOUNT_ATTR_IDMAP 0x00100000
#endif
#ifndef MOUNT_ATTR_RDONLY
#define MOUNT_ATTR_RDONLY 0x00000001
#endif
#ifndef CLOSE_RANGE_CLOEXEC
#define CLOSE_RANGE_CLOEXEC (1U << 2)
#endif
#ifndef CLONE_PIDFD
#define CLONE_PIDFD 0x00001000
#endif

struct mount_attr_s {
    uint64_t attr_set;
    uint64_t attr_clr;
    uint64_t propagation;
    uint64_t userns_fd;
};

#define MAX_MSG (512 * 1024) /* a request's bytes, NULs included, are at most MAX_MSG - 1 */
#define MAX_TOK 8192          /* tokens of one request: op, rid, then key, value pairs */
#define MAX_PENDING 8192

/* The caps on what one request may carry.  Over a cap a request is refused with EINVAL
 * ("request" stage), never truncated.  wire.py (the runtime's only encoder) mirrors each
 * under the same name; tests/integration/test_spawner_wire.py holds the two together. */
#define MAX_FDS 8               /* fds (SCM_RIGHTS) */
#define MAX_LAYERS 15           /* "lower" (create), "pl" (exec: pristine image layers) */
#define MAX_CGROUPS 15          /* "cg" */
#define MAX_LL_RULES 255        /* "lr" (Landlock file rules) */
#define MAX_PRISTINE 71         /* "pp" (pristine paths) */
#define MAX_RLIMITS 31          /* "rl" */
#define MAX_ARGS (MAX_TOK - 1)  /* "a" and "e", each (the token table binds first) */

#ifndef SYS_openat2
#define SYS_openat2 437
#endif
#ifndef SYS_fsopen
#define SYS_fsopen 430
#endif
#ifndef SYS_fsconfig
#define SYS_fsconfig 431
#endif
#ifndef SYS_fsmount
#define SYS_fsmount 432
#endif
struct dsec_open_how {
    uint64_t flags, mode, resolve;
};
#define DSEC_RESOLVE_NO_XDEV 0x01
#define DSEC_RESOLVE_NO_MAGICLINKS 0x02
#define DSEC_RESOLVE_NO_SYMLINKS 0x04
#define DSEC_RESOLVE_BENEATH 0x08
#define DSEC_RESOLVE_IN_ROOT 0x10
#ifndef MOVE_MOUNT_T_EMPTY_PATH
#define MOVE_MOUNT_T_EMPTY_PATH 0x00000040
#endif
#ifndef AT_RECURSIVE
#define AT_RECURSIVE 0x8000
#endif

struct req {
    char *tok[MAX_TOK];
    int ntok;
    int fds[MAX_FDS];
    int nfds;
    const char *overflow; /* non-NULL: the request did not fit (refused, never truncated) */
};

struct create_args {
    const char *id, *upper, *devskel, *empty;
    int hidepid; /* /proc: hidepid=invisible, the sandbox root's group exempt */
    char **lowers;
    char **cgs;
    unsigned long uid_base;
    unsigned long long disk, inodes;
    int userns_fd, go_fd, report_fd, net_fd;
};

struct exec_args {
    int initpidfd, in, out, err, report_fd;
    char **argv, **envp, **cgs, **rlimits;
    char *ll_default, **ll_rules, **plowers, **pristine;
    const char *cwd, *init_pid;
    uid_t uid;
    gid_t gid;
    int use_seccomp, new_session;
    const char *tty_gid; /* non-NULL: a terminal (devpts gid option, in host ids); in is the socket for the master */
    unsigned short rows, cols;
};

enum pend_kind { P_CREATE = 1, P_EXEC = 2 };

struct pending {
    int fd; /* report pipe (read end) */
    int kind;
    pid_t pid;
    int pidfd;
    char rid[40];
};

/* ---------- requests as parsed (protocol.c) ---------- */

/* Why a request is refused: the "err" reply's stage, errno and message. */
struct parse_err {
    const char *stage;
    int err;
    char msg[1024];
};

/* The ops; OP_NONE: under two tokens (dropped unanswered), OP_BAD: refused (see parse_err). */
enum op { OP_NONE, OP_BAD, OP_CREATE, OP_EXEC, OP_PING };

/* create.  Strings point into the request; lists are NULL-terminated. */
struct create_req {
    const char *id, *stage, *uid_base, *uid_count, *disk, *inodes, *upper, *devskel, *empty, *hidepid;
    char *lowers[MAX_LAYERS + 1], *cgs[MAX_CGROUPS + 1];
    int nlowers, ncgs;
    int net_fd; /* fd 0 of the request: a prepared network namespace; -1: none (one from the pool) */
};

/* exec.  fds 0-3 of the request, in this order: the init's pidfd, stdin, stdout, stderr. */
struct exec_req {
    int initpidfd, in, out, err;
    char **argv, **envp; /* static arrays of MAX_TOK */
    int argc, envc;
    char *lr[MAX_LL_RULES + 1], *pl[MAX_LAYERS + 1], *pp[MAX_PRISTINE + 1], *cgs[MAX_CGROUPS + 1],
        *rl[MAX_RLIMITS + 1];
    int nlr, npl, npp, ncgs, nrl;
    const char *cwd, *uid, *gid, *seccomp, *setsid, *ld, *ipid, *tty, *rows, *cols;
};

/* ---------- shared state (each defined once; see the file named) ---------- */

extern int sock_fd;                              /* protocol.c: the runtime's socket */
extern int inherited_ign[64], n_inherited_ign;   /* main.c: signals ignored when we started */
extern int init_bin_fd;                          /* main.c: the static dsec-init beside this binary */
extern int trace_on;                             /* main.c: DSEC_SPAWNER_TRACE */
extern struct timespec trace_t0;
extern int self_pidns_fd;                        /* main.c: our own pid namespace */
extern struct sock_fprog seccomp_prog;           /* confine.c */
extern int tmpl_fd;                              /* mounts.c: the template mount namespace */
extern struct pending pend[MAX_PENDING];         /* main.c: work watched by the poll loop */
extern int npend;

/* protocol.c */
const char *req_get(struct req *r, const char *key);
int req_all(struct req *r, const char *key, char **out, int max);
int send_msg_fd(int sock, const char *msg, int fd);
void send_tokens(const char **toks, int n, int fd_to_pass);
void reply_err(const char *rid, const char *stage, int err, const char *fmt, ...) __attribute__((format(printf, 4, 5)));
void reply_ok_pid(const char *rid, pid_t pid, int pidfd);
void reply_err_pid(const char *rid, const char *stage, int err, int pid, const char *msg);
void child_fail(int rfd, const char *stage, const char *fmt, ...) __attribute__((noreturn, format(printf, 3, 4)));
int recv_req(struct req *r, char *buf);
enum op req_op(struct req *r, struct parse_err *e);
int parse_create(struct req *r, struct create_req *c, struct parse_err *e);
int parse_exec(struct req *r, struct exec_req *x, struct parse_err *e);
int parse_only_main(void); /* parse_only.c: dsec-spawner --parse */

/* main.c */
void trace(const char *what);
int add_pending(int fd, int kind, pid_t pid, int pidfd, const char *rid);
pid_t clone_pidfd(unsigned long flags, int *pidfd);

/* confine.c */
int build_seccomp(void);
int set_caps(int keep_root_caps);

/* nspools.c */
int lo_up(void);
void netpool_start(int target);
void netpool_stop(void);
int netpool_take(void);
void userns_keeper_start(void);
void userns_keeper_stop(void);
int userns_get(const char *rid, const char *ub, const char *uc);

/* mounts.c */
int tmpl_make(const char *at, const char **what);
int sandbox_root(struct create_args *a);

/* create.c */
int write_file(const char *path, const char *data);
int join_cgroups(char **cgs, pid_t pid);
void create_args_init(struct create_args *a, const struct create_req *c);
void do_create(struct req *r);

/* landlock.c */
int ll_rule_ok(const char *rule);
int ll_build(char *deflt, char **lr, int rfd);

/* pristine.c */
int pristine_layers(char **lowers, int userns_fd, int rfd);
void pristine_mount(int img, char **paths, int rfd);

/* exec.c */
void exec_args_init(struct exec_args *a, const struct exec_req *x);
int rlimit_parse(const char *s, int *res, unsigned long long *soft, unsigned long long *hard);
void do_exec(struct req *r);

#endif
