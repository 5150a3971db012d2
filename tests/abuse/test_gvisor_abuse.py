"""The gVisor red team (issue 22): each case attacks one gVisor sandbox while a neighbour
gVisor sandbox runs a steady exec workload, and must be contained with the host healthy.

The cases live in :mod:`dsec.bench.abuse_gvisor` (``dsec bench abuse`` runs the same ones and
records the neighbours' exec latency; here only containment is asserted, never timing).
Heavy cases (races that spin, the fork bomb, the memory hog) are ``slow``. The module skips,
saying why, without runsc. At the end the backend must have left nothing on the host.
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import RT_PREFIX
from dsec.bench.abuse_cases import Check, Outcome, outcomes_json
from dsec.bench.abuse_gvisor import (
    GVISOR_CASES,
    GVisorCase,
    GVisorLab,
    build_gvabuse,
    gvisor_outcomes_json,
    run_gvisor_case_under_load,
)

needs_runsc = pytest.mark.skipif(shutil.which("runsc") is None,
                                 reason="runsc is not installed (scripts/setup.sh installs it from bookworm-backports)")
K_NEIGHBOURS = 1


def _param(c: GVisorCase) -> Any:
    return pytest.param(c, id=c.name, marks=[pytest.mark.slow] if c.heavy else [])


class _Lab:
    """A started GVisorBackend and its lab, with their own event loop, driven from sync tests."""

    def __init__(self, base: Path, seed: Path) -> None:
        from dsec.backends.gvisor.backend import GVisorBackend
        from dsec.backends.gvisor.config import GVisorConfig
        from dsec.images import LocalLayerStore

        self.name = f"{RT_PREFIX}-gvab"
        store = LocalLayerStore(base / f"state-{self.name}" / "layers")
        store.add_erofs(seed, name="busybox", tag="test", kind="base")
        self.runner = asyncio.Runner()
        self.backend = GVisorBackend(GVisorConfig(), name=self.name, state_dir=base / f"state-{self.name}",
                                     run_dir=base / "run", id_prefix="ga", store=store)
        self.lab = GVisorLab(self.backend, "busybox:test", base / "gvabuse-lab",
                             helper=build_gvabuse(base / "gvabuse"), quick=True)

    def run(self, coro: Any, timeout: float = 600.0) -> Any:
        return self.runner.run(asyncio.wait_for(coro, timeout))

    def leftovers(self) -> list[str]:
        left = [f"cgroup {p}" for p in Path("/sys/fs/cgroup").glob(f"*/dsec/{self.name}")]
        left += [f"record {p}" for p in self.backend.records_dir.glob("*.json")]
        left += [f"run dir {self.backend.run_dir}"] if self.backend.run_dir.exists() else []
        return left


@pytest.fixture(scope="module")
def gvlab(dsec_base: Path, busybox_seed: Path) -> Iterator[_Lab]:
    h = _Lab(dsec_base, busybox_seed)
    h.run(h.backend.start())
    try:
        h.run(h.lab.setup(K_NEIGHBOURS))
        try:
            yield h
        finally:
            h.run(h.lab.close())
    finally:
        h.run(h.backend.close())
        h.runner.close()
    left = h.leftovers()
    assert not left, f"gvisor abuse backend left: {left}"


@pytest.mark.root
@needs_runsc
@pytest.mark.parametrize("case", [_param(c) for c in GVISOR_CASES])
def test_gvisor_abuse_case_is_contained(gvlab: _Lab, case: GVisorCase) -> None:
    out = gvlab.run(run_gvisor_case_under_load(gvlab.lab, case))
    print(out.report())
    if out.skipped:
        pytest.skip(out.skipped)
    # Every case checks something that can fail, and the host checks always run.
    assert len(out.checks) >= 5, out.report()
    assert out.contained, out.report()


def test_every_gvisor_case_is_documented() -> None:
    """docs/GVISOR.md's red-team table names every case (and nothing else), each with its parts."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "GVISOR.md").read_text()
    section = doc.split("## Red team", 1)[1].split("\n## ", 1)[0] if "## Red team" in doc else ""
    missing = [c.name for c in GVISOR_CASES if f"`{c.name}`" not in section]
    assert not missing, f"cases missing from docs/GVISOR.md's red-team table: {missing}"
    assert len({c.name for c in GVISOR_CASES}) == len(GVISOR_CASES), "duplicate case names"
    for c in GVISOR_CASES:
        assert c.name.startswith("gvisor_") and c.attack and c.asserts and c.defence, c.name


def test_gvisor_outcomes_sit_beside_the_containers() -> None:
    """The flat JSON keys of the gVisor cases never collide with the container suite's."""
    outs = [Outcome("gvisor_a", [Check("x", True)], neighbour_p50_ms=80.0, neighbour_execs=30),
            Outcome("gvisor_b", [Check("x", False, "why")], neighbour_p50_ms=40.0, neighbour_execs=30),
            Outcome("gvisor_c", [], skipped="no helper")]
    flat = gvisor_outcomes_json(outs, 40.0)
    assert flat["case_gvisor_a"] is True and flat["case_gvisor_b"] is False and flat["case_gvisor_c"] is None
    assert flat["neighbour_ratio_gvisor_a"] == 2.0 and flat["neighbour_samples_gvisor_b"] == 30
    assert flat["gvisor_cases_total"] == 2 and flat["gvisor_cases_contained"] == 1
    assert flat["gvisor_cases_not_contained"] == "gvisor_b" and flat["gvisor_neighbour_p50_quiet_ms"] == 40.0
    assert flat["gvisor_neighbour_ratio_min_samples"] == 20
    container_keys = outcomes_json([Outcome("fork_bomb", [Check("x", True)])], 4.0)
    assert not set(flat) & set(container_keys), set(flat) & set(container_keys)
