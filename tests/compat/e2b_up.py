"""Shared by the E2B tests: ``dsec up`` (a subprocess) with the toolchain layers E2B's
templates use (``tc-base`` + python, jupyter), and the client environment ``dsec env e2b``
prints. The layers are built once (debootstrap + apt) and cached like the SandboxFusion tests'."""

from __future__ import annotations

import contextlib
import json
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


TINY = "tiny"
"""A template with a 32 MiB disk (the quota tests)."""
EXTERNAL = "DSEC_E2B_UP"
"""JSON of a running server's env (DSEC_URL, DSEC_TOKEN, E2B's four): the tests use it instead
of starting their own (the floor run: clients in another venv, the server in this one)."""


def e2b_test_config(where: Path) -> Path:
    """The control-plane config the E2B tests run with: E2B's templates plus ``tiny``."""
    from dsec.compat.e2b import E2BConfig

    templates = {k: v.model_dump() for k, v in E2BConfig().templates.items()}
    templates[TINY] = {**templates["base"], "memory_mb": 256, "disk_mb": 32}
    cfg = where / "e2b-control.json"
    cfg.write_text(json.dumps({"e2b": {"templates": templates, "ready_timeout_s": 5}}))
    return cfg


@contextlib.contextmanager
def e2b_test_up() -> Iterator[dict[str, str]]:
    """The server of tests/compat/test_e2b.py: $DSEC_E2B_UP's, else ``e2b_up`` with ``e2b_test_config``."""
    given = os.environ.get(EXTERNAL)
    if given:
        yield json.loads(given)
        return
    with tempfile.TemporaryDirectory(prefix="dsec-test-e2b-cfg-") as tmp, \
            e2b_up("--control-config", str(e2b_test_config(Path(tmp)))) as env:
        yield env


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
