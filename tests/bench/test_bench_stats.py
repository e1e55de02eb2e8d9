"""bench/bench_stats.py: the one spread (median, min, max) and nearest-rank quantile every bench script
reports with, and no bench script carrying its own copy of either."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.append(str(BENCH))

from bench_stats import quantile, spread  # noqa: E402


def test_a_spread_is_the_median_min_and_max_of_the_runs_that_have_the_figure():
    s = spread([0.29, None, 0.255, 0.276])
    assert (s.median, s.low, s.high, s.count) == (0.276, 0.255, 0.29, 3)
    assert s.text() == "0.276 (0.255-0.29)" and spread([1.5]).text(".2f") == "1.50"
    assert spread([0.2, 0.4]).median == pytest.approx(0.3) and spread([None]) is None


def test_quantile_is_the_nearest_sample():
    assert quantile([0.3, 0.1, 0.2], 0.99) == 0.3  # fewer than 100 samples: the slowest
    assert quantile([4.0, 1.0, 3.0, 2.0, 5.0], 0.5) == 3.0
    assert quantile([], 0.5) != quantile([], 0.5)  # NaN
    with pytest.raises(ValueError, match="outside"):
        quantile([1.0], 1.5)


def test_the_bench_tables_format_with_the_shared_helpers():
    from engines import spread as engine_spread
    from restore_paths import _spread
    from sandbox_server import fmt

    assert fmt([0.001, 0.002, 0.003, 0.010]) == "2.5 / 10.0 ms"  # median / nearest-rank p90
    assert engine_spread([30.0, 10.0, 20.0]) == "20 (10-30)"
    assert _spread([0.3, 0.1, 0.2], "CPU-s") == "0.200 CPU-s (0.100–0.300)" and _spread([]) == "-"


def test_no_bench_script_carries_its_own_quantile_or_spread():
    """A second copy would let two tables of docs/benchmarks.md disagree on what "p99" or "median
    (min-max)" means: every script takes them from bench_stats."""
    own = []
    for path in sorted(BENCH.glob("*.py")):
        if path.name == "bench_stats.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.ClassDef) and node.name in ("quantile", "_p", "Spread"):
                own.append(f"{path.name}:{node.lineno} {node.name}")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "round":
                text = ast.unparse(node)
                if "len(" in text and "- 1" in text:  # a hand-written nearest-rank index
                    own.append(f"{path.name}:{node.lineno} {text}")
    assert own == [], own
