"""``rollout.tree`` and ``algo=tree_grpo``: typed, validated, each mistake one line naming its key."""

from __future__ import annotations

import pytest
from rl_testutil import compose

from agentenv.errors import ConfigError

TREE = "rollout.tree={branch_at: [1, 2], width: 2, depth: 2, budget: 4}"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (("algo=tree_grpo",), r"rollout.tree: algo=tree_grpo needs branching rollouts"),
        ((TREE,), r"rollout.tree: branching rollouts are trained by algo=tree_grpo only, got algo=grpo"),
        (("algo=tree_grpo", "rollout.tree={branch_at: [], width: 2, depth: 1, budget: 4}"),
         r"rollout.tree.branch_at: needs at least one turn"),
        (("algo=tree_grpo", "rollout.tree={branch_at: [0, 2], width: 2, depth: 1, budget: 4}"),
         r"rollout.tree.branch_at: turns count from 1 .*got \[0, 2\]"),
        (("algo=tree_grpo", "rollout.tree={branch_at: [3, 2], width: 2, depth: 1, budget: 4}"),
         r"rollout.tree.branch_at: turns must be strictly increasing, got \[3, 2\]"),
        (("algo=tree_grpo", "rollout.tree={branch_at: [1], width: 2, depth: 2, budget: 4}"),
         r"rollout.tree.depth: 2 branchings per path need as many turns .* has 1"),
        (("algo=tree_grpo", "rollout.tree={branch_at: [1], width: 3, depth: 1, budget: 2}"),
         r"rollout.tree.budget: 2 leaves cannot hold one branching of rollout.tree.width=3"),
        (("algo=tree_grpo", "rollout.tree={branch_at: [1], width: 1, depth: 1, budget: 2}"),
         r"rollout.tree.width: must be >= 2, got 1"),
        (("algo=tree_grpo", "rollout.tree={branch_at: [1], width: 2, depth: 1}"),
         r"rollout.tree.budget"),
        (("algo=tree_grpo", "rollout.tree={branch_at: [1], width: 2, depth: 1, budget: 4, fanout: 2}"),
         r"rollout.tree.fanout"),
        (("algo=tree_grpo", "rollout.tree={branch_at: [1], width: 3, depth: 1, budget: 3}"),
         r"algo.group_size: 8 leaves per prompt are not whole trees: a tree of rollout.tree has 3 leaves"),
        (("algo=tree_grpo", "rollout.tree={branch_at: [1], width: 2, depth: 1, budget: 2, entropy_rise: -1}"),
         r"rollout.tree.entropy_rise: must be >= 0, got -1"),
        (("algo=tree_grpo", "rollout=vllm", TREE.replace("budget: 4", "budget: 4, entropy_rise: 0.1")),
         r"rollout.tree.entropy_rise: branching by entropy .* only the torch engine keeps; got "
         r"rollout.engine=vllm"),
        (("algo=tree_grpo", "rollout.max_concurrent_episodes=8", TREE),
         r"rollout.max_concurrent_episodes: a tree run plays all its trees at once"),
    ],
)
def test_tree_mistakes_are_one_line_naming_their_key(overrides, message):
    with pytest.raises(ConfigError, match=message) as info:
        compose(*overrides)
    assert "\n" not in str(info.value)


def test_a_valid_tree_is_typed_and_accepted():
    cfg = compose("algo=tree_grpo", TREE)
    assert cfg.algo.name == "tree_grpo" and cfg.algo.group_size == 8
    assert cfg.rollout.tree.branch_at == [1, 2] and cfg.rollout.tree.width == 2
    assert cfg.rollout.tree.entropy_rise is None  # fixed turns unless set
    by_entropy = compose("algo=tree_grpo", TREE.replace("budget: 4", "budget: 4, entropy_rise: 0.25"))
    assert by_entropy.rollout.tree.entropy_rise == 0.25
    assert compose().rollout.tree is None and compose("algo=grpo").algo.name == "grpo"
    on_vllm = compose("algo=tree_grpo", "rollout=vllm", TREE)  # fixed turns: vLLM re-reads each child
    assert on_vllm.rollout.engine == "vllm" and on_vllm.rollout.tree.width == 2
