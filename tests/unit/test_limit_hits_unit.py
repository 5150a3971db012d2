"""``ExecResult.limit`` without a kernel: the verdict table, the messages, the wire both ways.

The evidence itself (cgroup counters, the writable layer's room) is read on the real
kernel in tests/integration/test_runtime_limit_hits.py; here the pure judge gets it as data.
"""

from __future__ import annotations

import base64
import signal

import pytest

from dsec.backends.common.limits import Baseline, Counters, DiskRoom, judge
from dsec.edge.service import result_to_wire
from dsec.sdk._http import result_from_wire
from dsec.spec import Resources
from dsec.spec.api import ExecResultWire, StreamChunk
from dsec.spec.results import ExecResult, LimitHit

MiB = 1 << 20
RES = Resources(memory=128 * MiB, pids=64, disk=1 << 30)
QUIET = Counters(oom_kills=2, pids_hits=5)
OOM = Counters(oom_kills=3, pids_hits=5)
FORK = Counters(oom_kills=2, pids_hits=9)
ROOMY = DiskRoom(bytes_free=500 * MiB, inodes_free=1000, full=False)
FULL = DiskRoom(bytes_free=0, inodes_free=1000, full=True)


def verdict(exit_code: int | None = 0, sig: int | None = None, *, after: Counters = QUIET, disk: DiskRoom = ROOMY,
            timed_out: str | None = None, truncated: bool = False, full_before: bool = False,
            stderr: bytes = b"") -> str | None:
    hit = judge(RES, exit_code=exit_code, sig=sig, timed_out=timed_out, timeout_s=30.0, idle_timeout_s=5.0,
                truncated=truncated, output_cap=256 * 1024, before=Baseline(QUIET, full_before), after=after,
                disk=disk, output=(stderr, b""))
    return None if hit is None else hit.kind


def test_verdicts_need_evidence() -> None:
    assert verdict(0) is None
    assert verdict(1) is None
    assert verdict(None, signal.SIGKILL) is None  # killed, but no OOM kill was counted
    assert verdict(None, signal.SIGKILL, after=OOM) == "memory"
    assert verdict(137, after=OOM) == "memory"  # a shell reporting its child's kill
    assert verdict(1, after=OOM) is None  # an OOM kill elsewhere; this one failed by itself
    assert verdict(0, after=OOM) is None
    assert verdict(2, after=FORK) == "pids"
    assert verdict(0, after=FORK) is None  # a refused fork the command got over
    assert verdict(1, disk=FULL) == "disk_full"  # it filled the layer, then failed
    assert verdict(0, disk=FULL) is None
    # Full before it started: blamed only on the command's own word for it.
    assert verdict(1, disk=FULL, full_before=True) is None
    assert verdict(1, disk=FULL, full_before=True, stderr=b"x: No space left on device\n") == "disk_full"
    assert verdict(1, disk=FULL, full_before=True, stderr=b"x: Disk quota exceeded\n") == "disk_full"
    assert verdict(1, disk=ROOMY, stderr=b"No space left on device") is None  # words alone are not enough
    assert verdict(0, truncated=True) == "output_cap"
    assert verdict(None, signal.SIGKILL, timed_out="timeout") == "timeout"
    assert verdict(None, signal.SIGKILL, timed_out="idle_timeout") == "idle_timeout"
    # Order: what killed it before what it ran into, before what was cut from its result.
    assert verdict(None, signal.SIGKILL, after=Counters(3, 9), disk=FULL, truncated=True) == "memory"
    assert verdict(1, after=FORK, disk=FULL, truncated=True) == "pids"
    assert verdict(1, disk=FULL, truncated=True) == "disk_full"
    # No evidence read (the sandbox went away): no verdict.
    assert judge(RES, exit_code=None, sig=9, timed_out=None, timeout_s=None, idle_timeout_s=None, truncated=False,
                 output_cap=1024, before=Baseline(None), after=OOM, disk=None) is None


def test_an_oom_on_the_memory_medium_names_the_files() -> None:
    mem = Resources(memory=128 * MiB, pids=64, disk=1 << 30, disk_medium="memory")
    kw = dict(exit_code=None, sig=9, timed_out=None, timeout_s=None, idle_timeout_s=None, truncated=False,
              output_cap=1024, before=Baseline(Counters(0, 0)), after=OOM, disk=None)
    on_disk = judge(RES, **kw)  # type: ignore[arg-type]
    in_ram = judge(mem, **kw)  # type: ignore[arg-type]
    assert on_disk is not None and in_ram is not None and on_disk.kind == in_ram.kind == "memory"
    assert "medium" not in on_disk.message
    assert in_ram.message.endswith("(written files count against it on the memory medium: "
                                   "--disk-medium disk keeps them on disk)")


@pytest.mark.parametrize(("kind", "value", "line"), [
    ("memory", 128 * MiB, "dsec: killed by the memory limit (128 MiB): raise it with --memory / Resources.memory"),
    ("pids", 64, "dsec: the pids limit (64 processes) refused a fork: raise it with --pids / Resources.pids"),
    ("timeout", 600.0, "dsec: killed by the timeout (600 s): raise it with --timeout / timeout="),
    ("idle_timeout", 2.5, "dsec: killed by the idle timeout (no output for 2.5 s): raise it with idle_timeout="),
    ("output_cap", 256 * 1024, "dsec: output beyond the output cap (256 KiB of head and of tail per stream) was cut "
                               "from the result: raise it with --output-cap / SandboxSpec.output_cap"),
    ("disk_full", 3 * (1 << 30) // 2, "dsec: the writable layer is full (disk quota 1.5 GiB): raise it with --disk / "
                                      "Resources.disk"),
])
def test_messages_are_one_line(kind: str, value: float, line: str) -> None:
    hit = LimitHit.of(kind, value)  # type: ignore[arg-type]
    assert (hit.kind, hit.value, hit.message) == (kind, value, line)


def _result(limit: LimitHit | None) -> ExecResult:
    return ExecResult(exit_code=None, signal=9, stdout=b"out", stderr=b"", stdout_bytes=3, stderr_bytes=0,
                      truncated=False, duration_s=0.5, start_latency_s=0.0, limit=limit)


@pytest.mark.parametrize("limit", [None, LimitHit.of("memory", 128 * MiB), LimitHit.of("timeout", 0.5)])
def test_limit_travels_from_the_edge_to_the_sdk(limit: LimitHit | None) -> None:
    wire = result_to_wire(_result(limit)).model_dump_json()
    back = result_from_wire(ExecResultWire.model_validate_json(wire))
    assert back.limit == limit and back.signal == 9 and back.stdout == b"out"
    # /exec/stream's last line carries the same result.
    line = StreamChunk(kind="result", result=result_to_wire(_result(limit))).model_dump_json(exclude_none=True)
    chunk = StreamChunk.model_validate_json(line)
    assert chunk.result is not None and result_from_wire(chunk.result).limit == limit


def test_an_edge_without_limits_still_decodes() -> None:
    old = {"exit_code": 0, "stdout_b64": base64.b64encode(b"x").decode(), "stderr_b64": "", "stdout_bytes": 1,
           "stderr_bytes": 0, "truncated": False, "duration_s": 0.1}
    assert result_from_wire(ExecResultWire.model_validate(old)).limit is None


def test_cli_prints_the_limit_as_one_plain_line(capsys: pytest.CaptureFixture[str]) -> None:
    from dsec.cli.service import say_limit

    assert say_limit(_result(None)) is False
    hit = LimitHit.of("memory", 128 * MiB)
    assert say_limit(_result(hit)) is True
    assert capsys.readouterr().err == hit.message + "\n"
