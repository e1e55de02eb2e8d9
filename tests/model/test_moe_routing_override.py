"""Routing replay (R3) in the model: a `RoutingOverride` / `RecordedRoutes` makes the given tokens use the
given experts, weighted by the router's own scores there (so the router still learns), and leaves every
other token and the default path exactly as they were."""

import pytest
import torch
from model_testutil import tiny_config_dict, variant

from model import K3ForCausalLM
from model.k3 import RecordedRoutes
from model.moe import RoutingOverride


@pytest.fixture(scope="module")
def cfg():
    return variant(tiny_config_dict())


def moe_layers(cfg) -> int:
    return sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))


def test_an_override_uses_exactly_the_given_experts_and_the_router_still_gets_gradients(cfg):
    torch.manual_seed(0)
    model = K3ForCausalLM(cfg)
    moe = next(layer.block_sparse_moe for layer in model.model.layers if layer.is_moe)
    x = torch.randn(2, 6, cfg.hidden_size)
    with torch.no_grad():
        _, own = moe(x)
    # replay the k experts the router likes least on the first 8 tokens; the other 4 route by themselves
    scores = own.scores + moe.gate.e_score_correction_bias
    least = scores.topk(cfg.num_experts_per_token, dim=-1, largest=False).indices
    mask = torch.arange(12) < 8
    y, stats = moe(x, override=RoutingOverride(least.to(torch.int16), mask))
    assert torch.equal(stats.ids[mask], least[mask])  # exactly the recorded experts
    assert torch.equal(stats.ids[~mask], own.ids[~mask]) and torch.equal(stats.own_ids, own.ids)
    assert torch.equal(stats.loads, torch.bincount(stats.ids.reshape(-1), minlength=cfg.num_experts).float())
    y.square().sum().backward()
    grad = moe.gate.weight.grad.abs().sum(-1)  # per expert row of the router
    replayed_only = set(least[mask].flatten().tolist()) - set(stats.ids[~mask].flatten().tolist())
    unused = set(range(cfg.num_experts)) - set(stats.ids.flatten().tolist())
    assert replayed_only and all(grad[e] > 0 for e in replayed_only)  # gates from the router's own scores
    assert unused and all(grad[e] == 0 for e in unused)  # the router's own (not used) choice gets nothing


def test_recorded_routes_replay_through_the_whole_model_and_a_masked_out_record_changes_nothing(cfg):
    torch.manual_seed(1)
    model = K3ForCausalLM(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 7))
    with torch.no_grad():
        plain = model(ids)
        n, k = moe_layers(cfg), cfg.num_experts_per_token
        picks = [torch.randperm(cfg.num_experts)[:k] for _ in range(2 * 7 * n)]
        recorded = torch.stack(picks).view(2, 7, n, k)
        mask = torch.zeros(2, 7, dtype=torch.bool)
        mask[1, 2:] = True
        replayed = model(ids, routes=RecordedRoutes(recorded, mask))
        nothing = model(ids, routes=RecordedRoutes(recorded, torch.zeros_like(mask)))
    assert torch.equal(nothing.logits, plain.logits)  # no record: the default routing, bit for bit
    for layer, stats in enumerate(replayed.router_stats):
        used = stats.ids.view(2, 7, k)
        assert torch.equal(used[mask], recorded[:, :, layer][mask])
        assert torch.equal(used[0, :2], plain.router_stats[layer].ids.view(2, 7, k)[0, :2])  # before: as is
    # row 0 has no record (equal up to the batched kernels' summation order); row 1's replay changes it
    assert torch.allclose(replayed.logits[0], plain.logits[0], atol=1e-5)
    assert not torch.allclose(replayed.logits[1], plain.logits[1], atol=1e-3)


def test_bad_recorded_routes_are_one_line_errors(cfg):
    model = K3ForCausalLM(cfg)
    ids = torch.zeros(1, 3, dtype=torch.long)
    n, k = moe_layers(cfg), cfg.num_experts_per_token
    with pytest.raises(ValueError, match=r"routes: ids must be \[1, 3, 3, 2\]"):
        wide = torch.zeros(1, 3, n, k + 1, dtype=torch.long)
        model(ids, routes=RecordedRoutes(wide, torch.ones(1, 3, dtype=torch.bool)))
    bad = torch.full((1, 3, n, k), cfg.num_experts)
    with pytest.raises(ValueError, match=rf"expert ids must be in \[0, {cfg.num_experts}\), got 16..16"):
        model(ids, routes=RecordedRoutes(bad, torch.ones(1, 3, dtype=torch.bool)))
