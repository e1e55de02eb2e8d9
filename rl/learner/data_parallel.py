"""How a `rl.learner.learner.Learner` rank shares the batch with the others (``trainer.learner.world_size``; a
learner of one rank is the group of size 1, where every share is the whole).

Each rank forwards its run of whole groups and its loss is its share of the global loss, so the summed
gradients equal the single-rank ones; router scores are gathered exactly for quantile balancing.

Design: docs/design/training.md#rl-data-parallel.
"""

from __future__ import annotations

import torch

from model.expert_parallel import ExpertParallel
from rl.learner.ranks import RankGroup


class DataParallel:
    """One rank's share of the batch, its loss and its metrics (see the module docstring);
    ``dispatchers``: the MoE layers' expert-parallel exchanges (their traffic is logged)."""

    def __init__(self, group: RankGroup, dispatchers: list[ExpertParallel]) -> None:
        self.group = group
        self.dispatchers = dispatchers

    # ------------------------------------------------------------------ rows
    def local_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """This rank's run of ``rows`` (whole groups; the config check makes the split even)."""
        return rows.view(self.group.world_size, -1)[self.group.rank]

    def gather_rows(
        self, local: torch.Tensor | None, rows: torch.Tensor, batch_size: int
    ) -> torch.Tensor | None:
        """The ``[batch_size, ...]`` tensor whose ``rows`` every rank computed a run of (``local``)."""
        if local is None:
            return None
        every = self.group.all_gather_equal(local)
        full = local.new_zeros((batch_size, *local.shape[1:]))
        full[rows.view(self.group.world_size, -1)] = every
        return full

    # ------------------------------------------------------------------ loss and metrics
    def loss_shares(self, mask: torch.Tensor, aggregation: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(policy-loss share, token-mean share) of this rank: its weight in the global loss.

        A rank's masked mean over its own rows times ``max(local count, 1) / max(global count, 1)`` is
        its part of the global masked mean (count = tokens, or sequences with tokens for the
        ``seq_mean_*`` aggregations, as ``rl.algos.aggregate`` counts them)."""
        tokens = mask.sum()
        sequences = (mask.sum(dim=1) > 0).float().sum()
        counts = torch.stack([tokens, sequences]).float()
        total = self.group.all_reduce_sum(counts)
        shares = counts.clamp_min(1.0) / total.clamp_min(1.0)
        policy = shares[0] if aggregation == "token_mean" else shares[1]
        return policy, shares[0]

    def global_metrics(self, metrics: dict[str, float], token_share: float) -> dict[str, float]:
        """One optimizer step's metrics over the global batch: the loss terms are already this rank's
        shares (summed), the token means ``clip_fraction`` / ``approx_kl`` are weighted by the rank's
        tokens then summed; ``grad_norm`` is global already."""
        local = dict(metrics)
        for key in ("clip_fraction", "approx_kl"):
            local[key] = local[key] * token_share
        summed_keys = sorted(k for k in local if k != "grad_norm")
        total = self.group.all_reduce_sum(self.group.tensor([local[k] for k in summed_keys], torch.float64))
        return metrics | dict(zip(summed_keys, total.tolist(), strict=True))

    # ------------------------------------------------------------------ balancing
    def pooled_scores(self, scores: torch.Tensor) -> torch.Tensor:
        """The router scores of every rank's tokens of this step (exact gather, rank order)."""
        return self.group.all_gather_rows(scores)

    def summed_loads(self, loads: torch.Tensor) -> torch.Tensor:
        return self.summed(loads)

    def summed(self, counts: torch.Tensor) -> torch.Tensor:
        """``counts`` summed over the ranks (a batch-wide figure from each rank's share of it), on the
        device ``counts`` came from."""
        return self.group.all_reduce_sum(counts.to(self.group.device)).to(counts.device)

    def traffic(self) -> dict[str, float]:
        """What every rank sent through the expert all_to_alls since the last call, summed over the ranks
        (`model.expert_parallel.ExpertTraffic`: activations in the latent width and at the backbone width,
        all MoE layers, forward and backward; the routing metadata; the pairs routed); counters reset."""
        if not self.dispatchers:
            return {}
        keys = ("latent_bytes", "backbone_bytes", "metadata_bytes", "pairs")
        local = [float(sum(getattr(d.traffic, key) for d in self.dispatchers)) for key in keys]
        for d in self.dispatchers:
            d.traffic.reset()
        total = dict(zip(keys, self.group.all_reduce_sum(self.group.tensor(local, torch.float64)).tolist(),
                         strict=True))
        return {
            "ep_latent_bytes": total["latent_bytes"],
            "ep_backbone_bytes": total["backbone_bytes"],
            "ep_metadata_bytes": total["metadata_bytes"],
            "ep_sent_bytes": total["latent_bytes"] + total["metadata_bytes"],
            "ep_pairs": total["pairs"],
        }
