"""Percentiles and summaries for benchmark samples.

Pure functions over lists of floats; no I/O and no third-party imports, so the
benchmark code can use them anywhere (including inside helper processes).
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def percentile(values: Sequence[float], p: float) -> float:
    """The ``p``-th percentile (0..100) of ``values``, linearly interpolated.

    Same definition as numpy's default (``method="linear"``): the rank is
    ``p/100 * (n-1)`` over the sorted samples, interpolated between the two
    neighbours. Raises ``ValueError`` on an empty sequence or ``p`` outside 0..100.
    """
    if not values:
        raise ValueError("percentile of an empty sequence")
    if not 0.0 <= p <= 100.0 or math.isnan(p):
        raise ValueError(f"percentile p must be within 0..100, got {p}")
    ordered = sorted(values)
    rank = p / 100.0 * (len(ordered) - 1)
    low = math.floor(rank)
    high = math.ceil(rank)
    if low == high:
        return float(ordered[low])
    frac = rank - low
    return float(ordered[low] + (ordered[high] - ordered[low]) * frac)


def summarize(values: Sequence[float]) -> dict[str, float]:
    """``{"p50", "p95", "p99", "mean", "n"}`` of ``values`` (``n`` as a float).

    Raises ``ValueError`` on an empty sequence: a benchmark that measured
    nothing is a bug, not a zero.
    """
    if not values:
        raise ValueError("cannot summarize an empty sequence")
    return {
        "p50": percentile(values, 50),
        "p95": percentile(values, 95),
        "p99": percentile(values, 99),
        "mean": math.fsum(values) / len(values),
        "n": float(len(values)),
    }
