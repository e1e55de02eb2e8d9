"""Advantage estimators: GRPO (group-normalised), RLOO (leave-one-out) and PPO's GAE.

Small pure functions over tensors, so each can be checked against hand-computed values. Failed episodes
(``valid`` False) do not move their group's baseline and get advantage 0; `usable_episodes` is the rule
for which groups train (``algo.min_valid_members``).

Design: docs/design/training.md#rl-algos-advantages.
"""

from __future__ import annotations

import torch


def _grouped(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D (one per episode), got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards cannot be split into groups of {group_size}")
    return rewards.float().view(-1, group_size)


def _valid(valid: torch.Tensor | None, rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """``valid`` as a float ``[groups, G]`` mask (every member valid when None)."""
    if valid is None:
        return torch.ones_like(_grouped(rewards, group_size))
    if valid.shape != rewards.shape:
        raise ValueError(f"valid has shape {tuple(valid.shape)}, rewards {tuple(rewards.shape)}")
    return valid.float().view(-1, group_size)


def grpo_advantages(
    rewards: torch.Tensor,
    group_size: int,
    scale_by_std: bool = True,
    eps: float = 1e-6,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """GRPO (Shao et al. 2024): ``(r - mean_group) / (std_group + eps)``.

    ``scale_by_std=False`` is Dr.GRPO's variant (Liu et al. 2025), which drops the division because it
    up-weights groups whose rewards barely differ. The std is the population std (``unbiased=False``).
    ``valid`` (``[B]`` bool): the mean and std are over the valid members only; invalid members get 0.
    """
    grouped = _grouped(rewards, group_size)
    if valid is None or bool(valid.all()):  # every member valid: torch's mean and std, as always
        centred = grouped - grouped.mean(dim=1, keepdim=True)
        if scale_by_std:
            centred = centred / (grouped.std(dim=1, unbiased=False, keepdim=True) + eps)
        return centred.reshape(-1)
    mask = _valid(valid, rewards, group_size)
    count = mask.sum(dim=1, keepdim=True).clamp_min(1.0)
    mean = (grouped * mask).sum(dim=1, keepdim=True) / count
    centred = (grouped - mean) * mask
    if scale_by_std:
        std = ((centred**2).sum(dim=1, keepdim=True) / count).sqrt()
        centred = centred / (std + eps)
    return centred.reshape(-1)


def rloo_advantages(
    rewards: torch.Tensor, group_size: int, valid: torch.Tensor | None = None
) -> torch.Tensor:
    """REINFORCE leave-one-out (Ahmadian et al. 2024): ``r_i - mean_{j != i} r_j``.

    ``valid`` (``[B]`` bool): the baseline is the mean of the other *valid* members; invalid members, and
    a valid member with no other valid one, get 0."""
    if group_size < 2:
        raise ValueError("RLOO needs group_size >= 2 (the baseline is the mean of the other members)")
    grouped = _grouped(rewards, group_size)
    mask = _valid(valid, rewards, group_size)
    others = mask.sum(dim=1, keepdim=True) - mask  # valid members besides each one
    others_mean = ((grouped * mask).sum(dim=1, keepdim=True) - grouped * mask) / others.clamp_min(1.0)
    return ((grouped - others_mean) * mask * (others > 0)).reshape(-1)


def zero_variance_groups(
    rewards: torch.Tensor, group_size: int, tol: float = 1e-8, valid: torch.Tensor | None = None
) -> torch.Tensor:
    """DAPO's dynamic-sampling filter: True for every episode whose group has identical rewards (among
    its ``valid`` members, when given; a group with fewer than two valid members counts as identical).

    Such groups carry no GRPO signal (all advantages are zero); DAPO drops them from the batch.
    """
    grouped = _grouped(rewards, group_size)
    mask = _valid(valid, rewards, group_size).bool()
    high = grouped.masked_fill(~mask, float("-inf")).max(dim=1).values
    low = grouped.masked_fill(~mask, float("inf")).min(dim=1).values
    flat = (mask.sum(dim=1) < 2) | ((high - low) <= tol)
    return flat.repeat_interleave(group_size)


def usable_episodes(valid: torch.Tensor, group_size: int, min_valid: int) -> torch.Tensor:
    """The group rule for failed episodes: True for each valid episode of a group with at least
    ``min_valid`` valid members; False for failed episodes and for every member of a smaller group
    (its baseline would rest on too few samples, so the whole group is left out of the loss)."""
    if min_valid < 1:
        raise ValueError(f"min_valid must be >= 1, got {min_valid}")
    mask = _valid(valid, valid.float(), group_size).bool()
    enough = mask.sum(dim=1, keepdim=True) >= min_valid
    return (mask & enough).reshape(-1)


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
