"""Ray actors: `RolloutWorker` (a policy copy + an `EpisodeRunner`) and `LearnerActor` (a `Learner`).

Weight sync: the learner returns ``(version, state_dict)`` as two Ray objects; the driver hands the
state-dict reference to every worker (the tensors go learner → object store → worker, never through
the driver). A worker refuses weights older than the ones it holds, and refuses to roll out a batch
for another version than the one it holds (`StaleWeights`).
"""

from __future__ import annotations

import torch

from rl.config import RunConfig
from rl.generation import build_engine
from rl.learner import Learner, build_policy
from rl.rollout import EpisodeRunner, RolloutStats
from rl.tokenizer import build_tokenizer


class StaleWeights(RuntimeError):
    """A worker was asked to use weights of another version than the one it should hold."""


class RolloutWorker:
    """Ray actor: rolls out groups of episodes with its copy of the policy."""

    def __init__(self, cfg: RunConfig, index: int) -> None:
        torch.set_num_threads(cfg.rollout.torch_threads)
        self.cfg = cfg
        self.index = index
        self.tokenizer = build_tokenizer(cfg.tokenizer)
        self.model = build_policy(cfg.model, cfg.seed)
        self.engine = build_engine(cfg.rollout, self.model, self.tokenizer, cfg.env.action_vocabulary)
        self.runner = EpisodeRunner(cfg.env, cfg.rollout, self.engine, self.tokenizer, cfg.sandbox)
        self.version = -1

    def ready(self) -> bool:
        return True

    def load_weights(self, version: int, state_dict: dict[str, torch.Tensor]) -> int:
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
    ) -> tuple[list, RolloutStats, dict[int, torch.Tensor]]:
        """Episodes of the groups started from ``seeds``; sampling is seeded by ``sample_seed``.

        Also returns the tokens the policy routed to each expert during this rollout, per MoE layer.
        """
        if self.version != expected_version:
            raise StaleWeights(
                f"worker {self.index} holds weights v{self.version} but the batch needs v{expected_version}"
            )
        generator = torch.Generator().manual_seed(sample_seed)
        episodes, stats = self.runner.run(seeds, group_size, generator, first_group)
        return episodes, stats, self.engine.take_expert_loads()

    def close(self) -> None:
        self.runner.close()


class LearnerActor(Learner):
    """Ray actor: the `Learner`, with its torch thread count set for its process."""

    def __init__(self, cfg: RunConfig) -> None:
        torch.set_num_threads(cfg.trainer.learner_threads)
        super().__init__(cfg)

    def publish(self):
        """``(version, state_dict)`` as two Ray objects (call with ``num_returns=2``)."""
        return self.weights()
