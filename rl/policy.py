"""Building the K3 policy: initialised (the learner, evaluation) or as an empty shell that a rollout
worker fills with the learner's weights. A module of its own so that the learner and the workers import
it without importing each other."""

from __future__ import annotations

import torch

from model import K3Config, K3ForCausalLM


def build_policy(model_cfg: K3Config, seed: int) -> K3ForCausalLM:
    """A freshly initialised K3 policy; the same ``seed`` gives the same weights in every process."""
    torch.manual_seed(seed)
    return K3ForCausalLM(model_cfg)


def build_policy_shell(model_cfg: K3Config) -> K3ForCausalLM:
    """A K3 policy whose tensors are allocated but never initialised, to be filled by ``load_state_dict``.

    Built on the ``meta`` device (no init kernels run, no RNG draw) and then given uninitialised CPU
    storage: a rollout worker gets its weights from the learner, so a random init would be wasted work.
    The K3 policy has no buffers, so every tensor it holds is in its state dict and gets loaded.
    """
    with torch.device("meta"):
        model = K3ForCausalLM(model_cfg)
    model = model.to_empty(device="cpu")
    if model_cfg.tie_word_embeddings:  # to_empty gives each module its own tensor: tie them again
        model.lm_head.weight = model.model.embed_tokens.weight
    return model
