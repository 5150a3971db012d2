/*
 * Namespaces made ahead of the create path: the pool of loopback-only network
 * namespaces and the user-namespace keeper, each a helper process of the spawner.
 */
#include "spawner.h"

int lo_up(void) {
    int s = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (s < 0) return -1;
    struct ifreq ifr;
    memset(&ifr, 0, sizeof ifr);
    strncpy(ifr.ifr_name, "lo", IFNAMSIZ - 1);
    int rc = ioctl(s, SIOCGIFFLAGS, &ifr);
    if (rc == 0) {
        ifr.ifr_flags |= IFF_UP | IFF_RUNNING;
        rc = ioctl(s, SIOCSIFFLAGS, &ifr);
    }
    close(s);
    return rc;
}

/* A pool of network namespaces (loopback only, lo up): a new netns costs ~1 ms
 * of kernel time, too much for the create path.  A helper process, forked at
 * start, makes them on the other core and hands their fds over a socketpair;
 * every fd taken is answered with one refill request, so the pool stays full
 * without the spawner ever waiting for a netns to be made. */
static int netpool_sock = -1;
static pid_t netpool_pid = -1;

void netpool_stop(void) {
    if (netpool_pid > 0) {
        kill(netpool_pid, SIGKILL);
        waitpid(netpool_pid, NULL, 0);
        netpool_pid = -1;
    }
}

static int recv_fd(int sock, int flags) {
    char b;
    struct iovec iov = {.iov_base = &b, .iov_len = 1};
    union {
        char c[CMSG_SPACE(sizeof(int))];
        struct cmsghdr align;
    } cm;
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = cm.c, .msg_controllen = sizeof cm.c};
    if (recvmsg(sock, &msg, flags | MSG_CMSG_CLOEXEC) <= 0) return -1;
    struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
    if (!c || c->cmsg_type != SCM_RIGHTS) return -1;
    int fd;
    memcpy(&fd, CMSG_DATA(c), sizeof fd);
    return fd;
}

static void netpool_maker(int sock, int target, int host_netns_fd) __attribute__((noreturn));
static void netpool_maker(int sock, int target, int host_netns_fd) {
    prctl(PR_SET_NAME, "dsec-netpool", 0, 0, 0);
    prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0);
    int credit = target;
    for (;;) {
        while (credit > 0) {
            if (unshare(CLONE_NEWNET) < 0) _exit(1);
            int fd = open("/proc/thread-self/ns/net", O_RDONLY | O_CLOEXEC);
            int ok = fd >= 0 && lo_up() == 0;
            if (setns(host_netns_fd, CLONE_NEWNET) < 0) _exit(1);
            if (!ok) _exit(1);
            if (send_msg_fd(sock, "n", fd) < 0) _exit(0);
            close(fd);
            credit--;
        }
        char req[64];
        ssize_t n = read(sock, req, sizeof req);
        if (n <= 0) _exit(0); /* the spawner is gone */
        credit += (int)n;
    }
}

void netpool_start(int target) {
    if (target <= 0) return;
    int host_netns_fd = open("/proc/self/ns/net", O_RDONLY | O_CLOEXEC);
    int sv[2];
    if (host_netns_fd < 0 || socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) < 0) return;
    pid_t pid = fork();
    if (pid == 0) {
        close(sv[0]);
        close(sock_fd);
        netpool_maker(sv[1], target, host_netns_fd);
    }
    close(sv[1]);
    close(host_netns_fd);
    if (pid < 0) { close(sv[0]); return; }
    netpool_pid = pid;
    netpool_sock = sv[0];
}

int netpool_take(void) {
    if (netpool_sock < 0) return -1;
    int fd = recv_fd(netpool_sock, MSG_DONTWAIT);
    if (fd >= 0 && write(netpool_sock, "r", 1) < 0) { /* maker gone: creates make their own */ }
    return fd;
}

/* A user namespace mapping 0..count-1 to base..: its owner process exits at once.
 * The owner shares our fd table (CLONE_FILES): nothing is copied, whatever we hold.
 * Returns the namespace's fd, or -1 with errno set and *what naming the step. */
static int make_userns(const char *ub, const char *uc, const char **what) {
    int upipe[2];
    *what = "pipe";
    if (pipe2(upipe, O_CLOEXEC) < 0) return -1;
    pid_t u = (pid_t)syscall(SYS_clone, CLONE_NEWUSER | CLONE_FILES | SIGCHLD, NULL, NULL, NULL, NULL);
    if (u == 0) {
        char c;
        /* Shared fd table: close nothing; EOF comes when the parent closes the write end. */
        if (read(upipe[0], &c, 1) < 0) { }
        _exit(0);
    }
    if (u < 0) {
        int e = errno;
        close(upipe[0]); close(upipe[1]);
        errno = e;
        *what = "clone(CLONE_NEWUSER)";
        return -1;
    }
    char path[128], map[128];
    int userns_fd = -1;
    snprintf(map, sizeof map, "0 %s %s\n", ub, uc);
    snprintf(path, sizeof path, "/proc/%d/uid_map", (int)u);
    int ok = write_file(path, map) == 0;
    snprintf(path, sizeof path, "/proc/%d/gid_map", (int)u);
    ok = ok && write_file(path, map) == 0;
    int saved = errno;
    if (ok) {
        snprintf(path, sizeof path, "/proc/%d/ns/user", (int)u);
        userns_fd = open(path, O_RDONLY | O_CLOEXEC);
        saved = errno;
    }
    close(upipe[1]);
    waitpid(u, NULL, 0);
    close(upipe[0]);
    errno = saved;
    *what = "write uid/gid map";
    return userns_fd;
}

/* ---------- the user-namespace keeper ----------
 * One user namespace per uid range, kept open and reused by the next sandbox of the
 * same range: it owns no other namespace (those are created by the host), so nothing
 * of the old sandbox survives in it, and making one costs ~0.5 ms.  The kept fds live
 * in a helper process, not here: thousands of them in the spawner's fd table were
 * copied by each of its forks and closed by each sandbox init (close_range 32 -> 826 us
 * at 4,000 sandboxes).  Protocol (SOCK_SEQPACKET): "BASE COUNT" -> "o" + the fd, or
 * "e ERRNO STEP". */
#define USERNS_CACHE 4096
static struct { unsigned long base; int fd; } userns_cache[USERNS_CACHE];
static int userns_cached;
static int userns_sock = -1;
static pid_t userns_pid = -1;

static int userns_cache_get(unsigned long base) {
    for (int i = 0; i < userns_cached; i++)
        if (userns_cache[i].base == base) return userns_cache[i].fd;
    return -1;
}

static void userns_cache_put(unsigned long base, int fd) {
    if (userns_cached < USERNS_CACHE) {
        userns_cache[userns_cached].base = base;
        userns_cache[userns_cached].fd = fd;
        userns_cached++;
    } else {
        /* Full: replace a pseudo-random entry. */
        int i = (int)(base % USERNS_CACHE);
        close(userns_cache[i].fd);
        userns_cache[i].base = base;
        userns_cache[i].fd = fd;
    }
}

static void userns_keeper(int sock) __attribute__((noreturn));
static void userns_keeper(int sock) {
    prctl(PR_SET_NAME, "dsec-userns", 0, 0, 0);
    prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0);
    for (;;) {
        char req[128], ub[32], uc[32], out[160];
        ssize_t n = recv(sock, req, sizeof req - 1, 0);
        if (n <= 0) _exit(0); /* the spawner is gone */
        req[n] = 0;
        if (sscanf(req, "%31s %31s", ub, uc) != 2) {
            snprintf(out, sizeof out, "e %d request", EINVAL);
            if (send_msg_fd(sock, out, -1) < 0) _exit(0);
            continue;
        }
        unsigned long base = strtoul(ub, NULL, 10);
        int fd = userns_cache_get(base);
        if (fd < 0) {
            const char *what = "";
            fd = make_userns(ub, uc, &what);
            if (fd < 0) {
                snprintf(out, sizeof out, "e %d %s", errno, what);
                if (send_msg_fd(sock, out, -1) < 0) _exit(0);
                continue;
            }
            userns_cache_put(base, fd);
        }
        if (send_msg_fd(sock, "o", fd) < 0) _exit(0);
    }
}

void userns_keeper_start(void) {
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) < 0) return;
    pid_t pid = fork();
    if (pid == 0) {
        close(sv[0]);
        close(sock_fd);
        userns_keeper(sv[1]);
    }
    close(sv[1]);
    if (pid < 0) { close(sv[0]); return; }
    userns_pid = pid;
    userns_sock = sv[0];
}

void userns_keeper_stop(void) {
    if (userns_pid > 0) {
        kill(userns_pid, SIGKILL);
        waitpid(userns_pid, NULL, 0);
        userns_pid = -1;
    }
}

/* The sandbox's user namespace (an fd of our own, to close after use), from the keeper;
 * made here, uncached, if the keeper is gone.  Replies the error itself on failure. */
int userns_get(const char *rid, const char *ub, const char *uc) {
    if (userns_sock >= 0) {
        char q[80];
        snprintf(q, sizeof q, "%s %s", ub, uc);
        if (send(userns_sock, q, strlen(q) + 1, MSG_NOSIGNAL) >= 0) {
            char a[160];
            struct iovec iov = {.iov_base = a, .iov_len = sizeof a - 1};
            union {
                char c[CMSG_SPACE(sizeof(int))];
                struct cmsghdr align;
            } cm;
            struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = cm.c, .msg_controllen = sizeof cm.c};
            ssize_t n = recvmsg(userns_sock, &m, MSG_CMSG_CLOEXEC);
            if (n > 0) {
                a[n] = 0;
                struct cmsghdr *c = CMSG_FIRSTHDR(&m);
                if (a[0] == 'o' && c && c->cmsg_type == SCM_RIGHTS) {
                    int fd;
                    memcpy(&fd, CMSG_DATA(c), sizeof fd);
                    return fd;
                }
                int e = EIO;
                char step[120] = "keeper";
                sscanf(a, "e %d %119[^\n]", &e, step);
                reply_err(rid, "userns", e, "%s (uid range %s)", step, ub);
                return -1;
            }
        }
        /* The keeper is gone: make namespaces here from now on. */
        close(userns_sock);
        userns_sock = -1;
        userns_keeper_stop();
    }
    const char *what = "";
    int fd = make_userns(ub, uc, &what);
    if (fd < 0) reply_err(rid, "userns", errno, "%s (uid range %s)", what, ub);
    return fd;
}
