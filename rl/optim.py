"""The optimizer of both training stages: AdamW, gradient clipping and the lr schedule, built from one
`OptimConfig` (``algo.optim`` for RL, ``sft.optim`` for the cold start)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from rl.config.schema import OptimConfig


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
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


def optimizer_step(
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    loss: torch.Tensor,
    grad_clip: float,
) -> torch.Tensor:
    """One step on ``loss``: gradients, clipped to global norm ``grad_clip``, then the optimizer and the
    schedule; returns the gradient norm before clipping."""
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(
        [p for g in optimizer.param_groups for p in g["params"]], grad_clip
    )
    optimizer.step()
    scheduler.step()
    return grad_norm
