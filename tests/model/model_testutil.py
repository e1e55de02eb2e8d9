"""Helpers for the model tests: config variants of k3_tiny (imported as `model_testutil`)."""

from __future__ import annotations

import copy
from pathlib import Path

from model import K3Config

CONF = Path(__file__).resolve().parents[2] / "conf" / "model"


def tiny_config_dict() -> dict:
    return K3Config.from_yaml(CONF / "k3_tiny.yaml").to_dict()


def variant(base: dict, **overrides) -> K3Config:
    """A copy of `base` with top-level overrides; `linear_attn_config` overrides merge into the block."""
    d = copy.deepcopy(base)
    lac = overrides.pop("linear_attn_config", None)
    d.update(overrides)
    if lac:
        d["linear_attn_config"].update(lac)
    return K3Config.from_dict(d)


def kimi_linear_variant(base: dict, **overrides) -> K3Config:
    """K3 features off: the Kimi-Linear architecture transformers' KimiLinearForCausalLM implements."""
    kw = dict(
        hidden_act="silu",
        mla_use_output_gate=False,
        attn_res_block_size=None,
        routed_expert_hidden_size=None,
        routed_scaling_factor=2.446,
        linear_attn_config={"gate_lower_bound": None, "use_full_rank_gate": False},
    )
    kw.update(overrides)
    return variant(base, **kw)
