"""Advantage estimators and losses against values computed by hand (the numbers are in the comments)."""

import math

import pytest
import torch

from rl.algos import (
    aggregate,
    clipped_policy_loss,
    clipped_value_loss,
    gae,
    grpo_advantages,
    kl_estimate,
    rloo_advantages,
    sft_loss,
    truncated_is_weights,
    zero_variance_groups,
)

REWARDS = torch.tensor([1.0, 0, 0, 0, 1, 1, 0, 0])


def test_grpo_normalises_each_group_by_its_mean_and_population_std():
    # group 1: mean .25, std sqrt(.25 * .75) = .4330; group 2: mean .5, std .5
    adv = grpo_advantages(REWARDS, group_size=4, eps=0.0)
    s = 0.75 / math.sqrt(0.1875)
    expected = torch.tensor([s, -s / 3, -s / 3, -s / 3, 1, 1, -1, -1])
    torch.testing.assert_close(adv, expected)


def test_dr_grpo_only_centres_the_rewards():
    adv = grpo_advantages(REWARDS, group_size=4, scale_by_std=False)
    torch.testing.assert_close(adv, torch.tensor([0.75, -0.25, -0.25, -0.25, 0.5, 0.5, -0.5, -0.5]))


def test_grpo_gives_zero_advantage_to_a_group_with_equal_rewards():
    adv = grpo_advantages(torch.tensor([1.0, 1.0, 0.0, 0.0]), group_size=2)
    torch.testing.assert_close(adv, torch.zeros(4))


def test_rloo_subtracts_the_mean_of_the_other_members():
    adv = rloo_advantages(REWARDS, group_size=4)
    third = 1 / 3
    expected = torch.tensor(
        [1, -third, -third, -third, 0.5 + 1 / 6, 0.5 + 1 / 6, -(0.5 + 1 / 6), -(0.5 + 1 / 6)]
    )
    # member 4 of group 2: 1 - mean(1, 0, 0) = 2/3
    torch.testing.assert_close(adv, expected)


def test_rewards_that_do_not_split_into_groups_are_refused():
    with pytest.raises(ValueError, match="groups of 3"):
        grpo_advantages(REWARDS, group_size=3)


def test_dapo_filter_marks_groups_without_reward_variance():
    mask = zero_variance_groups(torch.tensor([1.0, 1, 0, 1, 0, 0]), group_size=2)
    assert mask.tolist() == [True, True, False, False, True, True]


def test_gae_skips_observation_tokens_between_actions():
    # tokens: action, observation, action, action (last one ends the episode with reward 1)
    rewards = torch.tensor([[0.0, 0, 0, 1]])
    values = torch.tensor([[0.5, 9.0, 0.2, 0.4]])
    mask = torch.tensor([[1, 0, 1, 1]])
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    # t3: δ = 1 - .4 = .6            A3 = .6
    # t2: δ = .9 * .4 - .2 = .16      A2 = .16 + .72 * .6 = .592
    # t0: δ = .9 * .2 - .5 = -.32     A0 = -.32 + .72 * .592 = .10624   (t1 is skipped)
    torch.testing.assert_close(adv, torch.tensor([[0.10624, 0.0, 0.592, 0.6]]))
    torch.testing.assert_close(ret, torch.tensor([[0.60624, 0.0, 0.792, 1.0]]))


def test_gae_with_lambda_one_and_gamma_one_is_return_minus_value():
    rewards = torch.tensor([[0.0, 0.0, 2.0]])
    values = torch.tensor([[0.5, 1.0, 1.5]])
    adv, _ = gae(rewards, values, torch.ones(1, 3), gamma=1.0, lam=1.0)
    torch.testing.assert_close(adv, torch.tensor([[1.5, 1.0, 0.5]]))


def test_clipped_surrogate_takes_the_pessimistic_term():
    old = torch.zeros(1, 3)
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.1]]))
    adv = torch.tensor([[1.0, 1.0, -1.0]])
    loss, stats = clipped_policy_loss(logp, old, adv, torch.ones(1, 3), clip_low=0.2, clip_high=0.2)
    # token 0: min(1.5, 1.2) = 1.2; token 1: min(.5, .8) = .5; token 2: min(-1.1, -1.1) = -1.1
    assert loss.item() == pytest.approx((-1.2 - 0.5 + 1.1) / 3)
    assert stats.clip_fraction == pytest.approx(1 / 3)


def test_dapo_clip_higher_widens_the_upper_bound_only():
    old = torch.zeros(1, 2)
    logp = torch.log(torch.tensor([[1.5, 0.5]]))
    adv = torch.tensor([[1.0, -1.0]])
    loss, _ = clipped_policy_loss(logp, old, adv, torch.ones(1, 2), clip_low=0.2, clip_high=0.28)
    # token 0: min(1.5, 1.28) = 1.28; token 1: min(-.5, -.8) = -.8 (lower clip still .2)
    assert loss.item() == pytest.approx((-1.28 + 0.8) / 2)


def test_policy_gradient_vanishes_on_masked_tokens():
    logp = torch.zeros(1, 2, requires_grad=True)
    loss, _ = clipped_policy_loss(logp, torch.zeros(1, 2), torch.ones(1, 2), torch.tensor([[1.0, 0.0]]))
    loss.backward()
    assert logp.grad[0, 1].item() == 0.0 and logp.grad[0, 0].item() == pytest.approx(-1.0)


def test_loss_aggregations():
    loss = torch.tensor([[1.0, 2, 3], [4, 0, 0], [7, 7, 7]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])  # row 3: a failed episode
    assert aggregate(loss, mask, "token_mean").item() == pytest.approx(10 / 4)
    assert aggregate(loss, mask, "seq_mean_token_mean").item() == pytest.approx((2 + 4) / 2)
    assert aggregate(loss, mask, "seq_mean_token_sum_norm").item() == pytest.approx((6 / 3 + 4 / 3) / 2)
    with pytest.raises(ValueError, match="unknown loss aggregation"):
        aggregate(loss, mask, "sum")


def test_clipped_value_loss_takes_the_larger_error():
    values, old, ret = torch.tensor([[1.0]]), torch.tensor([[0.5]]), torch.tensor([[2.0]])
    # clipped value .7: max((1 - 2)², (.7 - 2)²) / 2 = 1.69 / 2
    assert clipped_value_loss(values, old, ret, torch.ones(1, 1), clip_eps=0.2).item() == pytest.approx(0.845)


def test_kl_estimators():
    logp, ref = torch.log(torch.tensor([0.5])), torch.log(torch.tensor([0.25]))
    ln2 = math.log(2)
    assert kl_estimate(logp, ref, "k1").item() == pytest.approx(ln2)
    assert kl_estimate(logp, ref, "k2").item() == pytest.approx(0.5 * ln2**2)
    assert kl_estimate(logp, ref, "k3").item() == pytest.approx(0.5 + ln2 - 1)
    assert kl_estimate(ref, ref, "k3").item() == 0.0


def test_truncated_is_weights_cap_the_ratio():
    w = truncated_is_weights(torch.tensor([-1.0, -2.0]), torch.tensor([-2.0, -1.0]), cap=2.0)
    torch.testing.assert_close(w, torch.tensor([2.0, math.exp(-1)]))


def test_sft_loss_is_cross_entropy_on_action_tokens_only():
    # position 0 is an observation token with a huge loss (target 0 vs logit 100 on token 1): masked out
    logits = torch.tensor([[[0.0, 100.0], [0.0, math.log(3.0)], [0.0, math.log(3.0)]]], requires_grad=True)
    targets = torch.tensor([[0, 1, 0]])
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    loss, stats = sft_loss(logits, targets, mask)
    # p(1) = 3/4 at position 1, p(0) = 1/4 at position 2
    assert loss.item() == pytest.approx((math.log(4 / 3) + math.log(4)) / 2)
    assert stats.accuracy == pytest.approx(0.5)
    assert stats.tokens == 2
    loss.backward()
    assert torch.all(logits.grad[0, 0] == 0)
    assert torch.all(logits.grad[0, 1:] != 0)
