"""examples/rl_rollouts.py runs as its docstring says, against `dsec up` with the python
toolchain (code rewards through the SandboxFusion endpoint, SWE episodes through
DSecDeployment). The toolchain layers are the SandboxFusion tests' cache
($DSEC_STATE_DIR/cache/toolchain-layers: debootstrap + apt once)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from conftest import dsec_up

pytestmark = [pytest.mark.root, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("DSEC_STATE_DIR", "/var/lib/dsec")) / "cache" / "toolchain-layers"
NAMES = ("python",)


def test_the_rl_example_runs() -> None:
    from dsec.errors import LayerNotFound
    from dsec.images.store import LocalLayerStore
    from dsec.images.toolchains import BASE_NAME, build_toolchains, copy_toolchains, toolkit_name

    cache = LocalLayerStore(CACHE)
    try:
        try:
            base = cache.resolve(f"{BASE_NAME}:bookworm")
            if cache.resolve(f"{toolkit_name('python')}:bookworm").parents[:1] != (base.digest,):
                raise LayerNotFound("python")
        except LayerNotFound:
            if shutil.which("debootstrap") is None:
                pytest.skip("needs debootstrap (or cached toolchain layers)")
            build_toolchains(cache, NAMES)
        with tempfile.TemporaryDirectory(prefix="dsec-test-example-") as tmp:
            data = Path(tmp)
            dst = LocalLayerStore(data / "layers")
            copy_toolchains(cache, dst, NAMES)
            dst.close()
            with dsec_up(data, {**os.environ, "DSEC_STATE_DIR": str(data)}) as env:
                r = subprocess.run([sys.executable, str(REPO / "examples" / "rl_rollouts.py"), "-n", "6",
                                    "--group", "4"], env=env, capture_output=True, text=True, timeout=600)
    finally:
        cache.close()
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = r.stdout
    assert out.count("[code]") >= 5 and "run_code calls in" in out, out
    assert "rewards 1.00" in out or " 1.00" in out  # the right programs are rewarded
    assert "6 episodes" in out and "0 failed" in out, out
    assert "reward 1" in out  # the scripted fix passes its test
