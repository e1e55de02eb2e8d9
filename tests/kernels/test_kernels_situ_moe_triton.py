"""Fused SiTU-GLU and the grouped-GEMM MoE (Triton interpreter on CPU) match their PyTorch references.

Tolerances: fp32 kernels vs fp32 references at ``FP32_TOL`` relative to each tensor's scale (the
grouped GEMM sums in a different order from the per-expert loop).
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from kernels_testutil import assert_close_scaled

import kernels
from kernels.moe.grouped import moe_experts_triton
from kernels.moe.reference import moe_experts_reference
from kernels.situ_glu import situ_glu_reference
from kernels.situ_glu_triton import situ_glu_triton

pytestmark = pytest.mark.usefixtures("triton_interpreter")

FP32_TOL = 2e-6
MOE_TOL = 1e-5


def _grads(fn, *tensors, **kwargs):
    leaves = [t.clone().requires_grad_(True) for t in tensors]
    y = fn(*leaves, **kwargs)
    upstream = torch.arange(y.numel(), dtype=torch.float32).reshape(y.shape).cos()  # a fixed dL/dy
    (y.float() * upstream).sum().backward()
    return y, [t.grad for t in leaves]


def test_situ_glu_triton_matches_reference_including_extremes() -> None:
    z = torch.tensor([-1e4, -300.0, -30.0, -3.0, -0.1, 0.0, 0.1, 3.0, 30.0, 300.0, 1e4])
    gate, up = (t.reshape(-1) for t in torch.meshgrid(z, z, indexing="ij"))
    gen = torch.Generator().manual_seed(0)
    gate = torch.cat([gate, 6 * torch.randn(3000, generator=gen)])  # > one block, not a multiple
    up = torch.cat([up, 40 * torch.randn(3000, generator=gen)])
    y, (dg, du) = _grads(situ_glu_triton, gate, up)
    y_ref, (dg_ref, du_ref) = _grads(situ_glu_reference, gate, up)
    assert y.abs().max() <= 4.0 * 25.0
    assert torch.isfinite(dg).all() and torch.isfinite(du).all()
    assert_close_scaled(y, y_ref, FP32_TOL, "y")
    assert_close_scaled(dg, dg_ref, FP32_TOL, "d gate")
    assert_close_scaled(du, du_ref, FP32_TOL, "d up")


def test_situ_glu_triton_keeps_dtype_and_custom_betas() -> None:
    gen = torch.Generator().manual_seed(1)
    gate = (5 * torch.randn(7, 33, generator=gen)).bfloat16()
    up = (5 * torch.randn(7, 33, generator=gen)).bfloat16()
    y = situ_glu_triton(gate, up, beta1=2.0, beta2=3.0)
    assert y.dtype == torch.bfloat16 and y.shape == (7, 33)
    assert y.float().abs().max() <= 6.0
    assert_close_scaled(y, situ_glu_reference(gate, up, 2.0, 3.0), 1e-2, "y")


def _moe_case(M: int, L: int, I: int, E: int, top_k: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M, L, generator=gen)
    w_gate = 0.3 * torch.randn(E, I, L, generator=gen)
    w_up = 0.3 * torch.randn(E, I, L, generator=gen)
    w_down = 0.3 * torch.randn(E, L, I, generator=gen)
    # the last expert receives no token; expert 0 gets more than one 64-row tile when M is large
    ids = torch.stack([torch.randperm(E - 1, generator=gen)[:top_k] for _ in range(M)])
    ids[: M // 2, 0] = 0
    ids[: M // 2, 1:] = torch.randint(1, E - 1, (M // 2, top_k - 1), generator=gen)
    weights = torch.rand(M, top_k, generator=gen)
    return x, ids, weights, w_gate, w_up, w_down


@pytest.mark.parametrize(
    ("M", "L", "I", "E", "top_k"), [(1, 16, 16, 3, 2), (9, 24, 40, 5, 2), (150, 16, 32, 4, 3)]
)
def test_grouped_moe_matches_expert_loop_forward_and_backward(M, L, I, E, top_k) -> None:
    x, ids, weights, w_gate, w_up, w_down = _moe_case(M, L, I, E, top_k, seed=M)

    def run(fn, x, weights, w_gate, w_up, w_down):
        return fn(x, ids, weights, w_gate, w_up, w_down)

    y, grads = _grads(lambda *t: run(moe_experts_triton, *t), x, weights, w_gate, w_up, w_down)
    y_ref, grads_ref = _grads(lambda *t: run(moe_experts_reference, *t), x, weights, w_gate, w_up, w_down)
    assert_close_scaled(y, y_ref, MOE_TOL, "y")
    for name, g, g_ref in zip(["x", "weights", "w_gate", "w_up", "w_down"], grads, grads_ref, strict=True):
        assert_close_scaled(g, g_ref, MOE_TOL, f"d{name}")
    assert (grads[4][E - 1] == 0).all(), "an expert without tokens gets a zero gradient"


def test_moe_dispatch_and_bad_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    x, ids, weights, w_gate, w_up, w_down = _moe_case(6, 16, 16, 3, 2, seed=0)
    monkeypatch.setenv("K3_KERNELS", "triton")
    y = kernels.moe_experts(x, ids, weights, w_gate, w_up, w_down)
    assert_close_scaled(y, moe_experts_reference(x, ids, weights, w_gate, w_up, w_down), MOE_TOL, "y")
    with pytest.raises(ValueError, match="expert_ids"):
        kernels.moe_experts(x, ids + 5, weights, w_gate, w_up, w_down)


@triton.jit
def _bf16_dot_probe(a_ptr, b_ptr, c_ptr, N: tl.constexpr):
    r = tl.arange(0, N)
    offs = r[:, None] * N + r[None, :]
    tl.store(c_ptr + offs, tl.dot(tl.load(a_ptr + offs), tl.load(b_ptr + offs)))


def _bf16_dot_is_right() -> bool:
    """Triton 3.9's interpreter returns garbage for bf16 ``tl.dot`` (a 16×16 product is off by ~1e10)."""
    a, b = torch.eye(16).bfloat16(), torch.arange(256.0).reshape(16, 16).bfloat16()
    c = torch.empty(16, 16)
    _bf16_dot_probe[(1,)](a, b, c, N=16)
    return torch.equal(c, b.float())


def test_grouped_moe_bf16_matches_expert_loop() -> None:
    if not _bf16_dot_is_right():
        pytest.skip("the Triton interpreter gets bf16 tl.dot wrong; bench/kernels.py checks bf16 on GPU")
    x, ids, weights, w_gate, w_up, w_down = (
        t.bfloat16() if t.is_floating_point() else t for t in _moe_case(40, 32, 48, 4, 2, seed=3)
    )
    y = moe_experts_triton(x, ids, weights, w_gate, w_up, w_down)
    assert y.dtype == torch.bfloat16
    assert_close_scaled(y, moe_experts_reference(x, ids, weights, w_gate, w_up, w_down), 2e-2, "y")
