"""PyTorch reference for the LatentMoE expert block: a loop over experts.

``y[m] = Σ_j w[m, j] · W_down[e] @ situ_glu(W_gate[e] @ x[m], W_up[e] @ x[m])`` with ``e = ids[m, j]``.
"""

from __future__ import annotations

import torch

from kernels.situ_glu import situ_glu_reference


def check_moe_inputs(x, expert_ids, expert_weights, w_gate, w_up, w_down) -> None:
    """Raise ``ValueError`` naming the first argument whose shape disagrees with the others."""
    if x.dim() != 2:
        raise ValueError(f"moe_experts: x must be [M, L]; got {tuple(x.shape)}")
    M, L = x.shape
    if w_gate.dim() != 3 or w_gate.shape[2] != L:
        raise ValueError(f"moe_experts: w_gate must be [E, I, L={L}]; got {tuple(w_gate.shape)}")
    E, I, _ = w_gate.shape
    if w_up.shape != w_gate.shape:
        raise ValueError(
            f"moe_experts: w_up must match w_gate {tuple(w_gate.shape)}; got {tuple(w_up.shape)}"
        )
    if w_down.shape != (E, L, I):
        raise ValueError(f"moe_experts: w_down must be [E, L, I] = {(E, L, I)}; got {tuple(w_down.shape)}")
    if expert_ids.dim() != 2 or expert_ids.shape[0] != M:
        raise ValueError(f"moe_experts: expert_ids must be [M={M}, k]; got {tuple(expert_ids.shape)}")
    if expert_weights.shape != expert_ids.shape:
        raise ValueError(
            f"moe_experts: expert_weights must match expert_ids {tuple(expert_ids.shape)}; "
            f"got {tuple(expert_weights.shape)}"
        )
    if expert_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"moe_experts: expert_ids must be int64 or int32; got {expert_ids.dtype}")
    if expert_ids.numel() and (int(expert_ids.min()) < 0 or int(expert_ids.max()) >= E):
        raise ValueError(
            f"moe_experts: expert_ids must lie in [0, {E}); got range "
            f"[{int(expert_ids.min())}, {int(expert_ids.max())}]"
        )


def moe_experts_reference(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    expert_weights: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    beta1: float = 4.0,
    beta2: float = 25.0,
) -> torch.Tensor:
    """Per-expert loop: gather the tokens routed to each expert, run its SiTU-GLU FFN, scatter-add back."""
    check_moe_inputs(x, expert_ids, expert_weights, w_gate, w_up, w_down)
    y = torch.zeros_like(x)
    for e in range(w_gate.shape[0]):
        token_idx, slot_idx = (expert_ids == e).nonzero(as_tuple=True)
        if token_idx.numel() == 0:
            continue
        xe = x[token_idx]
        h = situ_glu_reference(xe @ w_gate[e].T, xe @ w_up[e].T, beta1, beta2)
        ye = (h @ w_down[e].T) * expert_weights[token_idx, slot_idx].unsqueeze(-1).to(x.dtype)
        y = y.index_add(0, token_idx, ye)
    return y
