/*
 * dsec-vmagent: PID 1 of a DSec microVM guest. It boots the guest (modules, disks, the
 * overlay root at /sysroot with a minimal /dev), then serves the host over the
 * virtio-serial port named "dsec.agent" (wire: agentwire.py). Single-threaded and
 * poll-based; every buffer is fixed or capped (output queue, per-exec stdin window), so
 * no guest process and no request can make it grow without bound. It survives a child
 * that floods output (per-exec credit), a fork bomb (pids.max on the sandbox cgroup,
 * oom_score_adj -1000 for itself) and a host that disconnects mid-stream (channels are
 * detached: their output is drained and dropped, their processes keep running).
 *
 * `dsec-vmagent --parse` reads one frame on stdin and prints the parsed request as JSON
 * (tests/integration/test_microvm_wire.py); it touches nothing else.
 */
#include "vmagent.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sched.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <net/if.h>
#include <net/if_arp.h>
#include <net/route.h>
#include <netinet/in.h>
#include <arpa/inet.h>
#include <sys/prctl.h>
#include <sys/mount.h>
#include <sys/reboot.h>
#include <sys/resource.h>
#include <sys/signalfd.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/statfs.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <termios.h>
#include <time.h>
#include <unistd.h>

#ifndef CAP_NET_ADMIN
#define CAP_NET_ADMIN 12 /* linux/capability.h (not in musl's headers) */
#endif

/* Kernel ABI the musl headers lack (linux/fs.h, linux/openat2.h, linux/random.h). */
#define FIFREEZE _IOWR('X', 119, int)
#define FITHAW _IOWR('X', 120, int)
#define RNDADDENTROPY _IOW('R', 0x03, int[2])
#define RNDRESEEDCRNG _IO('R', 0x07)
#ifndef SYS_openat2
#define SYS_openat2 437
#endif
#define RESOLVE_NO_MAGICLINKS 0x02
#define RESOLVE_IN_ROOT 0x10
struct open_how { uint64_t flags, mode, resolve; };
struct rand_pool_info { int entropy_count; int buf_size; uint32_t buf[]; };
#ifndef GRND_NONBLOCK
#define GRND_NONBLOCK 1
#endif

#ifndef TIOCGPTPEER
#define TIOCGPTPEER _IO('T', 0x41)
#endif

#define OUTBUF (1024 * 1024)
#define PRODUCE_LIMIT (512 * 1024)  /* producers (pipes, reads, lists) stop above this */
#define ANSWER_LIMIT (768 * 1024)   /* requests are taken only below this */
#define CG_ROOT "/sys/fs/cgroup/dsec"

/* ------------------------------------------------------------------ logging ---- */

static int kmsg = -1;

static void logk(const char *fmt, ...) {
    char buf[512];
    int n = snprintf(buf, sizeof buf, "<4>dsec-vmagent: ");
    va_list ap;
    va_start(ap, fmt);
    n += vsnprintf(buf + n, sizeof buf - (size_t)n, fmt, ap);
    va_end(ap);
    if (n > (int)sizeof buf - 1) n = sizeof buf - 1;
    if (kmsg >= 0 && write(kmsg, buf, (size_t)n) < 0) { /* nothing to do */ }
}

/* ------------------------------------------------------------------ small io ---- */

static int write_file(const char *path, const char *text) {
    int fd = open(path, O_WRONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    ssize_t n = write(fd, text, strlen(text));
    int e = errno;
    close(fd);
    errno = e;
    return n == (ssize_t)strlen(text) ? 0 : -1;
}

static ssize_t read_file(const char *path, char *buf, size_t size) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    ssize_t n = read(fd, buf, size - 1);
    close(fd);
    if (n < 0) return -1;
    buf[n] = 0;
    while (n > 0 && (buf[n - 1] == '\n' || buf[n - 1] == ' ')) buf[--n] = 0;
    return n;
}

static uint64_t now_ns(clockid_t clk) {
    struct timespec ts;
    clock_gettime(clk, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* ------------------------------------------------------------------ boot ---- */

static char boot_fail[256];  /* empty: the root is ready */
static int sysroot_fd = -1;  /* O_PATH of /sysroot: every file op resolves in it */
static int upper_fd = -1;    /* the upper disk's mount (FIFREEZE / FITHAW) */
static int devnull = -1;
static dev_t deny_dev[8];    /* /proc, /sys, /dev, /dev/pts, /dev/shm of the sandbox */
static int ndeny;
static char pids_max[24] = "1024";
static char mem_max[24] = "";  /* dsec.mem=<bytes>: the sandbox's memory limit (memory.max) */

static void fail_boot(const char *fmt, ...) {
    if (boot_fail[0]) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(boot_fail, sizeof boot_fail, fmt, ap);
    va_end(ap);
    logk("boot failed: %s\n", boot_fail);
}

static void load_modules(void) {
    char order[4096];
    if (read_file("/lib/modules/order", order, sizeof order) < 0) return;
    for (char *save = NULL, *name = strtok_r(order, "\n", &save); name; name = strtok_r(NULL, "\n", &save)) {
        char path[256];
        snprintf(path, sizeof path, "/lib/modules/%s.ko", name);
        int fd = open(path, O_RDONLY | O_CLOEXEC);
        if (fd < 0) { logk("module %s: %s\n", name, strerror(errno)); continue; }
        if (syscall(SYS_finit_module, fd, "", 0) < 0 && errno != EEXIST)
            logk("module %s: %s\n", name, strerror(errno));
        close(fd);
    }
}

static void read_cmdline(void) {
    char line[4096];
    if (read_file("/proc/cmdline", line, sizeof line) < 0) return;
    for (char *save = NULL, *w = strtok_r(line, " ", &save); w; w = strtok_r(NULL, " ", &save)) {
        if (!strncmp(w, "dsec.pids=", 10) && strlen(w + 10) < sizeof pids_max) {
            const char *v = w + 10;
            int ok = !strcmp(v, "max") || (*v && strspn(v, "0123456789") == strlen(v));
            if (ok) snprintf(pids_max, sizeof pids_max, "%s", v);
        }
        if (!strncmp(w, "dsec.mem=", 9) && strlen(w + 9) < sizeof mem_max) {
            const char *v = w + 9;
            if (*v && strspn(v, "0123456789") == strlen(v)) snprintf(mem_max, sizeof mem_max, "%s", v);
        }
    }
}

static int cg_take(char *out, size_t size);
static void cg_put(const char *cg);

/* The loopback interface up (127.0.0.1, ::1): a program that serves and calls itself on
 * localhost works as in a container. The kernel brings lo up only when something asks. */
static void loopback_up(void) {
    int fd = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0) { logk("loopback: socket: %s\n", strerror(errno)); return; }
    struct ifreq ifr;
    memset(&ifr, 0, sizeof ifr);
    snprintf(ifr.ifr_name, sizeof ifr.ifr_name, "lo");
    if (ioctl(fd, SIOCGIFFLAGS, &ifr) == 0) {
        ifr.ifr_flags |= IFF_UP | IFF_RUNNING;
        if (ioctl(fd, SIOCSIFFLAGS, &ifr) < 0) logk("loopback: up: %s\n", strerror(errno));
    } else {
        logk("loopback: %s\n", strerror(errno));
    }
    close(fd);
}

static void set_sin(struct sockaddr *sa, const char *ip) {
    struct sockaddr_in sin;
    memset(&sin, 0, sizeof sin);
    sin.sin_family = AF_INET;
    inet_pton(AF_INET, ip, &sin.sin_addr);
    memcpy(sa, &sin, sizeof sin);
}

/* eth0 (a VM given a NIC: its sandbox may have network) addressed, up and routed through the
 * gateway, whose MAC is fixed (a permanent neighbour). A clone keeps all of it from its
 * template; the host's tap answers as the gateway. Commands run without CAP_NET_ADMIN
 * (child_exec), so root inside cannot change it, as in a container. */
static void network_up(void) {
    int fd = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return;
    struct ifreq ifr;
    memset(&ifr, 0, sizeof ifr);
    snprintf(ifr.ifr_name, sizeof ifr.ifr_name, "eth0");
    if (ioctl(fd, SIOCGIFFLAGS, &ifr) < 0) { close(fd); return; } /* no NIC: no network */
    set_sin(&ifr.ifr_addr, NET_GUEST_IP);
    if (ioctl(fd, SIOCSIFADDR, &ifr) < 0) logk("eth0: address: %s\n", strerror(errno));
    set_sin(&ifr.ifr_netmask, NET_NETMASK);
    if (ioctl(fd, SIOCSIFNETMASK, &ifr) < 0) logk("eth0: netmask: %s\n", strerror(errno));
    if (ioctl(fd, SIOCGIFFLAGS, &ifr) == 0) {
        ifr.ifr_flags |= IFF_UP | IFF_RUNNING;
        if (ioctl(fd, SIOCSIFFLAGS, &ifr) < 0) logk("eth0: up: %s\n", strerror(errno));
    }
    struct arpreq ar;
    memset(&ar, 0, sizeof ar);
    set_sin(&ar.arp_pa, NET_GATEWAY_IP);
    ar.arp_ha.sa_family = ARPHRD_ETHER;
    unsigned m[6];
    if (sscanf(NET_GATEWAY_MAC, "%x:%x:%x:%x:%x:%x", &m[0], &m[1], &m[2], &m[3], &m[4], &m[5]) == 6)
        for (int i = 0; i < 6; i++) ar.arp_ha.sa_data[i] = (char)m[i];
    ar.arp_flags = ATF_PERM | ATF_COM;
    snprintf(ar.arp_dev, sizeof ar.arp_dev, "eth0");
    if (ioctl(fd, SIOCSARP, &ar) < 0) logk("eth0: gateway neighbour: %s\n", strerror(errno));
    struct rtentry rt;
    memset(&rt, 0, sizeof rt);
    set_sin(&rt.rt_dst, "0.0.0.0");
    set_sin(&rt.rt_genmask, "0.0.0.0");
    set_sin(&rt.rt_gateway, NET_GATEWAY_IP);
    rt.rt_flags = RTF_UP | RTF_GATEWAY;
    char dev[] = "eth0";
    rt.rt_dev = dev;
    if (ioctl(fd, SIOCADDRT, &rt) < 0) logk("eth0: default route: %s\n", strerror(errno));
    close(fd);
}

static void setup_cgroups(void) {
    mkdir("/sys/fs/cgroup", 0755);
    if (mount("cgroup2", "/sys/fs/cgroup", "cgroup2", MS_NOSUID | MS_NODEV | MS_NOEXEC, "nsdelegate") < 0) {
        logk("cgroup2: %s\n", strerror(errno));
        return;
    }
    if (write_file("/sys/fs/cgroup/cgroup.subtree_control", "+pids") < 0) logk("pids controller: %s\n", strerror(errno));
    write_file("/sys/fs/cgroup/cgroup.subtree_control", "+memory");
    write_file("/sys/fs/cgroup/cgroup.subtree_control", "+cpu");
    mkdir(CG_ROOT, 0755);
    write_file(CG_ROOT "/cgroup.subtree_control", "+pids");
    write_file(CG_ROOT "/cgroup.subtree_control", "+memory"); /* each exec's memory.events: its OOM kills */
    if (write_file(CG_ROOT "/pids.max", pids_max) < 0) logk("pids.max %s: %s\n", pids_max, strerror(errno));
    /* The sandbox's processes get its memory limit (the host sized the guest's RAM as that
     * plus what the kernel and this agent need): they hit their cgroup's limit, an OOM kill
     * within about a second, before the whole guest runs low, where reclaim thrashes on the
     * few file pages left (under TCG, for minutes) before the global OOM killer acts. */
    if (mem_max[0] && write_file(CG_ROOT "/memory.max", mem_max) < 0)
        logk("memory.max %s: %s\n", mem_max, strerror(errno));
    write_file(CG_ROOT "/memory.swap.max", "0");
    for (int i = 0; i < 4; i++) {  /* made before a template snapshot: clones start with them */
        char cg[64];
        if (cg_take(cg, sizeof cg) == 0) cg_put(cg);
    }
}

/* A block device's node in /dev, made from sysfs when devtmpfs has not made it yet. */
static int disk_node(const char *name, char *node, size_t size) {
    char path[128], dev[32];
    snprintf(node, size, "/dev/%.24s", name);
    snprintf(path, sizeof path, "/sys/block/%.24s/dev", name);
    unsigned ma, mi;
    if (read_file(path, dev, sizeof dev) < 0 || sscanf(dev, "%u:%u", &ma, &mi) != 2) return -1;
    if (mknod(node, S_IFBLK | 0600, makedev(ma, mi)) < 0 && errno != EEXIST) return -1;
    return 0;
}

static void mkdirs(const char *path, mode_t mode) {
    char buf[256];
    snprintf(buf, sizeof buf, "%s", path);
    for (char *p = buf + 1; *p; p++)
        if (*p == '/') { *p = 0; mkdir(buf, mode); *p = '/'; }
    mkdir(buf, mode);
}

static void deny(const char *path) {
    struct stat st;
    if (ndeny < (int)(sizeof deny_dev / sizeof deny_dev[0]) && stat(path, &st) == 0) deny_dev[ndeny++] = st.st_dev;
}

/* /sysroot's own /proc, /sys (ro), a minimal /dev and /tmp: what sandbox processes see. */
static void setup_sysroot_mounts(void) {
    static const struct { const char *name; mode_t mode; unsigned ma, mi; } nodes[] = {
        {"null", 0666, 1, 3}, {"zero", 0666, 1, 5}, {"full", 0666, 1, 7},
        {"random", 0666, 1, 8}, {"urandom", 0666, 1, 9}, {"tty", 0666, 5, 0},
    };
    mkdir("/sysroot/proc", 0555);
    mkdir("/sysroot/sys", 0555);
    mkdir("/sysroot/dev", 0755);
    if (mount("proc", "/sysroot/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL) < 0)
        return fail_boot("mount /proc: %s", strerror(errno));
    if (mount("sysfs", "/sysroot/sys", "sysfs", MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_RDONLY, NULL) < 0)
        return fail_boot("mount /sys: %s", strerror(errno));
    if (mount("tmpfs", "/sysroot/dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=0755,size=1m,nr_inodes=256") < 0)
        return fail_boot("mount /dev: %s", strerror(errno));
    for (size_t i = 0; i < sizeof nodes / sizeof nodes[0]; i++) {
        char p[64];
        snprintf(p, sizeof p, "/sysroot/dev/%s", nodes[i].name);
        if (mknod(p, S_IFCHR | nodes[i].mode, makedev(nodes[i].ma, nodes[i].mi)) < 0)
            return fail_boot("mknod %s: %s", p, strerror(errno));
        chmod(p, nodes[i].mode);
    }
    mkdir("/sysroot/dev/pts", 0755);
    mkdir("/sysroot/dev/shm", 01777);
    if (mount("devpts", "/sysroot/dev/pts", "devpts", MS_NOSUID | MS_NOEXEC, "newinstance,ptmxmode=0666,mode=0620,gid=5") < 0)
        return fail_boot("mount /dev/pts: %s", strerror(errno));
    if (mount("shm", "/sysroot/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777") < 0)
        return fail_boot("mount /dev/shm: %s", strerror(errno));
    symlink("pts/ptmx", "/sysroot/dev/ptmx");
    symlink("/proc/self/fd", "/sysroot/dev/fd");
    symlink("/proc/self/fd/0", "/sysroot/dev/stdin");
    symlink("/proc/self/fd/1", "/sysroot/dev/stdout");
    symlink("/proc/self/fd/2", "/sysroot/dev/stderr");
    /* /tmp stays on the writable disk, as in a container: what a sandbox writes there counts
     * against its disk quota, not its RAM */
    deny("/sysroot/proc");
    deny("/sysroot/sys");
    deny("/sysroot/dev");
    deny("/sysroot/dev/pts");
    deny("/sysroot/dev/shm");
}

static void setup_root(void) {
    char layer_dev[MAX_LAYERS][32], upper_dev[32] = "";
    int nlayers = 0;
    memset(layer_dev, 0, sizeof layer_dev);
    DIR *d = opendir("/sys/block");
    struct dirent *e;
    while (d && (e = readdir(d))) {
        if (strncmp(e->d_name, "vd", 2)) continue;
        char path[300], serial[64], node[32];
        snprintf(path, sizeof path, "/sys/block/%s/serial", e->d_name);
        if (read_file(path, serial, sizeof serial) < 0) continue;
        if (disk_node(e->d_name, node, sizeof node) < 0) { logk("%s: no node: %s\n", e->d_name, strerror(errno)); continue; }
        if (!strcmp(serial, "dsec-up")) {
            snprintf(upper_dev, sizeof upper_dev, "%s", node);
        } else if (!strncmp(serial, "dsec-l", 6) && serial[6] >= '0' && serial[6] <= '9') {
            int n = atoi(serial + 6);
            if (n >= 0 && n < MAX_LAYERS) {
                snprintf(layer_dev[n], sizeof layer_dev[n], "%s", node);
                if (n + 1 > nlayers) nlayers = n + 1;
            }
        }
    }
    if (d) closedir(d);
    mkdir("/sysroot", 0755);
    if (nlayers == 0) {
        if (upper_dev[0]) return fail_boot("an upper disk (dsec-up) but no layer disks (dsec-l0..)");
        /* a bare guest: the initramfs itself is the sandbox's root */
        if (mount("/", "/sysroot", NULL, MS_BIND, NULL) < 0) return fail_boot("bind /: %s", strerror(errno));
        setup_sysroot_mounts();
        return;
    }
    char lower[MAX_LAYERS * 16] = "";
    size_t off = 0;
    for (int n = nlayers - 1; n >= 0; n--) {
        char mp[32];
        if (!layer_dev[n][0]) return fail_boot("layer disk dsec-l%d is missing (layers must be l0..l%d)", n, nlayers - 1);
        snprintf(mp, sizeof mp, "/layers/%d", n);
        mkdirs(mp, 0755);
        if (mount(layer_dev[n], mp, "erofs", MS_RDONLY, NULL) < 0)
            return fail_boot("mount layer %d (%s, erofs): %s", n, layer_dev[n], strerror(errno));
        off += (size_t)snprintf(lower + off, sizeof lower - off, "%s%s", off ? ":" : "", mp);
    }
    mkdir("/upper", 0755);
    if (upper_dev[0]) {
        if (mount(upper_dev, "/upper", "ext4", MS_NOATIME, NULL) < 0)
            return fail_boot("mount the upper disk (%s, ext4): %s", upper_dev, strerror(errno));
    } else if (mount("upper", "/upper", "tmpfs", 0, "mode=0755") < 0) {
        return fail_boot("mount a tmpfs upper: %s", strerror(errno));
    }
    mkdir("/upper/u", 0755);
    mkdir("/upper/w", 0700);
    upper_fd = open("/upper", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    char opts[MAX_LAYERS * 16 + 128];
    snprintf(opts, sizeof opts, "lowerdir=%s,upperdir=/upper/u,workdir=/upper/w", lower);
    if (mount("overlay", "/sysroot", "overlay", 0, opts) < 0)
        return fail_boot("mount the overlay root: %s", strerror(errno));
    setup_sysroot_mounts();
}

static void boot(void) {
    mkdir("/proc", 0555);
    mkdir("/sys", 0555);
    mkdir("/dev", 0755);
    mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL);
    mount("sysfs", "/sys", "sysfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL);
    mount("devtmpfs", "/dev", "devtmpfs", MS_NOSUID, "mode=0755");
    kmsg = open("/dev/kmsg", O_WRONLY | O_CLOEXEC);
    write_file("/proc/self/oom_score_adj", "-1000");
    umask(0);
    load_modules();
    read_cmdline();
    setup_cgroups();
    loopback_up();
    network_up();
    devnull = open("/dev/null", O_RDWR | O_CLOEXEC);
    setup_root();
    sysroot_fd = open("/sysroot", O_PATH | O_DIRECTORY | O_CLOEXEC);
    if (sysroot_fd < 0) fail_boot("open /sysroot: %s", strerror(errno));
}

/* The dsec.agent port's /dev node, or -1 after waiting up to 10 s for it to appear. */
static int open_port(void) {
    for (int tries = 0; tries < 5000; tries++) {
        DIR *d = opendir("/sys/class/virtio-ports");
        struct dirent *e;
        while (d && (e = readdir(d))) {
            char path[300], name[64], dev[32], node[300];
            if (e->d_name[0] == '.') continue;
            snprintf(path, sizeof path, "/sys/class/virtio-ports/%s/name", e->d_name);
            if (read_file(path, name, sizeof name) < 0 || strcmp(name, "dsec.agent")) continue;
            snprintf(path, sizeof path, "/sys/class/virtio-ports/%s/dev", e->d_name);
            unsigned ma, mi;
            if (read_file(path, dev, sizeof dev) < 0 || sscanf(dev, "%u:%u", &ma, &mi) != 2) continue;
            snprintf(node, sizeof node, "/dev/%s", e->d_name);
            if (mknod(node, S_IFCHR | 0600, makedev(ma, mi)) < 0 && errno != EEXIST) continue;
            closedir(d);
            int fd = open(node, O_RDWR | O_NONBLOCK | O_CLOEXEC);
            if (fd < 0) { logk("open %s: %s\n", node, strerror(errno)); return -1; }
            fcntl(fd, F_SETOWN, getpid());
            fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_ASYNC);
            return fd;
        }
        if (d) closedir(d);
        usleep(2000);
    }
    return -1;
}

/* ------------------------------------------------------------ output queue ---- */

static uint8_t outq[OUTBUF];
static size_t out_head, out_tail;

static size_t out_used(void) { return out_tail - out_head; }

static void out_compact(void) {
    if (out_head == 0) return;
    memmove(outq, outq + out_head, out_tail - out_head);
    out_tail -= out_head;
    out_head = 0;
}

/* Room for a payload of `len` after a header (the caller keeps within the limits). */
static uint8_t *frame_begin(size_t len) {
    if (OUTBUF - out_tail < HDR_LEN + len) out_compact();
    if (OUTBUF - out_tail < HDR_LEN + len) return NULL;
    return outq + out_tail + HDR_LEN;
}

static void frame_end(uint8_t type, uint32_t chan, size_t len) {
    uint8_t *h = outq + out_tail;
    put_u32le(h, (uint32_t)len);
    put_u32le(h + 4, chan);
    h[8] = type;
    out_tail += HDR_LEN + len;
}

static void emit(uint8_t type, uint32_t chan, const void *payload, size_t len) {
    uint8_t *p = frame_begin(len);
    if (!p) { logk("output queue full: frame %c dropped\n", type); return; }
    if (len) memcpy(p, payload, len);
    frame_end(type, chan, len);
}

/* Token payloads ("ok\0key\0val\0..."), at most MAX_FRAME bytes. */
struct tb { uint8_t b[MAX_FRAME]; size_t n; int over; };
static struct tb tb;

static void tb_reset(const char *first) { tb.n = 0; tb.over = 0; size_t l = strlen(first) + 1; memcpy(tb.b, first, l); tb.n = l; }
static void tb_str(const char *s) {
    size_t l = strlen(s) + 1;
    if (tb.n + l > sizeof tb.b) { tb.over = 1; return; }
    memcpy(tb.b + tb.n, s, l);
    tb.n += l;
}
static void tb_kv(const char *k, const char *v) { tb_str(k); tb_str(v); }
static void tb_ku(const char *k, uint64_t v) { char s[24]; snprintf(s, sizeof s, "%llu", (unsigned long long)v); tb_kv(k, s); }
static void tb_emit(uint8_t type, uint32_t chan) {
    if (tb.over) { logk("answer on %u too large: dropped\n", chan); return; }
    emit(type, chan, tb.b, tb.n);
}

static void answer_err(uint32_t chan, int err, const char *fmt, ...) {
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    tb_reset("err");
    tb_ku("errno", (uint64_t)err);
    tb_kv("msg", msg);
    tb_emit(T_ANSWER, chan);
}

static void answer_ok(uint32_t chan) { tb_reset("ok"); tb_emit(T_ANSWER, chan); }

static void emit_u32(uint8_t type, uint32_t chan, uint32_t v) {
    uint8_t b[4];
    put_u32le(b, v);
    emit(type, chan, b, 4);
}

/* ------------------------------------------------------------------ channels ---- */

enum ckind { C_FREE, C_EXEC, C_READ, C_LIST, C_WRITE };

struct chan {
    enum ckind kind;
    uint32_t id;
    int detached;        /* the host that asked is gone: output is dropped */
    uint64_t credit;     /* output bytes the host will take */
    /* exec */
    pid_t pid;
    int out_fd, err_fd, in_fd, tty;
    int exited, status;
    struct rusage ru;
    uint8_t *ibuf;       /* STDIN_WINDOW bytes, while stdin is open */
    size_t ilen;
    int ieof, idead;
    char cg[64];
    uint64_t oom0, pidsmax0; /* the OOM-kill and pids-limit counters when it started */
    /* read, list, write */
    int fd, dirfd;
    DIR *dir;
    uint64_t max, done;
    char tmp[64], name[NAME_MAX + 1];
    int werr;
};

static struct chan chans[MAX_CHANS];

static struct chan *chan_find(uint32_t id) {
    for (int i = 0; i < MAX_CHANS; i++)
        if (chans[i].kind != C_FREE && chans[i].id == id && !chans[i].detached) return &chans[i];
    return NULL;
}

static struct chan *chan_new(uint32_t id, enum ckind kind) {
    for (int i = 0; i < MAX_CHANS; i++)
        if (chans[i].kind == C_FREE) {
            struct chan *c = &chans[i];
            memset(c, 0, sizeof *c);
            c->kind = kind;
            c->id = id;
            c->out_fd = c->err_fd = c->in_fd = c->fd = c->dirfd = -1;
            return c;
        }
    return NULL;
}

static void closefd(int *fd) { if (*fd >= 0) close(*fd); *fd = -1; }

static void stdin_close(struct chan *c) {
    if (!c->tty) closefd(&c->in_fd);
    c->in_fd = -1;
    free(c->ibuf);
    c->ibuf = NULL;
    c->ilen = 0;
}

/* Each exec runs in a cgroup of its own (a tree kill is cgroup.kill). Making and removing
 * one costs about 7 ms under TCG, so empty ones are kept for the next exec (up to
 * CG_POOL); those whose processes outlived their exec wait in `stale` until empty. */
#define CG_POOL 32
static char cg_pool[CG_POOL][64], cg_stale[64][64];
static unsigned cg_next;

/* One counter of a cgroup events file ("oom_kill 3", "max 1"); 0 when absent. */
static uint64_t cg_event(const char *file, const char *key) {
    char buf[512];
    if (read_file(file, buf, sizeof buf) < 0) return 0;
    size_t kl = strlen(key);
    for (char *line = buf; line && *line; line = strchr(line, '\n') ? strchr(line, '\n') + 1 : NULL)
        if (!strncmp(line, key, kl) && line[kl] == ' ') return strtoull(line + kl + 1, NULL, 10);
    return 0;
}

static uint64_t cg_oom_kills(const char *cg) {
    char p[96];
    snprintf(p, sizeof p, "%s/memory.events", cg);
    return cg_event(p, "oom_kill");
}

static int cg_empty(const char *cg) {
    char p[96], buf[128];
    snprintf(p, sizeof p, "%s/cgroup.events", cg);
    if (read_file(p, buf, sizeof buf) < 0) return errno == ENOENT ? 1 : 0;
    return strstr(buf, "populated 0") != NULL;
}

static void cg_put(const char *cg) {
    for (int i = 0; i < CG_POOL; i++)
        if (!cg_pool[i][0]) { snprintf(cg_pool[i], sizeof cg_pool[i], "%.63s", cg); return; }
    rmdir(cg);
}

static int cg_take(char *out, size_t size) {
    for (int i = 0; i < CG_POOL; i++)
        if (cg_pool[i][0]) {
            snprintf(out, size, "%s", cg_pool[i]);
            cg_pool[i][0] = 0;
            return 0;
        }
    snprintf(out, size, CG_ROOT "/x%u", cg_next++);
    return mkdir(out, 0755) < 0 && errno != EEXIST ? -1 : 0;
}

static void cg_release(const char *cg) {
    if (!cg[0]) return;
    if (cg_empty(cg)) { cg_put(cg); return; }
    for (int i = 0; i < 64; i++)
        if (!cg_stale[i][0]) { snprintf(cg_stale[i], sizeof cg_stale[i], "%.63s", cg); return; }
}

static void cg_sweep(void) {
    for (int i = 0; i < 64; i++)
        if (cg_stale[i][0] && cg_empty(cg_stale[i])) { cg_put(cg_stale[i]); cg_stale[i][0] = 0; }
}

static void chan_free(struct chan *c) {
    closefd(&c->out_fd);
    if (!c->tty) closefd(&c->err_fd);
    stdin_close(c);
    closefd(&c->fd);
    closefd(&c->dirfd);
    if (c->dir) closedir(c->dir);
    c->dir = NULL;
    if (c->kind == C_EXEC) cg_release(c->cg);
    c->cg[0] = 0;
    c->kind = C_FREE;
}

/* ------------------------------------------------------------------ files ---- */

static int in_root_at(int dirfd, const char *rel, int flags, mode_t mode) {
    struct open_how how = {.flags = (uint64_t)(flags | O_CLOEXEC), .mode = mode,
                           .resolve = RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS};
    for (int i = 0; i < 1000; i++) {
        long fd = syscall(SYS_openat2, dirfd, rel, &how, sizeof how);
        if (fd >= 0) return (int)fd;
        if (errno != EAGAIN && errno != EINTR) return -1;
    }
    return -1;
}

static int denied_dev(dev_t dev) {
    for (int i = 0; i < ndeny; i++)
        if (deny_dev[i] == dev) return 1;
    return 0;
}

/* Resolve in the sandbox root; /proc, /sys and /dev (and below) are refused (EXDEV). */
static int in_root(const char *rel, int flags, mode_t mode) {
    int fd = in_root_at(sysroot_fd, *rel ? rel : ".", flags, mode);
    struct stat st;
    if (fd >= 0 && fstat(fd, &st) == 0 && denied_dev(st.st_dev)) { close(fd); errno = EXDEV; return -1; }
    return fd;
}

/* Lexically normalise an absolute path into a relative one ("" is the root). */
static int norm(const char *in, char *out, size_t size) {
    size_t n = 0;
    const char *p = in;
    while (*p) {
        while (*p == '/') p++;
        const char *s = p;
        while (*p && *p != '/') p++;
        size_t l = (size_t)(p - s);
        if (l == 0 || (l == 1 && s[0] == '.')) continue;
        if (l == 2 && s[0] == '.' && s[1] == '.') {
            while (n > 0 && out[n - 1] != '/') n--;
            if (n > 0) n--;
            continue;
        }
        if (n + l + 2 > size) { errno = ENAMETOOLONG; return -1; }
        if (n) out[n++] = '/';
        memcpy(out + n, s, l);
        n += l;
    }
    out[n] = 0;
    return 0;
}

/* The parent directory's fd and the final name of a normalised non-root path. */
static int parent_of(const char *rel, char *name, size_t size) {
    if (!*rel) { errno = EBUSY; return -1; }
    const char *slash = strrchr(rel, '/');
    char head[MAX_PATH];
    if (slash) {
        memcpy(head, rel, (size_t)(slash - rel));
        head[slash - rel] = 0;
    } else {
        head[0] = 0;
    }
    const char *base = slash ? slash + 1 : rel;
    if (strlen(base) >= size) { errno = ENAMETOOLONG; return -1; }
    strcpy(name, base);
    return in_root(head, O_PATH | O_DIRECTORY, 0);
}

static char kind_of(mode_t m) { return S_ISREG(m) ? 'f' : S_ISDIR(m) ? 'd' : S_ISLNK(m) ? 'l' : 'o'; }

static void tb_stat(const struct stat *st, int dirfd, const char *name) {
    char t[2] = {kind_of(st->st_mode), 0};
    tb_kv("type", t);
    tb_ku("size", (uint64_t)st->st_size);
    tb_ku("mode", st->st_mode & 07777);
    tb_ku("uid", st->st_uid);
    tb_ku("gid", st->st_gid);
    tb_ku("mtime_ns", (uint64_t)st->st_mtim.tv_sec * 1000000000ull + (uint64_t)st->st_mtim.tv_nsec);
    if (S_ISLNK(st->st_mode)) {
        char target[MAX_PATH];
        ssize_t n = readlinkat(dirfd, name, target, sizeof target - 1);
        if (n >= 0) { target[n] = 0; tb_kv("target", target); }
    }
}

#define FAIL(c, what) do { answer_err((c), errno, "%s: %s", (what), strerror(errno)); goto out; } while (0)

static void do_stat(struct req *r) {
    char rel[MAX_PATH], name[NAME_MAX + 1];
    struct stat st;
    int fd = -1;
    if (norm(r->path, rel, sizeof rel) < 0) FAIL(r->chan, "stat");
    if (!*rel || r->follow) {
        if ((fd = in_root(rel, O_PATH, 0)) < 0 || fstat(fd, &st) < 0) FAIL(r->chan, "stat");
        tb_reset("ok");
        tb_stat(&st, fd, "");
    } else {
        if ((fd = parent_of(rel, name, sizeof name)) < 0) FAIL(r->chan, "stat");
        if (fstatat(fd, name, &st, AT_SYMLINK_NOFOLLOW) < 0) FAIL(r->chan, "stat");
        if (denied_dev(st.st_dev)) { errno = EXDEV; FAIL(r->chan, "stat"); }
        tb_reset("ok");
        tb_stat(&st, fd, name);
    }
    tb_emit(T_ANSWER, r->chan);
out:
    if (fd >= 0) close(fd);
}

static void do_list(struct req *r) {
    char rel[MAX_PATH];
    int fd = -1;
    if (norm(r->path, rel, sizeof rel) < 0) FAIL(r->chan, "list");
    if ((fd = in_root(rel, O_RDONLY | O_DIRECTORY, 0)) < 0) FAIL(r->chan, "list");
    struct chan *c = chan_new(r->chan, C_LIST);
    if (!c) { errno = EAGAIN; FAIL(r->chan, "list: too many open channels"); }
    c->dir = fdopendir(fd);
    if (!c->dir) { c->kind = C_FREE; FAIL(r->chan, "list"); }
    return;
out:
    if (fd >= 0) close(fd);
}

/* Emit list entries while there is room; the final ok when the directory is done. */
static void list_step(struct chan *c) {
    struct dirent *e;
    while (out_used() < PRODUCE_LIMIT) {
        errno = 0;
        if (!(e = readdir(c->dir))) {
            if (errno) answer_err(c->id, errno, "list: %s", strerror(errno));
            else answer_ok(c->id);
            chan_free(c);
            return;
        }
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        struct stat st;
        if (fstatat(dirfd(c->dir), e->d_name, &st, AT_SYMLINK_NOFOLLOW) < 0) continue;
        tb_reset("n");
        tb_str(e->d_name);
        tb_stat(&st, dirfd(c->dir), e->d_name);
        tb_emit(T_DIRENT, c->id);
    }
}

static void do_read(struct req *r) {
    char rel[MAX_PATH];
    struct stat st;
    int fd = -1;
    if (norm(r->path, rel, sizeof rel) < 0) FAIL(r->chan, "read");
    if ((fd = in_root(rel, O_RDONLY | O_NONBLOCK, 0)) < 0) FAIL(r->chan, "read");
    if (fstat(fd, &st) < 0) FAIL(r->chan, "read");
    if (S_ISDIR(st.st_mode)) { errno = EISDIR; FAIL(r->chan, "read"); }
    if (!S_ISREG(st.st_mode)) { answer_err(r->chan, EINVAL, "read: not a regular file"); goto out; }
    if ((uint64_t)st.st_size > r->max) {
        answer_err(r->chan, EFBIG, "read: %llu bytes, over the %llu asked for", (unsigned long long)st.st_size,
                   (unsigned long long)r->max);
        goto out;
    }
    struct chan *c = chan_new(r->chan, C_READ);
    if (!c) { errno = EAGAIN; FAIL(r->chan, "read: too many open channels"); }
    c->fd = fd;
    c->max = r->max;
    c->credit = r->win;
    return;
out:
    if (fd >= 0) close(fd);
}

static void read_step(struct chan *c) {
    while (c->credit > 0 && out_used() < PRODUCE_LIMIT) {
        size_t want = c->credit < MAX_FRAME ? (size_t)c->credit : MAX_FRAME;
        uint8_t *p = frame_begin(want);
        if (!p) return;
        ssize_t n = read(c->fd, p, want);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) { answer_err(c->id, errno, "read: %s", strerror(errno)); chan_free(c); return; }
        if (n == 0) {
            tb_reset("ok");
            tb_ku("size", c->done);
            tb_emit(T_ANSWER, c->id);
            chan_free(c);
            return;
        }
        if (c->done + (uint64_t)n > c->max) {
            answer_err(c->id, EFBIG, "read: grew past %llu bytes while read", (unsigned long long)c->max);
            chan_free(c);
            return;
        }
        frame_end(T_STDOUT, c->id, (size_t)n);
        c->done += (uint64_t)n;
        c->credit -= (uint64_t)n;
    }
}

static uint32_t rand32(void) {
    uint32_t v = 0;
    if (syscall(SYS_getrandom, &v, sizeof v, GRND_NONBLOCK) != sizeof v) v = (uint32_t)now_ns(CLOCK_MONOTONIC);
    return v;
}

/* Open the file a write lands in: a temporary beside it (renamed over it at the end),
 * or the file itself to append. Fills c->fd, c->dirfd, c->tmp, c->name. */
static int write_open(struct chan *c, const char *path, uint32_t mode, uint32_t uid, uint32_t gid, int append) {
    char rel[MAX_PATH];
    if (norm(path, rel, sizeof rel) < 0) return -1;
    if ((c->dirfd = parent_of(rel, c->name, sizeof c->name)) < 0) return -1;
    if (append) {
        int created = 1;
        c->fd = openat(c->dirfd, c->name, O_WRONLY | O_APPEND | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, mode);
        if (c->fd < 0 && errno == EEXIST) {
            created = 0;
            c->fd = openat(c->dirfd, c->name, O_WRONLY | O_APPEND | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
        }
        if (c->fd < 0) return -1;
        struct stat st;
        if (fstat(c->fd, &st) < 0) return -1;
        if (!S_ISREG(st.st_mode)) { errno = EINVAL; return -1; }
        if (created && (fchown(c->fd, uid, gid) < 0 || fchmod(c->fd, mode) < 0)) return -1;
        return 0;
    }
    snprintf(c->tmp, sizeof c->tmp, ".dsec-w-%u-%08x", c->id, rand32());
    c->fd = openat(c->dirfd, c->tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, mode);
    if (c->fd < 0) { c->tmp[0] = 0; return -1; }
    if (fchown(c->fd, uid, gid) < 0 || fchmod(c->fd, mode) < 0) return -1;
    return 0;
}

static void write_abort(struct chan *c) {
    if (c->tmp[0] && c->dirfd >= 0) unlinkat(c->dirfd, c->tmp, 0);
    c->tmp[0] = 0;
    chan_free(c);
}

static void do_write(struct req *r) {
    struct chan *c = chan_new(r->chan, C_WRITE);
    if (!c) { answer_err(r->chan, EAGAIN, "write: too many open channels"); return; }
    if (write_open(c, r->path, r->mode, r->uid, r->gid, r->append) < 0) {
        answer_err(r->chan, errno, "write: %s", strerror(errno));
        write_abort(c);
    }
}

/* Bytes of an upload ('I'); the empty one ends it. Acknowledged at once with 'J'. */
static void write_input(struct chan *c, const uint8_t *p, uint32_t len) {
    if (len == 0) {
        if (!c->werr && c->tmp[0] && renameat(c->dirfd, c->tmp, c->dirfd, c->name) < 0) c->werr = errno;
        if (!c->werr) c->tmp[0] = 0;
        if (c->werr) {
            answer_err(c->id, c->werr, "write: %s", strerror(c->werr));
        } else {
            tb_reset("ok");
            tb_ku("n", c->done);
            tb_emit(T_ANSWER, c->id);
        }
        write_abort(c);
        return;
    }
    for (uint32_t off = 0; !c->werr && off < len;) {
        ssize_t n = write(c->fd, p + off, len - off);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) { c->werr = errno; break; }
        off += (uint32_t)n;
        c->done += (uint64_t)n;
    }
    emit_u32(T_INCREDIT, c->id, len);
    if (c->werr) {  /* say so now: the host stops sending */
        answer_err(c->id, c->werr, "write: %s", strerror(c->werr));
        write_abort(c);
    }
}

static void chown_new(int dirfd, const char *name, uint32_t uid, uint32_t gid) {
    if (fchownat(dirfd, name, uid, gid, AT_SYMLINK_NOFOLLOW) < 0) logk("chown %s: %s\n", name, strerror(errno));
}

static void do_mkdir(struct req *r) {
    char rel[MAX_PATH], name[NAME_MAX + 1];
    int fd = -1;
    if (norm(r->path, rel, sizeof rel) < 0) FAIL(r->chan, "mkdir");
    if (!*rel) {
        if (r->parents) answer_ok(r->chan);
        else answer_err(r->chan, EEXIST, "mkdir: %s", strerror(EEXIST));
        return;
    }
    size_t len = strlen(rel);
    for (size_t i = r->parents ? 0 : len; i <= len; i++) {
        if (i < len && rel[i] != '/') continue;
        char sub[MAX_PATH];
        memcpy(sub, rel, i);
        sub[i] = 0;
        if (!*sub) continue;
        if ((fd = parent_of(sub, name, sizeof name)) < 0) FAIL(r->chan, "mkdir");
        if (mkdirat(fd, name, r->mode) == 0) {
            chown_new(fd, name, r->uid, r->gid);
        } else {
            struct stat st;
            if (errno != EEXIST || !r->parents) FAIL(r->chan, "mkdir");
            if (fstatat(fd, name, &st, 0) < 0) FAIL(r->chan, "mkdir");
            if (!S_ISDIR(st.st_mode)) { errno = ENOTDIR; FAIL(r->chan, "mkdir"); }
        }
        close(fd);
        fd = -1;
    }
    answer_ok(r->chan);
out:
    if (fd >= 0) close(fd);
}

/* Remove a directory tree below dirfd/name; never crosses into another filesystem. */
static int rm_tree(int dirfd, const char *name, dev_t dev, int depth) {
    if (depth > 256) { errno = ELOOP; return -1; }
    int fd = openat(dirfd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) return -1;
    struct stat st;
    if (fstat(fd, &st) < 0 || st.st_dev != dev) { close(fd); errno = EXDEV; return -1; }
    DIR *d = fdopendir(fd);
    if (!d) { close(fd); return -1; }
    struct dirent *e;
    int rc = 0;
    while (rc == 0 && (e = readdir(d))) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        if (unlinkat(fd, e->d_name, 0) == 0) continue;
        if (errno != EISDIR) { rc = -1; break; }
        rc = rm_tree(fd, e->d_name, dev, depth + 1);
    }
    int e2 = errno;
    closedir(d);
    errno = e2;
    if (rc == 0 && unlinkat(dirfd, name, AT_REMOVEDIR) < 0) return -1;
    return rc;
}

static void do_remove(struct req *r) {
    char rel[MAX_PATH], name[NAME_MAX + 1];
    int fd = -1;
    struct stat st, pst;
    if (norm(r->path, rel, sizeof rel) < 0) FAIL(r->chan, "remove");
    if ((fd = parent_of(rel, name, sizeof name)) < 0) FAIL(r->chan, "remove");
    if (fstatat(fd, name, &st, AT_SYMLINK_NOFOLLOW) < 0 || fstat(fd, &pst) < 0) FAIL(r->chan, "remove");
    if (denied_dev(st.st_dev)) { errno = EXDEV; FAIL(r->chan, "remove"); }
    if (!S_ISDIR(st.st_mode)) {
        if (unlinkat(fd, name, 0) < 0) FAIL(r->chan, "remove");
    } else if (!r->recursive) {
        if (unlinkat(fd, name, AT_REMOVEDIR) < 0) FAIL(r->chan, "remove");
    } else {
        if (st.st_dev != pst.st_dev) { errno = EBUSY; FAIL(r->chan, "remove"); }
        if (rm_tree(fd, name, st.st_dev, 0) < 0) FAIL(r->chan, "remove");
    }
    answer_ok(r->chan);
out:
    if (fd >= 0) close(fd);
}

static void do_rename(struct req *r) {
    char rs[MAX_PATH], rd[MAX_PATH], ns[NAME_MAX + 1], nd[NAME_MAX + 1];
    int fs = -1, fd = -1;
    if (norm(r->path, rs, sizeof rs) < 0 || norm(r->path2, rd, sizeof rd) < 0) FAIL(r->chan, "rename");
    if ((fs = parent_of(rs, ns, sizeof ns)) < 0) FAIL(r->chan, "rename");
    if ((fd = parent_of(rd, nd, sizeof nd)) < 0) FAIL(r->chan, "rename");
    if (renameat(fs, ns, fd, nd) < 0) FAIL(r->chan, "rename");
    answer_ok(r->chan);
out:
    if (fs >= 0) close(fs);
    if (fd >= 0) close(fd);
}

/* Replace a file of the sandbox (root-owned, 0644), /etc created when missing. */
static int put_file(const char *path, const char *text) {
    struct chan c;
    memset(&c, 0, sizeof c);
    c.fd = c.dirfd = -1;
    c.id = 0;
    int rc = -1;
    mkdirat(sysroot_fd, "etc", 0755);
    if (write_open(&c, path, 0644, 0, 0, 0) == 0) {
        size_t len = strlen(text);
        if (write(c.fd, text, len) == (ssize_t)len && renameat(c.dirfd, c.tmp, c.dirfd, c.name) == 0) {
            c.tmp[0] = 0;
            rc = 0;
        }
    }
    int e = errno;
    if (c.tmp[0] && c.dirfd >= 0) unlinkat(c.dirfd, c.tmp, 0);
    if (c.fd >= 0) close(c.fd);
    if (c.dirfd >= 0) close(c.dirfd);
    errno = e;
    return rc;
}

static void do_identity(struct req *r) {
    static union { struct rand_pool_info info; uint8_t raw[sizeof(struct rand_pool_info) + MAX_SEED]; } pool;
    int fd = open("/dev/urandom", O_RDWR | O_CLOEXEC);
    if (fd < 0) FAIL(r->chan, "identity: /dev/urandom");
    if (r->seedlen) {
        pool.info.entropy_count = (int)(r->seedlen * 8);
        pool.info.buf_size = (int)r->seedlen;
        memcpy(pool.info.buf, r->seed, r->seedlen);
        if (ioctl(fd, RNDADDENTROPY, &pool.info) < 0) FAIL(r->chan, "identity: RNDADDENTROPY");
    }
    if (ioctl(fd, RNDRESEEDCRNG) < 0) FAIL(r->chan, "identity: RNDRESEEDCRNG");
    if (r->has_realtime) {
        struct timespec ts = {.tv_sec = (time_t)(r->realtime_ns / 1000000000ull),
                              .tv_nsec = (long)(r->realtime_ns % 1000000000ull)};
        if (clock_settime(CLOCK_REALTIME, &ts) < 0) FAIL(r->chan, "identity: clock_settime");
    }
    if (sethostname(r->hostname, strlen(r->hostname)) < 0) FAIL(r->chan, "identity: sethostname");
    char text[512];
    snprintf(text, sizeof text, "%s\n", r->hostname);
    if (put_file("/etc/hostname", text) < 0) FAIL(r->chan, "identity: /etc/hostname");
    snprintf(text, sizeof text, "%s\n", r->machine_id);
    if (put_file("/etc/machine-id", text) < 0) FAIL(r->chan, "identity: /etc/machine-id");
    snprintf(text, sizeof text, "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n127.0.1.1\t%s\n",
             r->hostname);
    if (put_file("/etc/hosts", text) < 0) FAIL(r->chan, "identity: /etc/hosts");
    answer_ok(r->chan);
out:
    if (fd >= 0) close(fd);
}

static void do_sync(struct req *r) {
    sync();
    if (r->freeze == 1 || r->freeze == 0) {
        if (upper_fd < 0) { answer_err(r->chan, ENODEV, "sync: no upper disk to freeze"); return; }
        if (r->freeze && ioctl(upper_fd, FIFREEZE, 0) < 0 && errno != EBUSY) {
            answer_err(r->chan, errno, "sync: FIFREEZE: %s", strerror(errno));
            return;
        }
        if (!r->freeze && ioctl(upper_fd, FITHAW, 0) < 0 && errno != EINVAL) {
            answer_err(r->chan, errno, "sync: FITHAW: %s", strerror(errno));
            return;
        }
    }
    answer_ok(r->chan);
}

/* ------------------------------------------------------------------ exec ---- */

struct child_report { int stage; int err; };
enum { ST_SETUP, ST_CWD, ST_USER, ST_EXEC };
static const char *const stage_names[] = {"setup", "cwd", "user", "exec"};

static const char *env_path(struct req *r) {
    for (int i = 0; i < r->envc; i++)
        if (!strncmp(r->env[i], "PATH=", 5)) return r->env[i] + 5;
    return DEFAULT_PATH;
}

static void child_fail(int report, int stage) {
    struct child_report rep = {stage, errno};
    if (write(report, &rep, sizeof rep) < 0) { /* the parent sees EOF and a dead child */ }
    _exit(127);
}

/* execvpe with the request's PATH, and no shell fallback. */
static void exec_search(struct req *r) {
    const char *file = r->argv[0];
    char *const *argv = (char *const *)r->argv, *const *envp = (char *const *)r->env;
    if (strchr(file, '/')) { execve(file, argv, envp); return; }
    const char *path = env_path(r);
    int seen_eacces = 0;
    size_t fl = strlen(file);
    for (const char *p = path;; p++) {
        const char *z = strchrnul(p, ':');
        char buf[MAX_PATH + NAME_MAX + 2];
        size_t dl = (size_t)(z - p);
        if (dl + fl + 2 <= sizeof buf) {
            memcpy(buf, p, dl);
            buf[dl] = '/';
            memcpy(buf + dl + (dl ? 1 : 0), file, fl + 1);
            if (!dl) memcpy(buf, file, fl + 1);
            execve(buf, argv, envp);
            if (errno == EACCES) seen_eacces = 1;
            else if (errno != ENOENT && errno != ENOTDIR) return;
        }
        if (!*z) break;
        p = z;
    }
    errno = seen_eacces ? EACCES : ENOENT;
}

static void child_exec(struct req *r, struct chan *c, int report, int in_r, int out_w, int err_w, int slave) {
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);
    signal(SIGPIPE, SIG_DFL);
    if (setsid() < 0) child_fail(report, ST_SETUP);
    char procs[96];
    snprintf(procs, sizeof procs, "%s/cgroup.procs", c->cg);
    if (write_file(procs, "0") < 0) child_fail(report, ST_SETUP);
    write_file("/proc/self/oom_score_adj", "0");
    if (slave >= 0) {
        if (dup2(slave, 0) < 0 || dup2(slave, 1) < 0 || dup2(slave, 2) < 0) child_fail(report, ST_SETUP);
        if (ioctl(0, TIOCSCTTY, 0) < 0) child_fail(report, ST_SETUP);
    } else {
        if (dup2(in_r >= 0 ? in_r : devnull, 0) < 0 || dup2(out_w, 1) < 0 || dup2(err_w, 2) < 0)
            child_fail(report, ST_SETUP);
    }
    umask(022);
    if (chroot("/sysroot") < 0 || chdir("/") < 0) child_fail(report, ST_SETUP);
    if (chdir(r->cwd) < 0) child_fail(report, ST_CWD);
    /* The guest's network is the host's to set (network_up): no command may change it. */
    if (prctl(PR_CAPBSET_DROP, CAP_NET_ADMIN, 0, 0, 0) < 0) child_fail(report, ST_SETUP);
    if (setgroups(0, NULL) < 0 || setgid(r->gid) < 0 || setuid(r->uid) < 0) child_fail(report, ST_USER);
    exec_search(r);
    child_fail(report, ST_EXEC);
}

struct spawn { struct req *r; struct chan *c; int report, in_r, out_w, err_w, slave; };
static uint8_t child_stack[64 * 1024] __attribute__((aligned(16)));

static int spawn_child(void *arg) {
    struct spawn *sp = arg;
    child_exec(sp->r, sp->c, sp->report, sp->in_r, sp->out_w, sp->err_w, sp->slave);
    return 127;
}

static void do_exec(struct req *r) {
    int report[2] = {-1, -1}, in[2] = {-1, -1}, out[2] = {-1, -1}, err[2] = {-1, -1};
    int master = -1, slave = -1;
    struct chan *c = NULL;
    if (boot_fail[0]) { answer_err(r->chan, EIO, "exec: the guest did not boot: %s", boot_fail); return; }
    if (chan_find(r->chan)) { answer_err(r->chan, EEXIST, "exec: channel %u is in use", r->chan); return; }
    if (!(c = chan_new(r->chan, C_EXEC))) { answer_err(r->chan, EAGAIN, "exec: too many open channels"); return; }
    if (cg_take(c->cg, sizeof c->cg) < 0) { c->cg[0] = 0; FAIL(r->chan, "exec: cgroup"); }
    c->oom0 = cg_oom_kills(c->cg);
    c->pidsmax0 = cg_event(CG_ROOT "/pids.events", "max");
    if (pipe2(report, O_CLOEXEC) < 0) FAIL(r->chan, "exec: pipe");
    if (r->tty) {
        struct winsize ws = {.ws_row = (unsigned short)r->rows, .ws_col = (unsigned short)r->cols};
        int unlock = 0;
        if ((master = open("/sysroot/dev/pts/ptmx", O_RDWR | O_NOCTTY | O_CLOEXEC | O_NONBLOCK)) < 0) FAIL(r->chan, "exec: ptmx");
        if (ioctl(master, TIOCSPTLCK, &unlock) < 0) FAIL(r->chan, "exec: unlockpt");
        if ((slave = ioctl(master, TIOCGPTPEER, O_RDWR | O_NOCTTY | O_CLOEXEC)) < 0) FAIL(r->chan, "exec: pty peer");
        if (ioctl(master, TIOCSWINSZ, &ws) < 0) FAIL(r->chan, "exec: pty size");
    } else {
        if (pipe2(out, O_CLOEXEC) < 0 || pipe2(err, O_CLOEXEC) < 0) FAIL(r->chan, "exec: pipe");
        if (r->with_stdin && pipe2(in, O_CLOEXEC) < 0) FAIL(r->chan, "exec: pipe");
    }
    /* vfork-like (as posix_spawn): no copy-on-write of the agent, whose page faults and
     * TLB flushes are dear under TCG; the agent waits until the child has exec'd or died. */
    struct spawn sp = {r, c, report[1], in[0], out[1], err[1], slave};
    pid_t pid = clone(spawn_child, child_stack + sizeof child_stack, CLONE_VM | CLONE_VFORK | SIGCHLD, &sp);
    if (pid < 0) FAIL(r->chan, "exec: clone");
    closefd(&report[1]);
    closefd(&in[0]);
    closefd(&out[1]);
    closefd(&err[1]);
    closefd(&slave);
    struct child_report rep;
    ssize_t n;
    do n = read(report[0], &rep, sizeof rep); while (n < 0 && errno == EINTR);
    closefd(&report[0]);
    if (n != 0) {
        int status;
        while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {}
        if (n != (ssize_t)sizeof rep) rep.stage = ST_SETUP, rep.err = EIO;
        tb_reset("err");
        tb_ku("errno", (uint64_t)rep.err);
        char msg[MAX_PATH + 128];
        if (rep.stage == ST_EXEC) snprintf(msg, sizeof msg, "%.4000s: %s", r->argv[0], strerror(rep.err));
        else if (rep.stage == ST_CWD) snprintf(msg, sizeof msg, "cwd %.4000s: %s", r->cwd, strerror(rep.err));
        else if (rep.stage == ST_USER) snprintf(msg, sizeof msg, "uid %u gid %u: %s", r->uid, r->gid, strerror(rep.err));
        else snprintf(msg, sizeof msg, "setting up the process: %s", strerror(rep.err));
        tb_kv("msg", msg);
        tb_kv("stage", stage_names[rep.stage]);
        tb_emit(T_ANSWER, r->chan);
        goto out;
    }
    c->pid = pid;
    c->credit = r->win;
    if (r->tty) {
        c->tty = 1;
        c->out_fd = master;
        c->in_fd = r->with_stdin ? master : -1;
        master = -1;
    } else {
        c->out_fd = out[0];
        c->err_fd = err[0];
        c->in_fd = in[1];
        out[0] = err[0] = in[1] = -1;
        fcntl(c->out_fd, F_SETFL, O_NONBLOCK);
        fcntl(c->err_fd, F_SETFL, O_NONBLOCK);
        if (c->in_fd >= 0) fcntl(c->in_fd, F_SETFL, O_NONBLOCK);
    }
    if (r->with_stdin) c->idead = 0; else c->idead = 1;
    tb_reset("ok");
    tb_ku("pid", (uint64_t)pid);
    tb_emit(T_ANSWER, r->chan);
    return;
out:
    closefd(&report[0]); closefd(&report[1]);
    closefd(&in[0]); closefd(&in[1]);
    closefd(&out[0]); closefd(&out[1]);
    closefd(&err[0]); closefd(&err[1]);
    closefd(&master); closefd(&slave);
    if (c) chan_free(c);
}

static struct chan *exec_chan(uint32_t ch) {
    struct chan *c = chan_find(ch);
    return c && c->kind == C_EXEC ? c : NULL;
}

static void do_signal(struct req *r) {
    struct chan *c = exec_chan(r->ch);
    if (!c || c->exited) { answer_err(r->chan, ESRCH, "signal: no running process on channel %u", r->ch); return; }
    if (!r->tree) {
        /* on a terminal: its foreground job, as ^C would reach (the exec's own process when
         * the pty says none) */
        pid_t fg = c->tty && c->out_fd >= 0 ? tcgetpgrp(c->out_fd) : -1;
        if (fg > 0 ? kill(-fg, r->sig) < 0 : kill(c->pid, r->sig) < 0) {
            answer_err(r->chan, errno, "signal: %s", strerror(errno));
            return;
        }
    } else if (r->sig == SIGKILL && !r->spare) {
        char p[96];
        snprintf(p, sizeof p, "%s/cgroup.kill", c->cg);
        if (write_file(p, "1") < 0) { answer_err(r->chan, errno, "signal: cgroup.kill: %s", strerror(errno)); return; }
    } else {
        char p[96], buf[4096];
        snprintf(p, sizeof p, "%s/cgroup.procs", c->cg);
        int fd = open(p, O_RDONLY | O_CLOEXEC);
        if (fd < 0) { answer_err(r->chan, errno, "signal: %s", strerror(errno)); return; }
        size_t have = 0;
        ssize_t n;
        while ((n = read(fd, buf + have, sizeof buf - 1 - have)) > 0) {
            have += (size_t)n;
            buf[have] = 0;
            char *end = strrchr(buf, '\n');
            if (!end) { if (have == sizeof buf - 1) have = 0; continue; }
            *end = 0;
            for (char *s = NULL, *t = strtok_r(buf, "\n", &s); t; t = strtok_r(NULL, "\n", &s))
                if (!r->spare || atoi(t) != c->pid) kill(atoi(t), r->sig); /* spare: all but the exec's own process */
            size_t rest = have - (size_t)(end + 1 - buf);
            memmove(buf, end + 1, rest);
            have = rest;
        }
        close(fd);
    }
    answer_ok(r->chan);
}

/* ---- netcut: the guest's TCP connections a new policy forbids, destroyed (as ss -K) ---- */

struct nl_hdr { uint32_t len; uint16_t type, flags; uint32_t seq, pid; };
struct diag_sockid { uint16_t sport, dport; uint32_t src[4], dst[4]; uint32_t ifc; uint32_t cookie[2]; };
struct diag_req { uint8_t family, protocol, ext, pad; uint32_t states; struct diag_sockid id; };
struct diag_msg { uint8_t family, state, timer, retrans; struct diag_sockid id; uint32_t expires, rq, wq, uid, ino; };
#define NETLINK_SOCK_DIAG_ 4
#define SOCK_DIAG_BY_FAMILY_ 20
#define SOCK_DESTROY_ 21
#define TCP_ALL_BUT_LISTEN (0xfff & ~(1u << 10))

static int admitted(const struct req *r, uint32_t dst, uint16_t port) {
    if ((dst >> 24) == 127) return 1; /* loopback stays */
    for (int i = 0; i < r->nallow; i++)
        if (r->allow[i].proto == 6 && (dst & r->allow[i].mask) == r->allow[i].net &&
            port >= r->allow[i].lo && port <= r->allow[i].hi)
            return 1;
    return 0;
}

static int diag_send(int fd, uint16_t type, uint16_t flags, uint32_t seq, const struct diag_sockid *id) {
    struct { struct nl_hdr h; struct diag_req q; } m;
    memset(&m, 0, sizeof m);
    m.h.len = sizeof m;
    m.h.type = type;
    m.h.flags = flags;
    m.h.seq = seq;
    m.q.family = AF_INET;
    m.q.protocol = 6;
    m.q.states = TCP_ALL_BUT_LISTEN;
    if (id) m.q.id = *id;
    return send(fd, &m, sizeof m, 0) == (ssize_t)sizeof m ? 0 : -1;
}

static void do_netcut(struct req *r) {
    static struct diag_sockid victims[4096];
    static uint8_t buf[32768];
    int nv = 0, cut = 0, done = 0;
    int fd = socket(AF_NETLINK, SOCK_RAW | SOCK_CLOEXEC, NETLINK_SOCK_DIAG_);
    if (fd < 0) { answer_err(r->chan, errno, "netcut: sock_diag: %s", strerror(errno)); return; }
    if (diag_send(fd, SOCK_DIAG_BY_FAMILY_, 1 | 0x300, 1, NULL) < 0) {
        answer_err(r->chan, errno, "netcut: dump: %s", strerror(errno));
        close(fd);
        return;
    }
    while (!done) {
        ssize_t n = recv(fd, buf, sizeof buf, 0);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) break;
        for (size_t off = 0; off + sizeof(struct nl_hdr) <= (size_t)n;) {
            struct nl_hdr *h = (struct nl_hdr *)(buf + off);
            if (h->len < sizeof *h || off + h->len > (size_t)n) { done = 1; break; }
            if (h->type == 3 || h->type == 2) { done = 1; break; } /* NLMSG_DONE, NLMSG_ERROR */
            if (h->len >= sizeof *h + sizeof(struct diag_msg)) {
                struct diag_msg *d = (struct diag_msg *)(h + 1);
                uint32_t dst = ntohl(d->id.dst[0]);
                if (!admitted(r, dst, ntohs(d->id.dport)) && nv < (int)(sizeof victims / sizeof *victims))
                    victims[nv++] = d->id;
            }
            off += (h->len + 3) & ~3u;
        }
    }
    for (int i = 0; i < nv; i++) {
        if (diag_send(fd, SOCK_DESTROY_, 1 | 4, (uint32_t)i + 2, &victims[i]) < 0) continue;
        ssize_t n = recv(fd, buf, sizeof buf, 0);
        if (n >= (ssize_t)(sizeof(struct nl_hdr) + 4) && ((struct nl_hdr *)buf)->type == 2) {
            int32_t err;
            memcpy(&err, buf + sizeof(struct nl_hdr), sizeof err);
            if (err == 0) cut++;
        }
    }
    close(fd);
    tb_reset("ok");
    tb_ku("n", (uint64_t)cut);
    tb_emit(T_ANSWER, r->chan);
}

static void do_resize(struct req *r) {
    struct chan *c = exec_chan(r->ch);
    struct winsize ws = {.ws_row = (unsigned short)r->rows, .ws_col = (unsigned short)r->cols};
    if (!c || !c->tty || c->out_fd < 0) { answer_err(r->chan, ENOTTY, "resize: no terminal on channel %u", r->ch); return; }
    if (ioctl(c->out_fd, TIOCSWINSZ, &ws) < 0) { answer_err(r->chan, errno, "resize: %s", strerror(errno)); return; }
    answer_ok(r->chan);
}

/* Bytes for an exec's stdin ('I'); empty: close it when the buffer is written. */
static int exec_input(struct chan *c, const uint8_t *p, uint32_t len) {
    if (len == 0) {
        c->ieof = 1;
        if (c->ilen == 0 && !c->idead) {
            if (c->tty && c->in_fd >= 0) { if (write(c->in_fd, "\x04", 1) < 0) {} }
            stdin_close(c);
            c->idead = 1;
        }
        return 0;
    }
    if (c->idead || c->in_fd < 0) { emit_u32(T_INCREDIT, c->id, len); return 0; }
    if (c->ilen + len > STDIN_WINDOW) return -1;  /* the host broke the window: the stream is broken */
    if (!c->ibuf && !(c->ibuf = malloc(STDIN_WINDOW))) { emit_u32(T_INCREDIT, c->id, len); return 0; }
    memcpy(c->ibuf + c->ilen, p, len);
    c->ilen += len;
    return 0;
}

static void stdin_step(struct chan *c) {
    while (c->ilen > 0) {
        ssize_t n = write(c->in_fd, c->ibuf, c->ilen);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 && errno == EAGAIN) return;
        if (n <= 0) {  /* the reader is gone: what is left is consumed */
            emit_u32(T_INCREDIT, c->id, (uint32_t)c->ilen);
            stdin_close(c);
            c->idead = 1;
            return;
        }
        memmove(c->ibuf, c->ibuf + n, c->ilen - (size_t)n);
        c->ilen -= (size_t)n;
        emit_u32(T_INCREDIT, c->id, (uint32_t)n);
    }
    if (c->ieof) {
        if (c->tty) { if (write(c->in_fd, "\x04", 1) < 0) {} }
        stdin_close(c);
        c->idead = 1;
    }
}

/* Read one of an exec's outputs into the queue, within its credit. Returns 1 while the
 * fd may have more, 0 when it is done (EOF, or drained after the process exited). */
static int output_step(struct chan *c, int *fd, uint8_t type) {
    static uint8_t sink[MAX_FRAME];
    for (int rounds = 0; rounds < 4; rounds++) {
        if (c->detached) {
            ssize_t n = read(*fd, sink, sizeof sink);
            if (n > 0) continue;
            if (n < 0 && (errno == EAGAIN || errno == EINTR) && !c->exited) return 1;
            closefd(fd);
            return 0;
        }
        if (c->credit == 0 || out_used() >= PRODUCE_LIMIT) return 1;
        size_t want = c->credit < MAX_FRAME ? (size_t)c->credit : MAX_FRAME;
        uint8_t *p = frame_begin(want);
        if (!p) return 1;
        ssize_t n = read(*fd, p, want);
        if (n > 0) {
            frame_end(type, c->id, (size_t)n);
            c->credit -= (uint64_t)n;
            continue;
        }
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 && errno == EAGAIN && !c->exited) return 1;
        /* EOF; EIO from a pty whose other side is all closed; EAGAIN after the exit */
        if (c->tty) c->in_fd = -1;
        closefd(fd);
        return 0;
    }
    return 1;
}

static void exec_finish(struct chan *c) {
    if (c->out_fd >= 0 || c->err_fd >= 0 || !c->exited) return;
    if (!c->detached) {
        if (out_used() > ANSWER_LIMIT) return;
        int st = c->status;
        tb.n = 0;
        tb.over = 0;
        char code[16], sig[16];
        snprintf(code, sizeof code, "%d", WIFEXITED(st) ? WEXITSTATUS(st) : -1);
        snprintf(sig, sizeof sig, "%d", WIFSIGNALED(st) ? WTERMSIG(st) : 0);
        tb_kv("code", code);
        tb_kv("sig", sig);
        tb_ku("utime_us", (uint64_t)c->ru.ru_utime.tv_sec * 1000000ull + (uint64_t)c->ru.ru_utime.tv_usec);
        tb_ku("stime_us", (uint64_t)c->ru.ru_stime.tv_sec * 1000000ull + (uint64_t)c->ru.ru_stime.tv_usec);
        tb_ku("maxrss_kb", (uint64_t)c->ru.ru_maxrss);
        /* the limits' evidence (the host judges ExecResult.limit from it): OOM kills in the
         * exec's cgroup, forks refused at the sandbox's pids limit, and the upper's room */
        tb_ku("oom", c->cg[0] ? cg_oom_kills(c->cg) - c->oom0 : 0);
        tb_ku("pidsmax", cg_event(CG_ROOT "/pids.events", "max") - c->pidsmax0);
        struct statvfs vfs;
        if (statvfs("/upper", &vfs) == 0) {
            tb_ku("dfree", (uint64_t)vfs.f_bavail * vfs.f_frsize);
            tb_ku("ifree", (uint64_t)vfs.f_favail);
        }
        tb_emit(T_EXIT, c->id);
    }
    chan_free(c);
}

static void reap(void) {
    int status;
    struct rusage ru;
    pid_t pid;
    while ((pid = wait4(-1, &status, WNOHANG, &ru)) > 0) {
        for (int i = 0; i < MAX_CHANS; i++) {
            struct chan *c = &chans[i];
            if (c->kind == C_EXEC && c->pid == pid && !c->exited) {
                c->exited = 1;
                c->status = status;
                c->ru = ru;
                if (c->idead == 0) { stdin_close(c); c->idead = 1; }
            }
        }
    }
    cg_sweep();
}

/* ------------------------------------------------------------------ serving ---- */

static int port = -1;
static int connected;
static int broken;       /* a bad frame: input is dropped until the host reconnects */
static uint8_t inbuf[HDR_LEN + MAX_FRAME];
static size_t inlen;
static struct req req;

static void send_hello(uint8_t type, uint32_t chan) {
    tb_reset(type == T_HELLO ? "v" : "ok");
    if (type == T_HELLO) tb_str("1"); else tb_kv("v", "1");
    tb_ku("boot_ns", now_ns(CLOCK_BOOTTIME));
    if (boot_fail[0]) tb_kv("fail", boot_fail);
    tb_emit(type, chan);
}

/* The host went away: what was in flight is dropped; running processes keep running. */
static void disconnect(void) {
    connected = 0;
    broken = 0;
    inlen = 0;
    out_head = out_tail = 0;
    for (int i = 0; i < MAX_CHANS; i++) {
        struct chan *c = &chans[i];
        if (c->kind == C_EXEC) {
            c->detached = 1;
            if (!c->idead) { stdin_close(c); c->idead = 1; }
        } else if (c->kind == C_WRITE) {
            write_abort(c);
        } else if (c->kind != C_FREE) {
            chan_free(c);
        }
    }
}

static void poweroff(uint32_t chan) {
    answer_ok(chan);
    for (int i = 0; i < 100 && out_used() > 0; i++) {
        ssize_t n = write(port, outq + out_head, out_used());
        if (n > 0) out_head += (size_t)n;
        else usleep(10000);
    }
    sync();
    reboot(RB_POWER_OFF);
    reboot(RB_AUTOBOOT);
}

static void handle_request(const uint8_t *p, uint32_t len, uint32_t chan) {
    if (parse_request(p, len, chan, &req) < 0) {
        answer_err(chan, req.err, "%s", req.msg);
        return;
    }
    int needs_root = req.op >= OP_STAT && req.op <= OP_IDENTITY;
    if (needs_root && (boot_fail[0] || sysroot_fd < 0)) {
        answer_err(chan, EIO, "the guest did not boot: %s", boot_fail);
        return;
    }
    switch (req.op) {
    case OP_PING: answer_ok(chan); break;
    case OP_HELLO: send_hello(T_ANSWER, chan); break;
    case OP_EXEC: do_exec(&req); break;
    case OP_SIGNAL: do_signal(&req); break;
    case OP_RESIZE: do_resize(&req); break;
    case OP_STAT: do_stat(&req); break;
    case OP_LIST: do_list(&req); break;
    case OP_READ: do_read(&req); break;
    case OP_WRITE: do_write(&req); break;
    case OP_MKDIR: do_mkdir(&req); break;
    case OP_REMOVE: do_remove(&req); break;
    case OP_RENAME: do_rename(&req); break;
    case OP_IDENTITY: do_identity(&req); break;
    case OP_SYNC: do_sync(&req); break;
    case OP_POWEROFF: poweroff(chan); break;
    case OP_NETCUT: do_netcut(&req); break;
    default: answer_err(chan, EINVAL, "unknown op"); break;
    }
}

/* Frames in inbuf, while answers have room. */
static void process_input(void) {
    size_t off = 0;
    while (!broken && inlen - off >= HDR_LEN && out_used() < ANSWER_LIMIT) {
        const uint8_t *h = inbuf + off;
        uint32_t len = get_u32le(h), chan = get_u32le(h + 4);
        uint8_t type = h[8];
        if (len > MAX_FRAME) { logk("frame of %u bytes: the stream is broken\n", len); broken = 1; break; }
        if (inlen - off < HDR_LEN + len) break;
        const uint8_t *p = h + HDR_LEN;
        struct chan *c = chan_find(chan);
        if (type == T_REQUEST) {
            /* the payload is NUL-terminated text; copy so the request's strings stay put */
            handle_request(p, len, chan);
        } else if (type == T_INPUT) {
            if (c && c->kind == C_EXEC) {
                if (exec_input(c, p, len) < 0) { logk("stdin window overrun on %u\n", chan); broken = 1; break; }
            } else if (c && c->kind == C_WRITE) {
                write_input(c, p, len);
            }
        } else if (type == T_CREDIT && len == 4) {
            if (c) {
                c->credit += get_u32le(p);
                if (c->credit > (1ull << 40)) c->credit = 1ull << 40;
            }
        } else {
            logk("unknown frame type %u: the stream is broken\n", type);
            broken = 1;
            break;
        }
        off += HDR_LEN + len;
    }
    if (broken) { inlen = 0; return; }
    memmove(inbuf, inbuf + off, inlen - off);
    inlen -= off;
}

static void on_connect(void) {
    connected = 1;
    broken = 0;
    send_hello(T_HELLO, 0);
}

/* Read the port: 1 when the host is there, 0 when it is not. */
static int port_read(void) {
    for (;;) {
        size_t room = sizeof inbuf - inlen;
        if (room == 0) return 1;
        ssize_t n = read(port, inbuf + inlen, room);
        if (n > 0) {
            if (broken) inlen = 0;
            else inlen += (size_t)n;
            if ((size_t)n < room) return 1;
            continue;
        }
        if (n == 0) return 0;
        if (errno == EINTR) continue;
        return 1;  /* EAGAIN: connected, nothing to read */
    }
}

static void flush_out(void) {
    while (connected && out_used() > 0) {
        ssize_t n = write(port, outq + out_head, out_used());
        if (n > 0) { out_head += (size_t)n; continue; }
        if (n < 0 && errno == EINTR) continue;
        return;
    }
    if (out_used() == 0) out_head = out_tail = 0;
}

static void serve(int sfd) {
    static struct pollfd pfd[2 + 3 * MAX_CHANS];
    static struct chan *owner[2 + 3 * MAX_CHANS];
    static int which[2 + 3 * MAX_CHANS];  /* 0 out, 1 err, 2 in */
    if (port_read()) on_connect();
    for (;;) {
        int n = 0, busy = 0;
        pfd[n] = (struct pollfd){.fd = sfd, .events = POLLIN};
        owner[n++] = NULL;
        if (connected) {
            short ev = 0;
            ev |= POLLIN;
            if (out_used() > 0) ev |= POLLOUT;
            if (out_used() >= ANSWER_LIMIT) ev &= (short)~POLLIN;
            pfd[n] = (struct pollfd){.fd = port, .events = ev};
            owner[n++] = NULL;
        }
        for (int i = 0; i < MAX_CHANS; i++) {
            struct chan *c = &chans[i];
            if (c->kind == C_EXEC) {
                int room = c->detached || (c->credit > 0 && out_used() < PRODUCE_LIMIT);
                if (c->exited && room && (c->out_fd >= 0 || c->err_fd >= 0)) busy = 1;
                if (c->out_fd >= 0 && room) {
                    pfd[n] = (struct pollfd){.fd = c->out_fd, .events = POLLIN};
                    owner[n] = c, which[n++] = 0;
                }
                if (c->err_fd >= 0 && room) {
                    pfd[n] = (struct pollfd){.fd = c->err_fd, .events = POLLIN};
                    owner[n] = c, which[n++] = 1;
                }
                if (c->in_fd >= 0 && c->ilen > 0 && out_used() < ANSWER_LIMIT) {
                    pfd[n] = (struct pollfd){.fd = c->in_fd, .events = POLLOUT};
                    owner[n] = c, which[n++] = 2;
                }
                if (c->exited && c->out_fd < 0 && c->err_fd < 0) busy = 1;
            } else if ((c->kind == C_READ && c->credit > 0) || c->kind == C_LIST) {
                if (out_used() < PRODUCE_LIMIT) busy = 1;
            }
        }
        int timeout = busy ? 0 : connected ? -1 : 200;
        int rc = poll(pfd, (nfds_t)n, timeout);
        if (rc < 0 && errno != EINTR) { logk("poll: %s\n", strerror(errno)); usleep(10000); continue; }
        if (pfd[0].revents & POLLIN) {
            struct signalfd_siginfo si;
            while (read(sfd, &si, sizeof si) == (ssize_t)sizeof si) {}
            reap();
        }
        if (!connected) {
            if (port_read()) on_connect();
        } else if (n > 1 && pfd[1].revents) {
            if (pfd[1].revents & (POLLIN | POLLHUP | POLLERR)) {
                if (!port_read()) disconnect();
            }
        }
        for (int i = 2; i < n; i++) {
            struct chan *c = owner[i];
            if (!pfd[i].revents || !c || c->kind != C_EXEC) continue;
            if (which[i] == 2) stdin_step(c);
            else if (which[i] == 0 && c->out_fd >= 0) output_step(c, &c->out_fd, T_STDOUT);
            else if (which[i] == 1 && c->err_fd >= 0) output_step(c, &c->err_fd, T_STDERR);
        }
        for (int i = 0; i < MAX_CHANS; i++) {
            struct chan *c = &chans[i];
            if (c->kind == C_EXEC && c->exited) {
                if (c->out_fd >= 0) output_step(c, &c->out_fd, T_STDOUT);
                if (c->err_fd >= 0 && !c->tty) output_step(c, &c->err_fd, T_STDERR);
                exec_finish(c);
            } else if (c->kind == C_READ && out_used() < PRODUCE_LIMIT) {
                read_step(c);
            } else if (c->kind == C_LIST && out_used() < PRODUCE_LIMIT) {
                list_step(c);
            }
        }
        if (connected) process_input();
        flush_out();
    }
}

/* ------------------------------------------------------------ --parse mode ---- */

static void json_str(const char *s) {
    putchar('"');
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        if (*p == '"' || *p == '\\') printf("\\%c", *p);
        else if (*p < 0x20) printf("\\u%04x", *p);
        else putchar(*p);
    }
    putchar('"');
}

static void json_strs(const char *const *v, int n) {
    putchar('[');
    for (int i = 0; i < n; i++) { if (i) putchar(','); json_str(v[i]); }
    putchar(']');
}

static int parse_mode(void) {
    static uint8_t buf[HDR_LEN + MAX_FRAME + 1];
    size_t have = 0;
    ssize_t n;
    while ((n = read(0, buf + have, sizeof buf - have)) > 0) have += (size_t)n;
    if (have < HDR_LEN) { printf("{\"error\":{\"errno\":%d,\"message\":\"short frame\"}}\n", EINVAL); return 0; }
    uint32_t len = get_u32le(buf), chan = get_u32le(buf + 4);
    if (len > MAX_FRAME) {
        printf("{\"error\":{\"errno\":%d,\"message\":\"frame of %u bytes is over MAX_FRAME (%d): the stream is broken\"}}\n",
               EMSGSIZE, len, MAX_FRAME);
        return 0;
    }
    if (have != HDR_LEN + len || buf[8] != T_REQUEST) {
        printf("{\"error\":{\"errno\":%d,\"message\":\"not one request frame\"}}\n", EINVAL);
        return 0;
    }
    if (parse_request(buf + HDR_LEN, len, chan, &req) < 0) {
        printf("{\"error\":{\"errno\":%d,\"message\":", req.err);
        json_str(req.msg);
        printf("}}\n");
        return 0;
    }
    struct req *r = &req;
    printf("{\"op\":\"%s\",\"chan\":%u", op_names[r->op], r->chan);
    switch (r->op) {
    case OP_EXEC:
        printf(",\"argv\":"); json_strs(r->argv, r->argc);
        printf(",\"env\":"); json_strs(r->env, r->envc);
        printf(",\"cwd\":"); json_str(r->cwd);
        printf(",\"uid\":%u,\"gid\":%u,\"tty\":%d,\"rows\":%u,\"cols\":%u,\"stdin\":%d,\"win\":%u",
               r->uid, r->gid, r->tty, r->rows, r->cols, r->with_stdin, r->win);
        break;
    case OP_SIGNAL: printf(",\"ch\":%u,\"sig\":%d,\"tree\":%d,\"spare\":%d", r->ch, r->sig, r->tree, r->spare); break;
    case OP_RESIZE: printf(",\"ch\":%u,\"rows\":%u,\"cols\":%u", r->ch, r->rows, r->cols); break;
    case OP_STAT: printf(",\"path\":"); json_str(r->path); printf(",\"follow\":%d", r->follow); break;
    case OP_LIST: printf(",\"path\":"); json_str(r->path); break;
    case OP_READ:
        printf(",\"path\":"); json_str(r->path);
        printf(",\"max\":%llu,\"win\":%u", (unsigned long long)r->max, r->win);
        break;
    case OP_WRITE: case OP_MKDIR:
        printf(",\"path\":"); json_str(r->path);
        printf(",\"mode\":%u,\"uid\":%u,\"gid\":%u", r->mode, r->uid, r->gid);
        if (r->op == OP_WRITE) printf(",\"append\":%d", r->append); else printf(",\"parents\":%d", r->parents);
        break;
    case OP_REMOVE: printf(",\"path\":"); json_str(r->path); printf(",\"recursive\":%d", r->recursive); break;
    case OP_RENAME: printf(",\"src\":"); json_str(r->path); printf(",\"dst\":"); json_str(r->path2); break;
    case OP_IDENTITY:
        printf(",\"hostname\":"); json_str(r->hostname);
        printf(",\"machine_id\":"); json_str(r->machine_id);
        printf(",\"seed\":\"");
        for (size_t i = 0; i < r->seedlen; i++) printf("%02x", r->seed[i]);
        printf("\",\"realtime_ns\":");
        if (r->has_realtime) printf("%llu", (unsigned long long)r->realtime_ns); else printf("null");
        break;
    case OP_SYNC:
        printf(",\"freeze\":");
        if (r->freeze < 0) printf("null"); else printf("%d", r->freeze);
        break;
    case OP_NETCUT:
        printf(",\"allow\":[");
        for (int i = 0; i < r->nallow; i++) {
            uint32_t a = r->allow[i].net;
            int bits = 0;
            for (uint32_t m = r->allow[i].mask; m; m <<= 1) bits++;
            printf("%s\"%u.%u.%u.%u/%d %s %u-%u\"", i ? "," : "", a >> 24, (a >> 16) & 255, (a >> 8) & 255, a & 255,
                   bits, r->allow[i].proto == 6 ? "tcp" : "udp", r->allow[i].lo, r->allow[i].hi);
        }
        printf("]");
        break;
    default: break;
    }
    printf("}\n");
    return 0;
}

/* ------------------------------------------------------------------ main ---- */

int main(int argc, char **argv) {
    if (argc > 1 && !strcmp(argv[1], "--parse")) return parse_mode();
    if (getpid() != 1) {
        fprintf(stderr, "dsec-vmagent: the microVM guest's init; run as PID 1 (or --parse)\n");
        return 2;
    }
    signal(SIGPIPE, SIG_IGN);
    sigset_t mask;
    sigemptyset(&mask);
    sigaddset(&mask, SIGCHLD);
    sigaddset(&mask, SIGIO);
    sigprocmask(SIG_BLOCK, &mask, NULL);
    int sfd = signalfd(-1, &mask, SFD_NONBLOCK | SFD_CLOEXEC);
    boot();
    port = open_port();
    if (port < 0) {
        logk("no virtio-serial port named dsec.agent: powering off\n");
        reboot(RB_POWER_OFF);
        return 1;
    }
    serve(sfd);
    return 0;
}
