"""``python -m dsec.control``: run one control-plane replica in the foreground.

Settings come from ``--config FILE`` (JSON of ControlConfig), then flags, then
the environment (DSEC_CLUSTER_KEY / DSEC_CLUSTER_KEY_FILE, DSEC_CONTROL_DATA).
The two other secrets may come from the environment too, for what neither the
file nor a flag set: ``DSEC_DATABASE_URL`` (or ``DSEC_DATABASE_URL_FILE``, a
file holding it: a mounted Kubernetes Secret) and ``DSEC_BOOTSTRAP_TOKEN`` (or
``DSEC_BOOTSTRAP_TOKEN_FILE``), so a password never sits in a config file or on
a command line. SIGINT/SIGTERM stop it cleanly.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

from dsec.control.config import ControlConfig
from dsec.control.server import serve_control
from dsec.http import loop as dsec_loop


def parse_args(argv: list[str] | None = None) -> ControlConfig:
    ap = argparse.ArgumentParser(prog="python -m dsec.control", description="DSec control plane")
    ap.add_argument("--config", type=Path, help="JSON file of ControlConfig fields")
    ap.add_argument("--data-dir", type=Path)
    ap.add_argument("--database-url", help="sqlite:///PATH (default under --data-dir) or postgresql://...")
    ap.add_argument("--host")
    ap.add_argument("--port", type=int)
    ap.add_argument("--no-watcher", action="store_true", help="leave the watcher to other replicas")
    ap.add_argument("--log-level", default=None)
    a = ap.parse_args(argv)
    data: dict[str, Any] = json.loads(a.config.read_text()) if a.config else {}
    for name in ("data_dir", "database_url", "host", "port", "log_level"):
        value = getattr(a, name)
        if value is not None:
            data[name] = value
    if a.no_watcher:
        data["watcher"] = False
    for name, var in (("database_url", "DSEC_DATABASE_URL"), ("bootstrap_token", "DSEC_BOOTSTRAP_TOKEN")):
        if data.get(name) is None:
            value = _from_env(var)
            if value is not None:
                data[name] = value
    return ControlConfig.model_validate(data)


def _from_env(var: str) -> str | None:
    """``$VAR``, else the contents of the file ``$VAR_FILE`` (stripped); None when neither is set."""
    if os.environ.get(var):
        return os.environ[var]
    path = os.environ.get(f"{var}_FILE")
    if path:
        try:
            return Path(path).read_text().strip()
        except OSError as exc:
            raise SystemExit(f"python -m dsec.control: {var}_FILE={path}: {exc.strerror}") from None
    return None


async def run(config: ControlConfig) -> None:
    handle = await serve_control(config)
    print(f"dsec control plane listening on {handle.url} (store: {config.db_url.split('@')[-1]})", file=sys.stderr)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    waiter = asyncio.create_task(handle.wait())
    await asyncio.wait([asyncio.create_task(stop.wait()), waiter], return_when=asyncio.FIRST_COMPLETED)
    await handle.stop()


def main(argv: list[str] | None = None) -> None:
    config = parse_args(argv)
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    dsec_loop.run(run(config))


if __name__ == "__main__":
    main()
