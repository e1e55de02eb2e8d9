"""The learner on synthetic episodes (no sandboxes): balancing, KL, zero-weight samples, weight versions."""

import random
from dataclasses import replace

import pytest
import torch
from rl_testutil import compose

from rl.episode import Episode, collate
from rl.errors import StaleWeights
from rl.learner.learner import Learner
from rl.rollout.actor import RolloutWorker


def episodes(n=8, failed=False, seed=0):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        e = Episode("agentenv/GuessNumber-v0", seed=i // 4, group=i // 4)
        e.append([257, 259, *b"guess 0-7", 261, 260], trained=False)
        for _turn in range(2):
            e.append([48 + rng.randrange(8), 261], trained=True, logprobs=[-2.0, -1.0])
            e.step_rewards.append((len(e.tokens) - 1, float(rng.random() < 0.5)))
            e.append([259, *b"higher", 261, 260], trained=False)
        if failed:
            e.fail("RuntimeError: sandbox gone")
        out.append(e)
    return out


@pytest.fixture(scope="module")
def cfg():
    return compose("algo.group_size=4", "algo.episodes_per_step=8", "trainer.learner_threads=1")


def test_a_step_rebalances_every_router_and_logs_maxvio(cfg):
    learner = Learner(cfg)
    metrics = learner.train_step(episodes())
    biases = [r.e_score_correction_bias for r in learner.model.moe_routers()]
    assert len(biases) == 3 and all(b.abs().sum() > 0 for b in biases)  # set by quantile balancing
    assert all(abs(float(b.mean())) < 1e-5 for b in biases)  # mean-centred
    assert {"maxvio/layer1", "maxvio/layer2", "maxvio/layer3", "maxvio"} <= metrics.keys()
    assert metrics["weights_version"] == 1.0 and learner.weights()[0] == 1
    # the sampling floor of these tokens: > 0, and drawn without touching the run's RNG
    state = torch.get_rng_state()
    assert 0 < learner._maxvio_floor(collate(episodes(), learner.pad_id), slice(None)) < 10
    assert torch.equal(state, torch.get_rng_state()) and metrics["maxvio_floor"] > 0


def test_kl_to_the_frozen_reference_starts_at_zero_and_grows(cfg):
    learner = Learner(replace(cfg, algo=replace(cfg.algo, kl_coef=0.1, epochs=1, minibatches=1)))  # one step
    assert learner.train_step(episodes())["kl"] == pytest.approx(0.0, abs=1e-7)
    assert learner.train_step(episodes(seed=1))["kl"] > 0


def test_failed_episodes_are_zero_weight_samples(cfg):
    learner = Learner(cfg)
    before = {k: v.clone() for k, v in learner.model.named_parameters() if v.requires_grad}
    metrics = learner.train_step(episodes(failed=True))
    assert metrics["trained_tokens"] == 0.0
    after = dict(learner.model.named_parameters())
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_ppo_learns_a_value_head_over_epochs_and_minibatches(cfg):
    ppo = compose("algo=ppo", "algo.episodes_per_step=8", "algo.epochs=2", "algo.minibatches=2")
    learner = Learner(ppo)
    metrics = learner.train_step(episodes())
    assert learner.value_head is not None and metrics["value_loss"] > 0
    assert learner.value_head.weight.abs().sum() > 0
    assert learner.optimizer.state_dict()["state"][0]["step"] == 4  # 2 epochs x 2 minibatches
    assert metrics["approx_kl"] != 0.0  # later updates see a policy that moved: the ratio is not 1


def test_workers_refuse_stale_weights(cfg):
    worker = RolloutWorker(cfg, index=0)
    learner = Learner(cfg)
    learner.train_step(episodes())
    version, state = learner.weights()
    worker.load_weights(version, state)
    with pytest.raises(StaleWeights, match="refusing older v0"):
        worker.load_weights(0, state)
    with pytest.raises(StaleWeights, match="holds weights v1 but the batch needs v2"):
        worker.rollout([1], 2, 0, sample_seed=0, expected_version=2)


def test_lr_schedule_warms_up_then_decays_linearly():
    from rl.learner.optim import lr_schedule

    constant, decaying = lr_schedule(2, None, 0.1), lr_schedule(2, 10, 0.1)
    assert [constant(s) for s in (0, 1, 5, 100)] == [0.5, 1.0, 1.0, 1.0]
    assert [round(decaying(s), 2) for s in (0, 2, 7, 12, 50)] == [0.5, 1.0, 0.55, 0.1, 0.1]


def test_rl_and_sft_build_their_optimizer_from_their_own_optim_group():
    """``algo.optim`` and ``sft.optim`` are one schema; each stage's learner is built from its own."""
    from rl.config import OptimConfig
    from rl.sft.trainer import SFTLearner

    cfg = compose(
        "algo.optim.lr=2e-3", "algo.optim.betas=[0.8,0.9]", "algo.optim.weight_decay=0.01",
        "sft.optim.lr=5e-3", "sft.optim.eps=1e-6", "sft.optim.warmup_steps=1", "trainer.learner_threads=1",
    )
    assert isinstance(cfg.algo.optim, OptimConfig) and isinstance(cfg.sft.optim, OptimConfig)
    for learner, optim in ((Learner(cfg), cfg.algo.optim), (SFTLearner(cfg), cfg.sft.optim)):
        group = learner.optimizer.param_groups[0]
        assert learner.scheduler.base_lrs == [optim.lr]
        assert group["betas"] == tuple(optim.betas) and group["eps"] == optim.eps
        assert group["weight_decay"] == optim.weight_decay
    assert Learner(cfg).optimizer.param_groups[0]["betas"] == (0.8, 0.9)
    assert SFTLearner(cfg).scheduler.get_last_lr() == [5e-3]  # one warm-up step: the full lr at once


def test_ppo_balances_the_routers_after_every_optimizer_step(monkeypatch):
    """2 epochs x 2 minibatches = 4 optimizer steps, each followed by a bias update of every router."""
    from model.moe import TopKRouter

    updates = []
    original = TopKRouter.update_bias

    def counting_update(self, new_bias):
        updates.append(self)
        original(self, new_bias)

    monkeypatch.setattr(TopKRouter, "update_bias", counting_update)
    learner = Learner(compose("algo=ppo", "algo.episodes_per_step=8"))
    metrics = learner.train_step(episodes())
    assert metrics["optimizer_steps"] == 4.0
    assert len(updates) == 4 * len(learner.model.moe_routers())


@pytest.mark.parametrize("rate", [1.0, 0.3])
def test_in_loop_maxvio_falls_over_optimizer_steps_from_a_collapsed_router(rate):
    """A short PPO run from routers that send every token to experts 0 and 1 (MaxVio = 16/2 - 1 = 7):
    with K3's exact per-step solution (balance_rate 1) the next steps' routing is close to even within
    the first batch and stays there; the default damped rate gets there over a few batches."""
    learner = Learner(compose("algo=ppo", "algo.episodes_per_step=8", f"algo.balance_rate={rate}"))
    for router in learner.model.moe_routers():
        collapsed = torch.zeros_like(router.e_score_correction_bias)
        collapsed[:2] = 1.0
        router.update_bias(collapsed)
    history = [learner.train_step(episodes(seed=i)) for i in range(3)]
    assert history[0]["maxvio_first_update"] == pytest.approx(7.0)
    if rate == 1.0:
        assert history[0]["maxvio_last_update"] < 2.0  # within the first batch: 3 updates later
        assert all(m["maxvio"] < 1.5 for m in history[1:])
    else:
        assert history[-1]["maxvio_last_update"] < 2.0, [m["maxvio_last_update"] for m in history]
