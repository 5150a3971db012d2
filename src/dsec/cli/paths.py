"""Where the local all-in-one (``dsec up``) keeps what the CLI reads: its data directory and
admin token. Standard library only: every CLI command imports it."""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_URL = "http://127.0.0.1:7070"
"""The control plane of a local ``dsec up`` with its default port (the SDK's default too)."""


def data_dir_default() -> Path:
    return Path(os.environ.get("DSEC_STATE_DIR", "/var/lib/dsec"))


def admin_token_path(data_dir: Path) -> Path:
    return data_dir / "control" / "admin.token"


def local_token() -> str | None:
    """$DSEC_TOKEN, else the local all-in-one's admin token when this user may read it."""
    token = os.environ.get("DSEC_TOKEN")
    if token:
        return token
    path = admin_token_path(data_dir_default())
    try:
        return path.read_text().strip() or None
    except OSError:
        return None
