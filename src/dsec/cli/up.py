"""``dsec up``: the embedded all-in-one (control plane + edges + SQLite) on this machine.

Everything runs in one asyncio process: the control plane and each edge are
uvicorn servers in the same loop (``serve_control`` / ``serve_edge``). State
lives under one data directory: ``control/`` (SQLite, cluster key, admin
token) and the edges' records and layer store (the first edge uses the data
directory itself, so ``dsec image build`` layers are visible to it).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_PORT = 7070


def data_dir_default() -> Path:
    return Path(os.environ.get("DSEC_STATE_DIR", "/var/lib/dsec"))


def admin_token_path(data_dir: Path) -> Path:
    return data_dir / "control" / "admin.token"


@dataclass
class Cluster:
    """A running all-in-one: the control plane and its edges, in this event loop."""

    url: str
    data_dir: Path
    admin_token: str
    control: Any
    edges: list[Any] = field(default_factory=list)

    async def stop(self) -> None:
        for e in self.edges:
            with contextlib.suppress(Exception):
                await e.stop(destroy_all=True)
        with contextlib.suppress(Exception):
            await self.control.stop()


async def start_cluster(
    data_dir: Path,
    *,
    port: int = DEFAULT_PORT,
    edges: int = 1,
    edge_port: int = 0,
    host: str = "127.0.0.1",
    pools: list[dict[str, Any]] | None = None,
    edge_overrides: dict[str, Any] | None = None,
) -> Cluster:
    """Start a control plane on ``port`` and ``edges`` edges (ports picked freely)."""
    from dsec.control.config import ControlConfig
    from dsec.control.server import serve_control
    from dsec.edge.config import EdgeConfig, PoolConfig
    from dsec.edge.server import serve_edge

    data_dir = data_dir.absolute()
    (data_dir / "control").mkdir(parents=True, exist_ok=True)
    token_file = admin_token_path(data_dir)
    ccfg = ControlConfig(data_dir=data_dir / "control", host=host, port=port, admin_token_file=token_file)
    control = await serve_control(ccfg)
    started: list[Any] = []
    try:
        key = ccfg.resolve_cluster_key() if hasattr(ccfg, "resolve_cluster_key") else control.control.key
        for i in range(edges):
            edge_id = f"e{i + 1}"
            state = data_dir if i == 0 else data_dir / "edges" / edge_id
            ecfg = EdgeConfig(
                edge_id=edge_id, cluster_key=key, host=host, port=edge_port, state_dir=state,
                runtime_name=f"up-{edge_id}", control_plane_url=control.url, destroy_on_shutdown=True,
                pools=[PoolConfig.model_validate(p) for p in pools or []], **(edge_overrides or {}),
            )
            started.append(await serve_edge(ecfg))
        await _wait_registered(control, [e.edge_id for e in started])
    except BaseException:
        for e in started:
            with contextlib.suppress(Exception):
                await e.stop(destroy_all=True)
        await control.stop()
        raise
    token = control.admin_token or (token_file.read_text().strip() if token_file.exists() else "")
    return Cluster(url=control.url, data_dir=data_dir, admin_token=token, control=control, edges=started)


async def _wait_registered(control: Any, edge_ids: list[str], timeout: float = 15.0) -> None:
    """Until the control plane lists every edge (they register on start)."""
    import httpx

    from dsec import auth

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


def load_edge_overrides(path: Path) -> dict[str, Any]:
    """EdgeConfig fields from a JSON or TOML file (optionally under ``edge``) for every edge
    of the all-in-one, checked now (a typo fails before anything starts)."""
    import json
    import tomllib

    import click
    from pydantic import ValidationError

    from dsec.edge.config import EdgeConfig

    try:
        text = path.read_text()
        data = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    except (OSError, ValueError) as exc:
        raise click.BadParameter(f"{path}: {exc}", param_hint="--edge-config") from None
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


async def run_foreground(data_dir: Path, *, port: int, edges: int, host: str, say: Any,
                         edge_overrides: dict[str, Any] | None = None) -> None:
    cluster = await start_cluster(data_dir, port=port, edges=edges, host=host, edge_overrides=edge_overrides)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    say(f"dsec up: control plane {cluster.url}, edges: {', '.join(e.url for e in cluster.edges)}")
    say(f"admin token in {admin_token_path(cluster.data_dir)} (export DSEC_URL={cluster.url} "
        f"DSEC_TOKEN=$(cat {admin_token_path(cluster.data_dir)}))")
    try:
        await stop.wait()
    finally:
        say("dsec up: stopping (destroying sandboxes)")
        await cluster.stop()
