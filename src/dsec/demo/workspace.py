"""A small real Python project with failing tests, and candidate patches for it.

Agents in the demo read ``calc/stats.py``, apply one candidate patch and run
the tests; the reward is the fraction of tests that pass. Uses only the
standard library (``python3 -m unittest``), so the base image needs nothing
but python3.
"""

from __future__ import annotations

from pathlib import Path

BUGGY = '''"""Descriptive statistics (with bugs for the agents to fix)."""


def mean(xs):
    return sum(xs) / (len(xs) + 1)


def median(xs):
    s = sorted(xs)
    return s[len(s) // 2]


def variance(xs):
    m = mean(xs)
    return sum((x - m) ** 2 for x in xs) / len(xs)
'''

TESTS = '''import unittest

from calc.stats import mean, median, variance


class StatsTest(unittest.TestCase):
    def test_mean(self):
        self.assertAlmostEqual(mean([1, 2, 3, 4]), 2.5)

    def test_mean_single(self):
        self.assertEqual(mean([7]), 7)

    def test_median_odd(self):
        self.assertEqual(median([3, 1, 2]), 2)

    def test_median_even(self):
        self.assertEqual(median([4, 1, 3, 2]), 2.5)

    def test_variance(self):
        self.assertAlmostEqual(variance([2, 4, 4, 4, 5, 5, 7, 9]), 4.0)

    def test_empty_mean_raises(self):
        with self.assertRaises(ValueError):
            mean([])


if __name__ == "__main__":
    unittest.main()
'''

_FIX_MEAN = ("    return sum(xs) / (len(xs) + 1)\n",
             "    if not xs:\n        raise ValueError(\"mean of empty data\")\n    return sum(xs) / len(xs)\n")
_FIX_MEAN_HALF = ("    return sum(xs) / (len(xs) + 1)\n", "    return sum(xs) / len(xs)\n")
_FIX_MEDIAN = ("    return s[len(s) // 2]\n",
               "    n = len(s)\n    mid = n // 2\n    return s[mid] if n % 2 else (s[mid - 1] + s[mid]) / 2\n")
_BREAK_VARIANCE = ("    return sum((x - m) ** 2 for x in xs) / len(xs)\n",
                   "    return sum((x - m) ** 2 for x in xs) / (len(xs) - 1)\n")

# Candidate patches an "agent" might propose: (name, [(old, new), ...]).
CANDIDATES: list[tuple[str, list[tuple[str, str]]]] = [
    ("no-op", []),
    ("fix-mean", [_FIX_MEAN]),
    ("fix-mean-naive", [_FIX_MEAN_HALF]),
    ("fix-median", [_FIX_MEDIAN]),
    ("fix-both", [_FIX_MEAN, _FIX_MEDIAN]),
    ("fix-both-break-variance", [_FIX_MEAN, _FIX_MEDIAN, _BREAK_VARIANCE]),
    ("fix-naive-and-median", [_FIX_MEAN_HALF, _FIX_MEDIAN]),
    ("break-variance", [_BREAK_VARIANCE]),
]
N_TESTS = 6


def write_workspace(dest: Path) -> Path:
    """Lay the project out under ``dest/workspace``; returns ``dest``."""
    root = dest / "workspace"
    (root / "calc").mkdir(parents=True, exist_ok=True)
    (root / "tests").mkdir(parents=True, exist_ok=True)
    (root / "calc" / "__init__.py").write_text("")
    (root / "calc" / "stats.py").write_text(BUGGY)
    (root / "tests" / "__init__.py").write_text("")
    (root / "tests" / "test_stats.py").write_text(TESTS)
    (root / "README.md").write_text("Fix calc/stats.py so that `python3 -m unittest` passes.\n")
    return dest


def apply_patch(source: str, patch: list[tuple[str, str]]) -> str:
    for old, new in patch:
        if old not in source:
            raise ValueError(f"patch does not apply: {old.strip()!r} not found")
        source = source.replace(old, new, 1)
    return source


def reward_from_unittest(stderr: str) -> float:
    """Fraction of tests passed, from unittest's summary ("Ran N tests", "FAILED (failures=a, errors=b)")."""
    ran = 0
    bad = 0
    for line in stderr.splitlines():
        if line.startswith("Ran ") and " test" in line:
            ran = int(line.split()[1])
        if line.startswith("FAILED ("):
            for part in line[len("FAILED (") : -1].split(","):
                key, _, val = part.strip().partition("=")
                if key in ("failures", "errors"):
                    bad += int(val)
    return 0.0 if ran == 0 else (ran - bad) / ran
