"""Edge pieces that need no root: config validation, admission arithmetic, the pool
watermark, event logs and tombstones, error bodies, field names of 422s."""

from __future__ import annotations

import json
import secrets
import time
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from dsec.edge.admission import Admission, Budgets, Usage, over, resolve_budgets
from dsec.edge.config import EdgeConfig, PoolConfig
from dsec.edge.events import EventLog, Tombstone
from dsec.errors import Backpressure, ExceedsCapacity, ExecTimeout
from dsec.spec import ImageRef, Resources
from dsec.spec.api import EdgeCreateSandbox, SandboxInfo, StreamChunk
from dsec.spec.results import ExecResult

GiB = 1 << 30
MiB = 1 << 20
KEY = secrets.token_hex(32)


def cfg(**kw: Any) -> EdgeConfig:
    return EdgeConfig(edge_id=kw.pop("edge_id", "e1"), cluster_key=kw.pop("cluster_key", KEY), **kw)


# ------------------------------------------------------------------ config --


def test_config_validation() -> None:
    c = cfg(state_dir="/tmp/x")
    assert c.cluster_key == bytes.fromhex(KEY) and c.runtime == "edge-e1"
    assert c.base_url == "http://127.0.0.1:7071"
    assert json.loads(c.model_dump_json())["cluster_key"] == KEY  # hex on the way out
    for bad in ("E1", "1e", "e-1", "toolongid", ""):
        with pytest.raises(ValidationError, match="edge_id"):
            cfg(edge_id=bad)
    with pytest.raises(ValidationError, match="hex"):
        cfg(cluster_key="not hex")
    with pytest.raises(ValidationError, match="16 bytes"):
        cfg(cluster_key="abcd")
    with pytest.raises(ValidationError, match="extra"):
        EdgeConfig.model_validate({"edge_id": "e1", "cluster_key": KEY, "colour": 1})
    pool = PoolConfig(image=ImageRef(base="busybox:test"), size=2)
    with pytest.raises(ValidationError, match="same name"):
        cfg(pools=[pool, pool])
    assert pool.display_name() == "busybox:test/1cpu/1024MiB/1024MiBdisk"


def test_config_from_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("DSEC_CLUSTER_KEY", KEY)
    assert EdgeConfig.from_env(edge_id="e2").cluster_key == bytes.fromhex(KEY)
    monkeypatch.delenv("DSEC_CLUSTER_KEY")
    (tmp_path / "key").write_text(KEY + "\n")
    monkeypatch.setenv("DSEC_CLUSTER_KEY_FILE", str(tmp_path / "key"))
    assert EdgeConfig.from_env(edge_id="e2").cluster_key == bytes.fromhex(KEY)


def test_budgets_derived_from_the_machine(tmp_path: Path) -> None:
    b = resolve_budgets(cfg(state_dir=tmp_path / "not" / "yet"))
    assert b.cpu > 0 and b.memory > 0 and b.disk > 0 and 16 <= b.sandboxes <= 60000
    fixed = resolve_budgets(cfg(cpu_capacity=3, memory_capacity=5, disk_capacity=7, max_sandboxes=9))
    assert fixed == Budgets(sandboxes=9, cpu=3, memory=5, disk=7)


# --------------------------------------------------------------- admission --


def res(cpu: float = 1.0, memory: int = 100 * MiB, disk: int = 10 * MiB) -> Resources:
    return Resources(cpu=cpu, memory=memory, disk=disk)


def test_admission_refusals_and_reasons() -> None:
    adm = Admission(Budgets(sandboxes=3, cpu=2.0, memory=300 * MiB, disk=100 * MiB), retry_after_s=2.5)
    assert adm.check(res()) is None
    adm.reserve("a", res())
    with pytest.raises(ExceedsCapacity) as q:  # more than the whole edge: never fits here, not a 429
        adm.check(res(cpu=3))
    assert q.value.reasons == ["cpu"] and q.value.http_status == 422  # type: ignore[attr-defined]
    assert q.value.fields["asked"]["cpu"] == 3 and q.value.fields["capacity"]["cpu"] == 2.0
    assert "cpu 3, more than edge this edge" not in str(q.value) and "it has cpu 2" in str(q.value)
    with pytest.raises(ExceedsCapacity) as q:
        adm.check_room(res(cpu=0.5), 5)  # a fork into 5: 2.5 cpu of 2
    assert q.value.reasons == ["cpu", "memory", "count"] and str(q.value).startswith("a fork into 5 sandboxes asks for cpu 2.5, memory 500 MiB, 5 sandbox slot(s)")
    with pytest.raises(Backpressure) as bp:
        adm.check(res(cpu=1.5))
    assert bp.value.reason == "cpu" and bp.value.retry_after == 2.5  # type: ignore[attr-defined]
    assert bp.value.to_wire()["cpu_committed"] == 1.0
    with pytest.raises(Backpressure) as bp:
        adm.check(res(cpu=0.5, memory=250 * MiB, disk=95 * MiB))
    assert bp.value.reasons == ["memory", "disk"]  # type: ignore[attr-defined]
    adm.reserve("b", res(cpu=0.1))
    adm.reserve("c", res(cpu=0.1))
    with pytest.raises(Backpressure) as bp:
        adm.check(res(cpu=0.1))
    assert bp.value.reason == "count"  # type: ignore[attr-defined]
    adm.release("c")
    adm.release("c")  # idempotent
    assert adm.check(res(cpu=0.1)) is None
    assert adm.real == Usage(2, pytest.approx(1.1), 200 * MiB, 20 * MiB)  # type: ignore[arg-type]


def test_pooled_capacity_yields_to_real_creates() -> None:
    adm = Admission(Budgets(sandboxes=4, cpu=4.0, memory=1000 * MiB, disk=1000 * MiB))
    for i in range(3):
        assert adm.fits_pooled(res())
        adm.reserve(f"p{i}", res(), pooled=True)
    adm.reserve("r0", res())
    assert not adm.fits_pooled(res())  # pools never overcommit
    short = adm.check(res(cpu=2.0))  # fits only without pooled sandboxes
    assert short == Usage(1, 2.0, 0, 0)
    adm.claim("p0")  # a pooled sandbox became real
    assert (adm.real.sandboxes, adm.pooled.sandboxes) == (2, 2)
    adm.resync([("x", res(), False), ("y", res(), True)])
    assert (adm.real.sandboxes, adm.pooled.sandboxes) == (1, 1) and adm.holds("y") and not adm.holds("p1")


def test_memory_medium_takes_no_disk_budget_and_the_disk_itself_is_guarded() -> None:
    free = [10 * GiB]
    adm = Admission(Budgets(sandboxes=10, cpu=10.0, memory=1000 * MiB, disk=15 * MiB),
                    store_free=lambda: free[0], disk_reserve=1 * GiB)
    adm.reserve("d", res())
    with pytest.raises(Backpressure) as bp:
        adm.check(res())  # 20 MiB of quota > 15 MiB of disk budget
    assert bp.value.reason == "disk"  # type: ignore[attr-defined]
    mem = Resources(cpu=1.0, memory=100 * MiB, disk=10 * MiB, disk_medium="memory")
    assert adm.check(mem) is None  # tmpfs pages are memory: its memory limit holds them
    adm.reserve("m", mem)
    assert adm.real.disk == 10 * MiB and adm.real.memory == 200 * MiB
    adm.release("d")
    free[0] = 900 * MiB  # the disk under the store fell below the reserve
    with pytest.raises(Backpressure) as bp:
        adm.check(res())
    assert bp.value.reason == "disk" and "reserve" in str(bp.value)  # type: ignore[attr-defined]
    assert bp.value.to_wire()["store_free"] == 900 * MiB
    assert adm.check(mem) is None  # the memory medium does not write to the disk


def test_disk_budget_keeps_a_reserve_and_may_overcommit(tmp_path: Path) -> None:
    import shutil

    free = shutil.disk_usage(tmp_path).free
    plain = resolve_budgets(cfg(state_dir=tmp_path, disk_reserve=1 * GiB))
    assert abs(plain.disk - (free - GiB)) < 256 * MiB
    over4 = resolve_budgets(cfg(state_dir=tmp_path, disk_reserve=1 * GiB, disk_overcommit=4.0))
    assert abs(over4.disk - 4 * (free - GiB)) < 1024 * MiB


def test_over() -> None:
    b = Budgets(1, 1.0, 1, 1)
    assert over(Usage(1, 1.0, 1, 1), b) == []
    assert over(Usage(2, 1.0 + 1e-12, 2, 2), b) == ["count", "memory", "disk"]


# ------------------------------------------------------------- pools, events --


def test_pool_low_watermark(monkeypatch: pytest.MonkeyPatch) -> None:
    from dsec.edge import pools

    p = pools.WarmPool(PoolConfig(image=ImageRef(base="busybox:test"), size=3))
    p.ready.extend(["a", "b", "c"])
    p.note_level()
    p.ready.pop()
    p.note_level()
    p.ready.append("d")
    p.note_level()
    assert p.low_watermark() == 0  # the pool started empty within the window
    now = time.monotonic()
    monkeypatch.setattr(pools.time, "monotonic", lambda: now + 61)
    assert p.low_watermark() == 3  # a minute later only the current level counts


def test_event_log_and_tombstones() -> None:
    log = EventLog(tombstones=2)
    log.add("s1", "created", source="cold")
    merged = log.merged("s1", [{"t": 0.0, "event": "state", "state": "running"}])
    assert [e["event"] for e in merged] == ["state", "created"]
    assert [e["origin"] for e in merged] == ["runtime", "edge"] and merged[1]["source"] == "cold"
    for sid in ("s1", "s2", "s3"):
        log.bury(Tombstone(sid, "deleted", time.time(), 0.0, []))
    assert log.tombstone("s1") is None and log.tombstone("s3") is not None


# --------------------------------------------------------------- wire shapes --


def test_error_body_is_json_safe() -> None:
    from dsec.edge.service import error_body

    result = ExecResult(exit_code=None, signal=9, stdout=b"x", stderr=b"", stdout_bytes=1, stderr_bytes=0,
                        truncated=False, duration_s=1.0, start_latency_s=0.0, timed_out="timeout")
    body = error_body(ExecTimeout("slow", sandbox_id="e1-x", result=result, odd=object()))
    text = json.dumps(body)
    assert body["error"]["result"]["timed_out"] == "timeout" and "odd" in text


def test_field_names_of_validation_errors() -> None:
    from dsec.edge.app import _field_of

    assert _field_of(("body", "spec", "resources", "cpu")) == "spec.resources.cpu"
    assert _field_of(("body", "cmd", "list[str]")) == "cmd"
    assert _field_of(("query", "path")) == "path"
    assert _field_of(("body",)) == "body"


def test_wire_models_stay_compatible() -> None:
    body = {"spec": {"image": {"base": "busybox:test"}}}
    assert EdgeCreateSandbox.model_validate(body).id is None
    info = SandboxInfo(id="e1-0", state="running", edge_id="e1", edge_url="http://x", created_at=0.0)  # type: ignore[arg-type]
    assert info.from_pool is False and info.image is None
    assert StreamChunk(kind="stdout", data_b64="").dropped_bytes is None
