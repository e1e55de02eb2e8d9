"""Up-front validation of the composed run config: every error names the key and says what to do.

Run before any actor or sandbox starts, so that a typo costs a second, not a Ray start-up.
"""

from __future__ import annotations

import importlib
from typing import Any

import gymnasium

import agentenv.tasks  # noqa: F401  (registers the built-in tasks)
from rl.algos.losses import KL_ESTIMATORS, LOSS_AGGREGATIONS

ALGO_ADVANTAGES = {"grpo": "grpo", "rloo": "rloo", "ppo": "gae"}


class ConfigError(ValueError):
    """A config value is invalid; the message names the key."""


def _require(condition: bool, key: str, message: str) -> None:
    if not condition:
        raise ConfigError(f"{key}: {message}")


def _check_sandbox_pool(pool: Any) -> None:
    """``rollout.sandbox_pool``: name and pause_idle here, the rest are `PoolSettings` overrides."""
    from agentenv.errors import ConfigError as AgentEnvConfigError
    from agentenv.pool import PoolSettings

    _require(isinstance(pool, dict), "rollout.sandbox_pool", "must be a mapping (conf/rollout/torch.yaml)")
    pool = dict(pool)
    _require(isinstance(pool.pop("name", None), str), "rollout.sandbox_pool.name", "must be a string")
    pause_idle = pool.pop("pause_idle", None)
    _require(isinstance(pause_idle, bool), "rollout.sandbox_pool.pause_idle", "must be true or false")
    try:
        PoolSettings.load(**pool)
    except (AgentEnvConfigError, TypeError) as exc:
        raise ConfigError(f"rollout.sandbox_pool: {exc}") from None


def _registered(env_id: str) -> bool:
    """True if ``env_id`` (or ``module:env_id``, gymnasium's import-then-lookup form) is registered."""
    if ":" in env_id:
        module, env_id = env_id.split(":", 1)
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise ConfigError(f"env.id: cannot import module {module!r}: {exc}") from None
    return env_id in gymnasium.registry


def validate(cfg: dict[str, Any]) -> None:
    """Check a resolved config (plain dict, see ``OmegaConf.to_container``); raise `ConfigError`."""
    for section in ("algo", "env", "rollout", "trainer", "model", "tokenizer"):
        _require(isinstance(cfg.get(section), dict), section, "missing config section")
    algo, env, rollout, trainer = cfg["algo"], cfg["env"], cfg["rollout"], cfg["trainer"]

    _require(
        algo.get("name") in ALGO_ADVANTAGES,
        "algo.name",
        f"{algo.get('name')!r} is unknown; choose one of {sorted(ALGO_ADVANTAGES)}",
    )
    _require(
        algo.get("advantage") in ("grpo", "rloo", "gae"),
        "algo.advantage",
        f"{algo.get('advantage')!r} is unknown; use grpo, rloo or gae",
    )
    group, episodes = int(algo["group_size"]), int(algo["episodes_per_step"])
    if algo["advantage"] in ("grpo", "rloo"):
        _require(
            group >= 2,
            "algo.group_size",
            f"{algo['advantage'].upper()} needs groups of at least 2 episodes to compare, got {group}",
        )
    _require(group >= 1, "algo.group_size", f"must be >= 1, got {group}")
    _require(
        episodes >= 1 and episodes % group == 0,
        "algo.episodes_per_step",
        f"{episodes} episodes per step cannot be split into groups of algo.group_size={group}",
    )
    for key in ("epochs", "minibatches"):
        _require(int(algo.get(key, 1)) >= 1, f"algo.{key}", f"must be >= 1, got {algo.get(key)}")
    _require(
        int(algo.get("minibatches", 1)) <= episodes // group,
        "algo.minibatches",
        f"{algo.get('minibatches')} minibatches need at least as many groups per step ({episodes // group})",
    )
    for key in ("clip_low", "clip_high"):
        _require(0 < float(algo[key]) < 1, f"algo.{key}", f"must be in (0, 1), got {algo[key]}")
    _require(
        algo["loss_aggregation"] in LOSS_AGGREGATIONS,
        "algo.loss_aggregation",
        f"{algo['loss_aggregation']!r} is unknown; choose one of {list(LOSS_AGGREGATIONS)}",
    )
    _require(
        algo["kl_estimator"] in KL_ESTIMATORS,
        "algo.kl_estimator",
        f"{algo['kl_estimator']!r} is unknown; choose one of {list(KL_ESTIMATORS)}",
    )
    _require(float(algo["lr"]) > 0, "algo.lr", f"must be > 0, got {algo['lr']}")
    _require(float(algo["kl_coef"]) >= 0, "algo.kl_coef", f"must be >= 0, got {algo['kl_coef']}")
    if algo.get("tis_cap") is not None:
        _require(float(algo["tis_cap"]) > 0, "algo.tis_cap", f"must be > 0 or null, got {algo['tis_cap']}")
    if algo["advantage"] == "gae":
        for key in ("gamma", "lam"):
            _require(0 <= float(algo[key]) <= 1, f"algo.{key}", f"must be in [0, 1], got {algo[key]}")

    _require(
        _registered(str(env.get("id"))),
        "env.id",
        f"{env.get('id')!r} is not a registered gymnasium env; register it with gymnasium.register and "
        "name it as 'your_module:Name-v0' so that the module is imported first",
    )
    _require(
        env.get("group_start") in ("fork", "seed"),
        "env.group_start",
        f"{env.get('group_start')!r}; use 'fork' (reset once, fork the sandbox) or 'seed'",
    )
    _require(int(env["max_new_tokens"]) >= 1, "env.max_new_tokens", "must be >= 1")
    _require(
        int(env["max_episode_tokens"]) > int(env["max_new_tokens"]),
        "env.max_episode_tokens",
        "must be larger than env.max_new_tokens",
    )

    _require(
        rollout.get("engine") in ("torch", "vllm"),
        "rollout.engine",
        f"{rollout.get('engine')!r} is unknown; use torch or vllm",
    )
    if rollout["engine"] == "vllm":
        from rl.generation import EngineUnavailable, check_vllm_available

        try:
            check_vllm_available()
        except EngineUnavailable as exc:
            raise ConfigError(f"rollout.engine: {exc}") from None
    _require(float(rollout["temperature"]) > 0, "rollout.temperature", "must be > 0")
    _require(int(rollout["num_workers"]) >= 1, "rollout.num_workers", "must be >= 1")
    _require(
        0 <= float(rollout["max_failed_fraction"]) <= 1, "rollout.max_failed_fraction", "must be in [0, 1]"
    )
    _check_sandbox_pool(rollout.get("sandbox_pool"))

    _require(int(trainer["iterations"]) >= 1, "trainer.iterations", "must be >= 1")
    if trainer.get("ray_address") is None:
        needed = float(trainer["learner_cpus"]) + int(rollout["num_workers"]) * float(rollout["worker_cpus"])
        _require(
            needed <= float(trainer["num_cpus"]),
            "trainer.num_cpus",
            f"the learner ({trainer['learner_cpus']}) and {rollout['num_workers']} worker(s) of "
            f"{rollout['worker_cpus']} CPU need {needed} CPUs but local Ray gets {trainer['num_cpus']}",
        )

    vocab = int(cfg["model"]["vocab_size"])
    tok_vocab = int(cfg["tokenizer"].get("vocab_size", vocab))
    _require(
        vocab >= tok_vocab,
        "model.vocab_size",
        f"{vocab} is smaller than the tokenizer's vocabulary ({tok_vocab})",
    )
