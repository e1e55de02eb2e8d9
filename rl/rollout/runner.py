"""`EpisodeRunner`: play GRPO groups (or trees) of episodes of a sandboxed task with the policy, many at
once: one batched generation per turn, the env steps in parallel, every failure of one episode turned into
a masked sample and a replaced env. Its envs live across runs, their sandboxes members of one
`agentenv.SandboxPool` whose residency (`agentenv.pool.residency`) decides which of them run, wait or
pause; the runner tells it which calls run a sandbox, which sandboxes wait and for how long, and asks it
for the groups per wave. Users' guide: docs/training.md, "Sandboxes: one SandboxPool per rollout worker".
Design: docs/design/training.md#rl-rollout-runner.
"""

from __future__ import annotations

import copy
import logging
import os
import secrets
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gymnasium
import torch

import agentenv.tasks  # noqa: F401  (registers the built-in tasks)
from agentenv.factory import sandbox_factory
from agentenv.owner import keeper_labels, owner_labels
from agentenv.pool import NoResidency, PoolMetrics, Residency, SandboxPool
from agentenv.pool.residency import Slot
from rl.config import EnvConfig, RolloutConfig, SandboxPoolConfig
from rl.episode import Episode, EpisodeSummary
from rl.rollout.inflight import InFlightEpisode, env_state, restore_env_state
from rl.rollout.play import StepResult, play
from rl.rollout.programs import ProgramEpisodes, runs_program
from rl.rollout.torch_engine import Generation, TorchEngine
from rl.rollout.trees import TreeGrower
from rl.rollout.wrappers import fork_env, make_env, task, wrapper_specs
from rl.rollout_stats import RolloutStats
from rl.sandbox_hosts import split_hosts
from rl.tokenizer import Tokenizer

log = logging.getLogger(__name__)
WAIT_HISTORY = 16  # generation calls (per batch size) and gaps between runs an expected wait is a p50 of


def task_kwargs(env_cfg: EnvConfig, sandbox: dict[str, Any] | None) -> dict[str, Any]:
    """The task's constructor kwargs: ``env.kwargs``, with the ``sandbox`` group's profile under the
    env's own sandbox overrides (e.g. its image), and its ``hosts`` (remote sandboxes) when set."""
    kwargs = dict(env_cfg.kwargs)
    if sandbox:
        config, hosts = split_hosts(sandbox)
        kwargs["sandbox"] = {"config": config, **(kwargs.get("sandbox") or {})}
        if hosts:
            kwargs["sandbox"]["hosts"] = hosts
    return kwargs


def make_sandbox_pool(pool_cfg: SandboxPoolConfig, remote: bool = False) -> SandboxPool | None:
    """This runner's own pool: conf/agentenv/pool.yaml with ``rollout.sandbox_pool.overrides``; none
    for remote sandboxes (see the module docstring)."""
    if remote:
        return None
    name = f"{pool_cfg.name}-{os.getpid()}-{secrets.token_hex(3)}"
    # owned by this process: if it is killed, `agentenv gc` (and the next run's start) closes them
    return SandboxPool(name, labels=owner_labels(), **pool_cfg.overrides)


class EpisodeRunner:
    """Runs groups of episodes in live sandboxes (see the module docstring)."""

    def __init__(
        self,
        env_cfg: EnvConfig,
        rollout_cfg: RolloutConfig,
        engine: TorchEngine,
        tokenizer: Tokenizer,
        sandbox: dict[str, Any] | None = None,
    ) -> None:
        self.env_id = env_cfg.id
        self.env_kwargs = task_kwargs(env_cfg, sandbox)
        self.wrappers = wrapper_specs(env_cfg.wrappers)
        self.group_start = env_cfg.group_start
        self.max_new_tokens = env_cfg.max_new_tokens
        self.max_episode_tokens = env_cfg.max_episode_tokens
        self.action_room = env_cfg.max_episode_tokens - env_cfg.max_new_tokens  # tokens before an action
        self.engine = engine
        self.tokenizer = tokenizer
        self.remote = "hosts" in (self.env_kwargs.get("sandbox") or {})
        self.sandbox_pool = make_sandbox_pool(rollout_cfg.sandbox_pool, self.remote)
        # where every env's sandboxes come from, decided here once: the hosts, else this runner's pool
        self.sandboxes = sandbox_factory(self.env_kwargs.get("sandbox"), self.sandbox_pool)
        # which sandboxes run, wait or pause: the pool's one residency owner (agentenv.pool.residency);
        # remote sandboxes get one that does nothing (their host decides)
        pool_cfg = rollout_cfg.sandbox_pool
        self.residency: Residency | NoResidency = (
            self.sandbox_pool.residency.configure(pool_cfg.pause_policy, pool_cfg.admission)
            if self.sandbox_pool is not None
            else NoResidency()
        )
        self.policy_latency_s = rollout_cfg.policy_latency_s
        self.max_concurrent_episodes = rollout_cfg.max_concurrent_episodes
        # branching rollouts (rollout.tree, rl.rollout.trees): runs grow trees of group_size leaves
        self.trees = TreeGrower(self, rollout_cfg.tree) if rollout_cfg.tree is not None else None
        # agent-program tasks: the program plays each episode through a gateway (rl.rollout.programs)
        self.programs = ProgramEpisodes(self) if runs_program(self.env_id) else None
        self._generate_s: dict[int, deque[float]] = {}  # batch size -> recent generation call durations
        self._run_gaps: deque[float] = deque(maxlen=WAIT_HISTORY)  # end of a run -> start of the next
        self._run_ended: float | None = None
        self._clock = self.sandbox_pool.sandbox_seconds() if self.sandbox_pool is not None else (0.0, 0.0)
        self._running_bytes: list[int] = []  # running members' RSS at each wait of this run
        self.free_envs: list[gymnasium.Env] = []  # envs between runs; their sandboxes stay pool members
        self._pool_counts = {"pauses": 0, "resumes": 0}
        self._generator = torch.Generator()
        self._policy_version: Callable[[], int] = lambda: 0
        self._stats_lock = threading.Lock()
        self._close_errors = 0  # envs that failed to close (guarded by _stats_lock); see `_close`
        self._close_errors_seen = 0  # ... reported by earlier runs
        self._snapshot_lock = threading.Lock()  # guards the three fields below (see `snapshot`)
        self._run_episodes: list[Episode] | None = None  # every episode of the run in progress
        self._run_tag: Any = None  # ... and its `run(tag=)`
        self._snapshot_request: _SnapshotRequest | None = None
        self.threads = ThreadPoolExecutor(max_workers=rollout_cfg.env_threads)

    # ------------------------------------------------------------------ envs and their sandboxes
    def _take_envs(self, n: int, stats: RolloutStats) -> list[gymnasium.Env]:
        while len(self.free_envs) < n:
            env = make_env(self.env_id, self.env_kwargs, self.wrappers, self.sandboxes)
            if not self.residency.fallback_bytes:
                # the size a sandbox is counted at before the pool has measured one: its memory limit
                self.residency.fallback_bytes = task(env).sandbox_config().memory_bytes
            self.free_envs.append(env)
        taken, self.free_envs = self.free_envs[:n], self.free_envs[n:]
        return taken

    def _give_back(self, env: gymnasium.Env, broken: bool) -> None:
        """Keep ``env`` for the next run (a task leases its sandbox per call: nothing to release), or
        close it when its episode failed."""
        if broken:
            self._discard(env)
            return
        self.free_envs.append(env)

    def _discard(self, env: gymnasium.Env, slot: Slot | None = None) -> None:
        """Close ``env`` and its sandbox (again: a no-op); ``slot``: its use of the gate in progress, if
        any (freed at its end)."""
        if slot is not None:
            self._close(env)
            slot.freed = True
            return
        with self._admitted(env, need_slot=False) as used:
            self._close(env)
            used.freed = True

    def _close(self, env: gymnasium.Env) -> None:
        """Close ``env`` and its sandbox; a failure is logged and counted (`RolloutStats.close_errors`),
        not raised: the run goes on, but a sandbox that would not close may be left behind."""
        try:
            env.close()
        except Exception as exc:
            sandbox = getattr(self._handle(env), "id", None)
            log.warning("could not close an env of %s (sandbox %s): %s: %s", self.env_id, sandbox,
                        type(exc).__name__, exc)
            with self._stats_lock:
                self._close_errors += 1

    @staticmethod
    def _handle(env: gymnasium.Env) -> Any:
        """The sandbox handle ``env`` holds now (None: none), through the wrappers' own attribute lookup."""
        return env.get_wrapper_attr("sandbox")

    @contextmanager
    def _admitted(self, env: gymnasium.Env, stats: RolloutStats | None = None, need_slot: bool = True):
        """A call on ``env``'s sandbox in the block within the residency's slots (`Residency.running`;
        yields its `Slot`, which holds nothing when the residency does not gate): ``need_slot`` when the
        block runs a sandbox (reset, step, fork); the slot goes on with the sandbox the block leaves the
        env in (a reset's new one); the wait for a slot is added to ``stats.slot_wait_s``."""
        with self.residency.running(self._handle(env), need_slot) as slot:
            if stats is not None and slot.waited_s:
                with self._stats_lock:
                    stats.slot_wait_s += slot.waited_s
            try:
                yield slot
            finally:
                slot.handle = self._handle(env)

    @contextmanager
    def _starting(self, k: int, stats: RolloutStats) -> Iterator[tuple[int, list[gymnasium.Env]]]:
        """Slots for up to ``k`` sandboxes the block starts (fork, restore; `Residency.starting`): yields
        (slots taken, ``k`` without a gate; a list for the envs the block started). Each env the block
        appends gets one of the slots; the rest, or all of them if the block raises, are given back."""
        with self.residency.starting(k) as start:
            if start.waited_s:
                with self._stats_lock:
                    stats.slot_wait_s += start.waited_s
            started: list[gymnasium.Env] = []
            yield start.taken, started
            start.started.extend(self._handle(env) for env in started)

    def _free_if_stopped(self, env: gymnasium.Env, slot: Slot) -> None:
        """After a reset or step of ``env`` failed inside ``slot``: give the slot back at the end of the
        use when no sandbox of the env runs any more (its create failed, it died), so that a failed
        episode does not keep a slot parked until the end of the run."""
        if slot.held and not slot.gate.running_fn(self._handle(env)):
            slot.freed = True

    def close(self) -> None:
        """Close every env, then the pool: its members (forks included) and templates are removed."""
        list(self.threads.map(self._discard, self.free_envs))
        self.free_envs = []
        if self.programs is not None:
            self.programs.close()
        if self.sandbox_pool is not None:
            self.sandbox_pool.close()

    def expected_generation_s(self, batch_size: int) -> float:
        """p50 of this runner's recent generation calls of ``batch_size`` episodes (of any size when
        none of that size yet; before the first call ``policy_latency_s``, a lower bound of every call)."""
        recent = self._generate_s.get(batch_size) or [t for d in self._generate_s.values() for t in d]
        return statistics.median(recent) if recent else self.policy_latency_s

    def _generate(self, tokens: list[list[int]], episodes: list[Episode] | None = None):
        """One batched generation call (plus ``policy_latency_s``), timed for `expected_generation_s`;
        a tree run's ``episodes`` each from their own policy state (`TreeGrower.generate`)."""
        t = time.perf_counter()
        if self.trees is not None and self.trees.carries and episodes is not None:
            generations = self.trees.generate(episodes)
        else:
            generations = self.engine.generate(tokens, self.max_new_tokens, self._generator)
        if self.policy_latency_s:
            time.sleep(self.policy_latency_s)
        self._generate_s.setdefault(len(tokens), deque(maxlen=WAIT_HISTORY)).append(time.perf_counter() - t)
        return generations

    @contextmanager
    def _waiting(self, envs: list[gymnasium.Env], expected_wait_s: float, stats: RolloutStats):
        """While ``envs`` wait ``expected_wait_s`` (the block), the residency pauses the sandboxes it
        decides to (`Residency.waiting`, in the background: the block runs meanwhile); each env's next
        step resumes its own."""
        waited = None
        try:
            with self.residency.waiting([self._handle(e) for e in envs], expected_wait_s,
                                        self.threads.submit) as waited:
                yield
        finally:
            if waited is not None and waited.decision is not None:
                stats.pause_waits.extend([expected_wait_s] * waited.paused)
                self._running_bytes.append(waited.running_bytes)

    def release_idle(self, stats: RolloutStats | None = None) -> None:
        """After a run: the residency pauses the free envs' sandboxes if the expected gap until the next
        run is worth it, else keeps the budget (LRU pauses of idle members). Nothing for remote
        sandboxes (no pool)."""
        if self.sandbox_pool is None:
            return
        expected = statistics.median(self._run_gaps) if self._run_gaps else 0.0
        with self._waiting(self.free_envs, expected, stats or RolloutStats()):
            pass
        self.residency.make_room()

    def _record_pool(self, stats: RolloutStats) -> None:
        """The pool's pauses and resumes during this run, and a snapshot of its metrics (none without a
        pool: remote sandboxes)."""
        if self.sandbox_pool is None:
            return
        metrics: PoolMetrics = self.sandbox_pool.metrics()
        stats.pauses = metrics.pauses - self._pool_counts["pauses"]
        stats.resumes = metrics.resumes - self._pool_counts["resumes"]
        self._pool_counts = {"pauses": metrics.pauses, "resumes": metrics.resumes}
        clock = self.sandbox_pool.sandbox_seconds()
        stats.sandbox_running_s = clock[0] - self._clock[0]
        stats.sandbox_paused_s = clock[1] - self._clock[1]
        self._clock = clock
        samples, self._running_bytes = self._running_bytes, []
        running = float(statistics.mean(samples)) if samples else float(metrics.memory_used_bytes)
        slots = self.residency.metrics()["slots"]
        stats.pool = [{**metrics.to_dict(), "running_bytes": running, "slots": slots}]

    # ------------------------------------------------------------------ episodes
    def run(
        self,
        seeds: list[int],
        group_size: int,
        generator: torch.Generator,
        first_group: int = 0,
        policy_version: Callable[[], int] | None = None,
        tag: Any = None,
    ) -> tuple[list[Episode], RolloutStats]:
        """One episode per group member for each seed; episodes come back group after group.

        ``policy_version()`` is called before every turn's generation and returns the weights version
        the policy holds for it (None: version 0 throughout). The groups are played in waves of whole
        groups (`_groups_per_wave`). ``tag`` names the run in a `snapshot` of it (the async driver's
        call number)."""
        stats = RolloutStats()
        started = time.perf_counter()
        self._generator = generator
        self._policy_version = policy_version or (lambda: 0)
        if self.programs is not None:  # agent programs play the episodes (rl.rollout.programs)
            return self._finish(self.programs.run(seeds, group_size, first_group, tag, stats), stats, started)
        if self.trees is not None:  # branching rollouts: every group at once (rl.rollout.trees)
            episodes = self.trees.run(seeds, group_size, first_group, tag, stats)
            return self._finish(episodes, stats, started)
        episodes = [
            Episode(self.env_id, seed, first_group + g)
            for g, seed in enumerate(seeds)
            for _ in range(group_size)
        ]
        cap = self.max_concurrent_episodes
        if cap is not None and cap < group_size:
            raise ValueError(
                f"rollout.max_concurrent_episodes={cap} is below the group size {group_size}: episodes "
                "are played in whole groups; set it to at least the group size (or None: no cap)"
            )
        with self._running(episodes, tag):
            w = 0
            while w < len(seeds):
                per_wave = self._groups_per_wave(group_size, len(seeds) - w)
                wave = episodes[w * group_size : (w + per_wave) * group_size]
                stats.waves += 1
                with self.residency.demand(len(wave)):
                    t0 = time.perf_counter()
                    envs, owned_forks = self._start_groups(seeds[w : w + per_wave], group_size, wave, stats)
                    stats.reset_s += time.perf_counter() - t0
                    self._play(wave, envs, stats, owned=owned_forks)
                    self._return_envs(envs, wave, owned_forks)
                w += per_wave
        return self._finish(episodes, stats, started)

    def _groups_per_wave(self, group_size: int, remaining: int) -> int:
        """Whole groups (at least one) the next wave of a run plays, out of the ``remaining`` ones.

        ``rollout.max_concurrent_episodes`` when set, else the residency's plan (`Residency.plan`: all
        of them, or waves that fit its free slots when that is faster than pausing the episodes beyond
        them every turn), against this runner's expected generation times and the host's cores."""
        cap = self.max_concurrent_episodes
        if cap is not None:
            return min(remaining, max(1, cap // group_size))
        return self.residency.plan(group_size, remaining, self.expected_generation_s, os.cpu_count() or 1)

    def _return_envs(self, envs: list, episodes: list[Episode], owned: set[int]) -> None:
        """After play: close the envs in ``owned`` (forks, restores), give the others back for reuse."""
        for env, episode in zip(envs, episodes, strict=True):
            if env is None:
                continue
            if id(env) in owned:
                self._discard(env)
            else:
                self._give_back(env, broken=episode.error is not None)

    def _finish(
        self, episodes: list[Episode], stats: RolloutStats, started: float
    ) -> tuple[list[Episode], RolloutStats]:
        """The end of a run: idle sandboxes released, the pool's counters and the episodes' outcomes
        recorded in ``stats``."""
        if self.trees is not None:  # the leaves no path reached (rl.rollout.trees)
            self.trees.finish(episodes)
        if self._run_ended is not None:
            self._run_gaps.append(started - self._run_ended)
        self.release_idle(stats)
        self._record_pool(stats)
        stats.episodes = len(episodes)
        stats.failed = sum(1 for e in episodes if e.error)
        # each error's first line says what failed; the task-file frames of its traceback follow
        stats.errors = [f"seed {e.seed}: {e.error}" + (f"\n{e.trace}" if e.trace else "")
                        for e in episodes if e.error]
        stats.outcomes = [EpisodeSummary.of(e) for e in episodes]
        stats.generated_tokens = (
            sum(sum(e.action_mask) for e in episodes) if self.trees is None else self.trees.sampled(episodes)
        )
        with self._stats_lock:
            stats.close_errors = self._close_errors - self._close_errors_seen
            self._close_errors_seen = self._close_errors
        stats.total_s = time.perf_counter() - started
        self._run_ended = time.perf_counter()
        return episodes, stats

    def _start_groups(self, seeds, group_size, episodes, stats):
        """Reset the envs of every group; returns one env per episode (None where the start failed)."""
        envs: list[gymnasium.Env | None] = [None] * len(episodes)
        owned_forks: set[int] = set()
        if self.group_start == "seed":
            taken = self._take_envs(len(episodes), stats)
            jobs = [(env, episodes[i].seed) for i, env in enumerate(taken)]
        else:
            taken = self._take_envs(len(seeds), stats)
            jobs = [(env, seed) for env, seed in zip(taken, seeds, strict=True)]

        def reset(job):
            env, seed = job
            with self._admitted(env, stats) as slot:  # the reset creates or resumes its sandbox: a slot
                created = task(env).sandboxes_created
                try:
                    observation, _ = env.reset(seed=seed)
                    return observation, None
                except Exception as exc:  # the episode fails, not the run
                    self._free_if_stopped(env, slot)
                    return None, exc
                finally:  # a new sandbox for a new env, or for the episode after a played one
                    with self._stats_lock:
                        stats.sandboxes_created += task(env).sandboxes_created - created

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
                forks = self._fork(env, group_size - 1, stats)
            except Exception as exc:
                return obs, exc, []
            with self._stats_lock:
                stats.fork_s += time.perf_counter() - t
                stats.forks += group_size - 1
            return obs, None, forks

        t = time.perf_counter()
        forked = list(self.threads.map(fork, zip(jobs, results, strict=True)))
        stats.fork_phase_s += time.perf_counter() - t
        for g, (obs, err, forks) in enumerate(forked):
            members = [jobs[g][0], *forks] if err is None else [jobs[g][0]] + [None] * (group_size - 1)
            owned_forks.update(id(f) for f in forks)
            for j, env in enumerate(members):
                self._begin(episodes[g * group_size + j], env, obs, err, envs, g * group_size + j)
        return envs, owned_forks

    def _fork(self, env: gymnasium.Env, n: int, stats: RolloutStats) -> list[gymnasium.Env]:
        """``n`` forks of a reset env, in as many calls as the residency's slots allow (each fork a slot,
        taken first; the parent keeps its own slot while it runs, and a paused parent, e.g. one whose
        slot another start took, is forked from its checkpoint); all or none."""
        forks: list[gymnasium.Env] = []
        try:
            while len(forks) < n:
                with self._starting(n - len(forks), stats) as (taken, started):
                    with self._admitted(env, need_slot=False):
                        started += fork_env(env, taken)
                forks += started
        except BaseException:
            for f in forks:
                self._discard(f)
            raise
        return forks

    def _begin(self, episode: Episode, env, observation, error, envs, index) -> None:
        envs[index] = env
        if error is not None:
            episode.fail(error)
            return
        episode.begin(observation, self.tokenizer, self._policy_version())

    def _play(
        self,
        episodes: list[Episode],
        envs: list,
        stats: RolloutStats,
        active: list[int] | None = None,
        owned: set[int] | frozenset[int] = frozenset(),
    ) -> None:
        """Play ``episodes`` (those at ``active``, default: every one without an error) to their end
        through the play loop (`rl.rollout.play.play`). ``owned``: ids of the envs closed after the run
        (forks, restores); under a binding budget one is closed as soon as its episode ends, which frees
        its slot without a pause."""
        if active is None:
            active = [i for i, e in enumerate(episodes) if e.error is None]

        def generate(active: list[int]) -> list[Generation]:
            t = time.perf_counter()
            expected = self.expected_generation_s(len(active))
            with self._waiting([envs[i] for i in active], expected, stats):
                playing = [episodes[i] for i in active]
                generations = self._generate([e.tokens for e in playing], playing)
            stats.generate_s += time.perf_counter() - t
            for episode, gen in zip(playing, generations, strict=True):  # what the engine had to read
                stats.context_tokens += len(episode.tokens)
                read = gen.context_read
                stats.context_tokens_read += len(episode.tokens) if read is None else read
            return generations

        def step_all(jobs: list[tuple[int, str]]) -> dict[int, StepResult]:
            # a binding budget: a stepped env pauses inside its slot when another env waits for one
            # (else it keeps the slot, parked, until someone needs it), and the envs whose sandboxes
            # still run step first (no resume)
            gated = self.residency.binds

            def step(job: tuple[int, str]) -> StepResult:
                i, action = job
                with self._admitted(envs[i], stats) as slot:  # the step resumes its sandbox: a slot
                    try:
                        result = envs[i].step(action)
                    except Exception as exc:
                        self._free_if_stopped(envs[i], slot)
                        return None, exc
                    ended = result[2] or result[3]
                    if slot.held and ended and gated and id(envs[i]) in owned:
                        self._discard(envs[i], slot)  # `_return_envs` finds it closed
                    elif slot.held and not ended and self.residency.waiting_for_slot:
                        slot.pause()  # its slot is free for the waiter right away
                    return result, None

            if gated:
                jobs = sorted(jobs, key=lambda job: not self.residency.parked(self._handle(envs[job[0]])))
            t = time.perf_counter()
            results = dict(zip([i for i, _ in jobs], self.threads.map(step, jobs), strict=True))
            stats.env_step_s += time.perf_counter() - t
            stats.env_steps += len(jobs)
            return results

        def after_turn(active: list[int]) -> list[int]:
            if self.trees is None:
                return active
            return self.trees.branch(episodes, envs, active, owned, stats)  # leaves fork at branch turns

        play(episodes, active, generate, step_all, self.tokenizer, self.action_room, self._policy_version,
             before_turn=lambda active: self._serve_snapshot({id(episodes[i]): envs[i] for i in active}),
             after_turn=after_turn)

    # ------------------------------------------------------------------ in-flight checkpoints
    def snapshot(self, keeper: Path, timeout_s: float = 600.0) -> tuple[list[InFlightEpisode], Any] | None:
        """Record the run in progress at its next turn boundary, for a checkpoint kept in ``keeper``
        (see ``rl.rollout.inflight``): ``(one InFlightEpisode per episode of the run, the run's tag)``, or
        None
        when no run is in progress or the sandboxes are remote (no pool to keep them in). Called from
        another thread than the run's."""
        with self._snapshot_lock:
            if self._run_episodes is None or self.sandbox_pool is None:
                return None
            request = _SnapshotRequest(Path(keeper))
            self._snapshot_request = request
        if not request.done.wait(timeout_s):
            with self._snapshot_lock:
                if self._snapshot_request is request:
                    self._snapshot_request = None
            if not request.done.is_set():
                raise TimeoutError(f"the rollout reached no turn boundary within {timeout_s} s")
        if request.error is not None:
            raise request.error
        return request.result, request.tag

    def _serve_snapshot(self, playing: dict[int, gymnasium.Env]) -> None:
        """At a turn boundary: take a pending `snapshot` request (``playing``: episode id -> its env)."""
        with self._snapshot_lock:
            request, self._snapshot_request = self._snapshot_request, None
            episodes, tag = self._run_episodes, self._run_tag
        if request is None:
            return
        try:
            request.result = self._record_in_flight(episodes or [], playing, request.keeper)
            request.tag = tag
        except BaseException as exc:  # reported to the caller of `snapshot`; the run goes on
            request.error = exc
        finally:
            request.done.set()

    @contextmanager
    def _running(self, episodes: list[Episode], tag: Any):
        """Mark a run in progress (for `snapshot`); at its end a request still pending is answered with
        the finished episodes."""
        with self._snapshot_lock:
            self._run_episodes, self._run_tag = episodes, tag
        try:
            yield
        finally:
            self._serve_snapshot({})
            with self._snapshot_lock:
                self._run_episodes = None

    def _record_in_flight(
        self, episodes: list[Episode], playing: dict[int, gymnasium.Env], keeper: Path
    ) -> list[InFlightEpisode]:
        """Copies of ``episodes``; each playing one's sandbox paused and kept by ``keeper`` while its env
        goes on in a fork of it (an episode whose sandbox cannot be kept is recorded as failed)."""
        labels = keeper_labels(keeper)
        pool = self.sandbox_pool

        def keep(env: gymnasium.Env) -> str | BaseException:
            """The id of the kept sandbox (the env goes on in a fork of it), or why it could not be kept."""
            t = task(env)
            with self._admitted(env):  # the fork it goes on in runs: a slot
                try:
                    pool.pause(t.sandbox)  # no-op when the cost model paused it already
                    live = pool.fork(t.sandbox, 1)[0]
                    kept = pool.keep(t.sandbox, labels)
                except Exception as exc:
                    return exc
                t.adopt_sandbox(live)
                return kept.id

        order = [id(e) for e in episodes if id(e) in playing]
        kept = dict(zip(order, self.threads.map(keep, [playing[i] for i in order]), strict=True))
        records = []
        for episode in episodes:
            copied = copy.deepcopy(episode)
            sandbox_id = kept.get(id(episode))
            if isinstance(sandbox_id, str):
                state = env_state(playing[id(episode)])
                records.append(InFlightEpisode(copied, playing=True, sandbox_id=sandbox_id, env_state=state))
                continue
            if isinstance(sandbox_id, BaseException):
                log.warning("in-flight episode (seed %d) not kept: %s", episode.seed, sandbox_id)
                copied.fail(f"its sandbox could not be kept at the checkpoint: {sandbox_id}", "sandbox_lost")
            records.append(InFlightEpisode(copied, playing=False))
        return records

    def resume(
        self,
        recorded: list[InFlightEpisode],
        group_size: int,
        generator: torch.Generator,
        policy_version: Callable[[], int] | None = None,
        tag: Any = None,
    ) -> tuple[list[Episode], RolloutStats]:
        """Finish a rollout recorded by `snapshot` (after a restart): playing episodes continue in
        restores of their kept sandboxes, groups that had not started start now, finished episodes are
        returned as they were. Episodes come back group after group, as from `run`."""
        stats = RolloutStats()
        started = time.perf_counter()
        self._generator = generator
        self._policy_version = policy_version or (lambda: 0)
        if self.programs is not None:  # agent programs: recorded between waves (rl.rollout.programs)
            return self._finish(self.programs.resume(recorded, group_size, tag, stats), stats, started)
        episodes = [r.episode for r in recorded]
        with self.residency.demand(len(episodes)):
            return self._resume(recorded, episodes, group_size, tag, stats, started)

    def _resume(
        self,
        recorded: list[InFlightEpisode],
        episodes: list[Episode],
        group_size: int,
        tag: Any,
        stats: RolloutStats,
        started: float,
    ) -> tuple[list[Episode], RolloutStats]:
        """`resume` inside its demand on the gate."""
        envs: list[gymnasium.Env | None] = [None] * len(episodes)

        def restore(i: int) -> gymnasium.Env | BaseException:
            if self.sandbox_pool is None:
                return RuntimeError("in-flight episodes resume only with a local sandbox pool")
            env = make_env(self.env_id, self.env_kwargs, self.wrappers, self.sandboxes)
            try:
                with self._starting(1, stats) as (_, started):  # the restore runs: a slot
                    restore_env_state(env, recorded[i].env_state or [])
                    task(env).adopt_sandbox(self.sandbox_pool.restore(recorded[i].sandbox_id))
                    started.append(env)
            except Exception as exc:
                self._discard(env)
                return exc
            return env

        t0 = time.perf_counter()
        playing = [i for i, r in enumerate(recorded) if r.playing]
        for i, env in zip(playing, self.threads.map(restore, playing), strict=True):
            if isinstance(env, BaseException):
                episodes[i].fail(f"could not restore its kept sandbox {recorded[i].sandbox_id}: {env}",
                                 "sandbox_lost")
            else:
                envs[i] = env
        unstarted = [
            g for g in range(len(episodes) // group_size)
            if all(not e.tokens and e.error is None for e in episodes[g * group_size : (g + 1) * group_size])
        ]
        owned: set[int] = {id(env) for env in envs if env is not None}  # restored: closed at the end
        for g in unstarted:
            members = slice(g * group_size, (g + 1) * group_size)
            seed = episodes[members][0].seed
            start = self._start_groups if self.trees is None else self.trees.start_groups  # trees: roots
            fresh, forks = start([seed], group_size, episodes[members], stats)
            envs[members] = fresh
            owned |= forks
        stats.reset_s += time.perf_counter() - t0
        active = [i for i, env in enumerate(envs) if env is not None and episodes[i].error is None]
        with self._running(episodes, tag):
            self._play(episodes, envs, stats, active, owned)
        self._return_envs(envs, episodes, owned)
        return self._finish(episodes, stats, started)


@dataclass
class _SnapshotRequest:
    """A pending `EpisodeRunner.snapshot`, answered by the run's thread at a turn boundary."""

    keeper: Path
    done: threading.Event = field(default_factory=threading.Event)
    result: list[InFlightEpisode] | None = None
    tag: Any = None
    error: BaseException | None = None
