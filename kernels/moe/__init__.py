"""LatentMoE expert block: ``moe_experts`` picks PyTorch's grouped GEMM, the grouped-GEMM Triton kernel or
the per-expert loop.

The choice, measured (docs/kernels.md): ``torch.nn.functional.grouped_mm`` wherever it takes the tensors
(`kernels.moe.torch_grouped.grouped_mm_supported`: CUDA bf16 on SM >= 80; the CPU, where it is 1.7-2.1x
faster than the loop over experts at k3_tiny / k3_small shapes, forward + backward, and exact against
it); otherwise the Triton kernel on CUDA and the loop elsewhere. ``K3_KERNELS=reference|triton`` forces
the loop or Triton (``kernels.dispatch``), and the GPU check times all three at K3's expert shapes.
"""

from __future__ import annotations

import os

import torch

from kernels.dispatch import BACKEND_ENV, use_triton
from kernels.moe.reference import moe_experts_reference
from kernels.moe.torch_grouped import grouped_mm_supported, moe_experts_grouped_mm

__all__ = ["moe_experts", "moe_experts_reference", "moe_experts_grouped_mm", "moe_implementation"]


def moe_implementation(x: torch.Tensor, w_gate: torch.Tensor) -> str:
    """``grouped_mm``, ``triton`` or ``reference``: what `moe_experts` runs for these tensors."""
    forced = os.environ.get(BACKEND_ENV, "").strip().lower() not in ("", "auto")
    if not forced and x.dtype == w_gate.dtype and grouped_mm_supported(x.device.type, x.dtype):
        return "grouped_mm"
    return "triton" if use_triton(x) else "reference"


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
    kind = moe_implementation(x, w_gate)
    if kind == "grouped_mm":
        return moe_experts_grouped_mm(x, expert_ids, expert_weights, w_gate, w_up, w_down, beta1, beta2)
    if kind == "triton":
        from kernels.moe.grouped import moe_experts_triton

        return moe_experts_triton(x, expert_ids, expert_weights, w_gate, w_up, w_down, beta1, beta2)
    return moe_experts_reference(x, expert_ids, expert_weights, w_gate, w_up, w_down, beta1, beta2)
