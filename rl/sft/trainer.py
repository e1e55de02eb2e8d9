"""``python -m rl.train stage=sft data=demos.jsonl``: the supervised cold start before RL.

Next-token cross-entropy on the demonstrations' action tokens, with the RL loop's balancing, logging and
checkpoint layout, so ``model.init_from=RUN_DIR`` starts RL from the result; the data order depends only on
``(seed, epoch)``, so a resume continues bit for bit.

Design: docs/design/training.md#rl-sft.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from agentenv.errors import ConfigError
from rl.algos import sft_loss
from rl.checkpoints import TrainerState, read_checkpoint, write_checkpoint
from rl.config import RunConfig
from rl.episode import Episode
from rl.learner.learner import Learner
from rl.metrics import MetricsLogger
from rl.seeds import sft_epoch_seed
from rl.sft.demonstrations import Demonstration, read_demonstrations
from rl.tokenizer import MASKED_LOGIT

log = logging.getLogger("k3rl.sft")

SFT_PANELS = (
    ("loss", "action-token cross-entropy"),
    ("accuracy", "action-token accuracy"),
    ("lr", "learning rate"),
    ("maxvio", "MaxVio (mean over MoE layers)"),
)


class SFTLearner(Learner):
    """The RL `Learner` (policy, ``model.init_from``, optimizer, router balancing, checkpoints) built with
    the ``sft.optim`` optimizer and stepped with the SFT loss."""

    def __init__(self, cfg: RunConfig) -> None:
        algo = dataclasses.replace(
            cfg.algo,
            optim=cfg.sft.optim,
            kl_coef=0.0,  # no reference model
            advantage="grpo",  # no value head
        )
        super().__init__(dataclasses.replace(cfg, algo=algo))

    def masked_logits(self, logits: torch.Tensor, action_mask: torch.Tensor) -> torch.Tensor:
        """The rollout's action-vocabulary mask on action positions (no temperature: SFT fits π itself)."""
        if self.disallowed is None:
            return logits
        where = action_mask.bool()[..., None] & self.disallowed.to(logits.device)
        return logits.masked_fill(where, MASKED_LOGIT)

    def sft_step(self, episodes: list[Episode]) -> dict[str, float]:
        """One optimizer step of cross-entropy on the action tokens of ``episodes``; returns metrics."""
        self.model.train()
        batch = self._batch(episodes)
        with self.placement.autocast():
            out = self.model(batch.input_ids, attention_mask=batch.attention_mask)
        logits = self.masked_logits(out.logits[:, :-1], batch.action_mask)
        loss, stats = sft_loss(logits, batch.input_ids[:, 1:], batch.action_mask)
        lr = self.scheduler.get_last_lr()[0]  # the lr this step uses
        grad_norm = self.optimizer_step(loss)
        metrics = {
            "loss": loss.item(),
            "accuracy": stats.accuracy,
            "action_tokens": stats.tokens,
            "grad_norm": grad_norm.item(),
            "lr": lr,
        }
        metrics.update(self._balance_experts([out.router_stats]))
        self.steps += 1
        self.version += 1
        return metrics

    @torch.no_grad()
    def evaluate(self, episodes: list[Episode], batch_size: int) -> dict[str, float]:
        """Action-token cross-entropy and accuracy over ``episodes`` (every action token weighs the same)."""
        self.model.eval()
        loss_sum = correct = tokens = 0.0
        for start in range(0, len(episodes), batch_size):
            batch = self._batch(episodes[start : start + batch_size])
            with self.placement.autocast():
                out = self.model(batch.input_ids, attention_mask=batch.attention_mask)
            logits = self.masked_logits(out.logits[:, :-1], batch.action_mask)
            loss, stats = sft_loss(logits, batch.input_ids[:, 1:], batch.action_mask)
            loss_sum += loss.item() * stats.tokens
            correct += stats.accuracy * stats.tokens
            tokens += stats.tokens
        n = max(tokens, 1.0)
        return {
            "loss": loss_sum / n,
            "accuracy": correct / n,
            "action_tokens": tokens,
            "episodes": len(episodes),
        }


def load_episodes(run: RunConfig) -> tuple[list[Episode], int]:
    """The usable episodes of ``run.data`` and how many failed ones were dropped; checks that they were
    written for this run's tokenizer and fit the model's vocabulary (`ConfigError` otherwise)."""
    if not run.data:
        raise ConfigError("data: stage=sft needs the demonstration JSONL (data=PATH.jsonl)")
    path = Path(run.data)
    if not path.is_file():
        raise ConfigError(f"data: {path} does not exist; write it with `python -m rl.sft.demonstrations "
                          f"out=...`")
    try:
        demos: list[Demonstration] = read_demonstrations(path)
    except ValueError as exc:
        raise ConfigError(f"data: {exc}") from None
    tokenizer = "bytes" if run.tokenizer.kind == "bytes" else str(run.tokenizer.path)
    for number, demo in enumerate(demos, 1):
        if demo.tokenizer != tokenizer:
            raise ConfigError(
                f"data: {path}:{number} was tokenized with {demo.tokenizer!r}, this run uses {tokenizer!r}"
            )
        if demo.episode.tokens and max(demo.episode.tokens) >= run.model.vocab_size:
            raise ConfigError(
                f"data: {path}:{number} has token id {max(demo.episode.tokens)} >= model.vocab_size "
                f"({run.model.vocab_size})"
            )
    usable = [d.episode for d in demos if d.episode.error is None and any(d.episode.action_mask)]
    if not usable:
        raise ConfigError(f"data: {path} holds no usable episode (all failed, or none has action tokens)")
    return usable, len(demos) - len(usable)


def split_holdout(episodes: list[Episode], fraction: float, seed: int) -> tuple[list[Episode], list[Episode]]:
    """(train, held-out): a seeded random ``fraction`` of the episodes (at least one when > 0) held out."""
    order = torch.randperm(len(episodes), generator=torch.Generator().manual_seed(seed)).tolist()
    held = min(len(episodes) - 1, max(1, round(fraction * len(episodes)))) if fraction > 0 else 0
    return [episodes[i] for i in order[held:]], [episodes[i] for i in order[:held]]


def batch_rows(step: int, num_train: int, batch_size: int, seed: int) -> list[int]:
    """The training rows of optimizer step ``step``: a function of the step alone (exact resume)."""
    per_epoch = math.ceil(num_train / batch_size)
    epoch, index = divmod(step, per_epoch)
    order = torch.randperm(num_train, generator=torch.Generator().manual_seed(sft_epoch_seed(seed, epoch)))
    return order[index * batch_size : (index + 1) * batch_size].tolist()


@dataclass
class SFTResult:
    steps: int
    train_episodes: int
    heldout: dict[str, float]
    checkpoint: Path
    plot: Path | None
    wall_s: float


class SFTRunner:
    """Runs the SFT stage of a checked `RunConfig` into ``run_dir`` (see the module docstring)."""

    def __init__(self, cfg: RunConfig, run_dir: str | Path) -> None:
        self.cfg = cfg
        self.sft = cfg.sft
        self.run_dir = Path(run_dir)
        episodes, self.dropped = load_episodes(cfg)
        self.train, self.heldout = split_holdout(episodes, self.sft.holdout_fraction, cfg.seed)
        per_epoch = math.ceil(len(self.train) / self.sft.batch_size)
        self.total = per_epoch * self.sft.epochs
        if self.sft.max_steps is not None:
            self.total = min(self.total, self.sft.max_steps)

    def _save(self, learner: SFTLearner, metrics: MetricsLogger) -> Path:
        """A checkpoint of the last finished step (``rl.checkpoints``: its iteration is the step's index)."""
        state = TrainerState(stage="sft", iteration=learner.steps - 1, history=metrics.history)
        return write_checkpoint(self.run_dir, state, learner.save)

    def _resume(self, learner: SFTLearner, metrics: MetricsLogger) -> int:
        """Load ``trainer.resume``'s checkpoint; returns the first step to run."""
        path, state = read_checkpoint(self.cfg.trainer.resume, stage="sft")
        learner.load(path)
        metrics.history = state.history
        log.warning("resumed SFT from %s (%d steps done)", path, state.iteration + 1)
        return state.iteration + 1

    def run(self) -> SFTResult:
        from tqdm import tqdm

        started = time.perf_counter()
        torch.set_num_threads(self.cfg.trainer.learner_threads)
        learner = SFTLearner(self.cfg)
        metrics = MetricsLogger(self.run_dir, tensorboard=self.cfg.trainer.tensorboard)
        checkpoint: Path | None = None
        try:
            first = self._resume(learner, metrics) if self.cfg.trainer.resume else 0
            progress = tqdm(
                total=self.total,
                initial=first,
                desc="sft steps",
                disable=not self.cfg.trainer.progress_bar,
                dynamic_ncols=True,
            )
            for step in range(first, self.total):
                rows = batch_rows(step, len(self.train), self.sft.batch_size, self.cfg.seed)
                record = learner.sft_step([self.train[i] for i in rows])
                done = step + 1
                if done % self.sft.log_every == 0 or done == self.total:
                    record["epoch"] = step // math.ceil(len(self.train) / self.sft.batch_size)
                    metrics.log(step, record)
                    progress.set_postfix(loss=f"{record['loss']:.3f}", acc=f"{record['accuracy']:.3f}")
                progress.update(1)
                every = self.sft.checkpoint_every
                if every and done % every == 0 and done < self.total:
                    checkpoint = self._save(learner, metrics)
            progress.close()
            checkpoint = self._save(learner, metrics)  # before the held-out record: a resume continues steps
            heldout = learner.evaluate(self.heldout, self.sft.batch_size) if self.heldout else {}
            if heldout:
                metrics.log(self.total, {f"heldout_{k}": v for k, v in heldout.items()})
        finally:
            plot = metrics.plot(panels=SFT_PANELS)
            metrics.close()
        result = SFTResult(
            steps=self.total,
            train_episodes=len(self.train),
            heldout=heldout,
            checkpoint=checkpoint,
            plot=plot,
            wall_s=time.perf_counter() - started,
        )
        summary: dict[str, Any] = dataclasses.asdict(result) | {"dropped_failed_episodes": self.dropped}
        (self.run_dir / "sft_result.json").write_text(json.dumps(summary, default=str, indent=2))
        return result
