"""Random KDA inputs shaped as the layer produces them (q, k L2-normalised, g ≤ 0, β ∈ (0, 1))."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def make_kda_inputs(
    B: int,
    T: int,
    H: int,
    K: int,
    V: int,
    *,
    dtype=torch.float32,
    g_min: float = -5.0,
    seed: int = 0,
    with_state: bool = True,
    n_states: int | None = None,
) -> dict[str, torch.Tensor | None]:
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, K, generator=gen, dtype=torch.float64), dim=-1)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen, dtype=torch.float64), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen, dtype=torch.float64)
    g = g_min * torch.rand(B, T, H, K, generator=gen, dtype=torch.float64)
    beta = torch.rand(B, T, H, generator=gen, dtype=torch.float64)
    h0 = torch.randn(n_states or B, H, K, V, generator=gen, dtype=torch.float64) if with_state else None
    out = {"q": q, "k": k, "v": v, "g": g, "beta": beta}
    out = {name: x.to(dtype) for name, x in out.items()}
    out["initial_state"] = h0.to(dtype) if h0 is not None else None
    return out


def assert_close_scaled(actual: torch.Tensor, expected: torch.Tensor, tol: float, name: str = "") -> None:
    """max |actual − expected| ≤ tol · max(1, max |expected|): a tolerance relative to the tensor's scale."""
    expected = expected.to(torch.float64)
    err = (actual.to(torch.float64) - expected).abs().max().item() if expected.numel() else 0.0
    bound = tol * max(1.0, expected.abs().max().item() if expected.numel() else 0.0)
    assert err <= bound, f"{name}: max error {err:.3e} exceeds {bound:.3e}"


def kda_outputs_and_grads(fn, inputs: dict, output_final_state: bool = True, **kwargs):
    """Run ``fn`` on leaf copies of ``inputs`` and backpropagate a loss touching o and the final state."""
    leaves = {n: (t.clone().requires_grad_(True) if t is not None else None) for n, t in inputs.items()}
    o, final = fn(**leaves, output_final_state=output_final_state, **kwargs)
    loss = (o.float() * torch.linspace(-1, 1, o.shape[-1], dtype=torch.float32)).sin().sum()
    if final is not None:
        loss = loss + (final * final).sum()
    loss.backward()
    grads = {n: t.grad for n, t in leaves.items() if t is not None}
    return o, final, grads
