"""LatentMoE routed experts in Triton: permute by expert, grouped GEMMs with SiTU-GLU, combine.

One grouped GEMM per projection over tiles of each expert's tokens (SiTU-GLU in the epilogue) instead of a
loop over experts; the backward runs grouped GEMMs too. Verified under ``TRITON_INTERPRET=1`` on CPU; block
sizes are not tuned (no GPU was available).

Design: docs/design/model.md#kernels-moe-grouped.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.moe.reference import check_moe_inputs
from kernels.situ_glu_triton import situ_glu_backward, situ_glu_math

BM = 64  # rows (routed tokens) per tile; every tile belongs to one expert


@triton.jit
def _grouped_mm_kernel(
    a_ptr,
    b_ptr,
    b2_ptr,
    c_ptr,
    gate_out_ptr,
    up_out_ptr,
    tile_expert_ptr,
    tile_start_ptr,
    tile_end_ptr,
    N,
    Kd,
    stride_a,
    stride_be,
    stride_bk,
    stride_bn,
    stride_c,
    beta1,
    beta2,
    DUAL: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    """C[rows] (+)= A[rows] @ B[e] for one tile of one expert's rows (B[e][k, n] through strides).

    DUAL: also A @ B2[e]; then C = SiTU-GLU(A@B[e], A@B2[e]) and both pre-activations are stored.
    """
    tile = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(tile_expert_ptr + tile).to(tl.int64)
    start = tl.load(tile_start_ptr + tile).to(tl.int64)
    end = tl.load(tile_end_ptr + tile).to(tl.int64)
    rows = start + tl.arange(0, BM)
    row_ok = rows < end
    cols = pid_n * BN + tl.arange(0, BN)
    col_ok = cols < N
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    acc2 = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, Kd, BK):
        ks = k0 + tl.arange(0, BK)
        k_ok = ks < Kd
        a = tl.load(
            a_ptr + rows[:, None] * stride_a + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0
        )
        b_offs = e * stride_be + ks[:, None] * stride_bk + cols[None, :] * stride_bn
        b_mask = k_ok[:, None] & col_ok[None, :]
        b = tl.load(b_ptr + b_offs, mask=b_mask, other=0.0)
        acc = tl.dot(a, b.to(a.dtype), acc)
        if DUAL:
            b2 = tl.load(b2_ptr + b_offs, mask=b_mask, other=0.0)
            acc2 = tl.dot(a, b2.to(a.dtype), acc2)
    c_offs = rows[:, None] * stride_c + cols[None, :]
    c_mask = row_ok[:, None] & col_ok[None, :]
    if DUAL:
        gate = acc.to(gate_out_ptr.dtype.element_ty)
        up = acc2.to(up_out_ptr.dtype.element_ty)
        tl.store(gate_out_ptr + c_offs, gate, mask=c_mask)
        tl.store(up_out_ptr + c_offs, up, mask=c_mask)
        # SiTU-GLU of the rounded pre-activations, as the reference computes it
        acc = situ_glu_math(gate.to(tl.float32), up.to(tl.float32), beta1, beta2)
    if ACCUMULATE:
        acc += tl.load(c_ptr + c_offs, mask=c_mask, other=0.0).to(tl.float32)
    tl.store(c_ptr + c_offs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)


@triton.jit
def _grouped_wgrad_kernel(
    a_ptr,
    b_ptr,
    out_ptr,
    seg_start_ptr,
    seg_end_ptr,
    P,
    Q,
    stride_a,
    stride_b,
    stride_oe,
    stride_op,
    stride_oq,
    BP: tl.constexpr,
    BQ: tl.constexpr,
    BR: tl.constexpr,
):
    """out[e] = A[seg_e]ᵀ @ B[seg_e]: a [P, Q] weight gradient summed over the expert's routed rows."""
    e = tl.program_id(0).to(tl.int64)
    ps = tl.program_id(1) * BP + tl.arange(0, BP)
    qs = tl.program_id(2) * BQ + tl.arange(0, BQ)
    p_ok = ps < P
    q_ok = qs < Q
    start = tl.load(seg_start_ptr + e).to(tl.int64)
    end = tl.load(seg_end_ptr + e).to(tl.int64)
    acc = tl.zeros([BP, BQ], dtype=tl.float32)
    for r0 in range(start, end, BR):
        rs = r0 + tl.arange(0, BR)
        r_ok = rs < end
        a = tl.load(
            a_ptr + rs[:, None] * stride_a + ps[None, :], mask=r_ok[:, None] & p_ok[None, :], other=0.0
        )
        b = tl.load(
            b_ptr + rs[:, None] * stride_b + qs[None, :], mask=r_ok[:, None] & q_ok[None, :], other=0.0
        )
        acc = tl.dot(tl.trans(a), b.to(a.dtype), acc)
    offs = e * stride_oe + ps[:, None] * stride_op + qs[None, :] * stride_oq
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=p_ok[:, None] & q_ok[None, :])


def _block(n: int, cap: int) -> int:
    return max(16, min(cap, triton.next_power_of_2(max(n, 1))))


class _Routing:
    """Expert-sorted order of the (token, slot) pairs and the tile schedule of the grouped GEMMs."""

    def __init__(self, expert_ids: torch.Tensor, n_experts: int) -> None:
        M, top_k = expert_ids.shape
        flat = expert_ids.reshape(-1).long()
        self.order = torch.argsort(flat, stable=True)  # position in sorted order → flat (token, slot) index
        self.token = self.order // top_k
        counts = torch.bincount(flat, minlength=n_experts)
        ends = counts.cumsum(0)
        self.seg_start = (ends - counts).to(torch.int32)
        self.seg_end = ends.to(torch.int32)
        tiles_per_expert = (counts + BM - 1) // BM
        self.tile_expert = torch.repeat_interleave(
            torch.arange(n_experts, device=flat.device), tiles_per_expert
        )
        first_tile = tiles_per_expert.cumsum(0) - tiles_per_expert
        tile_rank = torch.arange(self.tile_expert.numel(), device=flat.device) - first_tile[self.tile_expert]
        self.tile_start = (self.seg_start.long()[self.tile_expert] + tile_rank * BM).to(torch.int32)
        self.tile_end = self.seg_end[self.tile_expert]
        self.tile_expert = self.tile_expert.to(torch.int32)
        self.n_tiles = int(self.tile_expert.numel())
        self.n_rows = flat.numel()


def _grouped_mm(
    a, w, routing: _Routing, n_out: int, transpose_w: bool, out=None, w2=None, preacts=None, betas=(4.0, 25.0)
):
    """``out[r] (+)= a[r] @ op(w[e_r])``; op transposes ``w [E, N, Kd]``, keeps ``w [E, Kd, N]``."""
    Kd = a.shape[1]
    accumulate = out is not None
    if out is None:
        out = torch.empty(routing.n_rows, n_out, dtype=a.dtype, device=a.device)
    if transpose_w:  # w [E, N, Kd]: B[e][k, n] = w[e, n, k]
        sbk, sbn = w.stride(2), w.stride(1)
    else:  # w [E, Kd, N]
        sbk, sbn = w.stride(1), w.stride(2)
    gate_out, up_out = preacts if preacts is not None else (out, out)
    BN = _block(n_out, 64)
    BK = _block(Kd, 32)
    if routing.n_tiles:
        _grouped_mm_kernel[(routing.n_tiles, triton.cdiv(n_out, BN))](
            a,
            w,
            w2 if w2 is not None else w,
            out,
            gate_out,
            up_out,
            routing.tile_expert,
            routing.tile_start,
            routing.tile_end,
            n_out,
            Kd,
            a.stride(0),
            w.stride(0),
            sbk,
            sbn,
            out.stride(0),
            float(betas[0]),
            float(betas[1]),
            DUAL=w2 is not None,
            ACCUMULATE=accumulate,
            BM=BM,
            BN=BN,
            BK=BK,
        )
    return out


def _grouped_wgrad(a, b, routing: _Routing, n_experts: int, dtype) -> torch.Tensor:
    """``out[e] = a[seg_e]ᵀ @ b[seg_e]`` → ``[E, a.shape[1], b.shape[1]]``."""
    P, Q = a.shape[1], b.shape[1]
    out = torch.empty(n_experts, P, Q, dtype=dtype, device=a.device)
    BP, BQ = _block(P, 64), _block(Q, 64)
    _grouped_wgrad_kernel[(n_experts, triton.cdiv(P, BP), triton.cdiv(Q, BQ))](
        a,
        b,
        out,
        routing.seg_start,
        routing.seg_end,
        P,
        Q,
        a.stride(0),
        b.stride(0),
        out.stride(0),
        out.stride(1),
        out.stride(2),
        BP=BP,
        BQ=BQ,
        BR=32,
    )
    return out


class MoEExpertsFunction(torch.autograd.Function):
    """Grouped-GEMM routed experts with SiTU-GLU; gradients for x, router weights and expert weights."""

    @staticmethod
    def forward(ctx, x, expert_ids, expert_weights, w_gate, w_up, w_down, beta1, beta2):
        E, I, L = w_gate.shape
        routing = _Routing(expert_ids, E)
        x = x.contiguous()
        xs = x[routing.token]  # [R, L] routed rows in expert order
        gate = torch.empty(routing.n_rows, I, dtype=x.dtype, device=x.device)
        up = torch.empty_like(gate)
        h = _grouped_mm(
            xs, w_gate, routing, I, transpose_w=True, w2=w_up, preacts=(gate, up), betas=(beta1, beta2)
        )
        ys = _grouped_mm(h, w_down, routing, L, transpose_w=True)
        weights = expert_weights.reshape(-1)[routing.order].to(ys.dtype)
        y = torch.zeros_like(x).index_add_(0, routing.token, ys * weights[:, None])
        ctx.save_for_backward(xs, gate, up, h, ys, weights, w_gate, w_up, w_down)
        ctx.routing, ctx.betas, ctx.weights_dtype = routing, (beta1, beta2), expert_weights.dtype
        ctx.weights_shape = expert_weights.shape
        return y

    @staticmethod
    def backward(ctx, dy):
        xs, gate, up, h, ys, weights, w_gate, w_up, w_down = ctx.saved_tensors
        routing = ctx.routing
        E, I, L = w_gate.shape
        dy_rows = dy.contiguous()[routing.token]  # [R, L]
        d_weights_sorted = (ys.float() * dy_rows.float()).sum(-1)
        d_weights = torch.empty(routing.n_rows, dtype=torch.float32, device=dy.device)
        d_weights[routing.order] = d_weights_sorted
        dys = (dy_rows * weights[:, None]).to(h.dtype)
        dh = _grouped_mm(dys, w_down, routing, I, transpose_w=False)  # dys @ w_down[e]: [R, I]
        d_gate, d_up = situ_glu_backward(gate, up, dh, *ctx.betas)
        dxs = _grouped_mm(d_gate, w_gate, routing, L, transpose_w=False)
        dxs = _grouped_mm(d_up, w_up, routing, L, transpose_w=False, out=dxs)
        dx = torch.zeros(dy.shape, dtype=torch.float32, device=dy.device).index_add_(
            0, routing.token, dxs.float()
        )
        dw_gate = _grouped_wgrad(d_gate, xs, routing, E, w_gate.dtype)
        dw_up = _grouped_wgrad(d_up, xs, routing, E, w_up.dtype)
        dw_down = _grouped_wgrad(dys, h, routing, E, w_down.dtype)
        return (
            dx.to(dy.dtype),
            None,
            d_weights.reshape(ctx.weights_shape).to(ctx.weights_dtype),
            dw_gate,
            dw_up,
            dw_down,
            None,
            None,
        )


def moe_experts_triton(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    expert_weights: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    beta1: float = 4.0,
    beta2: float = 25.0,
) -> torch.Tensor:
    """Routed experts on the grouped-GEMM Triton kernels; same contract as ``kernels.moe_experts``."""
    check_moe_inputs(x, expert_ids, expert_weights, w_gate, w_up, w_down)
    return MoEExpertsFunction.apply(
        x, expert_ids, expert_weights, w_gate, w_up, w_down, float(beta1), float(beta2)
    )
