"""KDA (Kimi Delta Attention) kernels: chunked (training/prefill), fused recurrent (decode), naive.

Every function has the signature ``(q, k, v, g, beta, scale=None, initial_state=None,
output_final_state=False, cu_seqlens=None) -> (o, final_state | None)``; see ``kernels.kda.reference``
for the recurrence and shapes. ``chunk_kda`` and ``fused_recurrent_kda`` dispatch through
``kernels.dispatch.use_triton``; ``naive_recurrent_kda`` is always the PyTorch recurrence.
"""

from __future__ import annotations

import torch

from kernels.dispatch import use_triton
from kernels.kda.reference import (
    CPU_CHUNK_SIZE,
    chunk_kda_reference,
    fused_recurrent_kda_reference,
    naive_recurrent_kda,
)

__all__ = ["chunk_kda", "fused_recurrent_kda", "naive_recurrent_kda", "chunk_kda_reference"]


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunkwise-parallel KDA: Triton on CUDA, the chunked PyTorch reference elsewhere.

    Elsewhere means CPU, where the reference runs with 32-token chunks (its fastest setting there).
    """
    if use_triton(q):
        from kernels.kda.chunk import chunk_kda_triton

        return chunk_kda_triton(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)
    return chunk_kda_reference(
        q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, chunk_size=CPU_CHUNK_SIZE
    )


def fused_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-by-token KDA for decoding (T usually 1): fused Triton step on CUDA, the recurrence elsewhere."""
    if use_triton(q):
        from kernels.kda.fused_recurrent import fused_recurrent_kda_triton

        return fused_recurrent_kda_triton(
            q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens
        )
    return fused_recurrent_kda_reference(
        q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens
    )
