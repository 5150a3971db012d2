/*
 * What every process started in a sandbox is confined by besides its namespaces:
 * the seccomp filter (built once at start) and the capability sets.
 */
#include "spawner.h"

/* ---------- seccomp: built once, loaded by every exec'd process ---------- */

struct sock_fprog seccomp_prog;

int build_seccomp(void) {
    scmp_filter_ctx ctx = seccomp_init(SCMP_ACT_ALLOW);
    if (!ctx) return -1;
    /* Syscalls a sandbox never needs; each answers a threat in docs/SECURITY.md. */
    static const char *deny[] = {
        "mount", "umount2", "pivot_root", "move_mount", "open_tree", "fsopen", "fsconfig",
        "fsmount", "fspick", "mount_setattr", "bpf", "kexec_load", "kexec_file_load",
        "init_module", "finit_module", "delete_module", "keyctl", "add_key", "request_key",
        "clock_settime", "clock_adjtime", "settimeofday", "reboot", "swapon", "swapoff",
        "perf_event_open", "userfaultfd", "open_by_handle_at", "name_to_handle_at",
        "unshare", "setns", "acct", "quotactl", "quotactl_fd", "lookup_dcookie", "vhangup",
        "iopl", "ioperm", "syslog", "uselib", "io_uring_setup", "io_uring_enter",
        "io_uring_register", "fanotify_init", "kcmp", "process_madvise", "nfsservctl",
        "pidfd_getfd", "mbind", "migrate_pages", "move_pages",
        "set_mempolicy", "get_mempolicy", "vm86", "vm86old", "_sysctl", "create_module",
        "get_kernel_syms", "query_module", "stime", "lsm_set_self_attr", NULL};
    for (int i = 0; deny[i]; i++) {
        int nr = seccomp_syscall_resolve_name(deny[i]);
        if (nr == __NR_SCMP_ERROR) continue;
        if (seccomp_rule_add(ctx, SCMP_ACT_ERRNO(EPERM), nr, 0) < 0) goto fail;
    }
    /* clone() with any namespace flag: EPERM.  Expressed per flag (MASKED_EQ flag,flag). */
    static const uint64_t flags[] = {CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET,
                                     CLONE_NEWIPC, CLONE_NEWUTS, CLONE_NEWCGROUP, 0x00000080ULL};
    for (size_t i = 0; i < sizeof flags / sizeof flags[0]; i++)
        if (seccomp_rule_add(ctx, SCMP_ACT_ERRNO(EPERM), SCMP_SYS(clone), 1,
                             SCMP_A0(SCMP_CMP_MASKED_EQ, flags[i], flags[i])) < 0)
            goto fail;
    /* clone3 passes flags in memory that seccomp cannot read: ENOSYS makes libc fall back to clone. */
    if (seccomp_rule_add(ctx, SCMP_ACT_ERRNO(ENOSYS), SCMP_SYS(clone3), 0) < 0) goto fail;
    /* Raw and packet sockets (also refused by capabilities; belt and braces). */
    if (seccomp_rule_add(ctx, SCMP_ACT_ERRNO(EPERM), SCMP_SYS(socket), 1,
                         SCMP_A0(SCMP_CMP_EQ, 17 /* AF_PACKET */)) < 0) goto fail;
    if (seccomp_rule_add(ctx, SCMP_ACT_ERRNO(EPERM), SCMP_SYS(socket), 2,
                         SCMP_A0(SCMP_CMP_NE, 16 /* AF_NETLINK */),
                         SCMP_A1(SCMP_CMP_MASKED_EQ, 0xf, 3 /* SOCK_RAW */)) < 0) goto fail;
    if (seccomp_rule_add(ctx, SCMP_ACT_ERRNO(EPERM), SCMP_SYS(socket), 3,
                         SCMP_A0(SCMP_CMP_EQ, 16 /* AF_NETLINK */),
                         SCMP_A1(SCMP_CMP_MASKED_EQ, 0xf, 3 /* SOCK_RAW */),
                         SCMP_A2(SCMP_CMP_NE, 9 /* NETLINK_AUDIT */)) < 0) goto fail;
    /* The audit socket, raw or not, answers as a kernel without audit does: useradd, passwd and
     * friends carry on (EPERM makes them abort: "Cannot open audit interface"). Disjoint from the
     * rules above, so no two actions compete. */
    if (seccomp_rule_add(ctx, SCMP_ACT_ERRNO(EPROTONOSUPPORT), SCMP_SYS(socket), 2,
                         SCMP_A0(SCMP_CMP_EQ, 16 /* AF_NETLINK */),
                         SCMP_A2(SCMP_CMP_EQ, 9 /* NETLINK_AUDIT */)) < 0) goto fail;
    /* ioctl(TIOCSTI) injects input into a terminal another process reads. */
    if (seccomp_rule_add(ctx, SCMP_ACT_ERRNO(EPERM), SCMP_SYS(ioctl), 1,
                         SCMP_A1(SCMP_CMP_MASKED_EQ, 0xffffffffULL, 0x5412 /* TIOCSTI */)) < 0) goto fail;

    int mfd = memfd_create("dsec-seccomp", MFD_CLOEXEC);
    if (mfd < 0) goto fail;
    if (seccomp_export_bpf(ctx, mfd) < 0) { close(mfd); goto fail; }
    off_t size = lseek(mfd, 0, SEEK_END);
    struct sock_filter *f = malloc(size);
    if (!f || pread(mfd, f, size, 0) != size) { close(mfd); goto fail; }
    close(mfd);
    seccomp_prog.len = (unsigned short)(size / sizeof(struct sock_filter));
    seccomp_prog.filter = f;
    seccomp_release(ctx);
    return 0;
fail:
    seccomp_release(ctx);
    return -1;
}

/* ---------- capabilities ---------- */

/* Capabilities root inside a sandbox keeps (they act only inside its user namespace). */
static const int keep_caps[] = {CAP_CHOWN, CAP_DAC_OVERRIDE, CAP_FOWNER, CAP_FSETID, CAP_KILL,
                                CAP_SETGID, CAP_SETUID, CAP_SETPCAP, CAP_NET_BIND_SERVICE,
                                CAP_SYS_CHROOT, CAP_SETFCAP, CAP_AUDIT_WRITE, -1};

int set_caps(int keep_root_caps) {
    uint64_t keep = 0;
    if (keep_root_caps)
        for (int i = 0; keep_caps[i] >= 0; i++) keep |= 1ULL << keep_caps[i];
    for (int c = 0; c <= 63; c++) {
        if (keep & (1ULL << c)) continue;
        if (prctl(PR_CAPBSET_DROP, c, 0, 0, 0) < 0 && errno != EINVAL) return -1;
    }
    struct __user_cap_header_struct h = {.version = _LINUX_CAPABILITY_VERSION_3, .pid = 0};
    struct __user_cap_data_struct d[2];
    memset(d, 0, sizeof d);
    d[0].effective = d[0].permitted = (uint32_t)keep;
    d[1].effective = d[1].permitted = (uint32_t)(keep >> 32);
    if (syscall(SYS_capset, &h, d) < 0) return -1;
    prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0);
    return 0;
}
