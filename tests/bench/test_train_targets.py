"""bench/train.py: the rollout table's targets for forked groups end in **met** or **missed** with their
figure, as every target line of docs/benchmarks.md does."""

from __future__ import annotations

import sys
from pathlib import Path

# appended, not prepended: bench/ holds kernels.py and model.py, which must not shadow the packages for
# the other tests of this process
sys.path.append(str(Path(__file__).resolve().parents[2] / "bench"))

from train import fork_targets  # noqa: E402


def test_each_forked_group_target_says_met_or_missed_with_its_figure():
    slow, fast = fork_targets(0.09, 183.0)
    assert slow.endswith(">= 0.9x seed groups' (measured): **missed**: 0.09x")
    assert fast.endswith("<= 500 ms (measured): **met**: 183 ms")
    slow, fast = fork_targets(0.95, 612.4)
    assert slow.endswith("**met**: 0.95x") and fast.endswith("**missed**: 612 ms")
    assert fork_targets(1.0, None)[1].endswith("**missed**: not measured (no fork phase measured)")
