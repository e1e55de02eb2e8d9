"""save_pretrained / from_pretrained: Moonshot names, config.json, strict shape checks."""

from __future__ import annotations

import json

import pytest
import torch
from model_testutil import variant
from safetensors.torch import load_file, save_file

from model import CheckpointMismatch, K3ForCausalLM


def test_round_trip_gives_identical_logits_and_bias(tiny_dict, tmp_path):
    model = K3ForCausalLM(variant(tiny_dict))
    model.moe_routers()[0].update_bias(torch.linspace(-1, 1, 16))
    model.save_pretrained(tmp_path)
    loaded = K3ForCausalLM.from_pretrained(tmp_path)
    ids = torch.randint(0, 272, (2, 30))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)
    assert torch.equal(loaded.moe_routers()[0].e_score_correction_bias, torch.linspace(-1, 1, 16))
    assert not loaded.moe_routers()[0].e_score_correction_bias.requires_grad


def test_checkpoint_uses_moonshot_names_and_config_keys(tiny_dict, tmp_path):
    K3ForCausalLM(variant(tiny_dict)).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "kimi_linear"
    assert config["architectures"] == ["KimiLinearForCausalLM"]
    assert config["linear_attn_config"]["kda_layers"] == [1, 2, 3]
    assert config["hidden_act"] == "situ" and config["latent_moe_use_norm"] is True
    names = set(load_file(str(tmp_path / "model.safetensors")))
    expected = {
        "model.embed_tokens.weight",
        "model.norm.weight",
        "lm_head.weight",
        "model.output_attn_res_norm.weight",
        "model.output_attn_res_proj.weight",
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.0.self_attn.q_conv1d.weight",
        "model.layers.0.self_attn.A_log",
        "model.layers.0.self_attn.dt_bias",
        "model.layers.0.self_attn.f_a_proj.weight",
        "model.layers.0.self_attn.f_b_proj.weight",
        "model.layers.0.self_attn.b_proj.weight",
        "model.layers.0.self_attn.g_proj.weight",
        "model.layers.0.self_attn.o_norm.weight",
        "model.layers.0.self_attention_res_norm.weight",
        "model.layers.0.mlp_res_proj.weight",
        "model.layers.3.self_attn.q_a_proj.weight",
        "model.layers.3.self_attn.q_a_layernorm.weight",
        "model.layers.3.self_attn.kv_a_proj_with_mqa.weight",
        "model.layers.3.self_attn.kv_b_proj.weight",
        "model.layers.3.self_attn.g_proj.weight",
        "model.layers.1.block_sparse_moe.gate.weight",
        "model.layers.1.block_sparse_moe.gate.e_score_correction_bias",
        "model.layers.1.block_sparse_moe.experts.15.w1.weight",
        "model.layers.1.block_sparse_moe.experts.0.w2.weight",
        "model.layers.1.block_sparse_moe.shared_experts.up_proj.weight",
        "model.layers.1.block_sparse_moe.routed_expert_down_proj.weight",
        "model.layers.1.block_sparse_moe.routed_expert_norm.weight",
        "model.layers.1.block_sparse_moe.routed_expert_up_proj.weight",
    }
    assert expected <= names, sorted(expected - names)
    state = load_file(str(tmp_path / "model.safetensors"))
    assert state["model.layers.0.self_attn.A_log"].shape == (4,)
    assert state["model.layers.0.self_attn.q_conv1d.weight"].shape == (128, 1, 4)
    assert state["model.layers.1.block_sparse_moe.experts.0.w1.weight"].shape == (64, 64)  # [I, latent]
    assert state["model.layers.0.self_attention_res_proj.weight"].shape == (1, 128)


def test_shape_mismatch_names_the_first_offending_tensor(tiny_dict, tmp_path):
    K3ForCausalLM(variant(tiny_dict)).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["moe_intermediate_size"] = 32
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        CheckpointMismatch,
        match=r"model\.layers\.1\.block_sparse_moe\.experts\.0\.w1\.weight.*\(64, 64\).*\(32, 64\)",
    ):
        K3ForCausalLM.from_pretrained(tmp_path)


def test_missing_and_unexpected_tensors_are_named(tiny_dict, tmp_path):
    K3ForCausalLM(variant(tiny_dict)).save_pretrained(tmp_path)
    path = str(tmp_path / "model.safetensors")
    state = load_file(path)
    del state["model.norm.weight"]
    save_file(state, path)
    with pytest.raises(CheckpointMismatch, match="lacks tensor 'model.norm.weight'"):
        K3ForCausalLM.from_pretrained(tmp_path)
    state["model.norm.weight"] = torch.ones(128)
    state["model.extra.weight"] = torch.ones(1)
    save_file(state, path)
    with pytest.raises(CheckpointMismatch, match="model.extra.weight"):
        K3ForCausalLM.from_pretrained(tmp_path)


def test_missing_folder_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        K3ForCausalLM.from_pretrained(tmp_path)


def test_tied_embeddings_round_trip(tiny_dict, tmp_path):
    model = K3ForCausalLM(variant(tiny_dict, tie_word_embeddings=True))
    model.save_pretrained(tmp_path)
    assert "lm_head.weight" not in load_file(str(tmp_path / "model.safetensors"))
    loaded = K3ForCausalLM.from_pretrained(tmp_path)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    ids = torch.randint(0, 272, (1, 10))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)
