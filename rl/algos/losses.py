"""Policy and value losses, KL estimators and the rollout importance-sampling correction.

All functions take per-token tensors ``[B, T]`` and a ``mask`` of the tokens that count (action tokens
of episodes that did not fail); they return scalars plus a few statistics for logging.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LOSS_AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")
KL_ESTIMATORS = ("k1", "k2", "k3")


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` over the positions where ``mask`` is 1 (0 when the mask is empty)."""
    mask = mask.to(x.dtype)
    return (x * mask).sum() / mask.sum().clamp_min(1.0)


def aggregate(
    loss: torch.Tensor, mask: torch.Tensor, mode: str, norm_length: int | None = None
) -> torch.Tensor:
    """Reduce a per-token loss ``[B, T]`` to a scalar.

    - ``token_mean``: every token of the batch weighs the same (DAPO's choice, no length bias).
    - ``seq_mean_token_mean``: mean per sequence, then mean over sequences (original GRPO).
    - ``seq_mean_token_sum_norm``: token sum per sequence divided by a constant (``norm_length``, default
      ``T``), then mean over sequences (Dr.GRPO: removes the bias towards long wrong answers).
    Sequences with an empty mask (failed episodes) count in none of them.
    """
    mask = mask.to(loss.dtype)
    if mode == "token_mean":
        return masked_mean(loss, mask)
    seq_has_tokens = (mask.sum(dim=1) > 0).to(loss.dtype)
    num_seqs = seq_has_tokens.sum().clamp_min(1.0)
    if mode == "seq_mean_token_mean":
        per_seq = (loss * mask).sum(dim=1) / mask.sum(dim=1).clamp_min(1.0)
        return (per_seq * seq_has_tokens).sum() / num_seqs
    if mode == "seq_mean_token_sum_norm":
        per_seq = (loss * mask).sum(dim=1) / float(norm_length or loss.shape[1])
        return (per_seq * seq_has_tokens).sum() / num_seqs
    raise ValueError(f"unknown loss aggregation {mode!r}; choose one of {LOSS_AGGREGATIONS}")


@dataclass
class PolicyLossStats:
    clip_fraction: float
    approx_kl: float


def clipped_surrogate(
    logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, clip_low: float, clip_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token ``-min(ρA, clip(ρ, 1-ε_low, 1+ε_high)A)`` and where the clipped term was the smaller.

    Positively homogeneous in ``A`` and linear among advantages of one sign, which `rl.algos.tree_grpo`
    uses to train a shared prefix once for all the leaves below it."""
    ratio = torch.exp(logp - old_logp)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * advantages
    return -torch.minimum(unclipped, clipped), clipped < unclipped


def clipped_policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    aggregation: str = "token_mean",
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, PolicyLossStats]:
    """PPO's clipped surrogate ``-min(ρA, clip(ρ, 1-ε_low, 1+ε_high)A)`` with ``ρ = exp(logp - old_logp)``.

    ``clip_high > clip_low`` is DAPO's "clip-higher". ``is_weights`` (detached, ``[B, T]``) multiplies
    each token's loss: the truncated importance-sampling correction for the gap between the policy that
    sampled the tokens and the learner's (see :func:`truncated_is_weights`).

    With ``old_logp`` the learner's own log-probs before the update and ``is_weights`` computed against
    the rollout log-probs, this is the **decoupled PPO objective** of AReaL (Fu et al. 2025, "AReaL: A
    Large-Scale Asynchronous Reinforcement Learning System for Language Reasoning"):

        J(θ) = E_{a ~ π_behav} [ π_prox(a)/π_behav(a) · min(r_θ A, clip(r_θ, 1-ε, 1+ε) A) ],
        r_θ = π_θ(a) / π_prox(a),

    where the proximal policy π_prox is the learner's weights before this batch's update (``old_logp``)
    and the behaviour policy π_behav is whatever sampled each token: in async training an older weights
    version, possibly a different one for each turn of an episode (partial rollout). The trust region
    is thus anchored on recent weights however stale the data, and the off-policy gap enters only
    through the (truncated) importance weight, token by token.
    """
    per_token, clipped_mask = clipped_surrogate(logp, old_logp, advantages, clip_low, clip_high)
    if is_weights is not None:
        per_token = per_token * is_weights.detach()
    loss = aggregate(per_token, mask, aggregation)
    with torch.no_grad():
        clip_fraction = masked_mean(clipped_mask.float(), mask).item()
        approx_kl = masked_mean(old_logp - logp, mask).item()
    return loss, PolicyLossStats(clip_fraction=clip_fraction, approx_kl=approx_kl)


def truncated_is_weights(learner_logp: torch.Tensor, rollout_logp: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated importance sampling (Yao et al. 2025, "TIS"): ``min(π_learner / π_rollout, cap)``.

    The rollout engine samples with its own numerics (another kernel, batch or precision), so its
    log-probs differ slightly from the learner's for the same weights; this reweights each token by the
    ratio, truncated at ``cap`` to bound the variance. In async training ``rollout_logp`` is the sampling
    log-prob of an older weights version (each token's own: the one that sampled it) and the ratio is
    decoupled PPO's ``π_prox / π_behav`` (see :func:`clipped_policy_loss`). Returned detached.
    """
    if cap <= 0:
        raise ValueError(f"truncated IS cap must be > 0, got {cap}")
    return torch.exp(learner_logp.detach() - rollout_logp.detach()).clamp(max=cap)


def clipped_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float = 0.2,
) -> torch.Tensor:
    """PPO's clipped value loss ``½ max((V - R)², (clip(V, V_old ± ε) - R)²)``, token-mean over the mask."""
    clipped = old_values + torch.clamp(values - old_values, -clip_eps, clip_eps)
    per_token = 0.5 * torch.maximum((values - returns) ** 2, (clipped - returns) ** 2)
    return masked_mean(per_token, mask)


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(π ‖ π_ref) from samples of π (Schulman, "Approximating KL divergence").

    - ``k1 = log π - log π_ref`` (unbiased, high variance, can be negative),
    - ``k2 = ½ (log π - log π_ref)²`` (biased, low variance),
    - ``k3 = exp(log π_ref - log π) - (log π_ref - log π) - 1`` (unbiased, ≥ 0; GRPO's choice).
    """
    log_ratio = logp - ref_logp
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    if estimator == "k3":
        return torch.exp(-log_ratio) + log_ratio - 1.0
    raise ValueError(f"unknown KL estimator {estimator!r}; choose one of {KL_ESTIMATORS}")


def token_log_probs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``log softmax(logits)[tokens]``: logits ``[B, T, V]`` predicting ``tokens`` ``[B, T]``."""
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Per-position entropy of the categorical distribution given by ``logits`` ``[B, T, V]``."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)
