/*
 * Pristine paths: an exec child's private mount namespace where named paths are the
 * image layers' own copies (read-only), whatever the sandbox did to them.
 */
#include "spawner.h"

/*
 * Pristine paths: an exec that names them runs in a mount namespace of its own
 * (a copy of the sandbox's, owned by the host user namespace) where each path
 * is a read-only bind from an overlay of the image layers alone.  The layers
 * are cloned from the host's mounts before entering the sandbox (no host path
 * is reachable after), idmapped like the sandbox's own lowers.
 */
int pristine_layers(char **lowers, int userns_fd, int rfd) {
    int t[MAX_LAYERS + 1], n = 0;
    for (; lowers[n] && n < MAX_LAYERS + 1; n++) {
        t[n] = (int)syscall(SYS_open_tree, AT_FDCWD, lowers[n], OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC);
        if (t[n] < 0) child_fail(rfd, "pristine", "open_tree %s", lowers[n]);
        struct mount_attr_s attr = {.attr_set = MOUNT_ATTR_IDMAP | MOUNT_ATTR_RDONLY, .userns_fd = (uint64_t)userns_fd};
        if (syscall(SYS_mount_setattr, t[n], "", AT_EMPTY_PATH, &attr, sizeof attr) < 0)
            child_fail(rfd, "pristine", "idmap %s", lowers[n]);
    }
    if (n == 0) { errno = EINVAL; child_fail(rfd, "pristine", "no image layers"); }
    if (n == 1) {
        /* overlayfs wants two lowers without an upper (and a clone of a clone is refused):
         * an empty tmpfs below the one layer changes nothing. */
        int e = (int)syscall(SYS_fsopen, "tmpfs", 1 /* FSOPEN_CLOEXEC */);
        if (e < 0 || syscall(SYS_fsconfig, e, 1 /* SET_STRING */, "size", "4k", 0) < 0 ||
            syscall(SYS_fsconfig, e, 6 /* CMD_CREATE */, NULL, NULL, 0) < 0)
            child_fail(rfd, "pristine", "empty bottom layer");
        t[1] = (int)syscall(SYS_fsmount, e, 1 /* FSMOUNT_CLOEXEC */, MOUNT_ATTR_RDONLY);
        if (t[1] < 0) child_fail(rfd, "pristine", "mount empty bottom layer");
        close(e);
        lowers[1] = NULL;
        n = 2;
    }
    int fs = (int)syscall(SYS_fsopen, "overlay", 1 /* FSOPEN_CLOEXEC */);
    if (fs < 0) child_fail(rfd, "pristine", "fsopen overlay");
    for (int i = 0; i < n; i++) /* top first, like lowerdir= */
        if (syscall(SYS_fsconfig, fs, 5 /* SET_FD */, "lowerdir+", NULL, t[i]) < 0)
            child_fail(rfd, "pristine", "overlay layer %s", lowers[i] ? lowers[i] : "(empty)");
    static const char *flags[] = {"redirect_dir=off", "metacopy=off", "xino=off", NULL};
    for (int i = 0; flags[i]; i++) {
        const char *eq = strchr(flags[i], '=');
        char key[32];
        snprintf(key, sizeof key, "%.*s", (int)(eq - flags[i]), flags[i]);
        if (syscall(SYS_fsconfig, fs, 1 /* SET_STRING */, key, eq + 1, 0) < 0)
            child_fail(rfd, "pristine", "overlay option %s", flags[i]);
    }
    if (syscall(SYS_fsconfig, fs, 6 /* CMD_CREATE */, NULL, NULL, 0) < 0) child_fail(rfd, "pristine", "create overlay");
    int m = (int)syscall(SYS_fsmount, fs, 1 /* FSMOUNT_CLOEXEC */, MOUNT_ATTR_RDONLY | 0x2 /* NOSUID */ | 0x4 /* NODEV */);
    if (m < 0) child_fail(rfd, "pristine", "fsmount overlay");
    close(fs);
    for (int i = 0; i < n; i++) close(t[i]);
    return m;
}

/* Open path p (absolute) below dirfd without following any symlink; O_PATH. */
static int open_nofollow(int dirfd, const char *p, uint64_t extra_resolve) {
    struct dsec_open_how how = {.flags = O_PATH | O_NOFOLLOW | O_CLOEXEC,
                                .resolve = DSEC_RESOLVE_NO_SYMLINKS | DSEC_RESOLVE_NO_MAGICLINKS | extra_resolve};
    return (int)syscall(SYS_openat2, dirfd, p[1] ? p + 1 : ".", &how, sizeof how);
}

/* In the sandbox's mount namespace (as host root): make a private copy and mount the pristine paths. */
void pristine_mount(int img, char **paths, int rfd) {
    if (unshare(CLONE_NEWNS) < 0) child_fail(rfd, "pristine", "unshare mount namespace");
    if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) < 0) child_fail(rfd, "pristine", "make / private");
    int root = open("/", O_PATH | O_DIRECTORY | O_CLOEXEC);
    if (root < 0) child_fail(rfd, "pristine", "open /");
    for (int i = 0; paths[i]; i++) {
        const char *p = paths[i];
        /* The image's copy: no symlink on the way (a symlink cannot be mounted over). */
        int src = open_nofollow(img, p, DSEC_RESOLVE_BENEATH | DSEC_RESOLVE_NO_XDEV);
        if (src < 0) {
            if (errno == ELOOP) child_fail(rfd, "pristine", "%s is or goes through a symlink in the image: give the path it points to", p);
            child_fail(rfd, "pristine", "%s is not in the image layers", p);
        }
        struct stat ss, ts;
        if (fstat(src, &ss) < 0) child_fail(rfd, "pristine", "stat image %s", p);
        if (S_ISLNK(ss.st_mode)) {
            errno = ELOOP;
            child_fail(rfd, "pristine", "%s is or goes through a symlink in the image: give the path it points to", p);
        }
        /* Where it goes: the same path in the sandbox, unless the sandbox replaced a part of
         * it (a symlink, another file type, removed): then its deepest intact directory
         * ancestor gets the image's copy instead (never the root). */
        char at[4096];
        snprintf(at, sizeof at, "%s", p);
        int dst = -1;
        for (;;) {
            dst = open_nofollow(root, at, 0);
            if (dst >= 0 && fstat(dst, &ts) == 0 && (S_ISDIR(ts.st_mode) == S_ISDIR(ss.st_mode)) &&
                (S_ISDIR(ts.st_mode) || S_ISREG(ts.st_mode)))
                break;
            if (dst >= 0) close(dst);
            char *slash = strrchr(at, '/');
            if (!slash || slash == at) {
                errno = ENOENT;
                child_fail(rfd, "pristine", "%s was removed or replaced in the sandbox up to the root; cannot restore it", p);
            }
            *slash = 0;
            close(src);
            src = open_nofollow(img, at, DSEC_RESOLVE_BENEATH | DSEC_RESOLVE_NO_XDEV);
            if (src < 0 || fstat(src, &ss) < 0 || !S_ISDIR(ss.st_mode)) {
                errno = ENOENT;
                child_fail(rfd, "pristine", "%s was replaced in the sandbox and %s is not a directory in the image", p, at);
            }
        }
        int tree = (int)syscall(SYS_open_tree, src, "", OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC | AT_EMPTY_PATH | AT_RECURSIVE);
        if (tree < 0) child_fail(rfd, "pristine", "clone image %s", at);
        if (syscall(SYS_move_mount, tree, "", dst, "", MOVE_MOUNT_F_EMPTY_PATH | MOVE_MOUNT_T_EMPTY_PATH) < 0)
            child_fail(rfd, "pristine", "mount image copy over %s", at);
        close(tree);
        close(dst);
        close(src);
    }
    close(root);
}
