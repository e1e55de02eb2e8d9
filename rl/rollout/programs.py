"""Rollouts of agent-program tasks (`agentenv.tasks.agent_program`): the program plays, the gateway records.

For a task that ``runs_program``, `EpisodeRunner.run` hands its groups to `ProgramEpisodes`. Each episode:
the env is reset as any task's (the runner's group starts: seeds or forks, slots, failures), an episode
key is opened on the runner's own gateway (`rl.rollout.gateway.service.Gateway` over the runner's engine,
so the same weights, ``env.action_vocabulary`` and version), the program is started by the env's one step
with `SandboxLink.env`'s variables (``OPENAI_BASE_URL``, ``OPENAI_API_KEY``) and ``OPENAI_MODEL``, and
waited for within the task's ``program.timeout_s``. The key's calls (`rl.rollout.gateway.capture`) become
the episode's tokens through `rl.rollout.gateway.samples.episode_samples`, without re-tokenising: prompts'
new parts are observation tokens (out of the loss), completions action tokens with their captured
log-probs, versions and routes; the verifier's reward sits on the last action token.

One episode is one training row (the learner's groups have ``group_size`` rows): when the program's calls
make several samples (it rewrote its history), the one with the most action tokens is trained and the
others' calls are counted in the task metric ``untrained_calls``. A program that crashes fails the episode
as ``runtime_error``, one past its timeout as ``exec_timeout`` (`rl.failures`): weight 0, its captured
tokens kept for inspection. A wave's programs all run at once (the wave is what the runner's slots and
``rollout.max_concurrent_episodes`` allow; ``rollout.env_threads`` caps only turn-based stepping), so the
gateway batches their calls together. The policy version is read once per wave, before the programs
start: in async training new weights are swapped in between waves, never under a running program. An
in-flight checkpoint (`EpisodeRunner.snapshot`) is taken at the next wave boundary: the finished episodes
as they are and the groups not started yet, which `ProgramEpisodes.resume` plays after a restart.
"""

from __future__ import annotations

import importlib
import json
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import gymnasium
import torch

from agentenv import Sandbox
from agentenv.errors import ConfigError
from rl.episode import Episode
from rl.rollout.gateway.capture import EpisodeRecord
from rl.rollout.gateway.samples import episode_samples
from rl.rollout.gateway.service import Gateway
from rl.rollout.gateway.settings import GatewaySettings
from rl.rollout.inflight import InFlightEpisode
from rl.rollout.wrappers import task
from rl.rollout_stats import RolloutStats

if TYPE_CHECKING:  # the HTTP stack (FastAPI, uvicorn) is imported by the workers of program tasks only
    from rl.rollout.gateway.sandbox_link import SandboxLink

EpisodeRunner = Any  # the `rl.rollout.runner.EpisodeRunner` that owns this part (it imports this module)

MODEL_NAME = "k3-policy"  # what the programs pass as ``model`` ($OPENAI_MODEL)
BATCH_WINDOW_S = 0.02  # the gateway's gathering gap: concurrent programs' calls are sampled together
MAX_BATCH_ROWS = 64


def runs_program(env_id: str) -> bool:
    """Whether ``env_id``'s task class plays its episodes with a program (``runs_program = True``)."""
    module, _, bare = env_id.rpartition(":")
    try:
        if module:  # a user's task module registers its ids on import (as gymnasium.make does)
            importlib.import_module(module)
        entry = gymnasium.spec(bare).entry_point
    except (ImportError, gymnasium.error.Error):
        return False  # make_env says what is wrong
    creator = gymnasium.envs.registration.load_env_creator(entry) if isinstance(entry, str) else entry
    return bool(getattr(creator, "runs_program", False))


def local_sandbox(handle: Any) -> Sandbox:
    """The `agentenv.Sandbox` under a task's handle (a pool member's own), for the link."""
    return handle.sandbox if not isinstance(handle, Sandbox) and hasattr(handle, "sandbox") else handle


def program_episode(episode: Episode, record: EpisodeRecord, reward: float) -> int:
    """Fill ``episode`` with the trained sample of ``record``'s calls (module docstring); returns the
    number of samples the calls made."""
    samples = episode_samples(record, reward, episode.env_id, episode.seed, episode.group)
    if not samples:
        return 0
    trained = max(reversed(samples), key=lambda s: sum(s.action_mask))  # ties: the later one
    for name in ("tokens", "action_mask", "logprobs", "versions", "routes", "step_rewards", "turns"):
        setattr(episode, name, getattr(trained, name))
    episode.record_info({"calls": len(record.calls), "untrained_calls": len(record.calls) - trained.turns})
    return len(samples)


class ProgramEpisodes:
    """The program-task side of an `EpisodeRunner` (module docstring); owns the gateway and its link."""

    def __init__(self, runner: EpisodeRunner) -> None:
        if runner.trees is not None:
            raise ConfigError(f"rollout.tree: {runner.env_id} is played by an agent program, which no "
                              "rollout can branch; set rollout.tree=null")
        if runner.remote:
            raise ConfigError(f"sandbox.hosts: {runner.env_id} is played by an agent program, which "
                              "reaches the policy from this machine's sandboxes only; remove sandbox.hosts")
        self.runner = runner
        self.link: SandboxLink | None = None

    def _link(self) -> SandboxLink:
        if self.link is None:
            from rl.rollout.gateway.sandbox_link import SandboxLink

            r = self.runner
            settings = GatewaySettings(
                model_name=MODEL_NAME, context_tokens=r.max_episode_tokens, max_tokens=r.max_new_tokens,
                max_n=1, batch_window_s=BATCH_WINDOW_S, max_batch_rows=MAX_BATCH_ROWS, open_access=False,
                seed=int(torch.randint(2**31 - 1, (1,), generator=r._generator)),  # the first run's
            )  # fmt: skip
            self.link = SandboxLink(Gateway(r.engine, r.tokenizer, settings)).start()
        return self.link

    def close(self) -> None:
        if self.link is not None:
            self.link.close()
            self.link = None

    def run(self, seeds: list[int], group_size: int, first_group: int, tag: Any,
            stats: RolloutStats) -> list[Episode]:
        """One episode per group member for each seed, group after group (as `EpisodeRunner.run`)."""
        r = self.runner
        episodes = [Episode(r.env_id, seed, first_group + g) for g, seed in enumerate(seeds)
                    for _ in range(group_size)]
        self._play_groups(episodes, list(range(len(seeds))), group_size, tag, stats)
        return episodes

    def resume(self, recorded: list[InFlightEpisode], group_size: int, tag: Any,
               stats: RolloutStats) -> list[Episode]:
        """Finish a run recorded by `EpisodeRunner.snapshot` (at a wave boundary: no episode was playing):
        finished episodes come back as they were, the groups that had not started are played now."""
        if any(r.playing for r in recorded):
            raise ValueError("a program run is recorded between waves; this record has playing episodes")
        episodes = [r.episode for r in recorded]
        unstarted = [g for g in range(len(episodes) // group_size)
                     if all(not e.tokens and e.error is None
                            for e in episodes[g * group_size : (g + 1) * group_size])]
        self._play_groups(episodes, unstarted, group_size, tag, stats)
        return episodes

    def _play_groups(self, episodes: list[Episode], groups: list[int], group_size: int, tag: Any,
                     stats: RolloutStats) -> None:
        """Play the ``groups`` (indices into ``episodes``, in groups of ``group_size``) in waves; a
        `EpisodeRunner.snapshot` is answered at the next wave boundary, with the episodes finished so far."""
        r = self.runner
        with r._running(episodes, tag):
            w = 0
            while w < len(groups):
                per_wave = r._groups_per_wave(group_size, len(groups) - w)
                chosen = groups[w : w + per_wave]
                wave = [e for g in chosen for e in episodes[g * group_size : (g + 1) * group_size]]
                stats.waves += 1
                with r.residency.demand(len(wave)):
                    self._wave([episodes[g * group_size].seed for g in chosen], group_size, wave, stats)
                w += per_wave
                r._serve_snapshot({})  # a wave boundary: no program runs

    def _wave(self, seeds: list[int], group_size: int, wave: list[Episode], stats: RolloutStats) -> None:
        r = self.runner
        link = self._link()
        starts = [Episode(e.env_id, e.seed, e.group) for e in wave]  # the resets' observations and errors
        t0 = time.perf_counter()
        envs, owned = r._start_groups(seeds, group_size, starts, stats)
        stats.reset_s += time.perf_counter() - t0
        link.gateway.batcher.version = r._policy_version()  # async: swapped in before the programs start

        def play(i: int) -> None:
            episode, start = wave[i], starts[i]
            episode.observations = list(start.observations)
            if start.error is not None:
                episode.error, episode.failure, episode.trace = start.error, start.failure, start.trace
                return
            self._play(envs[i], episode, stats)

        t, engine_s = time.perf_counter(), link.gateway.batcher.engine_s
        # every program of the wave at once (the wave is what the slots and max_concurrent_episodes
        # allow): an episode's thread only waits on its program, and the more programs call at once, the
        # fuller the gateway's batches; rollout.env_threads caps turn-based stepping, not this
        with ThreadPoolExecutor(max_workers=len(wave), thread_name_prefix="program") as threads:
            list(threads.map(play, range(len(wave))))
        stats.env_step_s += time.perf_counter() - t
        stats.generate_s += link.gateway.batcher.engine_s - engine_s  # the wave's calls, in the gateway
        stats.env_steps += sum(1 for s in starts if s.error is None)
        r._return_envs(envs, wave, owned)

    def _play(self, env: gymnasium.Env, episode: Episode, stats: RolloutStats) -> None:
        """Run the program of ``env``'s episode under a key of its own; fill ``episode`` from its calls."""
        r, link = self.runner, self._link()
        key = link.gateway.keys.open()
        result, error = None, None
        try:
            with r._admitted(env, stats) as slot:  # the program runs the sandbox: a slot
                t = task(env)
                t.hold_sandbox()  # running (resumed if paused) from linking until the program ends
                sandbox = None
                try:
                    sandbox = local_sandbox(t.sandbox)
                    variables = {**link.env(sandbox, key), "OPENAI_MODEL": MODEL_NAME}
                    result = env.step(json.dumps(variables))
                except Exception as exc:
                    r._free_if_stopped(env, slot)
                    error = exc
                finally:
                    t.release_sandbox()
                    if sandbox is not None:
                        link.detach(sandbox.id)
        finally:
            record = link.gateway.keys.close(key)
        reward = 0.0 if result is None else float(result[1])
        samples = program_episode(episode, record, reward)
        if error is not None:
            episode.fail(error)
            return
        observation, _, terminated, truncated, info = result
        episode.observations.append(observation)
        episode.success = bool(info.get("success", False))
        episode.truncated = bool(truncated and not terminated)
        episode.record_info(info)
        if not samples:
            episode.fail("the agent program ended without calling the policy: nothing to train",
                         "runtime_error")
