"""Parameter counts from the config alone (no tensors are built), and `python -m model.count CONFIG.yaml`.

`count_parameters(cfg) -> (total, active)`. *Active* is what one token touches: every dense parameter,
the k selected routed experts of each MoE layer (not all n), and the LM head, but not the input embedding
table (a lookup, no compute), following the convention of the published K3 figure (104.2 B active).
The counts mirror the modules of `model/` one for one; `tests/model/test_config.py` checks them against an
instantiated tiny model.
"""

from __future__ import annotations

import sys
from typing import Any

from model.config import K3Config


def _rmsnorm(width: int) -> int:
    return width


def _glu_ffn(d: int, intermediate: int) -> int:
    return 3 * d * intermediate  # gate_proj, up_proj, down_proj


def kda_layer_parameters(cfg: K3Config) -> int:
    """One KDA attention block (`self_attn.` of a KDA layer)."""
    d, lac = cfg.hidden_size, cfg.linear_attn_config
    h, dk = lac.num_heads, lac.head_dim
    c = h * dk
    n = 3 * d * c  # q_proj, k_proj, v_proj
    n += 3 * c * lac.short_conv_kernel_size  # q/k/v_conv1d (depthwise, no bias)
    n += h + c  # A_log [H], dt_bias [H*dk]
    n += d * dk + dk * c  # f_a_proj, f_b_proj (low-rank decay logit)
    n += d * h  # b_proj (beta)
    n += d * c if lac.use_full_rank_gate else d * dk + dk * c  # g_proj | g_a_proj + g_b_proj
    n += _rmsnorm(dk)  # o_norm
    n += c * d  # o_proj
    return n


def mla_layer_parameters(cfg: K3Config) -> int:
    """One NoPE MLA block (`self_attn.` of a full-attention layer)."""
    d, h = cfg.hidden_size, cfg.num_attention_heads
    qk = cfg.mla_qk_head_dim
    if cfg.q_lora_rank is None:
        n = d * h * qk
    else:
        n = d * cfg.q_lora_rank + _rmsnorm(cfg.q_lora_rank) + cfg.q_lora_rank * h * qk
    n += d * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + _rmsnorm(cfg.kv_lora_rank)  # kv_a_proj_with_mqa
    n += cfg.kv_lora_rank * h * (cfg.qk_nope_head_dim + cfg.v_head_dim)  # kv_b_proj
    n += h * cfg.v_head_dim * d  # o_proj
    if cfg.mla_use_output_gate:
        n += d * h * cfg.v_head_dim  # g_proj
    return n


def moe_layer_parameters(cfg: K3Config) -> tuple[int, int]:
    """One LatentMoE block: (total, active per token)."""
    d, ell = cfg.hidden_size, cfg.expert_width
    router = cfg.num_experts * d + cfg.num_experts  # gate.weight, e_score_correction_bias
    expert = _glu_ffn(ell, cfg.moe_intermediate_size)  # w1, w3, w2
    shared = _glu_ffn(d, cfg.moe_intermediate_size * cfg.num_shared_experts) if cfg.num_shared_experts else 0
    latent = 0
    if cfg.uses_latent_moe:
        latent = 2 * d * ell + (_rmsnorm(ell) if cfg.latent_moe_use_norm else 0)
    fixed = router + shared + latent
    return fixed + cfg.num_experts * expert, fixed + cfg.num_experts_per_token * expert


def count_parameters(cfg: K3Config | dict[str, Any]) -> tuple[int, int]:
    """(total, active) parameter counts of the model `cfg` describes, computed without building tensors."""
    if not isinstance(cfg, K3Config):
        cfg = K3Config.from_dict(cfg)
    d = cfg.hidden_size
    embed = cfg.vocab_size * d
    head = 0 if cfg.tie_word_embeddings else cfg.vocab_size * d
    total = embed + head + _rmsnorm(d)  # + final norm
    active = head + _rmsnorm(d) + (cfg.vocab_size * d if cfg.tie_word_embeddings else 0)
    attn_res_per_layer = 4 * d if cfg.uses_attn_res else 0  # two (norm [d], proj [1, d]) pairs per layer
    if cfg.uses_attn_res:
        total += 2 * d  # output_attn_res_norm, output_attn_res_proj
        active += 2 * d
    kda, mla = kda_layer_parameters(cfg), mla_layer_parameters(cfg)
    moe_total, moe_active = moe_layer_parameters(cfg)
    dense = _glu_ffn(d, cfg.intermediate_size)
    for i in range(cfg.num_hidden_layers):
        common = (kda if cfg.is_kda_layer(i) else mla) + 2 * _rmsnorm(d) + attn_res_per_layer
        total += common + (moe_total if cfg.is_moe_layer(i) else dense)
        active += common + (moe_active if cfg.is_moe_layer(i) else dense)
    return total, active


def _human(n: int) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return str(n)


def main(argv: list[str] | None = None) -> int:
    """Print total and active parameter counts of each config file given."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print("usage: python -m model.count conf/model/k3.yaml [more.yaml ...]", file=sys.stderr)
        return 2
    for path in argv:
        try:
            total, active = count_parameters(K3Config.from_yaml(path))
        except ValueError as e:
            print(f"{path}: {e}", file=sys.stderr)
            return 1
        print(f"{path}: total {total:,} ({_human(total)}), active {active:,} ({_human(active)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
