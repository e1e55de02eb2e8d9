"""Building the K3 policy: initialised (the learner, evaluation) or as an empty shell that a rollout
worker fills with the learner's weights. A module of its own so that the learner and the workers import
it without importing each other."""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from model import K3Config, K3ForCausalLM

# The random fills of parameter initialisation: torch.nn.init's random initialisers (a mode sees the
# initialiser, not the fill it calls) and the tensors' own random fills.
_RANDOM_FILLS = frozenset({
    torch.nn.init.normal_, torch.nn.init.uniform_, torch.nn.init.trunc_normal_, torch.nn.init.kaiming_normal_,
    torch.nn.init.kaiming_uniform_, torch.nn.init.xavier_normal_, torch.nn.init.xavier_uniform_,
    torch.nn.init.orthogonal_, torch.nn.init.sparse_,
    torch.Tensor.normal_, torch.Tensor.uniform_, torch.Tensor.bernoulli_, torch.Tensor.random_,
    torch.Tensor.exponential_, torch.Tensor.geometric_, torch.Tensor.log_normal_, torch.Tensor.cauchy_,
})


class _NoRandomFills(TorchFunctionMode):
    """Inside it, a random fill of a tensor leaves the tensor as it is and draws nothing from the RNG."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _RANDOM_FILLS:
            return args[0] if args else kwargs["tensor"]  # torch.nn.init's are called with tensor=
        return func(*args, **kwargs)


def build_policy(model_cfg: K3Config, seed: int) -> K3ForCausalLM:
    """A freshly initialised K3 policy; the same ``seed`` gives the same weights in every process."""
    torch.manual_seed(seed)
    return K3ForCausalLM(model_cfg)


def build_policy_shell(model_cfg: K3Config) -> K3ForCausalLM:
    """A K3 policy whose tensors are allocated but not randomly initialised, to be filled by
    ``load_state_dict``: a rollout worker gets its weights from the learner, so a random init would be
    wasted work, and it draws nothing from the process's RNG. (Built on the CPU with the random fills
    skipped rather than on the ``meta`` device: there the init's operations import ``torch._dynamo``,
    about 2 s of every worker's start.) The K3 policy has no buffers, so every tensor it holds is in its
    state dict and gets loaded."""
    with _NoRandomFills():
        return K3ForCausalLM(model_cfg)
