"""The supervised cold start's loss: next-token cross-entropy on action tokens only.

Demonstration episodes carry the RL loop's ``action_mask``: the observation turns the trainer wrote
(mask 0) are context, never targets, so the policy learns to act, not to predict the environment.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rl.algos.losses import masked_mean, token_log_probs


@dataclass
class SFTStats:
    """Statistics of one loss evaluation over the masked (action) tokens."""

    accuracy: float  # fraction of action tokens whose argmax prediction is the target
    tokens: float  # action tokens counted


def sft_loss(
    logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, SFTStats]:
    """Mean ``-log softmax(logits)[target]`` over the positions where ``mask`` is 1.

    ``logits`` ``[B, T, V]`` predict ``targets`` ``[B, T]`` (already shifted: position t predicts
    token t+1 of the episode); ``mask`` ``[B, T]`` is 1 on action tokens. Every action token of the
    batch weighs the same (token mean), as in the RL loss's default aggregation.
    """
    loss = masked_mean(-token_log_probs(logits, targets), mask)
    with torch.no_grad():
        correct = (logits.argmax(dim=-1) == targets).float()
        accuracy = masked_mean(correct, mask).item()
    return loss, SFTStats(accuracy=accuracy, tokens=float(mask.sum()))
