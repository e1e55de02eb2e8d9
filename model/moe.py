"""LatentMoE with SiTU-GLU experts (K3 "Stable LatentMoE").

    s = sigmoid(W_r x)                          full-width router, fp32
    TopK = top-k of s + b                       b = e_score_correction_bias selects only (no gradient)
    p_i = s_i / sum_TopK s * routed_scaling     weights from the *unbiased* scores
    u = sum_{i in TopK} p_i E_i(W_down x)       routed experts in the latent width l
    y = sum_j Shared_j(x) + W_up RMSNorm(u)     shared experts at full width

Routing replay (R3, "Rollout Routing Replay"): `TopKRouter.forward` takes an optional `RoutingOverride`
of chosen expert ids per token with a mask of the tokens that have one; those tokens use the given
experts, weighted by this router's own scores at them (so the router still gets gradients), and every
other token routes normally. The router's own choice is computed either way and reported in
`RouterStats.own_ids`, so the learner can measure how often it differs from the rollout's.

Expert parallelism (`model.expert_parallel`): u's sum runs over experts held by other ranks, reached by
all_to_all in the latent width l (h and the experts' outputs travel, never x).

Module names follow Moonshot's checkpoints (`gate`, `experts.E.w1/w3/w2`, `shared_experts`,
`routed_expert_down_proj`, `routed_expert_norm`, `routed_expert_up_proj`). With
`routed_expert_hidden_size: null` the block is a standard DeepSeek-V3-style MoE (experts on x).
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


class Expert(nn.Module):
    """One routed expert: w1 (gate) and w3 (up) [I, l], w2 (down) [l, I] (checkpoint names)."""

    def __init__(self, width: int, intermediate: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(width, intermediate, bias=False)
        self.w3 = nn.Linear(width, intermediate, bias=False)
        self.w2 = nn.Linear(intermediate, width, bias=False)


class LatentMoE(nn.Module):
    """Router on full-width x, experts in the latent width, RMSNorm before W_up, shared experts."""

    def __init__(self, cfg: K3Config, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.cfg = cfg
        self.gate = TopKRouter(cfg)
        width = cfg.expert_width
        self.experts = nn.ModuleList(Expert(width, cfg.moe_intermediate_size) for _ in range(cfg.num_experts))
        self.activation = glu_activation(cfg)
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
            u = self._routed(h, ids, weights)
        else:  # the same sum, over experts on every rank (all_to_all of h and of the experts' outputs)
            u = self.expert_parallel(self, h, ids, weights)
        if self.cfg.uses_latent_moe:
            if self.routed_expert_norm is not None:
                u = self.routed_expert_norm(u)
            u = self.routed_expert_up_proj(u)
        y = u if self.shared_experts is None else u + self.shared_experts(flat)
        real = slice(None) if valid is None else valid.reshape(-1)
        used = ids[real]
        stats = RouterStats(
            layer=self.layer_idx,
            scores=scores.detach()[real],
            loads=expert_loads(used, self.cfg.num_experts),
            ids=used,
            own_ids=used if own is ids else own[real],
        )
        return y.reshape(shape), stats

    def _routed(self, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        w_gate, w_up, w_down = self._stacked_expert_weights()
        if self.cfg.hidden_act == "situ":
            return moe_experts(
                h, ids, weights.to(h.dtype), w_gate, w_up, w_down,
                self.cfg.activation_situ_beta, self.cfg.activation_situ_linear_beta,
            )  # fmt: skip
        return _experts_loop(h, ids, weights.to(h.dtype), w_gate, w_up, w_down, self.activation)

    def _stacked_expert_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The experts' weights as [E, I, l], [E, I, l], [E, l, I] for `kernels.moe_experts`.

        The per-expert modules keep the checkpoint names (and `named_parameters()` yields them, as weight
        sync needs). With autograd on, the stack is rebuilt each call so gradients reach every expert;
        without it (decoding) the stack is reused until a weight changes: in-place updates through the
        parameter (optimizer steps, `load_state_dict`, `p.copy_` under no_grad) bump its version and are
        seen; writes through `p.data` are not, so call `K3ForCausalLM.invalidate_weight_caches()` after them.
        """
        params = [p for e in self.experts for p in (e.w1.weight, e.w3.weight, e.w2.weight)]
        if torch.is_grad_enabled() and any(p.requires_grad for p in params):
            self._stack_cache = None
            return self._stack(params)
        key = tuple((p.data_ptr(), p._version, p.dtype, p.device) for p in params)
        cached = getattr(self, "_stack_cache", None)
        if cached is None or cached[0] != key:
            cached = (key, self._stack(params))
            self._stack_cache = cached
        return cached[1]

    def invalidate_weight_cache(self) -> None:
        self._stack_cache = None

    @staticmethod
    def _stack(params: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return tuple(torch.stack(params[i::3]) for i in range(3))  # type: ignore[return-value]


def _experts_loop(h, ids, weights, w_gate, w_up, w_down, activation) -> torch.Tensor:
    """Routed experts with an arbitrary GLU activation (the SwiGLU ablation; `moe_experts` is SiTU-only)."""
    y = torch.zeros_like(h)
    for e in torch.unique(ids).tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        he = h[tok]
        out = activation(he @ w_gate[e].T, he @ w_up[e].T) @ w_down[e].T
        y = y.index_add(0, tok, out * weights[tok, slot].unsqueeze(-1))
    return y
