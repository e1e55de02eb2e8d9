"""The driver loop: Ray actors roll out, the learner steps, weights sync, metrics and checkpoints flow.

One iteration (synchronous, on-policy):
1. seeds for the iteration's GRPO groups are derived from ``(seed, iteration)``, so a resumed run
   replays exactly what the uninterrupted run would have done;
2. groups are split over the `RolloutWorker` actors; a worker that dies is restarted by Ray, reloads
   the current weights by reference and its share is retried (``rollout.max_worker_restarts``);
3. failed episodes are zero-weight samples; if more than ``rollout.max_failed_fraction`` of the
   iteration failed, the run stops with `TooManyFailures` and a summary of the errors;
4. the `LearnerActor` steps on the workers' episode references and publishes the next weights version
   (an object-store reference); workers load it;
5. metrics go to the console, JSONL and TensorBoard; checkpoints every ``trainer.checkpoint_every``.

The driver moves references only: episodes go worker → learner and weights learner → workers through
Ray's object store, and the driver reads just each rollout's `RolloutStats` (see ``rl.actors``). The
weights version is the learner's counter; the driver keeps the latest ``(version, reference)`` it
published, and the workers echo the version they rolled out with.

``trainer.mode=async`` replaces steps 1-4: `rl.async_rollout.AsyncRollouts` keeps the workers generating
while the learner trains, each batch is the first finished groups within ``trainer.max_staleness``
versions, and new weights reach the workers between turns without a barrier. Async runs are not exactly
resumable: resuming one continues from the checkpoint's weights and optimizer state. Both modes log
``learner_idle_fraction``: the share of the iteration's wall time the learner was not stepping.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import ray
import torch
from ray.exceptions import RayActorError, RayTaskError

from model.balancing import max_violation
from rl.actors import LearnerActor, StaleWeights, rollout_worker_actor
from rl.async_rollout import AsyncBatch, AsyncRollouts, RolloutWorkerLost
from rl.config import RunConfig
from rl.episode import Outcome
from rl.inflight import InFlightRecord, kept_sandboxes, load_record, remove_record, save_record
from rl.metrics import MetricsLogger
from rl.rollout import RolloutStats
from rl.sandbox_hosts import split_hosts, worker_environment

log = logging.getLogger("k3rl.train")


class TooManyFailures(RuntimeError):
    """More than ``rollout.max_failed_fraction`` of an iteration's episodes failed."""


@dataclass
class Rollout:
    """One iteration's rollout as the driver holds it: the episodes stay in the object store."""

    episodes: list[ray.ObjectRef]  # one reference per group, in batch order
    stats: RolloutStats
    expert_loads: dict[int, torch.Tensor]


@dataclass
class TrainResult:
    run_dir: Path
    iterations: int
    start_success: float
    end_success: float
    reached_target: bool
    wall_s: float
    checkpoint: Path | None
    plot: Path | None
    history: list[dict[str, Any]] = field(default_factory=list)


def group_seeds(seed: int, iteration: int, num_groups: int) -> list[int]:
    """Task seeds of one iteration's groups (distinct, reproducible from ``(seed, iteration)``)."""
    return [int(s) % 2**31 for s in np.random.SeedSequence([seed, iteration]).generate_state(num_groups)]


def split(items: list, parts: int) -> list[tuple[int, list]]:
    """``(offset, chunk)`` for ``parts`` contiguous chunks of nearly equal size (empty ones dropped)."""
    size, extra = divmod(len(items), parts)
    out, start = [], 0
    for p in range(parts):
        end = start + size + (1 if p < extra else 0)
        if end > start:
            out.append((start, items[start:end]))
        start = end
    return out


def failure_summary(errors: list[str]) -> str:
    """The five most common errors, with their counts."""
    kinds = Counter(e.split(": ", 1)[1] if ": " in e else e for e in errors)
    lines = ["most common errors:"]
    lines += [f"  {count} x {kind[:200]}" for kind, count in kinds.most_common(5)]
    return "\n".join(lines)


def check_failures(stats: RolloutStats, max_fraction: float, iteration: int) -> None:
    """Raise `TooManyFailures` (with a summary of the errors) when too many episodes failed."""
    if stats.episodes and stats.failed / stats.episodes > max_fraction:
        raise TooManyFailures(
            f"iteration {iteration}: {stats.failed} of {stats.episodes} episodes failed, more than "
            f"rollout.max_failed_fraction={max_fraction}.\n" + failure_summary(stats.errors)
        )


def rollout_balance_metrics(loads: dict[int, torch.Tensor]) -> dict[str, Any]:
    """The rollout's expert loads (tokens routed per expert, summed over workers) per MoE layer:
    ``rollout_maxvio/layer<L>``, ``rollout_expert_load/layer<L>`` (each expert's share of the layer's
    routed tokens, a list: JSONL only) and ``rollout_maxvio`` (mean over layers)."""
    out: dict[str, Any] = {}
    for layer in sorted(loads):
        out[f"rollout_maxvio/layer{layer}"] = max_violation(loads[layer])
        total = float(loads[layer].sum())
        out[f"rollout_expert_load/layer{layer}"] = [
            round(float(x) / total, 6) if total else 0.0 for x in loads[layer]
        ]
    if loads:
        out["rollout_maxvio"] = float(np.mean([out[f"rollout_maxvio/layer{k}"] for k in loads]))
    return out


def latest_checkpoint(path: str | Path) -> Path:
    """The newest checkpoint in a run directory, or ``path`` itself if it is a checkpoint."""
    path = Path(path)
    if (path / "trainer_state.json").is_file():
        return path
    candidates = sorted((path / "checkpoints").glob("iter_*")) if (path / "checkpoints").is_dir() else []
    candidates = [c for c in candidates if (c / "trainer_state.json").is_file()]
    if not candidates:
        raise FileNotFoundError(f"trainer.resume={path}: no checkpoint found (expected checkpoints/iter_*/)")
    return candidates[-1]


class Trainer:
    """Runs one training job from a checked `RunConfig` (see ``rl.config``)."""

    def __init__(self, cfg: RunConfig, run_dir: str | Path) -> None:
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.algo, self.rollout_cfg, self.tcfg = cfg.algo, cfg.rollout, cfg.trainer
        self.group_size = self.algo.group_size
        self.num_groups = self.algo.episodes_per_step // self.group_size
        self.metrics = MetricsLogger(self.run_dir, tensorboard=self.tcfg.tensorboard)
        self.started_ray = False
        self.workers: list = []
        self.learner = None
        self.version = 0  # the learner's latest published version, and its weights' reference
        self.weights: ray.ObjectRef | None = None
        self.worker_restarts = 0
        self.placement: dict[str, Any] = {}  # where the actors run (placement.json)
        self.stream: AsyncRollouts | None = None  # trainer.mode=async
        self._step_end = 0.0  # async: when the last learner step ended
        self._resumed: InFlightRecord | None = None  # async: the in-flight record of the resumed checkpoint
        self._kept_by: Path | None = None  # async: the checkpoint whose sandboxes are kept now

    # ------------------------------------------------------------------ set-up
    def _start_ray(self) -> None:
        if ray.is_initialized():
            return
        # Ray runs its workers at niceness 15 by default; the actors ARE the training job here, so on a
        # shared machine they would crawl behind any other process. Run them at normal priority.
        os.environ.setdefault("RAY_worker_niceness", "0")
        address = self.tcfg.ray_address
        kwargs: dict[str, Any] = {
            "include_dashboard": False,
            "logging_level": logging.WARNING,
            "configure_logging": False,
        }
        if address:
            ray.init(address=address, **kwargs)
        else:
            ray.init(num_cpus=self.tcfg.num_cpus, **kwargs)
        self.started_ray = True

    def _start_actors(self) -> None:
        """Create the learner and the rollout workers (built without init: they hold no weights until
        `_publish_first`); Ray constructs them in parallel. Local sandboxes left by the workers of an
        earlier run that was killed on this machine are closed first (`agentenv.gc.close_orphans`)."""
        if not split_hosts(self.cfg.sandbox)[1]:
            from agentenv.gc import close_orphans

            if orphans := close_orphans():
                log.info("closed %d sandboxes left by a killed run's rollout workers", len(orphans))
        learner_cls = ray.remote(LearnerActor).options(
            num_cpus=self.tcfg.learner_cpus, resources=dict(self.tcfg.learner_resources)
        )
        self.learner = learner_cls.remote(self.cfg)
        worker_options: dict[str, Any] = {
            "num_cpus": self.rollout_cfg.worker_cpus,
            "max_restarts": self.rollout_cfg.max_worker_restarts,
            "resources": dict(self.tcfg.worker_resources),
        }
        if self.tcfg.worker_placement == "spread":
            worker_options["scheduling_strategy"] = "SPREAD"
        worker_cls = rollout_worker_actor()
        worker_cls = worker_cls.options(**worker_options)
        environment = worker_environment(self.cfg.sandbox)  # the sandbox hosts' key, if any
        self.workers = [
            worker_cls.remote(self.cfg, i, environment) for i in range(self.rollout_cfg.num_workers)
        ]

    def _publish_first(self) -> None:
        """The learner's first published weights (fresh, or resumed) into every worker; this is also
        the wait for all actors to be up."""
        self.version, self.weights = ray.get(self.learner.publish.remote())
        self._sync_weights()
        self.placement = {
            "learner": ray.get(self.learner.node.remote()),
            "workers": ray.get([w.node.remote() for w in self.workers]),
        }
        self._write_placement()

    def _write_placement(self) -> None:
        """``placement.json`` in the run folder: the Ray node (id, IP) of the learner and of each rollout
        worker, rewritten when a worker is restarted (on a cluster, maybe on another node)."""
        (self.run_dir / "placement.json").write_text(json.dumps(self.placement, indent=1))
        log.info("placement: learner on %s, workers on %s", self.placement["learner"]["ip"],
                 [w["ip"] for w in self.placement["workers"]])

    def _sync_weights(self) -> float:
        """Every worker loads the current version by reference (object store → worker); returns seconds.
        A worker lost meanwhile (on a cluster: its node gone after it returned its rollout) is waited
        for: Ray restarts it, on another node if need be, and it loads the version then."""
        started = time.perf_counter()
        loads = [w.load_weights.remote(self.version, self.weights) for w in self.workers]
        for w, load in enumerate(loads):
            try:
                ray.get(load)
            except RayActorError as exc:
                self.worker_restarts += 1
                log.warning("rollout worker %d lost during the weight sync (%s); waiting for its restart",
                            w, type(exc).__name__)
                self._reload_worker(w)
        return time.perf_counter() - started

    # ------------------------------------------------------------------ rollout with retries
    def _rollout(self, iteration: int) -> Rollout:
        seeds = group_seeds(self.cfg.seed, iteration, self.num_groups)
        shares = split(seeds, len(self.workers))
        results: dict[int, Any] = {}
        attempts = 0
        while len(results) < len(shares):
            pending = {
                w: self._submit(w, iteration, offset, chunk)
                for w, (offset, chunk) in enumerate(shares)
                if w not in results
            }
            for w, (summary_ref, *group_refs) in pending.items():
                try:
                    version, stats, loads = ray.get(summary_ref)
                    if version != self.version:  # `rollout` refuses this; a mismatch here is a bug
                        raise RuntimeError(
                            f"rollout worker {w} sampled with weights v{version}, expected v{self.version}"
                        )
                    results[w] = (group_refs, stats, loads)
                except (RayActorError, RayTaskError) as exc:
                    if isinstance(exc, RayTaskError) and not isinstance(exc.cause, StaleWeights):
                        raise
                    attempts += 1
                    self.worker_restarts += 1
                    if attempts > self.rollout_cfg.max_worker_restarts:
                        raise RolloutWorkerLost(
                            f"rollout worker {w} failed {attempts} times in iteration {iteration}: {exc}"
                        ) from None
                    log.warning(
                        "rollout worker %d lost (%s); waiting for its restart and retrying",
                        w,
                        type(exc).__name__,
                    )
                    self._reload_worker(w)
        rollout = Rollout(episodes=[], stats=RolloutStats(), expert_loads={})
        for w in range(len(shares)):
            group_refs, stats, worker_loads = results[w]
            rollout.episodes.extend(group_refs)
            rollout.stats.merge(stats)
            for layer, value in worker_loads.items():
                rollout.expert_loads[layer] = rollout.expert_loads.get(layer, 0) + value
        return rollout

    def _submit(self, w: int, iteration: int, offset: int, chunk: list[int]):
        """``(summary, group 0, group 1, ...)`` references of worker ``w``'s rollout of ``chunk``."""
        sample_seed = int(np.random.SeedSequence([self.cfg.seed, iteration, 1, w]).generate_state(1)[0])
        return (
            self.workers[w]
            .rollout.options(num_returns=1 + len(chunk))
            .remote(chunk, self.group_size, offset, sample_seed, self.version)
        )

    def _reload_worker(self, w: int, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                ray.get(self.workers[w].load_weights.remote(self.version, self.weights), timeout=30)
                if self.placement:
                    self.placement["workers"][w] = ray.get(self.workers[w].node.remote(), timeout=30)
                    self._write_placement()
                return
            except (RayActorError, ray.exceptions.GetTimeoutError):
                if time.monotonic() > deadline:
                    raise RolloutWorkerLost(
                        f"rollout worker {w} did not come back within {timeout_s} s"
                    ) from None
                time.sleep(0.5)

    # ------------------------------------------------------------------ checkpoints
    def _save(self, iteration: int) -> Path:
        path = self.run_dir / "checkpoints" / f"iter_{iteration:05d}"
        ray.get(self.learner.save.remote(str(path)))
        state = {"iteration": iteration, "history": self.metrics.history}  # the version: in learner.pt
        (path / "trainer_state.json").write_text(json.dumps(state, default=float))
        if self.stream is not None and self.tcfg.checkpoint_in_flight:
            self._save_in_flight(path)
        return path

    def _save_in_flight(self, path: Path) -> None:
        """Async: record the episodes in flight into checkpoint ``path`` (``rl.inflight``), then close
        the sandboxes the previous checkpoint kept: only the latest checkpoint keeps any."""
        record = self.stream.snapshot(path, self.version)
        save_record(record, path)
        log.info("checkpoint %s: %s not trained yet (the playing ones' sandboxes kept)", path.name,
                 record.describe())
        previous, self._kept_by = self._kept_by, path
        if previous is None:
            return
        stale = sorted(set(kept_sandboxes(previous)) - set(record.sandbox_ids))
        if stale:
            try:
                ray.get([w.release_kept.remote(stale) for w in self.workers], timeout=300)
            except Exception as exc:  # gc closes them once the old checkpoint is deleted
                log.warning("could not close the sandboxes %s kept: %s", previous.name, exc)
        if previous != path:
            remove_record(previous)

    def _resume(self) -> int:
        path = latest_checkpoint(self.tcfg.resume)
        ray.get(self.learner.load.remote(str(path)))
        state = json.loads((path / "trainer_state.json").read_text())
        self.metrics.history = list(state.get("history", []))
        log.warning("resumed from %s (iteration %d)", path, state["iteration"])
        record = load_record(path)
        if record is not None and self.tcfg.mode == "async":
            self._resumed, self._kept_by = record, path
        elif record is not None:
            log.warning("%s recorded episodes in flight of an async run; trainer.mode=sync starts afresh",
                        path.name)
        return int(state["iteration"]) + 1

    # ------------------------------------------------------------------ main loop
    def run(self) -> TrainResult:
        started = time.perf_counter()
        checkpoint: Path | None = None
        plot: Path | None = None
        iteration = 0
        target = self.tcfg.stop_at_success
        window = self.tcfg.success_window
        reached = False
        try:
            self._start_ray()
            self._start_actors()
            first = self._resume() if self.tcfg.resume else 0
            self._publish_first()
            if self.tcfg.mode == "async":
                self._start_stream(first)
            progress = _progress(self.tcfg.iterations, first, self.tcfg.progress_bar)
            iteration = first - 1
            self._step_end = time.perf_counter()
            try:
                for iteration in range(first, self.tcfg.iterations):
                    if self.stream is not None:
                        record = self._async_iteration(iteration, started)
                    else:
                        record = self._iteration(iteration, started)
                    self.metrics.log(iteration, record)
                    progress.update(1)
                    progress.set_postfix(
                        success=f"{record['success']:.2f}",
                        reward=f"{record['reward']:.2f}",
                        tok_s=f"{record['generated_tokens_per_s']:.0f}",
                    )
                    every = self.tcfg.checkpoint_every
                    if every and (iteration + 1) % every == 0:
                        checkpoint = self._save(iteration)
                    recent = [r["success"] for r in self.metrics.history[-window:]]
                    if target is not None and len(recent) == window and np.mean(recent) >= target:
                        reached = True
                        break
                    limit = self.tcfg.time_limit_s
                    if limit is not None and time.perf_counter() - started > limit:
                        log.warning("trainer.time_limit_s=%s reached; stopping", limit)
                        break
            except KeyboardInterrupt:
                self._save_interrupted(len(self.metrics.history) - 1)
                raise
            progress.close()
            if iteration >= first and (
                checkpoint is None or not checkpoint.name.endswith(f"{iteration:05d}")
            ):
                checkpoint = self._save(iteration)
        finally:
            plot = self.metrics.plot()
            self.metrics.close()
            self._shutdown()
        history = self.metrics.history
        window_success = [r["success"] for r in history[-window:]]
        return TrainResult(
            run_dir=self.run_dir,
            iterations=len(history),
            start_success=float(history[0]["success"]) if history else float("nan"),
            end_success=float(np.mean(window_success)) if window_success else float("nan"),
            reached_target=reached,
            wall_s=time.perf_counter() - started,
            checkpoint=checkpoint,
            plot=plot,
            history=history,
        )

    def _save_interrupted(self, iteration: int) -> None:
        """Ctrl-C in async mode: a checkpoint of the last finished iteration with the episodes in flight,
        so that nothing the workers were playing is lost (sync mode loses nothing: it holds none)."""
        if self.stream is None or not self.tcfg.checkpoint_in_flight or iteration < 0:
            return
        log.warning("interrupted: writing a checkpoint with the episodes in flight (Ctrl-C again aborts)")
        path = self._save(iteration)
        log.warning("checkpoint %s written; continue with trainer.resume=%s", path, self.run_dir)

    def _iteration(self, iteration: int, started: float) -> dict[str, Any]:
        t0 = time.perf_counter()
        rollout = self._rollout(iteration)
        stats = rollout.stats
        rollout_s = time.perf_counter() - t0
        check_failures(stats, self.rollout_cfg.max_failed_fraction, iteration)
        for error in stats.errors[:3]:
            log.warning("iteration %d: episode failed: %s", iteration, error)
        t1 = time.perf_counter()
        learner_metrics, self.version, self.weights = ray.get(
            self.learner.train_step.remote(*rollout.episodes)
        )
        learner_s = time.perf_counter() - t1
        sync_s = self._sync_weights()
        iteration_s = time.perf_counter() - t0
        timings = {
            "env_steps_per_s": stats.env_steps / max(rollout_s, 1e-9),
            "rollout_s": rollout_s,
            "learner_s": learner_s,
            "weight_sync_s": sync_s,
            "iteration_s": iteration_s,
            "learner_wait_fraction": rollout_s / max(iteration_s, 1e-9),
            "learner_idle_fraction": 1.0 - learner_s / max(iteration_s, 1e-9),
        }
        return self._record(stats.outcomes, stats, rollout.expert_loads, timings, learner_metrics, started)

    # ------------------------------------------------------------------ async mode
    def _start_stream(self, first: int) -> None:
        """Queue rollouts on every worker (trainer.mode=async; see ``rl.async_rollout``)."""
        self.stream = AsyncRollouts(
            self.workers,
            seed=self.cfg.seed,
            stream=first,
            group_size=self.group_size,
            num_groups=self.num_groups,
            in_flight=self.tcfg.rollouts_in_flight,
            max_staleness=self.tcfg.max_staleness,
            max_restarts=self.rollout_cfg.max_worker_restarts,
            reload=self._reload_worker,
        )
        if self._resumed is not None:
            record, self._resumed = self._resumed, None
            self.stream.restore(record, [w["ip"] for w in self.placement["workers"]])
            log.warning("continuing %s from the checkpoint", record.describe())
        self.stream.start()

    def _async_iteration(self, iteration: int, started: float) -> dict[str, Any]:
        """One learner step on the first finished groups within the staleness bound; the iteration
        runs from the end of the previous learner step to the end of this one."""
        t0 = self._step_end
        batch: AsyncBatch = self.stream.next_batch(self.version)
        self.worker_restarts += batch.worker_restarts
        check_failures(batch.stats, self.rollout_cfg.max_failed_fraction, iteration)
        for error in batch.stats.errors[:3]:
            log.warning("iteration %d: episode failed: %s", iteration, error)
        t1 = time.perf_counter()
        learner_metrics, self.version, self.weights = ray.get(self.learner.train_step.remote(*batch.refs))
        learner_s = time.perf_counter() - t1
        t2 = time.perf_counter()
        self.stream.publish(self.version, self.weights)
        self._step_end = time.perf_counter()
        iteration_s = self._step_end - t0
        timings = {
            "env_steps_per_s": batch.stats.env_steps / max(iteration_s, 1e-9),
            "rollout_s": batch.wait_s,  # the wait for the batch: rollouts run all the time
            "learner_s": learner_s,
            "weight_sync_s": self._step_end - t2,
            "iteration_s": iteration_s,
            "learner_wait_fraction": batch.wait_s / max(iteration_s, 1e-9),
            "learner_idle_fraction": 1.0 - learner_s / max(iteration_s, 1e-9),
            **batch.metrics(),
        }
        return self._record(
            batch.outcomes, batch.stats, batch.expert_loads, timings, learner_metrics, started
        )

    # ------------------------------------------------------------------ metrics
    def _record(
        self,
        outcomes: list[Outcome],
        stats: RolloutStats,
        expert_loads: dict[int, torch.Tensor],
        timings: dict[str, float],
        learner_metrics: dict[str, Any],
        started: float,
    ) -> dict[str, Any]:
        """One iteration's metrics: the trained episodes' outcomes, the rollouts' counters, timings."""
        usable: list[Outcome] = [o for o in outcomes if not o.failed] or outcomes
        record: dict[str, Any] = {
            "success": float(np.mean([o.success for o in usable])),
            "reward": float(np.mean([o.reward for o in usable])),
            "turns": float(np.mean([o.turns for o in usable])),
            "episode_tokens": float(np.mean([o.tokens for o in usable])),
            "episodes": stats.episodes,
            "failed_episodes": stats.failed,
            "env_steps": stats.env_steps,
            "generated_tokens": stats.generated_tokens,
            "generated_tokens_per_s": stats.generated_tokens / max(stats.generate_s, 1e-9),
            **timings,
            "reset_s": stats.reset_s,
            "generate_s": stats.generate_s,
            "env_step_s": stats.env_step_s,
            "sandbox_pauses": stats.pauses,
            "sandbox_resumes": stats.resumes,
            "sandbox_forks": stats.forks,
            "sandbox_fork_latency_s": stats.fork_s / stats.forks if stats.forks else 0.0,
            **stats.pool_summary(),
            "sandboxes_created": stats.sandboxes_created,
            "worker_restarts": self.worker_restarts,
            "elapsed_s": time.perf_counter() - started,
            **rollout_balance_metrics(expert_loads),
            **learner_metrics,
        }
        return record

    def _shutdown(self) -> None:
        if self.stream is not None:
            try:
                self.stream.close()
            except Exception as exc:  # the workers are closed and killed below regardless
                log.warning("could not stop the queued rollouts: %s", exc)
            self.stream = None
        try:
            if self.workers:
                ray.get([w.close.remote() for w in self.workers], timeout=120)
        except Exception as exc:  # best effort: the sandboxes' registry rows let `agentenv gc` clean up
            log.warning("could not close every rollout worker's sandboxes: %s", exc)
        for actor in [*self.workers, self.learner]:
            if actor is not None:
                ray.kill(actor)
        self.workers, self.learner = [], None
        if self.started_ray:
            ray.shutdown()


def _progress(total: int, initial: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc="iterations", disable=not enabled, dynamic_ncols=True)
