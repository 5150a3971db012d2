"""The whole of tests/compat/test_e2b.py with the floor clients: ``e2b==2.27.0``,
``e2b-code-interpreter==2.9.0`` (the older httpx + Google-protobuf transport), in a venv
made here from PyPI, the server (``dsec up``) in this one. About 40 s (pip from PyPI, then the suite).

    .venv/bin/python -m pytest tests/compat/test_e2b_floor.py

``DSEC_E2B_CLIENTS="e2b==X e2b-code-interpreter==Y"`` runs another pair. docs/COMPAT.md, "E2B".
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import tomllib
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from e2b_up import EXTERNAL, e2b_test_config, e2b_up

pytestmark = [pytest.mark.root, pytest.mark.timeout(1800)]

ROOT = Path(__file__).resolve().parents[2]
FLOOR = ("e2b==2.27.0", "e2b-code-interpreter==2.9.0")


def _venv(where: Path, clients: list[str]) -> Path:
    """A fresh venv with the clients, pytest and DSec's own (SDK) dependencies; DSec itself
    comes from the checkout (PYTHONPATH), so the test file imports the same code."""
    py = where / "bin" / "python"
    subprocess.run([sys.executable, "-m", "venv", str(where)], check=True, timeout=300)
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    dev = [d for d in meta["project"]["optional-dependencies"]["dev"] if d.startswith(("pytest==", "pytest-timeout=="))]
    out = subprocess.run([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", *clients,
                          *meta["project"]["dependencies"], *dev], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout + out.stderr
    return py


def test_the_floor_clients_pass_the_suite(tmp_path: Path) -> None:
    clients = os.environ.get("DSEC_E2B_CLIENTS", " ".join(FLOOR)).split()
    py = _venv(tmp_path / "venv", clients)
    got = subprocess.run([str(py), "-c", "import importlib.metadata as m; "
                          "print(m.version('e2b'), m.version('e2b-code-interpreter'))"],
                         capture_output=True, text=True, check=True).stdout.split()
    assert got == [c.split("==")[1] for c in clients], got
    report = tmp_path / "junit.xml"
    with tempfile.TemporaryDirectory(prefix="dsec-test-e2b-cfg-") as tmp, \
            e2b_up("--control-config", str(e2b_test_config(Path(tmp)))) as env:
        run = subprocess.run(
            [str(py), "-m", "pytest", str(ROOT / "tests/compat/test_e2b.py"), "-q", "-p", "no:cacheprovider",
             f"--junitxml={report}", "-o", "addopts=-ra --strict-markers"],
            cwd=ROOT, capture_output=True, text=True, timeout=1500,
            env={**os.environ, EXTERNAL: json.dumps(env), "PYTHONPATH": str(ROOT / "src"),
                 "DSEC_LEAK_CHECK_BY_PARENT": "1",
                 "E2B_MAX_CONNECTIONS": "300"})
    suite = ET.parse(report).getroot()
    suite = suite.find("testsuite") if suite.tag == "testsuites" else suite
    assert suite is not None
    counts = {k: int(suite.get(k, "0")) for k in ("tests", "failures", "errors", "skipped")}
    print(f"{' '.join(clients)}: {counts}\n{run.stdout[-3000:]}")
    assert run.returncode == 0 and counts["failures"] == counts["errors"] == 0, run.stdout[-8000:] + run.stderr[-3000:]
    assert counts["tests"] >= 22 and counts["skipped"] == 0, counts
