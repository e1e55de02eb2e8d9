"""`K3Config`: the K3 policy's shape, with the ecosystem's config keys as field names.

The fields are the keys of Moonshot's `config.json` (read by vLLM, sglang, llama.cpp and transformers'
`KimiLinearConfig`), so `cfg.to_hf_dict()` *is* the `config.json` a checkpoint ships with, and a
`conf/model/*.yaml` file lists the same keys. A few k3rl-only switches for ablations are marked as such;
loaders outside k3rl ignore them.

Validation happens on construction: a bad value raises `ConfigError` naming the key and what to change,
before any tensor is built.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A model config value is missing, unknown or inconsistent."""


@dataclass
class LinearAttnConfig:
    """The `linear_attn_config` block: KDA shapes, gate choice and the 1-based layer schedule."""

    head_dim: int = 128
    num_heads: int = 96
    short_conv_kernel_size: int = 4
    # K3's lower-bounded gate g = lb * sigmoid(exp(A) * z); None selects Kimi-Linear's -exp(A) * softplus(z).
    gate_lower_bound: float | None = -5.0
    # K3's full-rank sigmoid output gate (`g_proj`); False selects the low-rank `g_a_proj`/`g_b_proj`.
    use_full_rank_gate: bool = True
    kda_layers: list[int] = field(default_factory=list)
    full_attn_layers: list[int] = field(default_factory=list)


# Keys that config.json files of the ecosystem carry but that add nothing to this implementation
# (fixed to the values given here, or meaningful only to other loaders). `from_dict` accepts and drops them.
_ECOSYSTEM_FIXED_KEYS: dict[str, Any] = {
    "model_type": "kimi_linear",
    "architectures": ["KimiLinearForCausalLM"],
    "num_key_value_heads": None,
    "moe_router_activation_func": "sigmoid",
    "use_grouped_topk": True,
    "num_expert_group": 1,
    "topk_group": 1,
    "moe_layer_freq": 1,
    "num_nextn_predict_layers": 0,
    "torch_dtype": None,
    "dtype": None,
    "transformers_version": None,
    "use_cache": True,
    "model_max_length": None,
}


@dataclass
class K3Config:
    """Shapes and switches of a K3 model. Field names are the ecosystem's `config.json` keys."""

    vocab_size: int = 163840
    hidden_size: int = 7168
    num_hidden_layers: int = 93
    num_attention_heads: int = 96
    # MLA (NoPE): q-LoRA rank (None = plain q_proj), latent KV rank and head dims.
    q_lora_rank: int | None = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64  # unrotated shared key dims (NoPE keeps them, no rotation anywhere)
    v_head_dim: int = 128
    mla_use_nope: bool = True
    mla_use_output_gate: bool = True
    # MoE
    num_experts: int = 896
    num_experts_per_token: int = 16
    moe_intermediate_size: int = 3072
    num_shared_experts: int = 2
    routed_expert_hidden_size: int | None = (
        3584  # latent width l; None = standard MoE (no latent projections)
    )
    latent_moe_use_norm: bool = True
    routed_scaling_factor: float = 1.0
    moe_renormalize: bool = True
    first_k_dense_replace: int = 1
    intermediate_size: int = 33792  # dense FFN of the first `first_k_dense_replace` layers
    # FFN activation: "situ" (SiTU-GLU) or "silu" (SwiGLU).
    hidden_act: str = "situ"
    activation_situ_beta: float = 4.0
    activation_situ_linear_beta: float = 25.0
    # Block Attention Residuals: block size in decoder layers; None = plain residual stream.
    attn_res_block_size: int | None = 12
    linear_attn_config: LinearAttnConfig = field(default_factory=LinearAttnConfig)
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 1048576
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    # Special token ids (written to config.json; null when the tokenizer defines them elsewhere).
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    # k3rl-only ablation: Full AttnRes (every sub-layer output is its own source; needs attn_res_block_size).
    attn_res_full: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.linear_attn_config, dict):
            self.linear_attn_config = _linear_attn_from_dict(self.linear_attn_config)
        self.validate()

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> K3Config:
        """Build from a plain dict (a YAML file's content, an OmegaConf node or a `config.json`).

        Unknown keys are an error (typos must not pass silently), except the ecosystem keys that a
        Moonshot/transformers `config.json` carries and this implementation fixes
        (see `_ECOSYSTEM_FIXED_KEYS`).
        """
        d = _to_plain(d)
        if not isinstance(d, dict):
            raise ConfigError(f"a model config must be a mapping, got {type(d).__name__}")
        if "text_config" in d and isinstance(d["text_config"], dict):  # a multimodal K3 config.json
            d = d["text_config"]
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(k for k in d if k not in names and k not in _ECOSYSTEM_FIXED_KEYS)
        if unknown:
            raise ConfigError(
                f"unknown model config key(s) {unknown}; valid keys are the K3Config fields: {sorted(names)}"
            )
        kwargs = {k: v for k, v in d.items() if k in names}
        if "max_position_embeddings" not in kwargs and d.get("model_max_length"):
            kwargs["max_position_embeddings"] = d["model_max_length"]
        return cls(**kwargs)

    @classmethod
    def from_yaml(cls, path: str | Path) -> K3Config:
        """Load a `conf/model/*.yaml` file (through OmegaConf, so Hydra interpolations resolve)."""
        from omegaconf import OmegaConf

        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"model config file {path} does not exist")
        return cls.from_dict(OmegaConf.to_container(OmegaConf.load(path), resolve=True))

    @classmethod
    def from_json(cls, path: str | Path) -> K3Config:
        """Load a checkpoint's `config.json`."""
        with open(path) as f:
            return cls.from_dict(json.load(f))

    def to_dict(self) -> dict[str, Any]:
        """The fields as a plain dict (`from_dict(to_dict())` round-trips)."""
        return dataclasses.asdict(self)

    def to_hf_dict(self) -> dict[str, Any]:
        """The `config.json` a checkpoint ships with: Moonshot/vLLM keys plus the fixed ecosystem keys."""
        d = self.to_dict()
        if not self.attn_res_full:
            d.pop("attn_res_full")
        d.update(
            model_type="kimi_linear",
            architectures=["KimiLinearForCausalLM"],
            num_key_value_heads=self.num_attention_heads,
            moe_router_activation_func="sigmoid",
            use_grouped_topk=True,
            num_expert_group=1,
            topk_group=1,
            moe_layer_freq=1,
            num_nextn_predict_layers=0,
            torch_dtype="float32",
        )
        return d

    # ------------------------------------------------------------------ derived shapes
    @property
    def kda(self) -> LinearAttnConfig:
        return self.linear_attn_config

    def is_kda_layer(self, layer_idx: int) -> bool:
        """True when 0-based decoder layer `layer_idx` is a KDA layer (the config lists are 1-based)."""
        return (layer_idx + 1) in self.linear_attn_config.kda_layers

    def is_moe_layer(self, layer_idx: int) -> bool:
        return layer_idx >= self.first_k_dense_replace

    @property
    def uses_latent_moe(self) -> bool:
        return self.routed_expert_hidden_size is not None

    @property
    def expert_width(self) -> int:
        """Width the routed experts run in: the latent width l, or d for a standard MoE."""
        return self.routed_expert_hidden_size or self.hidden_size

    @property
    def uses_attn_res(self) -> bool:
        return self.attn_res_block_size is not None

    @property
    def mla_qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Raise `ConfigError` on the first inconsistent value."""
        positive = [
            "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank",
            "qk_nope_head_dim", "v_head_dim", "num_experts", "num_experts_per_token",
            "moe_intermediate_size", "intermediate_size", "max_position_embeddings",
        ]  # fmt: skip
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        for name in ("qk_rope_head_dim", "num_shared_experts", "first_k_dense_replace"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ConfigError(f"{name} must be a non-negative integer, got {value!r}")
        if self.q_lora_rank is not None and self.q_lora_rank < 1:
            raise ConfigError(f"q_lora_rank must be a positive integer or null, got {self.q_lora_rank!r}")
        if not self.mla_use_nope:
            raise ConfigError("mla_use_nope must be true: K3/Kimi-Linear MLA uses no rotary embedding")
        if self.num_experts_per_token >= self.num_experts:
            raise ConfigError(
                f"num_experts_per_token ({self.num_experts_per_token}) must be smaller than num_experts "
                f"({self.num_experts}): routing picks top-k of n and quantile balancing routes top-(k+1)"
            )
        if self.first_k_dense_replace > self.num_hidden_layers:
            raise ConfigError(
                f"first_k_dense_replace ({self.first_k_dense_replace}) exceeds num_hidden_layers "
                f"({self.num_hidden_layers})"
            )
        if self.routed_expert_hidden_size is not None:
            ell = self.routed_expert_hidden_size
            if not isinstance(ell, int) or ell < 1 or ell > self.hidden_size or self.hidden_size % ell:
                raise ConfigError(
                    f"routed_expert_hidden_size (latent width, {ell!r}) must divide hidden_size "
                    f"({self.hidden_size}), e.g. {self.hidden_size // 2}; use null for a standard MoE"
                )
        if self.hidden_act not in ("situ", "silu"):
            raise ConfigError(
                f"hidden_act must be 'situ' (SiTU-GLU) or 'silu' (SwiGLU), got {self.hidden_act!r}"
            )
        if self.activation_situ_beta <= 0 or self.activation_situ_linear_beta <= 0:
            raise ConfigError("activation_situ_beta and activation_situ_linear_beta must be positive")
        if self.attn_res_block_size is not None and (
            not isinstance(self.attn_res_block_size, int) or self.attn_res_block_size < 1
        ):
            raise ConfigError(
                f"attn_res_block_size must be an integer >= 1 (decoder layers per block) or null for a "
                f"plain residual, got {self.attn_res_block_size!r}"
            )
        if self.attn_res_full and self.attn_res_block_size is None:
            raise ConfigError("attn_res_full needs attn_res_block_size set (AttnRes on); set both or neither")
        if self.rms_norm_eps <= 0:
            raise ConfigError(f"rms_norm_eps must be positive, got {self.rms_norm_eps!r}")
        self._validate_linear_attn()

    def _validate_linear_attn(self) -> None:
        lac = self.linear_attn_config
        for name in ("head_dim", "num_heads", "short_conv_kernel_size"):
            value = getattr(lac, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"linear_attn_config.{name} must be a positive integer, got {value!r}")
        if lac.gate_lower_bound is not None and not (-5.0 <= lac.gate_lower_bound < 0.0):
            raise ConfigError(
                f"linear_attn_config.gate_lower_bound must lie in [-5, 0) (K3 uses -5.0) or be null for "
                f"Kimi-Linear's unbounded gate, got {lac.gate_lower_bound!r}"
            )
        layers = list(range(1, self.num_hidden_layers + 1))
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
                f"1..{self.num_hidden_layers} exactly once; missing {missing}, "
                f"out of range or repeated {extra}"
            )


def _linear_attn_from_dict(d: dict[str, Any]) -> LinearAttnConfig:
    names = {f.name for f in dataclasses.fields(LinearAttnConfig)}
    unknown = sorted(set(d) - names)
    if unknown:
        raise ConfigError(f"unknown linear_attn_config key(s) {unknown}; valid keys: {sorted(names)}")
    return LinearAttnConfig(**d)


def _to_plain(d: Any) -> Any:
    """OmegaConf nodes -> plain containers; anything else unchanged."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf
    except ImportError:  # pragma: no cover - omegaconf is a dependency
        return d
    if isinstance(d, (DictConfig, ListConfig)):
        return OmegaConf.to_container(d, resolve=True)
    return d
