/*
 * The one reading of a request frame's payload (see agentwire.py for the wire). Parses
 * only: it opens, starts and changes nothing. Every cap is enforced by refusing the
 * request (EINVAL / E2BIG with a message), never by truncating it; unknown keys and
 * repeated single-valued keys are refused too.
 */
#include "vmagent.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

const char *const op_names[OP_COUNT] = {
    "ping", "hello", "exec", "signal", "resize", "stat", "list", "read", "write",
    "mkdir", "remove", "rename", "identity", "sync", "poweroff", "netcut",
};

static int refuse(struct req *r, int err, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(r->msg, sizeof r->msg, fmt, ap);
    va_end(ap);
    r->err = err;
    return -1;
}

/* A decimal integer in [lo, hi], no sign, no leading garbage, no overflow. */
static int num(struct req *r, const char *key, const char *v, uint64_t lo, uint64_t hi, uint64_t *out) {
    uint64_t n = 0;
    if (!*v) return refuse(r, EINVAL, "%s: empty number", key);
    for (const char *p = v; *p; p++) {
        if (*p < '0' || *p > '9') return refuse(r, EINVAL, "%s: not a decimal number", key);
        if (p - v >= 20 || n > (UINT64_MAX - (uint64_t)(*p - '0')) / 10)
            return refuse(r, EINVAL, "%s: number too large", key);
        n = n * 10 + (uint64_t)(*p - '0');
    }
    if (n < lo || n > hi) return refuse(r, EINVAL, "%s: %llu is outside %llu..%llu", key,
                                        (unsigned long long)n, (unsigned long long)lo,
                                        (unsigned long long)hi);
    *out = n;
    return 0;
}

static int path_ok(struct req *r, const char *key, const char *v) {
    size_t n = strlen(v);
    if (n >= MAX_PATH) return refuse(r, EINVAL, "%s: longer than %d bytes", key, MAX_PATH - 1);
    if (v[0] != '/') return refuse(r, EINVAL, "%s: must be an absolute path", key);
    return 0;
}

static int hexval(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
}

/* Keys each op takes; a key's bit in `seen` catches repeats (a and e may repeat). */
static const char *const op_keys[OP_COUNT][12] = {
    [OP_PING] = {0},
    [OP_HELLO] = {0},
    [OP_EXEC] = {"a", "e", "cwd", "uid", "gid", "tty", "rows", "cols", "stdin", "win", 0},
    [OP_SIGNAL] = {"ch", "sig", "tree", "spare", 0},
    [OP_RESIZE] = {"ch", "rows", "cols", 0},
    [OP_STAT] = {"path", "follow", 0},
    [OP_LIST] = {"path", 0},
    [OP_READ] = {"path", "max", "win", 0},
    [OP_WRITE] = {"path", "mode", "uid", "gid", "append", 0},
    [OP_MKDIR] = {"path", "mode", "uid", "gid", "parents", 0},
    [OP_REMOVE] = {"path", "recursive", 0},
    [OP_RENAME] = {"src", "dst", 0},
    [OP_IDENTITY] = {"hostname", "machine_id", "seed", "realtime_ns", 0},
    [OP_SYNC] = {"freeze", 0},
    [OP_POWEROFF] = {0},
    [OP_NETCUT] = {"allow", 0},
};

/* Keys that must be present, per op. */
static const char *const op_required[OP_COUNT][4] = {
    [OP_EXEC] = {"a", 0},
    [OP_SIGNAL] = {"ch", "sig", 0},
    [OP_RESIZE] = {"ch", "rows", "cols", 0},
    [OP_STAT] = {"path", 0},
    [OP_LIST] = {"path", 0},
    [OP_READ] = {"path", "max", 0},
    [OP_WRITE] = {"path", 0},
    [OP_MKDIR] = {"path", 0},
    [OP_REMOVE] = {"path", 0},
    [OP_RENAME] = {"src", "dst", 0},
    [OP_IDENTITY] = {"hostname", "machine_id", "seed", 0},
};

static int key_index(enum op op, const char *k) {
    for (int i = 0; op_keys[op][i]; i++)
        if (!strcmp(op_keys[op][i], k)) return i;
    return -1;
}

static int flag(struct req *r, const char *k, const char *v, int *out) {
    if (!strcmp(v, "0")) *out = 0;
    else if (!strcmp(v, "1")) *out = 1;
    else return refuse(r, EINVAL, "%s takes 0 or 1", k);
    return 0;
}

static int field(struct req *r, const char *k, const char *v) {
    uint64_t n = 0;
    switch (r->op) {
    case OP_EXEC:
        if (!strcmp(k, "a")) {
            if (r->argc >= MAX_ARGS) return refuse(r, E2BIG, "more than %d arguments", MAX_ARGS);
            if (r->argc == 0 && !*v) return refuse(r, EINVAL, "exec: empty command");
            r->argv[r->argc++] = v;
        } else if (!strcmp(k, "e")) {
            if (r->envc >= MAX_ENV) return refuse(r, E2BIG, "more than %d environment entries", MAX_ENV);
            const char *eq = strchr(v, '=');
            if (!eq || eq == v) return refuse(r, EINVAL, "environment entry without a NAME= prefix");
            r->env[r->envc++] = v;
        } else if (!strcmp(k, "cwd")) {
            if (path_ok(r, k, v)) return -1;
            r->cwd = v;
        } else if (!strcmp(k, "uid") || !strcmp(k, "gid")) {
            if (num(r, k, v, 0, 0xfffffffeu, &n)) return -1;
            *(k[0] == 'u' ? &r->uid : &r->gid) = (uint32_t)n;
        } else if (!strcmp(k, "tty")) {
            return flag(r, k, v, &r->tty);
        } else if (!strcmp(k, "stdin")) {
            return flag(r, k, v, &r->with_stdin);
        } else if (!strcmp(k, "rows") || !strcmp(k, "cols")) {
            if (num(r, k, v, 1, 0xffff, &n)) return -1;
            *(k[0] == 'r' ? &r->rows : &r->cols) = (unsigned)n;
        } else if (!strcmp(k, "win")) {
            if (num(r, k, v, 0, 0xffffffffu, &n)) return -1;
            r->win = (uint32_t)n;
        }
        return 0;
    case OP_SIGNAL:
    case OP_RESIZE:
        if (!strcmp(k, "ch")) {
            if (num(r, k, v, 1, 0xffffffffu, &n)) return -1;
            r->ch = (uint32_t)n;
        } else if (!strcmp(k, "sig")) {
            if (num(r, k, v, 1, 64, &n)) return -1;
            r->sig = (int)n;
        } else if (!strcmp(k, "tree")) {
            return flag(r, k, v, &r->tree);
        } else if (!strcmp(k, "spare")) {
            return flag(r, k, v, &r->spare);
        } else {
            if (num(r, k, v, 1, 0xffff, &n)) return -1;
            *(k[0] == 'r' ? &r->rows : &r->cols) = (unsigned)n;
        }
        return 0;
    case OP_STAT: case OP_LIST: case OP_READ: case OP_WRITE: case OP_MKDIR: case OP_REMOVE:
        if (!strcmp(k, "path")) {
            if (path_ok(r, k, v)) return -1;
            r->path = v;
        } else if (!strcmp(k, "follow")) {
            return flag(r, k, v, &r->follow);
        } else if (!strcmp(k, "append")) {
            return flag(r, k, v, &r->append);
        } else if (!strcmp(k, "parents")) {
            return flag(r, k, v, &r->parents);
        } else if (!strcmp(k, "recursive")) {
            return flag(r, k, v, &r->recursive);
        } else if (!strcmp(k, "max")) {
            return num(r, k, v, 0, UINT64_MAX >> 1, &r->max);
        } else if (!strcmp(k, "win")) {
            if (num(r, k, v, 0, 0xffffffffu, &n)) return -1;
            r->win = (uint32_t)n;
        } else if (!strcmp(k, "mode")) {
            if (num(r, k, v, 0, 07777, &n)) return -1;
            r->mode = (uint32_t)n;
        } else {  /* uid, gid */
            if (num(r, k, v, 0, 0xfffffffeu, &n)) return -1;
            *(k[0] == 'u' ? &r->uid : &r->gid) = (uint32_t)n;
        }
        return 0;
    case OP_RENAME:
        if (path_ok(r, k, v)) return -1;
        *(k[0] == 's' ? &r->path : &r->path2) = v;
        return 0;
    case OP_IDENTITY:
        if (!strcmp(k, "hostname")) {
            size_t l = strlen(v);
            if (l == 0 || l > MAX_HOSTNAME) return refuse(r, EINVAL, "hostname: 1..%d bytes", MAX_HOSTNAME);
            for (const char *p = v; *p; p++)
                if (!((*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z') || (*p >= '0' && *p <= '9') ||
                      *p == '-' || *p == '.'))
                    return refuse(r, EINVAL, "hostname: only letters, digits, '-' and '.'");
            r->hostname = v;
        } else if (!strcmp(k, "machine_id")) {
            if (strlen(v) != 32) return refuse(r, EINVAL, "machine_id: 32 lowercase hex digits");
            for (const char *p = v; *p; p++)
                if (hexval(*p) < 0) return refuse(r, EINVAL, "machine_id: 32 lowercase hex digits");
            r->machine_id = v;
        } else if (!strcmp(k, "seed")) {
            size_t l = strlen(v);
            if (l % 2 || l / 2 > MAX_SEED) return refuse(r, EINVAL, "seed: an even number of hex digits, at most %d bytes", MAX_SEED);
            for (size_t i = 0; i < l; i += 2) {
                int hi = hexval(v[i]), lo = hexval(v[i + 1]);
                if (hi < 0 || lo < 0) return refuse(r, EINVAL, "seed: lowercase hex digits only");
                r->seed[i / 2] = (uint8_t)(hi << 4 | lo);
            }
            r->seedlen = l / 2;
        } else {
            if (num(r, k, v, 0, UINT64_MAX >> 1, &r->realtime_ns)) return -1;
            r->has_realtime = 1;
        }
        return 0;
    case OP_SYNC:
        return flag(r, k, v, &r->freeze);
    case OP_NETCUT: {
        /* "A.B.C.D/N tcp|udp LO-HI" */
        unsigned a, b, c, d, n, lo, hi;
        char proto[4], tail;
        if (r->nallow >= MAX_ALLOW) return refuse(r, E2BIG, "more than %d allow elements", MAX_ALLOW);
        if (sscanf(v, "%u.%u.%u.%u/%u %3s %u-%u%c", &a, &b, &c, &d, &n, proto, &lo, &hi, &tail) != 8 ||
            a > 255 || b > 255 || c > 255 || d > 255 || n > 32 || lo > hi || hi > 65535 ||
            (strcmp(proto, "tcp") && strcmp(proto, "udp")))
            return refuse(r, EINVAL, "allow: A.B.C.D/N tcp|udp LO-HI");
        uint32_t mask = n ? 0xffffffffu << (32 - n) : 0;
        r->allow[r->nallow].net = ((uint32_t)a << 24 | b << 16 | c << 8 | d) & mask;
        r->allow[r->nallow].mask = mask;
        r->allow[r->nallow].proto = proto[0] == 't' ? 6 : 17;
        r->allow[r->nallow].lo = (uint16_t)lo;
        r->allow[r->nallow].hi = (uint16_t)hi;
        r->nallow++;
        return 0;
    }
    default:
        return 0;
    }
}

int parse_request(const uint8_t *payload, uint32_t len, uint32_t chan, struct req *r) {
    const char *tok[MAX_TOK];
    int ntok = 0;
    unsigned seen = 0;

    memset(r, 0, offsetof(struct req, argv));
    r->argc = r->envc = 0;
    r->cwd = "/";
    r->uid = r->gid = 0;
    r->tty = r->with_stdin = 0;
    r->rows = 24;
    r->cols = 80;
    r->win = DEFAULT_WINDOW;
    r->ch = 0;
    r->sig = 0;
    r->tree = 1;
    r->path = r->path2 = NULL;
    r->follow = r->append = r->parents = r->recursive = 0;
    r->mode = 0;
    r->max = 0;
    r->hostname = r->machine_id = NULL;
    r->seedlen = 0;
    r->has_realtime = 0;
    r->realtime_ns = 0;
    r->freeze = -1;
    r->nallow = 0;
    r->err = 0;
    r->msg[0] = 0;
    r->chan = chan;

    if (chan == 0) return refuse(r, EINVAL, "request on channel 0");
    if (len == 0 || payload[len - 1] != 0) return refuse(r, EINVAL, "the payload must end with a NUL");
    for (uint32_t i = 0; i < len;) {
        if (ntok >= MAX_TOK)
            return refuse(r, E2BIG, "the request has more than %d tokens: refused (nothing is ever truncated)", MAX_TOK);
        tok[ntok++] = (const char *)payload + i;
        i += (uint32_t)strlen((const char *)payload + i) + 1;
    }
    int op = -1;
    for (int i = 0; i < OP_COUNT; i++)
        if (!strcmp(tok[0], op_names[i])) op = i;
    if (op < 0) return refuse(r, EINVAL, "unknown op %.64s", tok[0]);
    r->op = (enum op)op;
    if (ntok % 2 == 0) return refuse(r, EINVAL, "%s: a key without a value", tok[0]);
    if (op == OP_WRITE) r->mode = 0644;
    if (op == OP_MKDIR) r->mode = 0755;
    for (int i = 1; i + 1 < ntok; i += 2) {
        int ki = key_index(r->op, tok[i]);
        if (ki < 0) return refuse(r, EINVAL, "%s takes no key %.64s", tok[0], tok[i]);
        int repeats = (r->op == OP_EXEC && ki <= 1) || r->op == OP_NETCUT;  /* a, e; allow */
        if (!repeats && (seen & (1u << ki))) return refuse(r, EINVAL, "%s: key %s given twice", tok[0], tok[i]);
        seen |= 1u << ki;
        if (field(r, tok[i], tok[i + 1])) return -1;
    }
    for (int i = 0; op_required[op][i]; i++)
        if (!(seen & (1u << key_index(r->op, op_required[op][i]))))
            return refuse(r, EINVAL, "%s needs %s", tok[0], op_required[op][i]);
    if (op == OP_EXEC) r->argv[r->argc] = NULL, r->env[r->envc] = NULL;
    if (op == OP_READ && r->max > UINT64_MAX >> 1) return refuse(r, EINVAL, "max too large");
    return 0;
}
