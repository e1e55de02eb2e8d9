"""Tree-GRPO (Ji et al., "Tree Search for LLM Agent Reinforcement Learning", ICLR 2026, arXiv 2509.21240).

An episode is a tree whose nodes are whole agent turns (observation + action tokens): siblings share
their ancestors' turns and differ from the branch point on. Each leaf ends one complete trajectory
with one outcome reward. The advantage of leaf ``i`` is the paper's sum of two group-relative terms,

    A(i) = A_intra(i) + A_inter(i),
    A_g(i) = (r_i - mean_{j in G_g(i)} r_j) / (std_{j in G_g(i)} r_j + eps)   (no division: Dr.GRPO),

with ``G_intra(i)`` the leaves under the deepest branch node above ``i`` (its siblings and their
descendants: they share everything up to that node, so the difference is the credit of the turns after
it) and ``G_inter(i)`` all leaves of the trees of the same prompt. Failed leaves (``valid`` False) are
out of every mean and std and get 0, as in `rl.algos.grpo_advantages`; a group of one leaf gives 0.
Without branches every tree is a chain, ``A_intra`` is 0 and ``A`` is GRPO's over the prompt's chains.

Training: the leaf paths expanded into chains would train a shared turn once per leaf below it.
`tree_samples` trains it once instead, with all those leaves' advantages combined: the clipped
surrogate is positively homogeneous in the advantage and linear among advantages of one sign, so
``sum_k w_k l(ρ, A_k) = l(ρ, A+) + l(ρ, A-)`` with ``A± = sum_k`` of the positive / negative
``w_k A_k`` (``w_k``: leaf ``k``'s token weight under the loss aggregation). `tree_policy_loss` is
then exactly the expanded chains' `rl.algos.clipped_policy_loss`, value and gradients.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rl.algos.losses import LOSS_AGGREGATIONS, clipped_surrogate
from rl.episode import Episode


@dataclass
class Tree:
    """One episode tree: node ``i``'s parent is ``parents[i]`` (``-1`` for the root, node 0; parents come
    before children), its turn is ``tokens[i]`` with ``action_mask[i]`` 1 on the tokens the policy
    sampled. ``rewards`` / ``valid``: one per leaf, in `leaves` order."""

    parents: list[int]
    tokens: list[list[int]]
    action_mask: list[list[int]]
    rewards: list[float]
    valid: list[bool] | None = None

    def __post_init__(self) -> None:
        n = len(self.parents)
        if n == 0 or self.parents[0] != -1:
            raise ValueError("a tree needs a root: node 0 with parent -1")
        for node, parent in enumerate(self.parents[1:], start=1):
            if not 0 <= parent < node:
                raise ValueError(f"node {node} has parent {parent}; parents must be earlier nodes")
        if len(self.tokens) != n or len(self.action_mask) != n:
            raise ValueError(f"{n} nodes but {len(self.tokens)} token lists, {len(self.action_mask)} masks")
        for node, (toks, mask) in enumerate(zip(self.tokens, self.action_mask, strict=True)):
            if len(toks) != len(mask):
                raise ValueError(f"node {node}: {len(toks)} tokens but {len(mask)} action-mask entries")
        leaves = len(self.leaves)
        if len(self.rewards) != leaves:
            raise ValueError(f"{leaves} leaves but {len(self.rewards)} rewards")
        if self.valid is not None and len(self.valid) != leaves:
            raise ValueError(f"{leaves} leaves but {len(self.valid)} valid flags")

    @property
    def children(self) -> list[list[int]]:
        kids: list[list[int]] = [[] for _ in self.parents]
        for node, parent in enumerate(self.parents[1:], start=1):
            kids[parent].append(node)
        return kids

    @property
    def leaves(self) -> list[int]:
        return [node for node, kids in enumerate(self.children) if not kids]

    def path(self, node: int) -> list[int]:
        """The nodes from the root down to ``node``."""
        nodes = [node]
        while self.parents[nodes[-1]] != -1:
            nodes.append(self.parents[nodes[-1]])
        return nodes[::-1]


def intra_groups(tree: Tree) -> torch.Tensor:
    """``[L, L]`` bool: row ``i`` marks the leaves under leaf ``i``'s deepest branch node (only ``i``
    itself when no node above it branches)."""
    kids, leaves = tree.children, tree.leaves
    members = torch.eye(len(leaves), dtype=torch.bool)
    for i, leaf in enumerate(leaves):
        branch = next((n for n in reversed(tree.path(leaf)[:-1]) if len(kids[n]) > 1), None)
        if branch is None:
            continue
        for j, other in enumerate(leaves):
            members[i, j] = branch in tree.path(other)
    return members


def group_relative(
    rewards: torch.Tensor,
    members: torch.Tensor,
    valid: torch.Tensor | None = None,
    scale_by_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """``(r_i - mean_{G_i}) / (std_{G_i} + eps)`` with ``G_i`` the valid leaves of ``members[i]``
    (``[L, L]`` bool); the population std; 0 for invalid leaves."""
    if rewards.dim() != 1 or members.shape != (rewards.numel(), rewards.numel()):
        raise ValueError(f"rewards {tuple(rewards.shape)} need a square [L, L] membership, got "
                         f"{tuple(members.shape)}")  # fmt: skip
    r = rewards.float()
    v = torch.ones_like(r) if valid is None else valid.float()
    m = members.float() * v[None, :]
    count = m.sum(dim=1).clamp_min(1.0)
    mean = (m @ r) / count
    centred = (r - mean) * v
    if scale_by_std:
        std = ((m * (r[None, :] - mean[:, None]) ** 2).sum(dim=1) / count).sqrt()
        centred = centred / (std + eps)
    return centred


def tree_grpo_advantages(
    trees: list[Tree], prompts: list[int], scale_by_std: bool = True, eps: float = 1e-6
) -> list[torch.Tensor]:
    """Each tree's leaf advantages ``A_intra + A_inter`` (module docstring); ``prompts[t]`` is the prompt
    of tree ``t``: the inter-tree group is every leaf of the trees of that prompt."""
    if len(prompts) != len(trees):
        raise ValueError(f"{len(trees)} trees but {len(prompts)} prompt ids")
    sizes = [len(t.leaves) for t in trees]
    rewards = torch.tensor([r for t in trees for r in t.rewards], dtype=torch.float32)
    valid = torch.tensor([bool(v) for t in trees for v in (t.valid or [True] * len(t.leaves))])
    intra = torch.block_diag(*[intra_groups(t) for t in trees]).bool()
    prompt_of = torch.tensor([p for p, n in zip(prompts, sizes, strict=True) for _ in range(n)])
    inter = prompt_of[:, None] == prompt_of[None, :]
    total = group_relative(rewards, intra, valid, scale_by_std, eps)
    total = total + group_relative(rewards, inter, valid, scale_by_std, eps)
    return list(total.split(sizes))


@dataclass
class TreeSamples:
    """Learner rows of a batch of trees: one row per leaf path, ``[R, T]`` tokens; the loss tensors are
    ``[R, T-1]`` (position ``p`` scores token ``p + 1``, like the learner's log-probs). Each node's action
    tokens are in the loss (``loss_mask``) in one row only, with the combined ``adv_pos`` / ``adv_neg``."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    adv_pos: torch.Tensor
    adv_neg: torch.Tensor


def _leaf_weights(
    action_tokens: list[int], trained: list[bool], aggregation: str, norm_length: int
) -> list[float]:
    """Each leaf path's per-token weight in `rl.algos.aggregate` over the expanded chains."""
    counted = [n for n, t in zip(action_tokens, trained, strict=True) if t and n > 0]
    if aggregation == "token_mean":
        return [1.0 / max(sum(counted), 1)] * len(trained)
    if aggregation == "seq_mean_token_mean":
        return [1.0 / (max(n, 1) * max(len(counted), 1)) for n in action_tokens]
    if aggregation == "seq_mean_token_sum_norm":
        return [1.0 / (norm_length * max(len(counted), 1))] * len(trained)
    raise ValueError(f"unknown loss aggregation {aggregation!r}; choose one of {LOSS_AGGREGATIONS}")


def tree_samples(
    trees: list[Tree],
    advantages: list[torch.Tensor],
    pad_id: int,
    aggregation: str = "token_mean",
    norm_length: int | None = None,
    trained: list[list[bool]] | None = None,
) -> TreeSamples:
    """The learner rows of ``trees`` (leaf advantages from `tree_grpo_advantages`): shared turns once,
    each with the weighted advantages of the ``trained`` leaves below it (default: the valid ones) split
    by sign. ``aggregation`` / ``norm_length`` are the loss's (`rl.algos.aggregate`), folded in here."""
    rows: list[list[int]] = []
    where: list[dict[int, int]] = []  # per row: node -> offset of its first token
    leaf_rows: list[list[int]] = []  # per tree: the row of each leaf
    for tree in trees:
        leaf_rows.append([])
        for leaf in tree.leaves:
            offsets, ids = {}, []
            for node in tree.path(leaf):
                offsets[node] = len(ids)
                ids.extend(tree.tokens[node])
            leaf_rows[-1].append(len(rows))
            rows.append(ids)
            where.append(offsets)
    if trained is None:
        trained = [list(t.valid) if t.valid is not None else [True] * len(t.leaves) for t in trees]
    if len(advantages) != len(trees):
        raise ValueError(f"{len(trees)} trees but {len(advantages)} advantage tensors")
    flat_trained = [bool(x) for ts in trained for x in ts]
    if len(flat_trained) != len(rows):
        raise ValueError(f"{len(rows)} leaves but {len(flat_trained)} trained flags")
    length = max(len(r) for r in rows)
    n_actions = [sum(sum(t.action_mask[n]) for n in t.path(leaf)) for t in trees for leaf in t.leaves]
    weights = _leaf_weights(n_actions, flat_trained, aggregation, norm_length or length - 1)
    shape = (len(rows), length)
    input_ids = torch.full(shape, pad_id, dtype=torch.long)
    attention_mask = torch.zeros(shape, dtype=torch.long)
    loss_mask, adv_pos, adv_neg = (torch.zeros(len(rows), length - 1) for _ in range(3))
    for r, ids in enumerate(rows):
        input_ids[r, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        attention_mask[r, : len(ids)] = 1
    for t, (tree, adv) in enumerate(zip(trees, advantages, strict=True)):
        if adv.shape != (len(tree.leaves),):
            raise ValueError(f"tree {t}: {len(tree.leaves)} leaves but advantages {tuple(adv.shape)}")
        below: list[list[int]] = [[] for _ in tree.parents]  # trained leaf indices under each node
        for i, leaf in enumerate(tree.leaves):
            if flat_trained[leaf_rows[t][i]]:
                for node in tree.path(leaf):
                    below[node].append(i)
        for node, leaves_below in enumerate(below):
            if not leaves_below:
                continue
            contrib = torch.stack([adv[i].float() * weights[leaf_rows[t][i]] for i in leaves_below])
            row = leaf_rows[t][leaves_below[0]]
            start = where[row][node]
            for k, is_action in enumerate(tree.action_mask[node]):
                if not is_action:
                    continue
                if start + k == 0:
                    raise ValueError(f"tree {t}: the first token of the root cannot be an action")
                p = start + k - 1
                loss_mask[row, p] = 1.0
                adv_pos[row, p] = contrib.clamp_min(0).sum()
                adv_neg[row, p] = contrib.clamp_max(0).sum()
    return TreeSamples(input_ids, attention_mask, loss_mask, adv_pos, adv_neg)


def tree_policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    samples: TreeSamples,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    is_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """The clipped surrogate of ``samples`` (the aggregation is already in their advantages): equal to
    `rl.algos.clipped_policy_loss` over the same trees expanded into one chain per leaf."""
    pos, _ = clipped_surrogate(logp, old_logp, samples.adv_pos, clip_low, clip_high)
    neg, _ = clipped_surrogate(logp, old_logp, samples.adv_neg, clip_low, clip_high)
    per_token = pos + neg
    if is_weights is not None:
        per_token = per_token * is_weights.detach()
    return (per_token * samples.loss_mask).sum()


def episode_trees(episodes: list[Episode], group_size: int) -> tuple[list[Tree], list[int], list[list[int]]]:
    """The trees of ``episodes`` (leaves laid out group after group, ``group_size`` per group, each
    recording its tree and branches): ``(trees, the group of each tree, the episode of each tree's
    leaves in `Tree.leaves` order)``. Rewards and validity (weight > 0) are the episodes'."""
    if len(episodes) % group_size:
        raise ValueError(f"{len(episodes)} leaves are not whole groups of {group_size}")
    members: dict[tuple[int, int], list[int]] = {}
    for i, episode in enumerate(episodes):
        if episode.tree is None or episode.branches is None:
            raise ValueError(f"episode {i} (seed {episode.seed}) records no tree: it is not a leaf of a "
                             "tree rollout (rollout.tree)")  # fmt: skip
        members.setdefault((i // group_size, episode.tree), []).append(i)
    trees, groups, leaf_episodes = [], [], []
    for (group, _), leaves in members.items():
        tree, order = _tree_of([episodes[i] for i in leaves])
        trees.append(tree)
        groups.append(group)
        leaf_episodes.append([leaves[k] for k in order])
    return trees, groups, leaf_episodes


def _tree_of(leaves: list[Episode]) -> tuple[Tree, list[int]]:
    """One tree from its leaves; with the index (in ``leaves``) of each of its leaves in order."""
    order = sorted(range(len(leaves)), key=lambda k: [c for _, c in leaves[k].branches])
    nodes: dict[tuple[int, ...], int] = {}
    parents: list[int] = []
    tokens: list[list[int]] = []
    masks: list[list[int]] = []
    for k in order:
        leaf = leaves[k]
        path = tuple(c for _, c in leaf.branches)
        if path in nodes:
            raise ValueError(f"two leaves of one tree (seed {leaf.seed}) share the branch path {path}")
        ends = [0, *(offset for offset, _ in leaf.branches), len(leaf.tokens)]
        for depth in range(len(path) + 1):
            key, span = path[:depth], slice(ends[depth], ends[depth + 1])
            if key in nodes:
                node = nodes[key]
                if tokens[node] != leaf.tokens[span] or masks[node] != leaf.action_mask[span]:
                    raise ValueError(f"leaves of one tree (seed {leaf.seed}) differ in their shared node "
                                     f"{key}")  # fmt: skip
                continue
            nodes[key] = len(parents)
            parents.append(nodes[key[:-1]] if depth else -1)
            tokens.append(leaf.tokens[span])
            masks.append(leaf.action_mask[span])
    tree = Tree(
        parents,
        tokens,
        masks,
        rewards=[leaves[k].reward for k in order],
        valid=[leaves[k].weight > 0 for k in order],
    )
    return tree, order
