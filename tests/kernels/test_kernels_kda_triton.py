"""The Triton KDA kernels (run by Triton's interpreter on CPU) match the token-by-token recurrence.

Oracle: ``naive_recurrent_kda`` in fp64. Kernels compute in fp32 from fp32 inputs; tolerance
``FP32_TOL`` relative to each tensor's scale (``max|err| ≤ tol·max(1, max|ref|)``). bf16 inputs are
checked against the fp64 oracle of the bf16-rounded inputs at ``BF16_TOL``.
"""

from __future__ import annotations

import pytest
import torch
from kernels_testutil import assert_close_scaled, kda_outputs_and_grads, make_kda_inputs

import kernels
from kernels.kda.chunk import chunk_kda_triton
from kernels.kda.fused_recurrent import fused_recurrent_kda_triton
from kernels.kda.reference import naive_recurrent_kda

pytestmark = pytest.mark.usefixtures("triton_interpreter")

FP32_TOL = 2e-5
BF16_TOL = 2e-2


def _oracle(inputs: dict, **kwargs):
    as64 = {n: (t.double() if t is not None else None) for n, t in inputs.items()}
    return kda_outputs_and_grads(naive_recurrent_kda, as64, **kwargs)


@pytest.mark.parametrize(
    ("B", "T", "H", "K", "V", "with_state"),
    [
        (1, 1, 1, 16, 16, True),  # a single token
        (2, 37, 2, 16, 32, True),  # one partial chunk, K ≠ V
        (1, 64, 1, 32, 16, False),  # exactly one chunk, no initial state
        (1, 130, 1, 16, 16, True),  # three chunks, state carried, partial last chunk
        (1, 70, 1, 128, 64, True),  # K3's head dim: the state passes work in two value blocks of 32
    ],
)
def test_chunk_triton_matches_recurrence_forward_and_backward(B, T, H, K, V, with_state) -> None:
    x = make_kda_inputs(B, T, H, K, V, with_state=with_state, seed=T)
    o, final, grads = kda_outputs_and_grads(chunk_kda_triton, x)
    o_ref, final_ref, grads_ref = _oracle(x)
    assert o.dtype == torch.float32 and final.dtype == torch.float32
    assert_close_scaled(o, o_ref, FP32_TOL, "o")
    assert_close_scaled(final, final_ref, FP32_TOL, "final_state")
    for name, grad in grads_ref.items():
        assert_close_scaled(grads[name], grad, FP32_TOL, f"d{name}")


def test_chunk_triton_varlen_matches_recurrence() -> None:
    """Packed sequences of 1, 69, 0 and 33 tokens: states never leak across sequences."""
    cu = torch.tensor([0, 1, 70, 70, 103])
    x = make_kda_inputs(1, 103, 2, 16, 16, n_states=4, seed=7)
    o, final, grads = kda_outputs_and_grads(chunk_kda_triton, x, cu_seqlens=cu)
    o_ref, final_ref, grads_ref = _oracle(x, cu_seqlens=cu)
    assert final.shape == (4, 2, 16, 16)
    assert_close_scaled(o, o_ref, FP32_TOL, "o")
    assert_close_scaled(final, final_ref, FP32_TOL, "final_state")
    for name, grad in grads_ref.items():
        assert_close_scaled(grads[name], grad, FP32_TOL, f"d{name}")


def test_chunk_triton_without_final_state_and_unbounded_decay() -> None:
    """Kimi-Linear's gate has no lower bound: in-chunk cumulative decay far below exp's range stays finite."""
    x = make_kda_inputs(1, 80, 1, 16, 16, g_min=-60.0, seed=3)
    o, final, grads = kda_outputs_and_grads(chunk_kda_triton, x, output_final_state=False)
    o_ref, _, grads_ref = _oracle(x, output_final_state=False)
    assert final is None
    assert_close_scaled(o, o_ref, FP32_TOL, "o")
    for name, grad in grads_ref.items():
        assert torch.isfinite(grads[name]).all(), name
        assert_close_scaled(grads[name], grad, FP32_TOL, f"d{name}")


def test_chunk_triton_bf16_inputs_give_bf16_output() -> None:
    x = make_kda_inputs(1, 40, 1, 16, 16, dtype=torch.bfloat16, seed=5)
    x["initial_state"] = x["initial_state"].float()
    o, final = chunk_kda_triton(**x, output_final_state=True)
    o_ref, final_ref = naive_recurrent_kda(**{n: t.double() for n, t in x.items()}, output_final_state=True)
    assert o.dtype == torch.bfloat16 and final.dtype == torch.float32
    assert_close_scaled(o, o_ref, BF16_TOL, "o")
    assert_close_scaled(final, final_ref, FP32_TOL, "final_state")


@pytest.mark.parametrize(("T", "cu"), [(1, None), (21, None), (12, [0, 5, 5, 12])])
def test_fused_recurrent_triton_matches_recurrence(T, cu) -> None:
    cu_seqlens = torch.tensor(cu) if cu is not None else None
    B = 2 if cu is None else 1
    x = make_kda_inputs(B, T, 2, 16, 24, n_states=(len(cu) - 1) if cu else None, seed=T)
    with torch.no_grad():
        o, final = fused_recurrent_kda_triton(**x, output_final_state=True, cu_seqlens=cu_seqlens)
    o_ref, final_ref = naive_recurrent_kda(
        **{n: t.double() for n, t in x.items()}, output_final_state=True, cu_seqlens=cu_seqlens
    )
    assert_close_scaled(o, o_ref, FP32_TOL, "o")
    assert_close_scaled(final, final_ref, FP32_TOL, "final_state")


def test_decode_steps_continue_a_chunked_prefill() -> None:
    """Prefill 40 tokens with the chunk kernel, decode 3 more one at a time: equals one pass over 43."""
    x = make_kda_inputs(1, 43, 1, 16, 16, seed=11)
    with torch.no_grad():
        o_full, final_full = naive_recurrent_kda(**x, output_final_state=True)
        prefix = {n: (t[:, :40] if n != "initial_state" else t) for n, t in x.items()}
        o_pre, state = chunk_kda_triton(**prefix, output_final_state=True)
        steps = [o_pre]
        for t in range(40, 43):
            token = {n: x[n][:, t : t + 1] for n in ("q", "k", "v", "g", "beta")}
            o_t, state = fused_recurrent_kda_triton(**token, initial_state=state, output_final_state=True)
            steps.append(o_t)
    assert_close_scaled(torch.cat(steps, dim=1), o_full, FP32_TOL, "o")
    assert_close_scaled(state, final_full, FP32_TOL, "final_state")


def test_dispatch_honours_k3_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    x = make_kda_inputs(1, 5, 1, 16, 16)
    monkeypatch.setenv("K3_KERNELS", "triton")
    o_triton, _ = kernels.chunk_kda(**x)
    monkeypatch.setenv("K3_KERNELS", "reference")
    o_ref, _ = kernels.chunk_kda(**x)
    assert_close_scaled(o_triton, o_ref, FP32_TOL, "o")
    monkeypatch.setenv("K3_KERNELS", "cuda-please")
    with pytest.raises(ValueError, match="K3_KERNELS"):
        kernels.chunk_kda(**x)


def test_triton_rejects_unsupported_head_dim() -> None:
    x = make_kda_inputs(1, 4, 1, 12, 16)
    with pytest.raises(ValueError, match="power of two"):
        chunk_kda_triton(**x)
