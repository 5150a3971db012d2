"""Bench reports: one self-contained HTML file of charts beside a bench's flat JSON.

What it owns: :class:`Figure` (a chart as pure data: a title, a kind, labelled series),
:func:`write_report` (renders each figure with matplotlib into a PNG, embeds it as a
``data:image/png;base64`` URI, and writes one HTML file with the bench's flat table under
the charts), and the side file of a run's series (:func:`series_path`, :func:`save_series`,
:func:`load_series`) from which ``dsec bench report`` draws the same charts again.

A suite supplies its figures from its flat results and its series (``figures(results,
series) -> list[Figure]`` in the suite's module, listed in :data:`SUITES`); figures import
nothing heavy, so a suite builds them whether or not matplotlib is installed.

Must never: reach the network or reference anything outside the file (no URLs, no external
JS or CSS, fonts are the viewer's); change or drop a key of the flat JSON; crash a bench
that has finished measuring: a missing matplotlib is :class:`ReportUnavailable`, one line
for the caller to print.
"""

from __future__ import annotations

import base64
import html
import importlib
import io
import json
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

Kind = Literal["line", "hist", "bar"]
SeriesData = dict[str, Any]
"""A run's per-sample data, by name: what the flat JSON summarises (JSON-serialisable)."""

SUITES: dict[str, str] = {
    "runtime": "dsec.bench.runtime",
    "images": "dsec.bench.images",
    "cluster": "dsec.bench.cluster",
    "vm": "dsec.bench.vm",
}
"""Suites that draw charts: name -> module with ``figures(results, series) -> list[Figure]``."""

INSTALL_HINT = "the bench extra: pip install 'dsec[bench]'"


class ReportUnavailable(ImportError):
    """matplotlib is not installed: no report, the bench's results stand."""


@dataclass(frozen=True)
class Series:
    """One labelled series. ``line``: points (x, y); ``hist``: samples in ``x`` (``y`` empty);
    ``bar``: one ``y`` per category of the figure (``x`` empty)."""

    label: str
    x: Sequence[float] = ()
    y: Sequence[float] = ()
    color: str | None = None
    """A matplotlib colour (``"C0"``...): the same thing the same colour in every chart."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "x", tuple(float(v) for v in self.x))
        object.__setattr__(self, "y", tuple(float(v) for v in self.y))


@dataclass(frozen=True)
class Figure:
    """A chart as data; :func:`write_report` draws it."""

    title: str
    kind: Kind
    series: tuple[Series, ...]
    xlabel: str = ""
    ylabel: str = ""
    caption: str = ""
    categories: tuple[str, ...] = ()
    """``bar``: the names along x; each series has one value per category."""
    refs: tuple[tuple[str, float], ...] = ()
    """Horizontal reference lines (a target, a baseline): (label, y)."""
    logx: bool = False
    logy: bool = False
    bins: int = 40
    name: str = ""
    """A stable file name for :func:`write_pngs` (default: from the title)."""

    def __post_init__(self) -> None:
        if self.kind not in ("line", "hist", "bar"):
            raise ValueError(f"{self.title}: unknown kind {self.kind!r}")
        for s in self.series:
            if self.kind == "line" and len(s.x) != len(s.y):
                raise ValueError(f"{self.title}: {s.label}: {len(s.x)} x for {len(s.y)} y")
            if self.kind == "bar" and len(s.y) != len(self.categories):
                raise ValueError(f"{self.title}: {s.label}: {len(s.y)} values for {len(self.categories)} categories")

    def has_data(self) -> bool:
        return any(s.x or s.y for s in self.series)


# ------------------------------------------------------------------ render --


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise ReportUnavailable(f"no HTML report: matplotlib is not installed ({INSTALL_HINT})") from None
    matplotlib.use("Agg", force=True)  # no display, no GUI toolkit
    import matplotlib.pyplot as plt

    return plt


def render_png(fig: Figure, *, dpi: int = 110) -> bytes:
    """One figure as PNG bytes (matplotlib, Agg)."""
    plt = _pyplot()
    f, ax = plt.subplots(figsize=(7.5, 4.2), dpi=dpi)
    try:
        _draw(ax, fig)
        ax.set_title(fig.title, fontsize=11)
        ax.set_xlabel(fig.xlabel)
        ax.set_ylabel(fig.ylabel)
        for label, y in fig.refs:
            ax.axhline(y, linestyle="--", linewidth=1, color="0.4", label=label)
        if fig.logx:
            ax.set_xscale("log")
        if fig.logy:
            ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
        if len(fig.series) > 1 or fig.refs:
            ax.legend(fontsize=8)
        f.tight_layout()
        buf = io.BytesIO()
        f.savefig(buf, format="png", metadata={"Software": None})
        return buf.getvalue()
    finally:
        plt.close(f)


def _draw(ax: Any, fig: Figure) -> None:
    if fig.kind == "line":
        for s in fig.series:
            ax.plot(s.x, s.y, marker="o" if len(s.x) <= 30 else None, markersize=3, linewidth=1.4, label=s.label,
                    color=s.color)
        return
    if fig.kind == "hist":
        samples = [s.x for s in fig.series if s.x]
        if not samples:
            return
        lo = min(min(x) for x in samples)
        hi = max(max(x) for x in samples)
        if fig.logx and lo > 0:
            edges = [lo * (hi / lo) ** (i / fig.bins) for i in range(fig.bins + 1)] if hi > lo else [lo, lo * 1.01]
        else:
            edges = [lo + (hi - lo) * i / fig.bins for i in range(fig.bins + 1)] if hi > lo else [lo - 0.5, lo + 0.5]
        for s in fig.series:
            if s.x:
                ax.hist(s.x, bins=edges, alpha=0.55, label=f"{s.label} (n={len(s.x):,})", histtype="stepfilled",
                        edgecolor="black", linewidth=0.4, color=s.color)
        return
    width = 0.8 / max(1, len(fig.series))
    for i, s in enumerate(fig.series):
        xs = [c + (i - (len(fig.series) - 1) / 2) * width for c in range(len(fig.categories))]
        ax.bar(xs, s.y, width=width, label=s.label, color=s.color)
    ax.set_xticks(range(len(fig.categories)))
    ax.set_xticklabels(fig.categories, rotation=20 if len(fig.categories) > 5 else 0, ha="right"
                       if len(fig.categories) > 5 else "center", fontsize=8)


# -------------------------------------------------------------------- html --

_CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",sans-serif;margin:2em auto;max-width:980px;color:#222;padding:0 1em}
h1{font-size:1.5em}h2{font-size:1.1em;margin-top:2em}
figure{margin:1.5em 0}figure img{max-width:100%;border:1px solid #ddd}
figcaption{color:#555;font-size:.9em;margin-top:.3em}
table{border-collapse:collapse;font-size:.85em}td,th{border-bottom:1px solid #eee;padding:2px 10px;text-align:left}
td.v{text-align:right;font-variant-numeric:tabular-nums}.meta{color:#666;font-size:.9em}
"""


def _cell(v: Any) -> str:
    if isinstance(v, float):
        return "nan" if math.isnan(v) else f"{v:,.3f}"
    if isinstance(v, int) and not isinstance(v, bool):
        return f"{v:,}"
    return str(v)


def render_html(title: str, figures: Sequence[Figure], table: Mapping[str, Any], *,
                notes: Sequence[str] = (), png: Callable[[Figure], bytes] = render_png) -> str:
    """The report's HTML text: the figures (PNG data URIs), then the flat table."""
    parts = [
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{html.escape(title)}</title><style>{_CSS}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
        f'<p class="meta">written {html.escape(time.strftime("%Y-%m-%d %H:%M:%S %Z"))} on '
        f"{html.escape(os.uname().nodename)}; {len(figures)} chart(s), {len(table)} figure(s) in the table</p>",
    ]
    parts += [f"<p>{html.escape(n)}</p>" for n in notes]
    for fig in figures:
        data = base64.b64encode(png(fig)).decode("ascii")
        parts.append(f"<figure><h2>{html.escape(fig.title)}</h2>"
                     f'<img alt="{html.escape(fig.title, quote=True)}" src="data:image/png;base64,{data}">')
        if fig.caption:
            parts.append(f"<figcaption>{html.escape(fig.caption)}</figcaption>")
        parts.append("</figure>")
    parts.append("<h2>All figures (the flat JSON)</h2><table><tr><th>key</th><th>value</th></tr>")
    for k, v in table.items():
        parts.append(f'<tr><td>{html.escape(str(k))}</td><td class="v">{html.escape(_cell(v))}</td></tr>')
    parts.append("</table></body></html>")
    return "\n".join(parts) + "\n"


def write_report(path: Path, title: str, figures: Sequence[Figure], table: Mapping[str, Any], *,
                 notes: Sequence[str] = ()) -> Path:
    """Write the report to ``path`` (one HTML file, nothing referenced outside it).

    Figures without data are left out. Raises :class:`ReportUnavailable` when matplotlib
    is not installed (before anything is written).
    """
    _pyplot()
    drawn = [f for f in figures if f.has_data()]
    text = render_html(title, drawn, table, notes=notes)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)
    return path


def write_pngs(directory: Path, figures: Sequence[Figure], *, prefix: str = "") -> list[Path]:
    """Each figure with data as its own PNG in ``directory`` (for docs), named from its title."""
    directory.mkdir(parents=True, exist_ok=True)
    made = []
    for fig in figures:
        if not fig.has_data():
            continue
        slug = "".join(c if c.isalnum() else "-" for c in (fig.name or fig.title).lower()).strip("-")
        while "--" in slug:
            slug = slug.replace("--", "-")
        p = directory / f"{prefix}{slug[:60]}.png"
        p.write_bytes(render_png(fig))
        made.append(p)
    return made


# ------------------------------------------------------------------ series --


def _stem(json_path: Path) -> str:
    return json_path.name[:-5] if json_path.name.endswith(".json") else json_path.name


def html_path(json_path: Path) -> Path:
    """``bench.json`` -> ``bench.html`` (``bench`` -> ``bench.html``): the report beside the JSON."""
    return json_path.with_name(_stem(json_path) + ".html")


def series_path(json_path: Path) -> Path:
    """``bench.json`` -> ``bench.series.json``: the run's per-sample data beside the JSON."""
    return json_path.with_name(_stem(json_path) + ".series.json")


def save_series(path: Path, suite: str, series: SeriesData) -> None:
    path.write_text(json.dumps({"suite": suite, "series": series}, separators=(",", ":")))


def load_series(path: Path) -> tuple[str, SeriesData]:
    doc = json.loads(path.read_text())
    return str(doc["suite"]), dict(doc["series"])


def suite_figures(suite: str, results: Mapping[str, Any], series: SeriesData) -> list[Figure]:
    """The figures suite ``suite`` draws from its results and series ([] for a suite without charts)."""
    mod = SUITES.get(suite)
    if mod is None:
        return []
    build: Callable[[Mapping[str, Any], SeriesData], list[Figure]] = importlib.import_module(mod).figures
    return build(results, series)


# ----------------------------------------------------------- series helpers --


def deciles(done_s: Sequence[float], parts: int = 10) -> tuple[list[float], list[float]]:
    """Create rate per decile of a series of ready times: (N at each decile's end, rate in it /s).

    The same cut as :func:`dsec.bench.baselines.decile_rates` (its first and last points are
    that function's): a decile is ``n // parts`` sandboxes, the first counted from the
    series' start, each other from the sandbox just before it; the last takes the rest.
    """
    done = sorted(float(t) for t in done_s)
    n = len(done)
    if n < parts:
        return [], []
    k = n // parts
    xs: list[float] = []
    ys: list[float] = []
    for i in range(parts):
        lo = i * k
        hi = n if i == parts - 1 else (i + 1) * k
        if i == parts - 1:  # as decile_rates: the last k, from the sandbox just before them
            lo = n - k
        start = done[lo - 1] if lo > 0 else 0.0
        xs.append(float(hi))
        ys.append((hi - lo) / max(done[hi - 1] - start, 1e-9))
    return xs, ys


def rate_curve(done_s: Sequence[float], points: int = 50) -> tuple[list[float], list[float]]:
    """Create rate against N at finer grain than deciles: ``points`` equal slices of the series."""
    done = sorted(float(t) for t in done_s)
    n = len(done)
    if n < 2:
        return [], []
    points = max(1, min(points, n // 2))
    xs: list[float] = []
    ys: list[float] = []
    for i in range(points):
        lo = i * n // points
        hi = (i + 1) * n // points
        start = done[lo - 1] if lo > 0 else 0.0
        xs.append(float(hi))
        ys.append((hi - lo) / max(done[hi - 1] - start, 1e-9))
    return xs, ys


def rate_over_time(done_s: Sequence[float], bins: int = 40) -> tuple[list[float], list[float]]:
    """Events per second against time: ``bins`` equal spans of the series (x: each span's middle,
    seconds). For answers that come in bursts, where equal counts (:func:`rate_curve`) spike."""
    done = [float(t) for t in done_s]
    if len(done) < 2:
        return [], []
    end = max(done)
    if end <= 0:
        return [], []
    width = end / bins
    counts = [0] * bins
    for t in done:
        counts[min(bins - 1, max(0, int(t / width)))] += 1
    return [(i + 0.5) * width for i in range(bins)], [c / width for c in counts]


def memory_per_sandbox(done_s: Sequence[float], samples: Sequence[Sequence[float]], *,
                       min_n: int = 10) -> tuple[list[float], list[float]]:
    """Host memory per sandbox against N, MiB, from (seconds since the series began,
    bytes used since it began) samples and the sandboxes' ready times."""
    import bisect

    done = sorted(float(t) for t in done_s)
    xs: list[float] = []
    ys: list[float] = []
    for t, used in samples:
        n = bisect.bisect_right(done, float(t))
        if n >= max(1, min_n):
            xs.append(float(n))
            ys.append(float(used) / n / (1 << 20))
    return xs, ys


def downsample(values: Sequence[float], most: int = 5000) -> list[float]:
    """At most ``most`` of ``values``, evenly strided (for a series file that stays small)."""
    if len(values) <= most:
        return [float(v) for v in values]
    step = len(values) / most
    return [float(values[int(i * step)]) for i in range(most)]


__all__ = [
    "SUITES",
    "Figure",
    "ReportUnavailable",
    "Series",
    "SeriesData",
    "deciles",
    "html_path",
    "load_series",
    "memory_per_sandbox",
    "rate_curve",
    "rate_over_time",
    "render_html",
    "render_png",
    "save_series",
    "series_path",
    "suite_figures",
    "write_pngs",
    "write_report",
]
