"""Tree-GRPO (rl.algos.tree_grpo): the advantages, the chain case, and one-pass training of shared turns."""

from __future__ import annotations

import pytest
import torch

from rl.algos import clipped_policy_loss, grpo_advantages, token_log_probs
from rl.algos.tree_grpo import Tree, intra_groups, tree_grpo_advantages, tree_policy_loss, tree_samples


def _chain(reward: float, valid: bool = True) -> Tree:
    return Tree(parents=[-1, 0], tokens=[[1, 2], [3, 4]], action_mask=[[0, 1], [0, 1]], rewards=[reward],
                valid=[valid])  # fmt: skip


@pytest.mark.parametrize("scale_by_std", [True, False])
@pytest.mark.parametrize("with_failure", [False, True])
def test_without_branches_it_is_grpo(scale_by_std, with_failure):
    rewards = torch.tensor([1.0, 0.0, 0.5, 1.0, 0.0, 0.0, 1.0, 0.25])
    valid = torch.ones(8, dtype=torch.bool)
    if with_failure:
        valid[2] = valid[5] = False
    trees = [_chain(float(r), bool(v)) for r, v in zip(rewards, valid, strict=True)]
    got = torch.cat(tree_grpo_advantages(trees, [0] * 4 + [1] * 4, scale_by_std=scale_by_std))
    want = grpo_advantages(rewards, 4, scale_by_std=scale_by_std, valid=valid)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def _branchy(rewards: list[float], valid: list[bool] | None = None) -> Tree:
    # 0 -> 1, 2 ; 2 -> 3, 4   (leaves 1, 3, 4)
    tokens = [[1, 2, 3], [4, 5], [6, 7], [8, 9, 5], [2, 2]]
    actions = [[0, 1, 1], [0, 1], [0, 1], [0, 1, 1], [0, 1]]
    return Tree(parents=[-1, 0, 0, 2, 2], tokens=tokens, action_mask=actions, rewards=rewards, valid=valid)


def test_intra_and_inter_by_hand():
    tree = _branchy([1.0, 0.0, 1.0])
    assert intra_groups(tree).tolist() == [[True, True, True], [False, True, True], [False, True, True]]
    (adv,) = tree_grpo_advantages([tree], [0], scale_by_std=False)
    # intra: 1 - 2/3, 0 - 1/2, 1 - 1/2 ; inter (the one tree of the prompt): 1/3, -2/3, 1/3
    torch.testing.assert_close(adv, torch.tensor([2 / 3, -7 / 6, 5 / 6]))
    # a failed leaf is out of every group and gets 0
    (adv,) = tree_grpo_advantages([_branchy([1.0, 0.0, 1.0], [True, True, False])], [0], scale_by_std=False)
    torch.testing.assert_close(adv, torch.tensor([0.5 + 0.5, 0.0 - 0.5, 0.0]))


def test_bad_trees_are_refused():
    with pytest.raises(ValueError, match="parents must be earlier"):
        Tree(parents=[-1, 2, 0], tokens=[[1]] * 3, action_mask=[[0]] * 3, rewards=[0.0, 0.0])
    with pytest.raises(ValueError, match="2 leaves but 1 rewards"):
        Tree(parents=[-1, 0, 0], tokens=[[1]] * 3, action_mask=[[0]] * 3, rewards=[0.0])


class TinyPolicy(torch.nn.Module):
    def __init__(self, vocab: int = 12) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, 8)
        self.rnn = torch.nn.GRU(8, 8, batch_first=True)
        self.head = torch.nn.Linear(8, vocab)

    def log_probs(self, ids: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.rnn(self.emb(ids))[0])
        return token_log_probs(logits[:, :-1], ids[:, 1:])


def _expanded(trees: list[Tree], advantages: list[torch.Tensor], pad_id: int):
    """The same trees as one duplicated chain per leaf (each shared turn repeated in every chain)."""
    rows, masks, advs, valid = [], [], [], []
    for tree, adv in zip(trees, advantages, strict=True):
        for i, leaf in enumerate(tree.leaves):
            nodes, node = [], leaf
            while node != -1:
                nodes.insert(0, node)
                node = tree.parents[node]
            rows.append([tok for n in nodes for tok in tree.tokens[n]])
            masks.append([m for n in nodes for m in tree.action_mask[n]])
            advs.append(float(adv[i]))
            valid.append(True if tree.valid is None else tree.valid[i])
    length = max(map(len, rows))
    ids = torch.tensor([r + [pad_id] * (length - len(r)) for r in rows])
    mask = torch.tensor([m[1:] + [0] * (length - len(m)) for m in masks], dtype=torch.float32)
    mask = mask * torch.tensor(valid, dtype=torch.float32)[:, None]
    return ids, mask, torch.tensor(advs)[:, None] * mask


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_shared_turns_once_equal_duplicated_chains(aggregation):
    torch.manual_seed(0)
    trees = [
        _branchy([1.0, 0.0, 1.0]),
        _branchy([0.0, 1.0, 0.0], [True, False, True]),
        Tree(parents=[-1, 0, 1, 1], tokens=[[1, 4], [5, 6, 7], [3], [9, 9]],
             action_mask=[[0, 1], [0, 1, 1], [1], [0, 1]], rewards=[1.0, 0.5]),  # fmt: skip
    ]
    advantages = tree_grpo_advantages(trees, [0, 0, 1])
    policy, old = TinyPolicy(), TinyPolicy()
    with torch.no_grad():  # an older policy near this one, so that some ratios are clipped
        for p, q in zip(policy.parameters(), old.parameters(), strict=True):
            q.copy_(p + 0.3 * torch.randn_like(p))

    ids, mask, adv = _expanded(trees, advantages, pad_id=0)
    logp = policy.log_probs(ids)
    with torch.no_grad():
        old_logp = old.log_probs(ids)
    want, stats = clipped_policy_loss(logp, old_logp, adv, mask, 0.2, 0.28, aggregation)
    assert 0 < stats.clip_fraction < 1  # both branches of the clipped surrogate are exercised
    want_grads = torch.autograd.grad(want, list(policy.parameters()))

    samples = tree_samples(trees, advantages, pad_id=0, aggregation=aggregation)
    assert samples.loss_mask.sum() < mask.sum()  # shared turns are trained once, not once per leaf
    logp = policy.log_probs(samples.input_ids)
    with torch.no_grad():
        old_logp = old.log_probs(samples.input_ids)
    got = tree_policy_loss(logp, old_logp, samples, 0.2, 0.28)
    got_grads = torch.autograd.grad(got, list(policy.parameters()))
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-5)
