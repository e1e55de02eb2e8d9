"""Typed schemas of the run config: one dataclass per Hydra group of ``conf/``.

The dataclasses declare each key's type and allowed range, not its value: every default lives in the
YAML files of ``conf/``. A field is ``MISSING`` (the YAML must set it) or, for keys that only some
options of a group carry (PPO's ``gamma``, a ``hf`` tokenizer's ``path``), ``None`` meaning "not set".
`rl.config.load` merges the composed config into these schemas and checks the ranges (see
``rl/config/checks.py``) before anything starts. The ``model`` group's schema is the model's own
`model.K3Config`; the ``sandbox`` group's is AgentENV's `agentenv.config.SandboxConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

from model.config import K3Config


def required(**rules: Any) -> Any:
    """A key every option of the group must set; ``rules`` are its range (see `checks.check_field`)."""
    return field(default=MISSING, metadata=rules)


def optional(**rules: Any) -> Any:
    """A key some options of the group leave out (``None``: not set); ``rules`` apply when it is set."""
    return field(default=None, metadata=rules)


@dataclass
class OptimConfig:
    """``algo.optim`` and ``sft.optim``: AdamW, gradient clipping and the lr schedule (`rl.learner.optim`)."""

    lr: float = required(gt=0)
    betas: list[float] = required()  # [beta1, beta2], each in [0, 1) (checks.check_optim)
    eps: float = required(gt=0)
    weight_decay: float = required(ge=0)
    grad_clip: float = required(gt=0)  # max global gradient norm
    warmup_steps: int = required(ge=0)  # linear warm-up
    decay_steps: int | None = optional(ge=1)  # then linear decay over this many steps (None: constant)
    min_lr_ratio: float = required(ge=0, le=1)  # ... down to lr x min_lr_ratio


@dataclass
class AlgoConfig:
    """``conf/algo/*.yaml``: the RL algorithm, its loss and its optimizer (``optim``)."""

    name: str = required(choices=("grpo", "rloo", "ppo", "tree_grpo"))
    advantage: str = required(choices=("grpo", "rloo", "gae", "tree_grpo"))
    group_size: int = required(ge=1)
    # a group trains only when at least this many members ended by the task's rules (not failed by the
    # infrastructure); failed members are out of the group's statistics and the loss (rl.algos)
    min_valid_members: int = required(ge=1)
    episodes_per_step: int = required(ge=1)
    scale_by_std: bool = required()
    filter_zero_variance_groups: bool = required()
    clip_low: float = required(gt=0, lt=1)
    clip_high: float = required(gt=0, lt=1)
    loss_aggregation: str = required(choices=("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"))
    tis_cap: float | None = optional(gt=0)
    kl_coef: float = required(ge=0)
    kl_estimator: str = required(choices=("k1", "k2", "k3"))
    entropy_coef: float = required(ge=0)
    epochs: int = required(ge=1)
    minibatches: int = required(ge=1)
    optim: OptimConfig = MISSING
    balance_rate: float = required(gt=0, le=1)
    # routing replay (R3): the learner's forward uses the experts the rollout engine recorded for each
    # generated token instead of its own routing (the gate weights still come from its own router)
    routing_replay: bool = required()
    # PPO (advantage: gae) only; required there (see checks.check_algo).
    gamma: float | None = optional(ge=0, le=1)
    lam: float | None = optional(ge=0, le=1)
    normalize_advantages: bool | None = optional()
    value_coef: float | None = optional(ge=0)
    value_clip: float | None = optional(gt=0)


@dataclass
class EnvConfig:
    """``conf/env/*.yaml``: the gymnasium task, how groups start, and token limits of an episode."""

    id: str = required()
    group_start: str = required(choices=("fork", "seed"))
    max_new_tokens: int = required(ge=1)
    action_vocabulary: str | None = optional()
    max_episode_tokens: int = required(ge=2)
    kwargs: dict[str, Any] = required()
    # gymnasium wrappers applied, innermost first, to every env the runner makes: "module:Class" or
    # {cls: "module:Class", kwargs: {...}}. None (key absent) = no wrappers.
    wrappers: list[Any] | None = optional()
    # the task's scripted expert for demonstrations (rl.sft.experts): "module:ExpertClass" (an
    # rl.sft.experts.Expert
    # subclass) or "module:function" (observation text -> action text). None = the task has none.
    expert: str | None = optional()


@dataclass
class SandboxPoolConfig:
    """``rollout.sandbox_pool``: each worker's `agentenv.SandboxPool`."""

    name: str = required()
    # whether the sandbox of an episode waiting on the policy is paused for the wait (agentenv.pool.cost):
    # cost = when the expected wait exceeds the pool's pause + resume p50s, or over budget
    pause_policy: str = required(choices=("cost", "never", "always"))
    # admission control (agentenv.pool.residency): a sandbox runs only in one of memory_budget // (one
    # sandbox's measured RSS) slots, so starts and steps wait for room instead of going over the budget
    admission: bool = required()
    # keys of conf/agentenv/pool.yaml set differently for the trainer's pools (empty: that file as is)
    overrides: dict[str, Any] = required()


@dataclass
class VllmEngineConfig:
    """``rollout.vllm`` (``conf/rollout/vllm.yaml``): each rollout worker's in-process vLLM engine."""

    dtype: str = required(choices=("float32", "bfloat16"))  # the model's compute dtype in vLLM
    max_model_len: int = required(ge=2)  # longest context + generation of one request, in tokens
    max_num_seqs: int = required(ge=1)  # requests one engine step may hold
    kv_cache_mib: int = required(ge=1)  # memory for the MLA KV cache and the KDA states of all requests
    # reuse the cached prefix of a request's earlier turns; refused with vLLM 0.32 (rl.config.checks)
    enable_prefix_caching: bool = required()


@dataclass
class TreeRolloutConfig:
    """``rollout.tree``: branching rollouts for Tree-GRPO (`rl.algos.tree_grpo`); checks.check_tree."""

    branch_at: list[int] = required()  # turns (1 = after the first) at which a path may branch, increasing
    width: int = required(ge=2)  # children of each branch node
    depth: int = required(ge=1)  # branch nodes along one root-to-leaf path, at most len(branch_at)
    budget: int = required(ge=2)  # leaves of one tree at most
    # None: a path branches at the turns of branch_at; a number (nats): at those of them where the policy's
    # next-action entropy exceeds that of its first action by at least this much (ARPO's entropy rise)
    entropy_rise: float | None = optional(ge=0)

    def leaf_paths(self) -> list[tuple[int, ...]]:
        """The leaves of one tree, in order: each the child index taken at each branch on its path."""
        paths: list[tuple[int, ...]] = [()]
        for _turn in self.branch_at[: self.depth]:
            grown: list[tuple[int, ...]] = []
            leaves = len(paths)
            for path in paths:
                if leaves + self.width - 1 <= self.budget:
                    grown += [(*path, c) for c in range(self.width)]
                    leaves += self.width - 1
                else:
                    grown.append(path)
            paths = grown
        return paths


@dataclass
class RolloutConfig:
    """``conf/rollout/*.yaml``: the generation engine and the rollout workers."""

    engine: str = required(choices=("torch", "vllm"))
    num_workers: int = required(ge=1)
    worker_cpus: float = required(gt=0)
    torch_threads: int = required(ge=1)
    temperature: float = required(gt=0)
    env_threads: int = required(ge=1)
    policy_latency_s: float = required(ge=0)  # sleep per generation call: emulates a larger policy
    # None: all episodes of a run call at once; N: groups played in waves of at most N episodes
    max_concurrent_episodes: int | None = optional(ge=1)
    sandbox_pool: SandboxPoolConfig = MISSING
    max_failed_fraction: float = required(ge=0, le=1)
    max_worker_restarts: int = required(ge=0)
    vllm: VllmEngineConfig | None = optional()  # engine vllm only (conf/rollout/vllm.yaml)
    tree: TreeRolloutConfig | None = optional()  # branching rollouts (algo=tree_grpo only); None: chains


@dataclass
class LearnerParallelConfig:
    """``trainer.learner``: how many processes the learner spans (`rl.learner.ranks`,
    `rl.learner.sharding`)."""

    # learner ranks (Ray actors of one placement group, one torch.distributed group): each trains its share
    # of every batch's groups and holds 1/world_size of the parameters and optimizer state
    world_size: int = required(ge=1)
    # ranks the routed experts are split across (a divisor of world_size: the device mesh is
    # world_size / expert_parallel (data) x expert_parallel (experts), rl.learner.sharding); tokens travel to
    # their
    # experts' ranks in LatentMoE's latent width (model.expert_parallel)
    expert_parallel: int = required(ge=1)


@dataclass
class TrainerConfig:
    """``conf/trainer/*.yaml``: Ray, the iteration loop, stopping, checkpoints and logging."""

    ray_address: str | None = optional()
    num_cpus: int = required(ge=1)
    learner_cpus: float = required(gt=0)
    learner_threads: int = required(ge=1)
    learner: LearnerParallelConfig = MISSING  # trainer.learner.world_size / expert_parallel
    iterations: int = required(ge=1)
    stop_at_success: float | None = optional(ge=0, le=1)
    success_window: int = required(ge=1)
    time_limit_s: float | None = optional(gt=0)
    checkpoint_every: int = required(ge=0)
    resume: str | None = optional()
    tensorboard: bool = required()
    progress_bar: bool = required()
    # sync: rollout, then learn (exactly resumable); async: workers keep generating while the learner
    # trains (rl.driver.async_source), groups older than max_staleness weight versions are dropped
    mode: str = required(choices=("sync", "async"))
    max_staleness: int = required(ge=0)
    rollouts_in_flight: int = required(ge=1)  # async: outstanding rollout calls per worker
    # async: every checkpoint (and Ctrl-C) records the episodes in flight, their sandboxes paused and kept
    # by the checkpoint, so a resumed run continues them (rl.rollout.inflight)
    checkpoint_in_flight: bool = required()
    # custom Ray resources (``ray start --resources``) each actor needs, so a cluster places it: the learner
    # on the node(s) that offer learner_resources, every rollout worker (and its sandboxes) on those that
    # offer worker_resources; {} = none (local Ray offers none)
    learner_resources: dict[str, float] = required()
    worker_resources: dict[str, float] = required()
    worker_placement: str = required(choices=("default", "spread"))  # Ray's DEFAULT or SPREAD scheduling
    # where the learner and the rollout workers run the policy (rl.device): auto = cuda when torch sees a
    # GPU, else cpu. On cuda each actor asks Ray for its share of a GPU and the policy runs in bf16
    device: str = required(choices=("auto", "cpu", "cuda"))
    learner_gpus: float = required(gt=0, le=1)  # GPUs Ray reserves per learner rank (device cuda only)
    worker_gpus: float = required(gt=0, le=1)  # GPUs Ray reserves for each rollout worker (device cuda only)
    # before Ray starts (rl.driver.preflight): make one env of the task here, reset it and step it, so a task
    # that cannot start fails in seconds with its own traceback
    preflight: bool = required()
    log_samples: int = required(ge=0)  # episodes per iteration written as text to <run dir>/samples.txt
    eval_every: int = required(ge=0)  # iterations between held-out evaluations (0 = none; rl.driver.heldout)
    eval_episodes: int = required(ge=1)  # held-out games per evaluation (the same games every time)


@dataclass
class TokenizerConfig:
    """``tokenizer`` (in conf/config.yaml): ``bytes`` (no download) or a local Hugging Face tokenizer."""

    kind: str = required(choices=("bytes", "hf"))
    vocab_size: int | None = optional(ge=1)  # bytes only
    path: str | None = optional()  # hf only
    special_tokens: dict[str, str] | None = optional()  # hf only


@dataclass
class PolicyConfig(K3Config):
    """``conf/model/*.yaml`` plus ``model.init_from``: the K3 shapes, and optionally the checkpoint
    (a ``save_pretrained`` folder, a checkpoint or a run folder) whose weights the run starts from.
    ``init_from`` is a run setting, not a shape: it stays out of `to_dict` and so of ``config.json``."""

    init_from: str | None = None

    def to_dict(self) -> dict[str, Any]:
        d = super().to_dict()
        d.pop("init_from", None)
        return d


@dataclass
class SFTConfig:
    """``conf/sft/*.yaml``: supervised cold start on demonstration episodes (``stage=sft``)."""

    batch_size: int = required(ge=1)
    epochs: int = required(ge=1)
    max_steps: int | None = optional(ge=1)
    holdout_fraction: float = required(ge=0, lt=1)
    optim: OptimConfig = MISSING
    log_every: int = required(ge=1)
    checkpoint_every: int = required(ge=0)


@dataclass
class RunConfig:
    """The whole run (``conf/config.yaml`` and its groups)."""

    seed: int = required(ge=0)
    stage: str = required(choices=("rl", "sft"))
    # stage=sft: the demonstration JSONL (`python -m rl.sft.demonstrations`); unused by stage=rl
    data: str | None = optional()
    model: PolicyConfig = MISSING
    algo: AlgoConfig = MISSING
    env: EnvConfig = MISSING
    # AgentENV's keys (conf/sandbox/default.yaml), checked by agentenv.config.SandboxConfig itself
    sandbox: dict[str, Any] = required()
    rollout: RolloutConfig = MISSING
    tokenizer: TokenizerConfig = MISSING
    trainer: TrainerConfig = MISSING
    sft: SFTConfig = MISSING


# Hydra group -> its schema (the top-level keys `seed` and `tokenizer` live in conf/config.yaml).
GROUP_SCHEMAS: dict[str, type] = {
    "model": PolicyConfig,
    "algo": AlgoConfig,
    "env": EnvConfig,
    "rollout": RolloutConfig,
    "trainer": TrainerConfig,
    "tokenizer": TokenizerConfig,
    "sft": SFTConfig,
}
