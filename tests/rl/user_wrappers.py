"""gymnasium wrappers a user would put in ``env.wrappers`` (imported by name in the Ray workers too:
``conftest.local_ray`` puts this folder on their PYTHONPATH)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import gymnasium


class BonusReward(gymnasium.RewardWrapper):
    """Adds ``bonus`` to every step's reward (a user's reward shaping)."""

    def __init__(self, env: gymnasium.Env, bonus: float) -> None:
        super().__init__(env)
        self.bonus = bonus

    def reward(self, reward):
        return reward + self.bonus


class NumberedObservations(gymnasium.Wrapper):
    """Prefixes each observation with its index in the episode (``#0 ``, ``#1 ``...): per-episode state
    that a fork must carry over from the env it was forked from."""

    def reset(self, *, seed=None, options=None):
        observation, info = self.env.reset(seed=seed, options=options)
        self.count = 1
        return f"#0 {observation}", info

    def step(self, action):
        observation, reward, terminated, truncated, info = self.env.step(action)
        observation = f"#{self.count} {observation}"
        self.count += 1
        return observation, reward, terminated, truncated, info


class DiesOnce(gymnasium.Wrapper):
    """Fault injection: the process dies (``os._exit``, as on an OOM kill) at the first reset with task
    seed ``seed``; ``marker`` (a file) records that it happened, so the restarted worker goes on."""

    def __init__(self, env: gymnasium.Env, seed: int, marker: str) -> None:
        super().__init__(env)
        self.crash_seed, self.marker = seed, Path(marker)

    def reset(self, *, seed=None, options=None):
        if seed == self.crash_seed and not self.marker.exists():
            self.marker.touch()
            os._exit(1)
        return self.env.reset(seed=seed, options=options)


class KillsProcessOnce(gymnasium.Wrapper):
    """Fault injection: at the first reset with a task seed in ``seeds``, process ``pid`` (a sandbox
    host's server) is killed with SIGKILL, as when its machine goes down; ``marker`` records that it
    happened, so it happens once per run."""

    def __init__(self, env: gymnasium.Env, seeds: list[int], pid: int, marker: str) -> None:
        super().__init__(env)
        self.kill_seeds, self.pid, self.marker = set(seeds), pid, Path(marker)

    def reset(self, *, seed=None, options=None):
        if seed in self.kill_seeds and not self.marker.exists():
            self.marker.touch()
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:  # another env's thread was first
                pass
        return self.env.reset(seed=seed, options=options)
