"""The crun / bwrap baselines of ``dsec bench runtime``: they run, and leave nothing behind.

Functional checks with small n, not timing assertions. After every call there
must be no bench directory (so no crun state: ``crun --root`` has nothing to
list), no process mentioning it, no ``dsec-bench-*`` cgroup and no mount.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from dsec.bench import baselines
from dsec.bench.stats import percentile, summarize

CGROUP_ROOT = Path("/sys/fs/cgroup")
N = 4

needs_crun = pytest.mark.skipif(shutil.which("crun") is None, reason="needs crun")
needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bwrap")


def each_tool(fn: Any) -> Any:
    """Run a root test once for crun and once for bwrap, with the leak check."""
    for mark in (pytest.mark.parametrize("tool", ["crun", "bwrap"]), pytest.mark.usefixtures("no_leaks"),
                 needs_bwrap, needs_crun, pytest.mark.root):
        fn = mark(fn)
    return fn


# ------------------------------------------------------------ pure parts ----


def test_percentile_interpolates_like_numpy_linear() -> None:
    values = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert percentile(values, 0) == 1.0
    assert percentile(values, 50) == 3.0
    assert percentile(values, 100) == 5.0
    assert percentile(values, 25) == 2.0
    assert math.isclose(percentile([1.0, 2.0], 95), 1.95)
    assert percentile([7.0], 99) == 7.0


def test_percentile_and_summarize_reject_bad_input() -> None:
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)
    with pytest.raises(ValueError):
        summarize([])


def test_summarize_keys() -> None:
    s = summarize([1.0, 2.0, 3.0, 4.0])
    assert set(s) == {"p50", "p95", "p99", "mean", "n"}
    assert s["n"] == 4.0 and s["mean"] == 2.5 and s["p50"] == 2.5


def test_crun_config_has_all_isolation(tmp_path: Path) -> None:
    cfg = baselines.crun_config(tmp_path, ["/bin/true"])
    linux = cfg["linux"]
    kinds = {ns["type"] for ns in linux["namespaces"]}
    assert kinds == {"pid", "network", "ipc", "uts", "mount", "cgroup", "user"}
    assert linux["uidMappings"][0]["hostID"] == baselines.BENCH_HOST_UID
    assert linux["uidMappings"][0]["containerID"] == 0
    assert {"memory", "pids", "cpu"} <= set(linux["resources"])
    assert cfg["root"] == {"path": str(tmp_path), "readonly": True}
    assert cfg["process"]["noNewPrivileges"] is True
    json.dumps(cfg)  # serialisable as config.json
    no_userns = baselines.crun_config(tmp_path, ["/bin/true"], host_uid=None)
    assert "user" not in {ns["type"] for ns in no_userns["linux"]["namespaces"]}
    assert "uidMappings" not in no_userns["linux"]


def test_prepare_busybox_rootfs(tmp_path: Path) -> None:
    if shutil.which("busybox") is None and not Path("/bin/busybox").exists():
        pytest.skip("needs busybox")
    root = baselines.prepare_busybox_rootfs(tmp_path / "dsec-rootfs")
    assert os.access(root / "bin" / "busybox", os.X_OK)
    for applet in ("sh", "true", "sleep", "cat", "echo", "ls"):
        assert os.readlink(root / "bin" / applet) == "busybox"
    for d in ("proc", "dev", "sys", "tmp", "etc"):
        assert (root / d).is_dir()
    baselines.prepare_busybox_rootfs(root)  # idempotent


def test_n_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        baselines.crun_create_latency(tmp_path, 0)
    with pytest.raises(ValueError):
        baselines.bwrap_create_rate(tmp_path, -1)


# ------------------------------------------------------------- the tools ----


def _bench_cgroups() -> set[str]:
    found: set[str] = set()
    for hier in CGROUP_ROOT.iterdir():
        if hier.is_dir():
            found |= {str(p) for p in hier.glob("dsec-bench-*")}
    return found


def _bench_mounts() -> set[str]:
    with open("/proc/self/mountinfo") as f:
        return {line for line in f if "dsec-bench" in line}


def _processes_mentioning(text: str) -> dict[int, str]:
    found: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if text in cmd:
            found[int(entry)] = cmd
    return found


@pytest.fixture
def workdir() -> Iterator[Path]:
    """A world-traversable directory for the bench dirs (sandbox root is host uid 200000)."""
    path = Path(tempfile.mkdtemp(prefix="dsec-test-baselines-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def rootfs(workdir: Path) -> Path:
    return baselines.prepare_busybox_rootfs(workdir / "rootfs")


@pytest.fixture
def no_leaks(workdir: Path) -> Iterator[None]:
    cgroups_before = _bench_cgroups()
    mounts_before = _bench_mounts()
    yield
    leftovers = sorted(p.name for p in workdir.iterdir() if p.name != "rootfs")
    assert leftovers == [], f"bench dirs left (crun state lives there): {leftovers}"
    assert _processes_mentioning(str(workdir)) == {}
    assert _bench_cgroups() - cgroups_before == set()
    assert _bench_mounts() - mounts_before == set()
    assert not list((workdir / "rootfs").glob("*/dsec-bench*"))


def _sane_ms(samples: list[float], n: int) -> None:
    assert len(samples) == n
    assert all(isinstance(x, float) and 0.0 < x < 10_000.0 for x in samples), samples


def _sane_rate(r: dict[str, float], n: int) -> None:
    assert r["n"] == n
    for key in (
        "rate",
        "first_decile_rate",
        "last_decile_rate",
        "last_decile_ratio",
        "ready_p50_ms",
        "ready_p99_ms",
        "create_s",
        "teardown_rate",
        "teardown_s",
    ):
        assert math.isfinite(r[key]) and r[key] > 0, (key, r)
    assert math.isclose(r["rate"], n / r["create_s"])


@pytest.mark.root
@needs_crun
@pytest.mark.usefixtures("no_leaks")
def test_crun_create_latency(rootfs: Path, workdir: Path) -> None:
    _sane_ms(baselines.crun_create_latency(rootfs, N, workdir=workdir), N)


@pytest.mark.root
@needs_bwrap
@pytest.mark.usefixtures("no_leaks")
def test_bwrap_create_latency(rootfs: Path, workdir: Path) -> None:
    _sane_ms(baselines.bwrap_create_latency(rootfs, N, workdir=workdir), N)


@pytest.mark.root
@needs_crun
@pytest.mark.usefixtures("no_leaks")
def test_crun_exec_latency(rootfs: Path, workdir: Path) -> None:
    _sane_ms(baselines.crun_exec_latency(rootfs, N, workdir=workdir), N)


@pytest.mark.root
@needs_crun
@pytest.mark.usefixtures("no_leaks")
def test_crun_create_rate(rootfs: Path, workdir: Path) -> None:
    _sane_rate(baselines.crun_create_rate(rootfs, 5, workdir=workdir), 5)


@pytest.mark.root
@needs_bwrap
@pytest.mark.usefixtures("no_leaks")
def test_bwrap_create_rate(rootfs: Path, workdir: Path) -> None:
    _sane_rate(baselines.bwrap_create_rate(rootfs, 5, workdir=workdir), 5)


@each_tool
def test_keeper_holds_sandboxes_until_teardown(tool: str, rootfs: Path, workdir: Path) -> None:
    """Between spawn and teardown the sandboxes idle in their own mount namespaces.

    Made 3 at a time by the runner's threads: they outlive the threads' work
    (bwrap's --die-with-parent fires when the thread that started it exits).
    """
    n = 9
    with baselines.Keeper(tool, rootfs, workdir=workdir, concurrency=3) as k:
        k.spawn(n)
        time.sleep(0.2)
        pids = [k.sandbox_pid(i) for i in range(n)]
        assert len(set(pids)) == n
        host_ns = os.readlink("/proc/self/ns/mnt")
        for pid in pids:
            assert os.readlink(f"/proc/{pid}/ns/mnt") != host_ns
            assert " /proc " in Path(f"/proc/{pid}/mountinfo").read_text()
        assert len(k.done_s()) == n
        _sane_rate(k.teardown(), n)
        for pid in pids:
            assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]


@pytest.mark.root
@needs_crun
@pytest.mark.usefixtures("no_leaks")
def test_keeper_cleans_up_without_teardown(rootfs: Path, workdir: Path) -> None:
    with baselines.Keeper("crun", rootfs, workdir=workdir) as k:
        k.spawn(2)
        pid = k.sandbox_pid(1)
    assert not Path(f"/proc/{pid}").exists()


@pytest.mark.root
@needs_crun
@needs_bwrap
@pytest.mark.usefixtures("no_leaks")
def test_rootfs_under_private_dir_and_host_root_variant(workdir: Path) -> None:
    """A rootfs in a 0700 directory works (the runners bind it into their own namespace)."""
    private = workdir / "private"
    private.mkdir(mode=0o700)
    root = baselines.prepare_busybox_rootfs(private / "rootfs")
    _sane_ms(baselines.bwrap_create_latency(root, 2, workdir=workdir), 2)
    _sane_ms(baselines.crun_create_latency(root, 2, workdir=workdir), 2)
    _sane_ms(baselines.bwrap_create_latency(root, 2, host_uid=None, workdir=workdir), 2)
    _sane_ms(baselines.crun_create_latency(root, 2, host_uid=None, workdir=workdir), 2)
    shutil.rmtree(private)


@pytest.mark.root
@needs_crun
@pytest.mark.usefixtures("no_leaks")
def test_failure_is_reported_and_cleaned_up(workdir: Path) -> None:
    """A rootfs without /bin/sh: the tool fails, the error says so, nothing is left."""
    empty = workdir / "rootfs"
    empty.mkdir(mode=0o755)
    calls: list[Callable[[], Any]] = [
        lambda: baselines.crun_create_rate(empty, 3, workdir=workdir),
        lambda: baselines.crun_create_latency(empty, 2, workdir=workdir),
    ]
    if shutil.which("bwrap"):
        calls.append(lambda: baselines.bwrap_create_rate(empty, 3, workdir=workdir))
    for call in calls:
        with pytest.raises(baselines.BaselineError):
            call()


@pytest.mark.root
@needs_crun
@pytest.mark.usefixtures("no_leaks")
@pytest.mark.parametrize("tool", ["crun", "bwrap"])
def test_concurrent_failure_carries_its_own_stderr(tool: str, workdir: Path) -> None:
    """Several sandboxes failing at once: the error names one and holds that tool's stderr."""
    if shutil.which(tool) is None:
        pytest.skip(f"needs {tool}")
    empty = workdir / "rootfs"
    empty.mkdir(mode=0o755)
    rate = baselines.crun_create_rate if tool == "crun" else baselines.bwrap_create_rate
    with pytest.raises(baselines.BaselineError) as info:
        rate(empty, 8, workdir=workdir, concurrency=4)
    assert "dsec-bench-" in str(info.value)
    assert info.value.detail.strip(), str(info.value)


@each_tool
def test_ctrl_c_during_a_concurrent_spawn_leaves_nothing(tool: str, rootfs: Path, workdir: Path) -> None:
    """^C while 8 are in flight: those finish, then every sandbox made so far is removed."""
    timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT))
    with (
        pytest.raises(KeyboardInterrupt),
        baselines.Keeper(tool, rootfs, workdir=workdir, concurrency=8) as k,
    ):
        timer.start()
        try:
            k.spawn(5_000)
        finally:
            timer.cancel()


@pytest.mark.root
@needs_crun
@needs_bwrap
def test_untraversable_workdir_is_refused(rootfs: Path, workdir: Path) -> None:
    private = workdir / "private"
    private.mkdir(mode=0o700)
    with pytest.raises(baselines.BaselineError, match="not reachable"):
        baselines.bwrap_create_latency(rootfs, 1, workdir=private)
    assert list(private.iterdir()) == []
