"""`dsec` network policies, stages, pristine exec and events against a real all-in-one
(`dsec up --edge-config` in its own process) and a real "remote host" network namespace."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import dsec_up, remote_host

pytestmark = pytest.mark.root
DSEC = [sys.executable, "-m", "dsec.cli.main"]
REMOTE_NS = "dsec-test-cremote"
REMOTE_LINK = "dtc-remote0"
REMOTE_IP = "10.220.0.2"
HOST_SIDE_IP = "10.220.0.1"



@pytest.fixture(scope="module")
def remote() -> Iterator[str]:
    with remote_host(REMOTE_NS, REMOTE_LINK, HOST_SIDE_IP, REMOTE_IP) as ip:
        yield ip


@pytest.fixture(scope="module")
def up(remote: str) -> Iterator[dict[str, str]]:
    with tempfile.TemporaryDirectory(prefix="dsec-test-clipol-") as tmp:
        data = Path(tmp)
        env = {**os.environ, "DSEC_STATE_DIR": str(data)}
        build = subprocess.run([*DSEC, "image", "build", "--busybox", "--name", "busybox", "--tag", "latest", "-q"],
                               env=env, capture_output=True, text=True, timeout=120)
        assert build.returncode == 0, build.stderr
        edge_cfg = data / "edge.toml"
        edge_cfg.write_text(f"""
audit_interval_s = 0.2

[network]
subnet = "10.221.0.0/20"
pool_size = 2

[network.permissions.web]
cidrs = ["{remote}/32"]
ports = ["8080"]
""")
        bad = subprocess.run([*DSEC, "up", "--data-dir", str(data), "--edge-config", str(data / "nope.json")],
                             env=env, capture_output=True, text=True, timeout=60)
        assert bad.returncode == 2 and "nope.json" in bad.stderr
        with dsec_up(data, env, "--edge-config", str(edge_cfg)) as ready:
            yield ready


def dsec(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*DSEC, *args], env=env, capture_output=True, text=True, timeout=120)


def fetch(env: dict[str, str], sid: str, port: int) -> bool:
    r = dsec(env, "exec", sid, "--", "sh", "-c", f"printf 'GET / HTTP/1.0\\r\\n\\r\\n' | nc -w 3 {REMOTE_IP} {port}")
    return r.returncode == 0 and f"remote-{port}" in r.stdout


def test_policy_commands(up: dict[str, str]) -> None:
    r = dsec(up, "create", "busybox", "--allow", "web", "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    sid = info["id"]
    try:
        assert "token" not in info
        net = json.loads(dsec(up, "network", sid, "--json").stdout)
        assert net["policy"] == {"allow": ["web"], "rules": []} and net["ip"].startswith("10.221."), net
        assert fetch(up, sid, 8080) and not fetch(up, sid, 9090)

        r = dsec(up, "policy", sid, "--allow-cidr", f"{REMOTE_IP}:9090/tcp", "--json")
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["network"]["rules"] == [{"cidr": f"{REMOTE_IP}/32", "ports": ["9090"], "protocol": "tcp"}]
        assert fetch(up, sid, 9090) and not fetch(up, sid, 8080)
        assert f"{REMOTE_IP}/32:9090/tcp" in dsec(up, "policy", sid).stdout  # no flags: show

        net = json.loads(dsec(up, "network", sid, "--json").stdout)
        assert net["ip"].startswith("10.221.") and net["denied"] >= 1, net  # the refused 8080 attempt

        r = dsec(up, "policy", sid, "--none")
        assert r.returncode == 0 and "loopback only" in r.stdout, r.stderr
        assert not fetch(up, sid, 9090)

        r = dsec(up, "policy", sid, "--allow", "nosuch")
        assert r.returncode == 1 and "nosuch" in r.stderr
        r = dsec(up, "policy", sid, "--allow-cidr", "not-an-ip")
        assert r.returncode == 2 and "not an IP address" in r.stderr
        r = dsec(up, "policy", sid, "--none", "--allow", "web")
        assert r.returncode == 2

        evs = json.loads(dsec(up, "events", sid, "--json").stdout)
        kinds = [e["event"] for e in evs]
        assert kinds.count("policy_changed") == 2 and "net_denied" in kinds, kinds
        r = dsec(up, "events", sid, "--kind", "policy_changed")
        assert r.returncode == 0 and "policy_changed" in r.stdout and "exec_started" not in r.stdout
    finally:
        dsec(up, "rm", sid)


def test_stages_and_pristine(up: dict[str, str], tmp_path: Path) -> None:
    stages = tmp_path / "stages.json"
    stages.write_text(json.dumps({
        "setup": {"network": {"allow": ["web"]}},
        "evaluate": {"files": {"read_only": ["/workspace"]}},
    }))
    r = dsec(up, "create", "busybox", "--stages-file", str(stages), "--stage", "setup", "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    sid = info["id"]
    try:
        # the control plane's answer carries what the edge enforces
        assert info["stage"] == "setup" and sorted(info["stages"]) == ["evaluate", "setup"]
        assert info["network"]["allow"] == ["web"]
        assert fetch(up, sid, 8080)
        assert dsec(up, "exec", sid, "--", "sh", "-c", "mkdir -p /workspace && echo v1 > /workspace/f").returncode == 0
        r = dsec(up, "stage", sid, "evaluate")
        assert r.returncode == 0 and "stage evaluate" in r.stdout and "loopback only" in r.stdout, r.stderr
        assert not fetch(up, sid, 8080)
        r = dsec(up, "exec", sid, "--", "sh", "-c", "cat /workspace/f; echo v2 > /workspace/f")
        assert r.stdout == "v1\n" and r.returncode != 0
        r = dsec(up, "stage", sid, "nosuch")
        assert r.returncode == 1 and "evaluate, setup" in r.stderr

        # evaluation against the image's own tools, whatever the agent did to them
        assert dsec(up, "exec", sid, "--", "sh", "-c", "rm /bin/wc").returncode == 0
        assert dsec(up, "exec", sid, "--", "/bin/wc", "-c", "/etc/hostname").returncode != 0
        r = dsec(up, "exec", sid, "--pristine", "/bin", "--", "sh", "-c", "echo x | /bin/wc -c")
        assert r.returncode == 0 and r.stdout.strip() == "2", r.stderr
        kinds = [e["event"] for e in json.loads(dsec(up, "events", sid, "--json").stdout)]
        assert "stage_changed" in kinds
    finally:
        dsec(up, "rm", sid)


def test_run_with_flags_and_bad_flags(up: dict[str, str], tmp_path: Path) -> None:
    r = dsec(up, "run", "busybox", "--allow-cidr", f"{REMOTE_IP}:8080", "--", "sh", "-c",
             f"printf 'GET / HTTP/1.0\\r\\n\\r\\n' | nc -w 3 {REMOTE_IP} 8080")
    assert r.returncode == 0 and "remote-8080" in r.stdout, r.stderr
    r = dsec(up, "run", "busybox", "--", "sh", "-c", f"nc -w 3 {REMOTE_IP} 8080 </dev/null")
    assert r.returncode != 0  # no flags: loopback only
    r = dsec(up, "create", "busybox", "--allow-cidr", f"{REMOTE_IP}:8080/icmp")
    assert r.returncode == 2 and "tcp, udp or any" in r.stderr
    stages = tmp_path / "s.json"
    stages.write_text(json.dumps({"a": {}}))
    r = dsec(up, "create", "busybox", "--stages-file", str(stages), "--stage", "b")
    assert r.returncode == 2 and re.search(r"stage 'b' is not one of", r.stderr), r.stderr
    r = dsec(up, "create", "busybox", "--stages-file", str(stages), "--stage", "a", "--allow", "web")
    assert r.returncode == 2 and "--stage" in r.stderr
    stages.write_text('{"a": {"files": {"hidden": ["relative"]}}}')
    r = dsec(up, "create", "busybox", "--stages-file", str(stages))
    assert r.returncode == 2 and "absolute" in r.stderr
