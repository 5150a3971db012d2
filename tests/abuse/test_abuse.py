"""The abuse suite (issue 5 §3): each case attacks one sandbox while neighbours run a steady
exec workload, and must be contained with the host healthy afterwards.

The cases live in :mod:`dsec.bench.abuse_cases` (``dsec bench abuse`` runs the same ones and
records the neighbours' exec latency; here only containment is asserted, never timing).
Heavy cases (long floods, CPU spin) are ``slow``; a case that is a known, tracked bug is
``xfail(strict=True)`` with the reason, so fixing it turns the test red until the mark goes.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import RuntimeHarness, edge_config
from dsec.bench.abuse_cases import CASES, Case, EdgeTarget, Lab, NeighbourLoad, Outcome, run_case
from dsec.bench.abuse_helper import build_helper

pytestmark = pytest.mark.root

K_NEIGHBOURS = 2


def _param(c: Case) -> Any:
    marks: list[Any] = []
    if c.heavy:
        marks.append(pytest.mark.slow)
    if c.known_bug:
        marks.append(pytest.mark.xfail(strict=True, reason=c.known_bug))
    return pytest.param(c, id=c.name, marks=marks)


@pytest.fixture(scope="module")
def edge(dsec_base: Path) -> Iterator[EdgeTarget]:
    from dsec.edge.testing import EdgeThread, leftovers

    key = secrets.token_bytes(32)
    cfg = edge_config(dsec_base, "abedge", "ab", key)
    e = EdgeThread(cfg).start()
    try:
        yield EdgeTarget(e.url, key)
    finally:
        e.stop()
    assert not leftovers(cfg), leftovers(cfg)


@pytest.fixture(scope="module")
def lab(make_runtime: Any, dsec_base: Path, edge: EdgeTarget) -> Iterator[tuple[RuntimeHarness, Lab]]:
    h = make_runtime("abuse").start()
    try:
        helper = build_helper(dsec_base / "abuse-helper")
        lb = Lab(rt=h.rt, image="busybox:test", work=dsec_base / "abuse", helper=helper, edge=edge, quick=True)
        h.run(lb.setup(K_NEIGHBOURS))
        try:
            yield h, lb
        finally:
            h.run(lb.close())
    finally:
        h.close()
    left = h.leftovers()
    assert not left, f"abuse runtime left: {left}"


async def _under_load(lb: Lab, c: Case) -> Outcome:
    load = NeighbourLoad(lb.rt, lb.neighbours)
    load.start()
    try:
        return await run_case(lb, c, load=load)
    finally:
        await load.stop()


@pytest.mark.parametrize("case", [_param(c) for c in CASES])
def test_abuse_case_is_contained(lab: tuple[RuntimeHarness, Lab], case: Case) -> None:
    h, lb = lab
    out = h.run(_under_load(lb, case), timeout=600)
    print(out.report())
    if out.skipped:
        pytest.skip(out.skipped)
    # Every case checks something that can fail, and the host checks always run.
    assert len(out.checks) >= 5, out.report()
    assert out.contained, out.report()


def test_every_case_is_documented() -> None:
    """docs/SECURITY.md's abuse table names every case (and nothing else)."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "SECURITY.md").read_text()
    section = doc.split("## Abuse suite", 1)[1] if "## Abuse suite" in doc else ""
    missing = [c.name for c in CASES if f"`{c.name}`" not in section]
    assert not missing, f"cases missing from docs/SECURITY.md's abuse table: {missing}"
    names = {c.name for c in CASES}
    assert len(names) == len(CASES), "duplicate case names"
