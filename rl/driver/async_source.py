"""Async rollouts (``trainer.mode=async``): `AsyncRollouts`, the `rl.driver.sources.RolloutSource` that keeps
``trainer.rollouts_in_flight`` rollout calls queued on every worker while the learner trains, hands the
learner the groups that finished first within ``trainer.max_staleness`` versions (older groups are
dropped whole), and offers each new version to the workers without a barrier. Its seeds come from
``(seed, stream, call)`` (`rl.seeds`): an async run is not replayable. The design (partial rollouts,
staleness, in-flight checkpoints): docs/training.md, "Asynchronous training".
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import ClassVar

import numpy as np
import ray
from ray.exceptions import RayActorError, RayTaskError

from rl.driver.rollout_workers import RolloutWorkers, worker_lost
from rl.driver.sources import FinishedGroup, StepBatch, finished_groups
from rl.episode import EpisodeSummary
from rl.rollout.inflight import InFlightRecord, kept_sandboxes, remove_record, save_record
from rl.seeds import async_group_seeds, async_sampling_seed
from rl.weights import PublishedWeights

log = logging.getLogger("k3rl.train")

RESTORED = -1  # the call number of finished groups read from a checkpoint


def split_stale(
    groups: list[FinishedGroup], version: int, max_staleness: int
) -> tuple[list[FinishedGroup], list[FinishedGroup]]:
    """``(kept, dropped)``, in order: a group is dropped when its oldest action token is more than
    ``max_staleness`` weight versions behind the learner's ``version``."""
    kept = [g for g in groups if g.staleness(version) <= max_staleness]
    dropped = [g for g in groups if g.staleness(version) > max_staleness]
    return kept, dropped


def staleness_metrics(batch: StepBatch, dropped: int, continued: int) -> dict[str, float]:
    """Staleness of a batch's episodes (versions behind the learner), partial rollouts, drops."""
    outcomes = batch.outcomes
    lags = [batch.version - o.oldest_version if o.oldest_version is not None else 0 for o in outcomes]
    partial = [o for o in outcomes if o.oldest_version is not None and o.newest_version != o.oldest_version]
    return {
        "staleness_mean": float(np.mean(lags)) if lags else 0.0,
        "staleness_max": float(max(lags, default=0)),
        "partial_rollout_episodes": float(len(partial)),
        "dropped_episodes": float(dropped),
        "continued_episodes": float(continued),
    }


class AsyncRollouts:
    """``trainer.mode=async``: the driver's queue of rollout calls and finished groups, a `RolloutSource`
    (see the module docstring)."""

    concurrent: ClassVar[bool] = True

    def __init__(
        self,
        workers: RolloutWorkers,
        *,
        seed: int,
        stream: int,
        group_size: int,
        num_groups: int,
        in_flight: int,
        max_staleness: int,
        keep_in_flight: bool,
    ) -> None:
        self.workers = workers
        self.seed, self.stream = seed, stream
        self.group_size, self.num_groups = group_size, num_groups
        self.in_flight, self.max_staleness = in_flight, max_staleness
        self.keep_in_flight = keep_in_flight  # trainer.checkpoint_in_flight
        self.groups_per_call = max(1, math.ceil(num_groups / (len(workers) * in_flight)))
        # summary -> (worker, group references, call number)
        self.calls: dict[ray.ObjectRef, tuple[int, list[ray.ObjectRef], int]] = {}
        self.reloaded_at: dict[int, int] = {}  # worker -> the first call number after its last reload
        self.ready: list[FinishedGroup] = []
        self.submitted = 0
        self.continued: set[int] = {RESTORED}  # calls a checkpoint recorded, and its finished groups
        self.kept_by: Path | None = None  # the checkpoint whose sandboxes are kept now
        self.since = time.perf_counter()  # when the current iteration began: the last publish

    def start(self) -> None:
        """Queue ``in_flight`` calls on every worker."""
        for _ in range(self.in_flight):
            for w in range(len(self.workers)):
                self._submit(w)
        self.since = time.perf_counter()

    def _submit(self, w: int) -> None:
        call = self.submitted
        self.submitted += 1
        seeds = async_group_seeds(self.seed, self.stream, call, self.groups_per_call)
        summary, *groups = (
            self.workers.actors[w]
            .rollout.options(num_returns=1 + len(seeds))
            .remote(seeds, self.group_size, 0, async_sampling_seed(self.seed, self.stream, call), None, call)
        )
        self.calls[summary] = (w, groups, call)

    def publish(self, version: int, weights: PublishedWeights) -> None:
        """Offer the learner's new weights to every worker (returns at once: workers copy them beside
        their running rollout and swap them in between turns)."""
        self.workers.offer(version, weights)
        self.since = time.perf_counter()

    def next_batch(self, version: int) -> StepBatch:
        """Block until ``num_groups`` groups within the staleness bound of ``version`` are finished."""
        batch = StepBatch(version=version, since=self.since)
        dropped = 0
        while True:
            self.ready, stale = split_stale(self.ready, version, self.max_staleness)
            dropped += sum(len(g.outcomes) for g in stale)
            if len(self.ready) >= self.num_groups:
                break
            started = time.perf_counter()
            done, _ = ray.wait(list(self.calls), num_returns=1)
            batch.wait_s += time.perf_counter() - started
            self._collect(done[0], batch)
        batch.groups, self.ready = self.ready[: self.num_groups], self.ready[self.num_groups :]
        continued = sum(len(g.outcomes) for g in batch.groups if g.call in self.continued)
        batch.stats.pool = self.workers.pool_snapshot()
        batch.metrics = staleness_metrics(batch, dropped, continued)
        return batch

    def _collect(self, summary: ray.ObjectRef, batch: StepBatch) -> None:
        """One finished call: queue the worker's next call, keep its groups (or retry a lost worker)."""
        w, groups, call = self.calls.pop(summary)
        try:
            _version, stats, loads = self.workers.summary(w, summary)
        except (RayActorError, RayTaskError) as exc:
            if not worker_lost(exc):
                raise
            if call >= self.reloaded_at.get(w, 0):  # else: queued on the instance that died, reloaded since
                batch.lost_workers += 1
                self.workers.recover(w, exc, batch.lost_workers)
                self.reloaded_at[w] = self.submitted
            self._submit(w)
            return
        self._submit(w)
        batch.add(stats, loads)
        self.ready += finished_groups(groups, stats.outcomes, self.group_size, call)

    # ------------------------------------------------------------------ in-flight checkpoints
    def checkpoint(self, path: Path, version: int) -> None:
        """With ``trainer.checkpoint_in_flight``: record the episodes in flight into checkpoint ``path``
        (`snapshot`, ``rl.rollout.inflight``), then close the sandboxes the previous checkpoint kept: only the
        latest checkpoint keeps any."""
        if not self.keep_in_flight:
            return
        record = self.snapshot(path, version)
        save_record(record, path)
        log.info("checkpoint %s: %s not trained yet (the playing ones' sandboxes kept)", path.name,
                 record.describe())
        previous, self.kept_by = self.kept_by, path
        if previous is None:
            return
        stale = sorted(set(kept_sandboxes(previous)) - set(record.sandbox_ids))
        if stale:
            try:
                ray.get([actor.release_kept.remote(stale) for actor in self.workers.actors], timeout=300)
            except Exception as exc:  # gc closes them once the old checkpoint is deleted
                log.warning("could not close the sandboxes %s kept: %s", previous.name, exc)
        if previous != path:
            remove_record(previous)

    def snapshot(self, keeper: Path, version: int, timeout_s: float = 600.0) -> InFlightRecord:
        """What a checkpoint at ``version`` (kept in folder ``keeper``) must hold to go on after a
        restart (``rl.rollout.inflight``): each worker's running call, recorded at its next turn boundary, and
        the groups of the calls that finished before that and are not trained yet. The live run goes on
        untouched (its playing episodes continue in forks of the sandboxes the checkpoint keeps)."""
        record = InFlightRecord(version=version, group_size=self.group_size)
        replies = [actor.snapshot_in_flight.remote(str(keeper)) for actor in self.workers.actors]
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

    def restore(self, record: InFlightRecord, keeper: Path) -> None:
        """Before `start`: go on with what checkpoint ``keeper`` recorded. Its finished groups are queued
        and each recorded call goes back to a worker on the node that keeps its sandboxes (another worker
        when that node has none: those episodes then fail, see ``rl.rollout.inflight``); the next checkpoint
        closes the sandboxes ``keeper`` kept."""
        node_ips = [node["ip"] for node in self.workers.nodes]
        for episodes in record.ready:
            summaries = [EpisodeSummary.of(e) for e in episodes]
            self.ready.append(FinishedGroup(ray.put(episodes), summaries, RESTORED))
        for n, recorded in enumerate(record.rollouts):
            on_node = [w for w, ip in enumerate(node_ips) if ip == recorded.node_ip]
            w = on_node[n % len(on_node)] if on_node else n % len(self.workers)
            call = self.submitted
            self.submitted += 1
            self.continued.add(call)
            groups = len(recorded.episodes) // recorded.group_size
            summary, *refs = (
                self.workers.actors[w]
                .continue_rollout.options(num_returns=1 + groups)
                .remote(recorded, async_sampling_seed(self.seed, self.stream, call), call)
            )
            self.calls[summary] = (w, refs, call)
        self.kept_by = keeper
        log.warning("continuing %s from the checkpoint", record.describe())

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
