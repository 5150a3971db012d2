"""The FnCall red-team suite (issue 22): each case attacks a real FnCallPool's worker through its
calls while neighbour calls run on the same worker, and must be contained with the worker whole.

The cases live in :mod:`dsec.bench.abuse_fncall` (``dsec bench abuse`` runs the same ones). One
pool for the module (the Debian bookworm python3+numpy layer of tests/integration/test_fncall.py,
numpy preloaded, 4 calls in flight, 2 spare, a small disk so that the disk cases reach its quota);
an edge with the fncall backend on the same layer for the cases that use the routes. Heavy cases
are ``slow``; a case that is a known, tracked bug is ``xfail(strict=True)`` with the reason.
"""

from __future__ import annotations

import ast
import os
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import RuntimeHarness, edge_config, running_edge
from dsec.backends.fncall.config import FnCallConfig, FnCallImage
from dsec.backends.fncall.pool import LABEL, FnCallPool
from dsec.bench import fncall as bench
from dsec.bench.abuse_cases import CASES, Check, Outcome
from dsec.bench.abuse_fncall import (
    FNCALL_CASES,
    SRC,
    FnCase,
    FnEdge,
    fncall_outcomes_json,
    run_fncall_case,
    suite_config,
)
from dsec.spec import ImageRef

CACHE = Path(os.environ.get("DSEC_STATE_DIR", "/var/lib/dsec")) / "cache"
IMAGE = ImageRef(base="pyfn:test")


def _fncall_config() -> FnCallConfig:
    cfg: FnCallConfig = suite_config(IMAGE)
    (img,) = cfg.images
    assert isinstance(img, FnCallImage) and img.concurrency == 4 and img.spare == 2
    return cfg


def _have_layer() -> bool:
    have_cache = (CACHE / ("debian-bookworm-" + "-".join(sorted(bench.PACKAGES))) / ".dsec-complete").exists()
    return have_cache or shutil.which("debootstrap") is not None


@pytest.fixture(scope="module")
def py_image(rtx: RuntimeHarness) -> ImageRef:
    if not _have_layer():
        pytest.skip("needs debootstrap (or a cached Debian python3-numpy rootfs) for a python layer")
    bench.python_layer(rtx.rt.store, CACHE, name="pyfn", tag="test")
    return IMAGE


@pytest.fixture(scope="module")
def pool(rtx: RuntimeHarness, py_image: ImageRef) -> Iterator[FnCallPool]:
    p = FnCallPool(_fncall_config(), rtx.rt, name="tabuse")
    rtx.run(p.start(), timeout=300)
    assert all(w.ready for w in p.workers()), [w.reason for w in p.workers()]
    try:
        yield p
    finally:
        rtx.run(p.close())
    assert not [s for s in rtx.rt.sandboxes.values() if s.spec.labels.get(LABEL)], "worker sandboxes left"


@pytest.fixture(scope="module")
def fn_edge(dsec_base: Path) -> Iterator[FnEdge]:
    """An edge running the container and fncall backends on the same layer (its own pool)."""
    if not _have_layer():
        pytest.skip("needs debootstrap (or a cached Debian python3-numpy rootfs) for a python layer")
    from dsec.backends.container.config import ContainerConfig
    from dsec.images.store import LocalLayerStore

    cfg = edge_config(dsec_base, "fnab", "fnab", secrets.token_bytes(32), backends=[ContainerConfig(), _fncall_config()])
    store = LocalLayerStore(Path(cfg.state_dir) / "layers")
    try:
        bench.python_layer(store, CACHE, name="pyfn", tag="test")
    finally:
        store.close()
    with running_edge(cfg) as e:
        yield FnEdge(e.url, e.admin_token())


def _param(c: FnCase) -> Any:
    marks: list[Any] = []
    if c.heavy:
        marks.append(pytest.mark.slow)
    if c.known_bug:
        marks.append(pytest.mark.xfail(strict=True, reason=c.known_bug))
    return pytest.param(c, id=c.name, marks=marks)


@pytest.mark.root
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("case", [_param(c) for c in FNCALL_CASES])
def test_fncall_case_is_contained(rtx: RuntimeHarness, pool: FnCallPool, request: pytest.FixtureRequest,
                                  case: FnCase) -> None:
    edge = request.getfixturevalue("fn_edge") if case.needs_edge or case.uses_edge else None
    out = rtx.run(run_fncall_case(pool, IMAGE, case, edge=edge, quick=True), timeout=900)
    print(out.report())
    if out.skipped:
        pytest.skip(out.skipped)
    # Every case checks something that can fail, and the worker checks always run.
    assert len(out.checks) >= 5, out.report()
    assert out.contained, out.report()
    # A case that shows a documented channel reports what it saw of it; no other case notes anything.
    assert bool(out.notes) == bool(case.documented), out.report()


def test_every_case_is_described_and_its_sources_compile() -> None:
    names = [c.name for c in FNCALL_CASES]
    assert len(set(names)) == len(names), "duplicate case names"
    for c in FNCALL_CASES:
        assert c.attack and c.asserts and c.defence, c.name
    for name, src in SRC.items():
        ast.parse(src, f"<{name}>")  # each runs in the worker's python3 (bookworm: 3.11)


def test_the_issue_s_findings_each_have_a_case() -> None:
    """Issue 22's findings, one case or more each."""
    required = {"zombie_leader_threads", "sigstop_sweep_helper", "forged_result_frames", "disk_quota_fill",
                "inode_exhaustion", "deep_tree_1000", "deep_tree_5000", "many_files_left", "scratch_link_games",
                "memory_beyond_limit", "exception_message_large", "lost_worker_messages", "listeners_left_behind",
                "tcp_time_wait", "concurrent_proc_peek", "signal_concurrent_calls", "attack_the_machinery",
                "ipc_and_keyrings", "write_outside_scratch", "globals_and_environment", "limits_and_priority",
                "setuid_attempts", "process_tricks", "fork_bomb", "cpu_spin_past_timeout", "fd_exhaustion",
                "result_pipe_games", "stdout_after_result", "awkward_values", "cleaner_climbs_out",
                "memory_charge_outlives_call", "output_amplification", "net_counters_across_time"}
    assert required <= {c.name for c in FNCALL_CASES}, required - {c.name for c in FNCALL_CASES}


def test_the_flat_json_prefixes_every_key_and_meets_no_container_key() -> None:
    outs = [Outcome(c.name, [Check("x", i % 2 == 0)], neighbour_p50_ms=2.0, neighbour_execs=30)
            for i, c in enumerate(FNCALL_CASES)]
    flat = fncall_outcomes_json(outs, 1.0)
    assert flat["fncall_cases_total"] == len(FNCALL_CASES)
    assert flat["case_fncall_fork_bomb"] in (True, False) and "case_fork_bomb" not in flat
    container_keys = {f"case_{c.name}" for c in CASES} | {"cases_total", "cases_contained", "cases_not_contained"}
    assert not container_keys & set(flat)
    assert all(k.startswith(("fncall_", "case_fncall_", "neighbour_ratio_fncall_", "neighbour_samples_fncall_"))
               for k in flat), sorted(flat)
