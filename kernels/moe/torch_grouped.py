"""LatentMoE routed experts on PyTorch's own grouped GEMM (``torch.nn.functional.grouped_mm``).

One ``grouped_mm`` per projection over the expert-sorted pairs, differentiated by autograd; same contract
as ``kernels.moe_experts``. `grouped_mm_supported` says where it runs.

Design: docs/design/model.md#kernels-moe-torch-grouped.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from kernels.moe.reference import check_moe_inputs
from kernels.situ_glu import situ_glu


@functools.cache
def grouped_mm_supported(device_type: str, dtype: torch.dtype) -> bool:
    """Whether ``grouped_mm`` exists in this torch and takes ``dtype`` tensors on ``device_type``."""
    if not hasattr(F, "grouped_mm"):
        return False
    if device_type == "cuda":
        return dtype == torch.bfloat16 and torch.cuda.get_device_capability() >= (8, 0)
    return device_type == "cpu" and dtype in (torch.float32, torch.bfloat16)


def moe_experts_grouped_mm(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    expert_weights: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    beta1: float = 4.0,
    beta2: float = 25.0,
) -> torch.Tensor:
    """y[m] = sum_j w[m, j] W_down[e] situ_glu(W_gate[e] x[m], W_up[e] x[m]), e = ids[m, j]: grouped GEMMs."""
    check_moe_inputs(x, expert_ids, expert_weights, w_gate, w_up, w_down)
    k = expert_ids.shape[1]
    flat = expert_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # pairs grouped by expert
    token = order // k
    ends = torch.bincount(flat, minlength=w_gate.shape[0]).cumsum(0).to(torch.int32)
    xs = x[token]
    gate = F.grouped_mm(xs, w_gate.transpose(-2, -1), offs=ends)
    up = F.grouped_mm(xs, w_up.transpose(-2, -1), offs=ends)
    ys = F.grouped_mm(situ_glu(gate, up, beta1, beta2), w_down.transpose(-2, -1), offs=ends)
    weights = expert_weights.reshape(-1)[order].to(ys.dtype)
    return torch.zeros_like(x).index_add(0, token, ys * weights[:, None])
