"""Ray actors: `RolloutWorker` (a policy copy + an `EpisodeRunner`) and `LearnerActor` (a `Learner`).

Data path (the driver holds references, never the tensors or the episodes):

- weights: the learner puts its state dict in Ray's object store once per version (`LearnerActor.publish`,
  and at the end of every `LearnerActor.train_step`) and returns ``(version, ObjectRef)``; the driver
  passes the reference to every worker's `RolloutWorker.load_weights`, where Ray resolves it.
- episodes: the driver calls `RolloutWorker.rollout` with ``num_returns=2``; it reads the first reference
  (the echoed version, `RolloutStats` and expert loads: small) and hands the second one (the episodes)
  unopened to `LearnerActor.train_step`.

The weights version is the learner's counter; workers and driver only carry it. A worker starts with no
weights (version -1, its policy built without init) and refuses weights older than the ones it holds,
and a batch for another version than the one it holds (`StaleWeights`).
"""

from __future__ import annotations

from typing import Any

import ray
import torch

from rl.config import RunConfig
from rl.episode import Episode
from rl.generation import build_engine
from rl.learner import Learner, build_policy_shell
from rl.rollout import EpisodeRunner, RolloutStats
from rl.tokenizer import build_tokenizer

NO_WEIGHTS = -1  # the version of a worker that has not loaded any weights yet


class StaleWeights(RuntimeError):
    """A worker was asked to use weights of another version than the one it should hold."""


class RolloutWorker:
    """Ray actor: rolls out groups of episodes with its copy of the policy."""

    def __init__(self, cfg: RunConfig, index: int) -> None:
        torch.set_num_threads(cfg.rollout.torch_threads)
        self.cfg = cfg
        self.index = index
        self.tokenizer = build_tokenizer(cfg.tokenizer)
        self.model = build_policy_shell(cfg.model)  # no random init: `load_weights` fills it
        self.engine = build_engine(cfg.rollout, self.model, self.tokenizer, cfg.env.action_vocabulary)
        self.runner = EpisodeRunner(cfg.env, cfg.rollout, self.engine, self.tokenizer, cfg.sandbox)
        self.version = NO_WEIGHTS

    def load_weights(self, version: int, state_dict: dict[str, torch.Tensor]) -> int:
        """Copy the learner's weights of ``version`` into the policy (Ray resolves a reference passed
        as ``state_dict``); returns the version now held."""
        if version < self.version:
            raise StaleWeights(
                f"worker {self.index} holds weights v{self.version}; refusing older v{version}"
            )
        self.model.load_state_dict(state_dict)
        self.version = version
        return version

    def rollout(
        self,
        seeds: list[int],
        group_size: int,
        first_group: int,
        sample_seed: int,
        expected_version: int,
    ) -> tuple[tuple[int, RolloutStats, dict[int, torch.Tensor]], list[Episode]]:
        """Episodes of the groups started from ``seeds``; sampling is seeded by ``sample_seed``.

        Returns ``((version, stats, expert_loads), episodes)``: the weights version the episodes were
        sampled with (echoed back), the run's counters and the tokens the policy routed to each expert
        per MoE layer; then the episodes. Called with ``num_returns=2`` so that each part is its own
        Ray object: the driver reads the first and passes the second on to the learner.
        """
        if self.version != expected_version:
            raise StaleWeights(
                f"worker {self.index} holds weights v{self.version} but the batch needs v{expected_version}"
            )
        generator = torch.Generator().manual_seed(sample_seed)
        episodes, stats = self.runner.run(seeds, group_size, generator, first_group)
        return (self.version, stats, self.engine.take_expert_loads()), episodes

    def close(self) -> None:
        self.runner.close()


class LearnerActor(Learner):
    """Ray actor: the `Learner`, with its torch thread count set for its process, publishing each
    weights version to Ray's object store."""

    def __init__(self, cfg: RunConfig) -> None:
        torch.set_num_threads(cfg.trainer.learner_threads)
        super().__init__(cfg)

    def publish(self) -> tuple[int, ray.ObjectRef]:
        """Put the current weights in the object store (once: ``ray.put`` serialises a copy, so the
        state dict is not cloned first); returns ``(version, reference)``."""
        return self.version, ray.put(self.model.state_dict())

    def train_step(self, *shares: list[Episode]) -> tuple[dict[str, Any], int, ray.ObjectRef]:
        """One `Learner.train_step` on the workers' episode lists concatenated in order (the driver
        passes the rollouts' references; Ray resolves them here), then `publish`; returns
        ``(metrics, version, weights reference)``."""
        metrics = super().train_step([episode for share in shares for episode in share])
        version, weights = self.publish()
        return metrics, version, weights
