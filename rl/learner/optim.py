"""The optimizer of both training stages: AdamW, gradient clipping and the lr schedule, built from one
`OptimConfig` (``algo.optim`` for RL, ``sft.optim`` for the cold start)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from rl.config.schema import OptimConfig
from rl.learner.sharding import check_no_replicas, local


def lr_schedule(warmup_steps: int, decay_steps: int | None, min_ratio: float) -> Callable[[int], float]:
    """Multiplier of the base lr per optimizer step: linear warm-up, then linear decay to ``min_ratio``
    over ``decay_steps`` (constant when ``decay_steps`` is None)."""
    warmup = max(1, warmup_steps)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if not decay_steps:
            return 1.0
        done = min(1.0, (step - warmup) / max(1, decay_steps))
        return 1.0 - (1.0 - min_ratio) * done

    return factor


def build_optimizer(
    params: Iterable[nn.Parameter], cfg: OptimConfig
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over ``params`` and its per-step schedule (`lr_schedule`), as ``cfg`` sets them."""
    beta1, beta2 = cfg.betas
    optimizer = torch.optim.AdamW(
        list(params), lr=cfg.lr, betas=(beta1, beta2), eps=cfg.eps, weight_decay=cfg.weight_decay
    )
    schedule = lr_schedule(cfg.warmup_steps, cfg.decay_steps, cfg.min_lr_ratio)
    init_state(optimizer)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


def init_state(optimizer: torch.optim.AdamW) -> None:
    """AdamW's state for every parameter now, as its first step would make it (step 0, zero moments):
    a checkpoint then holds every parameter's state, also of one no loss reached yet, so it loads into a
    learner of any size (`rl.learner.shard_checkpoint`); the steps are the same as with AdamW's lazy start."""
    from torch.optim.optimizer import _get_scalar_dtype

    for group in optimizer.param_groups:
        for p in group["params"]:
            optimizer.state[p] = {
                "step": torch.tensor(0.0, dtype=_get_scalar_dtype()),
                "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
            }


def optimizer_step(
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    loss: torch.Tensor,
    grad_clip: float,
    sum_over_ranks: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """One step on ``loss``: gradients, clipped to global norm ``grad_clip``, then the optimizer and the
    schedule; returns the gradient norm before clipping.

    The parameters may be shards (DTensors, `rl.learner.sharding`): the norm's squares are summed over each
    rank's local shards, then over the ranks by ``sum_over_ranks`` (an all-reduce; None: one rank), and
    every rank scales its shards by the same coefficient."""
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    with torch.no_grad():
        for grad in grads:
            check_no_replicas(grad)
        shards = [local(grad) for grad in grads]
        squares = sum((s.float().pow(2).sum() for s in shards), torch.zeros((), device=loss.device))
        if sum_over_ranks is not None:
            squares = sum_over_ranks(squares)
        grad_norm = squares.sqrt()
        coef = torch.clamp(grad_clip / (grad_norm + 1e-6), max=1.0)
        for shard in shards:
            shard.mul_(coef.to(shard.device, shard.dtype))
    optimizer.step()
    scheduler.step()
    return grad_norm
