"""Per-request sampling of the torch engine (`rl.rollout.torch_engine.Sampling`): what the gateway asks of
it."""

import math

import torch
from gateway_testutil import TOK
from rl_testutil import compose

from rl.policy import build_policy
from rl.rollout.torch_engine import Sampling, TorchEngine, nucleus


def test_nucleus_keeps_the_smallest_set_reaching_top_p_and_renormalises():
    logp = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05]]).log()
    kept = nucleus(logp, torch.tensor([0.7, 1.0])).exp()
    assert torch.allclose(kept[0], torch.tensor([0.625, 0.375, 0.0, 0.0]), atol=1e-6)
    assert torch.allclose(kept[1], logp[1].exp(), atol=1e-6)


def test_each_row_keeps_its_own_token_limit_and_nucleus():
    engine = TorchEngine(build_policy(compose().model, seed=0), TOK)
    context = [TOK.bos_id, TOK.observation_id, *TOK.encode("hello"), TOK.end_id, TOK.action_id]
    rows = [Sampling(1.0, 1.0, 2), Sampling(1.0, 1e-4, 5), Sampling(1.0, 1e-4, 5)]
    generations = engine.generate([context] * 3, 5, torch.Generator().manual_seed(0), rows)
    assert len(generations[0].token_ids) <= 2
    greedy = generations[1:]  # a nucleus of one token: the arg-max, sampled with probability 1
    assert greedy[0].token_ids == greedy[1].token_ids
    assert all(math.isclose(lp, 0.0, abs_tol=1e-6) for g in greedy for lp in g.logprobs)
    assert all(len(g.routes) == len(g.token_ids) for g in generations)
