"""bench/memory_sweep.py: the fixed-memory table's steady-state rate (no whole-run fallback) and the
break-even latencies inferred from measured rows."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# appended, not prepended: bench/ holds kernels.py and model.py, which must not shadow the packages for
# the other tests of this process
sys.path.append(str(Path(__file__).resolve().parents[2] / "bench"))

from memory_sweep import crossing, plot_sweep, steady_rate, verdict  # noqa: E402


def _history(n: int, episodes: int = 64, first_s: float = 100.0, step_s: float = 10.0) -> list[dict]:
    return [{"episodes": episodes, "elapsed_s": first_s + i * step_s} for i in range(n)]


def test_the_rate_covers_only_the_iterations_after_the_first_and_needs_the_whole_window():
    assert steady_rate(_history(6), "episodes") == pytest.approx(5 * 64 / 50.0)  # start-up's 100 s left out
    assert steady_rate(_history(5), "episodes") is None  # 4 after the first: no number, no fallback
    assert steady_rate(_history(3), "episodes", min_iterations=2) == pytest.approx(2 * 64 / 20.0)


def test_break_even_is_interpolated_between_measured_latencies():
    lat = [0.0, 2.0, 10.0, 30.0]
    words, value = crossing(lat, [0.1, 0.5, 1.5, 4.0], 1.0)
    assert value == pytest.approx(6.0) and "inferred" in words
    assert crossing(lat, [0.1, 0.5, 1.5, 4.0], 3.0)[1] == pytest.approx(10 + 1.5 / 2.5 * 20)
    never = crossing(lat, [0.1, 0.2, 0.3, 0.4], 1.0)
    assert never == ("above 30 s (not reached at any measured latency)", None)
    assert crossing(lat, [1.2, None, 2.0, 5.0], 1.0)[1] == 0.0  # at or below the first measured one
    assert crossing(lat, [0.5, None, 1.5, 4.0], 1.0)[1] == pytest.approx(5.0)  # skips the unmeasured 2 s
    assert crossing(lat, [None] * 4, 1.0)[1] is None
    assert crossing(lat, [2.0, 2.0, 0.5, 2.0], 1.0)[1] == pytest.approx(10 + 0.5 / 1.5 * 20)  # last crossing


def test_verdicts_and_the_plot(tmp_path):
    assert verdict(True, "3.2x") == "**met**: 3.2x"
    assert verdict(False, "0.3x") == "**missed**: 0.3x"
    assert verdict(None, "row (c) not steady").startswith("**missed**: not measured")
    path = tmp_path / "sweep.png"
    plot_sweep({"a": {0.0: 1.0, 2.0: 0.5}, "c": {0.0: None, 2.0: 0.2}}, {"a": "(a)"}, path, "t")
    assert path.stat().st_size > 1000
