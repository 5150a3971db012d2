"""One host, many instances (issue 11, item 1), against real runtimes, edges, mounts and cgroups:

- a second runtime with a name in use is refused before it touches anything (before
  names were claimed, its reconciler killed the first one's sandboxes);
- an edge whose host state vanished under it (a layer unmounted, cgroup directories
  removed, the /dev skeleton unmounted, the spawner killed) repairs it on the way of the
  next create, and says so in its health report and metrics;
- what it cannot repair (a layer whose file is gone) makes it unhealthy, with the exact
  layer, mountpoint and reason, until the cause is fixed.
"""

from __future__ import annotations

import asyncio
import os
import re
import secrets
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from conftest import CGROUP_ROOT, RuntimeHarness, edge_config, pid_alive, running_edge, wait_until
from dsec.backends.common import claims
from dsec.errors import HostError

pytestmark = pytest.mark.root

KEY = secrets.token_bytes(32)
SPEC: dict[str, Any] = {"image": {"base": "busybox:test"}, "resources": {"cpu": 0.5, "memory": 128 << 20}}


def test_a_second_runtime_with_a_name_in_use_is_refused_and_touches_nothing(
    make_runtime: Callable[[str], RuntimeHarness], tmp_path: Path,
) -> None:
    from dsec.backends.container.runtime import ContainerRuntime

    a = make_runtime("twin").start()
    try:
        rec = a.create()
        a.ok(rec.id, "echo mine > /tmp/mark")
        twin = ContainerRuntime(name=a.name, state_dir=tmp_path / "other-state", run_dir=a.run_dir)
        with pytest.raises(HostError) as err:
            asyncio.run(twin.start())
        msg = str(err.value)
        assert msg.startswith(f"runtime name {a.name!r} is in use by another process on this host "
                              f"({a.name} pid {os.getpid()}, lock {claims.claims_dir() / f'runtime-{a.name}'})"), msg
        assert "\n" not in msg
        assert not (tmp_path / "other-state" / "sandboxes").exists()
        # The first one's sandbox, cgroups and mounts are as they were.
        assert pid_alive(rec.init_pid) and a.ok(rec.id, "cat /tmp/mark") == "mine\n"
        assert all((CGROUP_ROOT / c / "dsec" / a.name / rec.id).is_dir() for c in ("memory", "pids", "freezer"))
        assert any("/skel " in ln for ln in a.layer_mounts())
    finally:
        a.close()
    assert a.leftovers() == []
    # Once the first one has closed, the name is free again.
    b = make_runtime("twin").start()
    b.close()


def _metric(text: str, name: str, **labels: str) -> float:
    sel = ",".join(f'{k}="{v}"' for k, v in labels.items())
    m = re.search(rf"^{name}{{{sel}}} (\S+)$" if sel else rf"^{name} (\S+)$", text, re.M)
    assert m, f"{name}{labels} not in metrics"
    return float(m.group(1))


def _create(api: httpx.Client) -> str:
    r = api.post("/v1/sandboxes", json={"spec": SPEC})
    assert r.status_code == 201, r.text
    sid = str(r.json()["id"])
    r = api.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "echo ok"})
    assert r.status_code == 200 and r.json()["exit_code"] == 0, r.text
    return sid


def test_an_edge_repairs_vanished_host_state_and_says_so(dsec_base: Path) -> None:
    # The periodic check is off (an hour): the next create must find and repair it all itself.
    cfg = edge_config(dsec_base, "heal", "hl", KEY, host_check_interval_s=3600,
                      network={"subnet": "10.219.0.0/24", "pool_size": 0})
    with running_edge(cfg) as edge, edge.client() as api:
        rt = edge.service.backends.get("container")
        assert api.get("/v1/health").json()["healthy"] is True
        assert api.delete(f"/v1/sandboxes/{_create(api)}").status_code in (200, 204)
        (digest, layer_mp), = rt.layers.mounts.mounted().items()
        parents = [CGROUP_ROOT / c / "dsec" / rt.name for c in ("memory", "pids")]
        spawner = rt.spawner.pid
        # What another instance's clean-up (or an operator) did to the first one in issue 11.
        subprocess.run(["umount", str(layer_mp)], check=True)
        for p in parents:
            p.rmdir()
        subprocess.run(["umount", str(rt.skel_dir)], check=True)
        os.kill(spawner, signal.SIGKILL)
        assert wait_until(lambda: not pid_alive(spawner))

        sid = _create(api)  # repaired on the way: no failure
        health = api.get("/v1/health").json()
        assert health["healthy"] is True and health["problems"] == [] and health["runtime"] == rt.name
        said = "\n".join(health["repairs"])
        assert f"re-mounted layer {digest} at {layer_mp} (it had been unmounted)" in said, said
        for p in parents:
            assert f"re-made cgroup directory {p} (it had been removed)" in said, said
        assert f"re-made the /dev skeleton at {rt.skel_dir} (it had been removed)" in said, said
        assert f"restarted dsec-spawner (pid {spawner} had exited" in said, said
        assert all(re.match(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ ", line) for line in health["repairs"])
        metrics = api.get("/metrics").text
        assert _metric(metrics, "dsec_edge_healthy") == 1
        for kind, least in (("layer_mount", 1), ("cgroup", 2), ("skeleton", 1), ("spawner", 1)):
            assert _metric(metrics, "dsec_edge_host_repairs_total", kind=kind) >= least, kind
        assert all(p.is_dir() for p in parents) and rt.spawner.pid != spawner

        # With a sandbox running on it: the writable-layer store unmounted (lazily: the
        # sandbox holds it) and the network's host table deleted (a flushed ruleset).
        r = api.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "echo kept > /tmp/kept"})
        assert r.status_code == 200 and r.json()["exit_code"] == 0, r.text
        subprocess.run(["umount", "-l", str(rt.uppers.mountpoint)], check=True)
        subprocess.run(["nft", "delete", "table", "inet", rt.net.host_table], check=True)
        sid2 = _create(api)  # the store is mounted again on the way
        r = api.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "cat /tmp/kept"})
        assert r.status_code == 200 and r.json()["exit_code"] == 0, r.text  # the running one never noticed
        edge.call(edge.service.selfcheck.check())  # the table is the periodic pass's
        health = api.get("/v1/health").json()
        assert health["healthy"] is True, health["problems"]
        said = "\n".join(health["repairs"])
        assert f"re-mounted the writable-layer store at {rt.uppers.mountpoint} (it had been unmounted)" in said, said
        assert f"re-made the sandbox network's nftables table inet {rt.net.host_table}" in said, said
        assert subprocess.run(["nft", "list", "table", "inet", rt.net.host_table], capture_output=True).returncode == 0
        metrics = api.get("/metrics").text
        assert _metric(metrics, "dsec_edge_host_repairs_total", kind="uppers") == 1
        assert _metric(metrics, "dsec_edge_host_repairs_total", kind="network") == 1
        for s in (sid, sid2):
            assert api.delete(f"/v1/sandboxes/{s}").status_code in (200, 204)


def test_what_an_edge_cannot_repair_is_reported_exactly(dsec_base: Path) -> None:
    cfg = edge_config(dsec_base, "unheal", "uh", KEY, host_check_interval_s=3600)
    with running_edge(cfg) as edge, edge.client() as api:
        rt = edge.service.backends.get("container")
        assert api.delete(f"/v1/sandboxes/{_create(api)}").status_code in (200, 204)
        (digest, layer_mp), = rt.layers.mounts.mounted().items()
        blob = Path(rt.store.blob_path(digest))
        aside = blob.with_name(blob.name + ".aside")
        subprocess.run(["umount", str(layer_mp)], check=True)
        blob.rename(aside)  # the layer's file is gone: nothing to mount it from
        try:
            edge.call(edge.service.selfcheck.check())
            health = api.get("/v1/health").json()
            assert health["healthy"] is False
            (problem,) = health["problems"]
            assert problem.startswith(f"layer {digest} is not mounted at {layer_mp} and cannot be mounted again: "
                                      f"layer {digest} is in the index of "), problem
            assert f"its file {blob} is missing" in problem, problem
            metrics = api.get("/metrics").text
            assert _metric(metrics, "dsec_edge_healthy") == 0
            assert _metric(metrics, "dsec_edge_host_problems", kind="layer_mount") == 1
            r = api.post("/v1/sandboxes", json={"spec": SPEC})
            assert r.status_code != 201 and f"its file {blob} is missing" in r.json()["error"]["message"], r.text
        finally:
            aside.rename(blob)
        edge.call(edge.service.selfcheck.check())  # the cause is fixed: repaired on the next pass
        health = api.get("/v1/health").json()
        assert health["healthy"] is True and health["problems"] == []
        assert f"re-mounted layer {digest} at {layer_mp} (it had been unmounted)" in health["repairs"][-1]
        assert _metric(api.get("/metrics").text, "dsec_edge_healthy") == 1
        assert api.delete(f"/v1/sandboxes/{_create(api)}").status_code in (200, 204)
