"""Tree rollouts for Tree-GRPO (`rl.algos.tree_grpo`): episodes that share a prefix and branch later.

``rollout.tree`` gives the turns a path branches at (``branch_at``), the children of a branch
(``width``), the branchings along one path (``depth``) and the leaves of a tree (``budget``). The
shape is fixed by the config (`TreeRolloutConfig.leaf_paths`): a path branches up to ``depth`` times
while the tree's leaves stay within the budget, paths taken in order. Where: at the first ``depth``
turns of ``branch_at``; or, with ``entropy_rise``, at those turns of ``branch_at`` where the policy's
next-action entropy exceeds that of its first action by at least ``entropy_rise`` (ARPO, Dong et al.
2025: branch where the policy grows unsure after a tool's answer). A group
(one prompt) holds ``algo.group_size`` leaves: ``group_size / leaves`` trees, each laid out as its
leaves in order.

`TreeGrower` (the runner's ``trees``) plays them. Only the first leaf of each tree starts (the root);
after a step that ends a branch turn, the leaf's env is forked ``width - 1`` times through the runner's
pool (`rl.rollout.wrappers.fork_env`: the sandbox as it is, the task's state copied; every fork has its own
sandbox identity) and each child, the parent going on as child 0, reseeds its task's randomness from
its path. The children continue from the parent's policy state
(`rl.rollout.torch_engine.EpisodeState.branch`):
each episode keeps its `EpisodeState`, so nothing is read twice. A path that ends (or fails) before one
of its branch turns stands for all the leaves below it: at the end they are copies of it, with an
empty turn after each branch it did not reach (every leaf is one draw of a whole trajectory, and a
finished one has nothing left to draw), so every tree has the same number of leaves and groups keep
their size downstream.

Each leaf `Episode` records its tree (``tree``) and, for every branch on its path, the token offset
where the branch node ends and its child index (``branches``); `rl.algos.tree_grpo.episode_trees` rebuilds the
`rl.algos.tree_grpo.Tree` of those leaves for the learner.

A tree run plays all its groups at once (no waves). In-flight checkpoints record its leaves as any
episodes (an unborn leaf as one that has not started); a resumed leaf reads its tokens once, then goes
on from its state. An async weights update between turns leaves a carried state as the older weights
read the prefix (the sampled tokens' log-probs are those they were drawn with). Only the torch engine
keeps per-episode states; on vLLM every leaf's turn is a request with its whole context (each child
re-reads the shared prefix), and branching by entropy is refused.
"""

from __future__ import annotations

import copy
import time
from typing import Any

import gymnasium
import numpy as np

from rl.algos.tree_grpo import episode_trees
from rl.config.schema import TreeRolloutConfig
from rl.episode import Episode
from rl.rollout.torch_engine import EpisodeState, Generation
from rl.rollout.wrappers import task
from rl.rollout_stats import RolloutStats

EpisodeRunner = Any  # the `rl.rollout.runner.EpisodeRunner` that owns this part (it imports this module)


def child_seed(seed: int, tree: int, path: tuple[int, ...]) -> int:
    """The seed of a child's task randomness: a function of its episode seed, tree and path."""
    return int(np.random.SeedSequence([seed, tree, *path]).generate_state(1)[0])


class TreeGrower:
    """Grows the trees of a runner's runs (see the module docstring)."""

    def __init__(self, runner: EpisodeRunner, cfg: TreeRolloutConfig) -> None:
        # the torch engine carries each episode's policy state across a branch; another engine (vLLM)
        # generates from whole contexts through the runner's batch, so each child re-reads the prefix
        self.carries = hasattr(runner.engine, "continue_from")
        if cfg.entropy_rise is not None and not self.carries:
            raise ValueError("rollout.tree.entropy_rise reads the policy's entropy from each episode's "
                             "state, which only the torch engine keeps (rollout=torch)")  # fmt: skip
        self.runner = runner
        self.width = cfg.width
        self.entropy_rise = cfg.entropy_rise
        # the turns a path may branch at: fixed, the d-th branch at turns[d]; by entropy, any of them
        self.turns = list(cfg.branch_at[: cfg.depth] if cfg.entropy_rise is None else cfg.branch_at)
        self.shape = cfg.leaf_paths()
        self.leaves = len(self.shape)
        self._first = {}  # path prefix -> the first leaf (its index in the tree) under it
        for k, path in reversed(list(enumerate(self.shape))):
            for d in range(len(path) + 1):
                self._first[path[:d]] = k
        self._states: dict[int, tuple[EpisodeState, int]] = {}  # id(episode) -> (its state, tokens read)
        self._first_entropy: dict[int, float] = {}  # id(episode) -> entropy at its first action (by entropy)
        self._read_since: dict[int, int] = {}  # id(episode) -> tokens read into its state since its action

    def trees_per_group(self, group_size: int) -> int:
        if group_size % self.leaves:
            raise ValueError(f"a group of {group_size} leaves is not a whole number of trees of "
                             f"{self.leaves} leaves (rollout.tree)")  # fmt: skip
        return group_size // self.leaves

    # ------------------------------------------------------------------ a run
    def run(
        self, seeds: list[int], group_size: int, first_group: int, tag: Any, stats: RolloutStats
    ) -> list[Episode]:
        """Play the trees of one group per seed (the runner's `run` set its generator and version);
        the leaves come back group after group."""
        runner = self.runner
        self.trees_per_group(group_size)
        episodes = [
            Episode(runner.env_id, seed, first_group + g, tree=k // self.leaves)
            for g, seed in enumerate(seeds)
            for k in range(group_size)
        ]
        try:
            with runner._running(episodes, tag), runner.residency.demand(len(episodes)):
                t0 = time.perf_counter()
                envs, owned = self.start_groups(seeds, group_size, episodes, stats)
                stats.reset_s += time.perf_counter() - t0
                stats.waves += 1
                active = [i for i, env in enumerate(envs) if env is not None and episodes[i].error is None]
                runner._play(episodes, envs, stats, active, owned)
                runner._return_envs(envs, episodes, owned)
        finally:
            self._forget()
        return episodes

    def start_groups(
        self, seeds: list[int], group_size: int, episodes: list[Episode], stats: RolloutStats
    ) -> tuple[list[gymnasium.Env | None], set[int]]:
        """Start the root of every tree (as `EpisodeRunner._start_groups` starts chains: the trees of
        one group are its members); one env per leaf, None but at the roots, and the owned forks."""
        trees = self.trees_per_group(group_size)
        roots = [g * group_size + t * self.leaves for g in range(len(seeds)) for t in range(trees)]
        started, owned = self.runner._start_groups(seeds, trees, [episodes[i] for i in roots], stats)
        envs: list[gymnasium.Env | None] = [None] * len(episodes)
        for i, env in zip(roots, started, strict=True):
            envs[i] = env
        return envs, owned

    # ------------------------------------------------------------------ generation (`_play`'s hook)
    def generate(self, episodes: list[Episode]) -> list[Generation]:
        """The next action of each episode from its own policy state (read up to its last token; an
        episode without one, e.g. resumed from an in-flight checkpoint, reads all its tokens). Only for
        an engine that carries states (`carries`); the runner batches the others' whole contexts."""
        runner = self.runner
        out = []
        for episode in episodes:
            state = self._read(episode)
            generation = runner.engine.continue_from(state, runner.max_new_tokens, runner._generator)
            generation.context_read = self._read_since.pop(id(episode), 0)
            self._states[id(episode)] = (state, len(episode.tokens) + len(generation.token_ids))
            out.append(generation)
        return out

    def _read(self, episode: Episode) -> EpisodeState:
        """The episode's policy state read up to its last token (its first action's entropy noted, when
        branching by entropy; a resumed episode reads its prompt, then the rest)."""
        engine, key = self.runner.engine, id(episode)
        state, read = self._states.get(key, (None, 0))
        if state is None and self.entropy_rise is not None and episode.turns:
            first_action = episode.action_mask.index(1)  # the prompt: what its first action was drawn after
            state, read = engine.read(episode.tokens[:first_action]), first_action
            self._read_since[key] = self._read_since.get(key, 0) + first_action
            self._first_entropy[key] = engine.entropy(state)
        if state is None or state.pending or episode.tokens[read:]:
            new = len(episode.tokens) - read + (len(state.pending) if state is not None else 0)
            self._read_since[key] = self._read_since.get(key, 0) + new
            state = engine.read(episode.tokens[read:], state)
        if self.entropy_rise is not None and key not in self._first_entropy:
            self._first_entropy[key] = engine.entropy(state)
        self._states[key] = (state, len(episode.tokens))
        return state

    def _forget(self) -> None:
        self._states.clear()
        self._first_entropy.clear()
        self._read_since.clear()

    # ------------------------------------------------------------------ branching (`_play`'s hook)
    def branch(
        self,
        episodes: list[Episode],
        envs: list,
        active: list[int],
        owned: set[int],
        stats: RolloutStats,
    ) -> list[int]:
        """After a turn: branch the ``active`` leaves at a branch turn; the leaves playing on."""
        due = [i for i in active if self._due(episodes[i], i)]
        if not due:
            return active

        def fork(i: int) -> list[gymnasium.Env] | BaseException:
            t = time.perf_counter()
            try:
                forks = self.runner._fork(envs[i], self.width - 1, stats)
            except Exception as exc:
                return exc
            with self.runner._stats_lock:
                stats.fork_s += time.perf_counter() - t
                stats.forks += self.width - 1
            return forks

        t = time.perf_counter()
        forked = list(self.runner.threads.map(fork, due))
        stats.fork_phase_s += time.perf_counter() - t
        playing = list(active)
        for i, forks in zip(due, forked, strict=True):
            parent = episodes[i]
            k = i % self.leaves
            base = i - k
            prefix = self.shape[k][: len(parent.branches or [])]
            offset = len(parent.tokens)
            parent.branches = [*(parent.branches or []), (offset, 0)]
            self._reseed(envs[i], parent, (*prefix, 0))
            state, read = self._states[id(parent)] if self.carries else (None, 0)
            copies = []
            if state is not None:
                t = time.perf_counter()
                copies = state.branch(self.width - 1)
                stats.state_copy_s += time.perf_counter() - t
                stats.state_copies += len(copies)
                stats.state_copy_bytes += len(copies) * state.cache.nbytes()
            for c in range(1, self.width):
                j = base + self._first[(*prefix, c)]
                child = copy.deepcopy(parent)
                child.branches[-1] = (offset, c)
                episodes[j] = child
                if isinstance(forks, BaseException):
                    child.fail(forks)
                    continue
                envs[j] = forks[c - 1]
                owned.add(id(envs[j]))
                self._reseed(envs[j], child, (*prefix, c))
                if copies:
                    self._states[id(child)] = (copies[c - 1], read)
                if id(parent) in self._first_entropy:
                    self._first_entropy[id(child)] = self._first_entropy[id(parent)]
                playing.append(j)
        return playing

    def _due(self, episode: Episode, i: int) -> bool:
        """Does leaf ``i`` branch now, after its last turn? (By entropy this reads its observation.)"""
        done = len(episode.branches or [])
        if done >= len(self.shape[i % self.leaves]):
            return False
        if self.entropy_rise is None:
            return episode.turns == self.turns[done]
        if episode.turns not in self.turns:
            return False
        rise = self.runner.engine.entropy(self._read(episode)) - self._first_entropy[id(episode)]
        return rise >= self.entropy_rise

    @staticmethod
    def _reseed(env: gymnasium.Env, episode: Episode, path: tuple[int, ...]) -> None:
        task(env).np_random = np.random.default_rng(child_seed(episode.seed, episode.tree or 0, path))

    # ------------------------------------------------------------------ the end of a run
    def finish(self, episodes: list[Episode]) -> list[Episode]:
        """The end of a run (or of a resumed one): every leaf a path did not reach is a copy of the path
        that ended before the branch (see the module docstring), every leaf's ``branches`` is filled up
        to its path (``episodes`` in place), and the policy states are dropped."""
        self._forget()
        self.trees_per_group(len(episodes))
        for i, episode in enumerate(episodes):
            k = i % self.leaves
            path = self.shape[k]
            if not episode.tokens and episode.error is None and k > 0:  # unborn: never forked into
                d = max(level for level, c in enumerate(path) if c)
                source = episodes[i - k + self._first[path[:d]]]
                episode = copy.deepcopy(source)
                episode.branches = list((source.branches or [])[:d])
                episodes[i] = episode
            branches = list(episode.branches or [])
            branches += [(len(episode.tokens), path[level]) for level in range(len(branches), len(path))]
            episode.branches = branches
        return episodes

    def sampled(self, episodes: list[Episode]) -> int:
        """The action tokens the policy sampled for finished trees: each shared turn once."""
        trees, _, _ = episode_trees(episodes, self.leaves)
        return sum(sum(map(sum, tree.action_mask)) for tree in trees)
