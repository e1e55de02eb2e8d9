"""Async training's parts without sandboxes: the staleness filter, per-token versions, the worker's
standby weights, and the decoupled PPO objective with a behaviour policy several versions old."""

import copy

import pytest
import torch
from rl_testutil import compose

from rl.algos import clipped_policy_loss, truncated_is_weights
from rl.driver.async_source import AsyncRollouts, split_stale
from rl.driver.rollout_workers import RolloutWorkers
from rl.driver.sources import FinishedGroup
from rl.episode import Episode, EpisodeSummary, collate
from rl.learner.learner import Learner
from rl.policy import build_policy_shell
from rl.rollout.actor import RolloutWorker
from rl.rollout.torch_engine import TorchEngine
from rl.tokenizer import ByteTokenizer

TOK = ByteTokenizer()


def group(oldest, size=2, newest=None):
    outcome = EpisodeSummary(False, 0.0, 1, 10, False, oldest, oldest if newest is None else newest)
    return FinishedGroup(ref=f"group-{oldest}", outcomes=[outcome] * size)


def test_groups_more_than_max_staleness_versions_behind_are_dropped():
    groups = [group(2), group(3), group(5), group(None), group(1, newest=5)]
    kept, dropped = split_stale(groups, version=5, max_staleness=2)
    assert [g.oldest_version for g in kept] == [3, 5, None]  # a group without action tokens is fresh
    assert [g.oldest_version for g in dropped] == [2, 1]  # a partial rollout is as old as its oldest token
    assert split_stale(groups, 5, 0)[0] == [groups[2], groups[3]]


def test_a_batch_takes_the_first_fresh_groups_counts_the_dropped_and_keeps_the_rest():
    stream = AsyncRollouts(
        RolloutWorkers([None], max_restarts=0),  # no worker is asked: enough groups are finished already
        seed=0,
        stream=0,
        group_size=2,
        num_groups=2,
        in_flight=2,
        max_staleness=1,
        keep_in_flight=False,
    )
    stream.ready = [group(3), group(5), group(4, newest=5), group(5), group(2)]
    batch = stream.next_batch(version=5)
    assert batch.refs == ["group-5", "group-4"]
    assert [g.ref for g in stream.ready] == ["group-5"]  # left for the next batch
    assert batch.metrics == {
        "staleness_mean": 0.5,
        "staleness_max": 1.0,
        "partial_rollout_episodes": 2.0,
        "dropped_episodes": 4.0,  # two groups of two, 2 and 3 versions behind
        "continued_episodes": 0.0,
    }


def test_tokens_record_their_version_and_collate_ignores_it():
    e = Episode("agentenv/GuessNumber-v0", seed=0, group=0)
    e.append([257, 259, 261, 260], trained=False, version=3)
    e.append([48, 261], trained=True, logprobs=[-1.0, -0.5], version=3)
    e.append([259, 261, 260], trained=False, version=4)
    e.append([49, 261], trained=True, logprobs=[-2.0, -0.1], version=4)
    assert e.versions == [3] * 6 + [4] * 5 and (e.oldest_version, e.newest_version) == (3, 4)
    assert (EpisodeSummary.of(e).oldest_version, EpisodeSummary.of(e).newest_version) == (3, 4)
    same = Episode(e.env_id, 0, 0, tokens=e.tokens, action_mask=e.action_mask, logprobs=e.logprobs)
    assert same.oldest_version is None
    a, b = collate([e], TOK.pad_id), collate([same], TOK.pad_id)
    assert vars(a).keys() == vars(b).keys() and a.routes is None and b.routes is None  # no engine records
    assert all(torch.equal(getattr(a, k), getattr(b, k)) for k in vars(a) if k != "routes")


@pytest.fixture(scope="module")
def cfg():
    return compose("algo.group_size=2", "algo.episodes_per_step=2", "algo.minibatches=1",
                   "trainer.learner_threads=1")


def test_a_worker_swaps_in_offered_weights_between_turns_without_waiting_on_a_copy(cfg):
    learner = Learner(cfg)
    worker = RolloutWorker(cfg, index=0)
    worker.load_weights(*learner.weights())
    serving = worker.model
    new = {k: v + 0.01 for k, v in learner.weights()[1].items()}
    assert worker.offer_weights(1, new) == 1 and worker.model is serving  # copied into the standby only
    assert worker.offer_weights(0, learner.weights()[1]) == 1  # an older offer is ignored
    with worker._standby_lock:  # a copy in progress: this turn keeps the weights it has
        assert worker._turn_version() == 0 and worker.engine.model is serving
    assert worker._turn_version() == 1 and worker.engine.model is worker.model is not serving
    assert torch.equal(worker.model.state_dict()["lm_head.weight"], new["lm_head.weight"])


def sample_turn(cfg, model, context, generator):
    """One sampled action of ``model`` after ``context``: its ids and sampling log-probs."""
    gen = TorchEngine(model, TOK, cfg.rollout.temperature, cfg.env.action_vocabulary).generate(
        [context], 4, generator
    )[0]
    return gen.token_ids, gen.logprobs


def token_probs(cfg, model, tokens: list[int]) -> torch.Tensor:
    """``[T-1]``: each token's probability under ``model`` given the tokens before it (teacher forcing),
    with the rollout's temperature and action vocabulary: what sampling it had as its chance."""
    engine = TorchEngine(model, TOK, cfg.rollout.temperature, cfg.env.action_vocabulary)
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0, :-1] / cfg.rollout.temperature
    logits = logits.masked_fill(engine.disallowed, float("-inf"))
    return torch.softmax(logits, -1).gather(-1, torch.tensor(tokens[1:])[:, None]).squeeze(-1)


def test_decoupled_objective_weights_each_token_by_its_own_behaviour_version(cfg):
    """A partial rollout: turn 1 sampled by v0, turn 2 by v2; the learner (proximal policy) is at v2.
    The IS weight of a token is min(π_prox / π_behav, cap) with the version that sampled it: 1 for
    turn 2, the v2/v0 ratio for turn 1; the clip is against π_prox, not against the old π_behav."""
    learner = Learner(cfg)
    v0 = build_policy_shell(cfg.model)
    v0.load_state_dict(learner.weights()[1])
    with torch.no_grad():  # two versions of updates, made large so that v0 and v2 clearly differ
        for p in learner.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    v2 = build_policy_shell(cfg.model)  # the learner's weights in a plain policy, to sample with
    v2.load_state_dict(learner.weights()[1])
    generator = torch.Generator().manual_seed(0)
    e = Episode("agentenv/GuessNumber-v0", seed=0, group=0)
    e.append([TOK.bos_id, TOK.observation_id, *TOK.encode("guess 0-7"), TOK.end_id, TOK.action_id], False)
    ids, logprobs = sample_turn(cfg, v0, e.tokens, generator)
    e.append(ids, trained=True, logprobs=logprobs, version=0)
    e.append([TOK.observation_id, *TOK.encode("higher"), TOK.end_id, TOK.action_id], False, version=2)
    ids, logprobs = sample_turn(cfg, v2, e.tokens, generator)
    e.append(ids, trained=True, logprobs=logprobs, version=2)
    batch = collate([e], TOK.pad_id)
    with torch.no_grad():
        prox = learner._forward(batch)[0]
    cap = cfg.algo.tis_cap
    weights = truncated_is_weights(prox, batch.rollout_logprobs, cap)
    versions = torch.tensor(e.versions[1:], dtype=torch.long)[None]
    turn1 = batch.action_mask.bool() & (versions == 0)
    turn2 = batch.action_mask.bool() & (versions == 2)
    torch.testing.assert_close(weights[turn2], torch.ones(int(turn2.sum())), atol=2e-4, rtol=0)
    # independently of the recorded log-probs and of the formula: each token's probability under v2 and
    # under v0 (the policy that really sampled it), from their own forward passes, divided
    expected = (token_probs(cfg, v2, e.tokens) / token_probs(cfg, v0, e.tokens)).clamp(max=cap)
    torch.testing.assert_close(weights[turn1], expected[turn1[0]], atol=2e-4, rtol=1e-4)
    assert (weights[turn1] - 1).abs().max() > 0.05  # v0 is really another policy
    # through the learner: the weights its step applies are these (its is_weight_mean is their mean over
    # the trained tokens); a second member with another reward makes a group of 2 with a signal
    other = copy.deepcopy(e)
    other.step_rewards.append((len(e.tokens) - 1, 1.0))
    applied = torch.where(turn2[0], 1.0, expected)[batch.action_mask[0].bool()]  # turn 2: v2 sampled it
    metrics = learner.train_step([e, other])
    assert metrics["is_weight_mean"] == pytest.approx(float(applied.mean()), abs=2e-4)
    assert abs(metrics["is_weight_mean"] - 1.0) > 0.01  # not the weights of an on-policy batch

    # The gradient: at θ = θ_prox the ratio is 1 and each token's gradient is -w A (token mean).
    advantages = torch.ones_like(prox)
    logp = prox.clone().requires_grad_(True)
    loss, _ = clipped_policy_loss(logp, prox, advantages, batch.action_mask, is_weights=weights)
    loss.backward()
    n = batch.action_mask.sum()
    torch.testing.assert_close(logp.grad, -weights * batch.action_mask / n)
    # Clipped against π_prox: a step that moved a token's ratio past 1 + ε gets no more gradient,
    # whatever its (old) behaviour policy.
    moved = (prox + 0.5 * batch.action_mask).requires_grad_(True)
    loss, stats = clipped_policy_loss(moved, prox, advantages, batch.action_mask, is_weights=weights)
    loss.backward()
    assert stats.clip_fraction == 1.0 and moved.grad.abs().max() == 0


def test_async_mode_needs_the_behaviour_importance_weight():
    from agentenv.errors import ConfigError

    with pytest.raises(ConfigError, match="algo.tis_cap: trainer.mode=async needs"):
        compose("trainer.mode=async", "algo.tis_cap=null")
    async_cfg = compose("trainer.mode=async")  # the default cap passes, unchanged by the check
    default_cap = compose().algo.tis_cap
    assert default_cap is not None
    assert (async_cfg.trainer.mode, async_cfg.algo.tis_cap) == ("async", default_cap)
