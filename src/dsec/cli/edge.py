"""``dsec edge``: edges on other hosts — join, list, drain, remove, bootstrap tokens (docs/EDGE.md, "Joining").

``dsec edge join URL --token dsb_...`` runs on the new host: it asks the control
plane for an edge id, the cluster key and the replicas' addresses, writes them
with the edge's settings to ``<state-dir>/edge.json`` (0600: it holds the key)
and runs the edge in the foreground. Run again on a state directory that has
joined already, it starts that edge without using the token again. The other
commands are an operator's (``DSEC_URL``/``DSEC_TOKEN``: the root project's token).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import click

from dsec.cli.term import console, out, say, table

CONFIG_NAME = "edge.json"


def _duration(text: str) -> float:
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    t = text.strip().lower()
    try:
        return float(t[:-1]) * units[t[-1]] if t and t[-1] in units else float(t)
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a duration (e.g. 90s, 30m, 1h, 2d)") from None


def _api() -> Any:
    """An httpx client of the control plane with the operator's token (DSEC_URL may list replicas)."""
    import httpx

    from dsec.cli.paths import DEFAULT_URL, local_token

    token = local_token()
    if not token:
        raise click.ClickException("no operator token: set DSEC_TOKEN to the root project's token")
    url = (os.environ.get("DSEC_URL") or DEFAULT_URL).split(",")[0].strip().rstrip("/")
    return httpx.Client(base_url=url, headers={"authorization": f"Bearer {token}"}, timeout=30.0)


def _check(resp: Any) -> Any:
    if resp.status_code >= 400:
        from dsec.errors import decode_error

        try:
            body = resp.json()
        except ValueError:
            body = resp.text
        raise decode_error(resp.status_code, body, dict(resp.headers), where=str(resp.url))
    return resp.json() if resp.content else None


@click.group("edge")
def edge_group() -> None:
    """Edges: join this host to a cluster, list, drain, remove; bootstrap tokens."""


# ------------------------------------------------------------------ join ----


@edge_group.command("join")
@click.argument("url")
@click.option("--token", required=True, envvar="DSEC_EDGE_TOKEN", help="An edge bootstrap token (dsb_...).")
@click.option("--edge-id", default=None, help="Ask for this id (default: the control plane picks one).")
@click.option("--state-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="The edge's state directory (default $DSEC_STATE_DIR or /var/lib/dsec).")
@click.option("--host", default="0.0.0.0", show_default=True, help="Address the edge listens on.")
@click.option("--port", type=int, default=7071, show_default=True)
@click.option("--advertise", "advertise", default=None, metavar="URL",
              help="Where the control plane and SDKs reach this edge (default http://<host>:<port>; "
                   "required with --host 0.0.0.0).")
@click.option("--config", "config_file", type=click.Path(dir_okay=False, exists=True, path_type=Path), default=None,
              help="JSON or TOML of more EdgeConfig fields (capacities, backends, pools, network...).")
@click.option("--label", multiple=True, help="KEY=VALUE placement label; repeat.")
@click.option("--no-start", is_flag=True, help="Only join and write the configuration.")
def join(url: str, token: str, edge_id: str | None, state_dir: Path | None, host: str, port: int,
         advertise: str | None, config_file: Path | None, label: tuple[str, ...], no_start: bool) -> None:
    """Join this host to the cluster whose control plane is at URL, then run its edge."""
    from dsec.cli.paths import data_dir_default

    state = (state_dir or data_dir_default()).absolute()
    path = state / CONFIG_NAME
    if path.exists():
        joined = json.loads(path.read_text())
        say(f"{state} joined already as edge {joined['edge_id']}: starting it (remove {path} to join again)")
    else:
        if advertise is None:
            if host in ("0.0.0.0", "::"):
                raise click.BadParameter("give --advertise http://ADDRESS:PORT (the edge listens on every address)",
                                         param_hint="--advertise")
            advertise = f"http://{host}:{port}"
        labels = dict(x.split("=", 1) for x in label if "=" in x)
        joined = join_cluster(url, token, edge_id=edge_id, advertise=advertise, labels=labels)
        extra: dict[str, Any] = {}
        if config_file is not None:
            from dsec.cli.up import load_edge_overrides

            extra = load_edge_overrides(config_file)
        write_config(path, {**extra, "edge_id": joined["edge_id"], "cluster_key": joined["cluster_key"],
                            "host": host, "port": port, "url": advertise, "state_dir": str(state),
                            "control_plane_url": ",".join(joined["control_plane_urls"]), "labels": labels})
        console.print(f"joined as edge {joined['edge_id']} (control plane {', '.join(joined['control_plane_urls'])}); "
                      f"configuration in {path}")
    if no_start:
        return
    from dsec.edge.__main__ import main as edge_main

    sys.exit(edge_main(["--config", str(path)]))


def join_cluster(url: str, token: str, *, edge_id: str | None, advertise: str,
                 labels: dict[str, str] | None = None) -> dict[str, Any]:
    """``POST /v1/edges/join``; the answer (edge_id, cluster_key, control_plane_urls, epoch)."""
    import httpx

    body = {"edge_id": edge_id, "url": advertise, "labels": labels or {}}
    last: Exception | None = None
    for base in [u.strip().rstrip("/") for u in url.split(",") if u.strip()]:
        try:
            resp = httpx.post(f"{base}/v1/edges/join", json=body, headers={"authorization": f"Bearer {token}"},
                              timeout=30.0)
        except httpx.HTTPError as exc:
            last = exc
            continue
        data: dict[str, Any] = _check(resp)
        return data
    raise click.ClickException(f"cannot reach the control plane at {url}: {last}")


def write_config(path: Path, data: dict[str, Any]) -> None:
    """The edge's configuration, 0600 from the start (it holds the cluster key)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=2)
    os.replace(tmp, path)


# ------------------------------------------------------------ operators ----


@edge_group.command("ls")
@click.option("--json", "as_json", is_flag=True)
def ls(as_json: bool) -> None:
    """The cluster's edges: status, epoch, what is placed there."""
    with _api() as c:
        edges = _check(c.get("/v1/edges"))
    if as_json:
        out.print_json(json.dumps(edges))
        return
    t = table("edge", "status", "draining", "sandboxes", "epoch", "last seen", "url", title="edges")
    now = time.time()
    for e in edges:
        seen = "never" if e.get("last_seen") is None else f"{now - e['last_seen']:.1f}s ago"
        t.add_row(e["id"], e["status"], "yes" if e["draining"] else "", str(e["committed"]["sandboxes"]),
                  str(e.get("epoch", 0)), seen, e["url"])
    out.print(t)


@edge_group.command("drain")
@click.argument("edge_id")
@click.option("--wait", is_flag=True, help="Wait until no sandbox is left there.")
@click.option("--timeout", "timeout", default="1h", show_default=True, help="How long --wait waits.")
@click.option("--undo", is_flag=True, help="Take new sandboxes again.")
def drain(edge_id: str, wait: bool, timeout: str, undo: bool) -> None:
    """Stop placing sandboxes on EDGE_ID. Its sandboxes are not moved (their processes and memory
    cannot move): they run until deleted or expired; --wait waits for that."""
    limit = _duration(timeout)
    with _api() as c:
        _check(c.post(f"/v1/edges/{edge_id}/drain", json={"draining": not undo}))
        if undo:
            console.print(f"edge {edge_id} takes new sandboxes again")
            return
        console.print(f"edge {edge_id} is draining: no new sandboxes are placed there")
        if not wait:
            return
        deadline = time.monotonic() + limit
        while True:
            left = _check(c.get(f"/v1/edges/{edge_id}/sandboxes"))
            n = sum(left.values())
            if n == 0:
                console.print(f"edge {edge_id} is empty: `dsec edge rm {edge_id}` takes it out")
                return
            if time.monotonic() > deadline:
                raise click.ClickException(f"edge {edge_id} still holds {n} sandbox(es) after {timeout} ({left})")
            time.sleep(1.0)


@edge_group.command("rm")
@click.argument("edge_id")
@click.option("--force", is_flag=True, help="Even with sandboxes there: they are reported lost (SandboxLost).")
def rm(edge_id: str, force: bool) -> None:
    """Take EDGE_ID out of the cluster (refused while it holds sandboxes: drain it first)."""
    with _api() as c:
        info = _check(c.delete(f"/v1/edges/{edge_id}", params={"force": "true"} if force else None))
    console.print(f"edge {info['id']} removed (epoch {info['epoch']}); it reports again only after `dsec edge join`")


@edge_group.group("token")
def token() -> None:
    """Bootstrap tokens that let new edges join."""


@token.command("create")
@click.option("--ttl", default="1h", show_default=True, help="How long it can be used (e.g. 30m, 1h, 7d).")
@click.option("--uses", type=click.IntRange(1, 100_000), default=1, show_default=True, help="How many joins.")
@click.option("--multi", is_flag=True, help="Any number of joins until it expires (a fleet's image).")
@click.option("--name", default="")
def token_create(ttl: str, uses: int, multi: bool, name: str) -> None:
    """Mint an edge bootstrap token (printed once; stored hashed)."""
    with _api() as c:
        info = _check(c.post("/v1/edges/tokens", json={"ttl_s": _duration(ttl), "uses": None if multi else uses,
                                                        "name": name}))
    say(f"edge bootstrap token {info['id']} ({'any number of' if multi else uses} join(s), expires in {ttl}):")
    print(info["token"])


@token.command("ls")
def token_ls() -> None:
    with _api() as c:
        toks = _check(c.get("/v1/edges/tokens"))
    t = table("id", "name", "used", "uses", "expires", "revoked", title="edge bootstrap tokens")
    for x in toks:
        t.add_row(x["id"], x["name"], str(x["used"]), "any" if x["uses"] is None else str(x["uses"]),
                  time.strftime("%Y-%m-%d %H:%M", time.localtime(x["expires_at"])), "yes" if x["revoked_at"] else "")
    out.print(t)


@token.command("revoke")
@click.argument("token_id")
def token_revoke(token_id: str) -> None:
    with _api() as c:
        _check(c.delete(f"/v1/edges/tokens/{token_id}"))
    console.print(f"revoked {token_id}")
