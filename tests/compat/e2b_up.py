"""Shared by the E2B tests: ``dsec up`` (a subprocess) with the toolchain layers E2B's
templates use (``tc-base`` + python, jupyter), and the client environment ``dsec env e2b``
prints. The layers are built once (debootstrap + apt) and cached like the SandboxFusion tests'."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import dsec_up

CACHE = Path(os.environ.get("DSEC_STATE_DIR", "/var/lib/dsec")) / "cache" / "toolchain-layers"
TOOLCHAINS = ("python", "jupyter")


def toolchains() -> Any:
    from dsec.errors import LayerNotFound
    from dsec.images.store import LocalLayerStore
    from dsec.images.toolchains import BASE_NAME, build_toolchains, toolkit_name

    store = LocalLayerStore(CACHE)
    try:
        base = store.resolve(f"{BASE_NAME}:bookworm")
        for n in TOOLCHAINS:
            if store.resolve(f"{toolkit_name(n)}:bookworm").parents[:1] != (base.digest,):
                raise LayerNotFound(n)
        return store
    except LayerNotFound:
        pass
    if shutil.which("debootstrap") is None:
        pytest.skip("needs debootstrap (or cached toolchain layers) to build the toolchains")
    build_toolchains(store, TOOLCHAINS)
    return store


def client_env(url: str, dsec_token: str) -> dict[str, str]:
    """What ``dsec env e2b`` prints (the command itself, run as a user would)."""
    out = subprocess.run([sys.executable, "-m", "dsec.cli.main", "env", "e2b", "--shell", "dotenv"],
                         env={**os.environ, "DSEC_URL": url, "DSEC_TOKEN": dsec_token}, capture_output=True,
                         text=True, timeout=60, check=True).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if line)


@contextlib.contextmanager
def e2b_up(*extra: str) -> Iterator[dict[str, str]]:
    """``dsec up`` holding the layers; yields its env plus E2B's four variables."""
    from dsec.images.store import LocalLayerStore
    from dsec.images.toolchains import copy_toolchains

    cache = toolchains()
    with tempfile.TemporaryDirectory(prefix="dsec-test-e2b-") as tmp:
        data = Path(tmp)
        dst = LocalLayerStore(data / "layers")
        copy_toolchains(cache, dst, TOOLCHAINS)
        dst.close()
        with dsec_up(data, {**os.environ, "DSEC_STATE_DIR": str(data)}, *extra) as env:
            yield {**env, **client_env(env["DSEC_URL"], env["DSEC_TOKEN"])}
