"""The learner: turns a batch of episodes into one optimizer step of the policy (and value head).

Pipeline of ``train_step``: collate → advantages (GRPO / RLOO per episode, GAE per token with a
value head for PPO, or Tree-GRPO per leaf of a tree rollout with each shared action token in the loss
once, `rl.algos.tree_grpo`) → clipped surrogate with truncated-IS correction against the rollout log-probs
(the decoupled PPO objective: clipped against the learner's own pre-update log-probs, weighted by
π_prox / π_behav per token, so it holds when async rollouts were sampled by older versions; see
``rl.algos.losses.clipped_policy_loss``),
optional KL to a frozen reference, value loss, entropy bonus → optimizer step (``algo.optim``, see
``rl.learner.optim``), and after **every** optimizer step (PPO's epochs x minibatches included) **quantile
balancing** of every MoE router's bias from the router scores of the tokens that step trained on, with
the step's MaxVio per layer logged → a new weights version.

Routing replay (``algo.routing_replay``, see ``rl.learner.routing``): the forward passes route each generated
token to the experts the rollout recorded for it; the routing mismatch against the record is logged
every step, with or without replay, beside ``rollout_logprob_gap``. Device (``trainer.device``, see
``rl.device``): on CUDA the fp32 weights and AdamW state live on the GPU and the forward runs in bf16
(gathered bf16 weights, bf16 autocast).

Every learner is sharded (`rl.learner.sharding`: FSDP2 block by block on a device mesh); one of
``trainer.learner.world_size`` = 1 is the mesh of size 1 in a process group of its own (`rl.learner.ranks`),
so
the same code runs at every size, and so do its checkpoints (`rl.learner.shard_checkpoint`).

`Learner` is a plain class (tested directly); ``rl.learner.actor`` wraps it as a Ray actor.
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from model import K3ForCausalLM, checkpoint
from model.balancing import max_violation, maxvio_floor, prefix_multiplicities, quantile_balance
from model.moe import RouterStats
from rl.algos import (
    broadcast_to_tokens,
    clipped_policy_loss,
    clipped_value_loss,
    entropy_from_logits,
    gae,
    grpo_advantages,
    kl_estimate,
    masked_mean,
    rloo_advantages,
    token_log_probs,
    truncated_is_weights,
    usable_episodes,
    zero_variance_groups,
)
from rl.algos.losses import PolicyLossStats, clipped_surrogate
from rl.algos.tree_grpo import (
    TreeSamples,
    episode_trees,
    tree_grpo_advantages,
    tree_policy_loss,
    tree_samples,
)
from rl.checkpoints import POLICY
from rl.config import AlgoConfig, RunConfig
from rl.device import Placement
from rl.episode import Episode, TensorBatch, collate
from rl.init_weights import load_init_weights
from rl.learner.data_parallel import DataParallel
from rl.learner.optim import build_optimizer, optimizer_step
from rl.learner.ranks import RankGroup, join_single_rank
from rl.learner.routing import mismatch_counts, mismatch_metrics, recorded_routes
from rl.learner.shard_checkpoint import load_local, save_local
from rl.learner.sharding import ShardedPolicy, learner_mesh, stacked_names
from rl.policy import build_policy
from rl.seeds import maxvio_floor_seed
from rl.tokenizer import MASKED_LOGIT, build_tokenizer, disallowed_tokens


class Learner:
    """Holds the policy, optimizer and schedule; see the module docstring.

    ``cfg`` is the whole checked run config (``algo``, ``model``, ``rollout``, ``tokenizer``, ``seed``).
    ``placement``: where the policy runs and its compute dtype (default: `rl.device.Placement` of
    ``trainer.device``).
    ``group``: this process's rank in a ``trainer.learner.world_size`` > 1 learner (`rl.learner.ranks`), whose
    torch.distributed group is already joined; it trains its share of each batch (`rl.learner.data_parallel`).
    Without one, a learner of one rank joins (or makes) a process group of size 1.
    """

    def __init__(
        self, cfg: RunConfig, placement: Placement | None = None, group: RankGroup | None = None
    ) -> None:
        self.cfg = cfg
        self.placement = placement or Placement.of(cfg.trainer.device)
        device = self.placement.device
        self.algo: AlgoConfig = cfg.algo
        tokenizer = build_tokenizer(cfg.tokenizer)
        self.pad_id = tokenizer.pad_id
        self.temperature = cfg.rollout.temperature
        self.disallowed = disallowed_tokens(tokenizer, cfg.env.action_vocabulary, cfg.model.vocab_size)
        world = cfg.trainer.learner.world_size
        if group is None and world == 1:
            group = join_single_rank(device)
        if group is None or group.world_size != world:
            raise ValueError(
                f"trainer.learner.world_size={world}: the learner needs its rank group "
                f"(rl.learner.ranks.join_rank_group), got {group}"
            )
        self.group = group
        self.model = build_policy(cfg.model, cfg.seed)
        load_init_weights(self.model, cfg.model)  # model.init_from: a checkpoint's weights, if set
        self.model.to(device)  # fp32 master weights (no-op on the CPU)
        self.value_head: nn.Linear | None = None
        if self.algo.advantage == "gae":
            self.value_head = nn.Linear(self.model.config.hidden_size, 1)
            nn.init.zeros_(self.value_head.weight)
            nn.init.zeros_(self.value_head.bias)
            self.value_head.to(device)
        self.reference: K3ForCausalLM | None = None
        if self.algo.kl_coef > 0:
            self.reference = copy.deepcopy(self.model).eval().requires_grad_(False)
        # what the optimizer steps and a checkpoint stores, under one root: ``policy.*``, ``value_head.*``
        self.trained = nn.ModuleDict({"policy": self.model})
        if self.value_head is not None:
            self.trained["value_head"] = self.value_head
        mesh = learner_mesh(group, device)
        dtype = self.placement.compute_dtype
        self.sharded = ShardedPolicy(self.model, self.value_head, self.reference, mesh, dtype)
        self.parallel = DataParallel(group, self.sharded.dispatchers)
        self.optimizer, self.scheduler = build_optimizer(self.sharded.trainable(), self.algo.optim)
        self.version = 0
        self.steps = 0

    # ------------------------------------------------------------------ weights
    def weights(self) -> tuple[int, dict[str, torch.Tensor]]:
        """The current version and a copy of the policy's full state dict (CPU tensors, router biases
        included; per-expert names). A collective: every rank calls it; rank 0 gets the weights, the
        others an empty dict. ``rl.learner.actor.LearnerActor.publish`` puts them in Ray's object store unit
        by
        unit instead."""
        return self.version, self.state_dict()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The policy's full state dict on rank 0 (gathered unit by unit, CPU copies; other ranks: {})."""
        state: dict[str, torch.Tensor] = {}
        self.sharded.full_units(lambda unit: state.update({k: v.cpu().clone() for k, v in unit.items()}))
        return state

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        """Copy full weights (a state dict under checkpoint names, as `weights` returns, on every rank)
        into the policy's shards in place."""
        options = StateDictOptions(full_state_dict=True, strict=True)
        set_model_state_dict(self.model, stacked_names(state), options=options)

    def optimizer_step(self, loss: torch.Tensor) -> torch.Tensor:
        """`rl.learner.optim.optimizer_step` over the ranks: ``loss`` is this rank's share of the global loss;
        the global gradient norm (squares of every rank's shards summed) is returned."""
        return optimizer_step(self.optimizer, self.scheduler, loss, self.algo.optim.grad_clip,
                              self.parallel.summed)  # fmt: skip

    # ------------------------------------------------------------------ training
    def advantages(
        self, batch: TensorBatch, values: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per-token advantages ``[B, T-1]`` (and PPO returns)."""
        kind, group = self.algo.advantage, self.algo.group_size
        if kind == "gae":
            adv, returns = gae(
                batch.token_rewards, values.detach(), batch.action_mask, self.algo.gamma, self.algo.lam
            )
            if self.algo.normalize_advantages:
                mean, std = masked_mean(adv, batch.action_mask), None
                var = masked_mean((adv - mean) ** 2, batch.action_mask)
                std = var.sqrt()
                adv = (adv - mean) / (std + 1e-6) * batch.action_mask
            return adv, returns
        if kind == "grpo":
            per_episode = grpo_advantages(
                batch.rewards, group, scale_by_std=self.algo.scale_by_std, valid=batch.weights > 0
            )
        elif kind == "rloo":
            per_episode = rloo_advantages(batch.rewards, group, valid=batch.weights > 0)
        elif kind == "tree_grpo":
            raise ValueError("tree_grpo's advantages are per tree with loss rows of their own: _tree_samples")
        else:
            raise ValueError(f"algo.advantage={kind!r} is unknown; use grpo, rloo or gae")
        return broadcast_to_tokens(per_episode, batch.action_mask), None

    def action_logits(self, logits: torch.Tensor, action_mask: torch.Tensor) -> torch.Tensor:
        """Temperature-scaled logits, with the rollout's action-vocabulary mask on action positions."""
        logits = logits / self.temperature
        if self.disallowed is None:
            return logits
        where = action_mask.bool()[..., None] & self.disallowed.to(logits.device)
        return logits.masked_fill(where, MASKED_LOGIT)

    def _forward(self, batch: TensorBatch, rows: torch.Tensor | slice = slice(None)):
        """Policy log-probs, values (PPO), logits and router stats of ``batch[rows]`` (with the rollout's
        routing replayed where recorded, under ``algo.routing_replay``)."""
        mask = batch.action_mask[rows]
        replay = self.algo.routing_replay and batch.routes is not None
        with self.placement.autocast():
            out = self.model(
                batch.input_ids[rows],
                attention_mask=batch.attention_mask[rows],
                return_hidden=self.value_head is not None,
                routes=recorded_routes(batch.routes[rows]) if replay else None,
            )
            values = None
            if self.value_head is not None:
                values = self.value_head(out.hidden[:, :-1]).squeeze(-1).float()
        logits = self.action_logits(out.logits[:, :-1], mask)
        logp = token_log_probs(logits, batch.input_ids[rows][:, 1:])
        return logp, values, logits, out.router_stats

    def _batch(self, episodes: list[Episode]) -> TensorBatch:
        """`collate` of ``episodes``, on the learner's device."""
        return collate(episodes, self.pad_id).to(self.placement.device)

    def train_step(self, episodes: list[Episode]) -> dict[str, float]:
        """Optimizer step(s) on ``episodes`` (laid out group after group); returns metrics.

        ``algo.epochs`` passes over the batch, each split into ``algo.minibatches`` (whole groups), make
        the clipped surrogate and the clipped value loss bite; with 1 x 1 it is a single
        on-policy step and the learner's own log-probs are the old policy. Every optimizer step is
        followed by quantile balancing of the routers from that step's router statistics.
        """
        self.model.train()
        algo = self.algo
        batch = self._batch(episodes)
        # failed episodes (weight 0) are out of the group statistics and the loss; a group with fewer
        # than algo.min_valid_members valid members is left out whole (rl.algos.usable_episodes)
        valid = batch.weights > 0
        keep = usable_episodes(valid, algo.group_size, algo.min_valid_members)
        if algo.advantage != "gae" and algo.filter_zero_variance_groups:
            keep = keep & ~zero_variance_groups(batch.rewards, algo.group_size, valid=valid)
        batch.action_mask = batch.action_mask * keep[:, None].float()
        num_groups = len(episodes) // algo.group_size
        chunks = [
            torch.arange(len(episodes)).view(num_groups, algo.group_size)[g].reshape(-1)
            for g in torch.arange(num_groups).chunk(min(algo.minibatches, num_groups))
        ]
        tree = None
        if algo.advantage == "tree_grpo":  # each shared action token in the loss once (rl.algos.tree_grpo)
            tree = self._tree_samples(episodes, batch, valid, keep, chunks)
            batch.action_mask = tree.loss_mask
        single = algo.epochs * algo.minibatches == 1
        first = None
        everything = torch.arange(len(episodes))
        mine = self.parallel.local_rows(everything)
        if single:
            first = self._forward(batch, mine)
            old_logp, old_values = first[0].detach(), None if first[1] is None else first[1].detach()
            first_router_stats = first[3]
        else:
            with torch.no_grad():
                old_logp, old_values, _, first_router_stats = self._forward(batch, mine)
        # every rank's pre-update log-probs and values, for the whole batch
        old_logp = self.parallel.gather_rows(old_logp, everything, len(episodes))
        old_values = self.parallel.gather_rows(old_values, everything, len(episodes))
        routing = {}  # the learner's own routing vs the rollout's, before this batch's updates
        if batch.routes is not None:  # counted on this rank's rows, summed over the ranks, then divided
            layers, counts = mismatch_counts(
                first_router_stats, batch.attention_mask[mine], batch.routes[mine]
            )
            counts = self.parallel.summed(counts)
            routing = mismatch_metrics(layers, counts)
        advantages, returns = (None, None) if tree is not None else self.advantages(batch, old_values)
        is_weights = None
        if algo.tis_cap is not None:
            is_weights = truncated_is_weights(old_logp, batch.rollout_logprobs, algo.tis_cap)
        totals: dict[str, list[float]] = {}
        floors: dict[int, float] = {}  # per minibatch: its tokens are the same in every epoch
        for _epoch in range(algo.epochs):
            for chunk, rows in enumerate(chunks):
                local = self.parallel.local_rows(rows)
                forward = first if first is not None else self._forward(batch, local)
                step_metrics = self._update(
                    batch, local, forward, old_logp, old_values, advantages, returns, is_weights, tree
                )
                step_metrics.update(self._balance_experts([forward[3]]))
                if "maxvio" in step_metrics:
                    if chunk not in floors:
                        floors[chunk] = self._maxvio_floor(batch, rows)
                    step_metrics["maxvio_floor"] = floors[chunk]
                for key, value in step_metrics.items():
                    totals.setdefault(key, []).append(value)
        metrics = {key: float(np.mean(values)) for key, values in totals.items()}
        if "maxvio" in totals:  # in-loop MaxVio of the first and the last optimizer step of this batch
            metrics["maxvio_first_update"] = totals["maxvio"][0]
            metrics["maxvio_last_update"] = totals["maxvio"][-1]
        metrics["optimizer_steps"] = float(len(totals.get("loss", [])))
        metrics.update(self.parallel.traffic())
        self.steps += 1
        self.version += 1
        mask = batch.action_mask
        metrics["rollout_logprob_gap"] = masked_mean((old_logp - batch.rollout_logprobs).abs(), mask).item()
        metrics.update(routing)
        if is_weights is not None:  # π_prox / π_behav: how far off-policy the batch was
            metrics["is_weight_mean"] = masked_mean(is_weights, mask).item()
            metrics["is_truncated_fraction"] = masked_mean((is_weights >= algo.tis_cap).float(), mask).item()
        metrics["trained_tokens"] = float(mask.sum())
        metrics["weights_version"] = float(self.version)
        metrics["lr"] = self.scheduler.get_last_lr()[0]
        return metrics

    def _update(self, batch, rows, forward, old_logp, old_values, advantages, returns, is_weights, tree=None):
        """One optimizer step on the rows ``rows`` of the batch (``tree``: `_tree_samples` of a
        tree_grpo batch); returns its metrics."""
        algo = self.algo
        logp, values, logits, _router_stats = forward
        mask = batch.action_mask[rows]
        # this rank's weight in each global mean (rl.learner.data_parallel; 1 on a learner of one rank)
        shares = self.parallel.loss_shares(mask, algo.loss_aggregation)
        rows_is = None if is_weights is None else is_weights[rows]
        if tree is not None:  # its advantages hold the whole minibatch's aggregation: no share to apply
            policy_loss, stats = self._tree_policy_loss(logp, old_logp[rows], tree, rows, rows_is)
        else:
            policy_loss, stats = clipped_policy_loss(
                logp,
                old_logp[rows],
                advantages[rows],
                mask,
                clip_low=algo.clip_low,
                clip_high=algo.clip_high,
                aggregation=algo.loss_aggregation,
                is_weights=rows_is,
            )
            policy_loss = policy_loss * shares[0]
        loss = policy_loss
        metrics: dict[str, float] = {}
        if values is not None:
            value_loss = clipped_value_loss(values, old_values[rows], returns[rows], mask, algo.value_clip)
            value_loss = value_loss * shares[1]
            loss = loss + algo.value_coef * value_loss
            metrics["value_loss"] = value_loss.item()
        kl = torch.zeros(())
        if self.reference is not None:
            with torch.no_grad(), self.placement.autocast():
                ref_logits = self.reference(
                    batch.input_ids[rows], attention_mask=batch.attention_mask[rows]
                ).logits
            ref_logp = token_log_probs(
                self.action_logits(ref_logits[:, :-1], mask), batch.input_ids[rows][:, 1:]
            )
            kl = masked_mean(kl_estimate(logp, ref_logp, algo.kl_estimator), mask)
            kl = kl * shares[1]
            loss = loss + algo.kl_coef * kl
        entropy = masked_mean(entropy_from_logits(logits), mask)
        entropy = entropy * shares[1]
        if algo.entropy_coef > 0:
            loss = loss - algo.entropy_coef * entropy
        grad_norm = self.optimizer_step(loss)
        metrics.update(
            {
                "loss": loss.item(),
                "policy_loss": policy_loss.item(),
                "kl": kl.item(),
                "entropy": entropy.item(),
                "clip_fraction": stats.clip_fraction,
                "approx_kl": stats.approx_kl,
                "grad_norm": grad_norm.item(),
            }
        )
        return self.parallel.global_metrics(metrics, float(shares[1]))

    def _tree_samples(
        self, episodes: list[Episode], batch: TensorBatch, valid: torch.Tensor, keep: torch.Tensor, chunks
    ) -> TreeSamples:
        """The learner rows of a tree_grpo batch (leaves of `rl.rollout.trees` trees, one row each, as
        collated): `rl.algos.tree_grpo.tree_samples` of each minibatch's trees (each minibatch's loss
        aggregated over its own leaves), laid back on the leaves' rows. The loss mask has every action
        token of a node in one row only; failed leaves are out of the advantages' groups, and leaves of
        groups left out (``keep``) are not trained."""
        algo = self.algo
        width = batch.action_mask.shape[1]
        loss_mask, adv_pos, adv_neg = (torch.zeros(len(episodes), width) for _ in range(3))
        trained_rows = (valid & keep).cpu()
        for rows in chunks:
            rows = rows.tolist()
            trees, groups, leaves = episode_trees([episodes[r] for r in rows], algo.group_size)
            advantages = tree_grpo_advantages(trees, groups, scale_by_std=algo.scale_by_std)
            trained = [[bool(trained_rows[rows[k]]) for k in tree_leaves] for tree_leaves in leaves]
            samples = tree_samples(trees, advantages, self.pad_id, algo.loss_aggregation, width, trained)
            order = torch.tensor([rows[k] for tree_leaves in leaves for k in tree_leaves])
            n = min(width, samples.loss_mask.shape[1])
            loss_mask[order, :n] = samples.loss_mask[:, :n]
            adv_pos[order, :n] = samples.adv_pos[:, :n]
            adv_neg[order, :n] = samples.adv_neg[:, :n]
        device = batch.action_mask.device
        return TreeSamples(batch.input_ids, batch.attention_mask, loss_mask.to(device), adv_pos.to(device),
                           adv_neg.to(device))  # fmt: skip

    def _tree_policy_loss(self, logp, old_logp, tree: TreeSamples, rows, is_weights):
        """`rl.algos.tree_grpo.tree_policy_loss` of ``tree``'s rows ``rows``, with the token-mean
        statistics of the clipped surrogate."""
        algo = self.algo
        rows_of = TreeSamples(tree.input_ids[rows], tree.attention_mask[rows], tree.loss_mask[rows],
                              tree.adv_pos[rows], tree.adv_neg[rows])  # fmt: skip
        loss = tree_policy_loss(logp, old_logp, rows_of, algo.clip_low, algo.clip_high, is_weights)
        with torch.no_grad():
            advantage = rows_of.adv_pos + rows_of.adv_neg
            _, clipped = clipped_surrogate(logp, old_logp, advantage, algo.clip_low, algo.clip_high)
            stats = PolicyLossStats(
                clip_fraction=masked_mean(clipped.float(), rows_of.loss_mask).item(),
                approx_kl=masked_mean(old_logp - logp, rows_of.loss_mask).item(),
            )
        return loss, stats

    def _maxvio_floor(self, batch: TensorBatch, rows: torch.Tensor | slice) -> float:
        """`model.balancing.maxvio_floor` of this optimizer step's tokens: the MaxVio a perfectly balanced
        router would show on them, given that tokens with one shared prefix route together. Drawn from
        its own generator (seeded by run seed and step), so logging it leaves the run's RNG alone."""
        config = self.model.config
        lumps = prefix_multiplicities(batch.input_ids[rows].cpu(), batch.attention_mask[rows].cpu())
        generator = torch.Generator().manual_seed(maxvio_floor_seed(self.cfg.seed, self.steps))
        return maxvio_floor(lumps, config.num_experts, config.num_experts_per_token, generator)

    @torch.no_grad()
    def _balance_experts(self, forwards_router_stats: list[list[RouterStats]]) -> dict[str, float]:
        """Quantile balancing of every router after an optimizer step, and the step's MaxVio per layer.

        ``forwards_router_stats`` holds the router statistics of every forward pass that made up the
        optimizer step (one per micro-batch); their scores and loads are pooled per layer, so the bias
        is solved on all the tokens the step trained on, and applies from the next step's routing on.
        """
        scores: dict[int, list[torch.Tensor]] = {}
        loads: dict[int, torch.Tensor] = {}
        for router_stats in forwards_router_stats:
            for stats in router_stats:
                scores.setdefault(stats.layer, []).append(stats.scores)
                loads[stats.layer] = loads.get(stats.layer, 0) + stats.loads
        metrics: dict[str, float] = {}
        for router, layer in zip(self.model.moe_routers(), sorted(scores), strict=True):
            bias = router.e_score_correction_bias
            # the global batch's scores and loads: every rank solves the same bias
            pooled = self.parallel.pooled_scores(torch.cat(scores[layer]))
            loads[layer] = self.parallel.summed_loads(loads[layer])
            solved = quantile_balance(pooled, router.top_k, bias)
            router.update_bias(bias + self.algo.balance_rate * (solved - bias))
            metrics[f"maxvio/layer{layer}"] = max_violation(loads[layer])
        if metrics:
            metrics["maxvio"] = float(np.mean(list(metrics.values())))
        return metrics

    # ------------------------------------------------------------------ checkpoints
    def save(self, directory: str | Path) -> None:
        """Write a checkpoint into ``directory`` (every rank calls it; the ranks share the folder): the
        learner's distributed checkpoint and its manifest (`rl.learner.shard_checkpoint`), then ``policy/``,
        the
        full weights as ``save_pretrained`` writes them, streamed unit by unit by rank 0."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        save_local(self, directory)
        self.export(directory / POLICY)

    def export(self, directory: str | Path) -> None:
        """``save_pretrained`` of the full policy into ``directory`` (a collective; rank 0 writes, one
        unit's full weights in memory at a time)."""
        writer = None
        if self.group.rank == 0:
            writer = checkpoint.StreamingExport(directory, self.model.config, self.sharded.layout())
        self.sharded.full_units(lambda unit: writer.write(unit) if writer is not None else None)
        if writer is not None:
            writer.close()

    def load(self, directory: str | Path) -> None:
        """Restore what `save` wrote (every rank calls it; the ranks read the folder), at this learner's
        world size whatever the writer's: the shards go into the policy's own parameters, so the
        optimizer keeps pointing at what it steps."""
        load_local(self, Path(directory))
