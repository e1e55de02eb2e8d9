"""Fused recurrent KDA in Triton: the decoding path (T usually 1), state kept in registers.

Forward-only (decoding needs no gradient): when autograd records and an input requires a gradient, the
call goes to ``chunk_kda_triton``. Verified under ``TRITON_INTERPRET=1``; not tuned on a GPU.

Design: docs/design/model.md#kernels-kda-fused-recurrent.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.kda.inputs import check_kda_inputs, sequence_bounds


@triton.jit
def _fused_recurrent_fwd_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    o_ptr,
    h0_ptr,
    ht_ptr,
    seq_start_ptr,
    seq_end_ptr,
    scale,
    H,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    HAS_H0: tl.constexpr,
    STORE_HT: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)  # 64-bit offsets: T·H·D can pass 2³¹
    h = tl.program_id(1)
    vb = tl.program_id(2)
    bos = tl.load(seq_start_ptr + n).to(tl.int64)
    eos = tl.load(seq_end_ptr + n).to(tl.int64)
    kk = tl.arange(0, BK)
    vv = vb * BV + tl.arange(0, BV)
    k_ok = kk < K
    v_ok = vv < V
    state_mask = k_ok[:, None] & v_ok[None, :]
    offs_state = (n * H + h) * K * V + kk[:, None] * V + vv[None, :]
    if HAS_H0:
        state = tl.load(h0_ptr + offs_state, mask=state_mask, other=0.0).to(tl.float32)
    else:
        state = tl.zeros([BK, BV], dtype=tl.float32)
    for t in range(bos, eos):
        q = tl.load(q_ptr + (t * H + h) * K + kk, mask=k_ok, other=0.0).to(tl.float32) * scale
        k = tl.load(k_ptr + (t * H + h) * K + kk, mask=k_ok, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + (t * H + h) * K + kk, mask=k_ok, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + (t * H + h) * V + vv, mask=v_ok, other=0.0).to(tl.float32)
        beta = tl.load(beta_ptr + t * H + h).to(tl.float32)
        state = state * tl.exp(g)[:, None]
        predicted = tl.sum(state * k[:, None], axis=0)
        state += k[:, None] * (beta * (v - predicted))[None, :]
        o = tl.sum(state * q[:, None], axis=0)
        tl.store(o_ptr + (t * H + h) * V + vv, o.to(o_ptr.dtype.element_ty), mask=v_ok)
    if STORE_HT:
        tl.store(ht_ptr + offs_state, state, mask=state_mask)


def fused_recurrent_kda_triton(
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
    """Token-by-token KDA in one Triton kernel; same contract as ``kernels.fused_recurrent_kda``."""
    needs_grad = torch.is_grad_enabled() and any(
        x is not None and x.requires_grad for x in (q, k, v, g, beta, initial_state)
    )
    if needs_grad:
        from kernels.kda.chunk import chunk_kda_triton

        return chunk_kda_triton(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)
    check_kda_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K**-0.5 if scale is None else float(scale)
    bounds = (
        [(b * T, (b + 1) * T) for b in range(B)] if cu_seqlens is None else sequence_bounds(T, cu_seqlens)
    )
    dev = q.device
    seq_start = torch.tensor([s for s, _ in bounds], dtype=torch.int32, device=dev)
    seq_end = torch.tensor([e for _, e in bounds], dtype=torch.int32, device=dev)
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    h0 = initial_state.float().contiguous() if initial_state is not None else None
    o = torch.empty(B, T, H, V, dtype=v.dtype, device=dev)
    final = torch.empty(len(bounds), H, K, V, dtype=torch.float32, device=dev) if output_final_state else None
    BK = triton.next_power_of_2(K)
    BV = min(triton.next_power_of_2(V), 64)
    _fused_recurrent_fwd_kernel[(len(bounds), H, triton.cdiv(V, BV))](
        q,
        k,
        v,
        g,
        beta,
        o,
        h0 if h0 is not None else o,
        final if final is not None else o,
        seq_start,
        seq_end,
        scale,
        H,
        K=K,
        V=V,
        BK=BK,
        BV=BV,
        HAS_H0=h0 is not None,
        STORE_HT=output_final_state,
    )
    return o, final
