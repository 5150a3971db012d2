"""``dsec up --registry``: a registry beside the all-in-one, its data under the data directory,
stopped with it; a layer pushed to it is pulled back by another store with equal digests."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import cli_all_in_one
from dsec.images.registry import RegistryClient

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(shutil.which("docker-registry") is None, reason="needs docker-registry"),
]


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def _registry_pid(root: Path) -> int | None:
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(b"docker-registry" in c for c in cmd[:1]) and str(root / "config.yml").encode() in cmd:
            return int(p)
    return None


def test_up_with_registry_push_pull(tmp_path: Path) -> None:
    with cli_all_in_one("dsec-test-upreg-", extra=["--registry"]) as env:
        data = Path(env["DSEC_STATE_DIR"])
        url_file = data / "registry/url"
        assert url_file.is_file(), (data / "up.log").read_text()
        url = url_file.read_text().strip()
        root = data / "registry"
        pid = _registry_pid(root)
        assert pid is not None and _alive(pid)
        with RegistryClient(url) as c:
            c.ping()
        host = url.split("://", 1)[1]
        run = [sys.executable, "-m", "dsec.cli.main", "image"]
        r = subprocess.run([*run, "push", "busybox:latest", "--registry", f"{host}/base", "-q"], env=env,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        other = {**env, "DSEC_STATE_DIR": str(tmp_path / "other")}
        r = subprocess.run([*run, "pull", f"{host}/base:latest", "-q"], env=other, capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0, r.stderr
        local = subprocess.run([*run, "inspect", "busybox:latest"], env=env, capture_output=True, text=True)
        assert r.stdout.strip() in local.stdout
        assert (root / "data/docker/registry/v2/repositories/base").is_dir()
    # Stopped with the all-in-one; its data stays (the temporary data directory went with the test).
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid)
