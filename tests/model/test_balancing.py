"""Quantile Balancing vs the sign update on skewed router scores (K3 §2.3.3; arXiv:2408.15664)."""

from __future__ import annotations

import pytest
import torch

from model.balancing import (
    _column_quantile,
    expert_loads,
    max_violation,
    maxvio_floor,
    prefix_multiplicities,
    quantile_balance,
    route_top_k,
    sign_update,
)


def zipf_popularity(n: int, seed: int) -> torch.Tensor:
    """Zipf-biased expert affinities: the expert of popularity rank r gets a logit shift of -0.5 log r."""
    shift = -0.5 * torch.log(torch.arange(1, n + 1, dtype=torch.float32))
    return shift[torch.randperm(n, generator=torch.Generator().manual_seed(seed))]


def skewed_scores(m: int, popularity: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Sigmoid router scores of m tokens: Gaussian token-expert affinities plus the expert popularity."""
    return torch.sigmoid(torch.randn(m, popularity.numel(), generator=generator) + popularity)


@pytest.mark.parametrize(("n", "k", "q"), [(64, 4, 1000), pytest.param(896, 16, 250, marks=pytest.mark.slow)])
def test_quantile_balancing_reaches_the_floor_where_sign_update_cannot(n, k, q):
    gen = torch.Generator().manual_seed(n)
    m = q * n // k  # target load: q tokens per expert (K3's 896 experts: a batch of 14k tokens)
    popularity = zipf_popularity(n, seed=n)
    scores = skewed_scores(m, popularity, gen)
    start = max_violation(expert_loads(route_top_k(scores, torch.zeros(n), k), n))
    assert start > 5.0  # the affinities really are skewed

    bias = torch.zeros(n)
    for _ in range(3):
        bias = quantile_balance(scores, k, bias)
    qb_vio = max_violation(expert_loads(route_top_k(scores, bias, k), n))
    assert qb_vio <= 0.05, qb_vio
    assert abs(float(bias.mean())) < 1e-5  # mean-centred

    sign_bias = torch.zeros(n)
    for _ in range(10):
        sign_bias = sign_update(expert_loads(route_top_k(scores, sign_bias, k), n), sign_bias, u=1e-3)
    sign_vio = max_violation(expert_loads(route_top_k(scores, sign_bias, k), n))
    assert sign_vio > 0.5, sign_vio

    # The bias generalises: on fresh batches from the same distribution MaxVio stays near sampling noise.
    floor = maxvio_floor(torch.ones(m), n, k, gen, draws=10)
    fresh = skewed_scores(m, popularity, gen)
    fresh_vio = max_violation(expert_loads(route_top_k(fresh, bias, k), n))
    assert fresh_vio <= 2 * floor, (fresh_vio, floor)


def test_quantile_balance_matches_torch_quantile_on_small_input():
    gen = torch.Generator().manual_seed(1)
    scores = torch.rand(101, 8, generator=gen)
    bias = torch.randn(8, generator=gen) * 0.1
    cutoff = torch.topk(scores + bias, 3, dim=-1).values[:, -1:]
    want = -torch.quantile(scores - cutoff, 1 - 2 / 8, dim=0)
    assert torch.allclose(quantile_balance(scores, 2, bias), want - want.mean(), atol=1e-6)
    for level in (0.0, 0.3, 0.5, 0.77, 1.0):
        assert torch.allclose(
            _column_quantile(scores, level), torch.quantile(scores, level, dim=0), atol=1e-6
        )


def test_sign_update_and_max_violation_values():
    loads = torch.tensor([10.0, 30.0, 20.0, 20.0])
    assert max_violation(loads) == pytest.approx(0.5)
    assert max_violation(torch.zeros(4)) == 0.0
    new = sign_update(loads, torch.zeros(4), u=0.1)
    assert torch.allclose(new, torch.tensor([0.1, -0.1, 0.0, 0.0]))


def test_bad_shapes_are_rejected():
    with pytest.raises(ValueError, match="k < n"):
        quantile_balance(torch.rand(10, 4), 4, torch.zeros(4))
    with pytest.raises(ValueError, match="bias"):
        quantile_balance(torch.rand(10, 4), 2, torch.zeros(5))
    with pytest.raises(ValueError, match="differ"):
        sign_update(torch.zeros(3), torch.zeros(4))


def test_prefix_multiplicities_count_shared_prefixes_and_skip_padding():
    ids = torch.tensor([[5, 6, 7, 0], [5, 6, 8, 0], [5, 9, 7, 7]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 0], [1, 1, 1, 1]])
    # contexts: (5) x3, (5,6) x2, (5,6,7), (5,6,8), (5,9), (5,9,7), (5,9,7,7)
    assert sorted(prefix_multiplicities(ids, mask).tolist()) == [1, 1, 1, 1, 1, 2, 3]
    assert prefix_multiplicities(ids, mask).sum() == mask.sum()


def test_maxvio_floor_grows_when_tokens_come_in_lumps():
    gen = torch.Generator().manual_seed(0)
    independent = maxvio_floor(torch.ones(2400), 16, 2, gen)
    lumpy = maxvio_floor(torch.full((100,), 24.0), 16, 2, gen)  # the same 2400 tokens, 24 per context
    # i.i.d. tokens: load ~ Binomial(2400, 1/8), mean 300, sd ~16; the max of 16 lies ~1.8 sd above
    assert 0.05 < independent < 0.2 and lumpy > 3 * independent
    assert maxvio_floor(torch.ones(0), 16, 2, gen) == 0.0
