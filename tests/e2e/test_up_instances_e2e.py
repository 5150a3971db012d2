"""Two `dsec up` all-in-ones on one host (issue 11, items 1 and 11), each its own process,
data directory and port, against a real "remote host" network namespace:

- their host resources are apart: runtime names, cgroups, mounts, sandbox subnets;
- one is stopped and started again while the other runs 100 creates (and a command in
  flight): zero failures, and the other's cgroups and mounts are untouched;
- a second instance on a data directory in use is refused with one line;
- a fresh instance has a network without any config file (raw CIDR rules work), and
  ``--network-config FILE`` gives named permissions.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from conftest import CGROUP_ROOT, dsec_up, mountinfo_lines, remote_host

pytestmark = pytest.mark.root
DSEC = [sys.executable, "-m", "dsec.cli.main"]
REMOTE_NS = "dsec-test-iremote"
REMOTE_LINK = "dti-remote0"
REMOTE_IP = "10.223.0.2"  # outside the automatic subnets (another instance on this host may hold one)
HOST_SIDE_IP = "10.223.0.1"


def dsec(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*DSEC, *args], env=env, capture_output=True, text=True, timeout=120)


def fetch(env: dict[str, str], sid: str, port: int) -> bool:
    r = dsec(env, "exec", sid, "--", "sh", "-c", f"printf 'GET / HTTP/1.0\\r\\n\\r\\n' | nc -w 3 {REMOTE_IP} {port}")
    return r.returncode == 0 and f"remote-{port}" in r.stdout


def edge_health(env: dict[str, str]) -> dict[str, Any]:
    r = httpx.get(env["DSEC_URL"] + "/v1/edges", headers={"authorization": f"Bearer {env['DSEC_TOKEN']}"}, timeout=10)
    (edge,) = r.json()["items"] if isinstance(r.json(), dict) else r.json()
    return dict(edge["health"])


@pytest.fixture(scope="module")
def remote() -> Iterator[str]:
    with remote_host(REMOTE_NS, REMOTE_LINK, HOST_SIDE_IP, REMOTE_IP) as ip:
        yield ip


@pytest.fixture(scope="module")
def dirs() -> Iterator[tuple[Path, Path]]:
    with tempfile.TemporaryDirectory(prefix="dsec-test-upa-") as a, tempfile.TemporaryDirectory(prefix="dsec-test-upb-") as b:
        for d in (a, b):
            r = dsec({**os.environ, "DSEC_STATE_DIR": d}, "image", "build", "--busybox", "--name", "busybox",
                     "--tag", "latest", "-q")
            assert r.returncode == 0, r.stderr
        yield Path(a), Path(b)


def test_two_instances_side_by_side(remote: str, dirs: tuple[Path, Path]) -> None:
    a_dir, b_dir = dirs
    env_a = {**os.environ, "DSEC_STATE_DIR": str(a_dir)}
    env_b = {**os.environ, "DSEC_STATE_DIR": str(b_dir)}
    net_cfg = b_dir / "net.toml"
    net_cfg.write_text(f'[permissions.web]\ncidrs = ["{remote}/32"]\nports = ["8080"]\n')
    with contextlib.ExitStack() as stack:
        a = stack.enter_context(dsec_up(a_dir, env_a))
        b_up = dsec_up(b_dir, env_b, "--network-config", str(net_cfg), "--node-name", "dsec-test-b")
        b = b_up.__enter__()
        b_running = True
        try:
            ha, hb = edge_health(a), edge_health(b)
            assert ha["runtime"].startswith("up-") and ha["runtime"].endswith("-e1"), ha["runtime"]
            assert hb["runtime"] == "dsec-test-b-e1" and ha["healthy"] and hb["healthy"]
            cg_a = [CGROUP_ROOT / c / "dsec" / ha["runtime"] for c in ("cpu", "memory", "pids", "freezer")]
            assert all(p.is_dir() for p in cg_a)

            # Network out of the box on A (no config file): a raw rule; named permissions on B.
            r = dsec(a, "create", "busybox", "--allow-cidr", f"{remote}/32:8080/tcp", "--json")
            assert r.returncode == 0, r.stderr
            sid_a = json.loads(r.stdout)["id"]
            r = dsec(b, "create", "busybox", "--allow", "web", "--json")
            assert r.returncode == 0, r.stderr
            sid_b = json.loads(r.stdout)["id"]
            assert fetch(a, sid_a, 8080) and not fetch(a, sid_a, 9090)
            assert fetch(b, sid_b, 8080) and not fetch(b, sid_b, 9090)
            ip_a = json.loads(dsec(a, "network", sid_a, "--json").stdout)["ip"]
            ip_b = json.loads(dsec(b, "network", sid_b, "--json").stdout)["ip"]
            net_a = ipaddress.IPv4Network(f"{ip_a}/16", strict=False)
            assert ipaddress.IPv4Address(ip_b) not in net_a, (ip_a, ip_b)  # each instance its own subnet
            r = dsec(a, "create", "busybox", "--allow", "web")
            assert r.returncode == 1 and "web" in r.stderr  # A has no named permissions

            a_mounts = sorted(ln.split()[4] for ln in mountinfo_lines() if f"/{ha['runtime']}/" in ln.split()[4])
            assert any(m.endswith("/skel") for m in a_mounts) and any("/layers/" in m for m in a_mounts)

            # A command in flight on A, then 100+ creates on A while B stops and starts again.
            long_cmd = subprocess.Popen([*DSEC, "exec", sid_a, "--", "sh", "-c", "sleep 12; echo survived"],
                                        env=a, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            failures: list[str] = []
            done: list[float] = []
            restarted = threading.Event()

            def creates() -> None:
                from dsec import Client, ImageRef, SandboxSpec

                spec = SandboxSpec(image=ImageRef(base="busybox:latest"))
                with Client(a["DSEC_URL"], a["DSEC_TOKEN"]) as c:
                    while len(done) < 100 or not restarted.is_set():
                        try:
                            with c.create(spec) as sb:
                                res = sb.exec("echo ok")
                                if res.stdout != b"ok\n":
                                    failures.append(f"exec said {res.stdout!r} {res.stderr!r}")
                        except Exception as exc:
                            failures.append(repr(exc))
                        done.append(time.monotonic())
                        if len(done) > 400:
                            break

            worker = threading.Thread(target=creates)
            worker.start()
            try:
                while len(done) < 5:
                    time.sleep(0.05)
                t_stop = time.monotonic()
                b_running = False
                b_up.__exit__(None, None, None)  # Ctrl-C: B destroys its sandboxes, removes its cgroups
                assert all(p.is_dir() for p in cg_a), "B's stop removed A's cgroups"
                b_up = dsec_up(b_dir, env_b, "--network-config", str(net_cfg), "--node-name", "dsec-test-b")
                b = b_up.__enter__()
                b_running = True
                t_started = time.monotonic()
                restarted.set()
            finally:
                restarted.set()
                worker.join(300)
            assert not failures, failures[:5]
            assert len(done) >= 100
            assert done[0] < t_stop and done[-1] > t_started  # the creates spanned B's restart
            out, err = long_cmd.communicate(timeout=60)
            assert long_cmd.returncode == 0 and out == "survived\n", err
            assert all(p.is_dir() for p in cg_a)
            assert a_mounts == sorted(ln.split()[4] for ln in mountinfo_lines() if f"/{ha['runtime']}/" in ln.split()[4])
            assert edge_health(a)["healthy"] and edge_health(a)["repairs"] == []  # nothing of A was touched
            assert fetch(a, sid_a, 8080)
            assert dsec(a, "rm", sid_a).returncode == 0
        finally:
            if b_running:
                b_up.__exit__(None, None, None)


def test_a_second_instance_on_a_data_dir_in_use_is_refused(dirs: tuple[Path, Path]) -> None:
    a_dir, _ = dirs
    env = {**os.environ, "DSEC_STATE_DIR": str(a_dir)}
    with dsec_up(a_dir, env) as a:
        pid = (a_dir / "up.lock").read_text().split()[-1]
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = str(s.getsockname()[1])
        for detach in ([], ["--detach"]):
            r = dsec(env, "up", "--data-dir", str(a_dir), "--port", port, *detach)
            assert r.returncode == 1, r.stderr
            said = " ".join(r.stderr.split())  # one message (the console may wrap it at 80 columns)
            assert said.startswith("error: ") and said.count("error:") == 1 and "Traceback" not in said, r.stderr
            assert f"{a_dir} is in use by another `dsec up` (dsec up pid {pid}): stop it first, or give this one " \
                   "another --data-dir (and --port)" in said, r.stderr
        assert not (a_dir / "up.pid").exists()  # the refused --detach wrote nothing
        assert edge_health(a)["healthy"]  # and the running one is untouched
        r = dsec(a, "run", "busybox", "--", "echo", "still here")
        assert r.returncode == 0 and r.stdout == "still here\n", r.stderr


def test_without_a_free_subnet_dsec_up_runs_loopback_only_and_says_why(
    dirs: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The default network cannot start (every automatic subnet is held): the all-in-one
    starts without it and says so, rather than not at all. The claims are in a directory
    of the test's own ($DSEC_CLAIMS_DIR), so other instances on this host are not disturbed."""
    import asyncio

    from dsec import AsyncClient, ImageRef, NetworkPolicy, SandboxSpec
    from dsec.backends.common import claims
    from dsec.cli.up import start_cluster
    from dsec.errors import InvalidSpec

    _, data = dirs
    private = Path(tempfile.mkdtemp(prefix="dsec-test-claims-"))
    monkeypatch.setenv("DSEC_CLAIMS_DIR", str(private))
    held = [claims.try_claim(private / f"subnet-{c.network_address}_{c.prefixlen}", "test")
            for c in claims.AUTO_CANDIDATES]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    runner = asyncio.Runner()
    cluster = runner.run(start_cluster(data, port=port))
    try:
        (note,) = cluster.notes
        assert note.startswith("edge e1 has no sandbox network (no free sandbox subnet among 10.224.0.0/16 .. "
                               "10.254.0.0/16 ("), note
        assert note.endswith("set network.subnet to a free range); its sandboxes are loopback-only"), note
        assert cluster.edges[0].config.network is None

        async def go() -> None:
            async with AsyncClient(cluster.url, cluster.admin_token) as c:
                spec = SandboxSpec(image=ImageRef(base="busybox:latest"))
                async with await c.create(spec) as sb:
                    assert (await sb.exec("echo ok")).stdout == b"ok\n"
                with pytest.raises(InvalidSpec, match="has no network configured"):
                    await c.create(spec.model_copy(update={"network": NetworkPolicy()}))

        runner.run(go())
    finally:
        runner.run(cluster.stop())
        runner.close()
        for c in held:
            assert c is not None
            c.release()
    assert sorted(p.name for p in private.iterdir()) == []  # every claim was let go and removed
    private.rmdir()
