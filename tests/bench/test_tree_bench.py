"""bench/tree.py's verdicts from training records: the cost at which tree GRPO first reaches chain GRPO's
final success, as a share of chain's, and both runs' success at the tokens both generated."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.append(str(Path(__file__).resolve().parents[2] / "bench"))

from tree import curve, seed_verdict, success_at  # noqa: E402


def records(success: list[float], tokens: int, sandbox_s: float) -> list[dict]:
    return [{"success": s, "generated_tokens": tokens, "sandbox_running_s": sandbox_s, "elapsed_s": 60.0 * i}
            for i, s in enumerate(success)]  # fmt: skip


def test_the_curve_sums_the_costs_and_smooths_success_over_three_iterations():
    points = curve(records([0.0, 0.3, 0.6, 0.9], 100, 10.0))
    assert [p[0] for p in points] == [100, 200, 300, 400] and [p[1] for p in points] == [10, 20, 30, 40]
    assert [p[2] for p in points] == [0, 1, 2, 3]
    assert [p[3] for p in points] == pytest.approx([0.0, 0.15, 0.3, 0.6])


def test_a_tree_that_reaches_chains_final_success_for_less_is_measured_against_chains_cost_to_it():
    chain = curve(records([0.0, 0.0, 0.3, 0.6, 0.6, 0.6], 100, 10.0))  # final 0.6, first at 600 tokens
    tree = curve(records([0.0, 0.6, 0.6, 0.9], 60, 5.0))  # windowed 0.6 first at iteration 3: 240 tokens
    v = seed_verdict(chain, tree)
    assert v["chain_final"] == pytest.approx(0.6) and v["tree_final"] == pytest.approx(0.7)
    assert v["tokens_ratio"] == pytest.approx(240 / 600) and v["sandbox_ratio"] == pytest.approx(20 / 60)
    assert v["budget"] == 240 and v["equal_budget"] == (pytest.approx(0.7), 0.0)


def test_a_tree_that_never_reaches_chains_final_success_has_no_ratio():
    chain = curve(records([0.5, 0.5, 0.5], 100, 10.0))
    tree = curve(records([0.0, 0.1, 0.2], 100, 10.0))
    assert seed_verdict(chain, tree)["tokens_ratio"] is None
    assert success_at(tree, 50) == 0.0 and success_at(tree, 300) == pytest.approx(0.1)


def test_a_chain_that_learned_nothing_gives_no_verdict():
    """Reaching a final success of 0 costs nothing: a 'met' there would be meaningless."""
    chain = curve(records([0.0, 0.0, 0.0], 100, 10.0))
    tree = curve(records([0.0, 0.0, 0.0], 100, 10.0))
    v = seed_verdict(chain, tree)
    assert not v["learned"] and v["tokens_ratio"] is None and v["sandbox_ratio"] is None
    learned = seed_verdict(curve(records([0.0, 0.3, 0.6], 100, 10.0)), tree)
    assert learned["learned"]

