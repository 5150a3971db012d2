"""The microVM agent's wire: the Python encoder (agentwire.py) and the agent's C parser agree.

Every request is encoded by ``agentwire`` and fed, as one frame, to the compiled
``dsec-vmagent --parse``, which runs the agent's real parser (``native/vmwire.c``) and
prints what the agent would act on. The expected values come from the dataclass's own
fields, not from its encoding. A list at its cap passes both; one over it is refused by
both (InvalidSpec here, EINVAL/E2BIG there). No VM and no root needed.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from dsec.backends.microvm import agentwire as w
from dsec.errors import HostError, InvalidSpec


@pytest.fixture(scope="module")
def binary() -> Path:
    from dsec.backends.microvm.build import agent_path

    try:
        return agent_path()
    except HostError as exc:
        pytest.skip(f"no dsec-vmagent: {exc}")


def parse_raw(binary: Path, data: bytes) -> dict[str, Any]:
    proc = subprocess.run([str(binary), "--parse"], input=data, capture_output=True, timeout=30)
    assert proc.returncode == 0, proc.stderr.decode()
    out: dict[str, Any] = json.loads(proc.stdout.decode())
    return out


def parse(binary: Path, req: w.Request, chan: int = 7) -> dict[str, Any]:
    out = parse_raw(binary, w.request_frame(req, chan))
    assert "error" not in out, out
    assert (out.pop("op"), out.pop("chan")) == (req.OP, chan)
    return out


def raw_frame(op: str, fields: list[tuple[str, str]], chan: int = 7) -> bytes:
    """A request frame without agentwire's checks (to show the C side refuses too)."""
    payload = b"".join(t.encode() + b"\0" for t in (op, *(x for kv in fields for x in kv)))
    return len(payload).to_bytes(4, "little") + chan.to_bytes(4, "little") + b"Q" + payload


def refused(binary: Path, op: str, fields: list[tuple[str, str]]) -> tuple[int, str]:
    out = parse_raw(binary, raw_frame(op, fields))
    assert "error" in out, out
    return out["error"]["errno"], out["error"]["message"]


# ------------------------------------------------------- expected, from fields ----


def expected(req: w.Request) -> dict[str, Any]:
    if isinstance(req, w.ExecRequest):
        return {"argv": list(req.argv), "env": [f"{k}={v}" for k, v in req.env], "cwd": req.cwd, "uid": req.uid,
                "gid": req.gid, "tty": int(req.tty), "rows": req.rows, "cols": req.cols, "stdin": int(req.stdin),
                "win": req.window}
    if isinstance(req, w.SignalRequest):
        return {"ch": req.chan, "sig": req.sig, "tree": int(req.tree), "spare": int(req.spare)}
    if isinstance(req, w.ResizeRequest):
        return {"ch": req.chan, "rows": req.rows, "cols": req.cols}
    if isinstance(req, w.StatRequest):
        return {"path": w.norm_path("path", req.path), "follow": int(req.follow)}
    if isinstance(req, w.ListRequest):
        return {"path": w.norm_path("path", req.path)}
    if isinstance(req, w.ReadRequest):
        return {"path": w.norm_path("path", req.path), "max": req.max_bytes, "win": req.window}
    if isinstance(req, w.WriteRequest):
        return {"path": w.norm_path("path", req.path), "mode": req.mode, "uid": req.uid, "gid": req.gid,
                "append": int(req.append)}
    if isinstance(req, w.MkdirRequest):
        return {"path": w.norm_path("path", req.path), "mode": req.mode, "uid": req.uid, "gid": req.gid,
                "parents": int(req.parents)}
    if isinstance(req, w.RemoveRequest):
        return {"path": w.norm_path("path", req.path), "recursive": int(req.recursive)}
    if isinstance(req, w.RenameRequest):
        return {"src": w.norm_path("src", req.src), "dst": w.norm_path("dst", req.dst)}
    if isinstance(req, w.IdentityRequest):
        return {"hostname": req.hostname, "machine_id": req.machine_id, "seed": req.seed.hex(),
                "realtime_ns": req.realtime_ns}
    if isinstance(req, w.SyncRequest):
        return {"freeze": None if req.freeze is None else int(req.freeze)}
    if isinstance(req, w.NetcutRequest):
        import ipaddress

        return {"allow": [f"{ipaddress.IPv4Network(c, strict=False).with_prefixlen} {p} {lo}-{hi}"
                          for c, p, lo, hi in req.allow]}
    return {}


MID = "0123456789abcdef0123456789abcdef"
REQUESTS: dict[str, w.Request] = {
    "ping": w.PingRequest(),
    "hello": w.HelloRequest(),
    "poweroff": w.PoweroffRequest(),
    "exec-bare": w.ExecRequest(argv=("true",)),
    "exec-all": w.ExecRequest(argv=("/bin/sh", "-c", "echo hi"), env=(("PATH", "/bin"), ("EMPTY", ""), ("EQ", "a=b")),
                              cwd="/wörk space", uid=1000, gid=1001, tty=True, rows=50, cols=132, stdin=True,
                              window=0),
    "exec-odd-text": w.ExecRequest(argv=("/bin/echo", 'quo"te', "back\\slash", "new\nline", "tab\t", "ünï €", "")),
    "exec-max-ints": w.ExecRequest(argv=("x",), uid=2**32 - 2, gid=2**32 - 2, rows=65535, cols=65535,
                                   window=2**32 - 1),
    "signal": w.SignalRequest(9, 15, tree=False),
    "signal-tree": w.SignalRequest(2**32 - 1, 64),
    "signal-spare": w.SignalRequest(3, 9, spare=True),
    "resize": w.ResizeRequest(3, 1, 65535),
    "stat": w.StatRequest("/etc/passwd"),
    "stat-follow-root": w.StatRequest("/", follow=True),
    "stat-dotdot": w.StatRequest("/a/../../b/./c//"),
    "list": w.ListRequest("/home/user"),
    "read": w.ReadRequest("/x", 2**63 - 1, 0),
    "write": w.WriteRequest(path="/tmp/f", mode=0o7777, uid=5, gid=6, append=True),
    "write-default": w.WriteRequest(path="/tmp/f"),
    "mkdir": w.MkdirRequest(path="/a/b/c", mode=0o700, parents=True),
    "remove": w.RemoveRequest("/a", recursive=True),
    "rename": w.RenameRequest("/a b", "/c/../d"),
    "identity": w.IdentityRequest(hostname="sb-1.x", machine_id=MID, seed=bytes(range(256)),
                                  realtime_ns=1_765_000_000_000_000_000),
    "identity-no-clock": w.IdentityRequest(hostname="h" * 64, machine_id=MID, seed=b""),
    "sync": w.SyncRequest(),
    "sync-freeze": w.SyncRequest(True),
    "sync-thaw": w.SyncRequest(False),
    "netcut-none": w.NetcutRequest(),
    "netcut": w.NetcutRequest((("10.1.2.0/24", "tcp", 80, 80), ("0.0.0.0/0", "udp", 1, 65535),
                               ("192.168.7.9/32", "tcp", 0, 65535), ("10.9.8.7/8", "tcp", 1000, 2000))),
}


@pytest.mark.parametrize("name", REQUESTS)
def test_request_agrees(binary: Path, name: str) -> None:
    req = REQUESTS[name]
    assert parse(binary, req) == expected(req)


def test_every_op_is_covered() -> None:
    ops = {r.OP for r in REQUESTS.values()}
    assert len(ops) == 16  # vmwire.c op_names


# --------------------------------------------------------------------- caps ----


def test_argv_and_env_at_and_over_their_caps(binary: Path) -> None:
    at = w.ExecRequest(argv=("x",) * w.MAX_ARGS)
    assert parse(binary, at)["argv"] == list(at.argv)
    with pytest.raises(InvalidSpec, match=r"1 over the agent's cap of 4000 \(MAX_ARGS\)"):
        dataclasses.replace(at, argv=(*at.argv, "y")).encode()
    assert refused(binary, "exec", [("a", "x")] * (w.MAX_ARGS + 1)) == (errno.E2BIG, "more than 4000 arguments")
    env = tuple((f"K{i}", "") for i in range(w.MAX_ENV))
    at_env = w.ExecRequest(argv=("x",), env=env)
    assert len(parse(binary, at_env)["env"]) == w.MAX_ENV
    with pytest.raises(InvalidSpec, match=r"1 over the agent's cap of 4000 \(MAX_ENV\)"):
        dataclasses.replace(at_env, env=(*env, ("Y", ""))).encode()
    assert refused(binary, "exec", [("a", "x"), *[("e", f"K{i}=") for i in range(w.MAX_ENV + 1)]]) == (
        errno.E2BIG, "more than 4000 environment entries")
    # Together they would pass MAX_TOK: the token table refuses first, on both sides.
    both = w.ExecRequest(argv=("x",) * w.MAX_ARGS, env=env)
    with pytest.raises(InvalidSpec, match="MAX_TOK"):
        w.request_frame(both, 1)
    errno_, msg = refused(binary, "exec", [("a", "x")] * w.MAX_ARGS + [("e", f"K{i}=") for i in range(w.MAX_ENV)])
    assert errno_ == errno.E2BIG and "more than 8192 tokens" in msg


def test_the_frame_and_token_caps(binary: Path) -> None:
    # A request of exactly MAX_FRAME bytes passes both; one more byte is refused by both.
    base = len(w.encode_request("exec", [("a", "x"), ("a", "")]))
    raw = [("a", "x"), ("a", "y" * (w.MAX_FRAME - base))]
    payload = w.encode_request("exec", raw)
    assert len(payload) == w.MAX_FRAME
    assert parse_raw(binary, w.frame(w.T_REQUEST, 1, payload))["argv"][1] == raw[1][1]
    with pytest.raises(InvalidSpec, match="MAX_FRAME"):
        w.encode_request("exec", [("a", "x"), ("a", "y" * (w.MAX_FRAME - base + 1))])
    with pytest.raises(InvalidSpec, match="MAX_FRAME"):
        w.frame(w.T_INPUT, 1, b"\0" * (w.MAX_FRAME + 1))
    over = raw_frame("exec", [("a", "x"), ("a", "y" * (w.MAX_FRAME - base + 1))])
    out = parse_raw(binary, over)
    assert out["error"]["errno"] == errno.EMSGSIZE and "MAX_FRAME" in out["error"]["message"]
    # MAX_TOK tokens: the op and (MAX_TOK - 1) // 2 fields fit; one more field does not.
    n = (w.MAX_TOK - 1) // 2
    with pytest.raises(InvalidSpec, match="MAX_TOK"):
        w.encode_request("ping", [("k", "")] * (n + 1))
    errno_, msg = refused(binary, "exec", [("a", "")] * (n + 1))
    assert errno_ == errno.E2BIG and "more than 8192 tokens" in msg


def test_paths_hostnames_and_seeds_at_their_caps(binary: Path) -> None:
    long_path = "/" + "p" * (w.MAX_PATH - 2)
    assert parse(binary, w.StatRequest(long_path))["path"] == long_path
    with pytest.raises(InvalidSpec, match="MAX_PATH"):
        w.StatRequest(long_path + "p").encode()
    assert refused(binary, "stat", [("path", long_path + "p")]) == (errno.EINVAL, "path: longer than 4095 bytes")
    with pytest.raises(InvalidSpec, match="hostname"):
        w.IdentityRequest(hostname="h" * 65, machine_id=MID, seed=b"").encode()
    assert refused(binary, "identity", [("hostname", "h" * 65), ("machine_id", MID), ("seed", "")])[0] == errno.EINVAL
    with pytest.raises(InvalidSpec, match="MAX_SEED"):
        w.IdentityRequest(hostname="h", machine_id=MID, seed=b"s" * 257).encode()
    assert refused(binary, "identity", [("hostname", "h"), ("machine_id", MID), ("seed", "00" * 257)])[0] == errno.EINVAL


# ------------------------------------------------------------ refusals ----


def test_the_parser_refuses_what_the_encoder_never_sends(binary: Path) -> None:
    cases: list[tuple[str, list[tuple[str, str]], str]] = [
        ("pong", [], "unknown op pong"),
        ("ping", [("x", "1")], "ping takes no key x"),
        ("exec", [], "exec needs a"),
        ("exec", [("a", "")], "exec: empty command"),
        ("exec", [("a", "x"), ("cwd", "rel")], "cwd: must be an absolute path"),
        ("exec", [("a", "x"), ("cwd", "/"), ("cwd", "/")], "exec: key cwd given twice"),
        ("exec", [("a", "x"), ("e", "NOEQ")], "environment entry without a NAME= prefix"),
        ("exec", [("a", "x"), ("e", "=v")], "environment entry without a NAME= prefix"),
        ("exec", [("a", "x"), ("uid", "-1")], "uid: not a decimal number"),
        ("exec", [("a", "x"), ("uid", "4294967295")], "uid: 4294967295 is outside 0..4294967294"),
        ("exec", [("a", "x"), ("uid", "99999999999999999999999")], "uid: number too large"),
        ("exec", [("a", "x"), ("tty", "yes")], "tty takes 0 or 1"),
        ("exec", [("a", "x"), ("rows", "0")], "rows: 0 is outside 1..65535"),
        ("signal", [("ch", "1"), ("sig", "65")], "sig: 65 is outside 1..64"),
        ("signal", [("ch", "0"), ("sig", "9")], "ch: 0 is outside 1..4294967295"),
        ("stat", [], "stat needs path"),
        ("rename", [("src", "/a")], "rename needs dst"),
        ("mkdir", [("path", "/a"), ("mode", "4096")], "mode: 4096 is outside 0..4095"),
        ("identity", [("hostname", "a b"), ("machine_id", MID), ("seed", "")],
         "hostname: only letters, digits, '-' and '.'"),
        ("identity", [("hostname", "a"), ("machine_id", MID.upper()), ("seed", "")],
         "machine_id: 32 lowercase hex digits"),
        ("identity", [("hostname", "a"), ("machine_id", MID), ("seed", "abc")],
         "seed: an even number of hex digits, at most 256 bytes"),
        ("sync", [("freeze", "2")], "freeze takes 0 or 1"),
    ]
    for op, fields, msg in cases:
        assert refused(binary, op, fields) == (errno.EINVAL, msg), (op, fields)
    out = parse_raw(binary, w.frame(w.T_REQUEST, 0, b"ping\0"))
    assert out["error"]["message"] == "request on channel 0"
    out = parse_raw(binary, w.frame(w.T_REQUEST, 1, b"ping"))
    assert out["error"]["message"] == "the payload must end with a NUL"
    out = parse_raw(binary, w.frame(w.T_REQUEST, 1, b"stat\0path\0"))
    assert out["error"]["message"] == "stat: a key without a value"


def test_netcut_elements_are_checked_on_both_sides(binary: Path) -> None:
    for bad in ("10.0.0.0/33 tcp 1-2", "10.0.0.0/8 icmp 1-2", "10.0.0.0/8 tcp 5-4", "10.0.0/8 tcp 1-2",
                "10.0.0.0/8 tcp 1-70000", "10.0.0.0/8 tcp 1-2 x"):
        assert refused(binary, "netcut", [("allow", bad)])[0] == errno.EINVAL, bad
    with pytest.raises(InvalidSpec):
        w.NetcutRequest((("not-a-net", "tcp", 1, 2),)).encode()
    with pytest.raises(InvalidSpec):
        w.NetcutRequest((("10.0.0.0/8", "tcp", 9, 2),)).encode()
    with pytest.raises(InvalidSpec):
        w.NetcutRequest((("10.0.0.0/8", "tcp", 1, 2),) * (w.MAX_ALLOW + 1)).encode()


def test_values_the_wire_cannot_carry_are_refused_here() -> None:
    bad: list[w.Request] = [
        w.ExecRequest(argv=()), w.ExecRequest(argv=("",)), w.ExecRequest(argv=("a\0b",)),
        w.ExecRequest(argv=("x",), env=(("", "v"),)), w.ExecRequest(argv=("x",), env=(("A=B", "v"),)),
        w.ExecRequest(argv=("x",), cwd="rel"), w.ExecRequest(argv=("x",), uid=-1),
        w.ExecRequest(argv=("x",), gid=True), w.ExecRequest(argv=("x",), rows=0),
        w.ExecRequest(argv=("\udcff",)), w.StatRequest("relative"), w.SignalRequest(1, 0),
        w.ReadRequest("/x", -1), w.WriteRequest(path="/x", mode=0o10000),
        w.IdentityRequest(hostname="", machine_id=MID, seed=b""),
        w.IdentityRequest(hostname="h", machine_id="xyz", seed=b""),
    ]
    for req in bad:
        with pytest.raises(InvalidSpec):
            w.request_frame(req, 1)
    with pytest.raises(InvalidSpec):
        w.request_frame(w.PingRequest(), 0)


def test_frames_and_answers_decode() -> None:
    r = w.FrameReader()
    stream = w.frame(w.T_ANSWER, 3, b"ok\0pid\x0042\0") + w.frame(w.T_EXIT, 3, b"code\0-1\0sig\0009\0utime_us\0"
                                                                  b"1500000\0stime_us\x000\0maxrss_kb\x007\0")
    frames = [f for i in range(len(stream)) for f in r.feed(stream[i:i + 1])]  # byte by byte
    assert [(t, c) for t, c, _ in frames] == [(w.T_ANSWER, 3), (w.T_EXIT, 3)]
    assert w.Answer.parse(frames[0][2]) == w.Answer(True, {"pid": "42"})
    assert w.Exit.parse(frames[1][2]) == w.Exit(-1, 9, 1.5, 0.0, 7)
    err = w.Answer.parse(b"err\0errno\x002\0msg\0no such file\0")
    assert (err.ok, err.errno, err.message) == (False, 2, "no such file")
    with pytest.raises(ValueError, match="stream broken"):
        list(w.FrameReader().feed((w.MAX_FRAME + 1).to_bytes(4, "little") + bytes(5)))


def test_the_guest_network_constants_agree_with_the_agent() -> None:
    """The guest's addresses are set by the agent (vmagent.h) and by the host's tap
    (network.py): the two must say the same, or the guest's packets go nowhere."""
    import ipaddress
    import re
    from pathlib import Path

    from dsec.backends.microvm import network

    header = (Path(network.__file__).parent / "native" / "vmagent.h").read_text()
    got = dict(re.findall(r'#define (NET_\w+) "([^"]+)"', header))
    assert got["NET_GUEST_IP"] == network.GUEST_IP and got["NET_GATEWAY_IP"] == network.GATEWAY_IP
    assert got["NET_GATEWAY_MAC"] == network.GATEWAY_MAC
    assert str(ipaddress.ip_network(f"0.0.0.0/{got['NET_NETMASK']}").prefixlen) == str(network.PREFIX)
    net = ipaddress.ip_network(f"{network.GATEWAY_IP}/{network.PREFIX}", strict=False)
    assert ipaddress.ip_address(network.GUEST_IP) in net


def test_the_platforms_addresses_are_blocked_for_vms_as_for_containers(tmp_path: Path) -> None:
    """An edge's own addresses and its control plane's (``BackendContext.platform``) join the
    microVM backend's block list, with or without a network section in its config."""
    from dsec.backends import BackendContext, build
    from dsec.backends.common.netconfig import NetworkConfig
    from dsec.backends.microvm.config import MicroVMConfig

    for cfg in (MicroVMConfig(), MicroVMConfig(network=NetworkConfig(blocked=("10.66.0.0/16",)))):
        be: Any = build(cfg, BackendContext(name="tvmplat", state_dir=tmp_path, run_dir=tmp_path, id_prefix="vp",
                                            store=None, backends={}, platform=("10.77.0.1/32", "10.66.1.2/32")))
        blocked = be.config.network.blocked
        assert "10.77.0.1/32" in blocked, blocked
        assert "10.66.1.2/32" in blocked or "10.66.0.0/16" in blocked, blocked
        assert be.net.config.blocked == blocked
