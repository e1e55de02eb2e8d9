"""``trainer.log_samples=N``: N episodes of every iteration as readable text, in ``<run dir>/samples.txt``.

What the policy typed is otherwise seen nowhere: the episodes go from the rollout workers to the learner
as token ids. Each iteration appends a header and N episodes, one from each of the first groups (then a
second member of each, and so on), each written turn by turn: the observation the policy read, the
action it typed (``repr``, so that spaces and odd bytes show) and the reward of that step, then how the
episode ended. The actions are the decoded action tokens of the episode, exactly what the task was given.
"""

from __future__ import annotations

from pathlib import Path
from textwrap import indent

import ray

from rl.episode import Episode
from rl.tokenizer import Tokenizer

SAMPLES_FILE = "samples.txt"


def actions_of(episode: Episode, tokenizer: Tokenizer) -> list[str]:
    """The decoded text of each of the episode's actions (each run of action tokens), in order."""
    actions, current = [], []
    for token, trained in zip(episode.tokens, episode.action_mask, strict=True):
        if trained:
            current.append(token)
        elif current:
            actions.append(tokenizer.decode(current))
            current = []
    if current:
        actions.append(tokenizer.decode(current))
    return actions


def format_episode(episode: Episode, tokenizer: Tokenizer, title: str) -> str:
    """One episode, turn by turn (see the module docstring)."""
    actions = actions_of(episode, tokenizer)
    rewards = [reward for _, reward in episode.step_rewards]
    ending = "success" if episode.success else "no success"
    if episode.error:
        ending = f"FAILED: {episode.error}" + (f"\n{episode.trace}" if episode.trace else "")
    elif episode.cut == "tokens":
        ending += ", cut by env.max_episode_tokens"
    elif episode.cut == "max_turns":
        ending += ", cut at the task's max_turns"
    lines = [f"--- {title}: seed {episode.seed}, group {episode.group}, reward {episode.reward:.3f}, "
             f"{episode.turns} turns, {len(episode.tokens)} tokens"]
    for turn, observation in enumerate(episode.observations):
        lines.append(f"observation {turn}:\n{indent(observation or '(empty)', '    ')}")
        if turn < len(actions):
            reward = f"   reward {rewards[turn]:.3f}" if turn < len(rewards) else ""
            lines.append(f"action {turn + 1}: {actions[turn]!r}{reward}")
    for turn in range(len(episode.observations), len(actions)):  # an action the task never answered
        lines.append(f"action {turn + 1}: {actions[turn]!r}   (not stepped)")
    lines.append(f"ended: {ending}")
    return "\n".join(lines)


def pick(groups: list[list[Episode]], n: int) -> list[Episode]:
    """``n`` episodes: the first member of each group, then the second of each, and so on."""
    picked: list[Episode] = []
    depth = max((len(g) for g in groups), default=0)
    for member in range(depth):
        for group in groups:
            if len(picked) == n:
                return picked
            if member < len(group):
                picked.append(group[member])
    return picked


class SampleLog:
    """Appends ``n`` episodes of each iteration to ``<run_dir>/samples.txt``."""

    def __init__(self, run_dir: str | Path, n: int, tokenizer: Tokenizer) -> None:
        self.path = Path(run_dir) / SAMPLES_FILE
        self.n = n
        self.tokenizer = tokenizer

    def write(self, iteration: int, group_refs: list[ray.ObjectRef], version: int) -> None:
        """Fetch just enough of the batch's groups (references to lists of episodes) and append them."""
        groups: list[list[Episode]] = []
        for ref in group_refs[: self.n]:  # the first member of each of the first n groups suffices
            groups.append(ray.get(ref))
        episodes = pick(groups, self.n)
        text = [f"=== iteration {iteration} (weights v{version}): {len(episodes)} of its episodes ==="]
        text += [format_episode(e, self.tokenizer, f"episode {i + 1}") for i, e in enumerate(episodes)]
        with self.path.open("a") as f:
            f.write("\n".join(text) + "\n\n")
