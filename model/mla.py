"""Multi-head Latent Attention with NoPE (no rotary embedding anywhere) and K3's output gate.

The decode cache holds only the latents (c_kv and k_extra), and decoding runs the absorbed form as MQA on
that latent cache, so the cache per token stays small.

Design: docs/design/model.md#model-mla.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model.cache import MLALayerCache
from model.config import K3Config
from model.norm import RMSNorm

LATENT_NORM_EPS = 1e-6


class MultiHeadLatentAttention(nn.Module):
    """One NoPE MLA block, named as Moonshot's checkpoints (`self_attn.` of a full-attention layer)."""

    def __init__(self, cfg: K3Config, layer_idx: int) -> None:
        super().__init__()
        d, h = cfg.hidden_size, cfg.num_attention_heads
        self.layer_idx = layer_idx
        self.num_heads, self.nope, self.extra, self.v_dim = (
            h,
            cfg.qk_nope_head_dim,
            cfg.qk_rope_head_dim,
            cfg.v_head_dim,
        )
        self.kv_lora_rank = cfg.kv_lora_rank
        self.scale = cfg.mla_qk_head_dim**-0.5
        qk = cfg.mla_qk_head_dim
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(d, h * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(d, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, h * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, h * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.o_proj = nn.Linear(h * cfg.v_head_dim, d, bias=False)
        self.g_proj = nn.Linear(d, h * cfg.v_head_dim, bias=False) if cfg.mla_use_output_gate else None

    def queries(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, H, nope + extra]."""
        q = self.q_proj(x) if hasattr(self, "q_proj") else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        return q.unflatten(-1, (self.num_heads, -1))

    def latents(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(normalised c_kv [B, T, kv_lora], k_extra [B, T, rope]): what the cache stores."""
        c_kv, k_extra = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.extra], dim=-1)
        return self.kv_a_layernorm(c_kv), k_extra

    def forward(
        self,
        x: torch.Tensor,
        key_valid: torch.Tensor | None = None,
        cache: MLALayerCache | None = None,
    ) -> torch.Tensor:
        """x [B, T, d]; key_valid [B, S] bool over all keys (cached + new; None = no padding)."""
        B, T, _ = x.shape
        q = self.queries(x)
        c_kv, k_extra = self.latents(x)
        past = 0
        if cache is not None:
            past = cache.length
            latent = cache.append(c_kv, k_extra)  # [B, S, kv_lora + rope]
            c_kv, k_extra = latent[..., : self.kv_lora_rank], latent[..., self.kv_lora_rank :]
        mask = self._mask(B, T, past, key_valid, x.device)  # [B, 1, T, S] bool, True = attend
        if cache is not None and past > 0:
            o = self._attend_absorbed(q, latent, mask)
        else:
            o = self._attend_expanded(q, c_kv, k_extra, mask)
        return self.output(o, x)

    def output(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Per-head attention output o [B, T, H, v] -> y [B, T, d]: the sigmoid output gate, then o_proj."""
        o = o.flatten(-2)  # [B, T, H*v]
        if self.g_proj is not None:
            o = o * torch.sigmoid(self.g_proj(x))
        return self.o_proj(o)

    def _mask(self, B: int, T: int, past: int, key_valid: torch.Tensor | None, device) -> torch.Tensor:
        S = past + T
        qpos = torch.arange(past, S, device=device).unsqueeze(1)
        kpos = torch.arange(S, device=device).unsqueeze(0)
        causal = kpos <= qpos  # [T, S]
        if key_valid is None:
            return causal.expand(B, 1, T, S)
        # A padding query still attends to itself, so no softmax row is empty (its output is unused).
        allowed = causal & (key_valid[:, None, :] | (kpos == qpos))  # [B, T, S]
        return allowed.unsqueeze(1)

    def expanded_keys_values(
        self, c_kv: torch.Tensor, k_extra: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head keys [..., S, H, nope + extra] and values [..., S, H, v] from the latents
        c_kv [..., S, kv_lora] and k_extra [..., S, extra] (the shared extra dims copied to every head)."""
        kv = self.kv_b_proj(c_kv).unflatten(-1, (self.num_heads, self.nope + self.v_dim))
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        extra = k_extra.unsqueeze(-2).expand(*k_nope.shape[:-1], self.extra)
        return torch.cat([k_nope, extra], dim=-1), v

    def _attend_expanded(self, q, c_kv, k_extra, mask) -> torch.Tensor:
        """Standard form: expand per-head keys and values from the latent. q [B,T,H,qk] -> [B,T,H,v]."""
        k, v = self.expanded_keys_values(c_kv, k_extra)
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=self.scale
        )
        return o.transpose(1, 2)

    def _attend_absorbed(self, q, latent, mask) -> torch.Tensor:
        """Absorbed (MQA) form on the latent cache [B, S, kv_lora + rope]: q~ = W_UK^T q_nope;
        score = [q~; q_extra] . [c_kv; k_extra]; o = W_UV (softmax . c_kv)."""
        w = self.kv_b_proj.weight.unflatten(
            0, (self.num_heads, self.nope + self.v_dim)
        )  # [H, nope+v, kv_lora]
        w_uk, w_uv = w[:, : self.nope], w[:, self.nope :]
        q_nope, q_extra = q.split([self.nope, self.extra], dim=-1)
        q_lat = torch.einsum("bthn,hnc->bhtc", q_nope, w_uk)  # [B, H, T, kv_lora]
        query = torch.cat([q_lat, q_extra.transpose(1, 2)], dim=-1)
        key = latent.unsqueeze(1)  # [B, 1, S, kv_lora + rope]: one key head shared by all query heads
        scores = (query @ key.transpose(-1, -2)).float() * self.scale  # [B, H, T, S]
        scores = scores.masked_fill(~mask, float("-inf"))
        p = torch.softmax(scores, dim=-1).to(latent.dtype)
        o_lat = p @ key[..., : self.kv_lora_rank]  # [B, H, T, kv_lora]
        return torch.einsum("bhtc,hvc->bthv", o_lat, w_uv)
