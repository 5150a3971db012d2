/*
 * dsec-vmagent: the microVM guest's PID 1 (init + agent). The wire is documented in
 * src/dsec/backends/microvm/agentwire.py, which mirrors every cap below by name;
 * tests/integration/test_microvm_wire.py runs each request through both parsers.
 */
#ifndef DSEC_VMAGENT_H
#define DSEC_VMAGENT_H

#define _GNU_SOURCE
#include <stddef.h>
#include <stdint.h>

#define AGENT_VERSION 1
#define HDR_LEN 9                 /* <u32le len><u32le chan><u8 type> */
#define MAX_FRAME 65536           /* payload bytes of one frame */
#define MAX_TOK 8192              /* tokens in one request (op, then two per field) */
#define MAX_ARGS 4000             /* argv entries (key a); under MAX_TOK/2 so it binds */
#define MAX_ENV 4000              /* environment entries (key e) */
#define MAX_PATH 4096             /* a path token, NUL included (so 4095 bytes of text) */
#define MAX_HOSTNAME 64
#define MAX_SEED 256              /* bytes of identity seed (512 hex digits) */
#define MAX_CHANS 256             /* live execs and transfers */
#define MAX_LAYERS 16             /* dsec-l0 .. dsec-l15 */
#define MAX_ALLOW 2048            /* elements of a netcut's allow-set */
#define STDIN_WINDOW (256 * 1024) /* stdin bytes the host may have in flight per exec */
#define DEFAULT_WINDOW (256 * 1024)
/* The guest's network (network.py holds the same values): eth0, when the VM has a NIC, is
 * NET_GUEST_IP/30 behind NET_GATEWAY_IP, the tap in its sandbox's network namespace on the
 * host, whose MAC is fixed (a permanent neighbour: nothing to resolve after a restore). */
#define NET_GUEST_IP "192.0.2.2"
#define NET_GATEWAY_IP "192.0.2.1"
#define NET_NETMASK "255.255.255.252"
#define NET_GATEWAY_MAC "02:64:73:65:63:01"
#define DEFAULT_PATH "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

/* frame types */
#define T_REQUEST 'Q'
#define T_INPUT 'I'
#define T_CREDIT 'K'
#define T_HELLO 'H'
#define T_ANSWER 'A'
#define T_STDOUT 'O'
#define T_STDERR 'E'
#define T_DIRENT 'D'
#define T_EXIT 'X'
#define T_INCREDIT 'J'

enum op {
    OP_PING, OP_HELLO, OP_EXEC, OP_SIGNAL, OP_RESIZE, OP_STAT, OP_LIST, OP_READ, OP_WRITE,
    OP_MKDIR, OP_REMOVE, OP_RENAME, OP_IDENTITY, OP_SYNC, OP_POWEROFF, OP_NETCUT, OP_COUNT
};

extern const char *const op_names[OP_COUNT];

/* One parsed request. Strings point into the frame it came from (valid while it is). */
struct req {
    enum op op;
    uint32_t chan;
    /* exec */
    const char *argv[MAX_ARGS + 1];
    int argc;
    const char *env[MAX_ENV + 1];
    int envc;
    const char *cwd;
    uint32_t uid, gid;
    int tty, with_stdin;
    unsigned rows, cols;
    uint32_t win;
    /* signal, resize */
    uint32_t ch;
    int sig, tree, spare;
    /* files */
    const char *path, *path2;
    int follow, append, parents, recursive;
    uint32_t mode;
    uint64_t max;
    /* identity */
    const char *hostname, *machine_id;
    uint8_t seed[MAX_SEED];
    size_t seedlen;
    int has_realtime;
    uint64_t realtime_ns;
    /* sync: -1 absent, 0 thaw, 1 freeze */
    int freeze;
    /* netcut: the allow-set of the policy now in force (host order) */
    struct { uint32_t net, mask; uint8_t proto; uint16_t lo, hi; } allow[MAX_ALLOW];
    int nallow;
    /* a refusal: errno and why */
    int err;
    char msg[256];
};

/* 0, or -1 with r->err and r->msg set (the request is refused; nothing is truncated). */
int parse_request(const uint8_t *payload, uint32_t len, uint32_t chan, struct req *r);

static inline uint32_t get_u32le(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
static inline void put_u32le(uint8_t *p, uint32_t v) {
    p[0] = v & 0xff; p[1] = (v >> 8) & 0xff; p[2] = (v >> 16) & 0xff; p[3] = (v >> 24) & 0xff;
}

#endif
