"""Ray actors: `RolloutWorker` (a policy copy + an `EpisodeRunner`) and `LearnerActor` (a `Learner`).

Weight sync: the learner returns ``(version, state_dict)`` as two Ray objects; the driver hands the
state-dict reference to every worker (the tensors go learner → object store → worker, never through
the driver). A worker refuses weights older than the ones it holds, and refuses to roll out a batch
for another version than the one it holds (`StaleWeights`).
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import ray
import torch

from model.balancing import max_violation
from rl.generation import build_engine
from rl.learner import Learner, build_policy
from rl.rollout import EpisodeRunner
from rl.tokenizer import build_tokenizer


class StaleWeights(RuntimeError):
    """A worker was asked to use weights of another version than the one it should hold."""


class RolloutWorker:
    """Ray actor: rolls out groups of episodes with its copy of the policy."""

    def __init__(self, cfg: dict[str, Any], index: int) -> None:
        torch.set_num_threads(int(cfg["rollout"]["torch_threads"]))
        self.cfg = cfg
        self.index = index
        self.tokenizer = build_tokenizer(cfg["tokenizer"])
        self.model = build_policy(cfg["model"], int(cfg["seed"]))
        self.engine = build_engine(
            cfg["rollout"], self.model, self.tokenizer, cfg["env"].get("action_vocabulary")
        )
        self.runner = EpisodeRunner(cfg["env"], cfg["rollout"], self.engine, self.tokenizer)
        self.version = -1
        self.restarted = False
        if ray.is_initialized() and ray.get_runtime_context().get_actor_id():
            with warnings.catch_warnings():  # the property is fine; its implementation warns internally
                warnings.simplefilter("ignore", DeprecationWarning)
                self.restarted = bool(ray.get_runtime_context().was_current_actor_reconstructed)

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
        iteration: int,
    ):
        """Episodes of the groups started from ``seeds``; sampling is seeded by ``sample_seed``."""
        if self.version != expected_version:
            raise StaleWeights(
                f"worker {self.index} holds weights v{self.version} but the batch needs v{expected_version}"
            )
        crash_at = self.cfg["rollout"].get("chaos", {}).get("crash_worker_at_iteration")
        if crash_at is not None and int(crash_at) == iteration and not self.restarted and self.index == 0:
            os._exit(1)  # fault injection for tests: the process dies as on an OOM kill
        generator = torch.Generator().manual_seed(int(sample_seed))
        episodes, stats = self.runner.run(seeds, group_size, generator, first_group)
        loads = self.engine.take_expert_loads()
        return episodes, stats, {layer: max_violation(l) for layer, l in loads.items()}

    def close(self) -> None:
        self.runner.close()


class LearnerActor(Learner):
    """Ray actor: the `Learner`, with its torch thread count set for its process."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        torch.set_num_threads(int(cfg["trainer"]["learner_threads"]))
        super().__init__(cfg)

    def publish(self):
        """``(version, state_dict)`` as two Ray objects (call with ``num_returns=2``)."""
        return self.weights()
