"""A cluster on one machine, as real as it gets: the fault tests' and ``dsec bench cluster``'s lab.

- a bridge the lab makes (``dlb<tag>``, a /24 of 10.180-219.x.0 that nothing on the
  host routes), with the control plane, the registry and PostgreSQL's clients on the
  host side of it;
- each edge is a "host": its own network namespace (``dsec-lab-<tag>-<n>``) joined to
  the bridge by a veth (``dlv<tag><n>``), its own state directory, a real ``python -m
  dsec.edge`` process started through ``nsenter --net`` (so it shares the machine's
  cgroups and mounts, as edges on one kernel must, but reaches nothing except over
  the bridge). It joins with ``dsec edge join`` and a bootstrap token, and gets its
  image with ``dsec image pull`` from the lab's registry: no file is shared with the
  control plane or another edge (only ``run_dir``, where the one kernel's uid ranges
  and host-wide names are arbitrated);
- control-plane replicas are real ``python -m dsec.control`` processes on one
  PostgreSQL (a throwaway cluster on a unix socket) or, with one replica, SQLite;
- faults: :meth:`Lab.kill_edge` (SIGKILL), :meth:`Lab.partition` / :meth:`Lab.heal`
  (the host end of the edge's veth down / up), :meth:`Lab.kill_control` (SIGKILL),
  :meth:`Lab.restart_postgres`, and clock skew (an edge started with libfaketime's
  ``FAKETIME=+2s``: every wall-clock read of the edge process, its libraries and its
  children moves, which no offset hook of our own could promise).

Everything the lab makes is named after its ``tag`` (two labs on one host do not
meet) and :meth:`Lab.close` removes it all, whatever state a fault left it in.
Needs root, ``ip``, ``nsenter``, ``docker-registry``; PostgreSQL for several replicas.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import ipaddress
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from dsec.bench.postgres import TempPostgres, temp_postgres
from dsec.http import auth

FAKETIME_LIB = next(iter(sorted(glob.glob("/usr/lib/*/faketime/libfaketime.so.1"))), None)
IMAGE = "busybox:test"


def unavailable() -> str | None:
    """Why a lab cannot run on this machine, or None."""
    if os.geteuid() != 0:
        return "the lab makes network namespaces and runs edges: needs root"
    for tool in ("ip", "nsenter"):
        if shutil.which(tool) is None:
            return f"{tool} is missing (iproute2 / util-linux)"
    if shutil.which("docker-registry") is None and shutil.which("registry") is None:
        return "docker-registry is missing (scripts/setup.sh installs it)"
    return None


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), capture_output=True, text=True, check=check)


def _routed() -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
    nets: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
    for line in _run("ip", "-4", "route", "show", "table", "all", check=False).stdout.splitlines():
        word = line.split()[0] if line.split() else ""
        if word in ("local", "broadcast", "unreachable", "prohibit", "blackhole"):
            word = line.split()[1]
        with contextlib.suppress(ValueError):
            if word != "default":
                nets.append(ipaddress.ip_network(word, strict=False))
    return nets


def pick_subnet(tag: str) -> ipaddress.IPv4Network:
    """A /24 in 10.180.0.0-10.219.255.0 that nothing here routes, first guess from the tag."""
    taken = _routed()
    h = int(hashlib.sha256(tag.encode()).hexdigest(), 16)
    for i in range(4096):
        n = (h + i) % (40 * 256)
        net = ipaddress.IPv4Network(f"10.{180 + n // 256}.{n % 256}.0/24")
        if not any(net.overlaps(t) for t in taken):
            return net
    raise RuntimeError("no free /24 for the lab's bridge")


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _wait(pred: Callable[[], bool], timeout: float, what: str, interval: float = 0.1) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)


# ---------------------------------------------------------------- parts ----


@dataclass
class Proc:
    argv: list[str]
    log: Path
    env: dict[str, str]
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Proc:
        f = open(self.log, "ab")  # noqa: SIM115 - the child holds it
        try:
            self.proc = subprocess.Popen(self.argv, stdout=f, stderr=f, stdin=subprocess.DEVNULL, env=self.env,
                                         start_new_session=True)
        finally:
            f.close()
        return self

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        if self.alive:
            assert self.proc is not None
            self.proc.kill()
            self.proc.wait(10)

    def stop(self, timeout: float = 30.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode

    def tail(self, n: int = 40) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        return ""


@dataclass
class Control:
    index: int
    url: str
    config: Path
    proc: Proc


@dataclass
class Edge:
    n: int
    netns: str
    veth: str
    ip: str
    state_dir: Path
    runtime: str
    edge_id: str = ""
    url: str = ""
    proc: Proc | None = None
    clock_offset_s: float = 0.0


@dataclass
class LabTimings:
    """The control plane's detection settings in the lab (short, so faults play out in seconds)."""

    dead_after_s: float = 2.5
    edge_lost_after_s: float = 8.0
    watcher_interval_s: float = 1.0
    reconcile_interval_s: float = 2.0
    orphan_grace_s: float = 5.0
    replica_dead_after_s: float = 3.0


@dataclass
class Lab:
    tag: str
    """Names every host resource of the lab: [a-z0-9], at most 6 characters."""
    base: Path
    run_dir: Path
    """Shared by the lab's edges: the one kernel's uid ranges are arbitrated there."""
    runtime_prefix: str
    timings: LabTimings = field(default_factory=LabTimings)
    env: dict[str, str] = field(default_factory=lambda: dict(os.environ))
    key: bytes = field(default_factory=lambda: secrets.token_bytes(32))
    admin_token: str = field(default_factory=lambda: "dsk_" + secrets.token_urlsafe(32))
    bridge: str = ""
    subnet: ipaddress.IPv4Network | None = None
    host_ip: str = ""
    pg: TempPostgres | None = None
    """A throwaway PostgreSQL (dsec.bench.postgres; fsync off: faults, not throughput, are measured)."""
    registry: Any = None
    image_ref: str = ""
    controls: list[Control] = field(default_factory=list)
    edges: dict[int, Edge] = field(default_factory=dict)
    say: Callable[[str], None] = lambda _m: None
    _stack: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)

    # ------------------------------------------------------------ set-up ----

    def start(self, *, replicas: int = 1, postgres: bool = True) -> Lab:
        assert len(self.tag) <= 6 and self.tag.isalnum(), self.tag
        self.base.mkdir(parents=True, exist_ok=True)
        self._bridge()
        if postgres:
            # in a directory of its own: the postgres user cannot traverse a test's 0700 temporary directories
            self.pg = self._stack.enter_context(temp_postgres(durable=False, max_connections=300))
            self.pg.create_database("dsec")
        self._registry()
        for i in range(replicas):
            self.start_control(i)
        return self

    def _bridge(self) -> None:
        self.bridge = f"dlb{self.tag}"
        self.subnet = pick_subnet(self.tag)
        self.host_ip = str(self.subnet.network_address + 1)
        _run("ip", "link", "del", self.bridge, check=False)
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        _run("ip", "addr", "add", f"{self.host_ip}/24", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")

    def _registry(self) -> None:
        from dsec.images import LocalLayerStore, build_busybox
        from dsec.images.registry_server import RegistryServer

        seed = self.base / "seed"
        store = LocalLayerStore(seed / "layers")
        try:
            build_busybox(store, name="busybox", tag="test")
        finally:
            store.close()
        self.registry = RegistryServer(self.base / "registry", host=self.host_ip).start()
        self.image_ref = f"{self.registry.url}/dsec/busybox:test"
        self._dsec("image", "--store", str(seed / "layers"), "push", IMAGE, "--registry", self.image_ref, "-q")

    def _dsec(self, *args: str, netns: str | None = None, timeout: float = 120) -> str:
        argv = [sys.executable, "-m", "dsec.cli.main", *args]
        if netns is not None:
            argv = ["nsenter", f"--net=/run/netns/{netns}", "--", *argv]
        env = {**self.env, "DSEC_URL": self.urls, "DSEC_TOKEN": self.admin_token}  # operator commands
        p = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout)
        if p.returncode != 0:
            raise RuntimeError(f"dsec {' '.join(args)} failed ({p.returncode}): {p.stderr[-2000:]}")
        return p.stdout

    def control_config(self, i: int, port: int) -> dict[str, Any]:
        t = self.timings
        return {
            "data_dir": str(self.base / f"control{i}"),
            "database_url": self.pg.url("dsec") if self.pg else f"sqlite:///{self.base / 'control.db'}",
            "cluster_key": self.key.hex(), "host": self.host_ip, "port": port,
            "bootstrap_token": self.admin_token, "log_level": "warning",
            "watcher_interval_s": t.watcher_interval_s, "dead_after_s": t.dead_after_s,
            "edge_lost_after_s": t.edge_lost_after_s, "reconcile_interval_s": t.reconcile_interval_s,
            "orphan_grace_s": t.orphan_grace_s, "replica_dead_after_s": t.replica_dead_after_s,
            "edge_timeout_s": 10.0,
        }

    def start_control(self, i: int) -> Control:
        port = _free_port(self.host_ip) if i >= len(self.controls) else int(self.controls[i].url.rsplit(":", 1)[1])
        cfg = self.base / f"control{i}.json"
        cfg.write_text(json.dumps(self.control_config(i, port)))
        os.chmod(cfg, 0o600)
        proc = Proc([sys.executable, "-m", "dsec.control", "--config", str(cfg)], self.base / f"control{i}.log",
                    self.env).start()
        c = Control(i, f"http://{self.host_ip}:{port}", cfg, proc)
        if i < len(self.controls):
            self.controls[i] = c
        else:
            self.controls.append(c)

        def up() -> bool:
            if not proc.alive:
                raise RuntimeError(f"control plane {i} exited: {proc.tail()}")
            with contextlib.suppress(httpx.HTTPError):
                return httpx.get(c.url + "/healthz", timeout=1).status_code == 200
            return False

        _wait(up, 60, f"control plane {i}")
        return c

    @property
    def urls(self) -> str:
        """Every replica's URL, comma-separated (the SDK's and the edges' failover list)."""
        return ",".join(c.url for c in self.controls)

    def api(self, i: int | None = None) -> httpx.Client:
        c = self.controls[i] if i is not None else next(c for c in self.controls if c.proc.alive)
        return httpx.Client(base_url=c.url, headers={"authorization": f"Bearer {self.admin_token}"}, timeout=30)

    def client(self) -> Any:
        from dsec import AsyncClient

        return AsyncClient(self.urls, self.admin_token, timeout=30.0)

    def bootstrap_token(self, *, uses: int | None = 1) -> str:
        with self.api() as c:
            r = c.post("/v1/edges/tokens", json={"ttl_s": 600, "uses": uses, "name": f"lab-{self.tag}"})
            r.raise_for_status()
            return str(r.json()["token"])

    # ------------------------------------------------------------- edges ----

    def add_edge(self, n: int, *, clock_offset_s: float = 0.0, token: str | None = None,
                 edge_config: dict[str, Any] | None = None, wait: bool = True) -> Edge:
        """Host ``n``: its namespace and veth, joined (bootstrap token), image pulled, edge started."""
        assert self.subnet is not None and 1 <= n <= 200
        e = Edge(n=n, netns=f"dsec-lab-{self.tag}-{n}", veth=f"dlv{self.tag}{n}", ip=str(self.subnet.network_address + 10 + n),
                 state_dir=self.base / f"host{n}" / "state", runtime=f"{self.runtime_prefix}-c{n}",
                 clock_offset_s=clock_offset_s)
        self.edges[n] = e
        _run("ip", "netns", "del", e.netns, check=False)
        _run("ip", "link", "del", e.veth, check=False)
        _run("ip", "netns", "add", e.netns)
        _run("ip", "link", "add", e.veth, "type", "veth", "peer", "name", "eth0", "netns", e.netns)
        _run("ip", "link", "set", e.veth, "master", self.bridge)
        _run("ip", "link", "set", e.veth, "up")
        for cmd in (["addr", "add", f"{e.ip}/24", "dev", "eth0"], ["link", "set", "eth0", "up"], ["link", "set", "lo", "up"],
                    ["route", "add", "default", "via", self.host_ip]):
            _run("ip", "netns", "exec", e.netns, "ip", *cmd)
        e.state_dir.mkdir(parents=True, exist_ok=True)
        self._dsec("image", "--store", str(e.state_dir / "layers"), "pull", self.image_ref, "-q", netns=e.netns)
        token = token or self.bootstrap_token()
        url = f"http://{e.ip}:7071"
        self._dsec("edge", "join", self.urls, "--token", token, "--state-dir", str(e.state_dir), "--host", e.ip,
                   "--port", "7071", "--advertise", url, "--no-start", netns=e.netns)
        cfg_path = e.state_dir / "edge.json"
        cfg = json.loads(cfg_path.read_text())
        cfg.update({"run_dir": str(self.run_dir), "runtime_name": e.runtime, "destroy_on_shutdown": True,
                    "cpu_capacity": 64.0, **(edge_config or {})})
        cfg_path.write_text(json.dumps(cfg))
        e.edge_id, e.url = cfg["edge_id"], url
        self.start_edge(n, wait=wait)
        return e

    def start_edge(self, n: int, *, wait: bool = True) -> Edge:
        e = self.edges[n]
        env = dict(self.env)
        if e.clock_offset_s:
            if FAKETIME_LIB is None:
                raise RuntimeError("clock skew needs libfaketime (apt-get install libfaketime)")
            env.update(LD_PRELOAD=FAKETIME_LIB, FAKETIME=f"{e.clock_offset_s:+g}s", FAKETIME_DONT_FAKE_MONOTONIC="1",
                       FAKETIME_NO_CACHE="1")
        e.proc = Proc(["nsenter", f"--net=/run/netns/{e.netns}", "--", sys.executable, "-m", "dsec.edge", "--config",
                       str(e.state_dir / "edge.json"), "--log-level", "warning"], self.base / f"edge{n}.log", env).start()
        if wait:
            self.wait_edge(n, "alive")
        return e

    def edge_info(self, n: int) -> dict[str, Any]:
        with self.api() as c:
            r = c.get(f"/v1/edges/{self.edges[n].edge_id}")
            r.raise_for_status()
            return dict(r.json())

    def wait_edge(self, n: int, status: str, timeout: float = 60.0) -> float:
        """Until the control plane shows edge ``n`` with ``status``; returns the seconds waited."""
        t0 = time.monotonic()
        e = self.edges[n]

        def ok() -> bool:
            if status == "alive" and e.proc is not None and not e.proc.alive:
                raise RuntimeError(f"edge {n} exited: {e.proc.tail()}")
            try:
                return bool(self.edge_info(n)["status"] == status)
            except httpx.HTTPError:
                return False

        _wait(ok, timeout, f"edge {n} ({e.edge_id}) {status}", interval=0.05)
        return time.monotonic() - t0

    def edge_admin(self) -> dict[str, str]:
        tok, _ = auth.mint(self.key, sandbox_id="*", project="*", ttl_s=600, scope="edge-admin")
        return {"authorization": f"Bearer {tok}"}

    def edge_sandboxes(self, n: int) -> list[dict[str, Any]]:
        e = self.edges[n]
        r = httpx.get(f"{e.url}/v1/sandboxes", headers=self.edge_admin(), timeout=10)
        r.raise_for_status()
        data = r.json()
        return list(data["items"] if isinstance(data, dict) else data)

    # ------------------------------------------------------------- faults ----

    def kill_edge(self, n: int) -> None:
        e = self.edges[n]
        if e.proc is not None:
            e.proc.kill()

    def partition(self, n: int) -> None:
        _run("ip", "link", "set", self.edges[n].veth, "down")

    def heal(self, n: int) -> None:
        _run("ip", "link", "set", self.edges[n].veth, "up")

    def kill_control(self, i: int) -> None:
        self.controls[i].proc.kill()

    def restart_postgres(self) -> float:
        assert self.pg is not None, "the lab runs on SQLite"
        return self.pg.restart()

    # ------------------------------------------------------------ checks ----

    def audit(self) -> dict[str, Any]:
        """The store's sandboxes beside every reachable edge's: what is lost, duplicated or leaked.

        - ``missing``: live in the store (running/paused/creating with an id), not on its edge;
        - ``unknown``: on an edge for a project, not live in the store (an orphan);
        - ``duplicate_requests``: request ids with more than one sandbox in the store;
        - ``reservations``: creates never settled (no id)."""
        with self.api() as c:
            rows = c.get("/v1/sandboxes", params=[("state", s) for s in ("creating", "running", "paused", "failed")])
            rows.raise_for_status()
            live = {r["id"]: r for r in rows.json()}
        on_edges: dict[str, dict[str, Any]] = {}
        for n, e in self.edges.items():
            if e.proc is None or not e.proc.alive:
                continue
            for sb in self.edge_sandboxes(n):
                if sb.get("project") is not None and sb["state"] != "stopped":
                    on_edges[sb["id"]] = sb
        reqs: dict[str, list[str]] = {}
        for sb in on_edges.values():
            if sb.get("request_id"):
                reqs.setdefault(sb["request_id"], []).append(sb["id"])
        reachable = {e.edge_id for e in self.edges.values() if e.proc is not None and e.proc.alive}
        return {
            "missing": sorted(i for i, r in live.items() if r["edge_id"] in reachable and i not in on_edges),
            "unknown": sorted(i for i in on_edges if i not in live),
            "duplicate_requests": {k: v for k, v in reqs.items() if len(v) > 1},
            "live": len(live),
            "on_edges": len(on_edges),
        }

    # ------------------------------------------------------------ teardown ----

    def close(self) -> list[str]:
        """Stop and remove everything; returns what could not be (expected: nothing)."""
        problems: list[str] = []
        for e in self.edges.values():
            with contextlib.suppress(Exception):
                self.heal(e.n)
            if e.proc is not None:
                rc = e.proc.stop(60)
                if rc not in (0, None, -15):
                    problems.append(f"edge {e.n} exited {rc}: {e.proc.tail(10)}")
        for c in self.controls:
            c.proc.stop(30)
        if self.registry is not None:
            with contextlib.suppress(Exception):
                self.registry.stop()
        self._stack.close()  # PostgreSQL
        for e in self.edges.values():
            _run("ip", "link", "del", e.veth, check=False)
            _run("ip", "netns", "del", e.netns, check=False)
        if self.bridge:
            _run("ip", "link", "del", self.bridge, check=False)
        return problems


def new_lab(*, tag: str | None = None, base: Path | None = None, run_dir: Path | None = None,
            runtime_prefix: str | None = None, **kw: Any) -> Lab:
    tag = tag or secrets.token_hex(3)
    base = base or Path(tempfile.mkdtemp(prefix=f"dsec-lab-{tag}-"))
    return Lab(tag=tag, base=base, run_dir=run_dir or base / "run", runtime_prefix=runtime_prefix or f"lab{tag}", **kw)
