"""The host <-> guest-agent wire of the microVM backend (protocol v1): pure data.

The guest's PID 1, ``dsec-vmagent`` (``native/dsec-vmagent.c``, parser in
``native/vmwire.c``), serves it on the virtio-serial port named ``dsec.agent``; the host
reaches that port through QEMU's chardev unix socket (:mod:`dsec.backends.microvm.agent`).

**Frames.** One byte stream. A frame is a 9-byte header ``<u32le len><u32le chan><u8
type>`` and ``len`` payload bytes, ``len <= MAX_FRAME``. A larger length means the
stream is broken: the agent drops input until the host reconnects. Token payloads are
NUL-terminated strings: a request is ``op\\0key\\0val\\0...``, an answer is
``ok\\0key\\0val\\0...`` or ``err\\0errno\\0<n>\\0msg\\0<text>\\0`` (exec failures add
``stage\\0setup|cwd|user|exec\\0``). Keys ``a`` (argv) and ``e`` (env ``K=V``) repeat;
every other key is given at most once; unknown keys are refused (EINVAL).

host -> guest:

- ``Q`` request; ``chan`` = the request id, a nonzero u32 the host picks (unique among
  the live ones; an exec's or a transfer's frames carry it).
- ``I`` stdin bytes of an exec, or upload bytes of a ``write``; empty = end of input.
- ``K`` output credit for ``chan``: payload u32le bytes.

guest -> host:

- ``H`` hello on chan 0: ``v\\0 1\\0 boot_ns\\0<CLOCK_BOOTTIME ns>\\0`` [``fail\\0<why>\\0``
  when the guest could not build its root: every exec/file op then answers EIO]. Sent
  when the agent starts and each time it sees the host connect again.
- ``A`` the answer to request ``chan``.
- ``O`` / ``E`` stdout / stderr bytes of an exec (``O`` for a pty's merged output), and
  ``O`` for the bytes of a ``read``.
- ``D`` one entry of a ``list`` (tokens ``n <name> type size mode uid gid mtime_ns
  [target]``).
- ``X`` the exit of an exec (tokens ``code sig utime_us stime_us maxrss_kb``; ``code`` is
  -1 when killed by a signal, ``sig`` 0 when it exited).
- ``J`` stdin / upload credit returned: u32le bytes consumed.

Ops (request keys -> answer):

- ``ping`` -> ok. ``hello`` -> ok v boot_ns [fail] (see below). ``poweroff`` -> ok, then
  the guest syncs and powers off.
- ``exec`` a+ e* cwd uid gid tty(0/1) rows cols stdin(0/1) win -> ok pid, then O/E and
  one X on the same chan; or err (with ``stage``) when the process could not start: a
  missing binary is ENOENT here, never a silent exit 127. Output is credit-controlled:
  ``win`` bytes to start, more with K; the agent stops reading a child's pipes while its
  credit is 0. Stdin (``stdin=1``): I frames, at most ``STDIN_WINDOW`` bytes in flight
  (unacknowledged by J); empty I closes it (on a pty: sends ^D). After the process
  exits, what its pipes hold is still sent (within credit), then X; descendants that
  keep the pipes open do not hold X back.
- ``signal`` ch sig tree(0/1) -> ok. ``tree=1`` signals every process of the exec's
  cgroup (SIGKILL through ``cgroup.kill``); ``tree=0`` the process alone, or on a terminal
  (an exec with ``tty``) its foreground job, as ^C would reach.
- ``resize`` ch rows cols -> ok (TIOCSWINSZ on the exec's pty).
- ``stat`` path follow(0/1) -> ok type(f/d/l/o) size mode uid gid mtime_ns [target].
- ``list`` path -> D frames, then ok.
- ``read`` path max win -> O frames within credit (win, then K), then ok size; or err
  (EFBIG when the file is over ``max``, or grows past it while read).
- ``write`` path mode uid gid append(0/1), then the host sends I frames and an empty I
  -> ok n. Each I is acknowledged with J. The agent may answer err at any point (say,
  ENOSPC): the host then stops sending; later I frames for the chan are dropped. Not
  appending, the bytes go to a temporary file renamed over ``path`` at the end.
- ``mkdir`` path mode uid gid parents(0/1); ``remove`` path recursive(0/1); ``rename``
  src dst -> ok.
- ``identity`` hostname machine_id seed(hex) [realtime_ns] -> ok: credits the seed to
  the RNG (RNDADDENTROPY) and reseeds it (RNDRESEEDCRNG), sets the clock, the hostname,
  and writes /etc/hostname, /etc/machine-id and /etc/hosts in the sandbox root.
- ``sync`` [freeze(0/1)] -> ok: sync(); FIFREEZE (1) or FITHAW (0) on the upper disk.
- ``netcut`` allow* ("A.B.C.D/N tcp|udp LO-HI", at most ``MAX_ALLOW``) -> ok n: every IPv4
  TCP connection of the guest (loopback apart) whose peer no tcp element admits is
  destroyed (SOCK_DESTROY; the owner sees ECONNABORTED): ``set_policy``'s cut, in the guest.

File paths are absolute, normalised lexically by both sides, and resolved with
``openat2(RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS)`` against the sandbox root, so ``..``
and symlinks never leave it; /proc, /sys and /dev (the sandbox's own mounts) are refused
with EXDEV. uids and gids are the guest's own (no mapping).

**Changes to the spec as briefed** (for the lead; all backward-compatible additions):

1. ``hello`` op. After a template restore the host's connection is new but the guest
   saw no disconnect (QEMU restores ``host_connected``), so no H frame comes. The client
   therefore asks: :meth:`~dsec.backends.microvm.agent.AgentClient.hello` sends a
   ``hello`` request and takes the first of an H frame or its answer.
2. ``fail`` token in H / hello: a guest whose root could not be mounted says why,
   instead of letting execs run in the bare initramfs.
3. D entries also carry ``uid``, ``gid`` and ``target`` (what ``FileInfo`` needs).
4. ``realtime_ns`` is optional in ``identity`` (absent: the clock is left alone).
5. The initial output window ``win`` is optional (default ``DEFAULT_WINDOW``) and
   ``err`` answers of exec carry ``stage``.
6. A disconnect detaches the connection's channels: execs keep running with their
   output drained and dropped and no X sent; reads, lists and writes are abandoned
   (a write's temporary file removed). The new connection starts with no channels.
7. Kernel command line ``dsec.pids=N|max``: pids.max of the sandbox processes' cgroup
   (``/sys/fs/cgroup/dsec``), default 1024, so a fork bomb cannot starve the agent.

The caps are the agent's (``native/vmagent.h``, same names); requests over one are
refused here with :class:`~dsec.errors.InvalidSpec` before anything is sent, and by the
agent with EINVAL/E2BIG: nothing is ever truncated. ``tests/integration/
test_microvm_wire.py`` runs every request through this module and ``dsec-vmagent
--parse``.

Pure data: no I/O, nothing imported beyond the standard library and ``dsec.errors``.
"""

from __future__ import annotations

import ipaddress
import posixpath
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import ClassVar, Final, TypeAlias

from dsec.errors import InvalidSpec

# ---- caps: each mirrors the vmagent.h constant of the same name ----
AGENT_VERSION: Final = 1
HDR_LEN: Final = 9
MAX_FRAME: Final = 65536
"""Payload bytes of one frame."""
MAX_TOK: Final = 8192
"""Tokens in one request (the op, then two per field)."""
MAX_ARGS: Final = 4000
MAX_ENV: Final = 4000
MAX_PATH: Final = 4096
"""A path token with its NUL: 4095 bytes of text at most."""
MAX_HOSTNAME: Final = 64
MAX_SEED: Final = 256
MAX_CHANS: Final = 256
"""Live execs and transfers in one guest (more: EAGAIN)."""
MAX_ALLOW: Final = 2048
"""Elements of a netcut's allow-set."""
MAX_LAYERS: Final = 16
"""Layer disks the guest mounts: serials ``dsec-l0`` (the base) .. ``dsec-l15``."""
STDIN_WINDOW: Final = 256 * 1024
"""Stdin bytes of one exec in flight (sent, not yet acknowledged by J)."""
DEFAULT_WINDOW: Final = 256 * 1024
DEFAULT_PATH: Final = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

# frame types
T_REQUEST: Final = ord("Q")
T_INPUT: Final = ord("I")
T_CREDIT: Final = ord("K")
T_HELLO: Final = ord("H")
T_ANSWER: Final = ord("A")
T_STDOUT: Final = ord("O")
T_STDERR: Final = ord("E")
T_DIRENT: Final = ord("D")
T_EXIT: Final = ord("X")
T_INCREDIT: Final = ord("J")

_HDR = struct.Struct("<IIB")
_U32: Final = 2**32 - 1
_I63: Final = 2**63 - 1

Fields: TypeAlias = list[tuple[str, str]]


# ---------------------------------------------------------------- frames ----


def frame(ftype: int, chan: int, payload: bytes = b"") -> bytes:
    """One frame; InvalidSpec when the payload is over MAX_FRAME."""
    if len(payload) > MAX_FRAME:
        raise InvalidSpec(f"frame of {len(payload)} bytes, {len(payload) - MAX_FRAME} over the agent's cap "
                          f"of {MAX_FRAME} (MAX_FRAME)", field="frame", count=len(payload), cap=MAX_FRAME)
    return _HDR.pack(len(payload), chan, ftype) + payload


def credit(chan: int, n: int) -> bytes:
    """A K (output credit) or the payload of a J (u32le)."""
    return frame(T_CREDIT, chan, struct.pack("<I", n))


def u32(payload: bytes) -> int:
    """The u32le payload of a K or J frame."""
    if len(payload) != 4:
        raise ValueError(f"a credit frame carries 4 bytes, not {len(payload)}")
    value: int = struct.unpack("<I", payload)[0]
    return value


class FrameReader:
    """Splits a byte stream into frames ``(type, chan, payload)``. ``feed`` raises
    ValueError on a header over MAX_FRAME: the stream is then broken."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> Iterator[tuple[int, int, bytes]]:
        self._buf += data
        off = 0
        try:
            while len(self._buf) - off >= HDR_LEN:
                length, chan, ftype = _HDR.unpack_from(self._buf, off)
                if length > MAX_FRAME:
                    raise ValueError(f"frame of {length} bytes from the agent (cap {MAX_FRAME}): stream broken")
                if len(self._buf) - off < HDR_LEN + length:
                    break
                yield ftype, chan, bytes(self._buf[off + HDR_LEN: off + HDR_LEN + length])
                off += HDR_LEN + length
        finally:
            del self._buf[:off]


def tokens(payload: bytes) -> list[str]:
    """The NUL-terminated strings of a token payload."""
    if not payload:
        return []
    if not payload.endswith(b"\0"):
        raise ValueError("token payload without its final NUL")
    return [t.decode("utf-8", "surrogateescape") for t in payload[:-1].split(b"\0")]


def pairs(toks: Sequence[str]) -> dict[str, str]:
    """``key val key val ...`` as a dict (the last value of a repeated key)."""
    return dict(zip(toks[::2], toks[1::2], strict=False))


# ---------------------------------------------------------------- answers ----


@dataclass(frozen=True, slots=True)
class Answer:
    """An ``A`` (or ``H``) payload: ``ok`` with fields, or ``err`` with errno and message."""

    ok: bool
    fields: dict[str, str]
    errno: int = 0
    message: str = ""

    @classmethod
    def parse(cls, payload: bytes) -> Answer:
        toks = tokens(payload)
        if not toks or toks[0] not in ("ok", "err"):
            raise ValueError(f"not an answer: {payload[:80]!r}")
        fields = pairs(toks[1:])
        if toks[0] == "ok":
            return cls(True, fields)
        try:
            err = int(fields.get("errno", "0"))
        except ValueError:
            err = 0
        return cls(False, fields, err, fields.get("msg", ""))


@dataclass(frozen=True, slots=True)
class Hello:
    """An ``H`` frame or a ``hello`` answer."""

    version: int
    boot_ns: int
    fail: str | None = None

    @classmethod
    def from_fields(cls, fields: dict[str, str]) -> Hello:
        return cls(int(fields.get("v", "0")), int(fields.get("boot_ns", "0")), fields.get("fail"))

    @classmethod
    def parse_frame(cls, payload: bytes) -> Hello:
        return cls.from_fields(pairs(tokens(payload)))


@dataclass(frozen=True, slots=True)
class Exit:
    """An ``X`` frame: ``code`` (-1 when killed), ``signal`` (0 when it exited), CPU times."""

    code: int
    signal: int
    utime_s: float
    stime_s: float
    maxrss_kb: int
    oom_kills: int = 0
    """OOM kills in the exec's cgroup while it ran (the guest kernel's evidence of its memory limit)."""
    pids_hits: int = 0
    """Forks refused at the sandbox's pids limit while it ran."""
    disk_free: int = -1
    """Bytes free on the writable disk when it ended (-1: not said)."""
    inodes_free: int = -1

    @classmethod
    def parse(cls, payload: bytes) -> Exit:
        f = pairs(tokens(payload))
        return cls(int(f["code"]), int(f["sig"]), int(f["utime_us"]) / 1e6, int(f["stime_us"]) / 1e6,
                   int(f["maxrss_kb"]), int(f.get("oom", 0)), int(f.get("pidsmax", 0)), int(f.get("dfree", -1)),
                   int(f.get("ifree", -1)))


@dataclass(frozen=True, slots=True)
class Stat:
    """A ``stat`` answer or a ``D`` entry. ``kind``: f, d, l or o."""

    name: str
    kind: str
    size: int
    mode: int
    uid: int
    gid: int
    mtime_ns: int
    target: str | None = None

    @classmethod
    def from_fields(cls, name: str, f: dict[str, str]) -> Stat:
        return cls(name, f["type"], int(f["size"]), int(f["mode"]), int(f["uid"]), int(f["gid"]),
                   int(f["mtime_ns"]), f.get("target"))

    @classmethod
    def parse_dirent(cls, payload: bytes) -> Stat:
        toks = tokens(payload)
        if len(toks) < 2 or toks[0] != "n":
            raise ValueError(f"not a list entry: {payload[:80]!r}")
        return cls.from_fields(toks[1], pairs(toks[2:]))


# ---------------------------------------------------------------- checks ----


def _over(op: str, what: str, n: int, cap: int, cap_name: str, field: str) -> None:
    if n > cap:
        raise InvalidSpec(f"{op}: {n} {what}, {n - cap} over the agent's cap of {cap} ({cap_name})",
                          field=field, count=n, cap=cap)


def _text(key: str, value: str) -> str:
    if not isinstance(value, str):
        raise InvalidSpec(f"{key} {value!r}: must be a string", field=key)
    if "\0" in value:
        raise InvalidSpec(f"NUL byte in {key}", field=key)
    try:
        value.encode()
    except UnicodeEncodeError:
        raise InvalidSpec(f"{key}: not valid text", field=key) from None
    return value


def _int(key: str, value: int, lo: int, hi: int) -> str:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise InvalidSpec(f"{key} {value!r}: must be an integer in {lo}..{hi}", field=key)
    return str(value)


def _flag(value: bool) -> str:
    return "1" if value else "0"


def norm_path(key: str, path: str) -> str:
    """An absolute path, normalised lexically (``..`` stops at the root); as the agent's."""
    s = _text(key, path)
    if not s.startswith("/"):
        raise InvalidSpec(f"{key} {s!r}: must be an absolute path", field=key)
    s = posixpath.normpath(s)
    if s.startswith("//"):
        s = "/" + s.lstrip("/")
    if len(s.encode()) >= MAX_PATH:
        raise InvalidSpec(f"{key}: longer than {MAX_PATH - 1} bytes (MAX_PATH)", field=key)
    return s


def encode_request(op: str, fields: Fields) -> bytes:
    """The payload of a request: ``op\\0key\\0val\\0...``, checked against the caps."""
    _over(op, "fields (two tokens each, after the op)", len(fields), (MAX_TOK - 1) // 2, "MAX_TOK", "request")
    try:
        payload = b"".join(t.encode() + b"\0" for t in (op, *(x for kv in fields for x in kv)))
    except UnicodeEncodeError:
        raise InvalidSpec(f"{op}: not valid text", field="request") from None
    if len(payload) > MAX_FRAME:
        raise InvalidSpec(f"{op}: request of {len(payload)} bytes, {len(payload) - MAX_FRAME} over the agent's cap "
                          f"of {MAX_FRAME} (MAX_FRAME)", field="request", count=len(payload), cap=MAX_FRAME)
    return payload


# ---------------------------------------------------------------- requests ----


@dataclass(frozen=True, slots=True)
class PingRequest:
    OP: ClassVar[str] = "ping"

    def encode(self) -> Fields:
        return []


@dataclass(frozen=True, slots=True)
class HelloRequest:
    OP: ClassVar[str] = "hello"

    def encode(self) -> Fields:
        return []


@dataclass(frozen=True, slots=True)
class PoweroffRequest:
    OP: ClassVar[str] = "poweroff"

    def encode(self) -> Fields:
        return []


@dataclass(frozen=True, slots=True, kw_only=True)
class ExecRequest:
    """Start ``argv`` in the sandbox root. ``env`` is exactly the environment (empty when
    none; PATH for the lookup of ``argv[0]`` comes from it, else DEFAULT_PATH)."""

    OP: ClassVar[str] = "exec"
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()
    cwd: str = "/"
    uid: int = 0
    gid: int = 0
    tty: bool = False
    rows: int = 24
    cols: int = 80
    stdin: bool = False
    window: int = DEFAULT_WINDOW

    def encode(self) -> Fields:
        if not self.argv or not self.argv[0]:
            raise InvalidSpec("exec: empty command", field="cmd")
        _over("exec", "arguments", len(self.argv), MAX_ARGS, "MAX_ARGS", "cmd")
        _over("exec", "environment entries", len(self.env), MAX_ENV, "MAX_ENV", "env")
        fields: Fields = [("a", _text("argument", a)) for a in self.argv]
        for k, v in self.env:
            if not k or "=" in k:
                raise InvalidSpec(f"environment name {k!r}: empty or with '='", field="env")
            fields.append(("e", f"{_text('env name', k)}={_text('env value', v)}"))
        cwd = _text("cwd", self.cwd)
        if not cwd.startswith("/") or len(cwd.encode()) >= MAX_PATH:
            raise InvalidSpec(f"cwd {cwd!r}: an absolute path under {MAX_PATH} bytes", field="cwd")
        fields += [
            ("cwd", cwd),
            ("uid", _int("uid", self.uid, 0, _U32 - 1)),
            ("gid", _int("gid", self.gid, 0, _U32 - 1)),
            ("tty", _flag(self.tty)),
            ("rows", _int("rows", self.rows, 1, 0xFFFF)),
            ("cols", _int("cols", self.cols, 1, 0xFFFF)),
            ("stdin", _flag(self.stdin)),
            ("win", _int("window", self.window, 0, _U32)),
        ]
        return fields


@dataclass(frozen=True, slots=True)
class SignalRequest:
    OP: ClassVar[str] = "signal"
    chan: int
    sig: int
    tree: bool = True
    spare: bool = False
    """With ``tree``: every process of the exec's cgroup but the exec's own (a session's shell
    lives on while what it runs is killed)."""

    def encode(self) -> Fields:
        out = [("ch", _int("chan", self.chan, 1, _U32)), ("sig", _int("signal", self.sig, 1, 64)),
               ("tree", _flag(self.tree))]
        return [*out, ("spare", "1")] if self.spare else out


@dataclass(frozen=True, slots=True)
class ResizeRequest:
    OP: ClassVar[str] = "resize"
    chan: int
    rows: int
    cols: int

    def encode(self) -> Fields:
        return [("ch", _int("chan", self.chan, 1, _U32)), ("rows", _int("rows", self.rows, 1, 0xFFFF)),
                ("cols", _int("cols", self.cols, 1, 0xFFFF))]


@dataclass(frozen=True, slots=True)
class StatRequest:
    OP: ClassVar[str] = "stat"
    path: str
    follow: bool = False

    def encode(self) -> Fields:
        return [("path", norm_path("path", self.path)), ("follow", _flag(self.follow))]


@dataclass(frozen=True, slots=True)
class ListRequest:
    OP: ClassVar[str] = "list"
    path: str

    def encode(self) -> Fields:
        return [("path", norm_path("path", self.path))]


@dataclass(frozen=True, slots=True)
class ReadRequest:
    OP: ClassVar[str] = "read"
    path: str
    max_bytes: int
    window: int = DEFAULT_WINDOW

    def encode(self) -> Fields:
        return [("path", norm_path("path", self.path)), ("max", _int("max_bytes", self.max_bytes, 0, _I63)),
                ("win", _int("window", self.window, 0, _U32))]


@dataclass(frozen=True, slots=True, kw_only=True)
class WriteRequest:
    OP: ClassVar[str] = "write"
    path: str
    mode: int = 0o644
    uid: int = 0
    gid: int = 0
    append: bool = False

    def encode(self) -> Fields:
        return [("path", norm_path("path", self.path)), ("mode", _int("mode", self.mode, 0, 0o7777)),
                ("uid", _int("uid", self.uid, 0, _U32 - 1)), ("gid", _int("gid", self.gid, 0, _U32 - 1)),
                ("append", _flag(self.append))]


@dataclass(frozen=True, slots=True, kw_only=True)
class MkdirRequest:
    OP: ClassVar[str] = "mkdir"
    path: str
    mode: int = 0o755
    uid: int = 0
    gid: int = 0
    parents: bool = False

    def encode(self) -> Fields:
        return [("path", norm_path("path", self.path)), ("mode", _int("mode", self.mode, 0, 0o7777)),
                ("uid", _int("uid", self.uid, 0, _U32 - 1)), ("gid", _int("gid", self.gid, 0, _U32 - 1)),
                ("parents", _flag(self.parents))]


@dataclass(frozen=True, slots=True)
class RemoveRequest:
    OP: ClassVar[str] = "remove"
    path: str
    recursive: bool = False

    def encode(self) -> Fields:
        return [("path", norm_path("path", self.path)), ("recursive", _flag(self.recursive))]


@dataclass(frozen=True, slots=True)
class RenameRequest:
    OP: ClassVar[str] = "rename"
    src: str
    dst: str

    def encode(self) -> Fields:
        return [("src", norm_path("src", self.src)), ("dst", norm_path("dst", self.dst))]


@dataclass(frozen=True, slots=True, kw_only=True)
class IdentityRequest:
    """A clone's own identity, set after each restore (every clone of a template starts
    with the template's RNG state, clock, hostname and machine-id)."""

    OP: ClassVar[str] = "identity"
    hostname: str
    machine_id: str
    seed: bytes
    realtime_ns: int | None = None

    def encode(self) -> Fields:
        h = _text("hostname", self.hostname)
        if not 1 <= len(h) <= MAX_HOSTNAME or not all(c.isascii() and (c.isalnum() or c in "-.") for c in h):
            raise InvalidSpec(f"hostname {h!r}: 1..{MAX_HOSTNAME} letters, digits, '-' or '.'", field="hostname")
        m = _text("machine_id", self.machine_id)
        if len(m) != 32 or any(c not in "0123456789abcdef" for c in m):
            raise InvalidSpec(f"machine_id {m!r}: 32 lowercase hex digits", field="machine_id")
        if not isinstance(self.seed, bytes | bytearray):
            raise InvalidSpec("seed: bytes", field="seed")
        _over("identity", "seed bytes", len(self.seed), MAX_SEED, "MAX_SEED", "seed")
        fields: Fields = [("hostname", h), ("machine_id", m), ("seed", bytes(self.seed).hex())]
        if self.realtime_ns is not None:
            fields.append(("realtime_ns", _int("realtime_ns", self.realtime_ns, 0, _I63)))
        return fields


@dataclass(frozen=True, slots=True)
class SyncRequest:
    """sync(); ``freeze`` True: FIFREEZE the upper disk (before a template snapshot),
    False: FITHAW it (after a restore), None: neither."""

    OP: ClassVar[str] = "sync"
    freeze: bool | None = None

    def encode(self) -> Fields:
        return [] if self.freeze is None else [("freeze", _flag(self.freeze))]


@dataclass(frozen=True, slots=True)
class NetcutRequest:
    """netcut(allow): destroy the guest's TCP connections (loopback apart) whose peer the
    allow-set no longer admits, as the host's SOCK_DESTROY does in a container's namespace.
    Each element is ``(cidr, proto, lo, hi)``; answered ``ok n=<connections cut>``."""

    OP: ClassVar[str] = "netcut"
    allow: tuple[tuple[str, str, int, int], ...] = ()

    def encode(self) -> Fields:
        _over("netcut", "allow elements", len(self.allow), MAX_ALLOW, "MAX_ALLOW", "network")
        out: Fields = []
        for cidr, proto, lo, hi in self.allow:
            try:
                net = ipaddress.IPv4Network(cidr, strict=False)
            except ValueError:
                raise InvalidSpec(f"netcut: {cidr!r} is not an IPv4 network", field="network") from None
            if proto not in ("tcp", "udp") or not 0 <= lo <= hi <= 65535:
                raise InvalidSpec(f"netcut: {proto} {lo}-{hi}: tcp or udp and ports 0..65535", field="network")
            out.append(("allow", f"{net.with_prefixlen} {proto} {lo}-{hi}"))
        return out


Request: TypeAlias = (PingRequest | HelloRequest | PoweroffRequest | ExecRequest | SignalRequest | ResizeRequest
                      | StatRequest | ListRequest | ReadRequest | WriteRequest | MkdirRequest | RemoveRequest
                      | RenameRequest | IdentityRequest | SyncRequest | NetcutRequest)


def request_frame(req: Request, chan: int) -> bytes:
    """The ``Q`` frame of ``req`` on request id ``chan`` (1..2**32-1)."""
    _int("request id", chan, 1, _U32)
    return frame(T_REQUEST, chan, encode_request(req.OP, req.encode()))
