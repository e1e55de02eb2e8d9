"""Gated FFNs: SiTU-GLU (K3, bounded) or SwiGLU (ablation / Kimi-Linear), the dense and shared-expert MLP.

SiTU-GLU(x) = softcap(W_g x, beta1) * sigmoid(W_g x) * softcap(W_u x, beta2), softcap(z, b) = b*tanh(z/b),
so |SiTU-GLU| <= beta1*beta2 (= 100 with K3's 4 and 25). The activation itself is `kernels.situ_glu`
(fp32 inside, Triton on CUDA); `model.situ_glu` re-exports it.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from kernels import situ_glu
from model.config import K3Config

GluActivation = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

__all__ = ["situ_glu", "swiglu", "glu_activation", "GatedFFN"]


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU: silu(gate) * up (the unbounded activation SiTU-GLU replaces)."""
    return F.silu(gate) * up


def glu_activation(cfg: K3Config) -> GluActivation:
    """The (gate, up) -> activation function `cfg.hidden_act` selects."""
    if cfg.hidden_act == "situ":
        return partial(situ_glu, beta1=cfg.activation_situ_beta, beta2=cfg.activation_situ_linear_beta)
    return swiglu


class GatedFFN(nn.Module):
    """`down_proj(act(gate_proj x, up_proj x))`: the dense first-layer FFN and the shared experts."""

    def __init__(self, width: int, intermediate: int, activation: GluActivation) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(width, intermediate, bias=False)
        self.up_proj = nn.Linear(width, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, width, bias=False)
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.activation(self.gate_proj(x), self.up_proj(x)))
