"""The summary statistics every bench script reports: a figure's spread over repeated runs (median, min,
max, count) and the nearest-rank quantile of one run's samples. One copy, so every table in
docs/benchmarks.md computes "median (min-max)" and "p99" the same way.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Spread:
    """One figure over the runs of a cell that have it: median, min, max and how many runs."""

    median: float
    low: float
    high: float
    count: int

    def text(self, fmt: str = ".3g") -> str:
        """``median (min-max)`` (three significant digits unless ``fmt`` says otherwise); a single run: its
        value alone."""
        if self.count == 1:
            return format(self.median, fmt)
        return f"{self.median:{fmt}} ({self.low:{fmt}}-{self.high:{fmt}})"


def spread(values: Iterable[float | None]) -> Spread | None:
    """The spread of ``values`` (None, a run without the figure, left out); None when no run has it."""
    got = sorted(v for v in values if v is not None)
    if not got:
        return None
    return Spread(statistics.median(got), got[0], got[-1], len(got))


def quantile(values: Sequence[float], q: float) -> float:
    """The `q` quantile of one run's samples, the nearest of them (p99 of fewer than 100: the largest);
    NaN for no samples."""
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile {q} is outside [0, 1]")
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))] if s else float("nan")
