"""Async rollouts (``trainer.mode=async``): keep every rollout worker busy while the learner trains, and
hand the learner batches of the groups that finished first, within a staleness bound.

`AsyncRollouts` (driver side) keeps ``trainer.rollouts_in_flight`` `RolloutWorker.rollout` calls queued
on each worker (each carries ``ceil(groups per step / (workers x in flight))`` groups), so a worker starts
its next call the moment it finishes one; as each call finishes (``ray.wait`` on the calls' summary
references) the driver queues another on that worker and keeps the call's groups, one object-store
reference each, until a batch of ``algo.episodes_per_step`` episodes is there. The learner's new weights
go to every worker with `RolloutWorker.offer_weights` (see ``rl.actors``): workers swap them in between
turns, so an episode in flight across an update continues with the new weights (partial rollout), and
every token keeps the version that sampled it (`rl.episode.Episode.versions`).

Staleness: a group is as old as its oldest action token. When a batch is formed for the learner at
version ``v``, groups whose oldest token is more than ``trainer.max_staleness`` versions behind ``v``
are **dropped** (not cut: a group is trained whole or not at all, so GRPO's group baseline stays a
baseline over comparable episodes) and counted in the batch's ``dropped_episodes``. The learner's loss
corrects for the remaining lag with the decoupled PPO objective (see ``rl.algos.losses``).

Task and sampling seeds come from ``(seed, stream, call)``, where ``stream`` is the iteration the run
started (or resumed) at: an async run is not replayable (which groups finish first depends on timing),
and a resumed one continues from its checkpoint's weights and optimizer state, not its exact path.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import ray
import torch
from ray.exceptions import RayActorError, RayTaskError

from rl.actors import StaleWeights
from rl.episode import Outcome
from rl.inflight import InFlightRecord
from rl.rollout import RolloutStats

log = logging.getLogger("k3rl.train")

ASYNC_SEEDS = 2  # the SeedSequence stream of async task seeds (sync mode's is (seed, iteration))
ASYNC_SAMPLING = 3
RESTORED = -1  # the call number of finished groups read from a checkpoint


class RolloutWorkerLost(RuntimeError):
    """A rollout worker kept dying after ``rollout.max_worker_restarts`` restarts."""


@dataclass
class FinishedGroup:
    """One finished GRPO group as the driver holds it: its episodes stay in the object store."""

    ref: ray.ObjectRef
    outcomes: list[Outcome]
    call: int | None = None  # the rollout call that played it (RESTORED: read from a checkpoint)

    @property
    def oldest_version(self) -> int | None:
        """The oldest weights version that sampled one of its action tokens (None: none sampled)."""
        return min((o.oldest_version for o in self.outcomes if o.oldest_version is not None), default=None)

    def staleness(self, version: int) -> int:
        """How many versions its oldest token is behind ``version`` (0 when it has no action token)."""
        oldest = self.oldest_version
        return 0 if oldest is None else version - oldest


def split_stale(
    groups: list[FinishedGroup], version: int, max_staleness: int
) -> tuple[list[FinishedGroup], list[FinishedGroup]]:
    """``(kept, dropped)``, in order: a group is dropped when its oldest action token is more than
    ``max_staleness`` weight versions behind the learner's ``version``."""
    kept = [g for g in groups if g.staleness(version) <= max_staleness]
    dropped = [g for g in groups if g.staleness(version) > max_staleness]
    return kept, dropped


@dataclass
class AsyncBatch:
    """What the learner trains on next, and what the driver logs about it."""

    groups: list[FinishedGroup]
    version: int  # the learner's version the batch was formed for
    stats: RolloutStats  # of the rollout calls that finished while it formed
    expert_loads: dict[int, torch.Tensor] = field(default_factory=dict)
    dropped_episodes: int = 0
    continued_episodes: int = 0  # episodes recorded by a checkpoint and finished after the restart
    wait_s: float = 0.0  # the driver's (and so the learner's) wait for it
    worker_restarts: int = 0

    @property
    def refs(self) -> list[ray.ObjectRef]:
        return [g.ref for g in self.groups]

    @property
    def outcomes(self) -> list[Outcome]:
        return [o for g in self.groups for o in g.outcomes]

    def metrics(self) -> dict[str, float]:
        """Staleness of its episodes (versions behind the learner), partial rollouts, drops."""
        lags = [self.version - o.oldest_version if o.oldest_version is not None else 0 for o in self.outcomes]
        partial = [
            o for o in self.outcomes if o.oldest_version is not None and o.newest_version != o.oldest_version
        ]
        return {
            "staleness_mean": float(np.mean(lags)) if lags else 0.0,
            "staleness_max": float(max(lags, default=0)),
            "partial_rollout_episodes": float(len(partial)),
            "dropped_episodes": float(self.dropped_episodes),
            "continued_episodes": float(self.continued_episodes),
        }


class AsyncRollouts:
    """The driver's queue of rollout calls and finished groups (see the module docstring).

    ``reload(w)`` makes worker ``w`` (restarted by Ray) load the current weights again.
    """

    def __init__(
        self,
        workers: list,
        *,
        seed: int,
        stream: int,
        group_size: int,
        num_groups: int,
        in_flight: int,
        max_staleness: int,
        max_restarts: int,
        reload: Callable[[int], None],
    ) -> None:
        self.workers = workers
        self.seed, self.stream = seed, stream
        self.group_size, self.num_groups = group_size, num_groups
        self.in_flight, self.max_staleness, self.max_restarts = in_flight, max_staleness, max_restarts
        self.reload = reload
        self.groups_per_call = max(1, math.ceil(num_groups / (len(workers) * in_flight)))
        # summary -> (worker, group references, call number)
        self.calls: dict[ray.ObjectRef, tuple[int, list[ray.ObjectRef], int]] = {}
        self.reloaded_at: dict[int, int] = {}  # worker -> the first call number after its last reload
        self.ready: list[FinishedGroup] = []
        self.pools: dict[int, list[dict]] = {}  # each worker's latest sandbox-pool snapshot
        self.submitted = 0
        self.offers: list[ray.ObjectRef] = []
        self.continued: set[int] = {RESTORED}  # calls a checkpoint recorded, and its finished groups

    def start(self) -> None:
        """Queue ``in_flight`` calls on every worker."""
        for _ in range(self.in_flight):
            for w in range(len(self.workers)):
                self._submit(w)

    def _submit(self, w: int) -> None:
        call = self.submitted
        self.submitted += 1
        seeds = [
            int(s) % 2**31
            for s in np.random.SeedSequence([self.seed, ASYNC_SEEDS, self.stream, call]).generate_state(
                self.groups_per_call
            )
        ]
        sample_seed = self._sample_seed(call)
        summary, *groups = (
            self.workers[w]
            .rollout.options(num_returns=1 + len(seeds))
            .remote(seeds, self.group_size, 0, sample_seed, None, call)
        )
        self.calls[summary] = (w, groups, call)

    def _sample_seed(self, call: int) -> int:
        sequence = np.random.SeedSequence([self.seed, ASYNC_SAMPLING, self.stream, call])
        return int(sequence.generate_state(1)[0])

    def publish(self, version: int, weights: ray.ObjectRef) -> None:
        """Offer the learner's new weights to every worker (returns at once: workers copy them beside
        their running rollout and swap them in between turns)."""
        self.offers = [w.offer_weights.remote(version, weights) for w in self.workers]

    def next_batch(self, version: int) -> AsyncBatch:
        """Block until ``num_groups`` groups within the staleness bound of ``version`` are finished."""
        waited = 0.0
        batch = AsyncBatch(groups=[], version=version, stats=RolloutStats())
        while True:
            self.ready, stale = split_stale(self.ready, version, self.max_staleness)
            batch.dropped_episodes += sum(len(g.outcomes) for g in stale)
            if len(self.ready) >= self.num_groups:
                break
            started = time.perf_counter()
            done, _ = ray.wait(list(self.calls), num_returns=1)
            waited += time.perf_counter() - started
            self._collect(done[0], batch)
        batch.groups, self.ready = self.ready[: self.num_groups], self.ready[self.num_groups :]
        batch.continued_episodes = sum(len(g.outcomes) for g in batch.groups if g.call in self.continued)
        batch.wait_s = waited
        batch.stats.pool = [p for w in sorted(self.pools) for p in self.pools[w]]
        return batch

    def _collect(self, summary: ray.ObjectRef, batch: AsyncBatch) -> None:
        """One finished call: queue the worker's next call, keep its groups (or retry a lost worker)."""
        w, groups, call = self.calls.pop(summary)
        try:
            _version, stats, loads = ray.get(summary)
        except (RayActorError, RayTaskError) as exc:
            if isinstance(exc, RayTaskError) and not isinstance(exc.cause, StaleWeights):
                raise
            if call < self.reloaded_at.get(w, 0):  # queued on the instance that died: already reloaded
                self._submit(w)
                return
            batch.worker_restarts += 1
            if batch.worker_restarts > self.max_restarts:
                raise RolloutWorkerLost(
                    f"rollout worker {w} failed {batch.worker_restarts} times in one batch: {exc}"
                ) from None
            log.warning("rollout worker %d lost (%s); reloading it and retrying", w, type(exc).__name__)
            self.reload(w)
            self.reloaded_at[w] = self.submitted
            self._submit(w)
            return
        self._submit(w)
        self.pools[w] = stats.pool
        stats.pool = []
        batch.stats.merge(stats)
        for layer, value in loads.items():
            batch.expert_loads[layer] = batch.expert_loads.get(layer, 0) + value
        size = self.group_size
        for g, ref in enumerate(groups):
            self.ready.append(FinishedGroup(ref, stats.outcomes[g * size : (g + 1) * size], call))

    # ------------------------------------------------------------------ in-flight checkpoints
    def snapshot(self, keeper: Path, version: int, timeout_s: float = 600.0) -> InFlightRecord:
        """What a checkpoint at ``version`` (kept in folder ``keeper``) must hold to go on after a
        restart (``rl.inflight``): each worker's running call, recorded at its next turn boundary, and
        the groups of the calls that finished before that and are not trained yet. The live run goes on
        untouched (its playing episodes continue in forks of the sandboxes the checkpoint keeps)."""
        record = InFlightRecord(version=version, group_size=self.group_size)
        replies = [w.snapshot_in_flight.remote(str(keeper)) for w in self.workers]
        last_finished: dict[int, int] = {}
        for w, reply in enumerate(replies):
            try:
                last_finished[w], running = ray.get(reply, timeout=timeout_s)
            except (RayActorError, RayTaskError, ray.exceptions.GetTimeoutError) as exc:
                log.warning("rollout worker %d could not record its episodes in flight: %s", w, exc)
                continue
            if running is not None:
                record.rollouts.append(running)
        recorded = {r.call for r in record.rollouts}
        finished = [g.ref for g in self.ready if g.call not in recorded]
        for w, groups, call in self.calls.values():  # finished before the snapshot, not collected yet
            if call <= last_finished.get(w, -1) and call not in recorded:
                finished.extend(groups)
        for ref in finished:
            try:
                record.ready.append(ray.get(ref, timeout=timeout_s))
            except (RayActorError, RayTaskError, ray.exceptions.GetTimeoutError) as exc:
                log.warning("a finished group could not be read for the checkpoint: %s", exc)
        return record

    def restore(self, record: InFlightRecord, node_ips: list[str]) -> None:
        """Before `start`: queue the recorded finished groups and hand each recorded call back to a
        worker on the node that keeps its sandboxes (``node_ips``: each worker's; another worker when
        that node has none: those episodes then fail, see ``rl.inflight``)."""
        for episodes in record.ready:
            self.ready.append(FinishedGroup(ray.put(episodes), [Outcome.of(e) for e in episodes], RESTORED))
        for n, recorded in enumerate(record.rollouts):
            on_node = [w for w, ip in enumerate(node_ips) if ip == recorded.node_ip]
            w = on_node[n % len(on_node)] if on_node else n % len(self.workers)
            call = self.submitted
            self.submitted += 1
            self.continued.add(call)
            groups = len(recorded.episodes) // recorded.group_size
            summary, *refs = (
                self.workers[w]
                .continue_rollout.options(num_returns=1 + groups)
                .remote(recorded, self._sample_seed(call), call)
            )
            self.calls[summary] = (w, refs, call)

    def close(self, timeout_s: float = 120.0) -> None:
        """Cancel the queued calls and wait (bounded) for the running ones, so workers can close."""
        pending = list(self.calls)
        for ref in pending:
            try:
                ray.cancel(ref)
            except Exception:  # already finished or not cancellable: waited for below
                pass
        if pending:
            ray.wait(pending, num_returns=len(pending), timeout=timeout_s)
        self.calls.clear()
        self.ready.clear()
