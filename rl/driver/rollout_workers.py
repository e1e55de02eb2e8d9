"""The driver's side of the rollout workers: their Ray actors, the weights version they should hold, where
they run, and the one way a lost worker comes back, used by both rollout sources and the weight sync."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import ray
import torch
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from rl.config import RunConfig
from rl.device import worker_options
from rl.errors import RolloutWorkerLost, StaleWeights
from rl.rollout.actor import NO_WEIGHTS, rollout_worker_actor
from rl.rollout_stats import RolloutStats
from rl.sandbox_hosts import worker_environment
from rl.weights import PublishedWeights

log = logging.getLogger("k3rl.train")

RESTART_TIMEOUT_S = 120.0  # how long a lost worker's restart (by Ray, maybe on another node) is waited for
PLACEMENT_FILE = "placement.json"

Summary = tuple[int, RolloutStats, dict[int, torch.Tensor]]  # what a rollout call returns first


def worker_lost(exc: Exception) -> bool:
    """Whether a failed worker call means the worker was lost: its process died (`RayActorError`), or it
    came back from a restart without weights and refused the call (`StaleWeights`). Any other error of
    the call is a bug or a task failure and stops the run."""
    return isinstance(exc, RayActorError) or (
        isinstance(exc, RayTaskError) and isinstance(exc.cause, StaleWeights)
    )


class RolloutWorkers:
    """The rollout worker actors as the driver holds them (see the module docstring).

    ``version``/``weights``: the learner version the workers should hold and its object-store reference,
    which a restarted worker reloads; ``restarts``: workers lost and brought back over the run (the
    ``worker_restarts`` metric); ``pools``: each worker's latest sandbox-pool snapshot.
    """

    def __init__(self, actors: list[Any], max_restarts: int) -> None:
        self.actors = actors
        self.max_restarts = max_restarts  # worker losses one batch survives (rollout.max_worker_restarts)
        self.version = NO_WEIGHTS
        self.weights: PublishedWeights | None = None
        self.restarts = 0
        self.pools: dict[int, list[dict]] = {}
        self.nodes: list[dict[str, str]] = []  # each worker's Ray node (id, IP), once `record_placement` ran
        self._placement: tuple[Path, dict[str, str]] | None = None
        self._offers: list[ray.ObjectRef] = []

    @classmethod
    def start(cls, cfg: RunConfig) -> RolloutWorkers:
        """Create ``rollout.num_workers`` actors (Ray constructs them in parallel; they hold no weights until
        `load`), placed as ``trainer.worker_resources``/``worker_placement`` say, with a GPU share on cuda
        (`rl.device.worker_options`)."""
        actor_cls = rollout_worker_actor().options(**worker_options(cfg))
        environment = worker_environment(cfg.sandbox)  # the sandbox hosts' key, if any
        actors = [actor_cls.remote(cfg, i, environment) for i in range(cfg.rollout.num_workers)]
        return cls(actors, cfg.rollout.max_worker_restarts)

    def __len__(self) -> int:
        return len(self.actors)

    # ------------------------------------------------------------------ weights
    def load(self, version: int, weights: PublishedWeights) -> None:
        """Every worker loads ``version`` by reference (object store → worker); returns when all hold it.
        A worker lost meanwhile (on a cluster: its node gone) is brought back by `recover`."""
        self.version, self.weights = version, weights
        loads = [actor.load_weights.remote(version, weights) for actor in self.actors]
        failures = 0
        for w, load in enumerate(loads):
            try:
                ray.get(load)
            except (RayActorError, RayTaskError) as exc:
                failures += 1
                self.recover(w, exc, failures)

    def offer(self, version: int, weights: PublishedWeights) -> None:
        """Offer ``version`` to every worker without waiting: each copies it beside its running rollout and
        swaps it in between turns (`rl.rollout.actor.RolloutWorker.offer_weights`)."""
        self.version, self.weights = version, weights
        self._offers = [actor.offer_weights.remote(version, weights) for actor in self.actors]

    # ------------------------------------------------------------------ results and losses
    def summary(self, w: int, ref: ray.ObjectRef) -> Summary:
        """The summary of one of worker ``w``'s rollout calls (raises as ``ray.get``); its sandbox-pool
        snapshot becomes the worker's latest (`pool_snapshot`) and leaves the returned stats."""
        version, stats, loads = ray.get(ref)
        self.pools[w], stats.pool = stats.pool, []
        return version, stats, loads

    def pool_snapshot(self) -> list[dict]:
        """Every worker's latest sandbox-pool snapshot, in worker order."""
        return [p for w in sorted(self.pools) for p in self.pools[w]]

    def recover(self, w: int, exc: Exception, failures: int) -> None:
        """The one path for a failed call of worker ``w``: re-raise it unless the worker was lost
        (`worker_lost`); stop the run with `RolloutWorkerLost` when ``failures`` (the losses of the
        current batch, this one included) exceed ``rollout.max_worker_restarts``; else wait for Ray to
        restart the worker and reload the current weights into it. The caller then retries its call."""
        if not worker_lost(exc):
            raise exc
        self.restarts += 1
        if failures > self.max_restarts:
            raise RolloutWorkerLost(
                f"rollout workers were lost {failures} times in one batch, more than "
                f"rollout.max_worker_restarts={self.max_restarts} (last: worker {w}, {exc})"
            ) from None
        log.warning("rollout worker %d lost (%s); waiting for its restart, then reloading v%d",
                    w, type(exc).__name__, self.version)
        self._reload(w)

    def _reload(self, w: int, timeout_s: float = RESTART_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        actor = self.actors[w]
        while True:
            try:
                ray.get(actor.load_weights.remote(self.version, self.weights), timeout=30)
                if self._placement is not None:  # it may have come back on another node
                    self.nodes[w] = ray.get(actor.node.remote(), timeout=30)
                    self._write_placement()
                return
            except (RayActorError, GetTimeoutError):
                if time.monotonic() > deadline:
                    raise RolloutWorkerLost(
                        f"rollout worker {w} did not come back within {timeout_s} s"
                    ) from None
                time.sleep(0.5)

    # ------------------------------------------------------------------ placement
    def record_placement(self, run_dir: Path, learner_node: dict[str, str]) -> None:
        """Write ``placement.json`` in the run folder: the Ray node (id, IP) of the learner and of each
        worker; rewritten whenever a worker is restarted (on a cluster, maybe on another node)."""
        self.nodes = ray.get([actor.node.remote() for actor in self.actors])
        self._placement = (Path(run_dir) / PLACEMENT_FILE, learner_node)
        self._write_placement()

    def _write_placement(self) -> None:
        assert self._placement is not None
        path, learner = self._placement
        path.write_text(json.dumps({"learner": learner, "workers": self.nodes}, indent=1))
        log.info("placement: learner on %s, workers on %s", learner["ip"], [n["ip"] for n in self.nodes])

    # ------------------------------------------------------------------ shutdown
    def close(self) -> None:
        """Close every worker's sandboxes (best effort) and kill the actors."""
        try:
            ray.get([actor.close.remote() for actor in self.actors], timeout=120)
        except Exception as exc:  # best effort: the sandboxes' registry rows let `agentenv gc` clean up
            log.warning("could not close every rollout worker's sandboxes: %s", exc)
        for actor in self.actors:
            ray.kill(actor)
        self.actors = []

