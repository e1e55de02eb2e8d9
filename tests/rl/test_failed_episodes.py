"""Failed episodes do not poison their groups (issue 26, item 4), on hand-made batches (no sandboxes):
the group statistics skip failed members, a group with too few valid members is left out, the learner's
update ignores a failed episode's reward and tokens, and the driver counts failures by kind."""

import math
from dataclasses import replace

import pytest
import torch
from rl_testutil import compose

from agentenv.errors import ExecTimeout, SandboxNotFound, SessionError
from rl.algos import grpo_advantages, rloo_advantages, usable_episodes, zero_variance_groups
from rl.episode import Episode, EpisodeSummary
from rl.failures import failure_kind, failure_metrics
from rl.learner.learner import Learner

# two groups of 4; member 3 of group 0 failed (its 0 would drag the group's mean down)
REWARDS = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0])
VALID = torch.tensor([True, True, True, False, True, True, True, True])


def test_grpo_statistics_are_over_the_valid_members_only():
    adv = grpo_advantages(REWARDS, 4, eps=0.0, valid=VALID)
    # group 0's valid members [1, 0, 1]: mean 2/3, population std sqrt(2/9)
    s = math.sqrt(2 / 9)
    torch.testing.assert_close(adv[:4], torch.tensor([(1 / 3) / s, (-2 / 3) / s, (1 / 3) / s, 0.0]))
    torch.testing.assert_close(adv[4:], grpo_advantages(REWARDS[4:], 4, eps=0.0))  # all valid: unchanged
    # the failed member's reward does not matter at all
    other = REWARDS.clone()
    other[3] = 7.0
    same = grpo_advantages(other, 4, valid=VALID)
    torch.testing.assert_close(same, grpo_advantages(REWARDS, 4, valid=VALID))
    dr_grpo = grpo_advantages(REWARDS, 4, scale_by_std=False, valid=VALID)  # centred on the valid mean
    torch.testing.assert_close(dr_grpo[:4], torch.tensor([1 / 3, -2 / 3, 1 / 3, 0]))


def test_rloo_baseline_is_the_mean_of_the_other_valid_members():
    adv = rloo_advantages(REWARDS, 4, valid=VALID)
    # member 0: 1 - mean(0, 1) = 0.5; member 1: 0 - mean(1, 1) = -1; member 2: 1 - mean(1, 0) = 0.5
    torch.testing.assert_close(adv[:4], torch.tensor([0.5, -1.0, 0.5, 0.0]))
    lone = rloo_advantages(torch.tensor([1.0, 0.0]), 2, valid=torch.tensor([True, False]))
    torch.testing.assert_close(lone, torch.zeros(2))  # no other valid member: no baseline, no signal


def test_zero_variance_filter_looks_at_the_valid_members():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 1.0])
    valid = torch.tensor([True, True, False, True, False, False])
    # group 0: valid rewards [1, 1] are equal (the failed 0 is no variance); group 1: one valid member
    assert zero_variance_groups(rewards, 3, valid=valid).tolist() == [True] * 6
    assert zero_variance_groups(rewards, 3).tolist() == [False] * 6


def test_a_group_trains_only_with_enough_valid_members():
    valid = torch.tensor([True, True, True, False, True, False, False, False])
    assert usable_episodes(valid, 4, 2).tolist() == [True, True, True, False] + [False] * 4
    assert usable_episodes(valid, 4, 1).tolist() == valid.tolist()
    assert usable_episodes(valid, 4, 4).tolist() == [False] * 8
    with pytest.raises(ValueError, match="min_valid must be >= 1"):
        usable_episodes(valid, 4, 0)


def test_exceptions_are_classified_by_kind():
    assert failure_kind(ExecTimeout("platform limit")) == "exec_timeout"
    assert failure_kind(SandboxNotFound("gone")) == "sandbox_lost"
    assert failure_kind(SessionError("shell ended")) == "sandbox_lost"
    assert failure_kind(ValueError("task bug")) == "runtime_error"
    e = Episode("x", 0, 0)
    e.fail(ExecTimeout("platform limit"))
    assert (e.failure, e.weight, EpisodeSummary.of(e).failure) == ("exec_timeout", 0.0, "exec_timeout")
    e.fail("could not restore", "sandbox_lost")
    assert e.failure == "sandbox_lost"


def test_the_driver_counts_failures_by_kind_and_excluded_groups():
    ok = EpisodeSummary(False, 0.0, 1, 5, False)
    lost = EpisodeSummary(False, 0.0, 1, 5, True, failure="sandbox_lost")
    timeout = EpisodeSummary(False, 0.0, 1, 5, True, failure="exec_timeout")
    metrics = failure_metrics([[ok, ok, ok, lost], [ok, lost, timeout, timeout]], min_valid=2)
    assert metrics == {"failed_sandbox_lost": 2.0, "failed_exec_timeout": 2.0, "failed_runtime_error": 0.0,
                       "excluded_groups": 1.0, "excluded_episodes": 5.0}


def episode(seed: int, group: int, guess: int, reward: float, failed: bool = False) -> Episode:
    e = Episode("agentenv/GuessNumber-v0", seed=seed, group=group)
    e.append([257, 259, *b"guess 0-7", 261, 260], trained=False)
    e.append([48 + guess, 261], trained=True, logprobs=[-2.0, -1.0])
    e.step_rewards.append((len(e.tokens) - 1, reward))
    if failed:
        e.fail(SandboxNotFound("its container was killed"))
    return e


def batch(failed_reward: float, failed_guess: int, group1_failures: int) -> list[Episode]:
    """Group 0: three valid members and one failed (its reward and tokens vary); group 1: four members
    of which ``group1_failures`` failed."""
    group0 = [episode(0, 0, g, r) for g, r in ((1, 1.0), (2, 0.0), (3, 0.0))]
    group0.append(episode(0, 0, failed_guess, failed_reward, failed=True))
    group1 = [episode(1, 1, g, float(g % 2), failed=i < group1_failures) for i, g in enumerate((4, 5, 6, 7))]
    return group0 + group1


@pytest.fixture(scope="module")
def cfg():
    cfg = compose("algo.group_size=4", "algo.episodes_per_step=8", "trainer.learner_threads=1",
                  "algo.min_valid_members=2")
    return replace(cfg, algo=replace(cfg.algo, epochs=1, minibatches=1, entropy_coef=0.0))


def trained(cfg, episodes: list[Episode]) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    learner = Learner(cfg)
    metrics = learner.train_step(episodes)
    return metrics, {k: v.detach().clone() for k, v in learner.model.named_parameters()}


def test_the_learner_ignores_a_failed_members_reward(cfg):
    """(Its tokens are out of the loss mask, `trained_tokens`; they still pass through the forward, where
    the MoE's batched expert matmuls round differently with them, so only the reward is compared bit for
    bit.)"""
    base_metrics, base = trained(cfg, batch(failed_reward=0.0, failed_guess=0, group1_failures=0))
    _, other = trained(cfg, batch(failed_reward=5.0, failed_guess=0, group1_failures=0))
    assert all(torch.equal(base[k], other[k]) for k in base)  # the same update, bit for bit
    assert base_metrics["trained_tokens"] == 7 * 2  # 3 + 4 valid members, 2 action tokens each
    # the failed member counted: group 0's baseline moves and the update differs
    _, counted = trained(cfg, [*batch(0.0, 0, 0)[:3], episode(0, 0, 0, 0.0), *batch(0.0, 0, 0)[4:]])
    assert any(not torch.equal(base[k], counted[k]) for k in base)


def test_a_group_below_the_minimum_is_left_out_and_the_rest_still_trains(cfg):
    metrics, _ = trained(cfg, batch(0.0, 0, group1_failures=3))  # group 1 keeps one valid member of 4
    assert metrics["trained_tokens"] == 3 * 2  # only group 0's three valid members
    metrics, _ = trained(cfg, batch(0.0, 0, group1_failures=2))  # two remain: the group trains
    assert metrics["trained_tokens"] == 5 * 2
