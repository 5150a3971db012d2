"""Network policies, stages, pristine exec and the audit trail through the edge's HTTP API,
against a real runtime, a real uvicorn on 127.0.0.1 and a real "remote host".

The remote host is a network namespace (``dsec-test-eremote``) with a veth to the host
and TCP servers in it; the host routes between it and the sandboxes. One edge per
module; every test destroys what it made, and the module checks that nothing is left:
no cgroup, record, uid slot, sandbox link or namespace of ours.
"""

from __future__ import annotations

import base64
import json
import re
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from conftest import RT_PREFIX, edge_config, remote_host, running_edge, wait_until
from dsec.edge.config import EdgeConfig
from dsec.edge.testing import EdgeThread, leftovers, prepare_busybox

pytestmark = pytest.mark.root

KEY = secrets.token_bytes(32)
REMOTE_NS = "dsec-test-eremote"
REMOTE_LINK = "dte-remote0"  # not "dsec-*": that prefix means "a sandbox's link" to the host rules
REMOTE_IP = "10.218.0.2"
HOST_SIDE_IP = "10.218.0.1"
SUBNET = "10.217.0.0/20"
RES: dict[str, Any] = {"cpu": 0.5, "memory": 256 << 20, "disk": 64 << 20}
SPEC: dict[str, Any] = {"image": {"base": "busybox:test"}, "resources": RES}



@pytest.fixture(scope="module")
def remote() -> Iterator[str]:
    with remote_host(REMOTE_NS, REMOTE_LINK, HOST_SIDE_IP, REMOTE_IP) as ip:
        yield ip


@pytest.fixture(scope="module")
def edge(dsec_base: Path, remote: str) -> Iterator[EdgeThread]:
    cfg = edge_config(
        dsec_base, "epol", "ep", KEY, watchdog_interval_s=0.2, audit_interval_s=0.2,
        pools=[{"image": {"base": "busybox:test"}, "resources": RES, "size": 1, "name": "plain"}],
        network={"subnet": SUBNET, "pool_size": 2,
                 "permissions": {"remote-web": {"cidrs": [f"{remote}/32"], "ports": ["8080"]},
                                 "remote-alt": {"cidrs": [f"{remote}/32"], "ports": ["9090"]}}},
    )
    with running_edge(cfg) as e:
        yield e
    # Its network manager holds no namespace (they die with their last fd, veths with them).
    # Host links are not checked by name: other runtimes on this machine use the same names.
    net = e.service.backends.get("container").net
    assert not net.sandboxes and not net._pool, (net.sandboxes, net._pool)


@pytest.fixture(scope="module")
def api(edge: EdgeThread) -> Iterator[httpx.Client]:
    with edge.client() as c:
        yield c


def create(api: httpx.Client, spec: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    r = api.post("/v1/sandboxes", json={"spec": spec or SPEC, **extra})
    assert r.status_code == 201, r.text
    return dict(r.json())


def sh(api: httpx.Client, sid: str, cmd: str, **extra: Any) -> dict[str, Any]:
    r = api.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": cmd, "timeout": 30, **extra})
    assert r.status_code == 200, r.text
    res = dict(r.json())
    res["out"] = base64.b64decode(res["stdout_b64"]).decode(errors="replace")
    res["err"] = base64.b64decode(res["stderr_b64"]).decode(errors="replace")
    return res


def fetch(api: httpx.Client, sid: str, port: int) -> str | None:
    """The remote's answer on ``port``, or None when refused (busybox nc)."""
    res = sh(api, sid, f"printf 'GET / HTTP/1.0\\r\\n\\r\\n' | nc -w 3 {REMOTE_IP} {port}")
    return res["out"] if res["exit_code"] == 0 and " 200 " in res["out"] else None


def err(r: httpx.Response) -> dict[str, Any]:
    body = r.json()
    assert set(body) == {"error"}, body
    return dict(body["error"])


def events(api: httpx.Client, sid: str, kind: str) -> list[dict[str, Any]]:
    return [e for e in api.get(f"/v1/sandboxes/{sid}/events").json() if e["event"] == kind]


def metric(api: httpx.Client, series: str) -> float:
    text = api.get("/metrics").text
    m = re.search(rf"^{re.escape(series)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def runtime_has(edge: EdgeThread, what: str) -> bool:
    import inspect

    rt = edge.service.backends.get("container")
    if what == "pristine":
        return "pristine" in inspect.signature(rt.exec).parameters
    return hasattr(rt, what)


def test_set_policy_through_http(edge: EdgeThread, api: httpx.Client) -> None:
    info = create(api)
    sid = info["id"]
    assert info["network"] is None and info["stage"] is None
    sb = httpx.Client(base_url=edge.url, headers={"authorization": f"Bearer {info['token']}"}, timeout=30)
    try:
        assert fetch(api, sid, 8080) is None  # default: loopback only
        assert sb.get(f"/v1/sandboxes/{sid}/network").json()["ip"] is None
        before = metric(api, 'dsec_edge_policy_changes_total{result="ok"}')

        # the sandbox's own token may change its policy; the answer shows it
        r = sb.put(f"/v1/sandboxes/{sid}/policy", json={"allow": ["remote-web"]})
        assert r.status_code == 200, r.text
        assert r.json()["network"] == {"allow": ["remote-web"], "rules": []} and r.json()["token"] is None
        assert "remote-8080" in (fetch(api, sid, 8080) or "")
        assert fetch(api, sid, 9090) is None
        net = sb.get(f"/v1/sandboxes/{sid}/network").json()
        assert net["ip"].startswith("10.217.") and net["policy"]["allow"] == ["remote-web"], net
        assert api.get(f"/v1/sandboxes/{sid}").json()["network"]["allow"] == ["remote-web"]

        # a raw rule instead
        r = api.put(f"/v1/sandboxes/{sid}/policy", json={"rules": [{"cidr": f"{REMOTE_IP}/32", "ports": ["9090"]}]})
        assert r.status_code == 200, r.text
        assert fetch(api, sid, 9090) is not None and fetch(api, sid, 8080) is None

        # typed refusals change nothing
        r = api.put(f"/v1/sandboxes/{sid}/policy", json={"allow": ["nosuch"]})
        assert r.status_code == 422 and err(r)["code"] == "invalid_spec" and "nosuch" in err(r)["message"], r.text
        r = api.put(f"/v1/sandboxes/{sid}/policy", json={"rules": [{"cidr": "not-an-ip"}]})
        assert r.status_code == 422 and err(r)["field"].startswith("rules"), r.text
        assert fetch(api, sid, 9090) is not None
        other = create(api)
        try:
            r = httpx.put(f"{edge.url}/v1/sandboxes/{sid}/policy", json=None,
                          headers={"authorization": f"Bearer {other['token']}"})
            assert r.status_code == 403 and err(r)["code"] == "forbidden"
        finally:
            api.delete(f"/v1/sandboxes/{other['id']}")
        r = api.put("/v1/sandboxes/ep-000000000000/policy", json=None)
        assert r.status_code == 404 and err(r)["code"] == "sandbox_not_found"

        # null: back to loopback only
        r = api.put(f"/v1/sandboxes/{sid}/policy", content=b"null", headers={"content-type": "application/json"})
        assert r.status_code == 200 and r.json()["network"] is None, r.text
        assert fetch(api, sid, 9090) is None

        changes = events(api, sid, "policy_changed")
        assert [c["policy"] is None for c in changes] == [False, False, True], changes
        assert metric(api, 'dsec_edge_policy_changes_total{result="ok"}') - before == 3
        assert metric(api, 'dsec_edge_policy_changes_total{result="failed"}') >= 1
        assert metric(api, 'dsec_edge_policy_apply_seconds_count{kind="policy"}') >= 3
    finally:
        sb.close()
        api.delete(f"/v1/sandboxes/{sid}")


def test_create_with_policy_is_cold_and_enforced(api: httpx.Client) -> None:
    r = api.post("/v1/sandboxes", json={"spec": {**SPEC, "network": {"allow": ["nosuch"]}}})
    assert r.status_code == 422 and err(r)["code"] == "invalid_spec", r.text
    assert wait_until(lambda: api.get("/v1/health").json()["pools"].get("plain") == 1, timeout=30)
    plain = create(api)
    assert plain["from_pool"] is True  # the warm pool serves specs without network or stages ...
    networked = create(api, {**SPEC, "network": {"allow": ["remote-web"]}})
    try:
        assert networked["from_pool"] is False  # ... and never one with a policy (docs/EDGE.md)
        assert networked["network"] == {"allow": ["remote-web"], "rules": []}
        assert "remote-8080" in (fetch(api, networked["id"], 8080) or "")
        assert fetch(api, plain["id"], 8080) is None
    finally:
        api.delete(f"/v1/sandboxes/{plain['id']}")
        api.delete(f"/v1/sandboxes/{networked['id']}")
    # stages with file rules only: a pooled sandbox, switched into its starting stage
    assert wait_until(lambda: api.get("/v1/health").json()["pools"].get("plain") == 1, timeout=30)
    staged = create(api, {**SPEC, "stages": {"eval": {"files": {"read_only": ["/etc"]}}, "open": {}}, "stage": "eval"})
    try:
        assert staged["from_pool"] is True and staged["stage"] == "eval", staged
        res = sh(api, staged["id"], "cat /etc/passwd >/dev/null && echo x > /etc/passwd")
        assert res["exit_code"] != 0, res  # readable, not writable
        assert events(api, staged["id"], "stage_changed")[0]["to"] == "eval"
    finally:
        api.delete(f"/v1/sandboxes/{staged['id']}")


def test_denied_attempts_reach_events_and_metrics(edge: EdgeThread, api: httpx.Client) -> None:
    info = create(api, {**SPEC, "network": {"allow": ["remote-web"]}})
    sid = info["id"]
    try:
        before = metric(api, "dsec_edge_net_denied_total")
        for _ in range(3):
            assert fetch(api, sid, 9090) is None
        assert wait_until(lambda: bool(events(api, sid, "net_denied")), timeout=10), api.get(
            f"/v1/sandboxes/{sid}/events").json()
        ev = events(api, sid, "net_denied")[0]
        assert ev["origin"] == "runtime" and ev["count"] >= 1
        assert any(REMOTE_IP in str(d) and "9090" in str(d) for d in ev["destinations"]), ev
        assert metric(api, "dsec_edge_net_denied_total") - before >= 1
        assert metric(api, "dsec_edge_net_denied_sandboxes_total") >= 1
        net = api.get(f"/v1/sandboxes/{sid}/network").json()
        assert net["denied"] >= 1 and any("9090" in d for d in net["recent_denied"]), net
        assert "{" not in next(ln for ln in api.get("/metrics").text.splitlines()
                               if ln.startswith("dsec_edge_net_denied_total"))  # no per-sandbox labels
    finally:
        api.delete(f"/v1/sandboxes/{sid}")


def test_limit_hits_reach_events_and_metrics(api: httpx.Client) -> None:
    spec = {**SPEC, "resources": {**RES, "disk": 8 << 20, "pids": 16}, "output_cap": 4096}
    info = create(api, spec)
    sid = info["id"]
    try:
        cap0 = metric(api, 'dsec_edge_limit_events_total{kind="output_cap"}')
        disk0 = metric(api, 'dsec_edge_limit_events_total{kind="disk_full"}')
        pids0 = metric(api, 'dsec_edge_limit_events_total{kind="pids_limit"}')

        res = sh(api, sid, "yes | head -c 100000")
        assert res["truncated"] and res["stdout_bytes"] == 100000
        capped = events(api, sid, "output_capped")
        assert capped and capped[0]["stdout_bytes"] == 100000 and capped[0]["output_cap"] == 4096, capped
        assert metric(api, 'dsec_edge_limit_events_total{kind="output_cap"}') - cap0 == 1

        res = sh(api, sid, "dd if=/dev/zero of=/fill bs=1M count=64")
        assert res["exit_code"] != 0 and ("No space" in res["err"] or "quota exceeded" in res["err"]), res
        full = events(api, sid, "disk_full")
        assert len(full) == 1 and full[0]["source"] == "statvfs" and full[0]["disk"] == 8 << 20, full
        assert metric(api, 'dsec_edge_limit_events_total{kind="disk_full"}') - disk0 == 1
        sh(api, sid, "rm /fill")
        r = api.put(f"/v1/sandboxes/{sid}/files", params={"path": "/big"}, content=b"x" * (12 << 20))
        assert r.status_code == 413 and err(r)["code"] == "too_large", r.text  # over the quota: not even read
        r = api.put(f"/v1/sandboxes/{sid}/files", params={"path": "/big"}, content=b"x" * ((8 << 20) + (1 << 19)))
        assert r.status_code == 400 and err(r)["code"] == "file_error", r.text
        full = events(api, sid, "disk_full")
        # Re-armed after the rm, then full again: noted by the files API's ENOSPC/EDQUOT, or by
        # the 0.2 s audit pass if it looked while the upload was filling the layer (a race).
        assert [f["source"] for f in full][:1] == ["statvfs"] and len(full) == 2, full
        assert full[1]["source"] in ("files_api", "statvfs"), full

        res = sh(api, sid, "for i in $(seq 40); do sleep 3 & done 2>/dev/null; wait")
        assert wait_until(lambda: bool(events(api, sid, "pids_limit")), timeout=10)
        assert metric(api, 'dsec_edge_limit_events_total{kind="pids_limit"}') > pids0
    finally:
        api.delete(f"/v1/sandboxes/{sid}")

    # a background process killed by the OOM killer after its exec returned: the audit pass sees it
    small = create(api, {**SPEC, "resources": {**RES, "memory": 32 << 20}})
    try:
        oom0 = metric(api, 'dsec_edge_limit_events_total{kind="oom"}')
        assert sh(api, small["id"], "(sleep 0.3; tail /dev/zero) >/dev/null 2>&1 &")["exit_code"] == 0
        assert not events(api, small["id"], "oom")
        assert wait_until(lambda: bool(events(api, small["id"], "oom")), timeout=20)
        assert metric(api, 'dsec_edge_limit_events_total{kind="oom"}') > oom0
    finally:
        api.delete(f"/v1/sandboxes/{small['id']}")


def test_stage_switch_through_http(edge: EdgeThread, api: httpx.Client) -> None:
    if not runtime_has(edge, "set_stage"):
        pytest.skip("the runtime has no set_stage yet")
    stages = {
        "setup": {"network": {"allow": ["remote-web"]}, "files": {"writable": ["/workspace"]}},
        "evaluate": {"files": {"read_only": ["/workspace"], "default": "rw"}},
    }
    info = create(api, {**SPEC, "stages": stages, "stage": "setup"})
    sid = info["id"]
    try:
        assert info["stage"] == "setup" and info["stages"] == ["evaluate", "setup"] and info["from_pool"] is False
        assert sh(api, sid, "mkdir -p /workspace && echo v1 > /workspace/f")["exit_code"] == 0
        assert fetch(api, sid, 8080) is not None
        sh(api, sid, "sleep 1000 >/dev/null 2>&1 &")  # started under "setup": must not outlive the switch
        assert "sleep 1000" in sh(api, sid, "ps")["out"]
        before = metric(api, 'dsec_edge_stage_changes_total{result="ok"}')

        r = api.post(f"/v1/sandboxes/{sid}/stage", json={"stage": "evaluate"})
        assert r.status_code == 200, r.text
        assert r.json()["stage"] == "evaluate" and r.json()["network"] is None
        assert api.get(f"/v1/sandboxes/{sid}").json()["stage"] == "evaluate"
        assert fetch(api, sid, 8080) is None  # the stage has no network
        res = sh(api, sid, "cat /workspace/f && echo v2 > /workspace/f")
        assert res["out"] == "v1\n" and res["exit_code"] != 0, res  # readable, not writable
        assert "sleep 1000" not in sh(api, sid, "ps")["out"]
        changed = events(api, sid, "stage_changed")
        assert len(changed) == 1 and changed[0]["to"] == "evaluate" and changed[0]["killed"] >= 1, changed
        assert metric(api, 'dsec_edge_stage_changes_total{result="ok"}') - before == 1

        r = api.post(f"/v1/sandboxes/{sid}/stage", json={"stage": "nosuch"})
        assert r.status_code == 422 and err(r)["field"] == "stage" and "evaluate, setup" in err(r)["message"], r.text
        r = api.post(f"/v1/sandboxes/{sid}/stage", json={"stage": "Bad Name"})
        assert r.status_code == 422 and err(r)["field"] == "stage"
    finally:
        api.delete(f"/v1/sandboxes/{sid}")
    plain = create(api)
    try:
        r = api.post(f"/v1/sandboxes/{plain['id']}/stage", json={"stage": "setup"})
        assert r.status_code == 422 and "none" in err(r)["message"], r.text
    finally:
        api.delete(f"/v1/sandboxes/{plain['id']}")


def test_pristine_exec_through_http(edge: EdgeThread, api: httpx.Client) -> None:
    if not runtime_has(edge, "pristine"):
        pytest.skip("the runtime's exec has no pristine= yet")
    info = create(api, {**SPEC, "resources": {**RES, "cpu": 0.25}})
    sid = info["id"]
    try:
        # the agent replaces a tool and removes another from the image's /bin
        assert sh(api, sid, "rm /bin/wc /bin/cat && printf '#!/bin/busybox sh\\necho HACKED\\n' > /bin/cat "
                            "&& chmod 755 /bin/cat")["exit_code"] == 0
        res = sh(api, sid, "echo real | /bin/cat; echo x | /bin/wc -c")
        assert res["out"] == "HACKED\n" and "wc" in res["err"], res
        res = sh(api, sid, "echo real | /bin/cat; echo x | /bin/wc -c", pristine=["/bin"])
        assert res["out"] == "real\n2\n", res
        assert sh(api, sid, "echo real | /bin/cat")["out"] == "HACKED\n"  # the sandbox's own view is unchanged
        with httpx.Client(base_url=api.base_url, headers={"authorization": f"Bearer {info['token']}"}) as sb:
            r = sb.post(f"/v1/sandboxes/{sid}/exec/stream", json={"cmd": "echo x | /bin/wc -c", "pristine": ["/bin"]})
            assert r.status_code == 200 and json.loads(r.text.splitlines()[-1])["result"]["exit_code"] == 0, r.text
        r = api.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "true", "pristine": ["etc"]})
        assert r.status_code == 422 and err(r)["field"].startswith("pristine"), r.text
    finally:
        api.delete(f"/v1/sandboxes/{sid}")


def test_no_network_section_refuses_policies(dsec_base: Path) -> None:
    name = f"{RT_PREFIX}-epol2"
    state = dsec_base / f"state-{name}"
    prepare_busybox(state)
    cfg = EdgeConfig(edge_id="eq", cluster_key=KEY, port=0, state_dir=state, run_dir=dsec_base / "run",
                     runtime_name=name, destroy_on_shutdown=True)
    with EdgeThread(cfg) as e, e.client() as c:
        r = c.post("/v1/sandboxes", json={"spec": {**SPEC, "network": {"rules": [{"cidr": "192.0.2.1"}]}}})
        assert r.status_code == 422 and "no network configured" in err(r)["message"], r.text
        sid = create(c)["id"]
        r = c.put(f"/v1/sandboxes/{sid}/policy", json={"rules": [{"cidr": "192.0.2.1"}]})
        assert r.status_code == 422 and err(r)["field"] == "policy", r.text
        assert c.put(f"/v1/sandboxes/{sid}/policy", json=None).status_code == 200  # none is always fine
        assert c.get(f"/v1/sandboxes/{sid}/network").json()["ip"] is None
        c.delete(f"/v1/sandboxes/{sid}")
    assert not leftovers(cfg), leftovers(cfg)
    assert cfg.model_dump(mode="json")["backends"][0]["network"] is None
