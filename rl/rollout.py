"""Rollout: run GRPO groups of episodes of a sandboxed task with the policy, many at once.

`EpisodeRunner` (plain Python, tested directly) owns a pool of task envs whose sandboxes stay alive
across episodes and iterations. For each iteration it

1. starts every group from one state: ``group_start: fork`` resets one env and forks its sandbox G-1
   times (any task; the G first observations are byte-identical), ``group_start: seed`` resets G live
   envs with the same seed (cheaper; needs a task whose reset is deterministic given the seed);
2. runs the multi-turn loop: one batched generation for all active episodes, then their env steps in
   parallel on a thread pool (each sandbox is used by one thread at a time);
3. turns every failure of a single episode (exception in the task, dead sandbox, failed resume) into
   a recorded error and a zero-weight sample, and replaces the env it broke.

Sandboxes idle longer than ``pause_idle_s`` (waiting on the policy or on the learner) are paused to
disk and resumed on demand; counts and latencies are reported.

`RolloutWorker` (in ``rl.actors``) is the Ray actor around a runner and a policy copy.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field

import gymnasium
import torch

import agentenv.tasks  # noqa: F401  (registers the built-in tasks)
from agentenv.tasks import SandboxTask
from rl.episode import Episode
from rl.generation import TorchEngine
from rl.tokenizer import Tokenizer


@dataclass
class RolloutStats:
    """Counters of one `EpisodeRunner.run` call (summed over workers by the driver)."""

    episodes: int = 0
    failed: int = 0
    env_steps: int = 0
    generated_tokens: int = 0
    reset_s: float = 0.0
    generate_s: float = 0.0
    env_step_s: float = 0.0
    total_s: float = 0.0
    pauses: int = 0
    pause_s: float = 0.0
    resumes: int = 0
    resume_s: float = 0.0
    forks: int = 0
    fork_s: float = 0.0
    sandboxes_created: int = 0
    errors: list[str] = field(default_factory=list)

    def merge(self, other: RolloutStats) -> None:
        for name, value in vars(other).items():
            if name == "errors":
                self.errors.extend(value)
            else:
                setattr(self, name, getattr(self, name) + value)


def make_env(env_id: str, kwargs: dict) -> SandboxTask:
    """A task env by gymnasium id, unwrapped (the runner needs `fork`, `pause`, `resume`)."""
    env = gymnasium.make(env_id, **kwargs).unwrapped
    if not isinstance(env, SandboxTask):
        raise TypeError(f"{env_id} is not a SandboxTask env (got {type(env).__name__})")
    return env


class EpisodeRunner:
    """Runs groups of episodes in live sandboxes (see the module docstring)."""

    def __init__(self, env_cfg: dict, rollout_cfg: dict, engine: TorchEngine, tokenizer: Tokenizer) -> None:
        self.env_id = env_cfg["id"]
        self.env_kwargs = dict(env_cfg.get("kwargs") or {})
        self.group_start = env_cfg.get("group_start", "fork")
        if self.group_start not in ("fork", "seed"):
            raise ValueError(f"env.group_start={self.group_start!r}; use 'fork' or 'seed'")
        self.max_new_tokens = int(env_cfg["max_new_tokens"])
        self.max_episode_tokens = int(env_cfg["max_episode_tokens"])
        self.pause_idle_s = rollout_cfg.get("pause_idle_s")
        self.engine = engine
        self.tokenizer = tokenizer
        self.pool: list[SandboxTask] = []
        self._generator = torch.Generator()
        self.parked: set[int] = set()  # ids of pooled envs whose sandboxes this runner paused
        self._stats_lock = threading.Lock()
        self.last_used: dict[int, float] = {}
        self.threads = ThreadPoolExecutor(max_workers=int(rollout_cfg.get("env_threads", 8)))

    # ------------------------------------------------------------------ env pool
    def _take_envs(self, n: int, stats: RolloutStats) -> list[SandboxTask]:
        while len(self.pool) < n:
            self.pool.append(make_env(self.env_id, self.env_kwargs))
            stats.sandboxes_created += 1
        taken, self.pool = self.pool[:n], self.pool[n:]
        return taken

    def _give_back(self, env: SandboxTask, broken: bool) -> None:
        if broken:
            self._discard(env)
        else:
            self.pool.append(env)
            self.last_used[id(env)] = time.perf_counter()

    def _discard(self, env: SandboxTask) -> None:
        try:
            env.close()
        except Exception:  # the sandbox may already be gone; nothing else to free
            pass

    def close(self) -> None:
        """Close every pooled env and its sandbox."""
        list(self.threads.map(self._discard, self.pool))
        self.pool = []

    def park_idle(self, stats: RolloutStats) -> None:
        """Pause pooled sandboxes idle for longer than ``pause_idle_s`` (no-op when it is None)."""
        if self.pause_idle_s is None:
            return
        now = time.perf_counter()
        idle = [e for e in self.pool if now - self.last_used.get(id(e), now) >= self.pause_idle_s]
        for env in self._park(idle, stats):
            self.pool.remove(env)
            self._discard(env)

    def _park(self, envs: list[SandboxTask], stats: RolloutStats) -> list[SandboxTask]:
        """Pause the sandboxes of ``envs`` (in parallel); returns the envs whose pause failed."""
        envs = [e for e in envs if e is not None and id(e) not in self.parked and e.sandbox is not None]

        def pause(env: SandboxTask) -> float | None:
            try:
                return env.pause()
            except Exception:
                return None

        failed = []
        for env, seconds in zip(envs, self.threads.map(pause, envs), strict=True):
            if seconds is None:
                failed.append(env)
                continue
            self.parked.add(id(env))
            with self._stats_lock:
                stats.pauses += 1
                stats.pause_s += seconds
        return failed

    @contextmanager
    def _parking_while_waiting(self, envs: list[SandboxTask], stats: RolloutStats):
        """While the policy generates, pause ``envs`` once the wait exceeds ``pause_idle_s``.

        Their steps resume them on demand. A failed pause leaves the env running (its step will tell).
        """
        if self.pause_idle_s is None:
            yield
            return
        timer = threading.Timer(float(self.pause_idle_s), self._park, args=(envs, stats))
        timer.start()
        try:
            yield
        finally:
            timer.cancel()
            timer.join()

    def _resume_if_paused(self, env: SandboxTask, stats: RolloutStats) -> None:
        """Resume a sandbox this runner parked (tracked here: no registry query per step)."""
        if id(env) not in self.parked:
            return
        self.parked.discard(id(env))
        seconds = env.resume()
        with self._stats_lock:
            stats.resume_s += seconds
            stats.resumes += 1

    # ------------------------------------------------------------------ episodes
    def run(
        self, seeds: list[int], group_size: int, generator: torch.Generator, first_group: int = 0
    ) -> tuple[list[Episode], RolloutStats]:
        """One episode per group member for each seed; episodes come back group after group."""
        stats = RolloutStats()
        started = time.perf_counter()
        self._generator = generator
        episodes = [
            Episode(self.env_id, seed, first_group + g)
            for g, seed in enumerate(seeds)
            for _ in range(group_size)
        ]
        t0 = time.perf_counter()
        envs, owned_forks = self._start_groups(seeds, group_size, episodes, stats)
        stats.reset_s += time.perf_counter() - t0
        self._play(episodes, envs, stats)
        for env, episode in zip(envs, episodes, strict=True):
            if env is None:
                continue
            if id(env) in owned_forks:
                self._discard(env)
            else:
                self._give_back(env, broken=episode.error is not None)
        self.park_idle(stats)
        stats.episodes = len(episodes)
        stats.failed = sum(1 for e in episodes if e.error)
        stats.errors = [f"seed {e.seed}: {e.error}" for e in episodes if e.error]
        stats.generated_tokens = sum(sum(e.action_mask) for e in episodes)
        stats.total_s = time.perf_counter() - started
        return episodes, stats

    def _start_groups(self, seeds, group_size, episodes, stats):
        """Reset the envs of every group; returns one env per episode (None where the start failed)."""
        envs: list[SandboxTask | None] = [None] * len(episodes)
        owned_forks: set[int] = set()
        if self.group_start == "seed":
            taken = self._take_envs(len(episodes), stats)
            jobs = [(env, episodes[i].seed) for i, env in enumerate(taken)]
        else:
            taken = self._take_envs(len(seeds), stats)
            jobs = [(env, seed) for env, seed in zip(taken, seeds, strict=True)]

        def reset(job):
            env, seed = job
            try:
                self._resume_if_paused(env, stats)
                observation, _ = env.reset(seed=seed)
                return observation, None
            except Exception as exc:  # the episode fails, not the run
                return None, exc

        results = list(self.threads.map(reset, jobs))
        if self.group_start == "seed":
            for i, (env, (obs, err)) in enumerate(zip(taken, results, strict=True)):
                self._begin(episodes[i], env, obs, err, envs, i)
            return envs, owned_forks

        def fork(job):
            (env, _seed), (obs, err) = job
            if err is not None or group_size == 1:
                return obs, err, []
            t = time.perf_counter()
            try:
                forks = env.fork(group_size - 1)
            except Exception as exc:
                return obs, exc, []
            with self._stats_lock:
                stats.fork_s += time.perf_counter() - t
                stats.forks += group_size - 1
            return obs, None, forks

        for g, (obs, err, forks) in enumerate(self.threads.map(fork, zip(jobs, results, strict=True))):
            members = [jobs[g][0], *forks] if err is None else [jobs[g][0]] + [None] * (group_size - 1)
            owned_forks.update(id(f) for f in forks)
            for j, env in enumerate(members):
                self._begin(episodes[g * group_size + j], env, obs, err, envs, g * group_size + j)
        return envs, owned_forks

    def _begin(self, episode: Episode, env, observation, error, envs, index) -> None:
        envs[index] = env
        if error is not None:
            episode.fail(error)
            return
        tok = self.tokenizer
        episode.observations.append(observation)
        episode.append(
            [tok.bos_id, tok.observation_id, *tok.encode(observation), tok.end_id, tok.action_id],
            trained=False,
        )

    def _play(self, episodes: list[Episode], envs: list, stats: RolloutStats) -> None:
        tok = self.tokenizer
        active = [i for i, e in enumerate(episodes) if e.error is None]
        while active:
            t = time.perf_counter()
            with self._parking_while_waiting([envs[i] for i in active], stats):
                generations = self.engine.generate(
                    [episodes[i].tokens for i in active], self.max_new_tokens, self._generator
                )
            stats.generate_s += time.perf_counter() - t
            actions, last_action_token = [], {}
            for i, gen in zip(active, generations, strict=True):
                episodes[i].append(gen.token_ids, trained=True, logprobs=gen.logprobs)
                last_action_token[i] = len(episodes[i].tokens) - 1
                if not gen.ended:
                    episodes[i].append([tok.end_id], trained=False)
                actions.append(tok.decode(gen.token_ids))

            def step(job):
                i, action = job
                try:
                    self._resume_if_paused(envs[i], stats)
                    return envs[i].step(action), None
                except Exception as exc:
                    return None, exc

            t = time.perf_counter()
            results = list(self.threads.map(step, zip(active, actions, strict=True)))
            stats.env_step_s += time.perf_counter() - t
            stats.env_steps += len(active)
            still_active = []
            for i, (result, error) in zip(active, results, strict=True):
                episode = episodes[i]
                if error is not None:
                    episode.fail(error)
                    continue
                observation, reward, terminated, truncated, info = result
                episode.observations.append(observation)
                episode.turns += 1
                episode.step_rewards.append((last_action_token[i], float(reward)))
                episode.success = episode.success or bool(info.get("success", False))
                if terminated or truncated:
                    episode.truncated = bool(truncated)
                    continue
                episode.append(
                    [tok.observation_id, *tok.encode(observation), tok.end_id, tok.action_id], trained=False
                )
                if len(episode.tokens) + self.max_new_tokens > self.max_episode_tokens:
                    episode.truncated = True
                    continue
                still_active.append(i)
            active = still_active
