"""What a `rl.learner.Learner` rank does differently when ``trainer.learner.world_size`` > 1.

- **Rows**: every rank receives the whole batch (collating it is cheap) and computes the advantages on it;
  each optimizer step's rows (whole groups, ``algo.minibatches`` of them per batch) are split into
  ``world_size`` equal runs of whole groups, and a rank forwards only its run (`local_rows`). Per-token
  tensors the whole batch needs (the pre-update log-probs and values) are gathered back (`gather_rows`).
- **Loss**: each rank's loss is its share of the global loss (`loss_shares`: its token or sequence
  count over the global one, as ``algo.loss_aggregation`` weighs them), so the gradients summed over the
  ranks are the single-rank gradient (`rl.sharding.sharded_optimizer_step`).
- **Weights**: parameters and AdamW state sharded (`rl.sharding.FlatShard`), routed experts split when
  ``expert_parallel`` = world_size (`model.expert_parallel`).
- **Balancing**: quantile balancing needs every rank's router scores of the step: they are gathered
  exactly (`pooled_scores`, one all_gather of [tokens, experts] per MoE layer) and every rank solves the
  same bias. Exact, at the cost of m x n floats per layer on each rank; a sharded histogram would send
  ~1000 bins per expert instead, and approximate the quantile.
"""

from __future__ import annotations

import torch
from torch import nn

from model.expert_parallel import ExpertParallel, local_expert_name, shard_experts
from rl.ranks import RankGroup
from rl.sharding import FlatShard

VALUE_HEAD = "value_head."  # name prefix of the PPO value head's parameters in the flat shard


def is_routed_expert(name: str) -> bool:
    """Whether a parameter name is one of a LatentMoE layer's routed experts."""
    return ".experts." in name


class DataParallel:
    """One rank's view of the sharded learner (see the module docstring)."""

    def __init__(self, model: nn.Module, value_head: nn.Module | None, group: RankGroup) -> None:
        self.group = group
        self.model = model
        self.dispatchers: list[ExpertParallel] = []
        if group.expert_parallel > 1:
            self.dispatchers = shard_experts(model, group.rank, group.expert_parallel)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if value_head is not None:
            named += [(VALUE_HEAD + n, p) for n, p in value_head.named_parameters()]
        split = bool(self.dispatchers)
        self.flat_names = [n for n, _ in named if not (split and is_routed_expert(n))]
        self.expert_names = [n for n, _ in named if split and is_routed_expert(n)]
        params = dict(named)
        self.flat = FlatShard([params[n] for n in self.flat_names], group, model.invalidate_weight_caches)
        self.experts = [params[n] for n in self.expert_names]

    # ------------------------------------------------------------------ parameters
    def optimizer_params(self) -> list[nn.Parameter]:
        """What this rank's AdamW steps: its flat slice, then its own routed experts."""
        return [self.flat.shard, *self.experts]

    def resident_bytes(self, optimizer: torch.optim.Optimizer) -> int:
        """Bytes of parameters and AdamW state this rank holds between steps (trainable parameters, the
        router biases and other non-trained parameters of the model, optimizer moments)."""
        held = [self.flat.shard, *self.experts, *(p for p in self.model.parameters() if not p.requires_grad)]
        state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
        return sum(t.numel() * t.element_size() for t in held + state)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole policy's state dict (the names and values of the single-rank model): the flat
        slices and every rank's experts gathered; the same on every rank."""
        state = {
            n: t for n, t in self.model.state_dict().items() if not (self.dispatchers and is_routed_expert(n))
        }
        for name, value in zip(self.flat_names, self.flat.full_tensors(), strict=True):
            if not name.startswith(VALUE_HEAD):
                state[name] = value
        return state | self.gathered_experts()

    def value_head_state(self) -> dict[str, torch.Tensor]:
        """The value head's full parameters (PPO), gathered."""
        tensors = self.flat.full_tensors()
        return {
            n[len(VALUE_HEAD) :]: t
            for n, t in zip(self.flat_names, tensors, strict=True)
            if n.startswith(VALUE_HEAD)
        }

    def gathered_experts(self) -> dict[str, torch.Tensor]:
        """Every rank's routed experts under their global names (empty without expert parallelism)."""
        if not self.experts:
            return {}
        numels = [p.numel() for p in self.experts]
        local = torch.cat([p.detach().reshape(-1) for p in self.experts])
        every = self.group.all_gather_equal(local)
        per_rank = self.dispatchers[0].per_rank
        out = {}
        for r in range(self.group.world_size):
            for name, value, p in zip(self.expert_names, every[r].split(numels), self.experts, strict=True):
                out[local_expert_name(name, r * per_rank)] = value.view(p.shape)
        return out

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
