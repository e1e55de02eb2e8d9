"""gymnasium wrappers a user would put in ``env.wrappers`` (imported by name in the Ray workers too:
``conftest.local_ray`` puts this folder on their PYTHONPATH)."""

from __future__ import annotations

import json
import os
import signal
import time
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


class KillsProcessThenWaits(KillsProcessOnce):
    """`KillsProcessOnce`, then every reset (in any worker) waits, for at most ``timeout_s``, until the
    run's ``placement`` file (the trainer's placement.json) has every rollout worker on node ``ip``: the
    trainer has found the killed node's worker dead and reloaded it where Ray restarted it. Async runs
    need this: without it the surviving workers could finish the run before Ray declares the node dead."""

    def __init__(self, env: gymnasium.Env, seeds: list[int], pid: int, marker: str, placement: str, ip: str,
                 timeout_s: float = 120.0) -> None:
        super().__init__(env, seeds, pid, marker)
        self.placement, self.ip, self.timeout_s = Path(placement), ip, timeout_s

    def _restarted(self) -> bool:
        try:
            workers = json.loads(self.placement.read_text())["workers"]
        except (OSError, ValueError):  # not written yet, or caught mid-write
            return False
        return all(w["ip"] == self.ip for w in workers)

    def reset(self, *, seed=None, options=None):
        result = super().reset(seed=seed, options=options)
        deadline = time.monotonic() + self.timeout_s
        while self.marker.exists() and not self._restarted() and time.monotonic() < deadline:
            time.sleep(0.2)
        return result


class HoldsMidGame(gymnasium.Wrapper):
    """While file ``flag`` exists, a step after which its episode goes on touches ``flag``.held and keeps
    the episode there for ``hold_s`` seconds: a test that waits for ``held`` and then stops the run knows
    that an episode is mid-game at the next turn boundary, however loaded the machine is."""

    def __init__(self, env: gymnasium.Env, flag: str, hold_s: float) -> None:
        super().__init__(env)
        self.flag, self.hold_s = Path(flag), hold_s

    def step(self, action):
        observation, reward, terminated, truncated, info = self.env.step(action)
        if not (terminated or truncated) and self.flag.exists():
            self.flag.with_name(self.flag.name + ".held").touch()
            time.sleep(self.hold_s)
        return observation, reward, terminated, truncated, info
