"""Range and consistency checks of a typed `RunConfig`; each failure names the key (``algo.optim.lr``).

Per-key ranges are declared on the schema's fields (``required(gt=0)``, ``optional(choices=...)``) and
checked by `check_fields`; rules that tie several keys together are the ``check_*`` functions below.
They raise `ConfigError` with the key and the problem; `rl.config.load` adds the file to fix.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

import gymnasium

import agentenv.tasks  # noqa: F401  (registers the built-in tasks)
from agentenv.errors import ConfigError


def _fail(key: str, message: str) -> None:
    raise ConfigError(f"{key}: {message}")


def check_field(key: str, value: Any, rules: dict[str, Any]) -> None:
    """One value against its declared rules: ``choices``, ``gt``, ``ge``, ``lt``, ``le``."""
    if value is None:
        return
    choices = rules.get("choices")
    if choices is not None and value not in choices:
        _fail(key, f"{value!r} is not one of {list(choices)}")
    bounds = {"gt": (">", lambda v, b: v > b), "ge": (">=", lambda v, b: v >= b)}
    bounds |= {"lt": ("<", lambda v, b: v < b), "le": ("<=", lambda v, b: v <= b)}
    for rule, (symbol, holds) in bounds.items():
        if rule in rules and not holds(value, rules[rule]):
            _fail(key, f"must be {symbol} {rules[rule]}, got {value}")


def check_fields(obj: Any, prefix: str) -> None:
    """Every declared rule of dataclass ``obj`` and of the dataclasses it holds."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        key = f"{prefix}.{f.name}" if prefix else f.name
        if dataclasses.is_dataclass(value):
            check_fields(value, key)
        else:
            check_field(key, value, dict(f.metadata))


def check_algo(algo) -> None:
    """Groups, minibatches and the keys only PPO needs."""
    group, episodes = algo.group_size, algo.episodes_per_step
    if algo.advantage in ("grpo", "rloo") and group < 2:
        _fail(
            "algo.group_size",
            f"{algo.advantage.upper()} needs groups of at least 2 episodes to compare, got {group}",
        )
    if algo.min_valid_members > group:
        _fail(
            "algo.min_valid_members",
            f"{algo.min_valid_members} valid members can never be reached in groups of "
            f"algo.group_size={group}",
        )
    if episodes % group:
        _fail(
            "algo.episodes_per_step",
            f"{episodes} episodes per step cannot be split into groups of algo.group_size={group}",
        )
    if algo.minibatches > episodes // group:
        _fail(
            "algo.minibatches",
            f"{algo.minibatches} minibatches need at least as many groups per step ({episodes // group})",
        )
    if algo.advantage == "gae":
        for key in ("gamma", "lam", "normalize_advantages", "value_coef", "value_clip"):
            if getattr(algo, key) is None:
                _fail(f"algo.{key}", "PPO (advantage: gae) needs it; set it in the algo's YAML")


def check_optim(optim, prefix: str) -> None:
    """AdamW's ``betas``: two values, each in [0, 1)."""
    if len(optim.betas) != 2:
        _fail(f"{prefix}.betas", f"expected [beta1, beta2], got {list(optim.betas)}")
    for i, beta in enumerate(optim.betas):
        check_field(f"{prefix}.betas[{i}]", beta, {"ge": 0, "lt": 1})


def check_env(env) -> None:
    """The task is registered with gymnasium and the token limits agree."""
    env_id = env.id
    if ":" in env_id:  # gymnasium's import-then-lookup form
        module, env_id = env_id.split(":", 1)
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise ConfigError(f"env.id: cannot import module {module!r}: {exc}") from None
    if env_id not in gymnasium.registry:
        _fail(
            "env.id",
            f"{env.id!r} is not a registered gymnasium env; register it with gymnasium.register and "
            "name it as 'your_module:Name-v0' so that the module is imported first",
        )
    if env.max_episode_tokens <= env.max_new_tokens:
        _fail("env.max_episode_tokens", f"must be larger than env.max_new_tokens ({env.max_new_tokens})")


def check_rollout(rollout) -> None:
    """vLLM has its block and the pool overrides are valid `PoolSettings` keys."""
    if rollout.engine == "vllm" and rollout.vllm is None:
        _fail("rollout.vllm", "rollout.engine=vllm needs the vllm block of conf/rollout/vllm.yaml")
    from agentenv.pool import PoolSettings

    try:
        PoolSettings.load(**rollout.sandbox_pool.overrides)
    except ConfigError as exc:
        raise ConfigError(f"rollout.sandbox_pool.overrides: {exc}") from None


def check_sandbox(sandbox: dict[str, Any]) -> None:
    """The sandbox group holds exactly the keys and values AgentENV's `SandboxConfig` accepts, plus
    ``hosts`` (null or a list of `agentenv serve` URLs; see ``rl.sandbox_hosts``)."""
    from agentenv.config import SandboxConfig
    from agentenv.settings import build
    from rl.sandbox_hosts import HOSTS_KEY, check_hosts, split_hosts

    check_hosts(sandbox.get(HOSTS_KEY))
    build(SandboxConfig, split_hosts(sandbox)[0], "sandbox", key_prefix="sandbox.")


def check_sandbox_hosts(cfg) -> None:
    """With ``sandbox.hosts`` the limits are the hosts' own and the local sandbox pool is off (see
    `rl.rollout.runner.EpisodeRunner`): settings that would then be silently ignored are refused."""
    from rl.sandbox_hosts import split_hosts

    if not split_hosts(cfg.sandbox)[1]:
        return
    env_sandbox = cfg.env.kwargs.get("sandbox") or {}
    for key in ("memory", "cpus"):
        if key in env_sandbox:
            _fail(f"env.kwargs.sandbox.{key}", "remote sandboxes (sandbox.hosts) take memory and cpus from "
                  "their host's sandbox config (conf/sandbox/default.yaml there); remove it")
    pool = cfg.rollout.sandbox_pool
    if pool.pause_policy == "always":
        _fail("rollout.sandbox_pool.pause_policy", "the local sandbox pool is off with sandbox.hosts "
              "(remote sandboxes stay running on their hosts between episodes); set it cost or never")
    if pool.overrides.get("warm_starts"):
        _fail("rollout.sandbox_pool.overrides.warm_starts", "warm starts come from the local sandbox "
              "pool, which is off with sandbox.hosts; set it false")


def check_resources(cfg) -> None:
    """Local Ray gets enough CPUs for the learner and the workers and is asked for no custom resources;
    the tokenizer fits the model."""
    trainer, rollout = cfg.trainer, cfg.rollout
    if trainer.ray_address is None:
        ranks = trainer.learner.world_size
        needed = ranks * trainer.learner_cpus + rollout.num_workers * rollout.worker_cpus
        if needed > trainer.num_cpus:
            _fail(
                "trainer.num_cpus",
                f"the learner ({trainer.learner_cpus}{f' x {ranks} ranks' if ranks > 1 else ''}) and "
                f"{rollout.num_workers} worker(s) of "
                f"{rollout.worker_cpus} CPU need {needed} CPUs but local Ray gets {trainer.num_cpus}",
            )
    for key in ("learner_resources", "worker_resources"):
        resources = getattr(trainer, key)
        if resources and trainer.ray_address is None:
            _fail(f"trainer.{key}", f"local Ray offers no custom resources ({dict(resources)}); join a "
                  "cluster started with `ray start --resources` (trainer=cluster) or set {}")
        for name, amount in resources.items():
            if name in ("CPU", "GPU", "memory") or amount <= 0:
                _fail(f"trainer.{key}", f"{name}: {amount} is not a positive custom resource (CPUs are "
                      "trainer.learner_cpus / rollout.worker_cpus)")
    tokenizer = cfg.tokenizer
    if tokenizer.kind == "hf" and not tokenizer.path:
        _fail("tokenizer.path", "tokenizer.kind=hf needs the path of a local tokenizer folder")
    if tokenizer.kind == "bytes" and tokenizer.vocab_size is None:
        _fail("tokenizer.vocab_size", "tokenizer.kind=bytes needs its vocabulary size")
    if tokenizer.vocab_size is not None and cfg.model.vocab_size < tokenizer.vocab_size:
        _fail(
            "model.vocab_size",
            f"{cfg.model.vocab_size} is smaller than the tokenizer's vocabulary ({tokenizer.vocab_size})",
        )


def check_vllm_lengths(cfg) -> None:
    """``rollout=vllm``: one request (an episode's context and its next action) fits the engine."""
    if cfg.rollout.engine == "vllm" and cfg.rollout.vllm.max_model_len < cfg.env.max_episode_tokens:
        _fail(
            "rollout.vllm.max_model_len",
            f"{cfg.rollout.vllm.max_model_len} tokens cannot hold an episode of env.max_episode_tokens="
            f"{cfg.env.max_episode_tokens}",
        )


PREFIX_CACHING_UNSUPPORTED = (
    "vLLM 0.32 caches K3's KDA states only with chunked prefill (its hybrid 'align' cache mode), and "
    "chunked prefill rewinds each seeded request's sampling generator, which CPU generators cannot do; "
    "set it to false (each turn then re-reads its context, as the torch engine's chains do)"
)


def check_vllm_prefix_caching(cfg) -> None:
    """``rollout.vllm.enable_prefix_caching`` cannot be on with seeded sampling (see the message)."""
    if cfg.rollout.engine == "vllm" and cfg.rollout.vllm.enable_prefix_caching:
        _fail("rollout.vllm.enable_prefix_caching", PREFIX_CACHING_UNSUPPORTED)


def check_trainer(cfg) -> None:
    """Async mode corrects for the behaviour policy with the truncated IS weight (``algo.tis_cap``), and
    its in-flight checkpoints keep CRIU checkpoints of the playing sandboxes, which a pool that freezes
    (``pause_method: freeze``) never takes: every playing episode would fail at each checkpoint."""
    if cfg.trainer.mode == "async" and cfg.algo.tis_cap is None:
        _fail(
            "algo.tis_cap",
            "trainer.mode=async needs the behaviour-policy importance weight; set algo.tis_cap (e.g. 2.0)",
        )
    if cfg.trainer.mode == "async" and cfg.trainer.eval_every:
        _fail("trainer.eval_every", "held-out evaluations run between the iterations of sync training; async "
              "workers never pause between rollouts; set trainer.eval_every=0 or trainer.mode=sync")
    if cfg.trainer.mode == "async" and cfg.trainer.checkpoint_in_flight:
        from agentenv.pool import PoolSettings

        if PoolSettings.load(**cfg.rollout.sandbox_pool.overrides).pause_method == "freeze":
            _fail(
                "trainer.checkpoint_in_flight",
                "an in-flight checkpoint keeps a CRIU checkpoint of each playing sandbox, and a pool with "
                "pause_method=freeze (rollout.sandbox_pool.overrides) takes none, so every playing episode "
                "would fail at each checkpoint; set trainer.checkpoint_in_flight=false or pause_method=criu",
            )


# algo.name -> its advantage estimator
ALGO_ADVANTAGES = {"grpo": "grpo", "rloo": "rloo", "ppo": "gae", "tree_grpo": "tree_grpo"}


def check_algo_name(algo) -> None:
    """``algo.name`` says which algorithm runs: its advantage estimator must be that algorithm's (the name
    is what conf/algo/<name>.yaml sets, and what a run's config.yaml reports)."""
    if ALGO_ADVANTAGES[algo.name] != algo.advantage:
        _fail(
            "algo.name",
            f"{algo.name} uses algo.advantage={ALGO_ADVANTAGES[algo.name]}, "
            f"got algo.advantage={algo.advantage}; pick the algorithm with algo=<name> "
            "(conf/algo/<name>.yaml) rather than one of its keys",
        )


def check_tree(cfg) -> None:
    """``rollout.tree`` (branching rollouts, `rl.rollout.trees`) goes with ``algo=tree_grpo`` (branching by
    entropy with the torch engine), and describes trees that can grow: increasing turns from 1, no more
    branchings per path than turns to branch at, one branching within the leaf budget, and
    ``algo.group_size`` (leaves per prompt) whole trees."""
    tree, algo = cfg.rollout.tree, cfg.algo
    if tree is None:
        if algo.advantage == "tree_grpo":
            _fail("rollout.tree", "algo=tree_grpo needs branching rollouts: set "
                  "rollout.tree={branch_at: [turns], width: W, depth: D, budget: B}")  # fmt: skip
        return
    if algo.advantage != "tree_grpo":
        _fail("rollout.tree", f"branching rollouts are trained by algo=tree_grpo only, got algo={algo.name}; "
              "set rollout.tree=null or algo=tree_grpo")  # fmt: skip
    turns = list(tree.branch_at)
    if not turns:
        _fail("rollout.tree.branch_at", "needs at least one turn to branch at")
    if any(not isinstance(t, int) or t < 1 for t in turns):
        _fail("rollout.tree.branch_at", f"turns count from 1 (branch after the first turn), got {turns}")
    if sorted(set(turns)) != turns:
        _fail("rollout.tree.branch_at", f"turns must be strictly increasing, got {turns}")
    if tree.depth > len(turns):
        _fail("rollout.tree.depth", f"{tree.depth} branchings per path need as many turns in "
              f"rollout.tree.branch_at, which has {len(turns)}")  # fmt: skip
    if tree.width > tree.budget:
        _fail("rollout.tree.budget", f"{tree.budget} leaves cannot hold one branching of "
              f"rollout.tree.width={tree.width}")  # fmt: skip
    if cfg.rollout.engine != "torch" and tree.entropy_rise is not None:
        _fail("rollout.tree.entropy_rise", "branching by entropy reads each episode's policy state, which "
              f"only the torch engine keeps; got rollout.engine={cfg.rollout.engine}: use rollout=torch "
              "or fixed branch turns (entropy_rise: null)")  # fmt: skip
    leaves = len(tree.leaf_paths())
    if algo.group_size % leaves:
        _fail("algo.group_size", f"{algo.group_size} leaves per prompt are not whole trees: a tree of "
              f"rollout.tree has {leaves} leaves, so set a multiple of {leaves}")  # fmt: skip
    if cfg.rollout.max_concurrent_episodes is not None:
        _fail("rollout.max_concurrent_episodes", "a tree run plays all its trees at once (rl.rollout.trees); "
              "set it to null with rollout.tree")  # fmt: skip


def check_waves(cfg) -> None:
    """``rollout.max_concurrent_episodes`` caps the episodes at once in whole groups: below one group it
    could only be ignored (one group at a time), so it is refused."""
    cap, group = cfg.rollout.max_concurrent_episodes, cfg.algo.group_size
    if cap is not None and cap < group:
        _fail(
            "rollout.max_concurrent_episodes",
            f"{cap} is below algo.group_size={group}: episodes are played in whole groups, so at least "
            f"{group} play at once; set it to {group} or more (or null: no cap)",
        )


def check_learner_ranks(cfg) -> None:
    """``trainer.learner``: every optimizer step's groups split evenly over the ranks (each rank trains
    whole groups), and the routed experts over ``expert_parallel`` ranks (a divisor of the world size:
    the mesh's second dimension)."""
    ranks, algo = cfg.trainer.learner, cfg.algo
    world, ep = ranks.world_size, ranks.expert_parallel
    groups = algo.episodes_per_step // algo.group_size
    if world > 1 and cfg.stage == "sft":
        _fail("trainer.learner.world_size", f"{world}: the SFT cold start (stage=sft) runs in one learner "
              "process")
    if world > 1 and groups % (algo.minibatches * world):
        _fail(
            "trainer.learner.world_size",
            f"{world} ranks cannot share the {groups} groups of a step evenly: each of the "
            f"algo.minibatches={algo.minibatches} minibatches needs a multiple of {world} groups "
            f"(algo.episodes_per_step / algo.group_size a multiple of {algo.minibatches * world})",
        )
    if world % ep:
        _fail(
            "trainer.learner.expert_parallel",
            f"{ep} does not divide trainer.learner.world_size={world}: the ranks form a (data, expert) "
            f"mesh of world_size / expert_parallel x expert_parallel",
        )
    if ep > 1 and cfg.model.num_experts % ep:
        _fail(
            "trainer.learner.expert_parallel",
            f"{ep} ranks cannot hold equal shares of model.num_experts={cfg.model.num_experts} experts",
        )


def check_run(cfg) -> None:
    """Every check, in the order a reader of conf/config.yaml meets the keys."""
    check_fields(cfg, "")
    check_algo(cfg.algo)
    check_algo_name(cfg.algo)
    check_optim(cfg.algo.optim, "algo.optim")
    check_env(cfg.env)
    check_sandbox(cfg.sandbox)
    check_rollout(cfg.rollout)
    check_tree(cfg)
    check_waves(cfg)
    check_vllm_lengths(cfg)
    check_vllm_prefix_caching(cfg)
    check_sandbox_hosts(cfg)
    check_resources(cfg)
    check_trainer(cfg)
    check_learner_ranks(cfg)
    check_optim(cfg.sft.optim, "sft.optim")
