"""Stage figures: switch latency and exec latency with Landlock file rules vs without.

Both exec series run in the same sandbox, interleaved with the switches, so
they see the same machine load (``dsec bench abuse`` calls this; figures, not
assertions).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from dsec.bench.stats import percentile
from dsec.spec import FileRules, SandboxSpec, Stage

if TYPE_CHECKING:
    from dsec.backends.container.runtime import ContainerRuntime

OPEN = "bench-open"
CLOSED = "bench-closed"
BENCH_STAGES = {
    OPEN: Stage(),
    CLOSED: Stage(files=FileRules(hidden=("/tests",), read_only=("/usr", "/etc", "/bin"), writable=("/tmp",))),
}
"""Typical rules: hide the tests, keep the system read-only, the rest writable."""


async def measure_stages(rt: ContainerRuntime, spec: SandboxSpec, *, n: int = 50) -> dict[str, float]:
    """p50s in milliseconds: ``stage_switch_p50_ms`` (set_stage in either direction, no
    process to kill), ``exec_landlock_p50_ms`` (``true`` under :data:`BENCH_STAGES`'s
    closed stage) and ``exec_plain_p50_ms`` (``true`` with no file rules), side by side.
    ``spec``'s image and resources are used; its own stages are replaced."""
    bench_spec = spec.model_copy(update={"stages": BENCH_STAGES, "stage": OPEN, "network": None})
    rec = await rt.create(bench_spec)
    switch: list[float] = []
    landlock: list[float] = []
    plain: list[float] = []
    try:
        for _ in range(3):  # warm-up: page cache, spawner, first Landlock use
            await rt.exec(rec.id, ["true"])
        for _ in range(max(1, n)):
            for stage, series in ((CLOSED, landlock), (OPEN, plain)):
                t0 = time.perf_counter()
                await rt.set_stage(rec.id, stage)
                switch.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                res = await rt.exec(rec.id, ["true"])
                series.append(time.perf_counter() - t0)
                if res.exit_code != 0:
                    raise RuntimeError(f"bench exec failed under stage {stage}: {res.stderr!r}")
    finally:
        await rt.destroy(rec.id)
    return {
        "stage_switch_p50_ms": percentile(switch, 50) * 1000,
        "exec_landlock_p50_ms": percentile(landlock, 50) * 1000,
        "exec_plain_p50_ms": percentile(plain, 50) * 1000,
    }


__all__ = ["BENCH_STAGES", "measure_stages"]
