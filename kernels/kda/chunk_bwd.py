"""Backward of chunkwise KDA in Triton (torch only allocates; ``kernels.kda.chunk`` holds the algorithm).

Four steps: the reverse state pass, per-chunk gradients through the output and WY products, the score
gradients into ``q, k, G`` per 16-token sub-tile, and the reverse cumulative sum for ``dg``.

Design: docs/design/model.md#kernels-kda-chunk-bwd.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.kda.chunk_utils import CHUNK, STATE_LAUNCH, SUB, SUB_TILE_LAUNCH, TILE_LAUNCH, ChunkArgs
from kernels.kda.cumsum import chunk_local_cumsum


@triton.jit
def _state_bwd_kernel(
    q_ptr,
    k_ptr,
    G_ptr,
    W_ptr,
    Aqk_ptr,
    do_ptr,
    du_ptr,
    dh_ptr,
    dht_ptr,
    dh0_ptr,
    seq_start_ptr,
    seq_end_ptr,
    seq_first_chunk_ptr,
    scale,
    H,
    K: tl.constexpr,
    V: tl.constexpr,
    BV: tl.constexpr,
    C: tl.constexpr,
    HAS_DHT: tl.constexpr,
    STORE_DH0: tl.constexpr,
):
    """Reverse over chunks: state gradient at each chunk end (dh), du = Aqkᵀ dO + k e^{G_L−G} dh, dh0."""
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
    if HAS_DHT:
        dstate = tl.load(dht_ptr + (n * H + h) * K * V + offs_state)
    else:
        dstate = tl.zeros([K, BV], dtype=tl.float32)
    n_chunks = tl.cdiv(eos - bos, C)
    for back in range(n_chunks):
        i = n_chunks - 1 - back
        start = bos + i * C
        end = tl.minimum(start + C, eos)
        rows = start + loc
        row_ok = rows < end
        tl.store(dh_ptr + ((first + i) * H + h) * K * V + offs_state, dstate)
        offs_k = (rows[:, None] * H + h) * K + kk[None, :]
        offs_v = (rows[:, None] * H + h) * V + vv[None, :]
        G = tl.load(G_ptr + offs_k, mask=row_ok[:, None], other=0.0)
        G_last = tl.load(G_ptr + ((end - 1) * H + h) * K + kk)
        k = tl.load(k_ptr + offs_k, mask=row_ok[:, None], other=0.0).to(tl.float32)
        q = tl.load(q_ptr + offs_k, mask=row_ok[:, None], other=0.0).to(tl.float32) * scale
        W = tl.load(W_ptr + offs_k, mask=row_ok[:, None], other=0.0)
        Aqk = tl.load(Aqk_ptr + (rows[:, None] * H + h) * C + loc[None, :], mask=row_ok[:, None], other=0.0)
        do = tl.load(do_ptr + offs_v, mask=row_ok[:, None], other=0.0).to(tl.float32)
        k_to_end = k * tl.exp(tl.where(row_ok[:, None], G_last[None, :] - G, 0.0))
        du = tl.dot(tl.trans(Aqk), do) + tl.dot(k_to_end, dstate)
        tl.store(du_ptr + offs_v, du, mask=row_ok[:, None])
        dstate = (
            dstate * tl.exp(G_last)[:, None] + tl.dot(tl.trans(q * tl.exp(G)), do) - tl.dot(tl.trans(W), du)
        )
    if STORE_DH0:
        tl.store(dh0_ptr + (n * H + h) * K * V + offs_state, dstate)


@triton.jit
def _chunk_bwd_keys_kernel(
    q_ptr,
    k_ptr,
    beta_ptr,
    G_ptr,
    M_ptr,
    u_ptr,
    du_ptr,
    do_ptr,
    h_ptr,
    dh_ptr,
    dq_ptr,
    dk_ptr,
    dG_ptr,
    dM_part_ptr,
    dbeta_part_ptr,
    chunk_start_ptr,
    chunk_end_ptr,
    scale,
    H,
    n_chunks,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    C: tl.constexpr,
):
    """Gradients of one chunk that live on the key channels, for one block of BK of them.

    From o = (q e^G) S + ..., S_end = e^{G_L} S + (k e^{G_L−G})ᵀ u and u = U − W S, W = M (β k e^G):
    partial dq, dk, dG (the score gradients are added by ``_intra_scores_bwd_kernel``), and this block's
    shares of dM (= dW (β k e^G)ᵀ) and dβ, reduced over the key blocks by ``_chunk_bwd_values_kernel``.
    """
    c = tl.program_id(0).to(tl.int64)  # 64-bit offsets: T·H·D can pass 2³¹
    h = tl.program_id(1)
    kb = tl.program_id(2)
    start = tl.load(chunk_start_ptr + c).to(tl.int64)
    end = tl.load(chunk_end_ptr + c).to(tl.int64)
    loc = tl.arange(0, C)
    rows = start + loc
    row_ok = rows < end
    rmask = row_ok[:, None]
    kk = kb * BK + tl.arange(0, BK)
    d_qdec = tl.zeros([C, BK], dtype=tl.float32)
    d_kte = tl.zeros([C, BK], dtype=tl.float32)
    dW = tl.zeros([C, BK], dtype=tl.float32)
    dG_last_state = tl.zeros([BK], dtype=tl.float32)
    for v0 in tl.static_range(0, V, BV):
        vv = v0 + tl.arange(0, BV)
        offs_v = (rows[:, None] * H + h) * V + vv[None, :]
        offs_state = (c * H + h) * K * V + kk[:, None] * V + vv[None, :]
        state = tl.load(h_ptr + offs_state)
        dstate = tl.load(dh_ptr + offs_state)
        u = tl.load(u_ptr + offs_v, mask=rmask, other=0.0)
        du = tl.load(du_ptr + offs_v, mask=rmask, other=0.0)
        do = tl.load(do_ptr + offs_v, mask=rmask, other=0.0).to(tl.float32)
        d_qdec += tl.dot(do, tl.trans(state))
        d_kte += tl.dot(u, tl.trans(dstate))
        dW -= tl.dot(du, tl.trans(state))
        dG_last_state += tl.sum(state * dstate, axis=1)
    offs_k = (rows[:, None] * H + h) * K + kk[None, :]
    q = tl.load(q_ptr + offs_k, mask=rmask, other=0.0).to(tl.float32) * scale
    k = tl.load(k_ptr + offs_k, mask=rmask, other=0.0).to(tl.float32)
    G = tl.load(G_ptr + offs_k, mask=rmask, other=0.0)
    G_last = tl.load(G_ptr + ((end - 1) * H + h) * K + kk)
    beta = tl.load(beta_ptr + rows * H + h, mask=row_ok, other=0.0).to(tl.float32)
    M = tl.load(M_ptr + (rows[:, None] * H + h) * C + loc[None, :], mask=rmask, other=0.0)
    eG = tl.exp(G)
    to_end = tl.exp(tl.where(rmask, G_last[None, :] - G, 0.0))
    k_to_end = k * to_end
    R2 = k * eG * beta[:, None]
    dR2 = tl.dot(tl.trans(M), dW)
    dG_last = dG_last_state * tl.exp(G_last) + tl.sum(d_kte * k_to_end, axis=0)
    dG = d_qdec * q * eG - d_kte * k_to_end + dR2 * R2
    dG += tl.where((rows == end - 1)[:, None], dG_last[None, :], 0.0)
    tl.store(dq_ptr + offs_k, d_qdec * eG, mask=rmask)
    tl.store(dk_ptr + offs_k, d_kte * to_end + dR2 * beta[:, None] * eG, mask=rmask)
    tl.store(dG_ptr + offs_k, dG, mask=rmask)
    part = (kb * n_chunks + c) * H + h
    tl.store(dM_part_ptr + part * C * C + loc[:, None] * C + loc[None, :], tl.dot(dW, tl.trans(R2)))
    tl.store(dbeta_part_ptr + part * C + loc, tl.sum(dR2 * k * eG, axis=1))


@triton.jit
def _chunk_bwd_values_kernel(
    v_ptr,
    beta_ptr,
    Akk_ptr,
    M_ptr,
    u_ptr,
    du_ptr,
    do_ptr,
    dM_part_ptr,
    dbeta_part_ptr,
    dAqk_ptr,
    dAkk_ptr,
    dv_ptr,
    dbeta_ptr,
    chunk_start_ptr,
    chunk_end_ptr,
    H,
    n_chunks,
    V: tl.constexpr,
    BV: tl.constexpr,
    C: tl.constexpr,
    NKB: tl.constexpr,
):
    """Gradients of one chunk on the value channels and through the triangular inverse.

    dAqk = dO uᵀ (lower), dv = β Mᵀ du, dM = du (β v)ᵀ + Σ_blocks dW (β k e^G)ᵀ, then through
    M = (I + A)⁻¹: dA = −Mᵀ dM Mᵀ (strictly lower), dAkk = β dA, dβ = Σ_i dA Akk + dR1·v + Σ_blocks.
    """
    c = tl.program_id(0).to(tl.int64)  # 64-bit offsets: T·H·D can pass 2³¹
    h = tl.program_id(1)
    start = tl.load(chunk_start_ptr + c).to(tl.int64)
    end = tl.load(chunk_end_ptr + c).to(tl.int64)
    loc = tl.arange(0, C)
    rows = start + loc
    row_ok = rows < end
    rmask = row_ok[:, None]
    offs_c = (rows[:, None] * H + h) * C + loc[None, :]
    beta = tl.load(beta_ptr + rows * H + h, mask=row_ok, other=0.0).to(tl.float32)
    Mt = tl.trans(tl.load(M_ptr + offs_c, mask=rmask, other=0.0))
    dAqk = tl.zeros([C, C], dtype=tl.float32)
    dM = tl.zeros([C, C], dtype=tl.float32)
    dbeta = tl.zeros([C], dtype=tl.float32)
    for v0 in tl.static_range(0, V, BV):
        vv = v0 + tl.arange(0, BV)
        offs_v = (rows[:, None] * H + h) * V + vv[None, :]
        u = tl.load(u_ptr + offs_v, mask=rmask, other=0.0)
        du = tl.load(du_ptr + offs_v, mask=rmask, other=0.0)
        do = tl.load(do_ptr + offs_v, mask=rmask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + offs_v, mask=rmask, other=0.0).to(tl.float32)
        dAqk += tl.dot(do, tl.trans(u))
        dR1 = tl.dot(Mt, du)
        dbeta += tl.sum(dR1 * v, axis=1)
        dM += tl.dot(du, tl.trans(v * beta[:, None]))
        tl.store(dv_ptr + offs_v, dR1 * beta[:, None], mask=rmask)
    for kb in tl.static_range(NKB):
        part = (kb * n_chunks + c) * H + h
        dM += tl.load(dM_part_ptr + part * C * C + loc[:, None] * C + loc[None, :])
        dbeta += tl.load(dbeta_part_ptr + part * C + loc)
    lower_incl = (loc[:, None] >= loc[None, :]) & rmask
    lower_strict = (loc[:, None] > loc[None, :]) & rmask
    dA = tl.where(lower_strict, -tl.dot(Mt, tl.dot(dM, Mt)), 0.0)
    Akk = tl.load(Akk_ptr + offs_c, mask=rmask, other=0.0)
    dbeta += tl.sum(dA * Akk, axis=1)
    tl.store(dAqk_ptr + offs_c, tl.where(lower_incl, dAqk, 0.0), mask=rmask)
    tl.store(dAkk_ptr + offs_c, dA * beta[:, None], mask=rmask)
    tl.store(dbeta_ptr + rows * H + h, dbeta, mask=row_ok)


@triton.jit
def _intra_scores_bwd_kernel(
    q_ptr,
    k_ptr,
    G_ptr,
    dAqk_ptr,
    dAkk_ptr,
    dq_ptr,
    dk_ptr,
    dG_ptr,
    chunk_start_ptr,
    chunk_end_ptr,
    scale,
    H,
    K: tl.constexpr,
    C: tl.constexpr,
    S: tl.constexpr,
):
    """Gradients of the decayed scores into q, k, G for the tokens of one 16-token sub-tile.

    As rows (t in the sub-tile): dq_t += Σ_i dAqk[t,i] k_i e^{G_t−G_i}, dk_t += Σ_i dAkk[t,i] k_i e^{..}.
    As columns (i in the sub-tile): dk_i += Σ_t (dAqk[t,i] q_t + dAkk[t,i] k_t) e^{G_t−G_i}.
    dG gets a⊙da for the row role and −b⊙db for the column role. Adds to the partial dq, dk, dG.
    """
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
        all_ok = all_rows < end
        offs_r = (rows[:, None] * H + h) * K + kk[None, :]
        offs_a = (all_rows[:, None] * H + h) * K + kk[None, :]
        q_r = tl.load(q_ptr + offs_r, mask=row_ok[:, None], other=0.0).to(tl.float32) * scale
        k_r = tl.load(k_ptr + offs_r, mask=row_ok[:, None], other=0.0).to(tl.float32)
        G_r = tl.load(G_ptr + offs_r, mask=row_ok[:, None], other=0.0)
        # ---- row role, off-diagonal: reference point at the sub-tile's first token
        G_ref = tl.load(G_ptr + (r0 * H + h) * K + kk)
        before = all_rows < r0
        k_b = tl.load(k_ptr + offs_a, mask=before[:, None], other=0.0).to(tl.float32)
        G_b = tl.load(G_ptr + offs_a, mask=before[:, None], other=0.0)
        k_b = k_b * tl.exp(tl.where(before[:, None], G_ref[None, :] - G_b, 0.0))
        offs_rows_c = (rows[:, None] * H + h) * C + all_loc[None, :]
        dAqk_r = tl.load(dAqk_ptr + offs_rows_c, mask=row_ok[:, None], other=0.0)
        dAkk_r = tl.load(dAkk_ptr + offs_rows_c, mask=row_ok[:, None], other=0.0)
        row_decay = tl.exp(tl.where(row_ok[:, None], G_r - G_ref[None, :], 0.0))
        dq_rows = tl.dot(tl.where(before[None, :], dAqk_r, 0.0), k_b) * row_decay
        dk_rows = tl.dot(tl.where(before[None, :], dAkk_r, 0.0), k_b) * row_decay
        # ---- column role, off-diagonal: reference point at the sub-tile's last valid token
        last = tl.minimum(r0 + S, end) - 1
        G_ref2 = tl.load(G_ptr + (last * H + h) * K + kk)
        after = (all_rows >= r0 + S) & all_ok
        q_a = tl.load(q_ptr + offs_a, mask=after[:, None], other=0.0).to(tl.float32) * scale
        k_a = tl.load(k_ptr + offs_a, mask=after[:, None], other=0.0).to(tl.float32)
        G_a = tl.load(G_ptr + offs_a, mask=after[:, None], other=0.0)
        a_decay = tl.exp(tl.where(after[:, None], G_a - G_ref2[None, :], 0.0))
        offs_cols = (all_rows[:, None] * H + h) * C + r * S + t_loc[None, :]
        dAqk_c = tl.load(dAqk_ptr + offs_cols, mask=after[:, None], other=0.0)  # [C, S]: rows t, cols i
        dAkk_c = tl.load(dAkk_ptr + offs_cols, mask=after[:, None], other=0.0)
        col_decay = tl.exp(tl.where(row_ok[:, None], G_ref2[None, :] - G_r, 0.0))
        dk_cols = (
            tl.dot(tl.trans(dAqk_c), q_a * a_decay) + tl.dot(tl.trans(dAkk_c), k_a * a_decay)
        ) * col_decay
        # ---- diagonal sub-tile, exact pairwise differences
        dq_diag = tl.zeros([S, K], dtype=tl.float32)
        dk_diag_row = tl.zeros([S, K], dtype=tl.float32)
        dk_diag_col = tl.zeros([S, K], dtype=tl.float32)
        for j in tl.static_range(S):
            j_ok = (r0 + j + kk * 0) < end
            offs_j = ((r0 + j) * H + h) * K + kk
            k_j = tl.load(k_ptr + offs_j, mask=j_ok, other=0.0).to(tl.float32)
            q_j = tl.load(q_ptr + offs_j, mask=j_ok, other=0.0).to(tl.float32) * scale
            G_j = tl.load(G_ptr + offs_j, mask=j_ok, other=0.0)
            # j as a column: rows t ≥ j of this sub-tile
            at_col = all_loc[None, :] == r * S + j
            dqk_col = tl.sum(tl.where(at_col, dAqk_r, 0.0), axis=1)  # dAqk[t, j] for t in sub-tile
            dkk_col = tl.sum(tl.where(at_col, dAkk_r, 0.0), axis=1)
            t_ge_j = (t_loc >= j) & row_ok
            dec_t = tl.exp(tl.where(t_ge_j[:, None], G_r - G_j[None, :], 0.0)) * k_j[None, :]
            dq_diag += dqk_col[:, None] * dec_t
            dk_diag_row += dkk_col[:, None] * dec_t
            # j as a row: columns i ≤ j of this sub-tile
            offs_jrow = ((r0 + j) * H + h) * C + r * S + t_loc
            dqk_row = tl.load(dAqk_ptr + offs_jrow, mask=(r0 + j + t_loc * 0) < end, other=0.0)
            dkk_row = tl.load(dAkk_ptr + offs_jrow, mask=(r0 + j + t_loc * 0) < end, other=0.0)
            i_le_j = (t_loc <= j) & row_ok & ((r0 + j + t_loc * 0) < end)
            dec_i = tl.exp(tl.where(i_le_j[:, None], G_j[None, :] - G_r, 0.0))
            dk_diag_col += (dqk_row[:, None] * q_j[None, :] + dkk_row[:, None] * k_j[None, :]) * dec_i
        dq_pair = dq_rows + dq_diag
        dk_row_role = dk_rows + dk_diag_row
        dk_col_role = dk_cols + dk_diag_col
        m = row_ok[:, None]
        dq_old = tl.load(dq_ptr + offs_r, mask=m, other=0.0)
        dk_old = tl.load(dk_ptr + offs_r, mask=m, other=0.0)
        dG_old = tl.load(dG_ptr + offs_r, mask=m, other=0.0)
        tl.store(dq_ptr + offs_r, dq_old + dq_pair, mask=m)
        tl.store(dk_ptr + offs_r, dk_old + dk_row_role + dk_col_role, mask=m)
        tl.store(dG_ptr + offs_r, dG_old + q_r * dq_pair + k_r * dk_row_role - k_r * dk_col_role, mask=m)


def chunk_kda_bwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    saved: dict[str, torch.Tensor],
    do: torch.Tensor,
    dht: torch.Tensor | None,
    need_dh0: bool,
    args: ChunkArgs,
) -> tuple[torch.Tensor, ...]:
    """Packed backward from what ``chunk_kda_fwd`` saved. Returns fp32 ``dq, dk, dv, dg, dbeta, dh0``."""
    T, H, K = q.shape
    V = v.shape[-1]
    table = args.table
    f32 = dict(dtype=torch.float32, device=q.device)
    du = torch.empty(T, H, V, **f32)
    dstates = torch.empty(table.n_chunks, H, K, V, **f32)
    dh0 = torch.empty(table.n_seqs, H, K, V, **f32) if need_dh0 else None
    G = saved["G"]
    args.launch(
        _state_bwd_kernel,
        (table.n_seqs, H, V // args.BV),
        q,
        k,
        G,
        saved["W"],
        saved["Aqk"],
        do,
        du,
        dstates,
        dht if dht is not None else G,  # never read without HAS_DHT
        dh0 if dh0 is not None else G,  # never written without STORE_DH0
        HAS_DHT=dht is not None,
        STORE_DH0=need_dh0,
        **STATE_LAUNCH,
    )
    dAqk, dAkk = torch.empty(T, H, CHUNK, **f32), torch.empty(T, H, CHUNK, **f32)
    dq, dk, dG = torch.empty(T, H, K, **f32), torch.empty(T, H, K, **f32), torch.empty(T, H, K, **f32)
    dv, dbeta = torch.empty(T, H, V, **f32), torch.empty(T, H, **f32)
    if table.n_chunks:
        n_kb = K // args.BK
        dM_part = torch.empty(n_kb, table.n_chunks, H, CHUNK, CHUNK, **f32)
        dbeta_part = torch.empty(n_kb, table.n_chunks, H, CHUNK, **f32)
        args.launch(
            _chunk_bwd_keys_kernel, (table.n_chunks, H, n_kb),
            q, k, beta, G, saved["M"], saved["u"], du, do, saved["states"], dstates, dq, dk, dG,
            dM_part, dbeta_part, **TILE_LAUNCH,
        )  # fmt: skip
        args.launch(
            _chunk_bwd_values_kernel, (table.n_chunks, H),
            v, beta, saved["Akk"], saved["M"], saved["u"], du, do, dM_part, dbeta_part, dAqk, dAkk, dv, dbeta,
            **TILE_LAUNCH,
        )  # fmt: skip
        args.launch(
            _intra_scores_bwd_kernel, (table.n_chunks * (CHUNK // SUB), H),
            q, k, G, dAqk, dAkk, dq, dk, dG, **SUB_TILE_LAUNCH,
        )  # fmt: skip
    dg = chunk_local_cumsum(dG, args, reverse=True)
    return dq * args.scale, dk, dv, dg, dbeta, dh0
