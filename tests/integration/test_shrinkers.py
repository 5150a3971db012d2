"""The shrinker reserve (issue 29): a real mount storm in a throwaway mount namespace raises the
kernel's memcg shrinker-id high-water mark, once per boot, and leaves nothing behind."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsec.backends.container import shrinkers
from dsec.bench.runtime import shrinker_id_hwm

pytestmark = pytest.mark.root


def _our_mounts() -> list[str]:
    return [ln for ln in Path("/proc/self/mountinfo").read_text().splitlines() if "dsec-shrinker-reserve" in ln]


def test_the_reserve_raises_the_mark_once_and_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    before = shrinker_id_hwm()
    if before is None:
        pytest.skip("the shrinker mark cannot be read on this kernel (< 6.7 or no memory cgroup)")
    if before > 20_000:
        pytest.skip(f"this boot's shrinker mark is already {before} ids: raising it would mount that many "
                    "superblocks (the mark only falls at reboot; a freshly booted CI machine runs this)")
    monkeypatch.setattr(shrinkers, "RECORD", tmp_path / "shrinker-reserve")
    assert shrinkers.reserve(0) == 0 and shrinkers.reserved() == 0
    want = before + 2048
    assert shrinkers.reserve(want) == want
    assert shrinkers.reserved() == want
    after = shrinker_id_hwm()
    assert after is not None and after >= want - 64, (before, after)  # the estimate reads in units of 64
    assert _our_mounts() == []  # the child's namespace took its mounts with it
    # Once per boot: no more ids asked, nothing done.
    assert shrinkers.reserve(want) == 0 and shrinkers.reserve(want - 1000) == 0


def test_a_sandbox_count_gives_three_ids_each_and_a_margin() -> None:
    assert shrinkers.ids_for(0) == 0
    assert shrinkers.ids_for(10_000) == 10_000 * shrinkers.SUPERBLOCKS_PER_SANDBOX + shrinkers.HOST_MARGIN


def test_the_edge_follows_its_configured_capacity(tmp_path: Path) -> None:
    from dsec.backends import BackendContext, build
    from dsec.backends.container.config import ContainerConfig

    def ctx(n: int | None) -> BackendContext:
        return BackendContext(name="x", state_dir=tmp_path, run_dir=tmp_path, id_prefix="sb", store=None,
                              backends={}, max_sandboxes=n)

    def reserve(cfg: ContainerConfig, n: int | None) -> int:
        return int(build(cfg, ctx(n)).shrinker_reserve)  # type: ignore[attr-defined]

    assert reserve(ContainerConfig(), None) == 0  # no capacity configured: no reserve
    assert reserve(ContainerConfig(), 5000) == shrinkers.ids_for(5000)
    assert reserve(ContainerConfig(shrinker_reserve=0), 5000) == 0
    assert reserve(ContainerConfig(shrinker_reserve=777), None) == 777
