"""An edge whose start is cut short (Ctrl-C while `dsec up` starts) leaves nothing behind.

Before the fix, ``EdgeService.stop()`` returned at once unless ``start()`` had finished,
so the runtime's host state (skeleton mount, cgroups, claims) stayed.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from pathlib import Path

import pytest

from conftest import edge_config, mountinfo_lines
from dsec.edge.service import EdgeService
from dsec.edge.testing import leftovers

pytestmark = pytest.mark.root


def test_a_start_cancelled_half_way_is_undone_by_stop(dsec_base: Path) -> None:
    cfg = edge_config(dsec_base, "stcancel", "sc", secrets.token_bytes(32))
    run = str(Path(cfg.run_dir) / cfg.runtime)

    async def scenario() -> list[str]:
        svc = EdgeService(cfg)
        task = asyncio.create_task(svc.start())
        # cancel once the runtime has put host state down (its skeleton mount), or at the end
        for _ in range(20000):
            if task.done() or any(f" {run}/" in line for line in mountinfo_lines()):
                break
            await asyncio.sleep(0.001)
        cut_short = not task.done()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        assert svc.started != cut_short
        await svc.stop(destroy_all=True)
        return [line for line in mountinfo_lines() if f" {run}/" in line]

    left_mounts = asyncio.run(scenario())
    assert left_mounts == []
    assert leftovers(cfg) == []
    cgroups = [p for p in Path("/sys/fs/cgroup").glob(f"*/dsec/{cfg.runtime}") if p.is_dir()]
    assert cgroups == []
