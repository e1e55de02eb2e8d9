"""Where the learner's batches come from: a `RolloutSource` hands the driver loop (``rl.driver.trainer``) a
`StepBatch` for the learner's current weights version and takes each new version back.

``trainer.mode=sync`` is `SyncRollouts`: nothing in flight between batches; each batch is one iteration
rolled out for exactly the current version, its task and sampling seeds a function of ``(seed,
iteration, worker)``, so a resumed run replays the uninterrupted one. ``trainer.mode=async`` is
`rl.driver.async_source.AsyncRollouts`: calls stay queued on every worker and a batch is the first groups that
finished within the staleness bound.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol

import ray
import torch
from ray.exceptions import RayActorError, RayTaskError

from rl.driver.rollout_workers import RolloutWorkers
from rl.episode import EpisodeSummary
from rl.rollout_stats import RolloutStats
from rl.seeds import group_seeds, sampling_seed
from rl.weights import PublishedWeights


@dataclass
class FinishedGroup:
    """One finished GRPO group as the driver holds it: its episodes stay in the object store."""

    ref: ray.ObjectRef
    outcomes: list[EpisodeSummary]
    call: int | None = None  # async: the rollout call that played it (RESTORED: read from a checkpoint)

    @property
    def oldest_version(self) -> int | None:
        """The oldest weights version that sampled one of its action tokens (None: none sampled)."""
        return min((o.oldest_version for o in self.outcomes if o.oldest_version is not None), default=None)

    def staleness(self, version: int) -> int:
        """How many versions its oldest token is behind ``version`` (0 when it has no action token)."""
        oldest = self.oldest_version
        return 0 if oldest is None else version - oldest


def finished_groups(
    refs: list[ray.ObjectRef], outcomes: list[EpisodeSummary], group_size: int, call: int | None = None
) -> list[FinishedGroup]:
    """The groups of one rollout call: its group references and its outcomes, ``group_size`` per group."""
    size = group_size
    return [FinishedGroup(ref, outcomes[g * size : (g + 1) * size], call) for g, ref in enumerate(refs)]


@dataclass
class StepBatch:
    """What the learner trains on next, and what the driver logs about it."""

    version: int  # the learner's version the batch was formed for
    since: float  # when the iteration that trains on it began (``time.perf_counter``)
    groups: list[FinishedGroup] = field(default_factory=list)  # in the order the learner gets them
    stats: RolloutStats = field(default_factory=RolloutStats)  # of the rollout calls collected for it
    expert_loads: dict[int, torch.Tensor] = field(default_factory=dict)  # tokens per expert, per MoE layer
    wait_s: float = 0.0  # the driver's (and so the learner's) wait for it
    lost_workers: int = 0  # rollout workers lost (and brought back) while it formed
    metrics: dict[str, float] = field(default_factory=dict)  # the source's own (async: staleness, drops)

    @property
    def refs(self) -> list[ray.ObjectRef]:
        return [g.ref for g in self.groups]

    @property
    def outcomes(self) -> list[EpisodeSummary]:
        return [o for g in self.groups for o in g.outcomes]

    def add(self, stats: RolloutStats, expert_loads: dict[int, torch.Tensor]) -> None:
        """Count one finished rollout call: its counters, and its expert loads summed layer by layer."""
        self.stats.merge(stats)
        for layer, value in expert_loads.items():
            self.expert_loads[layer] = self.expert_loads.get(layer, 0) + value


class RolloutSource(Protocol):
    """What the driver loop needs of a rollout scheme (see the module docstring)."""

    concurrent: ClassVar[bool]  # rollouts run while the learner steps: episodes are in flight between batches

    def next_batch(self, version: int) -> StepBatch:
        """Block until the learner's next batch, for weights ``version``, is there."""
        ...

    def publish(self, version: int, weights: PublishedWeights) -> None:
        """Hand the learner's new weights to the rollout workers."""
        ...

    def checkpoint(self, path: Path, version: int) -> None:
        """Add what the source holds in flight to checkpoint ``path`` (nothing if it holds nothing)."""
        ...

    def close(self) -> None:
        """Stop the rollouts in flight, so that the workers can close."""
        ...


def split(items: list[Any], parts: int) -> list[tuple[int, list[Any]]]:
    """``(offset, chunk)`` for ``parts`` contiguous chunks of nearly equal size (empty ones dropped)."""
    size, extra = divmod(len(items), parts)
    out, start = [], 0
    for p in range(parts):
        end = start + size + (1 if p < extra else 0)
        if end > start:
            out.append((start, items[start:end]))
        start = end
    return out


class SyncRollouts:
    """``trainer.mode=sync``: each batch is one iteration's groups, split over the workers in contiguous
    shares and rolled out with exactly the current weights; `publish` returns once every worker holds
    the new version. A lost worker's share is retried, with the same seeds, after `RolloutWorkers.recover`
    brought it back."""

    concurrent: ClassVar[bool] = False

    def __init__(
        self, workers: RolloutWorkers, *, seed: int, iteration: int, group_size: int, num_groups: int
    ) -> None:
        self.workers = workers
        self.seed, self.iteration = seed, iteration  # the iteration the next batch is for
        self.group_size, self.num_groups = group_size, num_groups

    def next_batch(self, version: int) -> StepBatch:
        if version != self.workers.version:  # `publish` loads every version; a mismatch here is a bug
            raise RuntimeError(f"a batch for v{version} was asked; the workers hold v{self.workers.version}")
        batch = StepBatch(version=version, since=time.perf_counter())
        shares = split(group_seeds(self.seed, self.iteration, self.num_groups), len(self.workers))
        results: dict[int, tuple[list[ray.ObjectRef], RolloutStats, dict[int, torch.Tensor]]] = {}
        while len(results) < len(shares):
            todo = [w for w in range(len(shares)) if w not in results]
            pending = {w: self._submit(w, *shares[w], version) for w in todo}
            for w, (summary, *groups) in pending.items():
                try:
                    echoed, stats, loads = self.workers.summary(w, summary)
                except (RayActorError, RayTaskError) as exc:
                    batch.lost_workers += 1
                    self.workers.recover(w, exc, batch.lost_workers)
                    continue
                if echoed != version:  # `rollout` refuses another version; a mismatch here is a bug
                    raise RuntimeError(f"rollout worker {w} sampled with v{echoed}, expected v{version}")
                results[w] = (groups, stats, loads)
        for w in range(len(shares)):  # in worker order: the learner's batch order, and the sums' order
            groups, stats, loads = results[w]
            batch.add(stats, loads)
            batch.groups += finished_groups(groups, stats.outcomes, self.group_size)
        batch.stats.pool = self.workers.pool_snapshot()
        batch.wait_s = time.perf_counter() - batch.since
        self.iteration += 1
        return batch

    def _submit(self, w: int, offset: int, chunk: list[int], version: int) -> list[ray.ObjectRef]:
        """``[summary, group 0, group 1, ...]`` references of worker ``w``'s rollout of ``chunk``."""
        return (
            self.workers.actors[w]
            .rollout.options(num_returns=1 + len(chunk))
            .remote(chunk, self.group_size, offset, sampling_seed(self.seed, self.iteration, w), version)
        )

    def publish(self, version: int, weights: PublishedWeights) -> None:
        self.workers.load(version, weights)

    def checkpoint(self, path: Path, version: int) -> None:
        """Nothing to add: between batches no episode is in flight."""

    def close(self) -> None:
        """Nothing to stop: between batches no rollout runs."""
