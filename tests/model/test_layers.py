"""Layer-level checks: SiTU-GLU, AttnRes mixing, KDA chunked vs recurrent, MLA absorbed vs expanded."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from model_testutil import variant

from kernels import naive_recurrent_kda
from model import situ_glu
from model.attn_res import DepthSources, depth_mix, make_depth_query
from model.cache import KDALayerCache, MLALayerCache
from model.kda import KimiDeltaAttention
from model.mla import MultiHeadLatentAttention
from model.norm import l2_normalize


def test_situ_glu_is_bounded_by_100_for_huge_inputs():
    z = torch.cat([torch.linspace(-1e6, 1e6, 20001), torch.tensor([-1e6, 1e6, 0.0])])
    gate, up = torch.meshgrid(z[::50], z[::50], indexing="ij")
    out = situ_glu(gate, up)
    assert torch.isfinite(out).all()
    assert out.abs().max() <= 100.0
    assert out.abs().max() > 99.0  # the bound is reached, not just respected by a vanishing output


def test_situ_glu_equals_swiglu_near_zero():
    z = torch.linspace(-0.1, 0.1, 201)
    gate, up = torch.meshgrid(z, z, indexing="ij")
    assert (situ_glu(gate, up) - F.silu(gate) * up).abs().max() <= 1e-3


def test_depth_mix_with_zero_query_is_the_uniform_mixture():
    norm, proj = make_depth_query(8, 1e-5)
    sources = [torch.randn(2, 3, 8) * s for s in (1.0, 10.0, 0.1)]
    assert torch.allclose(depth_mix(sources, norm, proj), sum(sources) / 3, atol=1e-6)


def test_depth_mix_weights_follow_the_normalised_keys():
    norm, proj = make_depth_query(4, 1e-6)
    with torch.no_grad():
        proj.weight.copy_(torch.tensor([[5.0, 0.0, 0.0, 0.0]]))
    a = torch.tensor([[1.0, 0.0, 0.0, 0.0]]) * 100  # large magnitude must not matter: keys are RMS-normed
    b = torch.tensor([[0.0, 1.0, 0.0, 0.0]])
    w = torch.softmax(
        torch.tensor([5.0 * 2.0, 0.0]), 0
    )  # RMSNorm of a one-hot of width 4 is 2 at the hot entry
    assert torch.allclose(depth_mix([a, b], norm, proj), w[0] * a + w[1] * b, atol=1e-4)


def test_depth_sources_block_bookkeeping():
    src = DepthSources(torch.zeros(1))
    assert len(src.sources()) == 1
    src.add(torch.ones(1))
    src.add(torch.ones(1))
    assert [float(s) for s in src.sources()] == [0.0, 2.0]
    src.close_block()
    src.add(torch.full((1,), 5.0))
    assert [float(s) for s in src.sources()] == [0.0, 2.0, 5.0]


def _kda_reference(layer: KimiDeltaAttention, x: torch.Tensor) -> torch.Tensor:
    """The layer's maths written out with the token-by-token recurrence (kernels' naive oracle)."""
    h, dk = layer.num_heads, layer.head_dim
    q, _ = layer.q_conv1d(layer.q_proj(x))
    k, _ = layer.k_conv1d(layer.k_proj(x))
    v, _ = layer.v_conv1d(layer.v_proj(x))
    q, k = l2_normalize(q.unflatten(-1, (h, dk))), l2_normalize(k.unflatten(-1, (h, dk)))
    o, _ = naive_recurrent_kda(q, k, v.unflatten(-1, (h, dk)), layer.decay(x), torch.sigmoid(layer.b_proj(x)))
    return layer.o_proj(layer.o_norm(o, layer.output_gate(x)).flatten(-2))


def test_kda_layer_chunked_equals_naive_recurrence_across_chunks(tiny_dict):
    for lac in ({}, {"gate_lower_bound": None, "use_full_rank_gate": False}):
        layer = KimiDeltaAttention(variant(tiny_dict, linear_attn_config=lac), 0)
        layer.reset_gate_parameters()
        x = torch.randn(2, 150, layer.q_proj.in_features)  # 150 = two full 64-chunks and a ragged tail
        with torch.no_grad():
            assert (layer(x) - _kda_reference(layer, x)).abs().max() <= 1e-5


def test_kda_gates_stay_in_range(tiny_dict):
    layer = KimiDeltaAttention(variant(tiny_dict), 0)
    layer.reset_gate_parameters()
    g = layer.decay(torch.randn(2, 10, layer.q_proj.in_features) * 1e4)
    assert (g >= -5.0).all() and (g <= 0).all()  # K3: lower bound -5 (reached only in fp32 saturation)
    assert g.min() < -4.9 and g.max() > -0.1  # the range is used, not collapsed


def test_kda_layer_decode_steps_equal_prefill(tiny_dict):
    layer = KimiDeltaAttention(variant(tiny_dict), 0)
    layer.reset_gate_parameters()
    x = torch.randn(2, 70, layer.q_proj.in_features)
    with torch.no_grad():
        full = layer(x)
        cache = KDALayerCache()
        parts = [layer(x[:, :67], cache=cache)] + [layer(x[:, t : t + 1], cache=cache) for t in range(67, 70)]
    assert (torch.cat(parts, 1) - full).abs().max() <= 1e-5


def test_mla_absorbed_decode_equals_expanded_attention(tiny_dict):
    for q_lora in (64, None):
        layer = MultiHeadLatentAttention(variant(tiny_dict, q_lora_rank=q_lora), 3)
        x = torch.randn(2, 20, layer.o_proj.out_features)
        with torch.no_grad():
            full = layer(x)
            cache = MLALayerCache()
            parts = [layer(x[:, :5], cache=cache)] + [
                layer(x[:, t : t + 1], cache=cache) for t in range(5, 20)
            ]
        assert (torch.cat(parts, 1) - full).abs().max() <= 1e-5
        assert cache.c_kv.shape[-1] + cache.k_extra.shape[-1] == 64 + 16  # kv_lora + unrotated key dims


def test_mla_has_no_position_dependence_beyond_causality(tiny_dict):
    """NoPE: permuting the earlier keys does not change the last token's output."""
    layer = MultiHeadLatentAttention(variant(tiny_dict), 3)
    x = torch.randn(1, 9, layer.o_proj.out_features)
    perm = torch.cat([torch.randperm(8), torch.tensor([8])])
    with torch.no_grad():
        assert torch.allclose(layer(x)[:, -1], layer(x[:, perm])[:, -1], atol=1e-6)
