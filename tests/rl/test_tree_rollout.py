"""Tree rollouts (`rl.rollout.trees`) with the tiny K3 policy and real sandboxes: a branch forks the running
sandbox and the policy state, siblings share the prefix and nothing after it, a path that ends early stands
for its leaves, the budget bounds the shape, a failed child is masked like a failed chain member, a tree
survives an in-flight checkpoint; the learner trains a shared turn once, as the expanded chains would, and
``algo=tree_grpo`` trains end to end; routes recorded on tree paths replay in the learner."""

from __future__ import annotations

import math
import pickle
import threading
import time
from dataclasses import replace

import gymnasium
import numpy as np
import pytest
import torch
from rl_testutil import TINY, compose

from agentenv import Sandbox
from agentenv.tasks.base import Outcome, SandboxTask
from rl.algos import clipped_policy_loss
from rl.algos.tree_grpo import episode_trees, tree_grpo_advantages
from rl.config.schema import TreeRolloutConfig
from rl.driver.evaluate import success_rate
from rl.driver.trainer import Trainer
from rl.episode import Episode, collate
from rl.learner.learner import Learner
from rl.policy import build_policy
from rl.rollout.runner import EpisodeRunner
from rl.rollout.torch_engine import TorchEngine
from rl.rollout.trees import child_seed
from rl.tokenizer import ByteTokenizer

TOK = ByteTokenizer()
# 2 prompts x 2 trees x 2 leaves, branching after the first turn
TREE_GRPO = ("algo=tree_grpo", "algo.group_size=4", "algo.episodes_per_step=8",
             "rollout.tree={branch_at: [1], width: 2, depth: 1, budget: 2}")  # fmt: skip


class Notebook(SandboxTask):
    """Each action leaves a file named by its turn and a draw of the task's randomness in the sandbox;
    the observation lists the files there."""

    def setup(self, seed: int) -> str:
        self.run("mkdir -p /workspace/notes && rm -f /workspace/notes/*")
        return "notes:"

    def act(self, action: str) -> Outcome:
        name = f"t{self.turn}-{int(self.np_random.integers(10**6))}"
        self.run(f"touch /workspace/notes/{name}")
        return Outcome(" ".join(sorted(self.run("ls /workspace/notes").output.split())))


class FailingNotebook(Notebook):
    """A Notebook whose second step raises on a coin of the task's randomness (a bug in a user's task)."""

    def act(self, action: str) -> Outcome:
        if self.turn == 2 and self.np_random.integers(2):
            raise ValueError("task bug on purpose")
        return super().act(action)


for _name, _cls in {"Notebook": Notebook, "FailingNotebook": FailingNotebook}.items():
    if f"tree/{_name}-v0" not in gymnasium.registry:
        gymnasium.register(f"tree/{_name}-v0", entry_point=_cls, disable_env_checker=True)


@pytest.fixture(scope="module")
def policy():
    return build_policy(compose().model, seed=0).float()


def make_runner(
    policy, sandbox_config, env: str, tree: dict, max_turns: int = 2, engine=None
) -> EpisodeRunner:
    """A tree runner on ``env`` (torch engine over ``policy`` unless ``engine`` is given)."""
    cfg = compose("rollout.env_threads=4")
    env_cfg = replace(cfg.env, id=f"tree/{env}-v0", kwargs={"max_turns": max_turns}, group_start="fork",
                      max_new_tokens=4, action_vocabulary="abcdefghij")  # fmt: skip
    pool = replace(cfg.rollout.sandbox_pool, pause_policy="never")
    rollout = replace(cfg.rollout, sandbox_pool=pool, tree=TreeRolloutConfig(**tree))
    engine = engine or TorchEngine(policy, TOK, action_vocabulary=env_cfg.action_vocabulary)
    return EpisodeRunner(env_cfg, rollout, engine, TOK, sandbox=sandbox_config)


def notes(observation: str) -> set[str]:
    return set(observation.split())


@pytest.mark.docker
def test_children_start_from_the_branch_and_never_see_their_siblings(policy, sandbox_config):
    runner = make_runner(policy, sandbox_config, "Notebook", {"branch_at": [1], "width": 2, "depth": 1,
                                                             "budget": 2})  # fmt: skip
    try:
        leaves, stats = runner.run([3], group_size=2, generator=torch.Generator().manual_seed(0))
    finally:
        runner.close()
    assert stats.failed == 0 and stats.forks == 1 and stats.env_steps == 3  # the shared turn stepped once
    # the child's copy of the policy state: timed, and the bytes of the parent's model cache
    assert stats.state_copies == 1 and stats.state_copy_s > 0 and stats.state_copy_bytes > 0
    assert [e.tree for e in leaves] == [0, 0] and all(e.turns == 2 for e in leaves)
    (offset, first), (offset_b, second) = leaves[0].branches[0], leaves[1].branches[0]
    assert (first, second) == (0, 1) and offset == offset_b
    assert leaves[0].tokens[:offset] == leaves[1].tokens[:offset]  # the shared prefix
    sampled = sum(leaves[0].action_mask[:offset]) + sum(sum(e.action_mask[offset:]) for e in leaves)
    assert stats.generated_tokens == sampled  # the shared turn's tokens were sampled once
    # the prefix was read once: in turn 2 each leaf read only the parent's last sampled token and what
    # followed its first action (chains would re-read the whole context)
    prompt, first_action = leaves[0].action_mask.index(1), sum(leaves[0].action_mask[:offset])
    assert stats.context_tokens == prompt + 2 * offset
    assert stats.context_tokens_read == prompt + 2 * (1 + offset - prompt - first_action)
    # a child's first observation is the state after the branch turn: the file turn 1 planted
    assert leaves[0].observations[:2] == leaves[1].observations[:2]
    planted = notes(leaves[0].observations[1])
    assert len(planted) == 1 and next(iter(planted)).startswith("t1-")
    # after the branch each sees its own turn-2 file, never its sibling's (each reseeded its draws)
    own = [notes(e.observations[2]) - planted for e in leaves]
    assert all(len(o) == 1 and next(iter(o)).startswith("t2-") for o in own) and own[0] != own[1]
    assert all(planted < notes(e.observations[2]) for e in leaves)
    # siblings sample on their own from the carried state: their actions after the branch differ, and
    # every sampling log-prob is the policy's own over the whole sequence (the prefix was not re-read)
    assert leaves[0].tokens[offset:] != leaves[1].tokens[offset:]
    batch = collate(leaves, TOK.pad_id)
    with torch.no_grad():
        logits = policy(batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1].float()
    engine = TorchEngine(policy, TOK, action_vocabulary="abcdefghij")
    logp = engine._action_logp(logits.reshape(-1, logits.shape[-1]), 1.0).view(logits.shape)
    logp = logp.gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    mask = batch.action_mask.bool()
    torch.testing.assert_close(logp[mask], batch.rollout_logprobs[mask], atol=2e-4, rtol=0)
    # routing replay on tree paths: each leaf holds the experts of each of its action tokens, those of the
    # shared turn (sampled once) the same in both
    shared = sum(leaves[0].action_mask[:offset])
    assert all(e.routes is not None and e.routes.shape[0] == sum(e.action_mask) for e in leaves)
    assert shared > 0 and torch.equal(leaves[0].routes[:shared], leaves[1].routes[:shared])
    assert not torch.equal(leaves[0].routes[shared:], leaves[1].routes[shared:])
    assert batch.routes is not None and (batch.routes[mask] >= 0).all()


@pytest.mark.docker
def test_a_path_that_ends_before_its_branch_stands_for_its_leaves(policy, sandbox_config):
    runner = make_runner(policy, sandbox_config, "Notebook", {"branch_at": [1], "width": 2, "depth": 1,
                                                             "budget": 2}, max_turns=1)  # fmt: skip
    try:
        leaves, stats = runner.run([4], group_size=2, generator=torch.Generator().manual_seed(0))
    finally:
        runner.close()
    assert stats.forks == 0 and stats.env_steps == 1 and stats.failed == 0
    end = len(leaves[0].tokens)
    assert leaves[0].tokens == leaves[1].tokens and [e.branches for e in leaves] == [[(end, 0)], [(end, 1)]]
    trees, _, order = episode_trees(leaves, 2)
    assert order == [[0, 1]] and trees[0].tokens[1:] == [[], []]  # the children's turns are empty


def action_starts(mask: list[int]) -> list[int]:
    """The offset of each action's first token."""
    return [i for i, m in enumerate(mask) if m and (i == 0 or not mask[i - 1])]


@pytest.mark.docker
def test_by_entropy_a_path_branches_at_its_first_candidate_turn_where_the_policy_grew_unsure(
        policy, sandbox_config):
    tree = {"branch_at": [1, 2], "width": 2, "depth": 1, "budget": 2}
    runner = make_runner(policy, sandbox_config, "Notebook", {**tree, "entropy_rise": 0.0}, max_turns=3)
    never = make_runner(policy, sandbox_config, "Notebook", {**tree, "entropy_rise": 1e6}, max_turns=3)
    try:
        leaves, stats = runner.run([3, 5, 8], group_size=2, generator=torch.Generator().manual_seed(0))
        flat, flat_stats = never.run([3], group_size=2, generator=torch.Generator().manual_seed(0))
    finally:
        runner.close()
        never.close()
    assert flat_stats.forks == 0 and flat[0].tokens == flat[1].tokens  # never unsure enough: no branch
    # the rule, recomputed from each tree's tokens with fresh reads: the first candidate turn whose
    # next-action entropy is at least the first action's
    engine = TorchEngine(policy, TOK, action_vocabulary="abcdefghij")
    branched = 0
    for g in range(3):
        first, second = leaves[2 * g], leaves[2 * g + 1]
        assert first.error is None and second.error is None
        starts = action_starts(first.action_mask)
        h0 = engine.entropy(engine.read(first.tokens[: starts[0]]))
        want = None
        for turn in tree["branch_at"]:
            if turn >= len(starts):  # the path ended with this turn: nothing to branch into
                break
            rise = engine.entropy(engine.read(first.tokens[: starts[turn]])) - h0
            assert abs(rise) > 1e-4, "too close to the threshold to tell"
            if rise >= 0:
                want = turn
                break
        (offset, _), (offset_b, _) = first.branches[0], second.branches[0]
        assert offset == offset_b
        if want is None:
            assert offset == len(first.tokens) and first.tokens == second.tokens
        else:
            branched += 1
            assert offset == starts[want] and first.tokens[:offset] == second.tokens[:offset]
    assert stats.forks == branched and 0 < branched, "pick seeds where some tree branches"


def expected_failures(seed: int, width: int) -> list[bool]:
    """Which children of the branch after turn 1 raise at turn 2 (the coin of their reseeded draws)."""
    return [bool(np.random.default_rng(child_seed(seed, 0, (c,))).integers(2)) for c in range(width)]


@pytest.mark.docker
def test_a_failed_child_is_masked_like_a_failed_chain_member(policy, sandbox_config):
    seed = next(s for s in range(100) if 0 < sum(expected_failures(s, 4)) < 4)
    failing = expected_failures(seed, 4)
    runner = make_runner(policy, sandbox_config, "FailingNotebook", {"branch_at": [1], "width": 4,
                                                                    "depth": 1, "budget": 4})  # fmt: skip
    try:
        leaves, stats = runner.run([seed], group_size=4, generator=torch.Generator().manual_seed(0))
    finally:
        runner.close()
    assert [e.error is not None for e in leaves] == failing and stats.failed == sum(failing)
    failed = [e for e, f in zip(leaves, failing, strict=True) if f]
    assert all(e.failure == "runtime_error" and e.weight == 0.0 for e in failed)
    assert [o.failed for o in stats.outcomes] == failing
    batch = collate(leaves, TOK.pad_id)
    assert all((batch.action_mask[i].sum() == 0) == f for i, f in enumerate(failing))
    trees, groups, order = episode_trees(leaves, 4)
    assert order == [[0, 1, 2, 3]] and trees[0].valid == [not f for f in failing]
    advantages = tree_grpo_advantages(trees, groups)[0]
    assert all(float(a) == 0.0 for a, f in zip(advantages, failing, strict=True) if f)


@pytest.mark.docker
@pytest.mark.slow
def test_tree_grpo_trains_end_to_end_in_async_mode(local_ray, tmp_path):
    """Async, with routing replay (the sync driver plays the same runner hooks, exercised above)."""
    cfg = compose(*TINY, *TREE_GRPO, "trainer.iterations=1", "env.group_start=fork", "trainer.mode=async",
                  "algo.routing_replay=true")
    result = Trainer(cfg, tmp_path / "tree").run()
    records = result.history
    assert len(records) == 1 and records[0]["episodes"] == 8 and records[0]["failed_episodes"] == 0
    assert math.isfinite(records[0]["loss"]) and records[0]["weights_version"] == 1
    assert records[0]["trained_tokens"] > 0
    # the leaves' routes (the shared turns' in each leaf) replayed: the learner routed as the rollout did
    assert records[0]["routing_recorded_tokens"] > 0 and records[0]["routing_mismatch"] == 0.0
    # at most 2 prompts x 2 trees x 1 extra child (a game won at turn 1 does not branch), each child with
    # its sandbox's fork and its copy of the policy state
    copies = records[0]["tree_state_copies"]
    assert 0 < copies <= 4 and records[0]["sandbox_forks"] >= copies
    assert records[0]["tree_state_copy_s"] > 0 and records[0]["tree_state_copy_bytes"] > 0


def hand_leaves(rewards: list[float]) -> list[Episode]:
    """Two prompts, each two trees of two leaves branching after turn 1 (group_size 4); in each tree the
    leaf of child 1 comes first, so that rows and tree leaves are not in the same order."""
    out = []
    for i, reward in enumerate(rewards):
        group, tree, child = i // 4, (i // 2) % 2, 1 - i % 2
        e = Episode("tree/Notebook-v0", seed=group, group=group, tree=tree)
        e.append([257, 259, *b"notes:", 261, 260], trained=False)
        e.append([97 + group, 98 + tree, 261], trained=True, logprobs=[-2.0, -1.5, -1.0])  # shared
        e.append([259, *b"t1", 261, 260], trained=False)
        e.branches = [(len(e.tokens), child)]
        e.append([99 + child, 261], trained=True, logprobs=[-2.0, -1.0])
        e.step_rewards.append((len(e.tokens) - 1, reward))
        out.append(e)
    return out


def test_the_learner_trains_shared_turns_once_as_the_expanded_chains():
    cfg = compose(*TINY, *TREE_GRPO, "algo.minibatches=1")
    learner = Learner(cfg)
    rewards = [1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0]
    leaves = hand_leaves(rewards)
    batch = collate(leaves, TOK.pad_id)
    valid = torch.ones(8, dtype=torch.bool)
    samples = learner._tree_samples(leaves, batch, valid, valid, [torch.arange(8)])
    # each tree's shared action (3 tokens) once, each leaf's own (2 tokens): 4 trees
    assert int(samples.loss_mask.sum()) == 4 * 3 + 8 * 2 and int(batch.action_mask.sum()) == 8 * 5
    # GRPO over the expanded chains with each leaf's Tree-GRPO advantage (intra: its tree's two leaves,
    # inter: its prompt's four), worked out here by hand, gives the same loss
    r = torch.tensor(rewards)

    def relative(values: torch.Tensor) -> torch.Tensor:
        return (values - values.mean()) / (values.std(unbiased=False) + 1e-6)

    per_leaf = torch.cat([relative(r[t : t + 2]) for t in range(0, 8, 2)])
    per_leaf = per_leaf + torch.cat([relative(r[g : g + 4]) for g in range(0, 8, 4)])
    # log-probs of a token at a position (so equal wherever the leaves share their prefix), old and new
    generator = torch.Generator().manual_seed(0)
    positions = torch.arange(batch.action_mask.shape[1]).expand_as(batch.action_mask)
    targets = batch.input_ids[:, 1:]
    logp = -torch.rand(positions.shape[1], 300, generator=generator)[positions, targets]
    old_logp = logp + 0.3 * torch.randn(positions.shape[1], 300, generator=generator)[positions, targets]
    want, _ = clipped_policy_loss(logp, old_logp, per_leaf[:, None] * batch.action_mask, batch.action_mask)
    got, _ = learner._tree_policy_loss(logp, old_logp, samples, torch.arange(8), None)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    # and a step on them trains
    metrics = learner.train_step(leaves)
    assert math.isfinite(metrics["loss"]) and metrics["trained_tokens"] == 4 * 3 + 8 * 2


@pytest.mark.docker
def test_a_tree_survives_an_in_flight_checkpoint_and_resume(policy, sandbox_config, tmp_path):
    """Recorded before its branch turn, a tree goes on in a new runner from its kept sandbox: its root
    re-reads its tokens, branches there, and the children fork from the restored sandbox."""
    tree = {"branch_at": [2], "width": 2, "depth": 1, "budget": 2}
    keeper = tmp_path / "keeper"
    keeper.mkdir()
    first = make_runner(policy, sandbox_config, "Notebook", tree, max_turns=3)
    taken: dict = {}
    calls = []

    def policy_version() -> int:  # 1: the root's start, 2: turn 1: a snapshot, served before turn 2
        calls.append(1)
        if len(calls) == 2:
            taken["thread"] = threading.Thread(target=lambda: taken.update(r=first.snapshot(keeper, 60)))
            taken["thread"].start()
            deadline = time.monotonic() + 10
            while first._snapshot_request is None and time.monotonic() < deadline:
                time.sleep(0.01)
        return 0

    try:
        first.run([5], 2, torch.Generator().manual_seed(0), policy_version=policy_version)
        taken["thread"].join(timeout=60)
    finally:
        first.close()
    recorded, _ = taken["r"]
    assert [r.playing for r in recorded] == [True, False] and recorded[0].episode.turns == 1
    assert not recorded[1].episode.tokens  # the second leaf was not born yet
    second = make_runner(policy, sandbox_config, "Notebook", tree, max_turns=3)
    try:
        reloaded = pickle.loads(pickle.dumps(recorded))  # as a restarted process reads it
        leaves, stats = second.resume(reloaded, 2, torch.Generator().manual_seed(1))
    finally:
        second.close()
        Sandbox.get(recorded[0].sandbox_id).close()
    assert stats.failed == 0 and stats.forks == 1 and all(e.turns == 3 for e in leaves)
    n = len(recorded[0].episode.tokens)
    assert all(e.tokens[:n] == recorded[0].episode.tokens for e in leaves)
    offset = leaves[0].branches[0][0]
    assert [e.branches for e in leaves] == [[(offset, 0)], [(offset, 1)]] and offset > n
    shared = notes(leaves[0].observations[2])
    assert len(shared) == 2 and leaves[1].observations[2] == leaves[0].observations[2]
    own = [notes(e.observations[3]) - shared for e in leaves]
    assert all(len(o) == 1 for o in own) and own[0] != own[1]


@pytest.mark.docker
def test_a_held_out_evaluation_of_a_tree_grpo_run_plays_chains():
    evaluation = success_rate(compose(*TINY, *TREE_GRPO), episodes=2, batch=2)
    assert evaluation.episodes == 2 and evaluation.failed == 0


@pytest.mark.docker
def test_a_budget_cuts_the_second_branching_short(policy, sandbox_config):
    """branch_at [1, 2], width 2, depth 2, budget 3: the root branches after turn 1, then only its first
    child after turn 2 (3 leaves: paths (0, 0), (0, 1), (1,))."""
    tree = {"branch_at": [1, 2], "width": 2, "depth": 2, "budget": 3}
    runner = make_runner(policy, sandbox_config, "Notebook", tree, max_turns=3)
    try:
        leaves, stats = runner.run([6], group_size=3, generator=torch.Generator().manual_seed(0))
    finally:
        runner.close()
    assert stats.failed == 0 and stats.forks == 2 and all(e.turns == 3 for e in leaves)
    assert [[c for _, c in e.branches] for e in leaves] == [[0, 0], [0, 1], [1]]
    assert leaves[0].branches[0][0] == leaves[2].branches[0][0] < leaves[0].branches[1][0]
    trees, _, order = episode_trees(leaves, 3)
    assert order == [[0, 1, 2]] and trees[0].parents == [-1, 0, 1, 1, 0]
    files = [notes(e.observations[3]) for e in leaves]
    assert len(files[0] & files[1]) == 2 and len(files[0] & files[2]) == 1  # turns 1-2 / turn 1 shared
