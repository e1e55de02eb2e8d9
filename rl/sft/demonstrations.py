"""`python -m rl.sft.demonstrations [overrides]`: demonstration episodes of a scripted expert, as JSONL.

The expert plays the task in a real sandbox like a policy, and each episode is written in the RL loop's token
layout under the same limits, so SFT trains on exactly what RL produces. Seeded, so a command writes the
same file every time; written atomically (``overwrite=true`` to replace).

Design: docs/design/training.md#rl-demonstrations.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from collections.abc import Generator
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gymnasium
import hydra
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from agentenv.errors import BackendUnavailable
from agentenv.paths import conf_dir
from rl.config import ConfigError, EnvConfig, RunConfig
from rl.config.load import load
from rl.episode import Episode
from rl.rollout.play import StepResult, play
from rl.rollout.torch_engine import Generation
from rl.seeds import demonstration_seeds
from rl.sft.experts import Expert, ExpertError, expert_for
from rl.tokenizer import Tokenizer

DEMO_KEYS = ("expert", "num_episodes", "out", "overwrite")  # conf/demonstrations.yaml's own keys


class DemonstrationError(ValueError):
    """The expert's play cannot be written in the RL loop's format under this config."""


@dataclass
class Demonstration:
    """One expert episode: the `Episode` as the RL loop lays it out, and what produced it."""

    episode: Episode
    actions: list[str]
    expert: str  # the expert's quality
    tokenizer: str  # "bytes" or the HF tokenizer folder: the ids mean nothing without it

    @property
    def reward(self) -> float:
        return self.episode.reward

    def to_json(self) -> dict[str, Any]:
        record = dataclasses.asdict(self.episode)
        record.pop("routes")  # an expert's play has no routing record (and a tensor is no JSON)
        record.update(actions=self.actions, reward=self.reward, expert=self.expert, tokenizer=self.tokenizer)
        return record

    @classmethod
    def from_json(cls, record: dict[str, Any]) -> Demonstration:
        names = {f.name for f in dataclasses.fields(Episode)}
        episode = Episode(**{k: v for k, v in record.items() if k in names})
        episode.step_rewards = [(int(i), float(r)) for i, r in episode.step_rewards]
        return cls(episode, list(record["actions"]), record["expert"], record["tokenizer"])


def read_demonstrations(path: str | Path) -> list[Demonstration]:
    """The demonstrations of a JSONL file written by this command."""
    out = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        try:
            out.append(Demonstration.from_json(json.loads(line)))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}:{number}: not a demonstration episode ({exc})") from None
    return out


class Recorder:
    """Plays one expert episode in an env through the rollout's play loop (`rl.rollout.play`), the expert in
    the policy's place, so it is laid out token by token as the RL loop lays out its episodes."""

    def __init__(self, env_cfg: EnvConfig, tokenizer: Tokenizer, tokenizer_name: str) -> None:
        self.env_id = env_cfg.id
        self.max_new_tokens = env_cfg.max_new_tokens
        self.action_room = env_cfg.max_episode_tokens - env_cfg.max_new_tokens  # tokens before an action
        self.vocabulary = set(env_cfg.action_vocabulary) if env_cfg.action_vocabulary else None
        self.tok = tokenizer
        self.tokenizer_name = tokenizer_name

    def action_ids(self, action: str) -> list[int]:
        """The policy's tokens for ``action``, its end-of-turn token included; refused when the RL loop's
        policy could not generate them."""
        if self.vocabulary is not None and not set(action) <= self.vocabulary:
            raise DemonstrationError(
                f"the expert's action {action!r} uses characters outside env.action_vocabulary="
                f"{''.join(sorted(self.vocabulary))!r}"
            )
        ids = [*self.tok.encode(action), self.tok.end_id]
        if len(ids) > self.max_new_tokens:
            raise DemonstrationError(
                f"the expert's action {action!r} is {len(ids)} tokens with the end-of-turn token, more than "
                f"env.max_new_tokens={self.max_new_tokens}; raise env.max_new_tokens to {len(ids)}"
            )
        return ids

    def play(self, env: gymnasium.Env, expert: Expert, seed: int, group: int) -> Demonstration:
        """One episode from ``env.reset(seed=seed)``; an env failure is recorded in ``episode.error``."""
        tok = self.tok
        episode = Episode(self.env_id, seed, group)
        actions: list[str] = []
        demo = Demonstration(episode, actions, expert.quality, self.tokenizer_name)
        try:
            observation, _ = env.reset(seed=seed)
        except BackendUnavailable as exc:  # no sandbox can start: a file of failed episodes is no use
            raise DemonstrationError(f"no sandbox could be started: {exc}") from None
        except Exception as exc:  # a broken sandbox fails the episode, not the run (as in rl.rollout.runner)
            episode.fail(exc)
            return demo
        expert.start(observation)
        episode.begin(observation, tok)

        def generate(active: list[int]) -> list[Generation]:  # the expert in the policy's place
            ids = self.action_ids(expert.act(episode.observations[-1]))
            return [Generation(token_ids=ids, logprobs=[0.0] * len(ids), ended=True)]

        def step(jobs: list[tuple[int, str]]) -> dict[int, StepResult]:
            (i, action), = jobs  # the text the RL loop would step the env with
            actions.append(action)
            try:
                return {i: (env.step(action), None)}
            except Exception as exc:
                return {i: (None, exc)}

        # recorded as the RL loop records a turn, and stopped where it stops an episode
        play([episode], [0], generate, step, tok, self.action_room, version=lambda: 0)
        return demo


def task_env(run: RunConfig) -> gymnasium.Env:
    """The task as the rollout makes it: kwargs with the sandbox profile, gymnasium checks, wrappers; its
    sandboxes on this machine, or on ``sandbox.hosts`` when set (no pool: one live sandbox is reused)."""
    from agentenv.factory import sandbox_factory
    from rl.rollout.runner import task_kwargs
    from rl.rollout.wrappers import make_env, wrapper_specs

    kwargs = task_kwargs(run.env, run.sandbox)
    sandboxes = sandbox_factory(kwargs.get("sandbox"))
    return make_env(run.env.id, kwargs, wrapper_specs(run.env.wrappers), sandboxes)


def record(
    run: RunConfig, tokenizer: Tokenizer, quality: str | None, num_episodes: int, tokenizer_name: str
) -> Generator[Demonstration]:
    """Play ``num_episodes`` expert episodes in one live sandbox (replaced if an episode breaks it)."""
    recorder = Recorder(run.env, tokenizer, tokenizer_name)
    env = task_env(run)
    try:
        for index, seed in enumerate(demonstration_seeds(run.seed, num_episodes)):
            demo = recorder.play(env, expert_for(run.env.expert, quality, seed), seed, index)
            yield demo
            if demo.episode.error is not None:
                env.close()
                env = task_env(run)
    finally:
        env.close()


def write(demos: Generator[Demonstration], out: Path, overwrite: bool) -> dict[str, float]:
    """Write ``demos`` to ``out`` (via a temporary file renamed at the end); return a summary. The
    generator is closed in any case (its sandbox too)."""
    if out.exists() and not overwrite:
        demos.close()
        raise DemonstrationError(f"out={out} exists; choose another path or pass overwrite=true")
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(f".{out.name}.partial")
    counts = {"episodes": 0, "success": 0, "reward": 0.0, "turns": 0, "failed": 0}
    try:
        with closing(demos), partial.open("w") as f:
            for demo in demos:
                f.write(json.dumps(demo.to_json()) + "\n")
                ep = demo.episode
                counts["episodes"] += 1
                counts["success"] += ep.success
                counts["reward"] += ep.reward
                counts["turns"] += ep.turns
                counts["failed"] += ep.error is not None
        os.replace(partial, out)
    finally:
        partial.unlink(missing_ok=True)
    n = max(1, counts["episodes"])
    return {
        "episodes": counts["episodes"],
        "success_rate": counts["success"] / n,
        "mean_reward": counts["reward"] / n,
        "mean_turns": counts["turns"] / n,
        "failed": counts["failed"],
    }


def demo_settings(cfg: DictConfig) -> tuple[DictConfig, dict[str, Any]]:
    """Split the composed config into the run config (checked by `rl.config.load`) and this command's
    own keys (conf/demonstrations.yaml)."""
    own = {
        key: OmegaConf.to_container(cfg[key], resolve=True) if OmegaConf.is_config(cfg[key]) else cfg[key]
        for key in DEMO_KEYS
    }
    run_cfg = OmegaConf.masked_copy(cfg, [k for k in cfg if k not in DEMO_KEYS])
    if not isinstance(own["num_episodes"], int) or own["num_episodes"] < 1:
        raise ConfigError(f"num_episodes: must be an integer >= 1, got {own['num_episodes']!r}")
    if not own["out"]:
        raise ConfigError("out: the JSONL file to write is not set")
    return run_cfg, own


def run_demonstrations(cfg: DictConfig) -> tuple[Path, dict[str, float]]:
    """Check the config, record the episodes, write the file; returns its path and a summary."""
    from rl.tokenizer import build_tokenizer

    run_cfg, own = demo_settings(cfg)
    run = load(run_cfg)
    quality = (own["expert"] or {}).get("quality")
    if not run.env.expert:
        raise ConfigError(f"env.expert: the task {run.env.id} names no scripted expert; set env.expert to "
                          "module:Class (an rl.sft.experts.Expert) or module:function (observation -> "
                          "action)")
    try:
        expert_for(run.env.expert, quality)  # an unknown expert or quality stops here, before any sandbox
    except ExpertError as exc:
        raise ConfigError(str(exc)) from None
    tokenizer = build_tokenizer(run.tokenizer)
    name = "bytes" if run.tokenizer.kind == "bytes" else str(run.tokenizer.path)
    out = Path(own["out"])
    started = time.perf_counter()
    summary = write(record(run, tokenizer, quality, own["num_episodes"], name), out, bool(own["overwrite"]))
    summary["wall_s"] = time.perf_counter() - started
    return out, summary


class CheckConfigFirst(Callback):
    """Hydra callback (``hydra.callbacks.check_config`` in conf/demonstrations.yaml): checks the config,
    this command's keys apart, before Hydra creates its run folder (as ``rl.train.CheckConfigFirst``)."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        try:
            load(demo_settings(config)[0])
        except ConfigError as exc:
            print(f"k3rl-demonstrations: config error: {exc}", file=sys.stderr)
            raise SystemExit(2) from None


@hydra.main(version_base=None, config_path=str(conf_dir()), config_name="demonstrations")
def _hydra_main(cfg: DictConfig) -> None:
    try:
        out, summary = run_demonstrations(cfg)
    except (ConfigError, DemonstrationError) as exc:
        print(f"k3rl-demonstrations: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    print(
        f"wrote {summary['episodes']} episodes to {out}: success {summary['success_rate']:.3f}, "
        f"mean reward {summary['mean_reward']:.3f}, mean turns {summary['mean_turns']:.2f}, "
        f"failed {summary['failed']}, {summary['wall_s']:.1f} s"
    )


def main() -> None:
    """The user's config folders and the command line as for ``rl.train`` (`rl.config.command_line`)."""
    from rl.config.command_line import prepare

    if "" not in sys.path and str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))  # task modules in the working directory, as `python -m` has
    try:
        sys.argv = [sys.argv[0], *prepare(sys.argv[1:], "demonstrations")]
    except ConfigError as exc:
        print(f"k3rl-demonstrations: config error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    _hydra_main()


if __name__ == "__main__":
    main()
