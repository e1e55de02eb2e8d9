"""Numerics oracle: with K3's extra features off, transformers' KimiLinearForCausalLM reads our checkpoint and
computes the same fp32 logits (KDA with Kimi-Linear gate, NoPE MLA, DeepSeek-V3 routing with the correction
bias, shared experts, dense first layer, SwiGLU).

The test-only extra `oracle = ["transformers>=5.17,<6"]` provides transformers. flash-linear-attention must
not be importable here (transformers prefers it, and it cannot run on CPU), so it is blocked before import.
"""

from __future__ import annotations

import sys

import pytest
import torch
from model_testutil import kimi_linear_variant
from safetensors.torch import load_file, save_file

from model import K3ForCausalLM


@pytest.fixture(scope="module")
def kimi_linear_class():
    sys.modules.setdefault(
        "fla", None
    )  # block flash-linear-attention: transformers would pick it and fail on CPU
    import transformers  # the numerics oracle is in the locked test set (the `oracle` extra)

    cls = getattr(transformers, "KimiLinearForCausalLM", None)
    assert cls is not None, (
        f"transformers {transformers.__version__} has no KimiLinearForCausalLM (needs >= 5.17); "
        "reinstall the locked test set: make bootstrap"
    )
    transformers.logging.set_verbosity_error()
    return cls


def _load_in_transformers(cls, model: K3ForCausalLM, directory):
    """Save with `save_pretrained` and load with transformers. transformers <= 5.24 wants the old 4-D
    `A_log` [1, 1, H, 1] (Moonshot's current checkpoints and vLLM use [H]; vLLM reads both): when it
    refuses [H], that one tensor is rewritten in the 4-D layout and the load retried."""
    model.save_pretrained(directory)
    try:
        return cls.from_pretrained(directory, dtype=torch.float32)
    except RuntimeError:  # a size mismatch (its report names A_log); any other problem fails the retry too
        pass
    path = str(directory / "model.safetensors")
    state = {k: (v.view(1, 1, -1, 1) if k.endswith(".A_log") else v) for k, v in load_file(path).items()}
    save_file(state, path, metadata={"format": "pt"})
    return cls.from_pretrained(directory, dtype=torch.float32)


@pytest.mark.parametrize("q_lora_rank", [64, None])
def test_transformers_kimi_linear_gives_the_same_logits(kimi_linear_class, tiny_dict, tmp_path, q_lora_rank):
    cfg = kimi_linear_variant(tiny_dict, q_lora_rank=q_lora_rank)
    model = K3ForCausalLM(cfg)
    with torch.no_grad():  # make every part matter: non-trivial selection bias, larger weights
        for router in model.moe_routers():
            router.update_bias(torch.randn(cfg.num_experts) * 0.05)
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(3.0)
    reference = _load_in_transformers(kimi_linear_class, model, tmp_path).eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 100))  # > one 64-token KDA chunk
    with torch.no_grad():
        ours = model(ids).logits
        theirs = reference(ids).logits.float()
    assert ours.abs().max() > 0.5  # logits of a real scale, not all ~0
    diff = (ours - theirs).abs().max()
    print(f"max |logit difference| vs transformers: {diff:.2e} (logit scale {ours.abs().max():.2f})")
    assert diff <= 1e-4
