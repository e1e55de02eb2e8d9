"""LatentMoE expert block: ``moe_experts`` dispatches to the grouped-GEMM Triton path or the expert loop."""

from __future__ import annotations

import torch

from kernels.dispatch import use_triton
from kernels.moe.reference import moe_experts_reference

__all__ = ["moe_experts", "moe_experts_reference"]


def moe_experts(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    expert_weights: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    beta1: float = 4.0,
    beta2: float = 25.0,
) -> torch.Tensor:
    """Routed experts in the latent width; shapes in ``kernels.moe.reference``. Output in x's dtype."""
    if use_triton(x):
        from kernels.moe.grouped import moe_experts_triton

        return moe_experts_triton(x, expert_ids, expert_weights, w_gate, w_up, w_down, beta1, beta2)
    return moe_experts_reference(x, expert_ids, expert_weights, w_gate, w_up, w_down, beta1, beta2)
