"""Routed experts stored stacked (`model.moe.RoutedExperts`): one [E, out, in] parameter per weight,
per-expert checkpoint names outside (state_dict, load_state_dict, `parameter_names`), and the grouped GEMM
on PyTorch's ``grouped_mm`` where it runs (the CPU here), equal to the loop over experts."""

from __future__ import annotations

import pytest
import torch
from model_testutil import variant

from kernels.moe import moe_experts, moe_experts_reference, moe_implementation
from model import K3ForCausalLM
from model.moe import RoutedExperts, parameter_names, stacked_slot


def test_experts_are_stacked_parameters_with_per_expert_names_outside(tiny_dict):
    model = K3ForCausalLM(variant(tiny_dict))
    experts = model.model.layers[1].block_sparse_moe.experts
    cfg = model.config
    assert isinstance(experts, RoutedExperts)
    stacked = (cfg.num_experts, cfg.moe_intermediate_size, cfg.expert_width)
    assert experts.w1.shape == experts.w3.shape == stacked
    assert experts.w2.shape == (cfg.num_experts, cfg.expert_width, cfg.moe_intermediate_size)
    state = model.state_dict()
    prefix = "model.layers.1.block_sparse_moe.experts."
    assert f"{prefix}w1" not in state and f"{prefix}{cfg.num_experts - 1}.w2.weight" in state
    assert torch.equal(state[f"{prefix}3.w3.weight"], experts.w3[3])
    assert list(state) == [n for n in state if n in set(parameter_names(model))]  # the parameters, in order
    assert set(parameter_names(model)) == set(state)
    assert stacked_slot(f"{prefix}3.w3.weight") == (f"{prefix}w3", 3)
    # a state dict of per-expert tensors (a save_pretrained folder, old or new) loads into the stacks
    other = K3ForCausalLM(variant(tiny_dict))
    other.load_state_dict(state)
    assert torch.equal(other.model.layers[1].block_sparse_moe.experts.w2, experts.w2)
    del state[f"{prefix}5.w1.weight"]
    with pytest.raises(RuntimeError, match=r"experts\.5\.w1\.weight is missing \(15 of 16 experts' w1"):
        other.load_state_dict(state)


def test_the_grouped_gemm_runs_on_grouped_mm_on_the_cpu_and_equals_the_loop(monkeypatch):
    torch.manual_seed(0)
    E, I, L, M, k = 8, 32, 16, 64, 2
    x = torch.randn(M, L, requires_grad=True)
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(M)])
    weights = torch.rand(M, k)
    stacks = [(torch.randn(E, I, L) * 0.2).requires_grad_(), (torch.randn(E, I, L) * 0.2).requires_grad_(),
              (torch.randn(E, L, I) * 0.2).requires_grad_()]  # fmt: skip
    assert moe_implementation(x, stacks[0]) == "grouped_mm"
    monkeypatch.setenv("K3_KERNELS", "reference")
    assert moe_implementation(x, stacks[0]) == "reference"
    monkeypatch.delenv("K3_KERNELS")
    grad = torch.randn(M, L)
    results = []
    for fn in (moe_experts, moe_experts_reference):
        for t in (x, *stacks):
            t.grad = None
        y = fn(x, ids, weights, *stacks)
        (y * grad).sum().backward()
        results.append([y.detach(), x.grad.clone(), *(s.grad.clone() for s in stacks)])
    for ours, loop in zip(*results, strict=True):
        torch.testing.assert_close(ours, loop, atol=1e-5, rtol=1e-5)
