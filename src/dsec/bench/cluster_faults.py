"""``dsec bench cluster``'s fault phase: what happens when an edge or a replica fails.

``dsec bench cluster`` runs it after the throughput phases (``--no-faults``: not), as
``EXTRA_PHASES["faults"]`` of bench/cluster.py; alone: ``python -m dsec.bench.cluster_faults
[--quick] [--json PATH]``. :func:`run` returns flat keys, in the bench's convention.

| key | how it is measured | target |
|---|---|---|
| ``edge_loss_excluded_s`` | an edge SIGKILLed; seconds until placement skips it (every create, every replica: its last report older than ``dead_after_s``, 2.5 s; from the store's ``last_seen``) | ≤ 3 |
| ``edge_loss_detect_s`` | the same edge: seconds until the control plane shows it ``dead`` (the watcher's next round after that, every 1 s) | |
| ``edge_lost_declared_s`` | the same edge's sandboxes reported ``lost`` (``edge_lost_after_s`` = 6 s here) | bound + ≤ 2 s |
| ``partition_fenced_ok`` | an edge cut off (veth down) until its sandboxes are lost, then healed: 1 if it destroyed every lost sandbox before taking new work, the SDK got ``SandboxLost``, and the audit is clean | 1 |
| ``partition_fence_s`` | from heal to the edge alive again (fenced) | |
| ``failover_lost_creates`` | a burst of creates through the SDK with two replicas' URLs; replica 0 SIGKILLed mid-burst: creates that failed | 0 |
| ``failover_duplicate_creates`` | the same burst: sandboxes beyond one per request id, or on an edge but not in the store | 0 |
| ``failover_burst_s`` | wall time of that burst | |
| ``lease_failover_lost_creates`` | the same burst through a create lease (``create_many``'s default: chunks of 16 straight to the edges), two replicas, two edges; edge 1 **and** replica 0 SIGKILLed mid-burst with chunks in flight on edge 1 (its part is abandoned through replica 1, those items created elsewhere); edge 1 started again: creates that failed plus live sandboxes missing from their edge | 0 |
| ``lease_failover_duplicate_creates`` | the same: sandboxes beyond one per item (live in the store or on an edge, after the watcher settled) or on an edge but not in the store | 0 |
| ``lease_failover_abandoned`` | lease parts the SDK abandoned (from the replicas' logs; ≥ 1: the fault hit the lease) | |
| ``lease_failover_burst_s`` | wall time of that burst | |

It runs in the lab of ``dsec.bench.netlab`` (edges as network-namespace hosts, real
processes, PostgreSQL); ``quick`` shrinks the bursts (40 creates instead of 200).
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import threading
import time
from collections.abc import Callable
from typing import Any

from dsec.bench import netlab

SPEC_KW: dict[str, Any] = {"cpu": 0.1, "memory": 32 << 20, "disk": 8 << 20, "disk_medium": "memory"}


def _spec() -> Any:
    from dsec import ImageRef, Resources, SandboxSpec

    return SandboxSpec(image=ImageRef(base=netlab.IMAGE), resources=Resources(**SPEC_KW))


async def _burst(lab: netlab.Lab, n: int, *, concurrency: int, during: Callable[[int], None] | None = None
                 ) -> tuple[list[Any], list[Any]]:
    """``n`` creates through the SDK (create_many: request ids, retries on 429/503); ``during(k)``
    is called (in a thread) after the k-th answer. Returns (sandboxes, errors)."""
    ok: list[Any] = []
    errors: list[Any] = []
    async with lab.client() as c:
        # one control-plane create per sandbox (request ids, replica failover): the path these
        # faults are about; create leases (edges taking creates directly) are not used here
        async for o in c.create_many(_spec(), n, concurrency=concurrency, max_wait_s=120, lease=False):
            (ok if o.ok else errors).append(o.sandbox if o.ok else o.error)
            if during is not None:
                k = len(ok) + len(errors)
                threading.Thread(target=during, args=(k,), daemon=True).start()
    return ok, errors


def _settle(lab: netlab.Lab, timeout: float = 30.0) -> dict[str, Any]:
    """Audit until the store and the edges agree (orphans finished or reaped), or the timeout."""
    deadline = time.monotonic() + timeout
    while True:
        audit = lab.audit()
        if (not audit["missing"] and not audit["unknown"]) or time.monotonic() > deadline:
            return audit
        time.sleep(1.0)


def edge_loss(lab: netlab.Lab, say: Callable[[str], None]) -> dict[str, Any]:
    sbs, _ = asyncio.run(_burst(lab, 6, concurrency=3))
    on1 = [s for s in sbs if s.info.edge_id == lab.edges[1].edge_id]
    say(f"edge loss: {len(sbs)} sandboxes ({len(on1)} on edge 1), SIGKILL edge 1")
    t0, killed_at = time.monotonic(), time.time()
    lab.kill_edge(1)
    detect = lab.wait_edge(1, "dead", timeout=30)
    # placement's own test, on every create: the last report is older than dead_after_s
    excluded = max(0.0, float(lab.edge_info(1)["last_seen"]) + lab.timings.dead_after_s - killed_at)

    async def lost() -> bool:
        async with lab.client() as c:
            return all([(await c.info(s.id)).state.value == "lost" for s in on1])

    while not asyncio.run(lost()):
        if time.monotonic() - t0 > lab.timings.edge_lost_after_s + 30:
            break
        time.sleep(0.2)
    declared = time.monotonic() - t0
    lab.start_edge(1)  # comes back: fenced, then alive
    return {"edge_loss_excluded_s": round(excluded, 2), "edge_loss_detect_s": round(detect, 2),
            "edge_lost_declared_s": round(declared, 2)}


def partition(lab: netlab.Lab, say: Callable[[str], None]) -> dict[str, Any]:
    from dsec.errors import SandboxLost

    sbs, _ = asyncio.run(_burst(lab, 8, concurrency=4))
    cut = [s for s in sbs if s.info.edge_id == lab.edges[2].edge_id]
    say(f"partition: edge 2 cut off with {len(cut)} sandboxes")
    lab.partition(2)
    lab.wait_edge(2, "dead", timeout=30)
    t0 = time.monotonic()

    async def states() -> set[str]:
        async with lab.client() as c:
            return {(await c.info(s.id)).state.value for s in cut}

    while asyncio.run(states()) != {"lost"} and time.monotonic() - t0 < lab.timings.edge_lost_after_s + 30:
        time.sleep(0.2)
    t1 = time.monotonic()
    lab.heal(2)
    lab.wait_edge(2, "alive", timeout=30)
    fence_s = time.monotonic() - t1
    left = {s["id"] for s in lab.edge_sandboxes(2)} & {s.id for s in cut}

    async def typed() -> bool:
        try:
            await cut[0].exec("true", timeout=5)
        except SandboxLost:
            return True
        return False

    got_typed = asyncio.run(typed()) if cut else True
    audit = _settle(lab)
    ok = bool(cut) and not left and got_typed and not audit["missing"] and not audit["unknown"]
    return {"partition_fenced_ok": int(ok), "partition_fence_s": round(fence_s, 2)}


def failover(lab: netlab.Lab, n: int, say: Callable[[str], None]) -> dict[str, Any]:
    killed = threading.Event()

    def maybe_kill(k: int) -> None:
        if k >= n // 3 and not killed.is_set():
            killed.set()
            say(f"failover: SIGKILL replica 0 after {k} of {n} creates")
            lab.kill_control(0)

    t0 = time.monotonic()
    sbs, errs = asyncio.run(_burst(lab, n, concurrency=16, during=maybe_kill))
    burst = time.monotonic() - t0
    audit = _settle(lab, timeout=lab.timings.replica_dead_after_s + lab.timings.orphan_grace_s + 30)
    ids = [s.id for s in sbs]
    dup = (len(ids) - len(set(ids))) + len(audit["unknown"]) + sum(len(v) - 1 for v in audit["duplicate_requests"].values())
    say(f"failover: {len(sbs)} made, {len(errs)} failed ({errs[:3]}), audit {audit}")
    return {"failover_lost_creates": len(errs) + len(audit["missing"]), "failover_duplicate_creates": dup,
            "failover_burst_s": round(burst, 2)}


def lease_failover(lab: netlab.Lab, n: int, say: Callable[[str], None]) -> dict[str, Any]:
    """A burst through a create lease; edge 1 and replica 0 SIGKILLed at once mid-burst."""
    e1 = lab.edges[1].edge_id
    killed = threading.Event()

    def kill(k: int) -> None:
        say(f"lease failover: SIGKILL edge 1 and replica 0 after {k} of {n} creates")
        lab.kill_edge(1)
        lab.kill_control(0)

    async def burst() -> tuple[list[Any], list[Any]]:
        ok: list[Any] = []
        errors: list[Any] = []
        async with lab.client() as c:
            async for o in c.create_many(_spec(), n, concurrency=64, max_wait_s=120):  # through a lease
                (ok if o.ok else errors).append(o.sandbox if o.ok else o.error)
                k = len(ok) + len(errors)
                if k >= n // 4 and not killed.is_set() and any(s.info.edge_id == e1 for s in ok):
                    killed.set()  # edge 1 has made some of the SDK's: chunks are in flight there
                    threading.Thread(target=kill, args=(k,), daemon=True).start()
        return ok, errors

    t0 = time.monotonic()
    sbs, errs = asyncio.run(burst())
    took = time.monotonic() - t0
    lab.wait_edge(1, "dead", timeout=30)
    lab.start_edge(1)  # re-adopts its sandboxes: the SDK's stand, the rest is destroyed
    audit = _settle(lab, timeout=lab.timings.replica_dead_after_s + lab.timings.orphan_grace_s + 30)
    ids = [s.id for s in sbs]
    dup = (len(ids) - len(set(ids))) + len(audit["unknown"]) + max(0, audit["live"] - n) + max(
        0, audit["on_edges"] - n) + sum(len(v) - 1 for v in audit["duplicate_requests"].values())
    logs = "".join((lab.base / f"control{c.index}.log").read_text(errors="replace") for c in lab.controls)
    lines = [line for line in logs.splitlines() if "abandoned by the client" in line]
    for line in lines:  # kept, returned, and how many the edge had made that nobody holds
        say(f"lease failover: {line.split(' WARNING ')[-1]}")
    parts = len(lines)
    say(f"lease failover: {len(sbs)} made, {len(errs)} failed ({errs[:3]}), {parts} part(s) abandoned, audit {audit}")
    return {"lease_failover_lost_creates": len(errs) + len(audit["missing"]),
            "lease_failover_duplicate_creates": dup, "lease_failover_abandoned": parts,
            "lease_failover_burst_s": round(took, 2)}


def run(*, quick: bool = False, say: Callable[[str], None] = print) -> dict[str, Any]:
    """The fault phase of ``dsec bench cluster``: each scenario in a lab of its own."""
    from dsec.bench import postgres

    problem = netlab.unavailable() or postgres.unavailable()
    if problem is not None:
        say(f"cluster faults skipped: {problem}")
        return {"cluster_faults_skipped": problem}
    out: dict[str, Any] = {}
    timings = netlab.LabTimings(edge_lost_after_s=6.0)
    # the killed edge comes back long before its sandboxes could be declared lost: the SDK's stand
    keep = netlab.LabTimings(edge_lost_after_s=600.0)
    for name, replicas, edges, scenario, t in (
        ("edge loss", 1, 2, edge_loss, timings),
        ("partition", 1, 2, partition, timings),
        ("failover", 2, 2, lambda lab, s: failover(lab, 40 if quick else 200, s), timings),
        ("lease failover", 2, 2, lambda lab, s: lease_failover(lab, 40 if quick else 200, s), keep),
    ):
        lab = netlab.new_lab(timings=t)
        try:
            lab.start(replicas=replicas, postgres=True)
            for i in range(1, edges + 1):
                lab.add_edge(i)
            out.update(scenario(lab, say))
        except Exception as exc:
            say(f"{name}: failed: {exc!r}")
            out[f"{name.replace(' ', '_')}_error"] = repr(exc)[:300]
        finally:
            problems = lab.close()
            if problems:
                say(f"{name}: teardown: {problems}")
            with contextlib.suppress(OSError):
                shutil.rmtree(lab.base, ignore_errors=True)
    return out


if __name__ == "__main__":
    import argparse
    import json
    from pathlib import Path

    ap = argparse.ArgumentParser(prog="python -m dsec.bench.cluster_faults", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="failover bursts of 40 creates instead of 200")
    ap.add_argument("--json", type=Path, help="write the flat JSON here")
    args = ap.parse_args()
    res = run(quick=args.quick)
    print(json.dumps(res, indent=2))
    if args.json is not None:
        args.json.write_text(json.dumps(res, indent=2) + "\n")
