"""Forward of chunkwise KDA in Triton: scores, WY/UT transform, state pass, outputs.

The maths is ``kernels.kda.reference.chunk_kda_reference``; ``kernels.kda.chunk`` documents the algorithm
and the packed layout. Only the state pass is sequential; the scores use a sub-tile reference point so that
no exponent is ever positive.

Design: docs/design/model.md#kernels-kda-chunk-fwd.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.kda.chunk_utils import CHUNK, STATE_LAUNCH, SUB, SUB_TILE_LAUNCH, TILE_LAUNCH, ChunkArgs
from kernels.kda.cumsum import chunk_local_cumsum


@triton.jit
def _intra_scores_fwd_kernel(
    q_ptr,
    k_ptr,
    G_ptr,
    Akk_ptr,
    Aqk_ptr,
    chunk_start_ptr,
    chunk_end_ptr,
    scale,
    H,
    K: tl.constexpr,
    C: tl.constexpr,
    S: tl.constexpr,
):
    """Rows of one 16-token sub-tile: Akk[t,i] = Σ k_t k_i e^{G_t-G_i} (i<t), Aqk likewise with q (i≤t)."""
    NS: tl.constexpr = C // S
    c = tl.program_id(0).to(tl.int64) // NS
    r = tl.program_id(0) % NS
    h = tl.program_id(1)
    start = tl.load(chunk_start_ptr + c).to(tl.int64)
    end = tl.load(chunk_end_ptr + c).to(tl.int64)
    r0 = start + r * S
    if r0 < end:
        kk = tl.arange(0, K)
        t_loc = tl.arange(0, S)
        rows = r0 + t_loc
        row_ok = rows < end
        all_loc = tl.arange(0, C)
        all_rows = start + all_loc
        offs_r = (rows[:, None] * H + h) * K + kk[None, :]
        q_r = tl.load(q_ptr + offs_r, mask=row_ok[:, None], other=0.0).to(tl.float32) * scale
        k_r = tl.load(k_ptr + offs_r, mask=row_ok[:, None], other=0.0).to(tl.float32)
        G_r = tl.load(G_ptr + offs_r, mask=row_ok[:, None], other=0.0)
        G_ref = tl.load(G_ptr + (r0 * H + h) * K + kk)
        # off-diagonal sub-tiles: every column token precedes r0, every row token follows it
        before = all_rows < r0
        offs_a = (all_rows[:, None] * H + h) * K + kk[None, :]
        k_a = tl.load(k_ptr + offs_a, mask=before[:, None], other=0.0).to(tl.float32)
        G_a = tl.load(G_ptr + offs_a, mask=before[:, None], other=0.0)
        k_a = k_a * tl.exp(tl.where(before[:, None], G_ref[None, :] - G_a, 0.0))
        row_decay = tl.exp(tl.where(row_ok[:, None], G_r - G_ref[None, :], 0.0))
        Aqk = tl.dot(q_r * row_decay, tl.trans(k_a))
        Akk = tl.dot(k_r * row_decay, tl.trans(k_a))
        # diagonal sub-tile: exact pairwise differences, one column at a time
        for j in tl.static_range(S):
            col_ok = (r0 + j + kk * 0) < end  # as a [K] mask (the interpreter wants tensors)
            k_j = tl.load(k_ptr + ((r0 + j) * H + h) * K + kk, mask=col_ok, other=0.0)
            k_j = k_j.to(tl.float32)
            G_j = tl.load(G_ptr + ((r0 + j) * H + h) * K + kk, mask=col_ok, other=0.0)
            on_or_below = (t_loc >= j) & row_ok
            decay = tl.exp(tl.where(on_or_below[:, None], G_r - G_j[None, :], 0.0)) * k_j[None, :]
            s_q = tl.sum(q_r * decay, axis=1)
            s_k = tl.sum(k_r * decay, axis=1)
            at_col = all_loc[None, :] == r * S + j
            Aqk += tl.where(at_col & on_or_below[:, None], s_q[:, None], 0.0)
            Akk += tl.where(at_col & (t_loc > j)[:, None], s_k[:, None], 0.0)
        offs_c = (rows[:, None] * H + h) * C + all_loc[None, :]
        tl.store(Akk_ptr + offs_c, Akk, mask=row_ok[:, None])
        tl.store(Aqk_ptr + offs_c, Aqk, mask=row_ok[:, None])


@triton.jit
def _solve_wy_kernel(
    Akk_ptr,
    beta_ptr,
    k_ptr,
    v_ptr,
    G_ptr,
    M_ptr,
    U_ptr,
    W_ptr,
    chunk_start_ptr,
    chunk_end_ptr,
    H,
    K: tl.constexpr,
    V: tl.constexpr,
    C: tl.constexpr,
):
    """M = (I + diag(β)·Akk)⁻¹ by forward substitution; U = M (β v); W = M (β k e^G)."""
    c = tl.program_id(0).to(tl.int64)  # 64-bit offsets: T·H·D can pass 2³¹
    h = tl.program_id(1)
    start = tl.load(chunk_start_ptr + c).to(tl.int64)
    end = tl.load(chunk_end_ptr + c).to(tl.int64)
    loc = tl.arange(0, C)
    rows = start + loc
    row_ok = rows < end
    kk = tl.arange(0, K)
    vv = tl.arange(0, V)
    beta = tl.load(beta_ptr + rows * H + h, mask=row_ok, other=0.0).to(tl.float32)
    offs_c = (rows[:, None] * H + h) * C + loc[None, :]
    A = tl.load(Akk_ptr + offs_c, mask=row_ok[:, None], other=0.0) * beta[:, None]
    M = tl.where(loc[:, None] == loc[None, :], 1.0, 0.0)
    for t in range(1, C):
        a_t = tl.sum(tl.where(loc[:, None] == t, A, 0.0), axis=0)  # row t of A, indexed by column
        m_t = tl.where(loc == t, 1.0, 0.0) - tl.sum(a_t[:, None] * M, axis=0)
        M = tl.where(loc[:, None] == t, m_t[None, :], M)
    offs_k = (rows[:, None] * H + h) * K + kk[None, :]
    offs_v = (rows[:, None] * H + h) * V + vv[None, :]
    k = tl.load(k_ptr + offs_k, mask=row_ok[:, None], other=0.0).to(tl.float32)
    v = tl.load(v_ptr + offs_v, mask=row_ok[:, None], other=0.0).to(tl.float32)
    G = tl.load(G_ptr + offs_k, mask=row_ok[:, None], other=0.0)
    U = tl.dot(M, v * beta[:, None])
    W = tl.dot(M, k * tl.exp(G) * beta[:, None])
    tl.store(M_ptr + offs_c, M, mask=row_ok[:, None])
    tl.store(U_ptr + offs_v, U, mask=row_ok[:, None])
    tl.store(W_ptr + offs_k, W, mask=row_ok[:, None])


@triton.jit
def _state_fwd_kernel(
    k_ptr,
    G_ptr,
    U_ptr,
    W_ptr,
    u_ptr,
    h_ptr,
    h0_ptr,
    ht_ptr,
    seq_start_ptr,
    seq_end_ptr,
    seq_first_chunk_ptr,
    H,
    K: tl.constexpr,
    V: tl.constexpr,
    BV: tl.constexpr,
    C: tl.constexpr,
    HAS_H0: tl.constexpr,
    STORE_HT: tl.constexpr,
):
    """Sequential over the chunks of one sequence: chunk-start states h, pseudo-values u, final state."""
    n = tl.program_id(0).to(tl.int64)  # 64-bit offsets: T·H·D can pass 2³¹
    h = tl.program_id(1)
    vb = tl.program_id(2)
    bos = tl.load(seq_start_ptr + n).to(tl.int64)
    eos = tl.load(seq_end_ptr + n).to(tl.int64)
    first = tl.load(seq_first_chunk_ptr + n).to(tl.int64)
    kk = tl.arange(0, K)
    vv = vb * BV + tl.arange(0, BV)
    loc = tl.arange(0, C)
    offs_state = kk[:, None] * V + vv[None, :]
    if HAS_H0:
        state = tl.load(h0_ptr + (n * H + h) * K * V + offs_state)
    else:
        state = tl.zeros([K, BV], dtype=tl.float32)
    n_chunks = tl.cdiv(eos - bos, C)
    for i in range(n_chunks):
        start = bos + i * C
        end = tl.minimum(start + C, eos)
        rows = start + loc
        row_ok = rows < end
        tl.store(h_ptr + ((first + i) * H + h) * K * V + offs_state, state)
        offs_k = (rows[:, None] * H + h) * K + kk[None, :]
        offs_v = (rows[:, None] * H + h) * V + vv[None, :]
        W = tl.load(W_ptr + offs_k, mask=row_ok[:, None], other=0.0)
        u = tl.load(U_ptr + offs_v, mask=row_ok[:, None], other=0.0) - tl.dot(W, state)
        tl.store(u_ptr + offs_v, u, mask=row_ok[:, None])
        G = tl.load(G_ptr + offs_k, mask=row_ok[:, None], other=0.0)
        G_last = tl.load(G_ptr + ((end - 1) * H + h) * K + kk)
        k = tl.load(k_ptr + offs_k, mask=row_ok[:, None], other=0.0).to(tl.float32)
        k_to_end = k * tl.exp(tl.where(row_ok[:, None], G_last[None, :] - G, 0.0))
        state = state * tl.exp(G_last)[:, None] + tl.dot(tl.trans(k_to_end), u)
    if STORE_HT:
        tl.store(ht_ptr + (n * H + h) * K * V + offs_state, state)


@triton.jit
def _output_fwd_kernel(
    q_ptr,
    G_ptr,
    Aqk_ptr,
    u_ptr,
    h_ptr,
    o_ptr,
    chunk_start_ptr,
    chunk_end_ptr,
    scale,
    H,
    K: tl.constexpr,
    V: tl.constexpr,
    BV: tl.constexpr,
    C: tl.constexpr,
):
    """o = (scale·q ⊙ e^G) S_chunk + Aqk u, for one chunk and one block of BV value channels."""
    c = tl.program_id(0).to(tl.int64)  # 64-bit offsets: T·H·D can pass 2³¹
    h = tl.program_id(1)
    vb = tl.program_id(2)
    start = tl.load(chunk_start_ptr + c).to(tl.int64)
    end = tl.load(chunk_end_ptr + c).to(tl.int64)
    loc = tl.arange(0, C)
    rows = start + loc
    row_ok = rows < end
    kk = tl.arange(0, K)
    vv = vb * BV + tl.arange(0, BV)
    offs_k = (rows[:, None] * H + h) * K + kk[None, :]
    offs_v = (rows[:, None] * H + h) * V + vv[None, :]
    q = tl.load(q_ptr + offs_k, mask=row_ok[:, None], other=0.0).to(tl.float32) * scale
    G = tl.load(G_ptr + offs_k, mask=row_ok[:, None], other=0.0)
    state = tl.load(h_ptr + (c * H + h) * K * V + kk[:, None] * V + vv[None, :])
    Aqk = tl.load(Aqk_ptr + (rows[:, None] * H + h) * C + loc[None, :], mask=row_ok[:, None], other=0.0)
    u = tl.load(u_ptr + offs_v, mask=row_ok[:, None], other=0.0)
    o = tl.dot(q * tl.exp(G), state) + tl.dot(Aqk, u)
    tl.store(o_ptr + offs_v, o.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])


def chunk_kda_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    h0: torch.Tensor | None,
    store_final: bool,
    args: ChunkArgs,
) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor]]:
    """Packed forward (``[T, H, D]`` tensors, fp32 ``h0``). Returns o, the final state and what the
    backward needs (``G, Akk, Aqk, M, W, u`` and the chunk-start ``states``)."""
    T, H, K = q.shape
    V = v.shape[-1]
    table = args.table
    f32 = dict(dtype=torch.float32, device=q.device)
    G = chunk_local_cumsum(g, args, reverse=False)
    Akk = torch.empty(T, H, CHUNK, **f32)
    Aqk = torch.empty(T, H, CHUNK, **f32)
    M = torch.empty(T, H, CHUNK, **f32)
    U, W, u = torch.empty(T, H, V, **f32), torch.empty(T, H, K, **f32), torch.empty(T, H, V, **f32)
    states = torch.empty(table.n_chunks, H, K, V, **f32)
    final = torch.empty(table.n_seqs, H, K, V, **f32) if store_final else None
    o = torch.empty(T, H, V, dtype=v.dtype, device=q.device)
    n_vb = V // args.BV
    if table.n_chunks:
        grid_sub = (table.n_chunks * (CHUNK // SUB), H)
        args.launch(_intra_scores_fwd_kernel, grid_sub, q, k, G, Akk, Aqk, **SUB_TILE_LAUNCH)
        args.launch(_solve_wy_kernel, (table.n_chunks, H), Akk, beta, k, v, G, M, U, W, **TILE_LAUNCH)
    args.launch(
        _state_fwd_kernel,
        (table.n_seqs, H, n_vb),
        k,
        G,
        U,
        W,
        u,
        states,
        h0 if h0 is not None else G,  # never read without HAS_H0
        final if final is not None else G,  # never written without STORE_HT
        HAS_H0=h0 is not None,
        STORE_HT=store_final,
        **STATE_LAUNCH,
    )
    if table.n_chunks:
        args.launch(_output_fwd_kernel, (table.n_chunks, H, n_vb), q, G, Aqk, u, states, o, **TILE_LAUNCH)
    saved = dict(G=G, Akk=Akk, Aqk=Aqk, M=M, W=W, u=u, states=states)
    return o, final, saved
