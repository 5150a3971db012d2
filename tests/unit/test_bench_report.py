"""Bench reports (dsec.bench.report): one self-contained HTML file of charts.

Synthetic series only (no root, no sandboxes): what a report holds, that it reaches
nothing outside itself, that each suite's figures come out of its series, and that a
missing matplotlib is one line, not a failed bench.
"""

from __future__ import annotations

import base64
import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest

from dsec.bench import report
from dsec.bench.baselines import decile_rates
from dsec.bench.report import Figure, Series

pytest.importorskip("matplotlib", reason="the bench extra (scripts/setup.sh installs it)")


def _synthetic() -> list[Figure]:
    xs = [float(i) for i in range(1, 101)]
    return [
        Figure("Create rate against N", "line", (Series("DSec", xs, [200 - x / 2 for x in xs], color="C0"),
                                                 Series("crun", xs, [150 - x for x in xs], color="C1")),
               xlabel="N", ylabel="/s", refs=(("target", 70.0),)),
        Figure("Latency histogram", "hist", (Series("DSec", x=[1 + (i % 17) / 10 for i in range(300)]),
                                             Series("crun", x=[3 + (i % 13) / 5 for i in range(300)])),
               xlabel="ms", logx=True),
        Figure("Memory per sandbox", "bar", (Series("MiB", y=[0.99, 1.75, 1.37]),),
               categories=("DSec", "crun", "bwrap")),
    ]


def test_report_is_self_contained_with_every_figure(tmp_path: Path) -> None:
    figs = _synthetic()
    out = report.write_report(tmp_path / "r.html", "dsec bench test", figs,
                              {"create_rate": 134.6, "keep_n": 10_000, "order": "dsec,crun,bwrap"})
    text = out.read_text()
    assert not re.search(r"https?://", text), "a report must not reach the network"
    assert "<script" not in text and "<link" not in text
    imgs = re.findall(r'<img alt="[^"]*" src="data:image/png;base64,([A-Za-z0-9+/=]+)">', text)
    assert len(imgs) == len(figs)
    for data in imgs:
        assert base64.b64decode(data).startswith(b"\x89PNG\r\n\x1a\n")
    for f in figs:
        assert f"<h2>{f.title}</h2>" in text
    assert "134.600" in text and "10,000" in text  # the flat table under the charts
    assert not list(tmp_path.glob(".*.tmp"))


def test_figures_without_data_are_left_out(tmp_path: Path) -> None:
    empty = Figure("Nothing here", "line", (Series("DSec"),))
    text = report.write_report(tmp_path / "r.html", "t", [empty, *_synthetic()[:1]], {}).read_text()
    assert "Nothing here" not in text and text.count("data:image/png;base64,") == 1


def test_figure_rejects_mismatched_series() -> None:
    with pytest.raises(ValueError):
        Figure("t", "line", (Series("a", [1.0, 2.0], [1.0]),))
    with pytest.raises(ValueError):
        Figure("t", "bar", (Series("a", y=[1.0]),), categories=("x", "y"))
    with pytest.raises(ValueError):
        Figure("t", "pie", ())  # type: ignore[arg-type]


def test_deciles_agree_with_the_flat_keys() -> None:
    done = [0.004 * i * (1 + i / 500) for i in range(1, 1001)]  # slows down as N grows
    xs, ys = report.deciles(done)
    first, last = decile_rates(done)
    assert len(xs) == len(ys) == 10 and xs[-1] == 1000
    assert ys[0] == pytest.approx(first) and ys[-1] == pytest.approx(last)
    assert ys == sorted(ys, reverse=True)
    cx, cy = report.rate_curve(done, 50)
    assert len(cx) == 50 and cx[-1] == 1000 and cy[0] > cy[-1]


def test_memory_per_sandbox_places_samples_on_ready_times() -> None:
    done = [i * 0.01 for i in range(1, 201)]  # 100 ready per second
    samples = [[0.5, 50 * (1 << 20)], [1.0, 100 * (1 << 20)], [2.0, 200 * (1 << 20)], [0.05, 1 << 20]]
    xs, ys = report.memory_per_sandbox(done, samples, min_n=10)
    assert xs == [50.0, 100.0, 200.0]  # the sample at 5 sandboxes is below min_n
    assert ys == pytest.approx([1.0, 1.0, 1.0])


def test_paths_beside_the_json() -> None:
    assert report.html_path(Path("/x/bench-runtime.json")) == Path("/x/bench-runtime.html")
    assert report.series_path(Path("/x/bench-runtime.json")) == Path("/x/bench-runtime.series.json")
    assert report.html_path(Path("/x/out")) == Path("/x/out.html")


def _runtime_series() -> dict[str, Any]:
    ready = {rt: [i * k for i in range(1, 201)] for rt, k in (("dsec", 0.005), ("crun", 0.01), ("bwrap", 0.008))}
    mem = {rt: [[t / 10, int(t * 50 * (1 << 20))] for t in range(1, 20)] for rt in ready}
    lat = {rt: [3.0 + i % 7 for i in range(30)] for rt in ready}
    return {"keep_ready_s": ready, "keep_mem": mem, "create_ms": lat, "keep_ready_ms": lat,
            "exec_ms": {"dsec": [1.1] * 20, "crun": [4.4] * 20}}


def _runtime_results() -> dict[str, Any]:
    out: dict[str, Any] = {"keep_n": 200, "order": "dsec,crun,bwrap", "keep_concurrency": 8}
    for pre in ("", "crun_", "bwrap_"):
        out.update({f"{pre}create_rate": 100.0, f"{pre}create_rate_first_decile": 200.0,
                    f"{pre}create_rate_last_decile": 90.0, f"{pre}create_rate_last_decile_ratio": 0.45,
                    f"{pre}idle_mib_per_sandbox": 1.0, f"{pre}teardown_rate": 150.0})
    return out


def test_runtime_figures_from_series_and_from_flat_keys_alone() -> None:
    titles = [f.title for f in report.suite_figures("runtime", _runtime_results(), _runtime_series())]
    assert any("per decile against N" in t for t in titles)
    assert "Host memory per idle sandbox against N" in titles
    assert any("latency" in t.lower() for t in titles)
    # an older JSON (no series file): the bars of its flat keys, no curves
    flat = report.suite_figures("runtime", _runtime_results(), {})
    assert flat and all(f.kind == "bar" for f in flat)


def test_other_suites_figures() -> None:
    vm = report.suite_figures("vm", {"vm_restore_p50_ms": 40.0, "vm_restore_start_p50_ms": 5.0,
                                     "vm_idle_mib_per_clone": 30.0},
                              {"vm_restore_ms": [40.0, 41.0], "container_create_exec_ms": [4.0, 5.0],
                               "vm_exec_ms": [2.0], "vm_cold_boot_ms": [300.0, 310.0]})
    assert {"Create to first exec answered", "Exec round trip in a running sandbox"} <= {f.title for f in vm}
    cl = report.suite_figures("cluster", {"control_creates_per_s_1replica": 900.0,
                                          "control_creates_cpu_ms_per_create_replicas_1replica": 0.5},
                              {"phases": {"lease 1replica": {"done_s": [i / 1000 for i in range(1, 500)],
                                                             "lat_ms": []}}})
    assert {"Creates answered per second through each phase", "CPU per create, by process"} <= {f.title for f in cl}
    im = report.suite_figures("images", {"lazy_first_exec_ms": 300.0, "full_pull_first_exec_ms": 900.0,
                                         "lazy_first_exec_noprofile_ms": 500.0},
                              {"link_bytes": {"big: full pull": [[0.0, 0], [1.0, 1 << 27]]},
                               "chunk_fetch_buckets_le_ms": {"1": 3, "10": 40, "+Inf": 1}})
    assert len(im) == 3
    assert report.suite_figures("sched", {}, {}) == []


def test_series_file_round_trip_and_report_command(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from dsec.cli.main import main

    js = tmp_path / "bench-runtime.json"
    js.write_text(json.dumps(_runtime_results()))
    report.save_series(report.series_path(js), "runtime", _runtime_series())
    assert report.load_series(report.series_path(js))[0] == "runtime"
    res = CliRunner().invoke(main, ["bench", "report", str(js), "--png-dir", str(tmp_path / "img")],
                             standalone_mode=False)
    assert res.exception is None or (isinstance(res.exception, SystemExit) and res.exception.code == 0), res.output
    text = report.html_path(js).read_text()
    assert "Host memory per idle sandbox against N" in text
    assert (tmp_path / "img" / "bench-runtime-memory-per-sandbox.png").exists()


def test_missing_matplotlib_is_one_line_not_a_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    from dsec.cli import main as cli

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.raises(report.ReportUnavailable, match="matplotlib is not installed"):
        report.write_report(tmp_path / "r.html", "t", _synthetic(), {})
    js = tmp_path / "b.json"
    cli._report("dsec bench runtime", {"keep_n": 10}, js, suite="runtime", series=_runtime_series())
    assert json.loads(js.read_text()) == {"keep_n": 10}  # the flat JSON as ever
    assert report.series_path(js).exists()
    assert not report.html_path(js).exists()
    said = capsys.readouterr()
    notes = [ln for ln in (said.out + said.err).splitlines() if ln.startswith(("note:", "warning:", "error:"))]
    assert len(notes) == 1 and notes[0].startswith("note: no HTML report: matplotlib is not installed"), notes
    assert "Traceback" not in said.err


def test_rate_over_time_counts_bursts_by_time() -> None:
    done = [1.0] * 100 + [2.0] * 100  # two bursts
    xs, ys = report.rate_over_time(done, bins=4)
    assert xs == pytest.approx([0.25, 0.75, 1.25, 1.75])
    assert sum(y * 0.5 for y in ys) == pytest.approx(200)
    assert max(ys) == pytest.approx(200)  # 100 in half a second, not one burst's "infinite" rate
