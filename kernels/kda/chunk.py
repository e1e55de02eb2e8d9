"""Chunkwise-parallel KDA in Triton: the autograd Function and the public entry ``chunk_kda_triton``.

The maths is ``kernels.kda.reference.chunk_kda_reference``; these files run every piece of per-chunk work in
Triton on a packed token axis cut into 64-token chunks, as flash-linear-attention's ``fla/ops/kda/`` does.
Head dims ``K``, ``V``: powers of two in [16, 128]. Verified under ``TRITON_INTERPRET=1``, not tuned on a GPU.

Design: docs/design/model.md#kernels-kda-chunk.
"""

from __future__ import annotations

import torch

from kernels.kda.chunk_bwd import chunk_kda_bwd
from kernels.kda.chunk_fwd import chunk_kda_fwd
from kernels.kda.chunk_utils import ChunkArgs, ChunkTable, check_head_dims
from kernels.kda.inputs import check_kda_inputs, sequence_bounds

__all__ = ["ChunkKDAFunction", "chunk_kda_triton"]


class ChunkKDAFunction(torch.autograd.Function):
    """``torch.autograd.Function`` over the packed Triton forward and backward (``chunk_fwd``, ``chunk_bwd``).

    Inputs are packed ``[T, H, D]`` (``beta``: ``[T, H]``); ``bounds`` are the sequences' token ranges.
    """

    @staticmethod
    def forward(ctx, q, k, v, g, beta, scale, initial_state, output_final_state, bounds):
        _, H, K = q.shape
        args = ChunkArgs(ChunkTable(bounds, q.device), H=H, K=K, V=v.shape[-1], scale=scale)
        q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
        h0 = initial_state.float().contiguous() if initial_state is not None else None
        o, final, saved = chunk_kda_fwd(q, k, v, g, beta, h0, output_final_state, args)
        ctx.save_for_backward(q, k, v, beta, *saved.values())
        ctx.saved_names = list(saved)
        ctx.args = args
        ctx.has_h0 = initial_state is not None
        ctx.h0_dtype = initial_state.dtype if initial_state is not None else None
        ctx.g_dtype = g.dtype
        if final is not None:
            return o, final
        return o, None

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, beta, *rest = ctx.saved_tensors
        saved = dict(zip(ctx.saved_names, rest, strict=True))
        dht = dht.float().contiguous() if dht is not None else None
        dq, dk, dv, dg, dbeta, dh0 = chunk_kda_bwd(
            q, k, v, beta, saved, do.contiguous(), dht, ctx.has_h0, ctx.args
        )
        dh0 = dh0.to(ctx.h0_dtype) if dh0 is not None else None
        return (
            dq.to(q.dtype),
            dk.to(k.dtype),
            dv.to(v.dtype),
            dg.to(ctx.g_dtype),
            dbeta.to(beta.dtype),
            None,
            dh0,
            None,
            None,
        )


def chunk_kda_triton(
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
    """Chunkwise KDA on the Triton kernels; same contract as ``kernels.chunk_kda``."""
    check_kda_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    B, T, H, K = q.shape
    V = v.shape[-1]
    check_head_dims(K, V)
    scale = K**-0.5 if scale is None else float(scale)
    if cu_seqlens is None:
        bounds = [(b * T, (b + 1) * T) for b in range(B)]
    else:
        bounds = sequence_bounds(T, cu_seqlens)
    flat = [x.reshape(B * T, H, x.shape[-1]) for x in (q, k, v, g)]
    o, final = ChunkKDAFunction.apply(
        *flat, beta.reshape(B * T, H), scale, initial_state, output_final_state, bounds
    )
    return o.reshape(B, T, H, V), final
