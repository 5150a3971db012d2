/*
 * Landlock: a stage's file rules ("ld" default class, "lr" class:path) turned into a
 * ruleset by walking the sandbox's tree, in an exec child inside the sandbox's mount
 * namespace.  Never grants anything a rule does not name.
 */
#include "spawner.h"

/* Our own Landlock ABI definitions: Debian 12's linux/landlock.h predates ABI 3. */
#ifndef SYS_landlock_create_ruleset
#define SYS_landlock_create_ruleset 444
#endif
#ifndef SYS_landlock_add_rule
#define SYS_landlock_add_rule 445
#endif
#ifndef SYS_landlock_restrict_self
#define SYS_landlock_restrict_self 446
#endif
#define DSEC_LL_CREATE_RULESET_VERSION (1U << 0)
#define DSEC_LL_RULE_PATH_BENEATH 1
#define LLA_EXECUTE (1ULL << 0)
#define LLA_WRITE_FILE (1ULL << 1)
#define LLA_READ_FILE (1ULL << 2)
#define LLA_READ_DIR (1ULL << 3)
#define LLA_REFER (1ULL << 13)    /* ABI 2 */
#define LLA_TRUNCATE (1ULL << 14) /* ABI 3 */
#define LLA_IOCTL_DEV (1ULL << 15) /* ABI 5 */
/* Rights that make sense on a non-directory (others are refused by landlock_add_rule). */
#define LLA_FILE_MASK (LLA_EXECUTE | LLA_WRITE_FILE | LLA_READ_FILE | LLA_TRUNCATE | LLA_IOCTL_DEV)
#define LLA_RO (LLA_EXECUTE | LLA_READ_FILE | LLA_READ_DIR)

struct dsec_ll_ruleset_attr {
    uint64_t handled_access_fs, handled_access_net, scoped;
};
struct dsec_ll_path_beneath {
    uint64_t allowed_access;
    int32_t parent_fd;
} __attribute__((packed));

static int ll_abi = -2; /* -2: not asked yet; <= 0: no Landlock */

static int landlock_abi(void) {
    if (ll_abi == -2) {
        long v = syscall(SYS_landlock_create_ruleset, NULL, 0, DSEC_LL_CREATE_RULESET_VERSION);
        ll_abi = v < 0 ? 0 : (int)v;
    }
    return ll_abi;
}

/* Every filesystem right the running kernel knows: all are handled (denied unless granted). */
static uint64_t ll_handled(int abi) {
    uint64_t h = (1ULL << 13) - 1; /* ABI 1: EXECUTE .. MAKE_SYM */
    if (abi >= 2) h |= LLA_REFER;
    if (abi >= 3) h |= LLA_TRUNCATE;
    if (abi >= 5) h |= LLA_IOCTL_DEV;
    return h;
}

/* A stage's file rules, as sent by the runtime: class 'h'idden, 'r'ead-only, 'w'ritable. */
struct ll_rule {
    const char *path; /* normalised, absolute; "/" allowed */
    size_t len;
    char cls;
};

struct ll_ctx {
    struct ll_rule *rules;
    int nrules;
    uint64_t handled;
    int ruleset;
    int rfd;
};

static uint64_t ll_rights(struct ll_ctx *c, char cls) {
    if (cls == 'w') return c->handled;
    if (cls == 'r') return LLA_RO & c->handled;
    return 0;
}

/* Is rule path q equal to p (len n), or strictly beneath it? p == "" is the root. */
static int ll_beneath(const char *q, size_t ql, const char *p, size_t n, int strict) {
    if (n == 0) return strict ? ql > 1 : 1; /* everything but "/" itself is strictly below the root */
    if (ql < n || memcmp(q, p, n) != 0) return 0;
    if (ql == n) return !strict;
    return q[n] == '/';
}

static int ll_open(int dirfd, const char *name, uint64_t flags) {
    struct dsec_open_how how = {.flags = flags | O_CLOEXEC | O_NOFOLLOW,
                                .resolve = DSEC_RESOLVE_NO_SYMLINKS | DSEC_RESOLVE_NO_MAGICLINKS | DSEC_RESOLVE_BENEATH};
    return (int)syscall(SYS_openat2, dirfd, name, &how, sizeof how);
}

static void ll_grant(struct ll_ctx *c, int fd, uint64_t rights, int is_dir, const char *what) {
    if (!is_dir) rights &= LLA_FILE_MASK;
    if (!rights) return;
    struct dsec_ll_path_beneath pb = {.allowed_access = rights, .parent_fd = fd};
    if (syscall(SYS_landlock_add_rule, c->ruleset, DSEC_LL_RULE_PATH_BENEATH, &pb, 0) < 0)
        child_fail(c->rfd, "landlock", "add rule for %s", what);
}

/*
 * The directory dfd (path p, n bytes; "" for the root) lies on the way to a
 * rule path.  Landlock rules cover whole subtrees, so the directory itself
 * gets only what every path below it may have (plus READ_DIR, so `ls` works),
 * and each entry gets its own rule: the access of its nearest named ancestor
 * (inherited) or its own rule; entries on the way to deeper rules recurse.
 * Nothing follows a symlink: a rule path that is (or goes through) a symlink
 * gets no grant at all.
 */
static void ll_walk(struct ll_ctx *c, int dfd, const char *p, size_t n, char inherited, int depth) {
    if (depth > 64) child_fail(c->rfd, "landlock", "rule paths nest too deep");
    uint64_t mine = ll_rights(c, inherited);
    for (int i = 0; i < c->nrules; i++)
        if (ll_beneath(c->rules[i].path, c->rules[i].len, p, n, 1)) mine &= ll_rights(c, c->rules[i].cls);
    mine |= LLA_READ_DIR & c->handled;
    ll_grant(c, dfd, mine, 1, n ? p : "/");
    int lfd = dup(dfd);
    if (lfd < 0) child_fail(c->rfd, "landlock", "dup");
    if (lseek(lfd, 0, SEEK_SET) < 0) { /* fresh fd */ }
    DIR *d = fdopendir(lfd);
    if (!d) child_fail(c->rfd, "landlock", "list %s", n ? p : "/");
    struct dirent *e;
    char child[4096];
    while ((e = readdir(d)) != NULL) {
        if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0) continue;
        int cl = snprintf(child, sizeof child, "%.*s/%s", (int)n, p, e->d_name);
        if (cl <= 0 || (size_t)cl >= sizeof child) continue;
        char cls = inherited;
        int below = 0;
        for (int i = 0; i < c->nrules; i++) {
            if (ll_beneath(c->rules[i].path, c->rules[i].len, child, (size_t)cl, 0)) {
                if (c->rules[i].len == (size_t)cl) cls = c->rules[i].cls;
                else below = 1;
            }
        }
        uint64_t want = ll_rights(c, cls);
        if (!below && (want & ~mine) == 0) continue; /* the directory's own rule covers it */
        int fd = ll_open(dfd, e->d_name, below ? (O_RDONLY | O_DIRECTORY) : O_PATH);
        if (fd < 0) {
            if (errno == ENOENT || errno == ELOOP) continue; /* gone meanwhile, or a symlink: no grant */
            if (below && errno == ENOTDIR) {
                fd = ll_open(dfd, e->d_name, O_PATH);
                if (fd < 0) continue;
                below = 0;
            } else {
                child_fail(c->rfd, "landlock", "open %s", child);
            }
        }
        struct stat st;
        if (fstat(fd, &st) < 0) child_fail(c->rfd, "landlock", "stat %s", child);
        if (S_ISLNK(st.st_mode)) { close(fd); continue; }
        if (below && S_ISDIR(st.st_mode)) ll_walk(c, fd, child, (size_t)cl, cls, depth + 1);
        else ll_grant(c, fd, want, S_ISDIR(st.st_mode), child);
        close(fd);
    }
    closedir(d);
}

/* An "lr" value: a class letter, ':', an absolute path (1), or not (0). */
int ll_rule_ok(const char *rule) {
    return rule[0] && rule[1] == ':' && rule[2] == '/';
}

/* Build the ruleset for "ld" (default class) and "lr" (class:path) tokens; -1 when there are none. */
int ll_build(char *deflt, char **lr, int rfd) {
    if (!deflt) return -1;
    int abi = landlock_abi();
    if (abi < 1) { errno = EOPNOTSUPP; child_fail(rfd, "landlock", "the kernel has no Landlock"); }
    static struct ll_rule rules[MAX_LL_RULES + 1];
    int nr = 0;
    char root_cls = deflt[0];
    for (int i = 0; lr[i] && nr < MAX_LL_RULES + 1; i++) {
        if (!ll_rule_ok(lr[i])) { errno = EINVAL; child_fail(rfd, "landlock", "bad rule %s", lr[i]); }
        const char *path = lr[i] + 2;
        if (strcmp(path, "/") == 0) { root_cls = lr[i][0]; continue; }
        rules[nr].path = path;
        rules[nr].len = strlen(path);
        rules[nr].cls = lr[i][0];
        nr++;
    }
    struct ll_ctx c = {.rules = rules, .nrules = nr, .handled = ll_handled(abi), .rfd = rfd};
    struct dsec_ll_ruleset_attr attr = {.handled_access_fs = c.handled};
    c.ruleset = (int)syscall(SYS_landlock_create_ruleset, &attr, sizeof attr.handled_access_fs, 0);
    if (c.ruleset < 0) child_fail(rfd, "landlock", "create ruleset (ABI %d)", abi);
    int root = open("/", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (root < 0) child_fail(rfd, "landlock", "open /");
    if (nr == 0) ll_grant(&c, root, ll_rights(&c, root_cls), 1, "/");
    else ll_walk(&c, root, "", 0, root_cls, 0);
    close(root);
    return c.ruleset;
}
