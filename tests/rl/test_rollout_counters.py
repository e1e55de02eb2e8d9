"""`EpisodeRunner` with the tiny policy and real sandboxes: ``sandboxes_created`` counts the sandboxes the
resets made (one per episode for a task that restores its state), each episode says what cut it (the
task's ``max_turns``, the token limit), and the task's ``Outcome.info`` numbers reach the outcomes the
driver reads."""

from __future__ import annotations

from dataclasses import replace

import gymnasium
import pytest
import torch
from rl_testutil import compose

from agentenv.tasks.guess_number import GuessNumber
from rl.policy import build_policy
from rl.rollout.runner import EpisodeRunner
from rl.rollout.torch_engine import TorchEngine
from rl.tokenizer import ByteTokenizer

pytestmark = pytest.mark.docker
TOK = ByteTokenizer()


class RestoringGuess(GuessNumber):
    """GuessNumber without its in-place reset: every episode after a played one gets a new sandbox."""

    in_place_reset = None


if "counters/RestoringGuess-v0" not in gymnasium.registry:
    gymnasium.register("counters/RestoringGuess-v0", entry_point=RestoringGuess, disable_env_checker=True)


@pytest.fixture(scope="module")
def policy():
    torch.manual_seed(0)
    return build_policy(compose().model, seed=0)


def runner(policy, sandbox_config, env_id: str, max_turns: int = 2, max_episode_tokens: int = 96):
    cfg = compose(f"env.kwargs.max_turns={max_turns}", "rollout.env_threads=4")
    env_cfg = replace(cfg.env, id=env_id, max_episode_tokens=max_episode_tokens)
    pool = replace(cfg.rollout.sandbox_pool, pause_policy="never")
    rollout = replace(cfg.rollout, sandbox_pool=pool)
    return EpisodeRunner(env_cfg, rollout, TorchEngine(policy, TOK), TOK, sandbox=sandbox_config)


def test_sandboxes_created_counts_the_sandboxes_resets_made(policy, sandbox_config):
    """The envs live across runs; their sandboxes do not (an in-place task's second run makes none:
    tests/rl/test_rollout.py, test_sandboxes_stay_alive_across_iterations)."""
    r = runner(policy, sandbox_config, "counters/RestoringGuess-v0")
    try:
        _, first = r.run([1, 2], 2, torch.Generator().manual_seed(0))
        _, second = r.run([3, 4], 2, torch.Generator().manual_seed(1))
    finally:
        r.close()
    assert first.failed == second.failed == 0
    assert first.sandboxes_created == 4 and second.sandboxes_created == 4


def test_each_episode_says_what_cut_it_and_carries_the_tasks_info(policy, sandbox_config):
    # 2 turns and room for them: a game not won in 2 guesses is cut by max_turns
    r = runner(policy, sandbox_config, "agentenv/GuessNumber-v0", max_turns=2, max_episode_tokens=96)
    try:
        episodes, stats = r.run([1, 2, 3], 2, torch.Generator().manual_seed(0))
    finally:
        r.close()
    for episode, outcome in zip(episodes, stats.outcomes, strict=True):
        assert episode.cut == (None if episode.success or episode.turns < 2 else "max_turns")
        assert outcome.cut == episode.cut
        assert {k for k, _ in outcome.task_info} == {"valid", "ruled_out"}  # GuessNumber's Outcome.info
    # 20 tokens hold the first observation and one action, not a second turn: every episode not over
    # after its first step is cut by the token limit
    r = runner(policy, sandbox_config, "agentenv/GuessNumber-v0", max_turns=3, max_episode_tokens=20)
    try:
        episodes, _ = r.run([1, 2], 2, torch.Generator().manual_seed(0))
    finally:
        r.close()
    assert all(e.cut == "tokens" for e in episodes if not e.success)
    assert any(e.cut == "tokens" for e in episodes)
