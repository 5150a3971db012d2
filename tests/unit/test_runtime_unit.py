"""Unit tests of the runtime's pure parts: output capture, the state table, path
normalisation, the error wire table and the public surface. No root, no kernel."""

from __future__ import annotations

import inspect
import itertools
import json
import random

import pytest

import dsec
import dsec.errors as errors_mod
from dsec.backends.common.fsops import _norm
from dsec.backends.common.output import BoundedCapture
from dsec.errors import (
    ERRORS_BY_CODE,
    DsecError,
    ExecTimeout,
    FileAccessError,
    InvalidSpec,
    LayerNotFound,
    SandboxNotFound,
    SandboxStateError,
    error_from_wire,
)
from dsec.spec import TRANSITIONS, ImageRef, SandboxSpec, SandboxState, can_move
from dsec.spec.results import ExecResult

# ---------------------------------------------------------- BoundedCapture ----


def _marker(dropped: int) -> bytes:
    return f"\n[... dsec: {dropped} bytes omitted ...]\n".encode()


def test_capture_small_output_is_kept_whole() -> None:
    c = BoundedCapture(8)
    assert (c.value(), c.total, c.truncated) == (b"", 0, False)
    c.feed(b"")
    c.feed(b"abc")
    c.feed(b"def")
    assert (c.value(), c.total, c.truncated) == (b"abcdef", 6, False)


def test_capture_exactly_twice_the_cap_is_not_truncated() -> None:
    c = BoundedCapture(4)
    c.feed(b"12345678")
    assert (c.value(), c.total, c.truncated) == (b"12345678", 8, False)
    c.feed(b"9")
    assert c.truncated and c.total == 9
    assert c.value() == b"1234" + _marker(1) + b"6789"


def test_capture_keeps_head_and_tail_of_a_flood() -> None:
    cap = 1024
    c = BoundedCapture(cap)
    chunk = bytes(range(256)) * 257  # 65,792 bytes, not a multiple of the cap
    for _ in range(200):
        c.feed(chunk)
    total = len(chunk) * 200
    data_tail = (chunk * 2)[-cap:]
    assert c.total == total and c.truncated
    v = c.value()
    assert v == chunk[:cap] + _marker(total - 2 * cap) + data_tail
    assert len(v) <= 2 * cap + len(_marker(total))


@pytest.mark.parametrize("seed", range(20))
def test_capture_matches_a_reference_for_any_chunking(seed: int) -> None:
    rng = random.Random(seed)
    cap = rng.choice([1, 2, 3, 7, 64, 100])
    data = bytes(rng.getrandbits(8) for _ in range(rng.randrange(0, 700)))
    c = BoundedCapture(cap)
    i = 0
    while i < len(data):
        n = rng.randrange(0, 3 * cap + 2)
        c.feed(data[i : i + n])
        i += n
    assert c.total == len(data)
    if len(data) <= 2 * cap:
        assert not c.truncated and c.value() == data
    else:
        assert c.truncated
        assert c.value() == data[:cap] + _marker(len(data) - 2 * cap) + data[-cap:]


def test_exec_result_helpers() -> None:
    r = ExecResult(exit_code=0, signal=None, stdout=b"\xffok", stderr=b"", stdout_bytes=3,
                   stderr_bytes=0, truncated=False, duration_s=0.1, start_latency_s=0.0)
    assert r.ok and r.stdout_text == "\ufffdok" and r.timed_out is None
    r2 = ExecResult(exit_code=None, signal=9, stdout=b"", stderr=b"", stdout_bytes=0,
                    stderr_bytes=0, truncated=False, duration_s=0.1, start_latency_s=0.0)
    assert not r2.ok


# ------------------------------------------------------ state transitions ----

LEGAL = {
    ("creating", "running"), ("creating", "failed"), ("creating", "stopping"),
    ("running", "stopping"), ("running", "failed"), ("running", "paused"),
    ("paused", "running"), ("paused", "stopping"), ("paused", "failed"),
    ("stopping", "stopped"), ("stopping", "failed"),
    ("failed", "stopping"),
    # the control plane's: an edge it lost (never set by an edge)
    ("creating", "lost"), ("running", "lost"), ("paused", "lost"), ("failed", "lost"),
}


def test_transition_table_is_exactly_the_documented_one() -> None:
    assert set(TRANSITIONS) == set(SandboxState)
    table = {(a.value, b.value) for a, dsts in TRANSITIONS.items() for b in dsts}
    assert table == LEGAL


@pytest.mark.parametrize(("src", "dst"), list(itertools.product(SandboxState, SandboxState)),
                         ids=lambda s: s.value)
def test_can_move(src: SandboxState, dst: SandboxState) -> None:
    assert can_move(src, dst) is ((src.value, dst.value) in LEGAL)


def test_state_graph_shape() -> None:
    assert not TRANSITIONS[SandboxState.STOPPED]  # terminal
    assert not TRANSITIONS[SandboxState.LOST]  # terminal
    assert not any(can_move(s, s) for s in SandboxState)  # no self-loops
    assert not any(can_move(s, SandboxState.CREATING) for s in SandboxState)  # never re-created
    seen, todo = {SandboxState.CREATING}, [SandboxState.CREATING]
    while todo:
        for nxt in TRANSITIONS[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    assert seen == set(SandboxState)
    # Every state can still reach an end (nothing gets stuck); lost is the control plane's end.
    for s in SandboxState:
        reach, todo = {s}, [s]
        while todo:
            for nxt in TRANSITIONS[todo.pop()]:
                if nxt not in reach:
                    reach.add(nxt)
                    todo.append(nxt)
        assert SandboxState.STOPPED in reach or s is SandboxState.LOST, s
    assert [s.value for s in SandboxState] == ["creating", "running", "stopping", "stopped", "failed", "paused",
                                               "lost"]


def test_runtime_refuses_illegal_moves(tmp_path) -> None:
    from dsec.backends.container.records import ContainerRecord
    from dsec.backends.container.runtime import ContainerRuntime

    rt = ContainerRuntime(name="unit", state_dir=tmp_path / "state", run_dir=tmp_path / "run")
    spec = SandboxSpec(image=ImageRef(base="busybox"))
    rec = ContainerRecord(id="sb-unit", state=SandboxState.STOPPED, spec=spec, created_at=0.0, slot=0)
    with pytest.raises(SandboxStateError) as ei:
        rt.records.move(rec, SandboxState.RUNNING, save=False)
    assert ei.value.sandbox_id == "sb-unit" and ei.value.state == "stopped"
    assert rec.state is SandboxState.STOPPED and rec.events == []
    rec = ContainerRecord(id="sb-unit", state=SandboxState.CREATING, spec=spec, created_at=0.0, slot=0)
    rt.records.move(rec, SandboxState.RUNNING, save=False)
    assert rec.state is SandboxState.RUNNING
    assert rec.events[-1]["event"] == "state" and rec.events[-1]["state"] == "running"


def test_record_json_round_trip() -> None:
    from dsec.backends.base import EdgeMeta
    from dsec.backends.container.records import ContainerRecord

    spec = SandboxSpec(image=ImageRef(base="busybox:1", toolkits=("py:3",)), env={"A": "b"})
    edge = EdgeMeta.lifecycle(100.0, 60.0, 5.0, labels={"k": "v"}, task="t", project="p", request_id="r1")
    rec = ContainerRecord(id="sb-x", state=SandboxState.RUNNING, spec=spec, slot=7, layers=["sha256:" + "a" * 64],
                          created_at=12.5, init_pid=42, init_start=99, reason="r", edge=edge)
    back = ContainerRecord.from_json(json.loads(json.dumps(rec.to_json())))
    assert (back.id, back.state, back.spec, back.slot, back.layers, back.created_at, back.init_pid,
            back.init_start, back.reason) == (rec.id, rec.state, rec.spec, 7, rec.layers, 12.5, 42, 99, "r")
    assert back.uid_base == rec.uid_base == (1 << 24) + 7 * 65536
    assert back.edge == edge and back.edge.expires_at == 160.0 and back.edge.labels == {"k": "v"}


def test_record_written_before_typed_edge_part_reads() -> None:
    """Records saved by an older edge keep their owner data in ``meta.edge``: still read."""
    from dsec.backends.container.records import ContainerRecord

    spec = SandboxSpec(image=ImageRef(base="busybox:1"))
    old = {"id": "sb-o", "state": "running", "spec": spec.model_dump(mode="json"), "slot": 3, "layers": [],
           "created_at": 1.0, "meta": {"edge": {"task": "t", "expires_at": 9.0, "pool": "p1", "unknown": 1}}}
    rec = ContainerRecord.from_json(old)
    assert (rec.edge.task, rec.edge.expires_at, rec.edge.pool) == ("t", 9.0, "p1")


# ------------------------------------------------------------- fsops._norm ----


@pytest.mark.parametrize(("path", "expected"), [
    ("/", ""),
    ("", ""),
    (".", ""),
    ("//", ""),
    ("/etc/passwd", "etc/passwd"),
    ("etc/passwd", "etc/passwd"),
    ("//etc//passwd/", "etc/passwd"),
    ("/a/./b/../c", "a/c"),
    ("..", ""),
    ("../../../etc/shadow", "etc/shadow"),
    ("/../../..", ""),
    ("a/../../../b", "b"),
    ("/tmp/..hidden", "tmp/..hidden"),
    ("/tmp/...", "tmp/..."),
    ("/tmp/x..", "tmp/x.."),
    ("/ spaces /é", " spaces /é"),
])
def test_norm(path: str, expected: str) -> None:
    assert _norm(path) == expected
    assert not _norm(path).startswith("/")
    assert ".." not in _norm(path).split("/")


@pytest.mark.parametrize("bad", ["a\0b", "\0", None, b"/etc", 5])
def test_norm_refuses_bad_paths(bad: object) -> None:
    with pytest.raises(InvalidSpec) as ei:
        _norm(bad)  # type: ignore[arg-type]
    assert ei.value.field == "path"


# ---------------------------------------------------------------- errors ----


def _all_error_classes() -> list[type[DsecError]]:
    return [c for _, c in inspect.getmembers(errors_mod, inspect.isclass)
            if issubclass(c, DsecError) and c.__module__ == errors_mod.__name__]


def test_wire_table_covers_every_error_once() -> None:
    classes = _all_error_classes()
    assert sorted(c.__name__ for c in ERRORS_BY_CODE.values()) == sorted(c.__name__ for c in classes)
    assert len({c.code for c in classes}) == len(classes)  # codes are unique
    for code, cls in ERRORS_BY_CODE.items():
        assert cls.code == code


@pytest.mark.parametrize("cls", sorted(ERRORS_BY_CODE.values(), key=lambda c: c.code), ids=lambda c: c.code)
def test_errors_round_trip_the_wire(cls: type[DsecError]) -> None:
    err = cls("something broke", sandbox_id="sb-1", retry_after=1.5, path="/x", nested={"a": [1, 2]})
    wire = json.loads(json.dumps(err.to_wire()))
    assert wire["code"] == cls.code and wire["message"] == "something broke"
    back = error_from_wire(wire)
    assert type(back) is cls
    assert str(back) == "something broke" and back.message == "something broke"
    assert back.fields == err.fields
    assert back.sandbox_id == "sb-1" and back.retry_after == 1.5 and back.nested == {"a": [1, 2]}
    assert back.to_wire() == err.to_wire()


def test_error_from_wire_is_forgiving() -> None:
    e = error_from_wire({"code": "no_such_code", "message": "m", "x": 1})
    assert type(e) is DsecError and e.message == "m" and e.x == 1
    e = error_from_wire({})
    assert type(e) is DsecError and e.message == "unknown error"
    payload = {"code": "sandbox_not_found", "message": "gone", "sandbox_id": "a"}
    error_from_wire(payload)
    assert payload == {"code": "sandbox_not_found", "message": "gone", "sandbox_id": "a"}  # not mutated


def test_errors_inherit_the_builtin_that_fits() -> None:
    assert issubclass(SandboxNotFound, LookupError)
    assert issubclass(ExecTimeout, TimeoutError)
    assert issubclass(InvalidSpec, ValueError)
    assert issubclass(LayerNotFound, LookupError) and issubclass(LayerNotFound, errors_mod.ImageError)
    assert issubclass(FileAccessError, OSError)
    assert issubclass(errors_mod.AuthError, PermissionError) and issubclass(errors_mod.Forbidden, PermissionError)
    assert error_from_wire({"code": "backpressure", "message": "busy", "retry_after": 2.5}).retry_after == 2.5
    assert all(issubclass(c, DsecError) for c in ERRORS_BY_CODE.values())
    e = FileAccessError("denied", errno=13, path="/p")
    assert e.errno == 13 and e.path == "/p" and str(e) == "denied"
    with pytest.raises(LookupError):
        raise error_from_wire({"code": "sandbox_not_found", "message": "x"})


# ------------------------------------------------------------ public API ----


def test_public_surface_is_deliberate() -> None:
    assert dsec.__all__ == [
        "AsyncClient",
        "AsyncSandbox",
        "AsyncSession",
        "AsyncTerminal",
        "AuthError",
        "Backpressure",
        "Client",
        "CreateOutcome",
        "DsecError",
        "ExceedsCapacity",
        "ExecError",
        "ExecResult",
        "ExecTimeout",
        "FileAccessError",
        "FileRules",
        "FnCall",
        "FnCallError",
        "FnCallFailed",
        "FnCallOOM",
        "FnCallOutputTooLarge",
        "FnCallTimeout",
        "FnCallWorkerLost",
        "FnResult",
        "Forbidden",
        "HostError",
        "ImageError",
        "ImageRef",
        "InvalidSpec",
        "LayerInUse",
        "LayerNotFound",
        "LimitHit",
        "NetRule",
        "NetworkPolicy",
        "OutputChunk",
        "QuotaExceeded",
        "Resources",
        "Sandbox",
        "SandboxEvicted",
        "SandboxFailed",
        "SandboxLost",
        "SandboxNotFound",
        "SandboxPreempted",
        "SandboxSpec",
        "SandboxState",
        "SandboxStateError",
        "Session",
        "SessionClosed",
        "Stage",
        "Terminal",
        "TerminalExit",
        "Unavailable",
        "Unsupported",
        "__version__",
    ]
    for name in dsec.__all__:
        assert hasattr(dsec, name), name
    assert dsec.SandboxSpec is SandboxSpec and dsec.DsecError is DsecError
