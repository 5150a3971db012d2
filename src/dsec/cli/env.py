"""``dsec env e2b``: the environment lines that point E2B's released clients at DSec.

Prints ``export`` lines (``eval "$(dsec env e2b)"``): ``E2B_API_URL`` and
``E2B_SANDBOX_URL`` are the control plane's URL (one listener serves both of E2B's planes),
``E2B_API_KEY`` is the project token in E2B's ``e2b_<hex>`` shape, ``E2B_DOMAIN`` an
unresolvable name so a client that misses ``E2B_SANDBOX_URL`` fails on DNS instead of
sending sandbox traffic to E2B's cloud. Imports nothing heavy; makes no request.
"""

from __future__ import annotations

import os
import shlex

import click

from dsec.errors import AuthError


@click.group("env")
def env_group() -> None:
    """Environment lines for other services' clients pointed at DSec."""


@env_group.command("e2b")
@click.option("--url", default=None, help="The control plane's URL (default: $DSEC_URL, else http://127.0.0.1:7070).")
@click.option("--token", default=None, help="A project API token, dsk_... (default: $DSEC_TOKEN); `dsec token create` "
                                            "makes one for a project.")
@click.option("--shell", "fmt", type=click.Choice(["sh", "dotenv"]), default="sh", show_default=True,
              help="sh: export lines; dotenv: KEY=value lines.")
def env_e2b(url: str | None, token: str | None, fmt: str) -> None:
    """E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY and E2B_DOMAIN for E2B's clients (e2b>=2.27,<3,
    e2b-code-interpreter>=2.9): eval "$(dsec env e2b)". docs/COMPAT.md, "E2B"."""
    from dsec.compat.e2b.keys import api_key_of

    url = (url or os.environ.get("DSEC_URL") or "http://127.0.0.1:7070").split(",")[0].rstrip("/")
    token = token or os.environ.get("DSEC_TOKEN")
    if not token:
        raise AuthError("no API token: pass --token dsk_... or set DSEC_TOKEN (`dsec token create` makes one)")
    if not token.startswith("dsk_"):
        raise AuthError("--token must be a project API token (dsk_...), not a sandbox or edge token")
    lines = {"E2B_API_URL": url, "E2B_SANDBOX_URL": url, "E2B_API_KEY": api_key_of(token), "E2B_DOMAIN": "dsec.invalid"}
    for k, v in lines.items():
        click.echo(f"export {k}={shlex.quote(v)}" if fmt == "sh" else f"{k}={v}")
