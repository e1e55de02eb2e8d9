"""K3Config loading/validation and parameter counting from the config alone."""

from __future__ import annotations

import subprocess
import sys

import pytest
from model_testutil import CONF, variant

from model import ConfigError, K3Config, K3ForCausalLM, count_parameters


def test_k3_yaml_counts_match_published_total_and_active():
    total, active = count_parameters(K3Config.from_yaml(CONF / "k3.yaml"))
    assert abs(total - 2.78e12) / 2.78e12 < 0.02, total
    assert abs(active - 104.2e9) / 104.2e9 < 0.02, active


def test_count_accepts_a_plain_dict():
    cfg = K3Config.from_yaml(CONF / "k3.yaml")
    assert count_parameters(cfg.to_dict()) == count_parameters(cfg)


def test_count_cli_prints_both_figures():
    out = subprocess.run(
        [sys.executable, "-m", "model.count", str(CONF / "k3.yaml")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "2.78 T" in out and "104.19 B" in out


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"attn_res_block_size": None, "hidden_act": "silu", "tie_word_embeddings": True},
        {"routed_expert_hidden_size": None, "q_lora_rank": None, "mla_use_output_gate": False},
        {
            "linear_attn_config": {"use_full_rank_gate": False, "gate_lower_bound": None},
            "num_shared_experts": 0,
        },
    ],
)
def test_count_equals_instantiated_numel(tiny_dict, overrides):
    cfg = variant(tiny_dict, **overrides)
    model = K3ForCausalLM(cfg)
    numel = sum(p.numel() for p in model.parameters())  # tied weights are counted once
    total, active = count_parameters(cfg)
    assert total == numel
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    experts = model.model.layers[-1].block_sparse_moe.experts
    expert = sum(p[0].numel() for p in experts.parameters())  # one expert's row of each stacked weight
    embed = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size
    unused_experts = cfg.num_experts - cfg.num_experts_per_token
    assert active == numel - embed - moe_layers * unused_experts * expert


def test_tiny_has_every_component_and_the_stated_size():
    cfg = K3Config.from_yaml(CONF / "k3_tiny.yaml")
    total, _ = count_parameters(cfg)
    assert 1e6 <= total <= 3e6
    kinds = {cfg.is_kda_layer(i) for i in range(cfg.num_hidden_layers)}
    assert kinds == {True, False}
    assert -(-cfg.num_hidden_layers // cfg.attn_res_block_size) >= 2
    assert cfg.num_experts >= 16 and cfg.num_experts_per_token >= 2 and cfg.num_shared_experts >= 1
    assert cfg.hidden_act == "situ" and cfg.uses_latent_moe and cfg.first_k_dense_replace >= 1
    assert cfg.vocab_size == 272


def test_small_is_tens_of_millions():
    total, _ = count_parameters(K3Config.from_yaml(CONF / "k3_small.yaml"))
    assert 1e7 <= total <= 1e8


def test_dict_round_trip(tiny_dict):
    cfg = K3Config.from_dict(tiny_dict)
    assert K3Config.from_dict(cfg.to_dict()) == cfg
    assert K3Config.from_dict(cfg.to_hf_dict()) == cfg


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"num_experts_per_token": 16}, "num_experts_per_token"),
        ({"routed_expert_hidden_size": 48}, "must divide hidden_size"),
        ({"attn_res_block_size": 0}, "attn_res_block_size"),
        ({"mla_use_nope": False}, "mla_use_nope"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"linear_attn_config": {"kda_layers": [1, 2]}}, "missing [3]"),
        ({"linear_attn_config": {"gate_lower_bound": -7.0}}, "gate_lower_bound"),
        ({"first_k_dense_replace": 9}, "first_k_dense_replace"),
    ],
)
def test_validation_names_the_bad_key(tiny_dict, overrides, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        variant(tiny_dict, **overrides)


def test_unknown_key_is_rejected(tiny_dict):
    with pytest.raises(ConfigError, match="hiden_size"):
        K3Config.from_dict({**tiny_dict, "hiden_size": 3})


def test_missing_yaml_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        K3Config.from_yaml(tmp_path / "nope.yaml")


def test_accepts_an_omegaconf_node_as_hydra_composes_it(tiny_dict):
    from omegaconf import OmegaConf

    node = OmegaConf.create({"model": tiny_dict}).model
    assert K3Config.from_dict(node) == K3Config.from_dict(tiny_dict)


def test_validation_lives_apart_from_the_schema_and_rechecks_a_changed_config(tiny_dict):
    import dataclasses

    from model.config_checks import ConfigError as ChecksError
    from model.config_checks import validate_config

    assert ChecksError is ConfigError  # one error class, importable from model, model.config and the checks
    cfg = K3Config.from_dict(tiny_dict)
    validate_config(cfg)  # a valid config passes
    bad = dataclasses.replace(cfg, linear_attn_config=dataclasses.replace(cfg.linear_attn_config))
    bad.linear_attn_config.full_attn_layers = [*bad.linear_attn_config.full_attn_layers, 99]
    with pytest.raises(ConfigError, match=r"out of range or repeated \[99\]"):
        validate_config(bad)


def test_unknown_linear_attn_key_names_the_block(tiny_dict):
    with pytest.raises(ConfigError, match=r"unknown linear_attn_config key\(s\) \['head_dims'\]"):
        variant(tiny_dict, linear_attn_config={"head_dims": 4})
