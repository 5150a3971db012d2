"""Lifecycle: create/destroy, shared read-only layers, crash safety, typed errors for bad input.

The crash test does what docs/RUNTIME.md promises: a runtime process is
SIGKILLed in the middle of a burst of creates, a new one starts with the same
name and directories, re-adopts what survived, removes what was half made, and
after it closes nothing of either is left on the host.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pydantic
import pytest

from conftest import (
    CGROUP_ROOT,
    CONTROLLERS,
    MiB,
    RuntimeHarness,
    mountinfo_lines,
    pid_alive,
    proc_cmdline,
    proc_comm,
    proc_status,
    wait_until,
)
from dsec.errors import (
    DsecError,
    ExecError,
    ImageError,
    InvalidSpec,
    LayerInUse,
    LayerNotFound,
    SandboxFailed,
    SandboxNotFound,
    SandboxStateError,
)
from dsec.spec import ImageRef, Resources, SandboxSpec, SandboxState

pytestmark = pytest.mark.root

SRC = Path(__file__).resolve().parents[2] / "src"


def _children(h: RuntimeHarness) -> set[str]:
    """Sandbox cgroup dirs of this runtime, in any controller."""
    out: set[str] = set()
    for c in CONTROLLERS:
        d = CGROUP_ROOT / c / "dsec" / h.name
        if d.is_dir():
            out |= {e.name for e in d.iterdir() if e.is_dir()}
    return out


def _snapshot(h: RuntimeHarness) -> dict[str, object]:
    return {
        "cgroups": _children(h),
        "records": {p.name for p in h.records()},
        "slots": {p.name for p in h.slot_files()},
        "mounts": sorted(ln.split(" ", 2)[2] for ln in mountinfo_lines()),
        "sandboxes": set(h.rt.sandboxes),
        "inits": set(h.inits()),
    }


def _erofs_mounts_of(h: RuntimeHarness, digest: str) -> list[str]:
    """This runtime's host mounts of the layer (other runtimes on the node mount their own)."""
    mp = str(h.run_dir / h.name / "layers" / digest.split(":", 1)[1])
    return [ln for ln in mountinfo_lines() if ln.split()[4] == mp and " - erofs " in ln]


# ----------------------------------------------------- create and destroy ----


def test_create_and_destroy_are_idempotent_and_complete(rtx: RuntimeHarness) -> None:
    rec = rtx.create(sandbox_id="life-idem")
    again = rtx.create(sandbox_id="life-idem")
    assert again is rec and rec.state is SandboxState.RUNNING
    assert [e["state"] for e in rec.events if e["event"] == "state"] == ["running"]
    assert len(rtx.cgroup_dirs(rec.id)) == len(CONTROLLERS)
    assert any(p.name == f"{rec.id}.json" for p in rtx.records())
    assert len([p for p in rtx.slot_files() if rec.id in p.read_text()]) == 1
    rtx.ok(rec.id, "sleep 999 >/dev/null 2>&1 & sleep 998 >/dev/null 2>&1 &")
    rtx.ok(rec.id, "sleep 997 >/dev/null 2>&1 &", user=1000)
    procs = rtx.pids(rec.id)
    assert len(procs) == 4, procs

    assert rtx.destroy(rec.id) is True
    assert rtx.destroy(rec.id) is False
    assert rtx.cgroup_dirs(rec.id) == []
    assert not any(p.name == f"{rec.id}.json" for p in rtx.records())
    assert not [p for p in rtx.slot_files() if rec.id in p.read_text()]
    assert wait_until(lambda: not any(pid_alive(p) for p in procs), timeout=3)
    with pytest.raises(SandboxNotFound):
        rtx.sh(rec.id, "true")
    with pytest.raises(SandboxNotFound):
        rtx.rt.files(rec.id)
    with pytest.raises(SandboxNotFound):
        rtx.rt.stats(rec.id)
    # The same id can be used again afterwards, for a fresh sandbox.
    rec2 = rtx.create(sandbox_id="life-idem")
    assert rec2 is not rec and rec2.init_pid != rec.init_pid
    assert rtx.sh(rec2.id, "pidof sleep").exit_code == 1
    assert rtx.destroy(rec2.id)


def test_destroyed_sandbox_ends_stopped(rtx: RuntimeHarness) -> None:
    rec = rtx.create()
    rtx.destroy(rec.id)
    assert rec.state is SandboxState.STOPPED
    assert [e["state"] for e in rec.events if e["event"] == "state"][-2:] == ["stopping", "stopped"]


def test_concurrent_create_and_destroy(rtx: RuntimeHarness) -> None:
    async def burst() -> list:
        return await asyncio.gather(*(rtx.rt.create(rtx.spec(memory=64 * MiB)) for _ in range(12)))

    recs = rtx.run(burst())
    ids = [r.id for r in recs]
    assert len(set(ids)) == 12 and len({r.uid_base for r in recs}) == 12
    results = rtx.run(asyncio.gather(*(rtx.rt.exec(i, "hostname") for i in ids)))
    assert [r.stdout.decode().strip() for r in results] == ids
    assert rtx.run(asyncio.gather(*(rtx.rt.destroy(i) for i in ids))) == [True] * 12
    assert not (_children(rtx) & set(ids))


def test_destroy_during_exec_ends_the_exec(rtx: RuntimeHarness) -> None:
    rec = rtx.create()

    async def race() -> object:
        ex = asyncio.ensure_future(rtx.rt.exec(rec.id, "sleep 100", timeout=60))
        await asyncio.sleep(0.3)
        assert await rtx.rt.destroy(rec.id)
        try:
            return await asyncio.wait_for(ex, 10)
        except DsecError as exc:
            return exc

    t0 = time.monotonic()
    out = rtx.run(race())
    assert time.monotonic() - t0 < 8
    assert isinstance(out, DsecError) or out.signal == signal.SIGKILL, out
    assert rtx.cgroup_dirs(rec.id) == []


def test_init_killed_from_the_host_fails_the_sandbox_cleanly(rtx: RuntimeHarness) -> None:
    rec = rtx.create()
    os.kill(rec.init_pid, signal.SIGKILL)
    assert wait_until(lambda: not pid_alive(rec.init_pid), timeout=3)
    with pytest.raises(SandboxFailed):
        rtx.sh(rec.id, "true")
    assert rec.state is SandboxState.FAILED and rec.reason
    with pytest.raises(SandboxStateError):
        rtx.sh(rec.id, "true")
    assert rtx.destroy(rec.id) is True
    assert rtx.cgroup_dirs(rec.id) == [] and not any(rec.id in p.name for p in rtx.records())
    # The init is the runtime's child (the spawner clones it with CLONE_PARENT): reaped, no zombie.
    assert not os.path.exists(f"/proc/{rec.init_pid}")


def test_inits_are_the_runtimes_children_and_are_reaped(rtx: RuntimeHarness) -> None:
    """Sandbox inits are not the spawner's children (its wait4(-1) per exec exit would walk
    every one of them): they are the runtime's, reaped on destroy, and never left as zombies."""
    recs = [rtx.create() for _ in range(5)]
    for rec in recs:
        assert proc_status(rec.init_pid)["PPid"] == str(os.getpid())
        rtx.ok(rec.id, "true")
    inits = {rec.init_pid: _start_time(rec.init_pid) for rec in recs}
    for rec in recs:
        rtx.destroy(rec.id)
    # Only these inits are the claim: any other child of this pytest process (a helper another
    # test started) is not the runtime's to reap.
    left = {pid: _describe(pid) for pid, start in inits.items() if _start_time(pid) == start}
    assert left == {}, f"inits still in the process table after destroy: {left}"


def _start_time(pid: int) -> int | None:
    try:
        data = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    return int(data[data.rindex(b")") + 2 :].split()[19])


def _describe(pid: int) -> str:
    try:
        st = proc_status(pid)
    except OSError:
        return "gone"
    return f"{st.get('Name')} state={st.get('State')} ppid={st.get('PPid')}"


def test_lost_spawner_is_replaced_and_sandboxes_survive(rtx: RuntimeHarness) -> None:
    rec = rtx.create()
    rtx.ok(rec.id, "echo before > /tmp/state")
    spawner = rtx.rt.spawner.pid
    os.kill(spawner, signal.SIGKILL)
    assert wait_until(lambda: not pid_alive(spawner), timeout=3)
    assert pid_alive(rec.init_pid)

    def exec_works() -> bool:
        try:
            return rtx.ok(rec.id, "cat /tmp/state") == "before\n"
        except DsecError:
            return False

    assert wait_until(exec_works, timeout=5)
    assert rtx.rt.spawner.pid != spawner
    other = rtx.create()
    assert rtx.ok(other.id, "echo new").strip() == "new"
    assert rtx.destroy(rec.id) and rtx.destroy(other.id)


# ------------------------------------------------------------------ layers ----


def test_layers_are_shared_and_unchanged_by_use(rtx: RuntimeHarness) -> None:
    digest = rtx.layer.digest
    blob = Path(rtx.rt.store.blob_path(digest))
    assert hashlib.sha256(blob.read_bytes()).hexdigest() == digest.split(":", 1)[1]
    mtime = blob.stat().st_mtime_ns
    with rtx.sandbox() as a, rtx.sandbox() as b:
        mounts = _erofs_mounts_of(rtx, digest)
        assert len(mounts) == 1, mounts  # one node-wide mount, shared
        assert " ro," in mounts[0] or " ro " in mounts[0]
        from_blob = [ln for ln in mountinfo_lines() if ln.split(" - ", 1)[-1].split()[1:2] == [str(blob)]]
        assert len(from_blob) == 1, from_blob  # the layer file is mounted once, whatever the mount point
        # No per-sandbox overlay, tmpfs or erofs mount shows on the host.
        assert not [ln for ln in mountinfo_lines() if a.id in ln or b.id in ln]
        # Whiteouts and copy-ups in a...
        rtx.ok(a.id, "rm /bin/ls && echo 'evil:x:0:0::/:/bin/sh' >> /etc/passwd && rm -rf /usr && chmod 777 /etc")
        assert rtx.sh(a.id, "test -e /bin/ls").exit_code == 1
        assert "evil" in rtx.ok(a.id, "cat /etc/passwd")
        # ...are invisible to b, which shares the layer...
        assert rtx.sh(b.id, "test -L /bin/ls && test -d /usr").exit_code == 0
        assert "evil" not in rtx.ok(b.id, "cat /etc/passwd")
        assert rtx.ok(b.id, "stat -c %a /etc").strip() == "755"
    # ...and leave the layer as it was: same bytes, same mount content, fresh sandboxes clean.
    assert hashlib.sha256(blob.read_bytes()).hexdigest() == digest.split(":", 1)[1]
    assert blob.stat().st_mtime_ns == mtime
    mp = rtx.run_dir / rtx.name / "layers" / digest.split(":", 1)[1]
    if mp.is_dir() and _erofs_mounts_of(rtx, digest):
        assert (mp / "bin/ls").is_symlink() and "evil" not in (mp / "etc/passwd").read_text()
    with rtx.sandbox() as c:
        assert rtx.sh(c.id, "test -L /bin/ls && ls / >/dev/null").exit_code == 0
        assert "evil" not in rtx.ok(c.id, "cat /etc/passwd")


def test_layer_in_use_cannot_be_removed(rtx: RuntimeHarness, sb) -> None:
    with pytest.raises(LayerInUse):
        rtx.rt.store.remove(rtx.layer.digest)
    with pytest.raises(LayerInUse):
        rtx.rt.store.remove("busybox:test")
    assert rtx.rt.store.resolve("busybox:test").digest == rtx.layer.digest
    assert rtx.ok(sb.id, "echo ok").strip() == "ok"


def test_host_mount_table_does_not_grow_with_sandboxes(rtx: RuntimeHarness, sb) -> None:
    before = mountinfo_lines()

    async def burst() -> list:
        return await asyncio.gather(*(rtx.rt.create(rtx.spec(memory=32 * MiB)) for _ in range(20)))

    recs = rtx.run(burst())
    try:
        assert len(mountinfo_lines()) == len(before), set(mountinfo_lines()) ^ set(before)
        assert all(rtx.ok(r.id, "cat /proc/self/mountinfo").count("\n") >= 5 for r in recs[:3])
    finally:
        rtx.run(asyncio.gather(*(rtx.rt.destroy(r.id) for r in recs)))
    assert len(mountinfo_lines()) == len(before)


# ---------------------------------------------------------------- bad input ----


def test_bad_input_gives_typed_errors_and_leaves_nothing(rtx: RuntimeHarness, sb, tmp_path: Path) -> None:
    before = _snapshot(rtx)
    # Unknown layers.
    for ref in ("nosuchlayer:latest", "busybox:nosuchtag", "sha256:" + "0" * 64):
        with pytest.raises(LayerNotFound) as ei:
            rtx.run(rtx.rt.create(rtx.spec(base=ref)))
        assert ref.split(":")[0] in str(ei.value) or "0000" in str(ei.value)
        assert isinstance(ei.value, LookupError)
    with pytest.raises(LayerNotFound):
        rtx.run(rtx.rt.create(SandboxSpec(image=ImageRef(base="busybox:test", toolkits=("nosuchtool:1",)))))
    # Bad sandbox ids.
    for bad in ("../x", "UPPER", "", "a" * 64, "x/y"):
        with pytest.raises(InvalidSpec) as ei2:
            rtx.run(rtx.rt.create(rtx.spec(), sandbox_id=bad or "-bad"))
        assert ei2.value.field == "sandbox_id"
    # A layer whose file went missing: a typed image error, nothing half made.
    from dsec.images import build_from_dir

    (tmp_path / "tree").mkdir()
    (tmp_path / "tree" / "file").write_text("x")
    broken = build_from_dir(rtx.rt.store, tmp_path / "tree", name="broken", tag="t")
    Path(rtx.rt.store.blob_path(broken.digest)).unlink()
    with pytest.raises(ImageError):
        rtx.run(rtx.rt.create(rtx.spec(base="broken:t")))
    rtx.rt.store.remove(broken.digest)
    # Exec-level mistakes.
    with pytest.raises(ExecError):
        rtx.sh(sb.id, ["definitely-not-a-binary"])
    with pytest.raises(ExecError):
        rtx.sh(sb.id, "true", cwd="/no/such/dir")
    with pytest.raises(InvalidSpec):
        rtx.sh(sb.id, "true", user="nobody")
    # Nothing of any of that is left.
    assert wait_until(lambda: _snapshot(rtx) == before, timeout=3), (before, _snapshot(rtx))
    assert rtx.pids(sb.id) == [sb.init_pid]


BAD_RESOURCES: list[dict[str, object]] = [
    {"memory": 1},
    {"memory": -5},
    {"memory": "lots"},
    {"cpu": 0},
    {"cpu": -1},
    {"cpu": 10_000},
    {"pids": 0},
    {"pids": 3},
    {"disk": 0},
    {"nofile": 1},
    {"cpu_weight": 0},
    {"gpus": 1},  # unknown field: a typo must not pass silently
]


@pytest.mark.parametrize("bad", BAD_RESOURCES, ids=lambda d: "-".join(f"{k}={v}" for k, v in d.items()))
def test_bad_limits_are_refused_at_construction(bad: dict[str, object]) -> None:
    with pytest.raises((pydantic.ValidationError, InvalidSpec)) as ei:
        Resources(**bad)  # type: ignore[arg-type]
    assert next(iter(bad)) in str(ei.value)
    with pytest.raises((pydantic.ValidationError, InvalidSpec)):
        SandboxSpec.model_validate({"image": {"base": "busybox"}, "resources": bad})


@pytest.mark.parametrize("ref", ["UPPER", "../etc", "a b", "", "-lead", "name:", "name:" + "t" * 200])
def test_bad_layer_refs_are_refused_at_construction(ref: str) -> None:
    with pytest.raises(pydantic.ValidationError):
        ImageRef(base=ref)


def test_bad_spec_fields_are_refused() -> None:
    with pytest.raises(pydantic.ValidationError):
        SandboxSpec(image=ImageRef(base="busybox"), env={"A=B": "x"})
    with pytest.raises(pydantic.ValidationError):
        SandboxSpec(image=ImageRef(base="busybox"), output_cap=10)
    with pytest.raises(pydantic.ValidationError):
        SandboxSpec.model_validate({"image": {"base": "busybox"}, "imgae": {}})
    with pytest.raises(pydantic.ValidationError):
        ImageRef(base="busybox", toolkits=tuple(f"t{i}" for i in range(9)))


# --------------------------------------------------- restart and reconcile ----


def test_close_without_destroy_then_restart_adopts(make_runtime: Callable[[str], RuntimeHarness]) -> None:
    h = make_runtime("adopt").start()
    rec = h.create()
    h.ok(rec.id, "echo kept > /tmp/kept; sleep 777 >/dev/null 2>&1 &")
    init = rec.init_pid
    h.close(destroy_all=False)
    assert pid_alive(init)
    h2 = make_runtime("adopt").start()
    try:
        assert h2.rt.reconciled == {"adopted": [rec.id], "destroyed": []}
        assert h2.rt.get(rec.id).init_pid == init
        assert h2.ok(rec.id, "cat /tmp/kept; ps -o args | grep -q '^[s]leep 777' && echo sleeping").split() == ["kept", "sleeping"]
        assert h2.rt.files(rec.id).read("/tmp/kept") == b"kept\n"
    finally:
        h2.close()
    assert h2.leftovers() == []
    assert not pid_alive(init)


CRASH_SCRIPT = r"""
import asyncio, sys
from dsec.backends.container.runtime import ContainerRuntime
from dsec.spec import ImageRef, Resources, SandboxSpec

name, state_dir, run_dir = sys.argv[1:4]

async def main():
    rt = ContainerRuntime(name=name, state_dir=state_dir, run_dir=run_dir)
    await rt.start()
    spec = SandboxSpec(image=ImageRef(base="busybox:test"), resources=Resources(memory=64 << 20))

    async def one():
        rec = await rt.create(spec)
        print("created", rec.id, rec.init_pid, flush=True)

    await asyncio.gather(*(one() for _ in range(6)))
    for rec in list(rt.sandboxes.values()):
        await rt.exec(rec.id, "echo survived > /tmp/mark; sleep 1000 >/dev/null 2>&1 &")
    print("spawner", rt.spawner.pid, flush=True)
    print("READY", flush=True)
    await asyncio.gather(*(one() for _ in range(30)))
    print("BURST-DONE", flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


class _Lines:
    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc = proc
        self.lines: list[str] = []
        self._buf = b""

    def until(self, pred: Callable[[list[str]], bool], timeout: float) -> bool:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while not pred(self.lines):
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                return pred(self.lines)
            self._buf += chunk
            *done, self._buf = self._buf.split(b"\n")
            self.lines += [d.decode() for d in done]
        return True


def test_sigkill_mid_burst_then_reconcile_leaves_nothing(make_runtime: Callable[[str], RuntimeHarness]) -> None:
    h = make_runtime("crash").prepare()
    def our_mounts() -> set[str]:
        return {ln.split(" ", 2)[2] for ln in mountinfo_lines() if str(h.run_dir) in ln or str(h.state_dir) in ln}

    mounts_before = our_mounts()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(
        [sys.executable, "-c", CRASH_SCRIPT, h.name, str(h.state_dir), str(h.run_dir)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
    )
    out = _Lines(proc)
    try:
        assert out.until(lambda ls: "READY" in ls, timeout=60), (out.lines, proc.poll())
        # Kill it once a few of the burst have finished: the rest are in flight.
        assert out.until(lambda ls: len([ln for ln in ls if ln.startswith("created")]) >= 8, timeout=30), out.lines
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out.until(lambda ls: False, timeout=0.2)  # drain what it printed before dying
    assert "BURST-DONE" not in out.lines, "the burst finished before the kill: nothing was in flight"
    created = {ln.split()[1]: int(ln.split()[2]) for ln in out.lines if ln.startswith("created")}
    first_six = list(created)[:6]
    spawner = int(next(ln.split()[1] for ln in out.lines if ln.startswith("spawner")))
    # The old spawner notices its runtime is gone and exits; sandboxes do not depend on it.
    assert wait_until(lambda: not pid_alive(spawner) or proc_comm(spawner) != "dsec-spawner", timeout=5)
    assert all(pid_alive(p) for p in created.values())
    leftover_cgroups = _children(h)
    assert set(created) <= leftover_cgroups

    h.start()
    try:
        rec = h.rt.reconciled
        adopted, destroyed = set(rec["adopted"]), set(rec["destroyed"])
        print(f"created={len(created)} adopted={len(adopted)} destroyed={len(destroyed)} cgroups-at-kill={len(leftover_cgroups)}")
        assert not adopted & destroyed
        assert set(created) <= adopted, "a sandbox reported created was not re-adopted"
        assert adopted | destroyed == leftover_cgroups
        assert _children(h) == adopted
        assert {p.name.removesuffix(".json") for p in h.records()} == adopted
        assert len(h.slot_files()) == len(adopted)
        assert set(h.inits()) == {h.rt.get(s).init_pid for s in adopted}
        # Adopted sandboxes work, with their state and processes intact.
        for sid in first_six:
            assert h.ok(sid, "cat /tmp/mark; ps -o args | grep -q '^[s]leep 1000' && echo bg").split() == ["survived", "bg"]
        for sid in adopted:
            assert h.ok(sid, "hostname").strip() == sid
        # New sandboxes can be made next to them.
        fresh = h.create()
        assert h.ok(fresh.id, "echo fresh").strip() == "fresh"
    finally:
        h.close()
    assert h.leftovers() == [], h.leftovers()
    assert not any(pid_alive(p) for p in created.values())
    assert our_mounts() <= mounts_before
    stray = [p for p in map(int, filter(str.isdigit, os.listdir("/proc")))
             if proc_comm(p) in ("dsec-init", "dsec-spawner") and h.name in " ".join(proc_cmdline(p))]
    assert stray == []
    with contextlib.suppress(FileNotFoundError):
        assert not [f for f in (h.run_dir / h.name / "stage").iterdir()]
