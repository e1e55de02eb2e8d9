"""bench/train.py: the rollout table's targets for forked groups end in **met** or **missed** with their
figure, as every target line of docs/benchmarks.md does."""

from __future__ import annotations

import sys
from pathlib import Path

# appended, not prepended: bench/ holds kernels.py and model.py, which must not shadow the packages for
# the other tests of this process
sys.path.append(str(Path(__file__).resolve().parents[2] / "bench"))

from train import fork_targets, heavy_start_lines  # noqa: E402


def test_each_forked_group_target_says_met_or_missed_with_its_figure():
    slow, fast = fork_targets(0.09, 183.0)
    assert slow.endswith(">= 0.5x seed groups' (measured): **missed**: 0.09x")
    assert fast.endswith("<= 500 ms (measured): **met**: 183 ms")
    slow, fast = fork_targets(0.55, 612.4)
    assert slow.endswith("**met**: 0.55x") and fast.endswith("**missed**: 612 ms")
    assert fork_targets(1.0, None)[1].endswith("**missed**: not measured (no fork phase measured)")


def test_the_heavy_start_target_is_on_the_medians_and_names_the_worst_pair():
    run = {"min": 0.0, "max": 0.0, "runs": 3, "failed": 0}
    lines = heavy_start_lines({**run, "episodes_per_s": 3.3, "min": 2.7, "max": 3.6},
                              {**run, "episodes_per_s": 1.0, "min": 0.9, "max": 1.1}, 2, 8)
    assert lines[-1].endswith("**met**: 3.30x (worst pair 2.45x)")
    lines = heavy_start_lines({**run, "episodes_per_s": 2.0, "min": 2.0, "max": 2.0},
                              {**run, "episodes_per_s": 1.0, "min": 1.0, "max": 1.0}, 2, 8)
    assert "**missed**: 2.00x" in lines[-1]
