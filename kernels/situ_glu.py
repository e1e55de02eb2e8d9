"""SiTU-GLU, the bounded gated activation of K3's FFNs.

``softcap(z, β) = β·tanh(z/β)``; ``situ_glu(gate, up) = softcap(gate, β₁)·sigmoid(gate)·softcap(up, β₂)``,
so ``|situ_glu| ≤ β₁·β₂`` for every input. Computed in fp32, returned in the input dtype.

This module holds the PyTorch reference and the dispatch; the fused Triton forward/backward lives in
``kernels.situ_glu_triton`` (imported only when used, so that ``TRITON_INTERPRET`` set by a test
before that import takes effect).
"""

from __future__ import annotations

import torch

from kernels.dispatch import use_triton


def situ_glu_reference(
    gate: torch.Tensor, up: torch.Tensor, beta1: float = 4.0, beta2: float = 25.0
) -> torch.Tensor:
    """PyTorch SiTU-GLU (autograd through torch's overflow-safe tanh and sigmoid)."""
    if gate.shape != up.shape:
        raise ValueError(
            f"situ_glu: gate and up must have the same shape; got {tuple(gate.shape)} and {tuple(up.shape)}"
        )
    gf, uf = gate.float(), up.float()
    out = beta1 * torch.tanh(gf / beta1) * torch.sigmoid(gf) * (beta2 * torch.tanh(uf / beta2))
    return out.to(gate.dtype)


def situ_glu(gate: torch.Tensor, up: torch.Tensor, beta1: float = 4.0, beta2: float = 25.0) -> torch.Tensor:
    """SiTU-GLU of the two pre-activations: fused Triton kernel on CUDA, PyTorch elsewhere."""
    if use_triton(gate):
        from kernels.situ_glu_triton import situ_glu_triton

        return situ_glu_triton(gate, up, beta1, beta2)
    return situ_glu_reference(gate, up, beta1, beta2)
