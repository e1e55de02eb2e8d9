"""K3ForCausalLM: causality, cached decoding, padding, gradients, AttnRes forms, ablations, training."""

from __future__ import annotations

import pytest
import torch
from model_testutil import kimi_linear_variant, variant

from model import K3ForCausalLM
from model.attn_res import depth_mix


def _model(cfg) -> K3ForCausalLM:
    model = K3ForCausalLM(cfg)
    _randomise_zero_inits(model)
    return model


@torch.no_grad()
def _randomise_zero_inits(model: K3ForCausalLM) -> None:
    """Give the zero-initialised AttnRes queries and router biases non-trivial values (so they act)."""
    for name, p in model.named_parameters():
        if name.endswith("_res_proj.weight"):
            p.normal_(std=0.5)
    for router in model.moe_routers():
        router.update_bias(torch.randn_like(router.e_score_correction_bias) * 0.05)


def _decode_in_pieces(model, ids, splits, attention_mask=None):
    cache = model.new_cache(ids.shape[0])
    logits, start = [], 0
    for end in [*splits, ids.shape[1]]:
        mask = None if attention_mask is None else attention_mask[:, :end]
        logits.append(model(ids[:, start:end], attention_mask=mask, cache=cache).logits)
        start = end
    return torch.cat(logits, dim=1)


def test_changing_a_token_never_changes_earlier_logits(tiny_dict):
    model = _model(variant(tiny_dict))
    ids = torch.randint(0, 272, (2, 100))
    changed = ids.clone()
    changed[:, 70] = (changed[:, 70] + 1) % 272
    with torch.no_grad():
        a, b = model(ids).logits, model(changed).logits
    assert (a[:, :70] - b[:, :70]).abs().max() <= 1e-5  # only float reassociation (expert batches differ)
    assert (a[:, 70:] - b[:, 70:]).abs().max() > 1e-3


@pytest.mark.parametrize(
    "overrides",
    [
        {},  # K3 tiny: 3 KDA + 1 MLA, block AttnRes
        {"num_hidden_layers": 6, "attn_res_full": True,
         "linear_attn_config": {"kda_layers": [1, 3, 4, 5], "full_attn_layers": [2, 6]}},
        {"attn_res_block_size": None, "linear_attn_config": {"gate_lower_bound": None}},
    ],
)  # fmt: skip
def test_incremental_decoding_equals_full_forward_across_chunk_boundaries(tiny_dict, overrides):
    model = _model(variant(tiny_dict, **overrides))
    ids = torch.randint(0, 272, (2, 140))
    with torch.no_grad():
        full = model(ids).logits
        # prefill 60 (inside chunk 1), then 1-token steps across the 64 boundary, a 60-token chunk across the
        # 128 boundary, then single steps again.
        pieces = _decode_in_pieces(model, ids, [60, 61, 62, 63, 64, 65, 66, 126, 127, 128, 129, 130])
    assert (pieces - full).abs().max() <= 1e-4


def test_left_padding_does_not_change_real_token_logits(tiny_dict):
    model = _model(variant(tiny_dict))
    seqs = [torch.randint(0, 272, (n,)) for n in (30, 75)]
    width = 75
    ids = torch.zeros(2, width, dtype=torch.long)
    mask = torch.zeros(2, width, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, width - len(s) :] = s
        mask[i, width - len(s) :] = 1
    with torch.no_grad():
        batched = model(ids, attention_mask=mask)
        for i, s in enumerate(seqs):
            alone = model(s.unsqueeze(0)).logits[0]
            assert (batched.logits[i, width - len(s) :] - alone).abs().max() <= 1e-4
    # router stats cover exactly the real tokens
    assert all(st.scores.shape[0] == 105 and float(st.loads.sum()) == 105 * 2 for st in batched.router_stats)


def test_batched_decoding_with_left_padding_matches_each_sequence_alone(tiny_dict):
    model = _model(variant(tiny_dict))
    prompts = [torch.randint(0, 272, (n,)) for n in (5, 70)]
    new = torch.randint(0, 272, (2, 8))  # tokens fed one step at a time after the prompts
    width = 70
    ids = torch.zeros(2, width, dtype=torch.long)
    mask = torch.zeros(2, width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = p
        mask[i, width - len(p) :] = 1
    with torch.no_grad():
        cache = model.new_cache(2)
        steps = [model(ids, attention_mask=mask, cache=cache).logits[:, -1]]
        for t in range(new.shape[1]):
            mask = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], dim=1)  # HF-style full mask
            steps.append(model(new[:, t : t + 1], attention_mask=mask, cache=cache).logits[:, -1])
        got = torch.stack(steps, dim=1)
        for i, p in enumerate(prompts):
            alone = model(torch.cat([p, new[i]]).unsqueeze(0)).logits[0, len(p) - 1 :]
            assert (got[i] - alone).abs().max() <= 1e-4


def test_cache_select_repeats_a_prefilled_prompt(tiny_dict):
    model = _model(variant(tiny_dict))
    prompt = torch.randint(0, 272, (1, 20))
    nxt = torch.randint(0, 272, (3, 1))
    with torch.no_grad():
        cache = model.new_cache(1)
        model(prompt, cache=cache)
        cache.select([0, 0, 0])
        got = model(nxt, cache=cache).logits[:, -1]
        want = model(torch.cat([prompt.expand(3, -1), nxt], 1)).logits[:, -1]
    assert (got - want).abs().max() <= 1e-4


def test_gradients_reach_every_parameter_except_the_selection_bias(tiny_dict):
    model = _model(variant(tiny_dict))
    for router in model.moe_routers():  # zero bias and enough tokens that every expert is picked
        router.update_bias(torch.zeros(16))
    ids = torch.randint(0, 272, (8, 64))
    out = model(ids, return_hidden=True)
    (out.logits.logsumexp(-1).mean() + out.hidden.pow(2).mean()).backward()
    # The first sub-layer mixes a single source (the embedding): its softmax is identically 1.
    single_source = {
        "model.layers.0.self_attention_res_norm.weight",
        "model.layers.0.self_attention_res_proj.weight",
    }
    for name, p in model.named_parameters():
        if name.endswith("e_score_correction_bias"):
            assert not p.requires_grad and p.grad is None, name
        elif name not in single_source:
            assert p.grad is not None and p.grad.abs().sum() > 0, f"no gradient reaches {name}"


def test_one_block_attn_res_reads_embedding_and_plain_residual_sum(tiny_dict):
    """With one block, each sub-layer's input is the depth mix of [embedding, sum of earlier outputs]."""
    cfg = variant(tiny_dict, attn_res_block_size=tiny_dict["num_hidden_layers"])
    model = _model(cfg)
    ids = torch.randint(0, 272, (1, 12))
    seen_inputs, outputs = [], []
    hooks = []
    for layer in model.model.layers:
        for norm, module in (
            (layer.input_layernorm, layer.self_attn),
            (layer.post_attention_layernorm, layer.block_sparse_moe if layer.is_moe else layer.mlp),
        ):
            hooks.append(norm.register_forward_hook(lambda m, a, o: seen_inputs.append(a[0])))
            hooks.append(
                module.register_forward_hook(
                    lambda m, a, o: outputs.append(o[0] if isinstance(o, tuple) else o)
                )
            )
    with torch.no_grad():
        model(ids)
        emb = model.model.embed_tokens(ids)
        mixers = [
            (lay.self_attention_res_norm, lay.self_attention_res_proj, lay.mlp_res_norm, lay.mlp_res_proj)
            for lay in model.model.layers
        ]
        for j, h in enumerate(seen_inputs):
            norm, proj = mixers[j // 2][2 * (j % 2)], mixers[j // 2][2 * (j % 2) + 1]
            sources = [emb] + ([sum(outputs[:j])] if j else [])
            assert torch.allclose(h, depth_mix(sources, norm, proj), atol=1e-5)
            if j:  # and with zero queries that mix is the mean of the two sources
                zero = torch.nn.Linear(proj.in_features, 1, bias=False).requires_grad_(False)
                zero.weight.zero_()
                assert torch.allclose(
                    depth_mix(sources, norm, zero), (sources[0] + sources[1]) / 2, atol=1e-6
                )
    for hook in hooks:
        hook.remove()


@pytest.mark.parametrize(
    "overrides",
    [
        {"linear_attn_config": {"gate_lower_bound": None, "use_full_rank_gate": False}},  # Kimi-Linear KDA
        {"attn_res_full": True},
        {"attn_res_block_size": None},
        {"routed_expert_hidden_size": 128},  # latent width = d
        {"routed_expert_hidden_size": None},  # standard MoE
        {"hidden_act": "silu"},
    ],
)
def test_every_ablation_switch_builds_and_decodes(tiny_dict, overrides):
    model = _model(variant(tiny_dict, **overrides))
    ids = torch.randint(0, 272, (2, 20))
    with torch.no_grad():
        full = model(ids).logits
        assert torch.isfinite(full).all()
        assert (_decode_in_pieces(model, ids, [10, 11]) - full).abs().max() <= 1e-4


def test_router_update_bias_changes_routing_only(tiny_dict):
    model = _model(variant(tiny_dict))
    router = model.moe_routers()[0]
    names = dict(model.named_parameters())  # a Parameter, not a buffer: weight sync sends it
    assert (
        names["model.layers.1.block_sparse_moe.gate.e_score_correction_bias"]
        is router.e_score_correction_bias
    )
    with pytest.raises(ValueError, match="shape"):
        router.update_bias(torch.zeros(3))
    bias = torch.zeros(16)
    bias[5] = 10.0
    router.update_bias(bias)
    out = model(torch.randint(0, 272, (2, 10)))
    assert float(out.router_stats[0].loads[5]) == 20  # every token picks the boosted expert
    assert out.router_stats[0].layer == 1 and out.router_stats[0].scores.shape == (20, 16)


def test_bad_inputs_raise_clear_errors(tiny_dict):
    model = _model(variant(tiny_dict))
    with pytest.raises(ValueError, match="input_ids"):
        model(torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="attention_mask"):
        model(torch.zeros(2, 5, dtype=torch.long), attention_mask=torch.ones(2, 4))
    with pytest.raises(ValueError, match="cache holds 1"):
        model(torch.zeros(2, 5, dtype=torch.long), cache=model.new_cache(1))


def test_tiny_model_overfits_a_small_batch(tiny_dict):
    model = K3ForCausalLM(variant(tiny_dict))
    ids = torch.randint(0, 272, (4, 32))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(40):
        logits = model(ids[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 272), ids[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] <= 0.1 * losses[0], losses[::10]


def test_kimi_linear_variant_has_no_k3_modules(tiny_dict):
    names = dict(K3ForCausalLM(kimi_linear_variant(tiny_dict)).named_parameters())
    assert not any("_res_" in n or "routed_expert" in n or ".g_proj" in n for n in names)
    assert any(n.endswith("self_attn.g_a_proj.weight") for n in names)


def test_decoding_sees_expert_weight_updates(tiny_dict):
    """The stacked expert weights reused across no-grad calls follow in-place updates (optimizer, copy_)."""
    model = _model(variant(tiny_dict))
    ids = torch.randint(0, 272, (2, 16))
    with torch.no_grad():
        before = model(ids).logits
        for p in model.model.layers[1].block_sparse_moe.experts.parameters():
            p.mul_(5.0)
        after = model(ids).logits
        fresh = K3ForCausalLM(model.config)
        fresh.load_state_dict(model.state_dict())
        assert (after - before).abs().max() > 1e-3
        assert (after - fresh(ids).logits).abs().max() <= 1e-6


def test_bfloat16_forward_tracks_fp32(tiny_dict):
    model = _model(variant(tiny_dict))
    ids = torch.randint(0, 272, (2, 40))
    with torch.no_grad():
        ref = model(ids).logits
        model.to(torch.bfloat16)
        low = model(ids).logits
    assert low.dtype == torch.float32 and torch.isfinite(low).all()
    assert (low - ref).abs().max() <= 0.1 * ref.abs().max() + 0.05
