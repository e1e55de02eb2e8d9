"""Advantage estimators: GRPO (group-normalised), RLOO (leave-one-out) and PPO's GAE.

Each is a small pure function over tensors so that it can be checked against hand-computed values.
Episode-level estimators (GRPO, RLOO) take one scalar reward per episode, laid out group after group
(``rewards[g * G + i]`` is member ``i`` of group ``g``); the trainer broadcasts the result over the
episode's action tokens. GAE works per token over the action tokens of a multi-turn sequence.
"""

from __future__ import annotations

import torch


def _grouped(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D (one per episode), got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards cannot be split into groups of {group_size}")
    return rewards.float().view(-1, group_size)


def grpo_advantages(
    rewards: torch.Tensor, group_size: int, scale_by_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO (Shao et al. 2024): ``(r - mean_group) / (std_group + eps)``.

    ``scale_by_std=False`` is Dr.GRPO's variant (Liu et al. 2025), which drops the division because it
    up-weights groups whose rewards barely differ. The std is the population std (``unbiased=False``).
    """
    grouped = _grouped(rewards, group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if scale_by_std:
        centred = centred / (grouped.std(dim=1, unbiased=False, keepdim=True) + eps)
    return centred.reshape(-1)


def rloo_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """REINFORCE leave-one-out (Ahmadian et al. 2024): ``r_i - mean_{j != i} r_j``."""
    if group_size < 2:
        raise ValueError("RLOO needs group_size >= 2 (the baseline is the mean of the other members)")
    grouped = _grouped(rewards, group_size)
    others_mean = (grouped.sum(dim=1, keepdim=True) - grouped) / (group_size - 1)
    return (grouped - others_mean).reshape(-1)


def zero_variance_groups(rewards: torch.Tensor, group_size: int, tol: float = 1e-8) -> torch.Tensor:
    """DAPO's dynamic-sampling filter: True for every episode whose group has identical rewards.

    Such groups carry no GRPO signal (all advantages are zero); DAPO drops them from the batch.
    """
    grouped = _grouped(rewards, group_size)
    flat = (grouped.max(dim=1).values - grouped.min(dim=1).values) <= tol
    return flat.repeat_interleave(group_size)


def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised Advantage Estimation (Schulman et al. 2016) over the action tokens of each row.

    ``rewards``, ``values``, ``mask``: ``[B, T]``. Only positions with ``mask == 1`` (tokens the policy
    generated) are steps of the MDP: observation and padding tokens are skipped, so the value after an
    action token is the value of the *next action token*, however many observation tokens lie between
    (the usual treatment of multi-turn agent sequences). The episode ends after the last action token.
    Returns ``(advantages, returns)``, both ``[B, T]`` and zero off the mask.
    """
    if not (rewards.shape == values.shape == mask.shape):
        raise ValueError(
            f"rewards {tuple(rewards.shape)}, values {tuple(values.shape)} and mask {tuple(mask.shape)} "
            "must have the same [B, T] shape"
        )
    mask = mask.float()
    rewards, values = rewards.float() * mask, values.float() * mask
    batch, length = rewards.shape
    advantages = torch.zeros_like(rewards)
    next_value = torch.zeros(batch, dtype=rewards.dtype, device=rewards.device)
    running = torch.zeros_like(next_value)
    for t in reversed(range(length)):
        m = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        new_running = delta + gamma * lam * running
        running = m * new_running + (1 - m) * running
        next_value = m * values[:, t] + (1 - m) * next_value
        advantages[:, t] = m * new_running
    returns = (advantages + values) * mask
    return advantages, returns


def broadcast_to_tokens(per_episode: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Spread one value per episode (``[B]``) over its action tokens (``mask``: ``[B, T]``)."""
    return per_episode.float()[:, None] * mask.float()
