"""KDA (Kimi Delta Attention) layer: short convs, L2-norm, bounded gate, delta rule, head norm, out gate.

Both K3's bounded gate and Kimi-Linear's (``gate_lower_bound: null``); padding is a no-op for the
recurrence (zeroed input, g = 0, beta = 0), so a padded sequence computes as a shorter one.

Design: docs/design/model.md#model-kda.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from kernels import chunk_kda, fused_recurrent_kda
from model.cache import KDALayerCache
from model.config import K3Config
from model.norm import GatedRMSNorm, l2_normalize


class ShortConv(nn.Conv1d):
    """Causal depthwise conv (kernel K, no bias) + SiLU over [B, T, C]; weight [C, 1, K] as on disk."""

    def __init__(self, channels: int, kernel_size: int) -> None:
        super().__init__(channels, channels, kernel_size, groups=channels, bias=False)

    def forward(self, x: torch.Tensor, tail: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, C], tail [B, C, K-1] (previous inputs; None = zeros) -> (SiLU(conv) [B, T, C], tail)."""
        k = self.kernel_size[0]
        xt = x.transpose(1, 2)  # [B, C, T]
        if tail is None:
            tail = xt.new_zeros(xt.shape[0], xt.shape[1], k - 1)
        full = torch.cat([tail.to(xt.dtype), xt], dim=-1)
        out = F.conv1d(full, self.weight, groups=self.groups)
        return F.silu(out).transpose(1, 2), full[..., full.shape[-1] - (k - 1) :]


class KimiDeltaAttention(nn.Module):
    """One KDA attention block, named as Moonshot's checkpoints (`self_attn.` of a KDA layer)."""

    def __init__(self, cfg: K3Config, layer_idx: int) -> None:
        super().__init__()
        lac = cfg.linear_attn_config
        d, self.num_heads, self.head_dim = cfg.hidden_size, lac.num_heads, lac.head_dim
        c = self.num_heads * self.head_dim
        self.layer_idx = layer_idx
        self.lower_bound = lac.gate_lower_bound
        self.q_proj = nn.Linear(d, c, bias=False)
        self.k_proj = nn.Linear(d, c, bias=False)
        self.v_proj = nn.Linear(d, c, bias=False)
        self.q_conv1d = ShortConv(c, lac.short_conv_kernel_size)
        self.k_conv1d = ShortConv(c, lac.short_conv_kernel_size)
        self.v_conv1d = ShortConv(c, lac.short_conv_kernel_size)
        self.A_log = nn.Parameter(torch.zeros(self.num_heads))
        self.dt_bias = nn.Parameter(torch.zeros(c, dtype=torch.float32))
        self.f_a_proj = nn.Linear(d, self.head_dim, bias=False)
        self.f_b_proj = nn.Linear(self.head_dim, c, bias=False)
        self.b_proj = nn.Linear(d, self.num_heads, bias=False)
        if lac.use_full_rank_gate:
            self.g_proj = nn.Linear(d, c, bias=False)
        else:
            self.g_a_proj = nn.Linear(d, self.head_dim, bias=False)
            self.g_b_proj = nn.Linear(self.head_dim, c, bias=False)
        self.o_norm = GatedRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.o_proj = nn.Linear(c, d, bias=False)

    @torch.no_grad()
    def reset_gate_parameters(self) -> None:
        """A_log: 0 for the K3 gate (A_h init 0), log U(1, 16) for Kimi-Linear's; dt_bias: inverse softplus
        of dt ~ logU(1e-3, 1e-1) (Mamba2/GDN init) in both cases."""
        if self.lower_bound is None:
            self.A_log.copy_(torch.empty_like(self.A_log).uniform_(1.0, 16.0).log())
        else:
            self.A_log.zero_()
        dt = torch.empty_like(self.dt_bias).uniform_(math.log(1e-3), math.log(1e-1)).exp().clamp_min(1e-4)
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))

    def decay(self, x: torch.Tensor) -> torch.Tensor:
        """Per-channel log decay g [B, T, H, dk] (fp32, <= 0)."""
        z = self.f_b_proj(self.f_a_proj(x)).float() + self.dt_bias.float()
        z = z.unflatten(-1, (self.num_heads, self.head_dim))
        a = self.A_log.float().exp().view(self.num_heads, 1)
        if self.lower_bound is None:
            return -a * F.softplus(z, threshold=20.0)
        return self.lower_bound * torch.sigmoid(a * z)

    def output_gate(self, x: torch.Tensor) -> torch.Tensor:
        pre = self.g_proj(x) if hasattr(self, "g_proj") else self.g_b_proj(self.g_a_proj(x))
        return pre.unflatten(-1, (self.num_heads, self.head_dim))

    def short_convs(
        self, x: torch.Tensor, tails: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """(q, k, v [B, T, C] after projection, short conv and SiLU; the new conv tails "q"/"k"/"v"
        [B, C, kernel-1]); ``tails`` holds the previous ones (missing = zeros: a fresh sequence)."""
        q, tq = self.q_conv1d(self.q_proj(x), tails.get("q"))
        k, tk = self.k_conv1d(self.k_proj(x), tails.get("k"))
        v, tv = self.v_conv1d(self.v_proj(x), tails.get("v"))
        return q, k, v, {"q": tq, "k": tk, "v": tv}

    def kernel_inputs(
        self, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The KDA kernel's (q, k, v [B, T, H, d] with q, k L2-normalised; g [B, T, H, dk]; beta [B, T, H])
        from the layer input x [B, T, d] and the conv outputs."""
        heads = (self.num_heads, self.head_dim)
        q = l2_normalize(q.unflatten(-1, heads))
        k = l2_normalize(k.unflatten(-1, heads))
        return q, k, v.unflatten(-1, heads), self.decay(x), torch.sigmoid(self.b_proj(x).float())

    def output(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The kernel output o [B, T, H, dv] -> y [B, T, d]: gated head norm, then o_proj."""
        return self.o_proj(self.o_norm(o, self.output_gate(x)).flatten(-2))

    def forward(
        self, x: torch.Tensor, valid: torch.Tensor | None = None, cache: KDALayerCache | None = None
    ) -> torch.Tensor:
        """x [B, T, d]; valid [B, T] bool (None = no padding); cache updated in place when given."""
        if valid is not None:
            x = x * valid.unsqueeze(-1).to(x.dtype)
        q, k, v, tails = self.short_convs(x, cache.conv_tails if cache is not None else {})
        q, k, v, g, beta = self.kernel_inputs(x, q, k, v)
        if valid is not None:
            g = g * valid.unsqueeze(-1).unsqueeze(-1)
            beta = beta * valid.unsqueeze(-1)
        state = cache.state if cache is not None else None
        kernel = fused_recurrent_kda if cache is not None and x.shape[1] == 1 else chunk_kda
        o, final = kernel(q, k, v, g, beta, initial_state=state, output_final_state=cache is not None)
        if cache is not None:
            cache.state = final
            cache.conv_tails = tails
        return self.output(o, x)
