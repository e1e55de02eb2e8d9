"""LatentMoE with SiTU-GLU experts (K3 "Stable LatentMoE").

Routed experts work in the latent width and are stored stacked (`RoutedExperts`, what the grouped GEMM
takes) under Moonshot's checkpoint names; the router takes a routing-replay override (`RoutingOverride`)
and always reports its own choice, so the learner can measure the mismatch.

Design: docs/design/model.md#model-moe.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kernels import moe_experts
from model.balancing import expert_loads
from model.config import K3Config
from model.ffn import GatedFFN, glu_activation
from model.norm import RMSNorm


@dataclass
class RouterStats:
    """What the learner needs from one MoE layer for balancing and logging (padding tokens excluded)."""

    layer: int  # 0-based decoder layer index
    scores: torch.Tensor  # [m, n] sigmoid router scores (detached, fp32)
    loads: torch.Tensor  # [n] tokens routed to each expert (float), by the experts actually used
    ids: torch.Tensor  # [m, k] the experts each token used (a routing override's where it had one)
    own_ids: torch.Tensor  # [m, k] the router's own top-k (the same tensor as ids without an override)


@dataclass
class RoutingOverride:
    """Experts to use for some tokens of one MoE layer (routing replay): ``ids`` [M, k] (any integer dtype;
    rows where ``mask`` is False are ignored) and ``mask`` [M] bool, over the flattened tokens."""

    ids: torch.Tensor
    mask: torch.Tensor


def _fp32_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` in fp32, also inside a bf16 autocast region (the learner's on CUDA): the router
    scores stay fp32 as in a rollout worker's bf16 policy, so both pick experts from the same precision."""
    if torch.is_autocast_enabled(x.device.type):
        with torch.autocast(device_type=x.device.type, enabled=False):
            return nn.functional.linear(x.float(), weight.float())
    return nn.functional.linear(x.float(), weight.float())


class TopKRouter(nn.Module):
    """Sigmoid router with a selection-only bias (`e_score_correction_bias`, a frozen nn.Parameter).

    The bias is a Parameter (not a buffer) so weight sync sends it; it never receives gradients and
    changes only through `update_bias` (quantile balancing or the sign update, once per step).
    """

    def __init__(self, cfg: K3Config) -> None:
        super().__init__()
        self.num_experts = cfg.num_experts
        self.top_k = cfg.num_experts_per_token
        self.renormalize = cfg.moe_renormalize
        self.routed_scaling_factor = cfg.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(cfg.num_experts), requires_grad=False)

    def forward(
        self, x: torch.Tensor, override: RoutingOverride | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [M, d] -> (scores [M, n] fp32, expert ids used [M, k], weights [M, k] fp32, own ids [M, k]).

        ``override``: tokens whose experts are given (routing replay); their weights are this router's
        scores at the given experts, renormalised as usual, so gradients reach the router as for its own
        choice. The own ids are the router's top-k of ``scores + bias`` whether or not it was overridden.
        """
        scores = torch.sigmoid(_fp32_linear(x, self.weight))
        own = torch.topk(scores.detach() + self.e_score_correction_bias.float(), self.top_k, dim=-1).indices
        if override is None:
            ids = own
        else:
            ids = torch.where(override.mask[:, None], override.ids.to(own.dtype), own)
        weights = scores.gather(1, ids)
        if self.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return scores, ids, weights * self.routed_scaling_factor, own

    @torch.no_grad()
    def update_bias(self, new_bias: torch.Tensor) -> None:
        """Set the selection bias in place (no gradient); used after each learner step."""
        if new_bias.shape != self.e_score_correction_bias.shape:
            raise ValueError(
                f"update_bias: expected a bias of shape {tuple(self.e_score_correction_bias.shape)}, "
                f"got {tuple(new_bias.shape)}"
            )
        self.e_score_correction_bias.copy_(new_bias.to(self.e_score_correction_bias))


EXPERT_WEIGHTS = ("w1", "w3", "w2")  # gate [E, I, l], up [E, I, l], down [E, l, I]: checkpoint order


def expert_key(prefix: str, expert: int, weight: str) -> str:
    """The checkpoint name of one expert's weight: ``{prefix}{expert}.{weight}.weight`` (``w1``/``w3``/``w2``
    as in Moonshot's checkpoints, where each expert is a module of three linear layers)."""
    return f"{prefix}{expert}.{weight}.weight"


def stacked_slot(name: str) -> tuple[str, int | None]:
    """Where a checkpoint name lives in the model: ``(..experts.wN, E)`` for a routed expert's
    ``..experts.E.wN.weight``, else ``(name, None)``."""
    head, sep, tail = name.rpartition(".experts.")
    parts = tail.split(".")
    if sep and len(parts) == 3 and parts[0].isdigit() and parts[1] in EXPERT_WEIGHTS and parts[2] == "weight":
        return f"{head}.experts.{parts[1]}", int(parts[0])
    return name, None


def parameter_names(module: nn.Module) -> list[str]:
    """The checkpoint names of ``module``'s parameters: a stacked expert weight counts as its experts'
    ``experts.E.wN.weight`` (buffers and other state are not included)."""
    names = []
    for name, param in module.named_parameters():
        head, _, weight = name.rpartition(".")
        if head.endswith(".experts") and weight in EXPERT_WEIGHTS:
            names += [expert_key(head + ".", e, weight) for e in range(param.shape[0])]
        else:
            names.append(name)
    return names


def write_per_expert(state: dict, prefix: str, stacked: dict[str, torch.Tensor], first: int = 0) -> None:
    """Write ``stacked`` (``{"w1": [E, ...], ...}``: experts ``first`` .. ``first + E - 1``) into ``state``
    under the per-expert names of `expert_key`, expert after expert (views of the stacked tensors)."""
    for index in range(next(iter(stacked.values())).shape[0]):
        for weight in EXPERT_WEIGHTS:
            if weight in stacked:
                state[expert_key(prefix, first + index, weight)] = stacked[weight][index]


class RoutedExperts(nn.Module):
    """The routed experts of one LatentMoE layer, stored stacked: ``w1`` (gate) and ``w3`` (up) [E, I, l],
    ``w2`` (down) [E, l, I], the layout the grouped GEMM takes (no re-stacking per forward).

    Outside, they keep the per-expert checkpoint names ``experts.E.w1.weight`` ...: ``state_dict`` splits
    the stacked tensors into per-expert views and ``load_state_dict`` stacks per-expert tensors, so
    ``save_pretrained``, weight sync and old checkpoints see what they always saw. A sharded learner's
    parameters (DTensors: rows on several ranks) keep their stacked names, which
    ``torch.distributed.checkpoint`` reshards. With expert parallelism the stacked tensor is a DTensor
    split over the expert dimension; the forward runs this rank's experts (`local_weights`).
    """

    def __init__(self, cfg: K3Config) -> None:
        super().__init__()
        experts, width, intermediate = cfg.num_experts, cfg.expert_width, cfg.moe_intermediate_size
        self.w1 = nn.Parameter(torch.empty(experts, intermediate, width))
        self.w3 = nn.Parameter(torch.empty(experts, intermediate, width))
        self.w2 = nn.Parameter(torch.empty(experts, width, intermediate))
        self.activation = glu_activation(cfg)
        self.situ = cfg.hidden_act == "situ"
        self.betas = (cfg.activation_situ_beta, cfg.activation_situ_linear_beta)
        self.register_state_dict_post_hook(_per_expert_state)
        self.register_load_state_dict_pre_hook(_stacked_state)

    @torch.no_grad()
    def reset_parameters(self, std: float) -> None:
        """Normal(0, std) expert by expert, in checkpoint order (w1, w3, w2 of expert 0, then expert 1, ...),
        so a seed gives the weights it gave when every expert was a module of three linear layers."""
        for expert in range(self.w1.shape[0]):
            for weight in EXPERT_WEIGHTS:
                nn.init.normal_(getattr(self, weight)[expert], std=std)

    def local_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(w1, w3, w2) of the experts this process holds: the whole stack, or under expert parallelism
        this rank's slice of the DTensor (differentiable: gradients reach the DTensor parameters)."""
        return tuple(_local(getattr(self, w)) for w in EXPERT_WEIGHTS)  # type: ignore[return-value]

    def forward(self, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """u [M, l] = sum_j weights[:, j] E_{ids[:, j]}(h) over local expert indices ``ids`` [M, k]."""
        w_gate, w_up, w_down = self.local_weights()
        weights = weights.to(h.dtype)
        if self.situ:
            return moe_experts(h, ids, weights, w_gate, w_up, w_down, *self.betas)
        return _experts_loop(h, ids, weights, w_gate, w_up, w_down, self.activation)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _is_sharded(tensor: torch.Tensor) -> bool:
    return hasattr(tensor, "placements")  # a DTensor


def _per_expert_state(module: RoutedExperts, state: dict, prefix: str, local_metadata: dict) -> None:
    """``state_dict`` post-hook: the stacked tensors under per-expert checkpoint names, in the old
    module order; a sharded (DTensor) stack keeps its stacked names (see `RoutedExperts`)."""
    keys = [prefix + w for w in EXPERT_WEIGHTS]
    if any(key not in state or _is_sharded(state[key]) for key in keys):
        return
    stacked = {w: state.pop(prefix + w) for w in EXPERT_WEIGHTS}
    write_per_expert(state, prefix, stacked)


def _stacked_state(module: RoutedExperts, state: dict, prefix: str, local_metadata, strict, missing_keys,
                   unexpected_keys, error_msgs) -> None:  # fmt: skip
    """``load_state_dict`` pre-hook: per-expert tensors (all of them, for each weight) stacked under the
    parameter's name; some experts without the others are an error naming the first one missing."""
    experts = module.w1.shape[0]
    for weight in EXPERT_WEIGHTS:
        keys = [expert_key(prefix, e, weight) for e in range(experts)]
        given = [key in state for key in keys]
        if prefix + weight in state or not any(given):
            continue
        if all(given):
            state[prefix + weight] = torch.stack([state.pop(key) for key in keys])
        else:
            error_msgs.append(f"{keys[given.index(False)]} is missing ({sum(given)} of {experts} experts' "
                              f"{weight} given)")  # fmt: skip
            for key in keys:
                state.pop(key, None)


class LatentMoE(nn.Module):
    """Router on full-width x, experts in the latent width, RMSNorm before W_up, shared experts."""

    def __init__(self, cfg: K3Config, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.cfg = cfg
        self.gate = TopKRouter(cfg)
        width = cfg.expert_width
        self.activation = glu_activation(cfg)
        self.experts = RoutedExperts(cfg)
        self.shared_experts = (
            GatedFFN(cfg.hidden_size, cfg.moe_intermediate_size * cfg.num_shared_experts, self.activation)
            if cfg.num_shared_experts
            else None
        )
        if cfg.uses_latent_moe:
            self.routed_expert_down_proj = nn.Linear(cfg.hidden_size, width, bias=False)
            self.routed_expert_norm = RMSNorm(width, cfg.rms_norm_eps) if cfg.latent_moe_use_norm else None
            self.routed_expert_up_proj = nn.Linear(width, cfg.hidden_size, bias=False)
        # expert parallelism (`model.expert_parallel.shard_experts`): this rank's experts only, tokens
        # dispatched to the others' in the latent width; None = every expert here
        self.expert_parallel = None

    def forward(
        self, x: torch.Tensor, valid: torch.Tensor | None = None, override: RoutingOverride | None = None
    ) -> tuple[torch.Tensor, RouterStats]:
        """x [B, T, d], valid [B, T] bool (None = all real) -> (y [B, T, d], router stats of real tokens).

        ``override``: experts for some of the B*T tokens (flattened; see `TopKRouter.forward`)."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        scores, ids, weights, own = self.gate(flat, override)
        h = self.routed_expert_down_proj(flat) if self.cfg.uses_latent_moe else flat
        if self.expert_parallel is None:
            u = self.experts(h, ids, weights)
        else:  # the same sum, over experts on every rank (all_to_all of h and of the experts' outputs)
            u = self.expert_parallel(self.experts, h, ids, weights)
        if self.cfg.uses_latent_moe:
            if self.routed_expert_norm is not None:
                u = self.routed_expert_norm(u)
            u = self.routed_expert_up_proj(u)
        y = u.reshape(shape)  # the shared experts' sum makes it a tensor of its own (no view of u)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        real = slice(None) if valid is None else valid.reshape(-1)
        used = ids[real]
        stats = RouterStats(
            layer=self.layer_idx,
            scores=scores.detach()[real],
            loads=expert_loads(used, self.cfg.num_experts),
            ids=used,
            own_ids=used if own is ids else own[real],
        )
        return y, stats


def _experts_loop(h, ids, weights, w_gate, w_up, w_down, activation) -> torch.Tensor:
    """Routed experts with an arbitrary GLU activation (the SwiGLU ablation; `moe_experts` is SiTU-only)."""
    y = torch.zeros_like(h)
    for e in torch.unique(ids).tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        he = h[tok]
        out = activation(he @ w_gate[e].T, he @ w_up[e].T) @ w_down[e].T
        y = y.index_add(0, tok, out * weights[tok, slot].unsqueeze(-1))
    return y
