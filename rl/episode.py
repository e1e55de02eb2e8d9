"""`Episode`: one multi-turn trajectory exactly as the policy saw and produced it, and its batching.

Token layout (see ``rl.tokenizer``): observation turns are written by the trainer (``action_mask`` 0),
action tokens are the sampled ids (``action_mask`` 1, with their sampling log-probs). Rewards of each
step sit on the last token of the action that earned them. A failed episode (exception in the task,
dead sandbox, failed resume, the platform's exec timeout: the infrastructure, not the task's rules,
ended it) keeps its tokens for inspection but has ``error`` and ``failure`` (its kind, see
``rl.failures``) set and weight 0: it is out of its group's statistics and of the loss.

Every token also records the weights version of the policy in use when it was written (``versions``):
for an action token that is the version that sampled it. In async training (``trainer.mode=async``) an
episode in flight across a weight update continues with the new weights, so one episode can mix
versions; the trainer's staleness bound looks at the oldest action token (`Episode.oldest_version`).
`collate` ignores the versions: the learner needs only the sampling log-probs they go with.

What the task reported: ``cut`` says what ended an episode before the task did (``max_turns``: the task's
turn limit truncated it; ``tokens``: the runner stopped it at ``env.max_episode_tokens``), ``task_info``
holds the numeric values of the task's ``Outcome.info`` at each step (`rl.task_metrics` turns them into
the iteration's per-task metrics), and a failed episode's ``trace`` holds the frames of the task's own
files in the exception's traceback (`agentenv.tracebacks`), so the error names the line to fix.

Routing replay: ``routes`` holds, for every action token in order, the experts the engine's routers chose
where that token was sampled (`rl.rollout.torch_engine.Generation.routes`: ``[n_action_tokens, n_moe_layers,
top_k]``), or None when no engine recorded any. Action tokens appended without a record get rows of -1
(no record). `collate` lays them out beside the log-probs (`TensorBatch.routes`). An episode pickled before
the field existed (an older in-flight checkpoint) reads back with ``routes`` None.

A leaf of a tree rollout (Tree-GRPO, `rl.rollout.trees`) is an ordinary episode holding its whole path
(the turns it shares with its siblings included) plus ``tree`` and ``branches``, from which the learner
rebuilds its tree (`rl.rollout.trees.episode_trees`); chains leave both None.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass, field

import torch

from agentenv.tracebacks import frames_text
from rl.failures import failure_kind
from rl.tokenizer import Tokenizer, observation_turn


@dataclass
class Episode:
    env_id: str
    seed: int
    group: int  # index of its GRPO group in the iteration's batch
    tokens: list[int] = field(default_factory=list)
    action_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # sampling log-prob of action tokens, 0 elsewhere
    step_rewards: list[tuple[int, float]] = field(default_factory=list)  # (token index, reward)
    versions: list[int] = field(default_factory=list)  # weights version in use when each token was written
    observations: list[str] = field(default_factory=list)  # every observation text, the last one included
    turns: int = 0
    success: bool = False
    truncated: bool = False
    error: str | None = None
    failure: str | None = None  # the kind of failure (rl.failures.FAILURE_KINDS) when ``error`` is set
    # [n_action_tokens, n_moe_layers, top_k] experts that sampled each action token (-1: none recorded);
    # None: no record at all. See the module docstring.
    routes: torch.Tensor | None = None
    # None for fields an older pickled episode lacks (class defaults): see the module docstring
    cut: str | None = None  # "max_turns" or "tokens": what ended it before the task did
    task_info: dict[str, list[float]] | None = None  # numeric Outcome.info key -> its value at each step
    trace: str | None = None  # a failed episode: the task-file frames of its exception
    # a leaf of a tree rollout (rl.rollout.trees): its tree in its group, and for each branch on its path
    # the token offset where the branch node ends and the child it took; None for a chain
    tree: int | None = None
    branches: list[tuple[int, int]] | None = None

    @property
    def first_observation(self) -> str:
        return self.observations[0] if self.observations else ""

    @property
    def reward(self) -> float:
        return float(sum(r for _, r in self.step_rewards))

    @property
    def weight(self) -> float:
        """1 for a usable sample, 0 for a failed episode (it contributes nothing to the loss)."""
        return 0.0 if self.error else 1.0

    def _action_versions(self) -> list[int]:
        """The weights version of each action token (none for an episode built by hand without them)."""
        return [v for v, m in zip(self.versions, self.action_mask, strict=False) if m]

    @property
    def oldest_version(self) -> int | None:
        """The oldest weights version that sampled one of its action tokens (None: it has none)."""
        return min(self._action_versions(), default=None)

    @property
    def newest_version(self) -> int | None:
        """The newest weights version that sampled one of its action tokens (None: it has none)."""
        return max(self._action_versions(), default=None)

    def append(
        self,
        ids: list[int],
        trained: bool,
        logprobs: list[float] | None = None,
        version: int = 0,
        routes: torch.Tensor | None = None,
    ) -> None:
        """Add ``ids``: action tokens (``trained``, with their sampling log-probs and, when the engine
        recorded them, their ``routes`` [len(ids), n_moe_layers, top_k]) or trainer-written ones;
        ``version`` is the weights version in use (the one that sampled them, for actions)."""
        if trained:
            self._append_routes(len(ids), routes)
        elif routes is not None:
            raise ValueError("routes are recorded for action tokens only (trained=True)")
        self.tokens.extend(ids)
        self.action_mask.extend([1 if trained else 0] * len(ids))
        self.logprobs.extend(logprobs if logprobs is not None else [0.0] * len(ids))
        self.versions.extend([version] * len(ids))

    def _append_routes(self, n: int, routes: torch.Tensor | None) -> None:
        """Rows for ``n`` new action tokens: ``routes``, or -1 rows (no record) once any record exists."""
        if routes is not None and routes.shape[0] != n:
            raise ValueError(f"routes has {routes.shape[0]} rows for {n} action tokens")
        if routes is None and self.routes is None:
            return
        if self.routes is None:  # the first record: earlier action tokens had none
            self.routes = torch.full((sum(self.action_mask), *routes.shape[1:]), -1, dtype=routes.dtype)
        if routes is None:
            routes = torch.full((n, *self.routes.shape[1:]), -1, dtype=self.routes.dtype)
        elif routes.shape[1:] != self.routes.shape[1:]:
            raise ValueError(f"routes of shape {list(routes.shape[1:])} after {list(self.routes.shape[1:])}")
        self.routes = torch.cat([self.routes, routes.to(self.routes.dtype)])

    def begin(self, observation: str, tok: Tokenizer, version: int = 0) -> None:
        """The reset's observation: kept, and framed as the start of the sequence."""
        self.observations.append(observation)
        self.append(observation_turn(tok, observation, first=True), trained=False, version=version)

    def stepped(self, result: tuple, reward_at: int, tok: Tokenizer, version: int, room: int) -> bool:
        """One env step's ``(observation, reward, terminated, truncated, info)``: the turn counted, its
        reward on token ``reward_at`` (the action's last). True when the episode goes on, its observation
        framed; False when the task ended it or its tokens then pass ``room`` (the most that still leaves
        room for an action); ``cut`` says which limit ended it: ``max_turns`` or ``tokens``."""
        observation, reward, terminated, truncated, info = result
        self.observations.append(observation)
        self.turns += 1
        self.step_rewards.append((reward_at, float(reward)))
        self.success = self.success or bool(info.get("success", False))
        self.record_info(info)
        if terminated or truncated:
            self.truncated = bool(truncated)
            self.cut = "max_turns" if truncated and not terminated else None
            return False
        self.append(observation_turn(tok, observation), trained=False, version=version)
        if len(self.tokens) > room:
            self.truncated = True
            self.cut = "tokens"  # the task did not end it: env.max_episode_tokens did
            return False
        return True

    def fail(self, error: BaseException | str, kind: str | None = None) -> None:
        """Mark the episode failed by ``error``; ``kind`` (default: `rl.failures.failure_kind` of the
        exception, ``runtime_error`` for a message) says which infrastructure failure it was."""
        if isinstance(error, str):
            self.error, self.failure = error, kind or "runtime_error"
        else:
            self.error, self.failure = f"{type(error).__name__}: {error}", kind or failure_kind(error)
            self.trace = frames_text(error)

    def record_info(self, info: dict) -> None:
        """Keep the numeric values (bools as 0/1) of one step's ``info``, but the base task's ``turn`` and
        ``success`` (already counted)."""
        for key, value in info.items():
            if key in ("turn", "success") or not isinstance(value, numbers.Real) or not math.isfinite(value):
                continue
            if self.task_info is None:
                self.task_info = {}
            self.task_info.setdefault(str(key), []).append(float(value))


@dataclass(frozen=True)
class EpisodeSummary:
    """What the driver needs of one episode for its metrics (the episode itself goes to the learner)."""

    success: bool
    reward: float
    turns: int
    tokens: int
    failed: bool
    oldest_version: int | None = None  # of its action tokens (see `Episode.oldest_version`)
    newest_version: int | None = None
    failure: str | None = None  # the kind of failure of a failed episode (`Episode.failure`)
    cut: str | None = None  # `Episode.cut`
    # each numeric Outcome.info key of the task and its mean over the episode's steps that reported it
    task_info: tuple[tuple[str, float], ...] = ()

    @classmethod
    def of(cls, episode: Episode) -> EpisodeSummary:
        info = episode.task_info or {}
        return cls(
            episode.success,
            episode.reward,
            episode.turns,
            len(episode.tokens),
            bool(episode.error),
            episode.oldest_version,
            episode.newest_version,
            episode.failure,
            episode.cut,
            tuple((key, sum(values) / len(values)) for key, values in sorted(info.items()) if values),
        )


@dataclass
class TensorBatch:
    """Right-padded tensors of a list of episodes, aligned on the *predicted* token (``[:, 1:]``)."""

    input_ids: torch.Tensor  # [B, T]
    attention_mask: torch.Tensor  # [B, T] 1 = real token
    action_mask: torch.Tensor  # [B, T-1] 1 where the target token is an action token of a usable episode
    rollout_logprobs: torch.Tensor  # [B, T-1]
    token_rewards: torch.Tensor  # [B, T-1] step rewards on the last action token of each step
    rewards: torch.Tensor  # [B] episode rewards
    weights: torch.Tensor  # [B] 1 usable, 0 failed
    # [B, T-1, n_moe_layers, top_k] long: the rollout's experts for each predicted token (so, the experts
    # of input position t for entry t), -1 where none was recorded; None when no episode has a record
    routes: torch.Tensor | None = None

    def to(self, device: torch.device) -> TensorBatch:
        """The same batch with every tensor on ``device`` (itself when they are there already)."""
        if self.input_ids.device == device:
            return self
        moved = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return TensorBatch(**{k: v if v is None else v.to(device) for k, v in moved.items()})


def collate(episodes: list[Episode], pad_id: int) -> TensorBatch:
    """Pack episodes into a `TensorBatch` (right padding; causal models ignore what follows a token)."""
    if not episodes:
        raise ValueError("cannot collate an empty list of episodes")
    width = max(2, max(len(e.tokens) for e in episodes))
    n = len(episodes)
    ids = torch.full((n, width), pad_id, dtype=torch.long)
    attn = torch.zeros((n, width), dtype=torch.long)
    act = torch.zeros((n, width))
    logp = torch.zeros((n, width))
    tok_rew = torch.zeros((n, width))
    for row, ep in enumerate(episodes):
        length = len(ep.tokens)
        if length:
            ids[row, :length] = torch.tensor(ep.tokens)
            attn[row, :length] = 1
            act[row, :length] = torch.tensor(ep.action_mask, dtype=torch.float) * ep.weight
            logp[row, :length] = torch.tensor(ep.logprobs, dtype=torch.float)
        for index, reward in ep.step_rewards:
            tok_rew[row, index] += reward
    return TensorBatch(
        input_ids=ids,
        attention_mask=attn,
        action_mask=act[:, 1:],
        rollout_logprobs=logp[:, 1:],
        token_rewards=tok_rew[:, 1:],
        rewards=torch.tensor([e.reward for e in episodes]),
        weights=torch.tensor([e.weight for e in episodes]),
        routes=collate_routes(episodes, width),
    )


def collate_routes(episodes: list[Episode], width: int) -> torch.Tensor | None:
    """`TensorBatch.routes` of ``episodes`` padded to ``width`` tokens, or None when none has a record."""
    recorded = [e.routes for e in episodes if e.routes is not None]
    if not recorded:
        return None
    shape = recorded[0].shape[1:]
    if any(r.shape[1:] != shape for r in recorded):
        shapes = sorted({tuple(r.shape[1:]) for r in recorded})
        raise ValueError(f"episodes recorded routes of different shapes [layers, top_k]: {shapes}")
    routes = torch.full((len(episodes), width, *shape), -1, dtype=torch.long)
    for row, ep in enumerate(episodes):
        if ep.routes is None:
            continue
        actions = torch.nonzero(torch.tensor(ep.action_mask, dtype=torch.bool)).flatten()
        if len(actions) != len(ep.routes):
            raise ValueError(
                f"episode (seed {ep.seed}) has {len(ep.routes)} route rows for {len(actions)} action tokens"
            )
        routes[row, actions] = ep.routes.long()
    return routes[:, 1:]
