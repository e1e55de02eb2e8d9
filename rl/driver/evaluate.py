"""Evaluate a policy: its success rate on fresh episodes of the configured task, in real sandboxes.

Played by the trainer's own `EpisodeRunner`, in this process, without Ray; task seeds come from a stream
of their own, so two policies evaluated with the same seed are compared on the same games.

Design: docs/design/training.md#rl-evaluate.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from rl.config import RunConfig
from rl.init_weights import load_init_weights
from rl.policy import build_policy
from rl.rollout.engines import build_engine
from rl.rollout.runner import EpisodeRunner
from rl.seeds import eval_seeds
from rl.tokenizer import build_tokenizer


@dataclass
class Evaluation:
    episodes: int
    success: float
    reward: float
    turns: float
    failed: int


def success_rate(cfg: RunConfig, episodes: int, seed: int = 0, batch: int = 64) -> Evaluation:
    """Play ``episodes`` games (``batch`` at a time, one episode per seed) and measure the policy."""
    torch.set_num_threads(cfg.rollout.torch_threads)
    tokenizer = build_tokenizer(cfg.tokenizer)
    policy = build_policy(cfg.model, cfg.seed)
    load_init_weights(policy, cfg.model)
    policy.eval()
    engine = build_engine(cfg.rollout, policy, tokenizer, cfg.env.action_vocabulary)
    env_cfg = replace(cfg.env, group_start="seed")  # one episode per seed: no groups to fork
    rollout_cfg = replace(cfg.rollout, tree=None)  # one chain per seed, also for a tree_grpo run
    runner = EpisodeRunner(env_cfg, rollout_cfg, engine, tokenizer, cfg.sandbox)
    generator = torch.Generator().manual_seed(seed)
    played = []
    try:
        seeds = eval_seeds(seed, episodes)
        for start in range(0, episodes, batch):
            done, _ = runner.run(seeds[start : start + batch], 1, generator)
            played.extend(done)
    finally:
        runner.close()
    usable = [e for e in played if not e.error]
    return Evaluation(
        episodes=len(played),
        success=float(np.mean([e.success for e in usable])) if usable else float("nan"),
        reward=float(np.mean([e.reward for e in usable])) if usable else float("nan"),
        turns=float(np.mean([e.turns for e in usable])) if usable else float("nan"),
        failed=len(played) - len(usable),
    )
