"""``python -m dsec.edge --config FILE | options``: run one edge agent in the foreground.

The config file is JSON or TOML holding :class:`EdgeConfig` fields; command-line
options override it. The cluster key comes from the file, ``--cluster-key-file``,
``DSEC_CLUSTER_KEY`` (hex) or ``DSEC_CLUSTER_KEY_FILE``. SIGINT/SIGTERM stop the
edge cleanly; sandboxes keep running for the next start unless
``--destroy-on-shutdown``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
import tomllib
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from dsec.edge.config import EdgeConfig
from dsec.http import loop as dsec_loop


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dsec.edge", description="Run a DSec edge agent.")
    p.add_argument("--config", type=Path, help="JSON or TOML file of EdgeConfig fields")
    p.add_argument("--edge-id")
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.add_argument("--url", help="advertised base URL (default http://HOST:PORT)")
    p.add_argument("--state-dir", type=Path)
    p.add_argument("--run-dir", type=Path)
    p.add_argument("--runtime-name")
    p.add_argument("--cluster-key-file", type=Path, help="file holding the cluster key in hex")
    p.add_argument("--control-plane-url")
    p.add_argument("--max-sandboxes", type=int)
    p.add_argument("--cpu-capacity", type=float)
    p.add_argument("--memory-capacity", type=int)
    p.add_argument("--disk-capacity", type=int)
    p.add_argument("--destroy-on-shutdown", action="store_true", default=None)
    p.add_argument("--log-level", default="info")
    return p


def load_config(args: argparse.Namespace) -> EdgeConfig:
    data: dict[str, Any] = {}
    if args.config is not None:
        text = args.config.read_text()
        data = tomllib.loads(text) if args.config.suffix == ".toml" else json.loads(text)
        data = dict(data.get("edge", data))
    for key in ("edge_id", "host", "port", "url", "state_dir", "run_dir", "runtime_name", "control_plane_url",
                "max_sandboxes", "cpu_capacity", "memory_capacity", "disk_capacity", "destroy_on_shutdown"):
        value = getattr(args, key)
        if value is not None:
            data[key] = value
    if args.cluster_key_file is not None:
        data["cluster_key"] = args.cluster_key_file.read_text().strip()
    return EdgeConfig.from_env(**data)


async def _run(config: EdgeConfig, log_level: str) -> None:
    from dsec.edge.server import serve_edge

    handle = await serve_edge(config, log_level=log_level)
    logging.getLogger("dsec.edge").info("edge %s serving at %s", config.edge_id, handle.url)
    print(f"dsec edge {config.edge_id} at {handle.url}", file=sys.stderr, flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    waiter = asyncio.ensure_future(stop.wait())
    await asyncio.wait({waiter, handle.task}, return_when=asyncio.FIRST_COMPLETED)
    waiter.cancel()
    await handle.stop()


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = load_config(args)
    except (ValidationError, OSError, ValueError) as exc:
        print(f"dsec edge: bad configuration: {exc}", file=sys.stderr)
        return 2
    dsec_loop.run(_run(config, args.log_level.lower()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
