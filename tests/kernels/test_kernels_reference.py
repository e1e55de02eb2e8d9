"""The PyTorch references agree with each other and with first principles (no Triton involved)."""

from __future__ import annotations

import pytest
import torch
from kernels_testutil import make_kda_inputs

from kernels.kda.reference import chunk_kda_reference, kda_step, naive_recurrent_kda
from kernels.moe.reference import moe_experts_reference
from kernels.situ_glu import situ_glu_reference

# fp32 chunked vs token-by-token: the bound.
FP32_TOL = 1e-5


@pytest.mark.parametrize(
    ("T", "with_state", "chunk_size"),  # 64: the Triton kernels' chunk; 32: what the CPU dispatch runs
    [(1, True, 64), (15, False, 64), (64, True, 64), (65, False, 64), (130, True, 64), (512, True, 64)]
    + [(600, False, 64)]  # 600: two groups of 8 chunks
    + [(1, True, 32), (33, False, 32), (130, True, 32), (512, False, 32)],
)
def test_chunked_reference_matches_recurrence_fp32(T: int, with_state: bool, chunk_size: int) -> None:
    x = make_kda_inputs(2, T, 2, 16, 32, with_state=with_state, seed=T)
    o_ref, s_ref = naive_recurrent_kda(**x, output_final_state=True)
    o, s = chunk_kda_reference(**x, output_final_state=True, chunk_size=chunk_size)
    assert o.dtype == torch.float32 and s.dtype == torch.float32
    torch.testing.assert_close(o, o_ref, atol=FP32_TOL, rtol=FP32_TOL)
    torch.testing.assert_close(s, s_ref, atol=FP32_TOL, rtol=FP32_TOL)


def test_chunked_reference_survives_unbounded_decay() -> None:
    """Kimi-Linear's gate is unbounded below: in-chunk cumulative decay reaches −3000, past exp's range."""
    x = make_kda_inputs(1, 128, 2, 16, 16, g_min=-50.0)
    o_ref, s_ref = naive_recurrent_kda(**x, output_final_state=True)
    o, s = chunk_kda_reference(**x, output_final_state=True)
    assert torch.isfinite(o).all()
    torch.testing.assert_close(o, o_ref, atol=FP32_TOL, rtol=FP32_TOL)
    torch.testing.assert_close(s, s_ref, atol=FP32_TOL, rtol=FP32_TOL)


def test_state_carried_across_calls_equals_one_call() -> None:
    x = make_kda_inputs(1, 150, 2, 16, 16)
    o_full, s_full = chunk_kda_reference(**x, output_final_state=True)
    first = {n: (t[:, :70] if t is not None and n != "initial_state" else t) for n, t in x.items()}
    o1, s1 = chunk_kda_reference(**first, output_final_state=True)
    second = {n: t[:, 70:] for n, t in x.items() if n != "initial_state"}
    o2, s2 = chunk_kda_reference(**second, initial_state=s1, output_final_state=True)
    torch.testing.assert_close(torch.cat([o1, o2], dim=1), o_full, atol=FP32_TOL, rtol=FP32_TOL)
    torch.testing.assert_close(s2, s_full, atol=FP32_TOL, rtol=FP32_TOL)


def test_varlen_equals_separate_sequences() -> None:
    lengths = [1, 70, 33]
    x = make_kda_inputs(1, sum(lengths), 2, 16, 16, n_states=len(lengths))
    cu = torch.tensor([0, 1, 71, 104])
    o, s = chunk_kda_reference(**x, output_final_state=True, cu_seqlens=cu)
    for n, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)):
        part = {name: t[:, a:b] for name, t in x.items() if name != "initial_state"}
        o_n, s_n = naive_recurrent_kda(
            **part, initial_state=x["initial_state"][n : n + 1], output_final_state=True
        )
        torch.testing.assert_close(o[:, a:b], o_n, atol=FP32_TOL, rtol=FP32_TOL)
        torch.testing.assert_close(s[n : n + 1], s_n, atol=FP32_TOL, rtol=FP32_TOL)


@pytest.mark.parametrize("g_min", [-5.0, -50.0])  # factored fast path; overflow-free pairwise path
def test_chunked_reference_gradients_match_recurrence(g_min: float) -> None:
    x = make_kda_inputs(1, 80, 2, 8, 8, dtype=torch.float64, g_min=g_min)
    grads = []
    for fn in (naive_recurrent_kda, chunk_kda_reference):
        leaves = {n: t.clone().requires_grad_(True) for n, t in x.items()}
        o, s = fn(**leaves, output_final_state=True)
        (o.sin().sum() + (s * s).sum()).backward()
        grads.append({n: t.grad for n, t in leaves.items()})
    for name in x:
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=1e-9, rtol=1e-9, msg=name)


def test_step_is_the_written_recurrence() -> None:
    """One step by hand: S ← S⊙exp(g); S ← S + β k (v − Sᵀk)ᵀ; o = Sᵀ(scale·q)."""
    K, V = 3, 2
    q, k, g = torch.tensor([[[1.0, 0.0, 0.0]]]), torch.tensor([[[0.0, 1.0, 0.0]]]), torch.zeros(1, 1, K)
    g[..., 1] = torch.log(torch.tensor(0.5))
    v, beta = torch.tensor([[[2.0, 4.0]]]), torch.tensor([[0.5]])
    S = torch.ones(1, 1, K, V)
    o, S1 = kda_step(q, k, v, g, beta, S, scale=1.0)
    # row 1 of S decays to 0.5, predicted v̂ = [0.5, 0.5]; update adds 0.5 * [1.5, 3.5] to row 1
    torch.testing.assert_close(S1[0, 0, 1], torch.tensor([1.25, 2.25]))
    torch.testing.assert_close(o[0, 0], torch.tensor([1.0, 1.0]))


def test_bad_shapes_name_the_argument() -> None:
    x = make_kda_inputs(1, 4, 2, 8, 8)
    x["beta"] = x["beta"][..., :1]
    with pytest.raises(ValueError, match="beta"):
        chunk_kda_reference(**x)


def test_situ_glu_is_bounded_with_finite_gradients() -> None:
    z = torch.tensor([-1e4, -50.0, -1.0, 0.0, 1.0, 50.0, 1e4], dtype=torch.float32)
    gate, up = torch.meshgrid(z, z, indexing="ij")
    gate, up = gate.clone().requires_grad_(True), up.clone().requires_grad_(True)
    y = situ_glu_reference(gate, up)
    assert (y.abs() <= 4.0 * 25.0).all()
    y.sum().backward()
    assert torch.isfinite(gate.grad).all() and torch.isfinite(up.grad).all()
    # near 0 it is SwiGLU: gate·sigmoid(gate)·up
    small = torch.tensor([0.01])
    torch.testing.assert_close(
        situ_glu_reference(small, small), small * torch.sigmoid(small) * small, rtol=1e-4, atol=0
    )


def test_moe_loop_equals_dense_mixture() -> None:
    gen = torch.Generator().manual_seed(0)
    M, L, I, E, topk = 10, 8, 12, 4, 2
    x = torch.randn(M, L, generator=gen)
    w_gate, w_up = torch.randn(E, I, L, generator=gen), torch.randn(E, I, L, generator=gen)
    w_down = torch.randn(E, L, I, generator=gen)
    ids = torch.stack([torch.randperm(E, generator=gen)[:topk] for _ in range(M)])
    weights = torch.rand(M, topk, generator=gen)
    y = moe_experts_reference(x, ids, weights, w_gate, w_up, w_down)
    # every expert on every token, then pick: an independent formulation
    h = situ_glu_reference(torch.einsum("eil,ml->mei", w_gate, x), torch.einsum("eil,ml->mei", w_up, x))
    all_out = torch.einsum("eli,mei->mel", w_down, h)
    expected = (all_out.gather(1, ids[..., None].expand(M, topk, L)) * weights[..., None]).sum(1)
    torch.testing.assert_close(y, expected, atol=1e-4, rtol=1e-5)
