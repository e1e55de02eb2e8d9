"""Routing replay (R3) end to end without sandboxes: the torch engine records the experts of every sampled
token, the records travel in the episodes to the learner, whose own routing matches them with the same
weights, differs from them with perturbed routers, and is replaced by them under ``algo.routing_replay``."""

import pickle
from dataclasses import replace

import pytest
import torch
from rl_testutil import compose

from rl.episode import Episode, collate
from rl.learner.learner import Learner
from rl.learner.routing import routing_mismatch
from rl.policy import build_policy_shell
from rl.rollout.torch_engine import TorchEngine
from rl.tokenizer import build_tokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def cfg():  # 2 groups of 2 episodes, one optimizer step per batch
    return compose(
        "algo.group_size=2", "algo.episodes_per_step=4", "algo.epochs=1", "algo.minibatches=1",
        "trainer.learner_threads=1",
    )  # fmt: skip


def play(cfg, weights: dict, turns: int = 2) -> list[Episode]:
    """Episodes of ``turns`` turns sampled by the torch engine with ``weights`` (the runner's layout)."""
    tok = build_tokenizer(cfg.tokenizer)
    model = build_policy_shell(cfg.model)
    model.load_state_dict(weights)
    engine = TorchEngine(model, tok, cfg.rollout.temperature, cfg.env.action_vocabulary)
    generator = torch.Generator().manual_seed(0)
    episodes = [Episode("agentenv/GuessNumber-v0", seed=i // 2, group=i // 2) for i in range(4)]
    for i, e in enumerate(episodes):
        prompt = [tok.bos_id, tok.observation_id, *tok.encode(f"guess 0-{i + 4}"), tok.end_id, tok.action_id]
        e.append(prompt, trained=False)
    for _turn in range(turns):
        for e, gen in zip(episodes, engine.generate([e.tokens for e in episodes], 3, generator), strict=True):
            assert gen.routes.shape == (len(gen.token_ids), 3, 2) and gen.routes.dtype == torch.int16
            e.append(gen.token_ids, trained=True, logprobs=gen.logprobs, routes=gen.routes)
            if not gen.ended:
                e.append([tok.end_id], trained=False)
            e.step_rewards.append((len(e.tokens) - 1, float(gen.token_ids[0] % 2)))
            e.append([tok.observation_id, *tok.encode("higher"), tok.end_id, tok.action_id], trained=False)
    return episodes


@pytest.fixture(scope="module")
def rollout(cfg):
    """A learner, and episodes its current weights sampled."""
    learner = Learner(cfg)
    return learner, play(cfg, learner.weights()[1])


def test_with_the_same_weights_the_learner_routes_every_generated_token_as_the_engine_did(cfg, rollout):
    learner, episodes = rollout
    generated = sum(sum(e.action_mask) for e in episodes)
    assert all(e.routes.shape == (sum(e.action_mask), 3, 2) for e in episodes)
    metrics = learner.train_step(episodes)
    assert metrics["routing_recorded_tokens"] == generated
    assert metrics["routing_mismatch"] == 0.0 and metrics["routing_mismatch_any"] == 0.0
    assert {f"routing_mismatch/layer{n}" for n in (1, 2, 3)} <= metrics.keys()
    assert metrics["rollout_logprob_gap"] < 1e-5


def test_perturbed_routers_mismatch_and_replay_takes_the_recorded_experts(cfg, rollout):
    learner, episodes = rollout
    weights = learner.weights()[1]
    episodes = play(cfg, weights)  # sampled by the learner's current weights
    generator = torch.Generator().manual_seed(1)
    for name in [k for k in weights if k.endswith("block_sparse_moe.gate.weight")]:
        weights[name] = weights[name] + 0.05 * torch.randn(weights[name].shape, generator=generator)
    batch = collate(episodes, learner.pad_id)
    results = {}
    for replay in (False, True):
        other = Learner(replace(cfg, algo=replace(cfg.algo, routing_replay=replay)))
        other.load_weights(weights)
        with torch.no_grad():
            stats = other._forward(batch)[3]
        own = routing_mismatch(stats, batch.attention_mask, batch.routes)
        as_used = [replace(s, own_ids=s.ids) for s in stats]  # the experts the forward used, as "own"
        used = routing_mismatch(as_used, batch.attention_mask, batch.routes)
        results[replay] = own, used
    (own_plain, used_plain), (own_replay, used_replay) = results[False], results[True]
    assert own_plain["routing_mismatch"] > 0 and used_plain == own_plain  # no replay: it routes by itself
    assert used_replay["routing_mismatch_any"] == 0.0  # replay: the forward used the recorded experts
    assert own_replay["routing_mismatch"] > 0  # ... while its own routing is still measured
    assert own_replay["routing_mismatch/layer1"] == own_plain["routing_mismatch/layer1"]  # same first input


def test_routes_survive_pickling_and_an_older_pickle_reads_back_without_them(rollout):
    episode = rollout[1][0]
    copied = pickle.loads(pickle.dumps(episode))
    assert torch.equal(copied.routes, episode.routes) and copied.tokens == episode.tokens
    old = Episode("agentenv/GuessNumber-v0", seed=0, group=0, tokens=[1, 2], action_mask=[0, 1])
    del old.__dict__["routes"]  # as pickled before the field existed
    assert pickle.loads(pickle.dumps(old)).routes is None


def test_collate_lays_routes_on_the_positions_that_sampled_each_token():
    e = Episode("agentenv/GuessNumber-v0", seed=0, group=0)
    e.append([257, 259, 48], trained=False)
    e.append([49], trained=True, logprobs=[-1.0])  # no record
    e.append([50, 51], trained=True, logprobs=[-1.0, -1.0], routes=torch.tensor([[[1, 2]], [[3, 4]]]))
    e.append([261], trained=False)
    plain = Episode("agentenv/GuessNumber-v0", seed=1, group=0)
    plain.append([257, 48, 49], trained=False)
    assert e.routes.tolist() == [[[-1, -1]], [[1, 2]], [[3, 4]]]
    batch = collate([e, plain], pad_id=256)
    assert batch.routes.shape == (2, 6, 1, 2)  # [B, T-1, layers, top_k], on the predicted tokens
    assert batch.routes[0, :, 0].tolist() == [[-1, -1]] * 3 + [[1, 2], [3, 4], [-1, -1]]
    assert (batch.routes[1] == -1).all()
    with pytest.raises(ValueError, match="routes has 1 rows for 2 action tokens"):
        e.append([1, 2], trained=True, routes=torch.zeros(1, 1, 2))
