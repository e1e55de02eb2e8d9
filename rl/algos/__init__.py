"""RL algorithms as small pure functions: advantage estimators and losses (see each module)."""

from rl.algos.advantages import (
    broadcast_to_tokens,
    gae,
    grpo_advantages,
    rloo_advantages,
    usable_episodes,
    zero_variance_groups,
)
from rl.algos.losses import (
    aggregate,
    clipped_policy_loss,
    clipped_value_loss,
    entropy_from_logits,
    kl_estimate,
    masked_mean,
    token_log_probs,
    truncated_is_weights,
)
from rl.algos.sft import sft_loss

__all__ = [
    "aggregate",
    "broadcast_to_tokens",
    "clipped_policy_loss",
    "clipped_value_loss",
    "entropy_from_logits",
    "gae",
    "grpo_advantages",
    "kl_estimate",
    "masked_mean",
    "rloo_advantages",
    "sft_loss",
    "token_log_probs",
    "truncated_is_weights",
    "usable_episodes",
    "zero_variance_groups",
]
