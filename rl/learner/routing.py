"""Routing replay (R3) on the learner's side: the rollout's recorded experts as a forward's override, and
how often the learner's own routing differs from them.

MoE RL drifts when rollout and learner route a token differently; ``algo.routing_replay`` trains on the
rollout's routes, and `routing_mismatch` is logged from counts summed over the ranks.

Design: docs/design/training.md#rl-routing.
"""

from __future__ import annotations

import torch

from model.k3 import RecordedRoutes
from model.moe import RouterStats


def recorded_mask(routes: torch.Tensor) -> torch.Tensor:
    """[B, T] bool: the positions of ``routes`` [B, T, n_moe_layers, top_k] that hold a record (no -1)."""
    if not routes.shape[2]:  # a model without MoE layers
        return torch.zeros(routes.shape[:2], dtype=torch.bool, device=routes.device)
    return (routes >= 0).flatten(2).all(-1)


def recorded_routes(routes: torch.Tensor) -> RecordedRoutes:
    """The forward override of input ids [B, T] from `TensorBatch.routes` [B, T-1, L, k] (records of input
    positions 0..T-2; the last position predicts nothing and routes by itself)."""
    last = torch.full_like(routes[:, :1], -1)
    ids = torch.cat([routes, last], dim=1)
    return RecordedRoutes(ids, recorded_mask(ids))


def own_routing(router_stats: list[RouterStats], attention_mask: torch.Tensor) -> torch.Tensor:
    """The learner's own top-k of every input position: [B, T, n_moe_layers, top_k] (-1 on padding).

    ``router_stats`` hold the real tokens only, row after row; ``attention_mask`` [B, T] says which."""
    real = attention_mask.bool().reshape(-1)
    layers = []
    for stats in router_stats:
        ids = torch.full((real.numel(), stats.own_ids.shape[-1]), -1, dtype=torch.long, device=real.device)
        ids[real] = stats.own_ids.to(real.device)
        layers.append(ids.view(*attention_mask.shape, -1))
    return torch.stack(layers, dim=2)


def mismatch_counts(
    router_stats: list[RouterStats], attention_mask: torch.Tensor, routes: torch.Tensor
) -> tuple[list[int], torch.Tensor]:
    """(the MoE layers, counts) of one forward over a batch with `TensorBatch.routes` ``routes``: counts is
    float64 ``[n_layers + 2]`` on the batch's device: per layer the recorded tokens whose own top-k set
    differs from the record, then the tokens that differ in any layer, then the recorded tokens. Counts
    add up over the ranks of a sharded learner; they are zeros when no token here has a record."""
    layers = [stats.layer for stats in router_stats]
    counts = torch.zeros(len(layers) + 2, dtype=torch.float64, device=attention_mask.device)
    mask = recorded_mask(routes)
    if not layers or not bool(mask.any()):
        return layers, counts
    own = own_routing(router_stats, attention_mask)[:, :-1][mask]  # [n, L, k], the recorded positions
    recorded = routes[mask].to(own.device)
    differs = (own.sort(-1).values != recorded.sort(-1).values).any(-1)  # [n, L] top-k sets differ
    counts[: len(layers)] = differs.sum(0).to(counts)
    counts[-2] = differs.any(-1).sum().to(counts)
    counts[-1] = float(mask.sum())
    return layers, counts


def mismatch_metrics(layers: list[int], counts: torch.Tensor) -> dict[str, float]:
    """The mismatch metrics (module docstring) of `mismatch_counts` (summed over ranks, or not); {} when no
    token has a record (an engine that records none) or the model has no MoE layer."""
    recorded = float(counts[-1])
    if not layers or recorded == 0:
        return {}
    per_layer = [float(c) / recorded for c in counts[: len(layers)].tolist()]
    metrics = {f"routing_mismatch/layer{n}": v for n, v in zip(layers, per_layer, strict=True)}
    metrics["routing_mismatch"] = sum(per_layer) / len(per_layer)
    metrics["routing_mismatch_any"] = float(counts[-2]) / recorded
    metrics["routing_recorded_tokens"] = recorded
    return metrics


def routing_mismatch(
    router_stats: list[RouterStats], attention_mask: torch.Tensor, routes: torch.Tensor
) -> dict[str, float]:
    """The mismatch metrics of one forward over ``attention_mask``'s rows (one process's view)."""
    return mismatch_metrics(*mismatch_counts(router_stats, attention_mask, routes))
