"""Router-bias balancing without auxiliary losses: Quantile Balancing (K3) and the sign update (DeepSeek).

The bias only selects experts and gets no gradient. Quantile Balancing is the exact coordinate minimiser of
the LP dual of balanced assignment, so it needs no step size and settles in a few steps; the sign update is
SignSGD on the same dual.

Design: docs/design/model.md#model-balancing.
"""

from __future__ import annotations

import math

import torch


def expert_loads(expert_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Tokens routed to each expert (float [n]) from top-k ids [m, k]."""
    return torch.bincount(expert_ids.reshape(-1), minlength=num_experts).float()


def route_top_k(scores: torch.Tensor, bias: torch.Tensor, k: int) -> torch.Tensor:
    """Expert ids [m, k] chosen by top-k of the biased scores s + b."""
    return torch.topk(scores + bias, k, dim=-1).indices


def quantile_balance(scores: torch.Tensor, k: int, bias: torch.Tensor) -> torch.Tensor:
    """One Quantile Balancing step: the bias that balances `scores` [m, n] (sigmoid router scores).

    Returns the new, mean-centred bias [n] (fp32), for the *next* step's routing.
    """
    if scores.dim() != 2:
        raise ValueError(f"quantile_balance: scores must be [m, n], got {tuple(scores.shape)}")
    m, n = scores.shape
    if not 1 <= k < n:
        raise ValueError(f"quantile_balance: need 1 <= k < n (top-(k+1) routing), got k={k}, n={n}")
    if bias.shape != (n,):
        raise ValueError(f"quantile_balance: bias must be [{n}], got {tuple(bias.shape)}")
    if m == 0:
        return bias.detach().float().clone()
    s = scores.detach().float()
    b = bias.detach().float().to(s.device)
    cutoff = torch.topk(s + b, k + 1, dim=-1).values[:, -1:]  # alpha_i: (k+1)-th biased score, [m, 1]
    margins = s - cutoff  # [m, n]
    b_hat = -_column_quantile(margins, 1.0 - k / n)
    return (b_hat - b_hat.mean()).to(bias.dtype)


def _column_quantile(x: torch.Tensor, level: float) -> torch.Tensor:
    """Per-column quantile of x [m, n] with linear interpolation (torch.quantile's rule).

    `torch.quantile` refuses inputs above 2^24 elements and sorts whole columns; balancing needs a level
    near 1 (1 - k/n), so a `topk` over the few largest entries of each column is enough (and ~5x faster
    than `kthvalue` at m = 56k, n = 896).
    """
    m = x.shape[0]
    pos = level * (m - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    rows = x.T.contiguous()  # [n, m]: topk along the contiguous dim
    if level >= 0.5:  # order statistics counted from the top
        top = torch.topk(rows, m - lo, dim=1).values  # descending; ascending index i is top[:, m - 1 - i]
        v_lo, v_hi = top[:, m - 1 - lo], top[:, m - 1 - hi]
    else:
        bottom = -torch.topk(-rows, hi + 1, dim=1).values  # ascending
        v_lo, v_hi = bottom[:, lo], bottom[:, hi]
    return v_lo + (pos - lo) * (v_hi - v_lo)


def sign_update(loads: torch.Tensor, bias: torch.Tensor, u: float = 1e-3) -> torch.Tensor:
    """The loss-free balancing step of arXiv:2408.15664: b + u * sign(mean load - load)."""
    if loads.shape != bias.shape:
        raise ValueError(
            f"sign_update: loads {tuple(loads.shape)} and bias {tuple(bias.shape)} differ in shape"
        )
    loads = loads.detach().float().to(bias.device)
    return (bias.detach() + u * torch.sign(loads.mean() - loads)).to(bias.dtype)


def prefix_multiplicities(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Tokens per distinct causal context in a batch [B, T] (padding, ``attention_mask == 0``, left out).

    A causal model gives equal hidden states, hence equal routing, to every token whose prefix (the real
    tokens up to and including it) is the same: episodes that share a prompt send its tokens to the same
    experts together. The counts are the sizes of those indivisible lumps of router load.
    """
    nodes: dict[tuple[int, int], int] = {}
    counts: list[int] = []
    for row, keep in zip(input_ids.tolist(), attention_mask.bool().tolist(), strict=True):
        node = -1
        for token, real in zip(row, keep, strict=True):
            if not real:
                continue
            key = (node, token)
            node = nodes.setdefault(key, len(nodes))
            if node == len(counts):
                counts.append(0)
            counts[node] += 1
    return torch.tensor(counts, dtype=torch.float32)


def maxvio_floor(
    multiplicities: torch.Tensor, num_experts: int, k: int, generator: torch.Generator, draws: int = 32
) -> float:
    """Expected MaxVio of a perfectly balanced router on a batch: each distinct context (of the given
    multiplicities, see `prefix_multiplicities`; all ones for independent tokens) picks k distinct experts
    uniformly at random. No bias computed from other batches can be expected to do better than this
    sampling noise, so it is the yardstick for the in-loop MaxVio."""
    if multiplicities.numel() == 0:
        return 0.0
    weights = multiplicities.float().repeat_interleave(k)
    vios = []
    for _ in range(draws):
        ids = torch.rand(multiplicities.numel(), num_experts, generator=generator).topk(k, dim=-1).indices
        vios.append(max_violation(torch.bincount(ids.reshape(-1), weights=weights, minlength=num_experts)))
    return sum(vios) / len(vios)


def max_violation(loads: torch.Tensor) -> float:
    """MaxVio = (max load - mean load) / mean load (0 for a perfectly balanced or empty batch)."""
    loads = loads.detach().float()
    mean = loads.mean()
    if loads.numel() == 0 or float(mean) == 0.0:
        return 0.0
    return float((loads.max() - mean) / mean)
