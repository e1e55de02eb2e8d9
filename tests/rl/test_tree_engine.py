"""Branching with the torch engine: an episode's state (KDA recurrent and conv states, MLA latent KV) is
kept at a turn boundary and copied into the children, which continue without reading the prefix again."""

from __future__ import annotations

import torch
from rl_testutil import TINY, compose

from rl.learner.routing import own_routing
from rl.policy import build_policy
from rl.rollout.torch_engine import TorchEngine
from rl.tokenizer import ByteTokenizer

TOK = ByteTokenizer()


def _full_routes(model, context: list[int], tokens: list[int]) -> torch.Tensor:
    """The experts of the positions that sampled ``tokens`` after ``context`` ([n, n_moe_layers, top_k]),
    reading the whole sequence at once: what routing replay gives the learner."""
    ids = torch.tensor([context + tokens])
    with torch.inference_mode():
        out = model(ids, attention_mask=torch.ones_like(ids))
    own = own_routing(out.router_stats, torch.ones_like(ids))[0, :-1]
    return own[len(context) - 1 :].sort(-1).values


def _full_logprobs(model, context: list[int], tokens: list[int]) -> torch.Tensor:
    """Log-probs of ``tokens`` after ``context``, reading the whole sequence at once (no cache)."""
    ids = torch.tensor([context + tokens])
    with torch.inference_mode():
        logp = torch.log_softmax(model(ids).logits[0, :-1].float(), dim=-1)
    return logp[len(context) - 1 :].gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)


def test_children_continue_from_the_carried_state_as_if_they_reread_the_prefix():
    model = build_policy(compose(*TINY).model, seed=0).float()
    engine = TorchEngine(model, TOK)
    prefix = TOK.encode("obs: pick a number between 1 and 9\n")
    root = engine.read(prefix)
    first = engine.continue_from(root, 6, torch.Generator().manual_seed(0))
    observation = TOK.encode("\nobs: too low\n")
    engine.read(observation, root)  # the turn boundary: the branch node's state
    shared = prefix + first.token_ids + observation

    children = root.branch(2)
    generators = [torch.Generator().manual_seed(10 + i) for i in range(2)]
    turns = [engine.continue_from(c, 12, g) for c, g in zip(children, generators, strict=True)]
    assert turns[0].token_ids != turns[1].token_ids  # siblings sample on their own
    for turn in turns:
        want = _full_logprobs(model, shared, turn.token_ids)
        torch.testing.assert_close(torch.tensor(turn.logprobs), want, atol=1e-5, rtol=0)
        # each sampled token's experts are recorded as a reread forward routes it (routing replay)
        assert turn.routes is not None and turn.routes.shape[0] == len(turn.token_ids)
        assert torch.equal(turn.routes.long().sort(-1).values, _full_routes(model, shared, turn.token_ids))

    # a child's later turns go on from its own state; its sibling's tokens never entered it
    again = TOK.encode("\nobs: too high\n")
    engine.read(again, children[1])
    later = engine.continue_from(children[1], 8, torch.Generator().manual_seed(3))
    want = _full_logprobs(model, shared + turns[1].token_ids + again, later.token_ids)
    torch.testing.assert_close(torch.tensor(later.logprobs), want, atol=1e-5, rtol=0)
    # the branch node itself is untouched by its children
    assert root.cache.seen_tokens == len(shared) and children[0].cache.seen_tokens > len(shared)
