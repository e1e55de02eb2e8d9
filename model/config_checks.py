"""Validation of a `K3Config`, kept apart from the schema in `model.config`.

`validate_config` raises `ConfigError` on the first inconsistent value, naming the key and what to change,
before any tensor is built; `check_known_keys` refuses typos in a config mapping.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


class ConfigError(ValueError):
    """A model config value is missing, unknown or inconsistent."""


_POSITIVE = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank",
    "qk_nope_head_dim", "v_head_dim", "num_experts", "num_experts_per_token",
    "moe_intermediate_size", "intermediate_size", "max_position_embeddings",
)  # fmt: skip
_NON_NEGATIVE = ("qk_rope_head_dim", "num_shared_experts", "first_k_dense_replace")


def check_known_keys(given: Iterable[str], valid: set[str], what: str, *, also: Iterable[str] = ()) -> None:
    """ConfigError when `given` holds a key outside `valid` and `also` (accepted, dropped by the caller)."""
    accepted = valid | set(also)
    unknown = sorted(k for k in given if k not in accepted)
    if unknown:
        raise ConfigError(f"unknown {what} key(s) {unknown}; valid keys are {sorted(valid)}")


def validate_config(cfg: Any) -> None:
    """Raise `ConfigError` on the first inconsistent value of `cfg` (a `model.config.K3Config`; not imported
    here, since `model.config` imports this module)."""
    for name in _POSITIVE:
        value = getattr(cfg, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    for name in _NON_NEGATIVE:
        value = getattr(cfg, name)
        if not isinstance(value, int) or value < 0:
            raise ConfigError(f"{name} must be a non-negative integer, got {value!r}")
    if cfg.q_lora_rank is not None and cfg.q_lora_rank < 1:
        raise ConfigError(f"q_lora_rank must be a positive integer or null, got {cfg.q_lora_rank!r}")
    if not cfg.mla_use_nope:
        raise ConfigError("mla_use_nope must be true: K3/Kimi-Linear MLA uses no rotary embedding")
    if cfg.num_experts_per_token >= cfg.num_experts:
        raise ConfigError(
            f"num_experts_per_token ({cfg.num_experts_per_token}) must be smaller than num_experts "
            f"({cfg.num_experts}): routing picks top-k of n and quantile balancing routes top-(k+1)"
        )
    if cfg.first_k_dense_replace > cfg.num_hidden_layers:
        raise ConfigError(
            f"first_k_dense_replace ({cfg.first_k_dense_replace}) exceeds num_hidden_layers "
            f"({cfg.num_hidden_layers})"
        )
    if cfg.routed_expert_hidden_size is not None:
        ell = cfg.routed_expert_hidden_size
        if not isinstance(ell, int) or ell < 1 or ell > cfg.hidden_size or cfg.hidden_size % ell:
            raise ConfigError(
                f"routed_expert_hidden_size (latent width, {ell!r}) must divide hidden_size "
                f"({cfg.hidden_size}), e.g. {cfg.hidden_size // 2}; use null for a standard MoE"
            )
    if cfg.hidden_act not in ("situ", "silu"):
        raise ConfigError(f"hidden_act must be 'situ' (SiTU-GLU) or 'silu' (SwiGLU), got {cfg.hidden_act!r}")
    if cfg.activation_situ_beta <= 0 or cfg.activation_situ_linear_beta <= 0:
        raise ConfigError("activation_situ_beta and activation_situ_linear_beta must be positive")
    if cfg.attn_res_block_size is not None and (
        not isinstance(cfg.attn_res_block_size, int) or cfg.attn_res_block_size < 1
    ):
        raise ConfigError(
            f"attn_res_block_size must be an integer >= 1 (decoder layers per block) or null for a "
            f"plain residual, got {cfg.attn_res_block_size!r}"
        )
    if cfg.attn_res_full and cfg.attn_res_block_size is None:
        raise ConfigError("attn_res_full needs attn_res_block_size set (AttnRes on); set both or neither")
    if cfg.rms_norm_eps <= 0:
        raise ConfigError(f"rms_norm_eps must be positive, got {cfg.rms_norm_eps!r}")
    _validate_linear_attn(cfg)


def _validate_linear_attn(cfg: Any) -> None:
    lac = cfg.linear_attn_config
    for name in ("head_dim", "num_heads", "short_conv_kernel_size"):
        value = getattr(lac, name)
        if not isinstance(value, int) or value < 1:
            raise ConfigError(f"linear_attn_config.{name} must be a positive integer, got {value!r}")
    if lac.gate_lower_bound is not None and not (-5.0 <= lac.gate_lower_bound < 0.0):
        raise ConfigError(
            f"linear_attn_config.gate_lower_bound must lie in [-5, 0) (K3 uses -5.0) or be null for "
            f"Kimi-Linear's unbounded gate, got {lac.gate_lower_bound!r}"
        )
    layers = list(range(1, cfg.num_hidden_layers + 1))
    kda, full = list(lac.kda_layers), list(lac.full_attn_layers)
    both = sorted(set(kda) & set(full))
    if both:
        raise ConfigError(f"layers {both} are listed in both kda_layers and full_attn_layers")
    listed = sorted(kda + full)
    if listed != layers:
        missing = sorted(set(layers) - set(listed))
        extra = sorted(set(listed) - set(layers))
        raise ConfigError(
            "linear_attn_config.kda_layers and full_attn_layers (1-based) must together list every layer "
            f"1..{cfg.num_hidden_layers} exactly once; missing {missing}, "
            f"out of range or repeated {extra}"
        )
