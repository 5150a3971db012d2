"""The spawner's wire: the one place that builds requests for ``dsec-spawner``.

One frozen dataclass per op the spawner serves (:class:`CreateRequest`,
:class:`ExecRequest`, :class:`PingRequest`), with typed fields. Each has
``encode()``, the request's (key, value) fields, and ``fds()``, the fds sent with
it (SCM_RIGHTS) in the order the spawner reads them; :func:`frame` makes the
datagram (``op, rid, key, value, ...``, each NUL-terminated). The C side reads it
in ``native/protocol.c`` (``recv_req``, ``req_op``, ``parse_create``,
``parse_exec``).

The caps are the spawner's (``native/spawner.h``, same names). A request over one
is refused here with :class:`~dsec.errors.InvalidSpec`, naming the list and by how
much, before anything is sent; the spawner would refuse it too (EINVAL), never
truncate it. ``tests/integration/test_spawner_wire.py`` feeds every request through
this module and through the compiled parser (``dsec-spawner --parse``) and checks
that they agree field by field.

Pure data: no I/O, nothing imported beyond the standard library and ``dsec.errors``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Final, Literal, NamedTuple, TypeAlias

from dsec.errors import InvalidSpec

# ---- caps: each mirrors the spawner.h constant of the same name ----
MAX_MSG: Final = 512 * 1024
"""spawner.h MAX_MSG: a request datagram is at most ``MAX_MSG - 1`` bytes."""
MAX_TOK: Final = 8192
"""spawner.h MAX_TOK: tokens in one request (op, rid, then two per field)."""
MAX_FIELDS: Final = (MAX_TOK - 2) // 2
"""Fields that fit the token table (what binds argv and env in practice)."""
MAX_FDS: Final = 8
"""spawner.h MAX_FDS: fds sent with one request."""
MAX_LAYERS: Final = 15
"""spawner.h MAX_LAYERS: ``lower`` (create) and ``pl`` (exec, pristine image layers)."""
MAX_CGROUPS: Final = 15
"""spawner.h MAX_CGROUPS: ``cg``."""
MAX_LL_RULES: Final = 255
"""spawner.h MAX_LL_RULES: ``lr`` (Landlock file rules)."""
MAX_PRISTINE: Final = 71
"""spawner.h MAX_PRISTINE: ``pp`` (pristine paths)."""
MAX_RLIMITS: Final = 31
"""spawner.h MAX_RLIMITS: ``rl``."""
MAX_ARGS: Final = MAX_TOK - 1
"""spawner.h MAX_ARGS: ``a`` and ``e``, each (MAX_FIELDS binds first)."""

Fields: TypeAlias = list[tuple[str, str]]
AccessClass: TypeAlias = Literal["h", "r", "w"]
"""Landlock access: hidden, read-only, writable (``native/landlock.c``)."""
_ACCESS: Final[dict[str, AccessClass]] = {"h": "h", "r": "r", "w": "w"}

_U32: Final = 2**32 - 1
_U64: Final = 2**64 - 1


def _over(op: str, what: str, n: int, cap: int, cap_name: str, field: str) -> None:
    if n > cap:
        raise InvalidSpec(
            f"{op}: {n} {what}, {n - cap} over the spawner's cap of {cap} ({cap_name})",
            field=field, count=n, cap=cap,
        )


def _text(key: str, value: str) -> str:
    if "\0" in value:
        # InvalidSpec (a ValueError): the caller's input, a 4xx at the edge, not a 500.
        raise InvalidSpec(f"NUL byte in {key}", field=key)
    return value


def _int(key: str, value: int, lo: int, hi: int) -> str:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise InvalidSpec(f"{key} {value!r}: must be an integer in {lo}..{hi}", field=key)
    return str(value)


def _abs(key: str, path: str | Path) -> str:
    s = _text(key, str(path))
    if not s.startswith("/"):
        raise InvalidSpec(f"{key} {s!r}: must be an absolute path", field=key)
    return s


def _checked(op: str, fields: Fields) -> Fields:
    _over(op, "fields (two tokens each, after op and rid)", len(fields), MAX_FIELDS, "MAX_TOK", "cmd")
    return fields


# ---- pieces of an exec ----


class Rlimit(NamedTuple):
    """``setrlimit(resource, (soft, hard))`` in the exec child; wire ``rl``: ``RES:SOFT:HARD``."""

    resource: int
    soft: int
    hard: int

    def encode(self) -> str:
        return (f"{_int('rlimit resource', self.resource, 0, 2**31 - 1)}:"
                f"{_int('rlimit soft', self.soft, 0, _U64)}:{_int('rlimit hard', self.hard, 0, _U64)}")


class LandlockRule(NamedTuple):
    """One path's access; wire ``lr``: ``CLASS:/path``."""

    access: AccessClass
    path: str

    def encode(self) -> str:
        if self.access not in _ACCESS:
            raise InvalidSpec(f"Landlock access {self.access!r}: one of h, r, w", field="stages")
        return f"{self.access}:{_abs('Landlock rule path', self.path)}"


@dataclass(frozen=True, slots=True)
class Landlock:
    """A stage's file rules as the exec child builds its ruleset from them (``native/landlock.c``):
    ``default`` for every path no rule names (wire ``ld``), ``rules`` (wire ``lr``, in order)."""

    default: AccessClass
    rules: tuple[LandlockRule, ...] = ()

    @classmethod
    def from_tokens(cls, tokens: Iterable[tuple[str, str]]) -> Landlock | None:
        """From ``stages.landlock_tokens`` (``ld`` first, then ``lr``...); None for none (no Landlock)."""
        default: AccessClass | None = None
        rules: list[LandlockRule] = []
        for key, value in tokens:
            if key == "ld" and default is None and value in _ACCESS:
                default = _ACCESS[value]
            elif key == "lr" and default is not None and value[:1] in _ACCESS and value[1:2] == ":":
                rules.append(LandlockRule(_ACCESS[value[0]], value[2:]))
            else:
                raise InvalidSpec(f"not a Landlock token: {key}={value!r}", field="stages")
        return None if default is None else cls(default, tuple(rules))

    def encode(self) -> Fields:
        if self.default not in _ACCESS:
            raise InvalidSpec(f"Landlock default {self.default!r}: one of h, r, w", field="stages")
        _over("exec", "Landlock file rules", len(self.rules), MAX_LL_RULES, "MAX_LL_RULES", "stages")
        return [("ld", self.default), *(("lr", r.encode()) for r in self.rules)]


@dataclass(frozen=True, slots=True)
class Pristine:
    """Paths the exec sees as the image has them: ``layers`` are the image layers' host
    mountpoints, top first (wire ``pl``), ``paths`` absolute paths in the sandbox (``pp``)."""

    layers: tuple[Path, ...]
    paths: tuple[str, ...]

    def encode(self) -> Fields:
        if not self.layers or not self.paths:
            raise InvalidSpec("pristine needs at least one image layer and one path", field="pristine")
        _over("exec", "pristine image layers", len(self.layers), MAX_LAYERS, "MAX_LAYERS", "pristine")
        _over("exec", "pristine paths", len(self.paths), MAX_PRISTINE, "MAX_PRISTINE", "pristine")
        return [*(("pl", _abs("pristine layer", p)) for p in self.layers),
                *(("pp", _abs("pristine path", p)) for p in self.paths)]


@dataclass(frozen=True, slots=True)
class Tty:
    """Run on a new pty of the sandbox's devpts: ``gid`` is the sandbox's tty group in
    host ids (devpts ``gid=``); ``rows``/``cols`` None: the spawner's 24x80."""

    gid: int
    rows: int | None = None
    cols: int | None = None

    def encode(self) -> Fields:
        out = [("tty", _int("tty gid", self.gid, 0, _U32 - 1))]
        if self.rows is not None:
            out.append(("rows", _int("tty rows", self.rows, 1, 0xFFFF)))  # an unsigned short in C
        if self.cols is not None:
            out.append(("cols", _int("tty cols", self.cols, 1, 0xFFFF)))
        return out


# ---- the requests ----


@dataclass(frozen=True, slots=True)
class PingRequest:
    """ping: the spawner answers ``ok``. No fields, no fds."""

    OP: ClassVar[str] = "ping"

    def encode(self) -> Fields:
        return []

    def fds(self) -> tuple[int, ...]:
        return ()


@dataclass(frozen=True, slots=True, kw_only=True)
class CreateRequest:
    """create: clone a sandbox's init (``native/create.c``).

    fds: ``(net_fd,)`` when given — a prepared network namespace (veth, address,
    nftables) — else none (the spawner takes a loopback-only one from its pool).
    """

    OP: ClassVar[str] = "create"
    sandbox_id: str
    """The sandbox's id, also its hostname."""
    stage: Path
    """Where the spawner mounts its template mount namespace (made on the first create)."""
    uid_base: int
    uid_count: int
    disk: int
    """Bytes of the memory medium's tmpfs (unused with ``upper``)."""
    inodes: int
    devskel: Path
    """The node's read-only /dev skeleton."""
    empty: Path
    """The node's empty directory (/sys and masked /proc directories)."""
    lowers: tuple[Path, ...]
    """Image layers' host mountpoints, top first (1..MAX_LAYERS)."""
    cgroups: tuple[Path, ...] = ()
    """Cgroup directories the init joins before it runs."""
    upper: Path | None = None
    """The writable layer's directory on the disk store; None: a tmpfs (memory medium)."""
    net_fd: int | None = None
    hide_pids: bool = False
    """The sandbox's /proc shows a process only to its own uid and to the sandbox's root
    (``hidepid=invisible,gid=<root's host gid>``): FnCall's workers, whose calls are uids of
    their own that must not read each other's command lines."""

    def encode(self) -> Fields:
        op = self.OP
        if not self.sandbox_id:
            raise InvalidSpec("create: empty sandbox id", field="sandbox_id")
        if not self.lowers:
            raise InvalidSpec("create: no image layers", field="image")
        _over(op, "image layers", len(self.lowers), MAX_LAYERS, "MAX_LAYERS", "image")
        _over(op, "cgroups", len(self.cgroups), MAX_CGROUPS, "MAX_CGROUPS", "cgroups")
        fields = [
            ("id", _text("id", self.sandbox_id)),
            ("stage", _abs("stage", self.stage)),
            ("uid_base", _int("uid_base", self.uid_base, 0, _U32 - 1)),
            ("uid_count", _int("uid_count", self.uid_count, 1, _U32)),
            ("disk", _int("disk", self.disk, 0, _U64)),
            ("inodes", _int("inodes", self.inodes, 0, _U64)),
            ("devskel", _abs("devskel", self.devskel)),
            ("empty", _abs("empty", self.empty)),
            *([("upper", _abs("upper", self.upper))] if self.upper is not None else []),
            *(("lower", _abs("lower", p)) for p in self.lowers),
            *(("cg", _abs("cg", p)) for p in self.cgroups),
            *([("hidepid", "1")] if self.hide_pids else []),
        ]
        return _checked(op, fields)

    def fds(self) -> tuple[int, ...]:
        return () if self.net_fd is None else (self.net_fd,)


@dataclass(frozen=True, slots=True, kw_only=True)
class ExecRequest:
    """exec: start a command in a sandbox (``native/exec.c``).

    fds, in this order: the sandbox init's pidfd, stdin, stdout, stderr. With
    ``tty``, stdin is a socket the pty's master is sent back over and the other two
    are unused (any fd will do).
    """

    OP: ClassVar[str] = "exec"
    init_pidfd: int
    stdin: int
    stdout: int
    stderr: int
    argv: tuple[str, ...]
    cwd: str
    uid: int
    gid: int
    env: tuple[tuple[str, str], ...] = ()
    seccomp: bool = True
    setsid: bool = True
    """A session of its own (the default); False keeps the spawner's (wire ``setsid=0``)."""
    cgroups: tuple[Path, ...] = ()
    rlimits: tuple[Rlimit, ...] = ()
    landlock: Landlock | None = None
    init_pid: int | None = None
    """The init's pid (its /proc entry): needed with ``pristine`` and ``tty``."""
    pristine: Pristine | None = None
    tty: Tty | None = None

    def encode(self) -> Fields:
        op = self.OP
        if not self.argv or not self.argv[0]:
            raise InvalidSpec("empty command", field="cmd")
        _over(op, "arguments", len(self.argv), MAX_ARGS, "MAX_ARGS", "cmd")
        _over(op, "environment variables", len(self.env), MAX_ARGS, "MAX_ARGS", "env")
        _over(op, "cgroups", len(self.cgroups), MAX_CGROUPS, "MAX_CGROUPS", "cgroups")
        _over(op, "rlimits", len(self.rlimits), MAX_RLIMITS, "MAX_RLIMITS", "rlimits")
        if (self.pristine is not None or self.tty is not None) and self.init_pid is None:
            raise InvalidSpec("exec: pristine paths and terminals need the init's pid", field="init_pid")
        fields: Fields = [("a", _text("argv", a)) for a in self.argv]
        for k, v in self.env:
            if not k or "=" in k:
                raise InvalidSpec(f"bad environment variable {k!r}", field="env")
            fields.append(("e", _text("env", f"{k}={v}")))
        fields += [("cwd", _abs("cwd", self.cwd)), ("uid", _int("uid", self.uid, 0, _U32 - 1)),
                   ("gid", _int("gid", self.gid, 0, _U32 - 1)), ("seccomp", "1" if self.seccomp else "0")]
        if not self.setsid:
            fields.append(("setsid", "0"))
        fields += [("cg", _abs("cg", p)) for p in self.cgroups]
        fields += [("rl", r.encode()) for r in self.rlimits]
        if self.landlock is not None:
            fields += self.landlock.encode()
        if self.init_pid is not None:
            fields.append(("ipid", _int("init_pid", self.init_pid, 1, 2**31 - 1)))
        if self.pristine is not None:
            fields += self.pristine.encode()
        if self.tty is not None:
            fields += self.tty.encode()
        return _checked(op, fields)

    def fds(self) -> tuple[int, int, int, int]:
        return (self.init_pidfd, self.stdin, self.stdout, self.stderr)


Request: TypeAlias = CreateRequest | ExecRequest | PingRequest


def frame(op: str, rid: str, fields: Sequence[tuple[str, str]]) -> bytes:
    """The datagram: ``op``, ``rid``, then each key and value, every token NUL-terminated.
    Refuses a NUL inside a token and a datagram over ``MAX_MSG - 1`` bytes."""
    parts = [op, rid]
    for k, v in fields:
        parts += [k, _text(k, v)]
    try:
        data = b"\0".join(p.encode() for p in parts) + b"\0"
    except UnicodeEncodeError as exc:
        raise InvalidSpec(f"{op}: a field is not valid text ({exc.reason})", field="cmd") from None
    if len(data) > MAX_MSG - 1:
        raise InvalidSpec(
            f"request too large ({len(data)} bytes, {len(data) - (MAX_MSG - 1)} over the spawner's "
            f"{MAX_MSG - 1} (MAX_MSG); argv+env must stay under 500 KiB)",
            field="cmd",
        )
    return data
