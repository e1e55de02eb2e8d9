"""Fused SiTU-GLU in Triton, forward and backward (elementwise, fp32 math, input dtype in and out).

``y = β₁ tanh(gate/β₁) · sigmoid(gate) · β₂ tanh(up/β₂)``. tanh and sigmoid are evaluated from
``exp(−|z|)``, which never overflows, so the output stays within ``β₁·β₂`` and both gradients stay
finite for any finite input (checked up to ±1e4). The backward recomputes the activations from the
saved pre-activations instead of storing them. Used by ``kernels.situ_glu`` on CUDA tensors; runs on
CPU under ``TRITON_INTERPRET=1`` (tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def stable_tanh(z):
    """tanh from exp(−2|z|) ∈ (0, 1]: no overflow for any z."""
    e = tl.exp(-2.0 * tl.abs(z))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(z >= 0, t, -t)


@triton.jit
def stable_sigmoid(z):
    """sigmoid from exp(−|z|) ∈ (0, 1]: no overflow for any z."""
    e = tl.exp(-tl.abs(z))
    return tl.where(z >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


@triton.jit
def situ_glu_math(gate, up, beta1, beta2):
    """SiTU-GLU of fp32 tiles (shared with the MoE kernel's epilogue)."""
    return beta1 * stable_tanh(gate / beta1) * stable_sigmoid(gate) * (beta2 * stable_tanh(up / beta2))


@triton.jit
def situ_glu_grads(gate, up, dy, beta1, beta2):
    """(d gate, d up) of SiTU-GLU for fp32 tiles.

    The derivatives use cancellation-free forms: 1 − tanh²(z) = 4e/(1+e)² with e = exp(−2|z|), and
    σ(z)(1 − σ(z)) = e/(1+e)² with e = exp(−|z|).
    """
    a = beta1 * stable_tanh(gate / beta1)
    s = stable_sigmoid(gate)
    b = beta2 * stable_tanh(up / beta2)
    e1 = tl.exp(-2.0 * tl.abs(gate / beta1))
    d_tanh1 = 4.0 * e1 / ((1.0 + e1) * (1.0 + e1))
    es = tl.exp(-tl.abs(gate))
    d_sigmoid = es / ((1.0 + es) * (1.0 + es))
    e2 = tl.exp(-2.0 * tl.abs(up / beta2))
    d_tanh2 = 4.0 * e2 / ((1.0 + e2) * (1.0 + e2))
    d_gate = dy * b * (d_tanh1 * s + a * d_sigmoid)
    d_up = dy * a * s * d_tanh2
    return d_gate, d_up


@triton.jit
def _situ_glu_fwd_kernel(gate_ptr, up_ptr, y_ptr, n, beta1, beta2, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    gate = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = situ_glu_math(gate, up, beta1, beta2)
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _situ_glu_bwd_kernel(gate_ptr, up_ptr, dy_ptr, dgate_ptr, dup_ptr, n, beta1, beta2, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    gate = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    d_gate, d_up = situ_glu_grads(gate, up, dy, beta1, beta2)
    tl.store(dgate_ptr + offs, d_gate.to(dgate_ptr.dtype.element_ty), mask=mask)
    tl.store(dup_ptr + offs, d_up.to(dup_ptr.dtype.element_ty), mask=mask)


def situ_glu_forward(gate: torch.Tensor, up: torch.Tensor, beta1: float, beta2: float) -> torch.Tensor:
    """Launch the forward kernel on contiguous tensors of one shape."""
    y = torch.empty_like(gate)
    n = gate.numel()
    if n:
        _situ_glu_fwd_kernel[(triton.cdiv(n, BLOCK),)](
            gate, up, y, n, float(beta1), float(beta2), BLOCK=BLOCK
        )
    return y


def situ_glu_backward(gate, up, dy, beta1: float, beta2: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the backward kernel; returns (d gate, d up) in the dtypes of gate and up."""
    d_gate, d_up = torch.empty_like(gate), torch.empty_like(up)
    n = gate.numel()
    if n:
        _situ_glu_bwd_kernel[(triton.cdiv(n, BLOCK),)](
            gate, up, dy, d_gate, d_up, n, float(beta1), float(beta2), BLOCK=BLOCK
        )
    return d_gate, d_up


class SiTUGLUFunction(torch.autograd.Function):
    """Fused SiTU-GLU with a fused backward; saves only the two pre-activations."""

    @staticmethod
    def forward(ctx, gate, up, beta1, beta2):
        gate, up = gate.contiguous(), up.contiguous()
        ctx.save_for_backward(gate, up)
        ctx.betas = (beta1, beta2)
        return situ_glu_forward(gate, up, beta1, beta2)

    @staticmethod
    def backward(ctx, dy):
        gate, up = ctx.saved_tensors
        d_gate, d_up = situ_glu_backward(gate, up, dy.contiguous(), *ctx.betas)
        return d_gate, d_up, None, None


def situ_glu_triton(
    gate: torch.Tensor, up: torch.Tensor, beta1: float = 4.0, beta2: float = 25.0
) -> torch.Tensor:
    """SiTU-GLU through the fused Triton kernels (autograd-capable)."""
    if gate.shape != up.shape:
        raise ValueError(
            f"situ_glu: gate and up must have the same shape; got {tuple(gate.shape)} and {tuple(up.shape)}"
        )
    if gate.dtype != up.dtype:
        up = up.to(gate.dtype)
    return SiTUGLUFunction.apply(gate, up, float(beta1), float(beta2))
