"""The Python encoder (wire.py) and the spawner's C parser agree, field by field.

Every request goes through both: ``wire`` encodes it, the compiled ``dsec-spawner
--parse`` receives it over a SOCK_SEQPACKET socket (with its fds), runs the real
parser and prints what the spawner would act on. The expected values are derived
from the dataclass's own fields (not from its encoding), so the test holds the
typed request, the encoder and the parser together. A list at its cap passes both;
one over it is refused by both — InvalidSpec here, EINVAL there.

No root needed: the parse-only mode starts, mounts and enters nothing.
"""

from __future__ import annotations

import array
import dataclasses
import errno
import os
import socket
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from dsec.backends.container import wire
from dsec.backends.container.wire import (
    CreateRequest,
    ExecRequest,
    Landlock,
    LandlockRule,
    Pristine,
    Rlimit,
    Tty,
)
from dsec.errors import HostError, InvalidSpec

# ------------------------------------------------------------------ harness ----


@pytest.fixture(scope="module")
def binary() -> Path:
    from dsec.backends.container.build import spawner_path

    try:
        return spawner_path()
    except HostError as exc:
        pytest.skip(f"no dsec-spawner: {exc}")


def parse_raw(binary: Path, data: bytes, fds: Sequence[int] = ()) -> dict[str, Any]:
    """One datagram through ``dsec-spawner --parse``; its JSON."""
    import json

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 * 1024 * 1024)
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())] if fds else []
        ours.sendmsg([data], anc)
        proc = subprocess.run([str(binary), "--parse"], stdin=theirs.fileno(), capture_output=True, timeout=30)
    finally:
        ours.close()
        theirs.close()
    assert proc.returncode == 0, proc.stderr.decode()
    out: dict[str, Any] = json.loads(proc.stdout.decode())
    return out


def unchecked_frame(op: str, fields: Sequence[tuple[str, str]]) -> bytes:
    """The datagram ``wire.frame`` makes, without its checks (to show the C side refuses too)."""
    return b"\0".join(t.encode() for t in [op, "1", *(x for kv in fields for x in kv)]) + b"\0"


def parse(binary: Path, req: wire.Request) -> dict[str, Any]:
    """``req`` encoded by wire.py, as the C parser reads it (a refusal fails the test)."""
    out = parse_raw(binary, wire.frame(req.OP, "1", req.encode()), req.fds())
    assert "error" not in out, out
    assert (out["rid"], out["op"], out["nfds"]) == ("1", req.OP, len(req.fds()))
    return out


def refused(binary: Path, op: str, fields: Sequence[tuple[str, str]], fds: Sequence[int] = ()) -> str:
    """The C parser refuses these fields with EINVAL at the "request" stage: its message."""
    out = parse_raw(binary, unchecked_frame(op, fields), fds)
    assert "error" in out, out
    assert (out["error"]["stage"], out["error"]["errno"]) == ("request", errno.EINVAL), out
    msg: str = out["error"]["message"]
    return msg


def ident(fd: int | None) -> dict[str, int] | None:
    if fd is None:
        return None
    st = os.fstat(fd)
    return {"dev": st.st_dev, "ino": st.st_ino}


@pytest.fixture
def fds() -> Iterator[list[int]]:
    """Four fds told apart by inode (four pipes' read ends)."""
    pipes = [os.pipe() for _ in range(5)]
    yield [r for r, _ in pipes]
    for r, w in pipes:
        os.close(r)
        os.close(w)


# ------------------------------------------------------- expected, from fields ----


def expected_create(req: CreateRequest) -> dict[str, Any]:
    return {
        "id": req.sandbox_id,
        "stage": str(req.stage),
        "uid_base": req.uid_base,
        "uid_map": f"0 {req.uid_base} {req.uid_count}\n",
        "disk": req.disk,
        "inodes": req.inodes,
        "upper": None if req.upper is None else str(req.upper),
        "devskel": str(req.devskel),
        "empty": str(req.empty),
        "lowers": [str(p) for p in req.lowers],
        "cgroups": [str(p) for p in req.cgroups],
        "net_fd": ident(req.net_fd),
        "hidepid": int(req.hide_pids),
    }


def expected_exec(req: ExecRequest) -> dict[str, Any]:
    ll, pr, tty = req.landlock, req.pristine, req.tty
    return {
        "argv": list(req.argv),
        "env": [f"{k}={v}" for k, v in req.env],
        "cwd": req.cwd,
        "uid": req.uid,
        "gid": req.gid,
        "seccomp": req.seccomp,
        "setsid": req.setsid,
        "cgroups": [str(p) for p in req.cgroups],
        "rlimits": [[r.resource, r.soft, r.hard] for r in req.rlimits],
        "landlock": None if ll is None else {"default": ll.default, "rules": [[r.access, r.path] for r in ll.rules]},
        "init_pid": None if req.init_pid is None else str(req.init_pid),
        "pristine_layers": [] if pr is None else [str(p) for p in pr.layers],
        "pristine_paths": [] if pr is None else list(pr.paths),
        "tty": None if tty is None else {"gid": str(tty.gid), "rows": tty.rows or 0, "cols": tty.cols or 0},
        "fds": {"init_pidfd": ident(req.init_pidfd), "stdin": ident(req.stdin),
                "stdout": ident(req.stdout), "stderr": ident(req.stderr)},
    }


def over_cap(exc: pytest.ExceptionInfo[InvalidSpec], n: int, cap: int) -> None:
    """wire.py's refusal names the count, the cap and how far over it is."""
    assert f"{n - cap} over the spawner's cap of {cap}" in str(exc.value), exc.value
    assert (exc.value.fields["count"], exc.value.fields["cap"]) == (n, cap)


# ------------------------------------------------------------------- create ----


def create_req(**kw: Any) -> CreateRequest:
    base: dict[str, Any] = dict(
        sandbox_id="sb-0123456789ab", stage=Path("/run/dsec/rt/stage"), uid_base=1_065_536, uid_count=65536,
        disk=256 * 1024 * 1024, inodes=32768, devskel=Path("/run/dsec/rt/devskel"),
        empty=Path("/run/dsec/rt/empty"), lowers=(Path("/run/dsec/rt/layers/aa"), Path("/run/dsec/rt/layers/bb")),
    )
    return CreateRequest(**{**base, **kw})


@pytest.mark.parametrize("upper", [None, Path("/var/lib/dsec/uppers/sb-0123456789ab")], ids=["memory", "disk"])
@pytest.mark.parametrize("cgroups", [(), tuple(Path(f"/sys/fs/cgroup/{c}/dsec/rt/sb") for c in ("cpu", "memory"))],
                         ids=["no-cg", "cg"])
@pytest.mark.parametrize("with_net", [False, True], ids=["pool-netns", "own-netns"])
def test_create_agrees(binary: Path, fds: list[int], upper: Path | None, cgroups: tuple[Path, ...],
                       with_net: bool) -> None:
    req = create_req(upper=upper, cgroups=cgroups, net_fd=fds[0] if with_net else None)
    assert parse(binary, req)["create"] == expected_create(req)


def test_create_hidepid_agrees_and_takes_only_1(binary: Path) -> None:
    req = create_req(hide_pids=True)
    assert ("hidepid", "1") in req.encode()
    assert parse(binary, req)["create"] == expected_create(req)
    assert "hidepid" not in dict(create_req().encode())
    msg = refused(binary, "create", [*create_req().encode(), ("hidepid", "yes")])
    assert msg == "create: hidepid takes 1"


def test_create_lists_at_and_over_their_caps(binary: Path) -> None:
    lowers = tuple(Path(f"/l/{i}") for i in range(wire.MAX_LAYERS))
    cgs = tuple(Path(f"/c/{i}") for i in range(wire.MAX_CGROUPS))
    at_cap = create_req(lowers=lowers, cgroups=cgs)
    assert parse(binary, at_cap)["create"] == expected_create(at_cap)
    for key, field, cap in (("lower", "lowers", wire.MAX_LAYERS), ("cg", "cgroups", wire.MAX_CGROUPS)):
        extra = Path(f"/x/{cap}")
        more: dict[str, Any] = {field: (*getattr(at_cap, field), extra)}
        with pytest.raises(InvalidSpec) as ei:
            dataclasses.replace(at_cap, **more).encode()
        over_cap(ei, cap + 1, cap)
        msg = refused(binary, "create", [*at_cap.encode(), (key, str(extra))])
        assert msg == f"create takes at most {wire.MAX_LAYERS} layers and {wire.MAX_CGROUPS} cgroups"


def test_create_needs_its_fields_in_both(binary: Path) -> None:
    full = create_req().encode()
    for key in ("id", "stage", "uid_base", "uid_count", "disk", "inodes", "devskel", "empty"):
        msg = refused(binary, "create", [kv for kv in full if kv[0] != key])
        assert msg.startswith("create needs id, stage"), (key, msg)
    with pytest.raises(TypeError):
        CreateRequest(sandbox_id="x")  # type: ignore[call-arg]  # the dataclass has no defaults for them
    with pytest.raises(InvalidSpec, match="no image layers"):
        create_req(lowers=()).encode()  # the C side refuses it later, in the init ("no lower layers")


# --------------------------------------------------------------------- exec ----


def exec_req(fds: list[int], **kw: Any) -> ExecRequest:
    base: dict[str, Any] = dict(init_pidfd=fds[0], stdin=fds[1], stdout=fds[2], stderr=fds[3],
                                argv=("/bin/sh", "-c", "echo hi"), cwd="/", uid=0, gid=0)
    return ExecRequest(**{**base, **kw})


LANDLOCK = Landlock("w", (LandlockRule("h", "/tests"), LandlockRule("r", "/usr"), LandlockRule("w", "/dev")))
PRISTINE = Pristine((Path("/run/dsec/rt/layers/aa"), Path("/run/dsec/rt/layers/bb")), ("/tests", "/etc/passwd"))
OPTIONAL: dict[str, dict[str, Any]] = {
    "bare": {},
    "env": {"env": (("PATH", "/usr/bin:/bin"), ("EMPTY", ""), ("EQ", "a=b"))},
    "no-seccomp": {"seccomp": False},
    "no-setsid": {"setsid": False},
    "user": {"uid": 1000, "gid": 1001},
    "cgroups": {"cgroups": (Path("/sys/fs/cgroup/cpu/dsec/rt/sb"), Path("/sys/fs/cgroup/freezer/dsec/rt/x1"))},
    "rlimits": {"rlimits": (Rlimit(7, 1024, 4096), Rlimit(3, 2**64 - 1, 2**64 - 1))},
    "landlock-default-only": {"landlock": Landlock("r")},
    "landlock": {"landlock": LANDLOCK},
    "landlock-root-rule": {"landlock": Landlock("w", (LandlockRule("r", "/"),))},
    "init-pid": {"init_pid": 4242},
    "pristine": {"init_pid": 4242, "pristine": PRISTINE},
    "tty": {"init_pid": 4242, "tty": Tty(1_065_541, 50, 132)},
    "tty-default-size": {"init_pid": 4242, "tty": Tty(1_065_541)},
    "odd-text": {"argv": ("/bin/echo", 'quo"te', "back\\slash", "new\nline", "tab\t", "ünï €", ""),
                 "cwd": "/wörk space"},
    "everything": {"env": (("A", "1"),), "seccomp": False, "setsid": False, "uid": 7, "gid": 8,
                   "cgroups": (Path("/c/1"),), "rlimits": (Rlimit(7, 1, 2),), "landlock": LANDLOCK,
                   "init_pid": 99, "pristine": PRISTINE, "tty": Tty(5, 24, 80)},
}


@pytest.mark.parametrize("variant", OPTIONAL)
def test_exec_agrees(binary: Path, fds: list[int], variant: str) -> None:
    req = exec_req(fds, **OPTIONAL[variant])
    assert parse(binary, req)["exec"] == expected_exec(req)


def _with_one_more(req: ExecRequest, key: str) -> ExecRequest:
    """``req`` with one more entry in the list behind wire key ``key``."""
    if key == "lr":
        assert req.landlock is not None
        return dataclasses.replace(req, landlock=Landlock(req.landlock.default,
                                                          (*req.landlock.rules, LandlockRule("r", "/one/more"))))
    if key in ("pl", "pp"):
        assert req.pristine is not None
        p = req.pristine
        more = (dataclasses.replace(p, layers=(*p.layers, Path("/one/more"))) if key == "pl"
                else dataclasses.replace(p, paths=(*p.paths, "/one/more")))
        return dataclasses.replace(req, pristine=more)
    if key == "cg":
        return dataclasses.replace(req, cgroups=(*req.cgroups, Path("/one/more")))
    assert key == "rl"
    return dataclasses.replace(req, rlimits=(*req.rlimits, Rlimit(7, 1, 1)))


@pytest.mark.parametrize(("key", "cap", "what"), [
    ("lr", wire.MAX_LL_RULES, "file rules (Landlock)"),
    ("pl", wire.MAX_LAYERS, "image layers"),
    ("pp", wire.MAX_PRISTINE, "pristine paths"),
    ("cg", wire.MAX_CGROUPS, "cgroups"),
    ("rl", wire.MAX_RLIMITS, "rlimits"),
])
def test_exec_lists_at_and_over_their_caps(binary: Path, fds: list[int], key: str, cap: int, what: str) -> None:
    at_cap = exec_req(
        fds, init_pid=1,
        landlock=Landlock("r", tuple(LandlockRule("w", f"/p/{i}") for i in range(wire.MAX_LL_RULES))),
        pristine=Pristine(tuple(Path(f"/l/{i}") for i in range(wire.MAX_LAYERS)),
                          tuple(f"/p/{i}" for i in range(wire.MAX_PRISTINE))),
        cgroups=tuple(Path(f"/c/{i}") for i in range(wire.MAX_CGROUPS)),
        rlimits=tuple(Rlimit(i, i, i) for i in range(wire.MAX_RLIMITS)),
    )
    assert parse(binary, at_cap)["exec"] == expected_exec(at_cap)
    over = _with_one_more(at_cap, key)
    with pytest.raises(InvalidSpec) as ei:
        over.encode()
    over_cap(ei, cap + 1, cap)
    msg = refused(binary, "exec", [*at_cap.encode(), (key, "w:/one/more" if key == "lr" else "/one/more")], fds[:4])
    assert msg == f"more than {cap} {what} in one command"


def test_argv_and_env_meet_the_token_table_first(binary: Path, fds: list[int]) -> None:
    # MAX_ARGS (8191) "a" fields cannot fit MAX_TOK (8192 tokens, two per field): both sides
    # refuse such a command for its token count, the C side before it counts arguments.
    bare = exec_req(fds, argv=("x",))
    room = wire.MAX_FIELDS - len(bare.encode()) + 1  # argv entries that fill the token table exactly
    for field in ("argv", "env"):
        fits = (dataclasses.replace(bare, argv=("x",) * room) if field == "argv"
                else dataclasses.replace(bare, env=tuple((f"K{i}", "v") for i in range(room - 1))))
        assert len(fits.encode()) == wire.MAX_FIELDS
        assert parse(binary, fits)["exec"] == expected_exec(fits)
        one_more = (dataclasses.replace(fits, argv=(*fits.argv, "y")) if field == "argv"
                    else dataclasses.replace(fits, env=(*fits.env, ("Y", "y"))))
        with pytest.raises(InvalidSpec) as ei:
            one_more.encode()
        over_cap(ei, wire.MAX_FIELDS + 1, wire.MAX_FIELDS)
        extra = ("a", "y") if field == "argv" else ("e", "Y=y")
        msg = refused(binary, "exec", [*fits.encode(), extra], fds[:4])
        assert msg == "the request has more than 8192 tokens: refused (nothing is ever truncated)"
    for field, n in (("argv", wire.MAX_ARGS), ("argv", wire.MAX_ARGS + 1), ("env", wire.MAX_ARGS + 1)):
        big = (dataclasses.replace(bare, argv=("x",) * n) if field == "argv"
               else dataclasses.replace(bare, env=tuple((f"K{i}", "v") for i in range(n))))
        with pytest.raises(InvalidSpec, match="over the spawner's cap"):
            big.encode()
        raw = [*bare.encode(), *([("a", "x")] * n if field == "argv" else [("e", f"K{i}=v") for i in range(n)])]
        assert "more than 8192 tokens" in refused(binary, "exec", raw, fds[:4])


def test_exec_needs_four_fds_and_its_fields(binary: Path, fds: list[int]) -> None:
    fields = exec_req(fds).encode()
    for n in (0, 3, 5):
        assert refused(binary, "exec", fields, fds[:n]) == (
            f"exec needs 4 fds (init pidfd, stdin, stdout, stderr), got {n}")
    for key in ("a", "cwd", "uid", "gid"):
        assert refused(binary, "exec", [kv for kv in fields if kv[0] != key], fds[:4]) == (
            "exec needs argv, cwd, uid, gid")
    with pytest.raises(TypeError):
        ExecRequest(argv=("x",), cwd="/", uid=0, gid=0)  # type: ignore[call-arg]  # no fds
    for bad in (dict(argv=()), dict(argv=("",))):
        with pytest.raises(InvalidSpec, match="empty command"):
            exec_req(fds, **bad).encode()
    with pytest.raises(InvalidSpec, match="init's pid"):
        exec_req(fds, tty=Tty(5)).encode()
    with pytest.raises(InvalidSpec, match="init's pid"):
        exec_req(fds, pristine=PRISTINE).encode()


def test_values_the_wire_cannot_carry_are_refused_here(fds: list[int]) -> None:
    for bad in (dict(argv=("a\0b",)), dict(env=(("K", "v\0"),)), dict(cwd="/a\0"),
                dict(env=(("", "v"),)), dict(env=(("A=B", "v"),)), dict(cwd="relative"),
                dict(uid=-1), dict(uid=2**32), dict(gid=True),
                dict(rlimits=(Rlimit(-1, 0, 0),)), dict(rlimits=(Rlimit(7, 2**64, 0),)),
                dict(init_pid=1, tty=Tty(5, rows=0)), dict(init_pid=1, tty=Tty(5, cols=65536)),
                dict(landlock=Landlock("w", (LandlockRule("w", "relative"),))),
                dict(landlock=Landlock("x")),  # type: ignore[arg-type]
                dict(init_pid=1, pristine=Pristine((), ("/a",)))):
        with pytest.raises(InvalidSpec):
            exec_req(fds, **bad).encode()
    with pytest.raises(InvalidSpec, match="not valid text"):
        wire.frame("exec", "1", [("a", "\udcff")])


# -------------------------------------------------------------- every request ----


def test_ping_and_unknown_ops(binary: Path) -> None:
    ping = wire.PingRequest()
    assert parse(binary, ping) == {"rid": "1", "op": "ping", "nfds": 0}
    assert refused(binary, "pong", []) == "unknown op pong"
    assert parse_raw(binary, b"ping\0") == {"dropped": True}  # no rid: nobody to answer


def test_the_datagram_and_fd_caps(binary: Path, fds: list[int]) -> None:
    # MAX_MSG - 1 bytes pass both; one more is refused by both.
    head = unchecked_frame("ping", [("pad", "")])
    fits = [("pad", "x" * (wire.MAX_MSG - 1 - len(head)))]
    assert len(wire.frame("ping", "1", fits)) == wire.MAX_MSG - 1
    assert parse_raw(binary, wire.frame("ping", "1", fits))["op"] == "ping"
    over = [("pad", fits[0][1] + "x")]
    with pytest.raises(InvalidSpec, match=r"request too large .* 1 over"):
        wire.frame("ping", "1", over)
    assert refused(binary, "ping", over).startswith("the request is over 512 KiB")
    # MAX_FDS fds pass the receiver; one more is refused (typed requests carry 4 at most).
    many = [os.dup(fds[i % 4]) for i in range(wire.MAX_FDS + 1)]
    try:
        assert parse_raw(binary, unchecked_frame("ping", []), many[: wire.MAX_FDS])["nfds"] == wire.MAX_FDS
        assert refused(binary, "ping", [], many).startswith("the request carries more than 8 fds")
    finally:
        for fd in many:
            os.close(fd)


def test_landlock_from_stage_tokens() -> None:
    from dsec.backends.container.stages import landlock
    from dsec.spec import FileRules

    rules = FileRules(default="rw", hidden=("/tests",), read_only=("/usr",), writable=("/workspace",))
    built = landlock(rules)
    assert built is not None
    assert Landlock.from_tokens(built.encode()) == built  # tokens round-trip
    assert landlock(FileRules()) is None  # unrestricted: no Landlock at all
    for bad in ([("lr", "w:/x")], [("ld", "w"), ("ld", "r")], [("ld", "w"), ("lr", "q:/x")], [("x", "y")]):
        with pytest.raises(InvalidSpec):
            Landlock.from_tokens(bad)
