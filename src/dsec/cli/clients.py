"""The CLI's SDK clients, from $DSEC_URL / $DSEC_TOKEN or the local all-in-one."""

from __future__ import annotations

import os
from typing import Any


def client() -> Any:
    """A sync SDK client from $DSEC_URL/$DSEC_TOKEN, falling back to the local all-in-one's admin token."""
    from dsec.cli.paths import local_token
    from dsec.sdk import Client

    return Client(os.environ.get("DSEC_URL"), local_token())


def lean() -> Any:
    """The lean client (cli/lean.py) from the same settings as :func:`client`."""
    from dsec.cli.lean import lean_client

    return lean_client()


__all__ = ["client", "lean"]
