"""The driver loop of RL training: a rollout source hands the learner a batch for its current weights, the
learner steps and publishes the next version, the source takes it to the workers; metrics and checkpoints
follow each iteration.

The loop is the same in both modes; ``trainer.mode`` picks the source (``rl.driver.sources``): ``sync``
(`SyncRollouts`, exactly resumable) or ``async`` (`rl.driver.async_source.AsyncRollouts`). The driver moves
references only: episodes go worker → learner and weights learner → workers through Ray's object store.
How an iteration flows, the modes and their metrics: docs/training.md.
"""

from __future__ import annotations

import logging
import os
import textwrap
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import ray
import torch

from model.balancing import max_violation
from rl.checkpoints import TrainerState, read_checkpoint, write_checkpoint
from rl.config import RunConfig
from rl.device import check_device, resolve_device
from rl.driver.async_source import AsyncRollouts
from rl.driver.heldout import HeldOutEval
from rl.driver.learner_group import LearnerGroup
from rl.driver.rollout_workers import RolloutWorkers
from rl.driver.samples import SampleLog
from rl.driver.sources import RolloutSource, StepBatch, SyncRollouts
from rl.errors import TooManyFailures
from rl.failures import failure_metrics
from rl.metrics import MetricsLogger
from rl.rollout.inflight import load_record
from rl.rollout_stats import RolloutStats
from rl.sandbox_hosts import split_hosts
from rl.task_metrics import cut_metrics, cut_warning, info_metrics, task_name
from rl.tokenizer import build_tokenizer
from rl.weights import PublishedWeights

log = logging.getLogger("k3rl.train")


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


def failure_summary(errors: list[str]) -> str:
    """The five most common errors (their first line, ``seed N: `` aside), with their counts, each followed
    by the task-file frames of one of its tracebacks (the lines after the first, `rl.rollout.runner`)."""
    kinds: Counter[str] = Counter()
    frames: dict[str, str] = {}
    for error in errors:
        first, _, rest = error.partition("\n")
        kind = first.split(": ", 1)[1] if ": " in first else first
        kinds[kind] += 1
        frames.setdefault(kind, rest)
    lines = ["most common errors:"]
    for kind, count in kinds.most_common(5):
        lines.append(f"  {count} x {kind[:200]}")
        if frames[kind]:
            lines.append(textwrap.indent(frames[kind], "    "))
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


def with_resolved_device(cfg: RunConfig) -> RunConfig:
    """``cfg`` with ``trainer.device`` resolved to ``cpu`` or ``cuda`` (`rl.device.resolve_device`), so the
    actors and Ray's GPU requests agree; an ``auto`` that resolves to cuda is checked as an explicit one."""
    device = resolve_device(cfg.trainer.device)
    if device == cfg.trainer.device:
        return cfg
    resolved = replace(cfg, trainer=replace(cfg.trainer, device=device))
    if device == "cuda":
        check_device(resolved)
    return resolved


class Trainer:
    """Runs one RL training job from a checked `RunConfig` (see ``rl.config``)."""

    def __init__(self, cfg: RunConfig, run_dir: str | Path) -> None:
        cfg = with_resolved_device(cfg)
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.rollout_cfg, self.tcfg = cfg.rollout, cfg.trainer
        self.metrics = MetricsLogger(self.run_dir, tensorboard=self.tcfg.tensorboard)
        self.started_ray = False
        self.learner = None
        self.workers: RolloutWorkers | None = None
        self.source: RolloutSource | None = None
        self.version = 0  # the learner's latest published version, and its weights' reference
        self.weights: PublishedWeights | None = None
        self.task_name = task_name(cfg.env.id)  # the prefix of the task's own metrics (rl.task_metrics)
        self.samples: SampleLog | None = None  # trainer.log_samples (rl.driver.samples)
        self.heldout: HeldOutEval | None = None  # trainer.eval_every (rl.driver.heldout)
        self.warned_cut = False  # episodes cut by env.max_episode_tokens were reported (once a run)

    # ------------------------------------------------------------------ the loop
    def _iteration(self, iteration: int, started: float) -> dict[str, Any]:
        """One iteration, the same in both modes: the source's batch for the current weights, one
        learner step on it, the new weights back to the source; returns the iteration's metrics."""
        batch = self.source.next_batch(self.version)
        try:
            check_failures(batch.stats, self.rollout_cfg.max_failed_fraction, iteration)
        except TooManyFailures:  # a stopped run's metrics and plot still hold what this iteration played
            self.metrics.log(iteration, self._record(batch, dict(batch.metrics), {}, started))
            raise
        for error in batch.stats.errors[:3]:
            log.warning("iteration %d: episode failed: %s", iteration, error)
        warning = cut_warning(batch.outcomes, self.cfg.env.max_episode_tokens)
        if warning and not self.warned_cut:
            log.warning("iteration %d: %s", iteration, warning)
            self.warned_cut = True
        step_started = time.perf_counter()
        learner_metrics, self.version, self.weights = self.learner.train_step(*batch.refs)
        step_ended = time.perf_counter()
        self.source.publish(self.version, self.weights)
        ended = time.perf_counter()
        learner_s, iteration_s = step_ended - step_started, ended - batch.since
        rollouts_ran_s = iteration_s if self.source.concurrent else batch.wait_s  # sync: only in next_batch
        timings = {
            "env_steps_per_s": batch.stats.env_steps / max(rollouts_ran_s, 1e-9),
            "rollout_s": batch.wait_s,  # the learner's wait for the batch
            "learner_s": learner_s,
            "weight_sync_s": ended - step_ended,
            "iteration_s": iteration_s,
            "learner_wait_fraction": batch.wait_s / max(iteration_s, 1e-9),
            "learner_idle_fraction": 1.0 - learner_s / max(iteration_s, 1e-9),
            **batch.metrics,
        }
        record = self._record(batch, timings, learner_metrics, started)
        return {**record, **self._watch(iteration, batch)}

    def _watch(self, iteration: int, batch: StepBatch) -> dict[str, Any]:
        """What the user asked to see of an iteration: ``trainer.log_samples`` episodes written to the run
        folder, and every ``trainer.eval_every`` iterations the held-out games' metrics."""
        if self.samples is not None:
            self.samples.write(iteration, batch.refs, batch.version)
        every = self.tcfg.eval_every
        if self.heldout is None or not every or (iteration + 1) % every:
            return {}
        started = time.perf_counter()
        metrics = self.heldout.run(self.version, (iteration + 1) // every)
        log.info("iteration %d: held-out success %.2f over %d games (weights v%d)", iteration,
                 metrics["eval_success"], metrics["eval_episodes"], self.version)
        return {**metrics, "eval_s": time.perf_counter() - started}

    def run(self) -> TrainResult:
        started = time.perf_counter()
        checkpoint: Path | None = None
        plot: Path | None = None
        iteration = 0
        target = self.tcfg.stop_at_success
        window = self.tcfg.success_window
        reached = False
        try:
            first = self._start()
            progress = _progress(self.tcfg.iterations, first, self.tcfg.progress_bar)
            iteration = first - 1
            try:
                for iteration in range(first, self.tcfg.iterations):
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

    # ------------------------------------------------------------------ set-up
    def _start(self) -> int:
        """Ray, the actors, the resumed state (``trainer.resume``), the learner's first weights in every
        worker (also the wait for all actors to be up), and the rollout source; returns the first
        iteration to run."""
        self._start_ray()
        self._start_actors()
        first, resumed = 0, None
        if self.tcfg.resume:
            resumed, first = self._resume()
        self.version, self.weights = self.learner.publish()
        self.workers.load(self.version, self.weights)  # workers hold no weights until now
        self.workers.record_placement(self.run_dir, self.learner.node())
        self.source = self._source(first, resumed)
        if self.tcfg.log_samples:
            self.samples = SampleLog(self.run_dir, self.tcfg.log_samples, build_tokenizer(self.cfg.tokenizer))
        if self.tcfg.eval_every:
            self.heldout = HeldOutEval(self.workers, self.cfg.seed, self.tcfg.eval_episodes)
        return first

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
        """Create the learner and the rollout workers (built without init: they hold no weights until the
        learner's first version is loaded); Ray constructs them in parallel. Local sandboxes left by the
        workers of an earlier run that was killed on this machine are closed first."""
        if not split_hosts(self.cfg.sandbox)[1]:
            from agentenv.gc import close_orphans

            if orphans := close_orphans():
                log.info("closed %d sandboxes left by a killed run's rollout workers", len(orphans))
        log.info("device: %s (trainer.device resolved; rl/device.py)", self.tcfg.device)
        self.learner = LearnerGroup.start(self.cfg)  # trainer.learner.world_size ranks
        self.workers = RolloutWorkers.start(self.cfg)

    def _source(self, first: int, resumed: Path | None) -> RolloutSource:
        """The rollout source of ``trainer.mode``, starting at iteration ``first``; an async one goes on
        with the episodes in flight that the ``resumed`` checkpoint recorded."""
        algo = self.cfg.algo
        num_groups = algo.episodes_per_step // algo.group_size
        record = load_record(resumed) if resumed is not None else None
        if self.tcfg.mode == "sync":
            if record is not None:
                log.warning("%s recorded episodes in flight of an async run; trainer.mode=sync starts afresh",
                            resumed.name)
            return SyncRollouts(
                self.workers, seed=self.cfg.seed, iteration=first, group_size=algo.group_size,
                num_groups=num_groups,
            )
        source = AsyncRollouts(
            self.workers,
            seed=self.cfg.seed,
            stream=first,
            group_size=algo.group_size,
            num_groups=num_groups,
            in_flight=self.tcfg.rollouts_in_flight,
            max_staleness=self.tcfg.max_staleness,
            keep_in_flight=self.tcfg.checkpoint_in_flight,
        )
        if record is not None:
            source.restore(record, resumed)
        source.start()
        return source

    # ------------------------------------------------------------------ checkpoints
    def _save(self, iteration: int) -> Path:
        """Checkpoint ``iteration`` (``rl.checkpoints``), with what the source holds in flight."""
        state = TrainerState(stage="rl", iteration=iteration, history=self.metrics.history)
        path = write_checkpoint(self.run_dir, state, self._save_learner)
        self.source.checkpoint(path, self.version)
        return path

    def _save_learner(self, folder: Path) -> None:
        self.learner.save(str(folder))

    def _resume(self) -> tuple[Path, int]:
        """Load ``trainer.resume``'s checkpoint into the learner and the history; returns the checkpoint
        and the first iteration to run."""
        path, state = read_checkpoint(self.tcfg.resume, stage="rl")
        self.learner.load(str(path))
        self.metrics.history = state.history
        log.warning("resumed from %s (iteration %d)", path, state.iteration)
        return path, state.iteration + 1

    def _save_interrupted(self, iteration: int) -> None:
        """Ctrl-C with episodes in flight (async): a checkpoint of the last finished iteration that keeps
        them, so that nothing the workers were playing is lost (sync mode holds none between batches)."""
        if self.source is None or not self.source.concurrent or not self.tcfg.checkpoint_in_flight:
            return
        if iteration < 0:
            return
        log.warning("interrupted: writing a checkpoint with the episodes in flight (Ctrl-C again aborts)")
        path = self._save(iteration)
        log.warning("checkpoint %s written; continue with trainer.resume=%s", path, self.run_dir)

    # ------------------------------------------------------------------ metrics
    def _record(
        self, batch: StepBatch, timings: dict[str, float], learner_metrics: dict[str, Any], started: float
    ) -> dict[str, Any]:
        """One iteration's metrics: the trained episodes' outcomes, the rollouts' counters, timings."""
        outcomes, stats = batch.outcomes, batch.stats
        usable = [o for o in outcomes if not o.failed] or outcomes
        record: dict[str, Any] = {
            "success": float(np.mean([o.success for o in usable])),
            "reward": float(np.mean([o.reward for o in usable])),
            "turns": float(np.mean([o.turns for o in usable])),
            "episode_tokens": float(np.mean([o.tokens for o in usable])),
            "episodes": stats.episodes,
            "failed_episodes": stats.failed,
            **failure_metrics([g.outcomes for g in batch.groups], self.cfg.algo.min_valid_members),
            "env_steps": stats.env_steps,
            "generated_tokens": stats.generated_tokens,
            "generated_tokens_per_s": stats.generated_tokens / stats.generate_s if stats.generate_s else 0.0,
            "context_tokens_read": stats.context_tokens_read,
            "context_read_fraction": (
                stats.context_tokens_read / stats.context_tokens if stats.context_tokens else 1.0
            ),
            **timings,
            "reset_s": stats.reset_s,
            "generate_s": stats.generate_s,
            "env_step_s": stats.env_step_s,
            "sandbox_pauses": stats.pauses,
            "sandbox_resumes": stats.resumes,
            "sandbox_forks": stats.forks,
            "sandbox_fork_latency_s": stats.fork_s / stats.forks if stats.forks else 0.0,
            "tree_state_copies": stats.state_copies,
            "tree_state_copy_s": stats.state_copy_s / max(stats.state_copies, 1),
            "tree_state_copy_bytes": stats.state_copy_bytes / max(stats.state_copies, 1),
            **stats.pool_summary(),
            "sandboxes_created": stats.sandboxes_created,
            **cut_metrics(outcomes),
            **info_metrics(outcomes, self.task_name),
            "env_close_errors": stats.close_errors,
            "worker_restarts": self.workers.restarts,
            "elapsed_s": time.perf_counter() - started,
            **rollout_balance_metrics(batch.expert_loads),
            **learner_metrics,
        }
        return record

    def _shutdown(self) -> None:
        if self.source is not None:
            try:
                self.source.close()
            except Exception as exc:  # the workers are closed and killed below regardless
                log.warning("could not stop the queued rollouts: %s", exc)
            self.source = None
        if self.workers is not None:
            self.workers.close()
            self.workers = None
        if self.learner is not None:
            self.learner.kill()
            self.learner = None
        if self.started_ray:
            ray.shutdown()


def _progress(total: int, initial: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc="iterations", disable=not enabled, dynamic_ncols=True)
