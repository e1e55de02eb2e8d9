"""PyTorch references for KDA (Kimi Delta Attention): the gated delta rule with per-channel decay.

Plain PyTorch (autograd, any device): :func:`naive_recurrent_kda`, the token-by-token recurrence and the
oracle of every other implementation, and :func:`chunk_kda_reference`, the chunkwise algorithm the Triton
kernels run, evaluated without overflow for any decay.

Design: docs/design/model.md#kernels-kda-reference.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F

from kernels.kda.inputs import check_kda_inputs, sequence_bounds

CHUNK_SIZE = 64  # as the Triton kernels
CPU_CHUNK_SIZE = 32  # what ``kernels.chunk_kda`` uses on CPU (see ``bench/kernels.py``)
SUB_TILE = 16
# exp(88.7) overflows fp32; the fast path's factors stay below exp(60) (sums of K ≤ 256 such terms are safe)
SAFE_EXPONENT = 60.0
CHUNKS_PER_GROUP = 8
FACTORED_SUB_TILES = (32, 16)


def kda_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the recurrence (the decoding step).

    ``q, k, g: [B, H, K]``, ``v: [B, H, V]``, ``beta: [B, H]``, ``state: [B, H, K, V]`` (all fp32).
    Returns ``(o [B, H, V], new_state [B, H, K, V])``.
    """
    state = state * g.exp().unsqueeze(-1)
    predicted = torch.einsum("bhkv,bhk->bhv", state, k)
    state = state + torch.einsum("bhk,bhv->bhkv", k, beta.unsqueeze(-1) * (v - predicted))
    o = torch.einsum("bhkv,bhk->bhv", state, q * scale)
    return o, state


def _naive_single(q, k, v, g, beta, scale, state):
    """Recurrence over ``[B, H, T, *]`` fp32 tensors; returns ``(o [B, H, T, V], final state)``."""
    outputs = []
    for t in range(q.shape[2]):
        o_t, state = kda_step(q[:, :, t], k[:, :, t], v[:, :, t], g[:, :, t], beta[:, :, t], state, scale)
        outputs.append(o_t)
    o = torch.stack(outputs, dim=2) if outputs else v.new_zeros(v.shape)
    return o, state


def intra_chunk_decayed_scores(
    a: torch.Tensor, b: torch.Tensor, G: torch.Tensor, include_diagonal: bool, sub_tile: int = SUB_TILE
) -> torch.Tensor:
    """``M[t, i] = Σ_c a_tc b_ic exp(G_tc − G_ic)`` for ``i ≤ t`` (``i < t`` without the diagonal), else 0.

    ``a, b, G: [..., C, K]`` with ``G`` non-increasing along C (cumulative log decay); returns
    ``[..., C, C]``. Overflow-free for any decay (see the module docstring): exact pairwise
    differences on diagonal sub-tiles, a per-sub-tile reference point off the diagonal. This is the
    form the Triton kernels use; :func:`intra_chunk_scores` adds a faster path for moderate decay.
    """
    C = a.shape[-2]
    if C % sub_tile:
        raise ValueError(f"chunk length {C} must be a multiple of the sub-tile {sub_tile}")
    tri = torch.ones(sub_tile, sub_tile, dtype=torch.bool, device=a.device)
    tri = tri.tril() if include_diagonal else tri.tril(-1)
    row_blocks = []
    for r in range(C // sub_tile):
        rows = slice(r * sub_tile, (r + 1) * sub_tile)
        a_r, b_r, G_r = a[..., rows, :], b[..., rows, :], G[..., rows, :]
        pieces = []
        if r > 0:
            ref = G[..., r * sub_tile : r * sub_tile + 1, :]
            a_dec = a_r * (G_r - ref).exp()
            b_dec = b[..., : r * sub_tile, :] * (ref - G[..., : r * sub_tile, :]).exp()
            pieces.append(a_dec @ b_dec.transpose(-1, -2))
        diff = G_r.unsqueeze(-2) - G_r.unsqueeze(-3)  # [..., t, i, K]
        decay = torch.where(tri.unsqueeze(-1), diff, torch.zeros_like(diff)).exp()
        diag = (a_r.unsqueeze(-2) * decay * b_r.unsqueeze(-3)).sum(-1)
        pieces.append(diag * tri)
        if (r + 1) * sub_tile < C:
            pieces.append(a.new_zeros(*a.shape[:-2], sub_tile, C - (r + 1) * sub_tile))
        row_blocks.append(torch.cat(pieces, dim=-1))
    return torch.cat(row_blocks, dim=-2)


def _factored_scores(q, k, G, sub_tile: int):
    """``(Akk, Aqk)`` through a reference point per row sub-tile, or None when an exponent would be unsafe.

    For the rows ``t`` of a sub-tile with middle token ``m`` and every column ``i`` up to the
    sub-tile's end: ``exp(G_t − G_i) = exp(G_t − G_m)·exp(G_m − G_i)``, one matmul per sub-tile.
    """
    C = q.shape[-2]
    Akk = q.new_zeros(*q.shape[:-1], C)
    Aqk = q.new_zeros(*q.shape[:-1], C)
    for r in range(C // sub_tile):
        rows = slice(r * sub_tile, (r + 1) * sub_tile)
        end = (r + 1) * sub_tile
        G_mid = G[..., r * sub_tile + sub_tile // 2, :].unsqueeze(-2)  # [..., 1, K]
        row_exp = G[..., rows, :] - G_mid
        col_exp = G_mid - G[..., :end, :]
        if max(float(row_exp.detach().max()), float(col_exp.detach().max())) > SAFE_EXPONENT:
            return None
        row_decay = row_exp.exp()
        k_cols = (k[..., :end, :] * col_exp.exp()).transpose(-1, -2)  # [..., K, end]
        Akk[..., rows, :end] = (k[..., rows, :] * row_decay) @ k_cols
        Aqk[..., rows, :end] = (q[..., rows, :] * row_decay) @ k_cols
    # above the diagonal a row factor before m meets a column factor after m: their product may
    # overflow, so those entries are selected away (never multiplied by 0, which would give NaN)
    lower = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    zero = q.new_zeros(())
    return torch.where(lower.tril(-1), Akk, zero), torch.where(lower, Aqk, zero)


def intra_chunk_scores(
    q: torch.Tensor, k: torch.Tensor, G: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Both score matrices of a chunk: ``(Akk, Aqk)`` = decayed ``k·k`` (strictly lower), ``q·k`` (lower).

    Fast path: one matmul per row sub-tile (32 tokens, else 16), factoring every decay through the
    sub-tile's middle token, so positive exponents span at most half a sub-tile; it is taken when they
    stay below ``SAFE_EXPONENT`` (16-token sub-tiles: always for K3's gate, g > −5). Otherwise (e.g.
    an unbounded Kimi-Linear gate) the overflow-free :func:`intra_chunk_decayed_scores` runs.
    """
    for sub_tile in FACTORED_SUB_TILES:
        if q.shape[-2] % sub_tile == 0 and (scores := _factored_scores(q, k, G, sub_tile)) is not None:
            return scores
    return (
        intra_chunk_decayed_scores(k, k, G, include_diagonal=False),
        intra_chunk_decayed_scores(q, k, G, include_diagonal=True),
    )


def unit_lower_inverse(A: torch.Tensor, leaf: int = SUB_TILE) -> torch.Tensor:
    """``(I + A)⁻¹`` for strictly lower-triangular ``A [..., n, n]``, by 2×2 block recursion.

    ``[[A₁₁, 0], [A₂₁, A₂₂]]⁻¹ = [[A₁₁⁻¹, 0], [−A₂₂⁻¹ A₂₁ A₁₁⁻¹, A₂₂⁻¹]]``; the 16×16 leaves go to
    ``solve_triangular``. Batched matmuls make this about twice as fast on CPU as one triangular solve
    with the WY right-hand sides.
    """
    n = A.shape[-1]
    if n <= leaf or n % 2:
        eye = torch.eye(n, dtype=A.dtype, device=A.device)
        return torch.linalg.solve_triangular(A + eye, eye.expand_as(A), upper=False, unitriangular=True)
    h = n // 2
    inv11 = unit_lower_inverse(A[..., :h, :h], leaf)
    inv22 = unit_lower_inverse(A[..., h:, h:], leaf)
    inv21 = -(inv22 @ (A[..., h:, :h] @ inv11))
    top = torch.cat([inv11, torch.zeros_like(inv11)], dim=-1)
    return torch.cat([top, torch.cat([inv21, inv22], dim=-1)], dim=-2)


def _prepare_chunks(q, k, v, g, beta):
    """Everything about a group of chunks that does not depend on the incoming state.

    Inputs ``[B, H, n, C, *]`` (q already scaled, beta ``[B, H, n, C, 1]``). Returns the WY products
    ``U, W``, the scores ``Aqk``, the decayed queries and keys and each chunk's total decay.
    """
    G = g.cumsum(dim=-2)
    Akk, Aqk = intra_chunk_scores(q, k, G)
    eG = G.exp()
    M = unit_lower_inverse(beta * Akk)  # (I + diag(β) Akk)⁻¹
    U = M @ (beta * v)
    W = M @ (beta * k * eG)
    G_last = G[..., -1:, :]
    k_to_end = k * (G_last - G).exp()
    chunk_decay = G_last.transpose(-1, -2).exp()  # [B, H, n, K, 1]
    return U, W, Aqk, q * eG, k_to_end, chunk_decay


def _chunk_single(q, k, v, g, beta, scale, state, chunk_size=CHUNK_SIZE, chunks_per_group=CHUNKS_PER_GROUP):
    """Chunked algorithm over ``[B, H, T, *]`` fp32 tensors; returns ``(o [B, H, T, V], final state)``.

    Chunks are prepared ``chunks_per_group`` at a time (vectorised, and small enough to stay in
    cache), then the state is carried through the group's chunks one by one.
    """
    B, H, T, K = q.shape
    V = v.shape[-1]
    if T == 0:
        return v.new_zeros(B, H, 0, V), state
    pad = (-T) % chunk_size
    if pad:  # zero tokens with g = 0, β = 0 leave the state unchanged and are dropped from o
        q, k, v, g = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v, g))
        beta = F.pad(beta, (0, pad))
    N = (T + pad) // chunk_size
    q, k, v, g = (x.reshape(B, H, N, chunk_size, x.shape[-1]) for x in (q, k, v, g))
    beta = beta.reshape(B, H, N, chunk_size, 1)
    q = q * scale
    outputs = []
    for first in range(0, N, chunks_per_group):
        group = slice(first, first + chunks_per_group)
        U, W, Aqk, q_dec, k_to_end, chunk_decay = _prepare_chunks(
            q[:, :, group], k[:, :, group], v[:, :, group], g[:, :, group], beta[:, :, group]
        )
        k_to_end_t = k_to_end.transpose(-1, -2).contiguous()
        W = W.contiguous()
        starts, pseudo_values = [], []
        for n in range(U.shape[2]):  # the only sequential part: two small matmuls per chunk
            u = U[:, :, n] - W[:, :, n] @ state
            starts.append(state)
            pseudo_values.append(u)
            state = chunk_decay[:, :, n] * state + k_to_end_t[:, :, n] @ u
        outputs.append(q_dec @ torch.stack(starts, dim=2) + Aqk @ torch.stack(pseudo_values, dim=2))
    o = torch.cat(outputs, dim=2).reshape(B, H, N * chunk_size, V)[:, :, :T]
    return o, state


def _run_per_sequence(single, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens):
    """Shared driver: layout ``[B,T,H,D]`` → fp32 ``[B,H,T,D]``, one call per packed sequence.

    The final state is fp32 (fp64 when the inputs are fp64, for gradient checks).
    """
    check_kda_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K**-0.5 if scale is None else float(scale)
    dtype = torch.promote_types(q.dtype, torch.float32)  # fp32, or fp64 for gradient checks
    qf, kf, vf, gf = (x.to(dtype).transpose(1, 2) for x in (q, k, v, g))
    bf = beta.to(dtype).transpose(1, 2)
    outputs, finals = [], []
    for n, (start, end) in enumerate(sequence_bounds(T, cu_seqlens)):
        rows = slice(n, n + 1) if cu_seqlens is not None else slice(None)
        if initial_state is not None:
            state = initial_state[rows].to(dtype)
        else:
            state = qf.new_zeros(1 if cu_seqlens is not None else B, H, K, V)
        o, state = single(
            qf[..., start:end, :],
            kf[..., start:end, :],
            vf[..., start:end, :],
            gf[..., start:end, :],
            bf[..., start:end],
            scale,
            state,
        )
        outputs.append(o)
        finals.append(state)
    o = torch.cat(outputs, dim=2).transpose(1, 2).to(v.dtype)
    final = torch.cat(finals, dim=0) if output_final_state else None
    return o, final


def naive_recurrent_kda(
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
    """Token-by-token KDA, the oracle. Shapes as ``kernels.chunk_kda``; computed in fp32."""
    return _run_per_sequence(
        _naive_single, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens
    )


def chunk_kda_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunkwise-parallel KDA in PyTorch (WY/UT transform). Shapes as ``kernels.chunk_kda``.

    ``chunk_size`` (a multiple of 16) defaults to the Triton kernels' 64; ``CPU_CHUNK_SIZE`` (32) is
    faster on CPU, where the O(C²) in-chunk work per token matters more than the number of chunks.
    """
    if chunk_size <= 0 or chunk_size % SUB_TILE:
        raise ValueError(f"chunk_size must be a positive multiple of {SUB_TILE}; got {chunk_size}")
    return _run_per_sequence(
        partial(_chunk_single, chunk_size=chunk_size),
        q,
        k,
        v,
        g,
        beta,
        scale,
        initial_state,
        output_final_state,
        cu_seqlens,
    )


# Decoding: the recurrence is the reference of the fused recurrent kernel.
fused_recurrent_kda_reference = naive_recurrent_kda
