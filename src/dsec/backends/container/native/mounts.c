/*
 * Mount trees: the template mount namespace every sandbox starts from, and a
 * sandbox's own tree (layers, overlay, /dev, /proc, /sys) built from detached mounts.
 * Runs in the spawner (template) and in the sandbox's init before it drops to the
 * sandbox's root; never in the spawner's own mount namespace after start.
 */
#include "spawner.h"

static int ensure_dir(const char *path, uid_t uid, gid_t gid, mode_t mode) {
    if (mkdir(path, mode) == 0) return chown(path, uid, gid);
    return errno == EEXIST ? 0 : -1;
}

/* ---------- the template mount namespace every sandbox starts from ---------- */

/* A sandbox's mount namespace is a copy of this one, not of the host's: one read-only
 * tmpfs (mode 0700, owned by host root) holding one empty directory, r, where the
 * sandbox's overlay is attached before it is moved over the root.
 *
 * Why: switching a sandbox's root with pivot_root walks every task on the host
 * (chroot_fs_refs: 0.13 -> 2.27 ms per create from 0 to 4,000 sandboxes) and
 * detaching the old root waits for an RCU grace period.  Here the root is switched by
 * moving the overlay over the namespace's own root and chroot'ing into it (what
 * switch_root does), which costs neither.  A chroot is escapable where ".." climbs
 * above the new root: from the overlay's root it cannot (its mountpoint is the root of
 * a mount without a parent, so ".." stays put), and what lies beneath is this tmpfs,
 * which the sandbox's root (an unmapped uid for it: no DAC override) cannot search and
 * which holds nothing of the host anyway.  Made once per spawner, with one pivot_root. */
int tmpl_fd = -1;

int tmpl_make(const char *at, const char **what) {
    int ready[2];
    if (pipe2(ready, O_CLOEXEC) < 0) { *what = "pipe"; return -1; }
    pid_t pid = fork();
    if (pid < 0) { close(ready[0]); close(ready[1]); *what = "fork"; return -1; }
    if (pid == 0) {
        close(ready[0]);
        const char *step = "unshare(CLONE_NEWNS)";
        if (unshare(CLONE_NEWNS) < 0) goto fail;
        step = "make / private";
        if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) < 0) goto fail;
        step = "tmpfs";
        if (mount("dsec-tmpl", at, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=16k,nr_inodes=64,mode=700") < 0)
            goto fail;
        step = "chdir";
        if (chdir(at) < 0) goto fail;
        step = "mountpoint";
        if (mkdir("r", 0700) < 0) goto fail;
        step = "read-only root";
        if (mount(NULL, ".", NULL, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL) < 0)
            goto fail;
        step = "pivot_root";
        if (syscall(SYS_pivot_root, ".", ".") < 0 || umount2(".", MNT_DETACH) < 0 || chdir("/") < 0) goto fail;
        if (write(ready[1], "k", 1) != 1) _exit(1);
        pause();
        _exit(0);
    fail:;
        char msg[128];
        int n = snprintf(msg, sizeof msg, "%c%s", (char)errno, step);
        if (write(ready[1], msg, (size_t)n) < 0) _exit(1);
        _exit(1);
    }
    close(ready[1]);
    char msg[128];
    ssize_t n = read(ready[0], msg, sizeof msg - 1);
    close(ready[0]);
    int fd = -1, e = EIO;
    static char step[160]; /* fits the prefix and all of msg: never truncated */
    if (n == 1 && msg[0] == 'k') {
        char p[64];
        snprintf(p, sizeof p, "/proc/%d/ns/mnt", (int)pid);
        fd = open(p, O_RDONLY | O_CLOEXEC);
        e = errno;
        snprintf(step, sizeof step, "open the template's namespace");
    } else if (n > 1) {
        msg[n] = 0;
        e = (unsigned char)msg[0];
        snprintf(step, sizeof step, "template mount namespace: %s", msg + 1);
    } else {
        snprintf(step, sizeof step, "template mount namespace: helper died");
    }
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    *what = step;
    errno = e;
    return fd;
}

/* ---------- the sandbox's own /etc/hostname and /etc/hosts ---------- */

/* Written into the upper before the overlay is made over it: whatever the image holds at
 * these paths, or lacks (a debootstrap minbase has no /etc/hosts), the sandbox has its own
 * name in /etc/hostname and an /etc/hosts where localhost and that name resolve, as Docker
 * gives each container.  They are the sandbox's files (its root owns and may edit them); a
 * snapshot keeps them and a sandbox made from it writes its own again.  The text is
 * dsec.backends.common.identity's (tests/conformance/test_identity.py compares).
 * The upper is new here (a fresh subvolume or tmpfs) but for a create retried with the same
 * id: what is there is replaced, nothing followed. */
static const char HOSTS_HEAD[] =
    "127.0.0.1\tlocalhost\n"
    "::1\tlocalhost ip6-localhost ip6-loopback\n"
    "fe00::0\tip6-localnet\n"
    "ff00::0\tip6-mcastprefix\n"
    "ff02::1\tip6-allnodes\n"
    "ff02::2\tip6-allrouters\n";

static int put_file(int dir, const char *name, const char *text, size_t n, uid_t ub) {
    if (unlinkat(dir, name, 0) < 0 && errno != ENOENT) return -1; /* a retried create's upper */
    int fd = openat(dir, name, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (fd < 0) return -1;
    int ok = write(fd, text, n) == (ssize_t)n && fchown(fd, ub, ub) == 0;
    close(fd);
    return ok ? 0 : -1;
}

/* ~65 us on the disk medium (btrfs: a transaction per create), ~22 us on tmpfs (p50,
 * DSEC_SPAWNER_TRACE; docs/PERFORMANCE.md). */
static void write_identity(int updir, const char *id, uid_t ub, int rfd) {
    char text[sizeof HOSTS_HEAD + 128];
    /* EEXIST: the upper of a create retried with the same id (the spawner died half-way and
     * the edge made it again); what is there must be a directory, never followed */
    if ((mkdirat(updir, "etc", 0755) < 0 && errno != EEXIST) ||
        fchownat(updir, "etc", ub, ub, AT_SYMLINK_NOFOLLOW) < 0)
        child_fail(rfd, "identity", "mkdir upper/etc");
    int etc = openat(updir, "etc", O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (etc < 0) child_fail(rfd, "identity", "open upper/etc");
    int n = snprintf(text, sizeof text, "%s\n", id);
    if (n < 0 || (size_t)n >= sizeof text || put_file(etc, "hostname", text, (size_t)n, ub) < 0)
        child_fail(rfd, "identity", "write /etc/hostname");
    n = snprintf(text, sizeof text, "%s127.0.1.1\t%s\n", HOSTS_HEAD, id);
    if (n < 0 || (size_t)n >= sizeof text || put_file(etc, "hosts", text, (size_t)n, ub) < 0)
        child_fail(rfd, "identity", "write /etc/hosts");
    close(etc);
}

/* The sandbox's tree, in the init (create_child, before it becomes the sandbox's root):
 * detached mounts picked up in the spawner's namespace, attached in a copy of the
 * template's, moved over its root and chroot'ed into.  Returns the upper's root (fd). */
int sandbox_root(struct create_args *a) {
    int rfd = a->report_fd;
    uid_t ub = (uid_t)a->uid_base;
    /* Everything the sandbox's tree is made of is picked up here, in the spawner's mount
     * namespace where the host paths resolve, as detached mounts (open_tree clones, and
     * fsmount for the overlay and the memory medium's tmpfs): the sandbox's namespace
     * then holds its own tree and the template's root, nothing else. */
    int lt[MAX_LAYERS + 1], nl = 0;
    for (; a->lowers[nl] && nl < MAX_LAYERS + 1; nl++) {
        /* the layers, idmapped so the sandbox's root owns their files */
        lt[nl] = (int)syscall(SYS_open_tree, AT_FDCWD, a->lowers[nl], OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC);
        if (lt[nl] < 0) child_fail(rfd, "layer", "open_tree %s", a->lowers[nl]);
        struct mount_attr_s attr = {.attr_set = MOUNT_ATTR_IDMAP | MOUNT_ATTR_RDONLY,
                                    .userns_fd = (uint64_t)a->userns_fd};
        if (syscall(SYS_mount_setattr, lt[nl], "", AT_EMPTY_PATH, &attr, sizeof attr) < 0)
            child_fail(rfd, "layer", "idmap %s", a->lowers[nl]);
    }
    if (nl == 0) child_fail(rfd, "layer", "no lower layers");
    trace("lowers");
    /* Upper: a directory the host prepared on the node's disk store (a btrfs subvolume
     * under a quota: no superblock of its own), or a tmpfs sized by the disk quota and
     * charged to the sandbox's memory cgroup ("memory" medium).  Either holds upper/,
     * work/ and shm/ (the sandbox's /dev/shm, inside the same quota).  The init keeps its
     * root open (fd 3): the host reaches the upper at /proc/<init>/fd/3. */
    int uroot;
    if (a->upper) {
        uroot = (int)syscall(SYS_open_tree, AT_FDCWD, a->upper, OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC);
        if (uroot < 0) child_fail(rfd, "disk", "bind upper %s", a->upper);
    } else {
        char v[32];
        int fs = (int)syscall(SYS_fsopen, "tmpfs", 1 /* FSOPEN_CLOEXEC */);
        if (fs < 0) child_fail(rfd, "disk", "fsopen tmpfs");
        snprintf(v, sizeof v, "%llu", a->disk);
        if (syscall(SYS_fsconfig, fs, 1 /* SET_STRING */, "size", v, 0) < 0) child_fail(rfd, "disk", "tmpfs size %s", v);
        snprintf(v, sizeof v, "%llu", a->inodes);
        if (syscall(SYS_fsconfig, fs, 1, "nr_inodes", v, 0) < 0) child_fail(rfd, "disk", "tmpfs nr_inodes %s", v);
        if (syscall(SYS_fsconfig, fs, 1, "mode", "0755", 0) < 0 || syscall(SYS_fsconfig, fs, 1, "source", "dsec-upper", 0) < 0 ||
            syscall(SYS_fsconfig, fs, 6 /* CREATE */, NULL, NULL, 0) < 0)
            child_fail(rfd, "disk", "upper tmpfs");
        uroot = (int)syscall(SYS_fsmount, fs, 1 /* FSMOUNT_CLOEXEC */, 0x2 /* NOSUID */ | 0x4 /* NODEV */);
        if (uroot < 0) child_fail(rfd, "disk", "mount upper tmpfs");
        close(fs);
        if (mkdirat(uroot, "upper", 0755) < 0 || fchownat(uroot, "upper", ub, ub, 0) < 0 ||
            mkdirat(uroot, "work", 0700) < 0 || mkdirat(uroot, "shm", 01777) < 0 ||
            fchownat(uroot, "shm", ub, ub, 0) < 0 || fchmodat(uroot, "shm", 01777, 0) < 0)
            child_fail(rfd, "disk", "upper dirs");
    }
    int updir = openat(uroot, "upper", O_PATH | O_DIRECTORY | O_CLOEXEC | O_NOFOLLOW);
    int wkdir = openat(uroot, "work", O_PATH | O_DIRECTORY | O_CLOEXEC | O_NOFOLLOW);
    if (updir < 0 || wkdir < 0) child_fail(rfd, "disk", "open upper/ and work/");
    write_identity(updir, a->id, ub, rfd);
    trace("identity");
    int ovfs = (int)syscall(SYS_fsopen, "overlay", 1 /* FSOPEN_CLOEXEC */);
    if (ovfs < 0) child_fail(rfd, "mount", "fsopen overlay");
    for (int i = 0; i < nl; i++) /* top first, like lowerdir= */
        if (syscall(SYS_fsconfig, ovfs, 5 /* SET_FD */, "lowerdir+", NULL, lt[i]) < 0)
            child_fail(rfd, "mount", "overlay layer %s", a->lowers[i]);
    if (syscall(SYS_fsconfig, ovfs, 5, "upperdir", NULL, updir) < 0 ||
        syscall(SYS_fsconfig, ovfs, 5, "workdir", NULL, wkdir) < 0)
        child_fail(rfd, "mount", "overlay upper");
    static const char *ovopts[] = {"source=dsec-root", "redirect_dir=off", "metacopy=off", "index=off", "xino=off", NULL};
    for (int i = 0; ovopts[i]; i++) {
        const char *eq = strchr(ovopts[i], '=');
        char key[32];
        snprintf(key, sizeof key, "%.*s", (int)(eq - ovopts[i]), ovopts[i]);
        if (syscall(SYS_fsconfig, ovfs, 1 /* SET_STRING */, key, eq + 1, 0) < 0)
            child_fail(rfd, "mount", "overlay option %s", ovopts[i]);
    }
    if (syscall(SYS_fsconfig, ovfs, 6 /* CREATE */, NULL, NULL, 0) < 0) child_fail(rfd, "mount", "create overlay");
    int ov = (int)syscall(SYS_fsmount, ovfs, 1 /* FSMOUNT_CLOEXEC */, 0x2 /* NOSUID */);
    if (ov < 0) child_fail(rfd, "mount", "fsmount overlay");
    close(ovfs);
    close(updir);
    close(wkdir);
    for (int i = 0; i < nl; i++) close(lt[i]);
    trace("overlay");
    /* /dev: the node's read-only skeleton (files, symlinks, pts/ and shm/ directories), the
     * host's harmless character devices, the upper's shm/; /sys and masked /proc
     * directories: the node's empty directory.  Bind mounts only: no superblock per
     * sandbox (each one costs every memory cgroup on the node a shrinker slot,
     * docs/PERFORMANCE.md). */
    static const char *devs[] = {"null", "zero", "full", "random", "urandom", "tty", NULL};
    int devfd[8], skel = -1, shm = -1, emp = -1;
    {
        struct mount_attr_s ro = {.attr_set = MOUNT_ATTR_RDONLY | 0x2 /* NOSUID */ | 0x8 /* NOEXEC */};
        struct mount_attr_s dv = {.attr_set = 0x2 /* NOSUID */ | 0x8 /* NOEXEC */};
        struct mount_attr_s sh = {.attr_set = 0x2 /* NOSUID */ | 0x4 /* NODEV */};
        struct mount_attr_s em = {.attr_set = MOUNT_ATTR_RDONLY | 0x2 | 0x4 | 0x8};
        skel = (int)syscall(SYS_open_tree, AT_FDCWD, a->devskel, OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC);
        if (skel < 0 || syscall(SYS_mount_setattr, skel, "", AT_EMPTY_PATH, &ro, sizeof ro) < 0)
            child_fail(rfd, "dev", "bind /dev skeleton %s", a->devskel);
        for (int i = 0; devs[i]; i++) {
            char src[64];
            snprintf(src, sizeof src, "/dev/%s", devs[i]);
            devfd[i] = (int)syscall(SYS_open_tree, AT_FDCWD, src, OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC);
            if (devfd[i] < 0 || syscall(SYS_mount_setattr, devfd[i], "", AT_EMPTY_PATH, &dv, sizeof dv) < 0)
                child_fail(rfd, "dev", "bind %s", src);
        }
        shm = (int)syscall(SYS_open_tree, uroot, "shm", OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC);
        if (shm < 0 || syscall(SYS_mount_setattr, shm, "", AT_EMPTY_PATH, &sh, sizeof sh) < 0)
            child_fail(rfd, "dev", "bind /dev/shm");
        emp = (int)syscall(SYS_open_tree, AT_FDCWD, a->empty, OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC);
        if (emp < 0 || syscall(SYS_mount_setattr, emp, "", AT_EMPTY_PATH, &em, sizeof em) < 0)
            child_fail(rfd, "sys", "bind the empty directory %s", a->empty);
    }
    trace("binds");
    /* From here on, a private copy of the template namespace (see tmpl_make). */
    if (setns(tmpl_fd, CLONE_NEWNS) < 0) child_fail(rfd, "mount", "enter the template mount namespace");
    if (unshare(CLONE_NEWNS) < 0) child_fail(rfd, "mount", "copy the template mount namespace");
    if (chdir("/") < 0) child_fail(rfd, "mount", "chdir /");
    if (syscall(SYS_move_mount, ov, "", AT_FDCWD, "r", MOVE_MOUNT_F_EMPTY_PATH) < 0)
        child_fail(rfd, "mount", "attach the overlay");
    close(ov);
    trace("template");
    /* /proc: fresh, with kernel knobs read-only and host-revealing files masked. */
    if (ensure_dir("r/proc", ub, ub, 0555) < 0) child_fail(rfd, "proc", "mkdir /proc");
    /* hidepid: a process is shown only to its own uid (ptrace's read check) and to the
     * sandbox root's group, given as its host gid: this mount is made in the host's user
     * namespace, where proc reads gid= (the sandbox maps its ids 0.. to uid_base..). */
    char procopts[64];
    snprintf(procopts, sizeof procopts, "hidepid=invisible,gid=%lu", a->uid_base);
    if (mount("proc", "r/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, a->hidepid ? procopts : NULL) < 0)
        child_fail(rfd, "proc", "mount proc");
    static const char *ro_proc[] = {"sys", "sysrq-trigger", "irq", "bus", "fs", "driver", NULL};
    for (int i = 0; ro_proc[i]; i++) {
        char p[128];
        snprintf(p, sizeof p, "r/proc/%s", ro_proc[i]);
        if (access(p, F_OK) < 0) continue;
        if (mount(p, p, NULL, MS_BIND | MS_REC, NULL) < 0 ||
            mount(NULL, p, NULL, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL) < 0)
            child_fail(rfd, "proc", "read-only %s", p);
    }
    trace("proc");
    if (ensure_dir("r/dev", ub, ub, 0755) < 0) child_fail(rfd, "dev", "mkdir /dev");
    if (syscall(SYS_move_mount, skel, "", AT_FDCWD, "r/dev", MOVE_MOUNT_F_EMPTY_PATH) < 0)
        child_fail(rfd, "dev", "attach the /dev skeleton");
    for (int i = 0; devs[i]; i++) {
        char dst[64];
        snprintf(dst, sizeof dst, "r/dev/%s", devs[i]);
        if (syscall(SYS_move_mount, devfd[i], "", AT_FDCWD, dst, MOVE_MOUNT_F_EMPTY_PATH) < 0)
            child_fail(rfd, "dev", "attach /dev/%s", devs[i]);
        close(devfd[i]);
    }
    if (syscall(SYS_move_mount, shm, "", AT_FDCWD, "r/dev/shm", MOVE_MOUNT_F_EMPTY_PATH) < 0)
        child_fail(rfd, "dev", "attach /dev/shm");
    close(skel);
    close(shm);
    trace("dev");
    /* /sys: empty and read-only; nothing of the host's hardware or cgroups shows. */
    if (ensure_dir("r/sys", ub, ub, 0555) < 0) child_fail(rfd, "sys", "mkdir /sys");
    if (syscall(SYS_move_mount, emp, "", AT_FDCWD, "r/sys", MOVE_MOUNT_F_EMPTY_PATH) < 0)
        child_fail(rfd, "sys", "mount /sys");
    close(emp);
    /* Mask /proc files that reveal or poke the host: directories get the empty read-only
     * directory (/sys's), files /dev/null. */
    static const char *masked[] = {"kcore", "keys", "timer_list", "sched_debug", "latency_stats",
                                   "kallsyms", "kpagecount", "kpageflags", "kpagecgroup", "sysvipc", NULL};
    for (int i = 0; masked[i]; i++) {
        char p[128];
        snprintf(p, sizeof p, "r/proc/%s", masked[i]);
        if (access(p, F_OK) < 0) continue;
        struct stat st;
        const char *src = stat(p, &st) == 0 && S_ISDIR(st.st_mode) ? "r/sys" : "r/dev/null";
        if (mount(src, p, NULL, MS_BIND, NULL) < 0 ||
            mount(NULL, p, NULL, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL) < 0)
            child_fail(rfd, "proc", "mask %s", p);
    }
    trace("masks");
    /* /tmp must be world-writable even when the image forgot it. */
    if (ensure_dir("r/tmp", ub, ub, 01777) < 0) child_fail(rfd, "mount", "mkdir /tmp");
    int upper_fd = uroot;

    trace("sys+tmp");
    /* Switch root: the overlay (with everything under it) moves over the namespace's root,
     * and becomes ours.  setns() into this namespace lands on it too (it looks "/" up
     * through the mounts stacked on the root). */
    if (chdir("r") < 0) child_fail(rfd, "root", "chdir r");
    if (mount(".", "/", NULL, MS_MOVE, NULL) < 0) child_fail(rfd, "root", "move the root over /");
    if (chroot(".") < 0) child_fail(rfd, "root", "chroot");
    if (chdir("/") < 0) child_fail(rfd, "root", "chdir /");

    trace("root");
    return upper_fd;
}
