"""A real bench phase writes its report beside its JSON.

One phase of ``dsec bench runtime`` (bwrap's create-and-keep of 30, a few seconds), its
series kept as the bench keeps them, then the CLI's ending: the flat JSON, the series file
and the HTML report side by side.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from dsec.bench import baselines, report
from dsec.bench import runtime as rb

pytest.importorskip("matplotlib", reason="the bench extra (scripts/setup.sh installs it)")

N = 30


@pytest.fixture
def workdir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="dsec-test-report-"))
    path.chmod(0o755)  # the sandboxes' root is an unprivileged host uid
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.mark.root
@pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bwrap")
def test_bwrap_keep_phase_writes_the_report_beside_the_json(workdir: Path) -> None:
    from dsec.cli.main import _report

    rootfs = baselines.prepare_busybox_rootfs(workdir / "rootfs")
    series: dict[str, object] = {}
    said: list[str] = []
    results = rb._baseline_side("bwrap", rootfs, n_lat=3, n_keep=N, n_exec=0, host=rb._host_devs(),
                                say=said.append, series=series)
    assert results["bwrap_keep_n"] == N
    ready = series["keep_ready_s"]["bwrap"]  # type: ignore[index]
    mem = series["keep_mem"]["bwrap"]  # type: ignore[index]
    assert len(ready) == N and len(series["create_ms"]["bwrap"]) == 3  # type: ignore[index]
    assert mem and all(t >= 0 for t, _ in mem)  # placed on the runner's own time line

    js = workdir / "bench-runtime.json"
    _report("dsec bench runtime", results, js, suite="runtime", series=series)
    assert json.loads(js.read_text()) == json.loads(json.dumps(results))  # flat, as before
    side = report.series_path(js)
    assert report.load_series(side) == ("runtime", json.loads(json.dumps(series)))
    page = report.html_path(js)
    assert page == workdir / "bench-runtime.html" and page.exists()
    text = page.read_text()
    assert not re.search(r"https?://", text)
    assert "Create-and-keep rate per decile against N" in text
    assert text.count('src="data:image/png;base64,') >= 3
