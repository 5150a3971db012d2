"""The main job: 64 agent-style rollouts through the SDK against the all-in-one.

Each rollout gets its own sandbox (Debian base with python3 + a workspace
layer holding a small project with failing tests), reads a file, applies a
candidate patch, runs the tests and records the reward.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from dsec.demo.workspace import CANDIDATES, apply_patch, reward_from_unittest, write_workspace

Say = Callable[[str], None]


@dataclass
class Rollout:
    index: int
    candidate: str
    reward: float = 0.0
    steps_ms: dict[str, float] = field(default_factory=dict)
    error: str | None = None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ensure_layers(data_dir: Path, say: Say) -> tuple[str, str]:
    """The Debian+python3 base (debootstrap, built once) and the workspace layer."""
    from dsec.errors import LayerNotFound
    from dsec.images.build import build_debootstrap, build_from_dir
    from dsec.images.store import LocalLayerStore

    store = LocalLayerStore(data_dir / "layers")
    try:
        base = store.resolve("demo-debian:bookworm-python3")
        say(f"base layer demo-debian:bookworm-python3 already built ({base.size / 1e6:.0f} MB)")
    except LayerNotFound:
        say("building the Debian base layer with python3 (debootstrap, about a minute, once)")
        t0 = time.monotonic()
        base = build_debootstrap(store, suite="bookworm", variant="minbase", packages=("python3",),
                                 name="demo-debian", tag="bookworm-python3")
        say(f"  built in {time.monotonic() - t0:.0f}s: {base.size / 1e6:.0f} MB")
    with tempfile.TemporaryDirectory(prefix="dsec-demo-ws-") as tmp:
        ws = build_from_dir(store, write_workspace(Path(tmp)), name="demo-workspace", tag="calc",
                            kind="workspace", parents=(base.digest,))
    say(f"workspace layer demo-workspace:calc {ws.digest[:19]}…")
    return "demo-debian:bookworm-python3", "demo-workspace:calc"


async def run_demo(data_dir: Path, *, n: int = 64, concurrency: int = 16, say: Say = print) -> list[Rollout]:
    from dsec.cli.up import start_cluster
    from dsec.sdk import AsyncClient, AsyncSandbox
    from dsec.spec import ImageRef, Resources, SandboxSpec

    base, workspace = await asyncio.to_thread(ensure_layers, data_dir, say)
    cluster = await start_cluster(data_dir, port=_free_port())
    say(f"all-in-one up: control plane {cluster.url}, edge {cluster.edges[0].url}")
    spec = SandboxSpec(image=ImageRef(base=base, workspace=workspace),
                       resources=Resources(cpu=1, memory=256 << 20, disk=128 << 20, pids=128))
    rollouts: list[Rollout] = []
    try:
        async with AsyncClient(cluster.url, cluster.admin_token) as client:
            sem = asyncio.Semaphore(concurrency)

            async def rollout(i: int, sb: AsyncSandbox) -> Rollout:
                name, patch = CANDIDATES[i % len(CANDIDATES)]
                r = Rollout(i, name)
                try:
                    async with sem, sb:
                        t = time.perf_counter()
                        source = await sb.files.read_text("/workspace/calc/stats.py")
                        r.steps_ms["read"] = (time.perf_counter() - t) * 1000
                        t = time.perf_counter()
                        await sb.files.write("/workspace/calc/stats.py", apply_patch(source, patch))
                        r.steps_ms["patch"] = (time.perf_counter() - t) * 1000
                        t = time.perf_counter()
                        res = await sb.exec(["python3", "-m", "unittest"], cwd="/workspace", timeout=120)
                        r.steps_ms["test"] = (time.perf_counter() - t) * 1000
                        r.reward = reward_from_unittest(res.stderr_text)
                except Exception as exc:  # a failed rollout is a result, not a crash
                    r.error = f"{type(exc).__name__}: {exc}"
                return r

            t0 = time.perf_counter()
            tasks: list[asyncio.Task[Rollout]] = []
            create_ms: dict[int, float] = {}
            async for outcome in client.create_many(spec, n, concurrency=concurrency, labels={"demo": "calc"}):
                create_ms[outcome.index] = (time.perf_counter() - t0) * 1000
                if outcome.sandbox is not None:
                    tasks.append(asyncio.create_task(rollout(outcome.index, outcome.sandbox)))
                else:
                    rollouts.append(Rollout(outcome.index, "-", error=str(outcome.error)))
            rollouts += await asyncio.gather(*tasks)
            wall = time.perf_counter() - t0
            rollouts.sort(key=lambda r: r.index)
            _summary(rollouts, wall, n, say)
    finally:
        say("stopping the all-in-one (destroying sandboxes)")
        with contextlib.suppress(Exception):
            await cluster.stop()
    return rollouts


def _summary(rollouts: list[Rollout], wall: float, n: int, say: Say) -> None:
    from rich.console import Console
    from rich.table import Table

    ok = [r for r in rollouts if r.error is None]
    t = Table(title=f"dsec demo: {n} rollouts, one sandbox each")
    t.add_column("candidate patch")
    t.add_column("rollouts", justify="right")
    t.add_column("mean reward", justify="right")
    by: dict[str, list[float]] = {}
    for r in ok:
        by.setdefault(r.candidate, []).append(r.reward)
    for name, rewards in sorted(by.items(), key=lambda kv: -statistics.mean(kv[1])):
        t.add_row(name, str(len(rewards)), f"{statistics.mean(rewards):.2f}")
    Console().print(t)
    s = Table(title="per-step latency (ms) and throughput")
    s.add_column("step")
    s.add_column("p50", justify="right")
    s.add_column("p95", justify="right")
    for step in ("read", "patch", "test"):
        vals = sorted(r.steps_ms[step] for r in ok if step in r.steps_ms)
        if vals:
            s.add_row(step, f"{vals[len(vals) // 2]:.1f}", f"{vals[min(len(vals) - 1, int(len(vals) * 0.95))]:.1f}")
    Console().print(s)
    say(f"rollouts ok: {len(ok)}/{n}; mean reward {statistics.mean([r.reward for r in ok]) if ok else 0:.3f}; "
        f"wall {wall:.1f}s; {n / wall:.1f} sandboxes/s")
    for r in rollouts:
        if r.error:
            say(f"  rollout {r.index} failed: {r.error}")
