"""``trainer.eval_every=K``: every K iterations the rollout workers play held-out games with the weights
just published, and the iteration's metrics get ``eval_success`` and the other ``eval_*`` figures beside
``success``.

The same games at every evaluation (a seed stream of their own), so the numbers compare across
iterations; the episodes are not trained on.

Design: docs/design/training.md#rl-heldout.
"""

from __future__ import annotations

import numpy as np

from rl.driver.rollout_workers import RolloutWorkers
from rl.driver.sources import split
from rl.episode import EpisodeSummary
from rl.seeds import eval_seeds, sampling_seed

EVAL_SAMPLING = 0x65766C  # the sampling seeds' "iteration" tag of evaluation calls (apart from training's)


class HeldOutEval:
    """Plays the held-out games on the workers (see the module docstring)."""

    def __init__(self, workers: RolloutWorkers, seed: int, episodes: int) -> None:
        self.workers = workers
        self.seed = seed
        self.seeds = eval_seeds(seed, episodes)

    def run(self, version: int, number: int) -> dict[str, float]:
        """Evaluation ``number`` of the run, with weights ``version`` (which every worker holds)."""
        shares = split(self.seeds, len(self.workers))
        calls = []
        for w, (offset, chunk) in enumerate(shares):
            sample_seed = sampling_seed(self.seed, EVAL_SAMPLING + number, w)
            calls.append(
                self.workers.actors[w].rollout.options(num_returns=1 + len(chunk))
                .remote(chunk, 1, offset, sample_seed, version)[0]
            )
        outcomes: list[EpisodeSummary] = []
        for w, ref in enumerate(calls):
            _, stats, _ = self.workers.summary(w, ref)
            outcomes += stats.outcomes
        usable = [o for o in outcomes if not o.failed]
        return {
            "eval_success": float(np.mean([o.success for o in usable])) if usable else float("nan"),
            "eval_reward": float(np.mean([o.reward for o in usable])) if usable else float("nan"),
            "eval_turns": float(np.mean([o.turns for o in usable])) if usable else float("nan"),
            "eval_failed_episodes": float(len(outcomes) - len(usable)),
            "eval_episodes": float(len(outcomes)),
        }
