"""Input checking shared by every KDA implementation (reference and Triton).

The checks run before any kernel so that a wrong shape yields one clear message naming the argument,
rather than a broadcasting error deep inside an einsum or a Triton launch.
"""

from __future__ import annotations

import torch


def check_kda_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
) -> None:
    """Validate the shapes of a KDA call (layout ``[B, T, H, D]``, as flash-linear-attention).

    Raises ``ValueError`` naming the first inconsistent argument.
    """
    if q.dim() != 4:
        raise ValueError(f"q must be [B, T, H, K]; got shape {tuple(q.shape)}")
    B, T, H, K = q.shape
    if k.shape != q.shape:
        raise ValueError(f"k must have q's shape {tuple(q.shape)}; got {tuple(k.shape)}")
    if g.shape != q.shape:
        raise ValueError(
            f"g (log decay per key channel) must have q's shape {tuple(q.shape)}; got {tuple(g.shape)}"
        )
    if v.dim() != 4 or v.shape[:3] != (B, T, H):
        raise ValueError(f"v must be [B, T, H, V] with B, T, H = {B}, {T}, {H}; got {tuple(v.shape)}")
    if beta.shape != (B, T, H):
        raise ValueError(f"beta must be [B, T, H] = {(B, T, H)}; got {tuple(beta.shape)}")
    V = v.shape[-1]
    n_states = B
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"with cu_seqlens the batch must be packed into B=1; got B={B}")
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            raise ValueError("cu_seqlens must be a 1-D tensor [N+1] of sequence offsets starting at 0")
        offsets = cu_seqlens.tolist()
        if (
            offsets[0] != 0
            or offsets[-1] != T
            or any(b < a for a, b in zip(offsets, offsets[1:], strict=False))
        ):
            raise ValueError(f"cu_seqlens must rise from 0 to T={T}; got {offsets}")
        n_states = len(offsets) - 1
    if initial_state is not None and initial_state.shape != (n_states, H, K, V):
        raise ValueError(
            f"initial_state must be [{'N' if cu_seqlens is not None else 'B'}, H, K, V] = "
            f"{(n_states, H, K, V)}; got {tuple(initial_state.shape)}"
        )


def sequence_bounds(T: int, cu_seqlens: torch.Tensor | None) -> list[tuple[int, int]]:
    """The ``(start, end)`` token range of each packed sequence (one range ``(0, T)`` without varlen)."""
    if cu_seqlens is None:
        return [(0, T)]
    offsets = [int(x) for x in cu_seqlens.tolist()]
    return list(zip(offsets[:-1], offsets[1:], strict=True))
