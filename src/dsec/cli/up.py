"""``dsec up``: the embedded all-in-one (control plane + edges + SQLite) on this machine.

Everything runs in one asyncio process: the control plane and each edge are
uvicorn servers in the same loop (``serve_control`` / ``serve_edge``). State
lives under one data directory: ``control/`` (SQLite, cluster key, admin
token) and the edges' records and layer store (the first edge uses the data
directory itself, so ``dsec image build`` layers are visible to it).

Several all-in-ones may run on one host, each on its own data directory and
port. Every host resource is named after the instance: its *node name*
(``--node-name``, default ``up-<8 hex>``, a hash of the data directory's real
path) names each edge's runtime ``<node>-<edge id>``, which names its cgroups,
run directory, writable-layer store and network objects, all claimed host-wide
at start (:mod:`dsec.backends.common.claims`). The data directory itself is
locked (``up.lock``, flock, for the process's lifetime): a second instance on
it is refused before anything starts. Each edge has a network out of the box
(an ``"auto"`` subnet that no other instance holds), so policies work without
a config file.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import re
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsec.cli.paths import admin_token_path as admin_token_path  # re-exported
from dsec.cli.paths import data_dir_default as data_dir_default

log = logging.getLogger("dsec.up")

DEFAULT_PORT = 7070
NODE_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,19}$")
DEFAULT_NETWORK: dict[str, Any] = {"pool_size": 4}
"""The ``network`` section every edge of ``dsec up`` gets unless one is given: an automatic
subnet, the built-in always-blocked ranges (plus the platform's own addresses) and a small
pool of prepared namespaces."""


def lock_path(data_dir: Path) -> Path:
    return data_dir / "up.lock"


def node_name_default(data_dir: Path) -> str:
    """``up-<8 hex>`` from the data directory's real path: stable across restarts, different
    for every data directory (so two instances never share a host resource)."""
    return "up-" + hashlib.sha256(str(data_dir.resolve()).encode()).hexdigest()[:8]


def check_node_name(name: str) -> str:
    if not NODE_NAME_RE.match(name):
        raise ValueError(f"node name {name!r}: 1-20 of a-z, 0-9 and -, starting with a letter or digit")
    return name


def lock_data_dir(data_dir: Path) -> Any:
    """Hold ``<data_dir>/up.lock`` (a :class:`claims.Claim`, released with the process):
    HostError in one line when another ``dsec up`` runs on this data directory."""
    from dsec.backends.common import claims

    data_dir.mkdir(parents=True, exist_ok=True)
    claim = claims.try_claim(lock_path(data_dir), "dsec up")
    if claim is None:
        raise _in_use(data_dir, claims.holder(lock_path(data_dir)) or "another process")
    return claim


def _in_use(data_dir: Path, who: str) -> Exception:
    from dsec.errors import HostError

    return HostError(f"{data_dir} is in use by another `dsec up` ({who}): stop it first, or give this one "
                     "another --data-dir (and --port)", path=str(data_dir))


def check_data_dir_free(data_dir: Path) -> None:
    """The same refusal as :func:`lock_data_dir`, without taking the lock (before detaching)."""
    who = data_dir_in_use(data_dir)
    if who:
        raise _in_use(data_dir, who)


def check_port_free(host: str, port: int) -> None:
    """HostError in one line when ``host:port`` is taken (another instance, another server):
    found before anything starts, rather than as uvicorn's exit inside the control plane."""
    import errno
    import socket

    from dsec.errors import HostError

    if port == 0:
        return
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise HostError(f"cannot listen on {host}:{port}: {exc.strerror}: give another --host/--port") from None
            raise HostError(f"port {port} on {host} is in use (another `dsec up`?): give this instance "
                            "another --port", port=port) from None


def data_dir_in_use(data_dir: Path) -> str:
    """Who holds ``data_dir``'s lock ("" when nobody): for a check before detaching."""
    from dsec.backends.common import claims

    path = lock_path(data_dir)
    if not path.exists():
        return ""
    claim = claims.try_claim(path, "probe", shared=True)
    if claim is None:
        return claims.holder(path) or "another process"
    claim.release()
    return ""


@dataclass
class Cluster:
    """A running all-in-one: the control plane and its edges, in this event loop."""

    url: str
    data_dir: Path
    admin_token: str
    control: Any
    edges: list[Any] = field(default_factory=list)
    node_name: str = ""
    lock: Any = None
    """The data directory's lock (released by :meth:`stop`)."""
    notes: list[str] = field(default_factory=list)
    """What did not start as configured by default (said at start)."""
    registry: Any = None
    """The OCI registry started beside it (``--registry``): a RegistryServer, or None."""

    async def stop(self) -> None:
        """Stop every edge (destroying its sandboxes), then the control plane. A failure is
        logged, not raised: the rest still stops (and says what it left behind)."""
        compat = getattr(getattr(self.control, "app", None), "state", None)
        service = getattr(compat, "sandboxfusion", None)
        if service is not None:
            try:  # its last deletes reach the edges while they still answer
                await service.aclose()
            except Exception:
                log.exception("the SandboxFusion API did not stop cleanly")
        for e in self.edges:
            try:
                await e.stop(destroy_all=True)
            except Exception:
                log.exception("edge %s did not stop cleanly; its runtime %s may have left mounts or cgroups "
                              "(a restart on this data directory cleans them up)", e.edge_id, e.config.runtime)
        try:
            await self.control.stop()
        except Exception:
            log.exception("the control plane did not stop cleanly")
        if self.registry is not None:
            try:
                await asyncio.to_thread(self.registry.stop)
            except Exception:
                log.exception("the registry (pid %s) did not stop cleanly", self.registry.pid)
            self.registry = None
        if self.lock is not None:
            self.lock.release()
            self.lock = None


async def start_cluster(
    data_dir: Path,
    *,
    port: int = DEFAULT_PORT,
    edges: int = 1,
    edge_port: int = 0,
    host: str = "127.0.0.1",
    pools: list[dict[str, Any]] | None = None,
    edge_overrides: dict[str, Any] | None = None,
    node_name: str | None = None,
    registry: bool = False,
    registry_port: int = 0,
    control_overrides: dict[str, Any] | None = None,
) -> Cluster:
    """Start a control plane on ``port`` and ``edges`` edges (ports picked freely). Each edge's
    runtime is ``<node_name>-<edge id>`` (default node name: :func:`node_name_default`); an
    edge gets :data:`DEFAULT_NETWORK` unless ``edge_overrides`` has a ``network`` (None: none).
    ``registry`` also starts an OCI registry on ``host:registry_port`` (0: a free port) with
    its data under ``<data_dir>/registry`` (:func:`dsec.images.registry_server.start_for_data_dir`),
    stopped with the rest. ``control_overrides``: more ControlConfig fields (e.g. a
    ``sandboxfusion`` section). HostError when another instance holds the data directory or one
    of the names."""
    from dsec.control.config import ControlConfig
    from dsec.control.server import serve_control
    from dsec.edge.config import EdgeConfig, PoolConfig
    from dsec.edge.server import serve_edge
    from dsec.errors import HostError

    data_dir = data_dir.absolute()
    node = check_node_name(node_name) if node_name is not None else node_name_default(data_dir)
    lock = lock_data_dir(data_dir)  # first: a second instance here must touch nothing
    try:
        check_port_free(host, port)
        if registry:
            check_port_free(host, registry_port)
        (data_dir / "control").mkdir(parents=True, exist_ok=True)
        token_file = admin_token_path(data_dir)
        ccfg = ControlConfig(data_dir=data_dir / "control", host=host, port=port, admin_token_file=token_file,
                             **(control_overrides or {}))
        control = await serve_control(ccfg)
    except BaseException:
        lock.release()
        raise
    started: list[Any] = []
    notes: list[str] = []
    overrides = {"network": DEFAULT_NETWORK, **(edge_overrides or {})}
    reg = None
    if registry:
        from dsec.images.registry_server import start_for_data_dir

        try:
            # First, so the edges load layers they lack from it (lazily); in this thread:
            # the registry is told to die with the thread that started it.
            reg = start_for_data_dir(data_dir, host=host, port=registry_port)
        except BaseException:
            await control.stop()
            lock.release()
            raise
        overrides.setdefault("registry", {"url": reg.url})
    try:
        key = ccfg.resolve_cluster_key() if hasattr(ccfg, "resolve_cluster_key") else control.control.key
        for i in range(edges):
            edge_id = f"e{i + 1}"
            state = data_dir if i == 0 else data_dir / "edges" / edge_id
            ecfg = EdgeConfig(
                edge_id=edge_id, cluster_key=key, host=host, port=edge_port, state_dir=state,
                runtime_name=f"{node}-{edge_id}", control_plane_url=control.url, destroy_on_shutdown=True,
                pools=[PoolConfig.model_validate(p) for p in pools or []], **overrides,
            )
            try:
                started.append(await serve_edge(ecfg))
            except HostError as exc:
                if "network" in (edge_overrides or {}) or "backends" in (edge_overrides or {}):
                    raise
                # The default network could not start (no libnftables, no free subnet...):
                # an all-in-one without it beats none; said at start (Cluster.notes).
                backends = [b.model_copy(update={"network": None}) if b.kind == "container" else b
                            for b in ecfg.backends]
                started.append(await serve_edge(ecfg.model_copy(update={"backends": backends})))
                notes.append(f"edge {edge_id} has no sandbox network ({exc}); its sandboxes are loopback-only")
        await _wait_registered(control, [e.edge_id for e in started])
    except BaseException:
        for e in started:
            with contextlib.suppress(Exception):
                await e.stop(destroy_all=True)
        await control.stop()
        if reg is not None:
            await asyncio.to_thread(reg.stop)
        lock.release()
        raise
    token = control.admin_token or (token_file.read_text().strip() if token_file.exists() else "")
    return Cluster(url=control.url, data_dir=data_dir, admin_token=token, control=control, edges=started,
                   node_name=node, lock=lock, notes=notes, registry=reg)


async def _wait_registered(control: Any, edge_ids: list[str], timeout: float = 15.0) -> None:
    """Until the control plane lists every edge (they register on start)."""
    import httpx

    from dsec.http import auth

    key = control.control.key
    tok, _ = auth.mint(key, sandbox_id="*", project="*", scope="edge-admin", ttl_s=60)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    async with httpx.AsyncClient(base_url=control.url, timeout=5) as http:
        while True:
            try:
                resp = await http.get("/v1/edges", headers={"authorization": f"Bearer {tok}"})
                if resp.status_code < 400:
                    body = resp.json()
                    items = body["items"] if isinstance(body, dict) else body
                    if set(edge_ids) <= {e.get("id") or e.get("edge_id") for e in items}:
                        return
            except httpx.HTTPError:
                pass
            if loop.time() > deadline:
                return  # the watcher will find them; creates answer 429 until then
            await asyncio.sleep(0.1)


EDGE_IDENTITY = ("edge_id", "cluster_key", "host", "port", "url", "state_dir", "runtime_name", "control_plane_url",
                 "destroy_on_shutdown", "pools")
"""EdgeConfig fields `dsec up` sets for each edge itself (an --edge-config file may not)."""


def _read_config(path: Path, option: str) -> Any:
    import json
    import tomllib

    import click

    try:
        text = path.read_text()
        return tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    except (OSError, ValueError) as exc:
        raise click.BadParameter(f"{path}: {exc}", param_hint=option) from None


def load_network_config(path: Path) -> dict[str, Any]:
    """A ``network`` section (NetworkConfig fields, optionally under ``network``) from a JSON
    or TOML file, checked now; ``subnet`` left out means ``"auto"``."""
    import click
    from pydantic import ValidationError

    from dsec.backends.common.network import NetworkConfig

    data = _read_config(path, "--network-config")
    data = data.get("network", data) if isinstance(data, dict) else data
    if not isinstance(data, dict):
        raise click.BadParameter(f"{path}: expected an object of network settings (docs/EDGE.md, \"Network\")",
                                 param_hint="--network-config")
    try:
        NetworkConfig.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(x) for x in first.get("loc", ()))
        raise click.BadParameter(f"{path}: {where}: {first['msg']}", param_hint="--network-config") from None
    return dict(data)


CONTROL_IDENTITY = ("data_dir", "host", "port", "admin_token_file")
"""ControlConfig fields `dsec up` sets itself (a --control-config file may not)."""


def load_control_overrides(path: Path) -> dict[str, Any]:
    """ControlConfig fields from a JSON or TOML file (optionally under ``control``), checked
    now, e.g. ``[sandboxfusion]`` settings (docs/COMPAT.md)."""
    import click
    from pydantic import ValidationError

    from dsec.control.config import ControlConfig

    data = _read_config(path, "--control-config")
    data = dict(data.get("control", data)) if isinstance(data, dict) else data
    if not isinstance(data, dict):
        raise click.BadParameter(f"{path}: expected an object of ControlConfig fields", param_hint="--control-config")
    fixed = sorted(set(data) & set(CONTROL_IDENTITY))
    if fixed:
        raise click.BadParameter(f"{path}: `dsec up` sets {', '.join(fixed)} itself", param_hint="--control-config")
    try:
        ControlConfig.model_validate({"data_dir": "/nonexistent", **data})
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(x) for x in first.get("loc", ()))
        raise click.BadParameter(f"{path}: {where}: {first['msg']}", param_hint="--control-config") from None
    return data


def load_edge_overrides(path: Path) -> dict[str, Any]:
    """EdgeConfig fields from a JSON or TOML file (optionally under ``edge``) for every edge
    of the all-in-one, checked now (a typo fails before anything starts)."""
    import click
    from pydantic import ValidationError

    from dsec.edge.config import EdgeConfig

    data = _read_config(path, "--edge-config")
    data = dict(data.get("edge", data)) if isinstance(data, dict) else data
    if not isinstance(data, dict):
        raise click.BadParameter(f"{path}: expected an object of EdgeConfig fields", param_hint="--edge-config")
    fixed = sorted(set(data) & set(EDGE_IDENTITY))
    if fixed:
        raise click.BadParameter(f"{path}: `dsec up` sets {', '.join(fixed)} itself", param_hint="--edge-config")
    try:
        EdgeConfig.model_validate({"edge_id": "e1", "cluster_key": "00" * 32, **data})
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(x) for x in first.get("loc", ()))
        raise click.BadParameter(f"{path}: {where}: {first['msg']}", param_hint="--edge-config") from None
    return data


def ccfg_e2b(cluster: Cluster) -> bool:
    """Whether the control plane serves E2B's clients (``ControlConfig.e2b.enabled``)."""
    cfg = getattr(getattr(cluster.control, "control", None), "config", None)
    e2b = getattr(cfg, "e2b", None)
    return bool(getattr(e2b, "enabled", False))


READY_FILE = "up.ready"
"""Written (the process's pid) once every edge has registered: the all-in-one takes sandboxes."""


async def run_foreground(data_dir: Path, *, port: int, edges: int, host: str, say: Any,
                         edge_overrides: dict[str, Any] | None = None, node_name: str | None = None,
                         registry: bool = False, registry_port: int = 0,
                         control_overrides: dict[str, Any] | None = None) -> None:
    cluster = await start_cluster(data_dir, port=port, edges=edges, host=host, edge_overrides=edge_overrides,
                                  node_name=node_name, registry=registry, registry_port=registry_port,
                                  control_overrides=control_overrides)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    say(f"dsec up: control plane {cluster.url}, edges: {', '.join(e.url for e in cluster.edges)}")
    nets = []
    for e in cluster.edges:
        net = getattr(e.service.backends.by_kind.get("container"), "net", None)
        nets.append(f"{e.edge_id} {net.subnet}" if net is not None and e.config.network is not None
                    else f"{e.edge_id} none")
    say(f"node {cluster.node_name} (runtimes {', '.join(e.config.runtime for e in cluster.edges)}); "
        f"sandbox networks: {', '.join(nets)}")
    for note in cluster.notes:
        say(f"dsec up: {note}")
    if cluster.registry is not None:
        host_port = cluster.registry.url.split("://", 1)[1]
        say(f"registry {cluster.registry.url} (data in {cluster.registry.data_dir}); edges load layers they "
            f"lack from it lazily: dsec image push NAME:TAG --registry {host_port}/NAME")
    say(f"admin token in {admin_token_path(cluster.data_dir)} (export DSEC_URL={cluster.url} "
        f"DSEC_TOKEN=$(cat {admin_token_path(cluster.data_dir)}))")
    sf = getattr(cluster.control.app.state, "sandboxfusion", None)
    if sf is not None:
        say(f"SandboxFusion API: export SANDBOX_FUSION_ENDPOINT={cluster.url}{sf.config.prefix}/"
            f"$(cat {admin_token_path(cluster.data_dir)}) (any project token; docs/COMPAT.md)")
    listener = getattr(cluster.control, "sandboxfusion_listener", None)
    if listener is not None:
        say(f"SandboxFusion without a token (SkyRL): {listener.url}/run_code, charged to project "
            f"{listener.token.project!r}, peers in {', '.join(sf.config.listener.allow) if sf else '?'}")
    if ccfg_e2b(cluster):
        say(f"E2B clients: eval \"$(DSEC_URL={cluster.url} DSEC_TOKEN=$(cat {admin_token_path(cluster.data_dir)}) "
            "dsec env e2b)\" (docs/COMPAT.md, \"E2B\")")
    ready = cluster.data_dir / READY_FILE
    ready.write_text(f"{os.getpid()}\n")  # `dsec up --detach` returns once this names its child
    try:
        await stop.wait()
    finally:
        ready.unlink(missing_ok=True)
        say("dsec up: stopping (destroying sandboxes)")
        await cluster.stop()
