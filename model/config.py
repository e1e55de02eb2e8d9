"""`K3Config`: the K3 policy's shape, with the ecosystem's config keys as field names.

The fields are the keys of Moonshot's `config.json`, so `cfg.to_hf_dict()` is the file a checkpoint ships
with and other loaders read it; a bad value raises `ConfigError` on construction, before any tensor.

Design: docs/design/model.md#model-config.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from model.config_checks import ConfigError, check_known_keys, validate_config

__all__ = ["ConfigError", "K3Config", "LinearAttnConfig"]


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
        check_known_keys(d, names, "model config", also=_ECOSYSTEM_FIXED_KEYS)
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
        """Raise `ConfigError` on the first inconsistent value (see `model.config_checks`)."""
        validate_config(self)


def _linear_attn_from_dict(d: dict[str, Any]) -> LinearAttnConfig:
    names = {f.name for f in dataclasses.fields(LinearAttnConfig)}
    check_known_keys(d, names, "linear_attn_config")
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
