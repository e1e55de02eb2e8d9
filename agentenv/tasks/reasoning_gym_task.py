"""ReasoningGym: the procedural reasoning datasets of the ``reasoning-gym`` package as agent tasks.

``agentenv/ReasoningGym-v0`` serves one reasoning-gym dataset (``dataset``, a name such as
``basic_arithmetic``, ``leg_counting`` or ``spell_backward``, built with ``dataset_kwargs``, e.g.
``{seed: 0, size: 100000, min_terms: 2}``). ``reset(seed)`` poses problem ``seed % size`` of the
dataset (so an episode is determined by its seed: ``group_start: seed`` is exact); the observation is
the problem's question. Each action is an answer, scored by the dataset's own ``score_answer`` (1 for
a right answer, 0 for a wrong one, partial credit where the dataset gives it).

``max_turns: 1`` is a single-turn task: the first answer ends the episode. With ``max_turns > 1`` a
wrong answer is answered with the scorer's verdict (``wrong answer (score 0.00); 2 tries left``) and
the agent tries again; a right answer ends the episode early. Running out of tries is the end of the
task by its rules, so the episode is ``terminated`` (not ``truncated``), as after a single answer.
The reward of an episode is the score of its last answer (earlier, wrong answers earn 0), so returns
stay in ``[0, 1]`` whatever ``max_turns``.
With ``answer_tag: answer`` the answer is read from the last ``<answer>...</answer>`` of the action
(reasoning-gym's convention for policies that think before answering); without it, the whole action
(stripped of surrounding whitespace) is the answer.

**No sandbox.** The problems are generated and scored in this Python process: there is no program to
run and no state outside the task, so a container would only add start-up time and memory. The task is
still a `SandboxTask` (what the trainer's rollout expects) whose sandbox hooks do nothing: it never
creates, pauses or forks a container, and ``fork`` copies the env in its episode state (the problem and
the turn), which is all a GRPO group member needs.

Observations keep the dataset's text as it is, Unicode included (logic symbols, box drawing, emoji):
the observation and action spaces are `UnicodeText` spaces. A question longer than
``max_observation_chars`` is refused with an error naming that option, never cut.
"""

from __future__ import annotations

import copy
import difflib
import string
from typing import Any

from gymnasium.spaces import Text

from agentenv.tasks.base import Outcome, SandboxTask


class UnicodeText(Text):
    """A `Text` space of any Unicode string of bounded length.

    gymnasium's `Text` needs a finite character set; reasoning-gym's questions use arbitrary Unicode.
    Membership accepts every character; ``sample()`` draws from printable ASCII.
    """

    def __init__(self, max_length: int, min_length: int = 0) -> None:
        super().__init__(max_length=max_length, min_length=min_length, charset=string.printable)

    def contains(self, x: Any) -> bool:
        return isinstance(x, str) and self.min_length <= len(x) <= self.max_length

    def __repr__(self) -> str:
        return f"UnicodeText({self.min_length}, {self.max_length})"


def load_dataset(name: str, dataset_kwargs: dict[str, Any]):
    """The reasoning-gym dataset ``name`` built with ``dataset_kwargs``; clear errors for bad input."""
    try:
        import reasoning_gym
        from reasoning_gym.factory import DATASETS
    except ImportError as exc:  # pragma: no cover - reasoning-gym is a dependency of k3rl
        raise RuntimeError("agentenv/ReasoningGym-v0 needs the `reasoning-gym` package") from exc
    if name not in DATASETS:
        close = difflib.get_close_matches(str(name), DATASETS, n=3)
        hint = f"; did you mean {close}?" if close else f"; known datasets: {sorted(DATASETS)}"
        raise ValueError(f"dataset={name!r} is not a reasoning-gym dataset{hint}")
    try:
        return reasoning_gym.create_dataset(name, **dataset_kwargs)
    except (TypeError, ValueError, AssertionError) as exc:
        raise ValueError(
            f"reasoning-gym dataset {name!r} refused dataset_kwargs={dataset_kwargs}: {exc}"
        ) from None


class ReasoningGym(SandboxTask):
    """One reasoning-gym dataset as a single- or multi-turn task (see the module docstring).

    ``dataset``: the reasoning-gym dataset name; ``dataset_kwargs``: its config (``seed`` and ``size``
    fix which problems exist; a missing ``seed`` is taken as 0 so that problems never depend on the
    process); ``max_turns``: tries per problem; ``answer_tag``: read the answer from
    ``<answer_tag>...</answer_tag>`` (None: the whole action). Other keyword arguments are
    `SandboxTask`'s (``sandbox``, ``session`` and ``sandboxes`` are accepted and unused).
    """

    in_place_reset = "no sandbox: an episode's state is its problem and turn, both set by setup"

    def __init__(
        self,
        dataset: str = "basic_arithmetic",
        dataset_kwargs: dict[str, Any] | None = None,
        max_turns: int = 1,
        answer_tag: str | None = None,
        max_observation_chars: int = 4096,
        max_action_chars: int = 1024,
        **kwargs,
    ) -> None:
        super().__init__(
            max_turns=max_turns,
            max_observation_chars=max_observation_chars,
            max_action_chars=max_action_chars,
            **kwargs,
        )
        self.observation_space = UnicodeText(max_observation_chars)
        self.action_space = UnicodeText(max_action_chars)
        self.dataset_name = dataset
        self.dataset_kwargs = {"seed": 0, **dict(dataset_kwargs or {})}
        self.dataset = load_dataset(dataset, self.dataset_kwargs)
        self.answer_tag = answer_tag
        self.problem_index: int | None = None
        self._entry: dict[str, Any] = {}

    # ----------------------------------------------------------------- the task
    def setup(self, seed: int) -> str:
        self.problem_index = seed % len(self.dataset)
        self._entry = self.dataset[self.problem_index]
        return str(self._entry["question"])

    def answer_of(self, action: str) -> str | None:
        """The answer an action gives (None when ``answer_tag`` is set and the action has no such tag)."""
        if self.answer_tag is None:
            return action.strip()
        from reasoning_gym.utils import extract_answer

        return extract_answer(action, tag_name=self.answer_tag)

    def act(self, action: str) -> Outcome:
        score = float(self.dataset.score_answer(self.answer_of(action), self._entry))
        success = score >= 1.0
        if success:
            observation = "correct"
        else:
            left = self.max_turns - self.turn
            observation = f"wrong answer (score {score:.2f})"
            if left > 0:
                observation += f"; {left} {'try' if left == 1 else 'tries'} left"
        done = success or self.turn >= self.max_turns  # the last try ends the task (terminated, by its rules)
        info = {"score": score, "problem": self.problem_index}
        return Outcome(observation, done=done, success=success, info=info)

    def reward(self, outcome: Outcome) -> float:
        """The score of the episode's last answer (a right one, or the last try); 0 for earlier tries."""
        return outcome.info["score"] if outcome.done else 0.0

    def clean(self, text: str) -> str:
        """Observations are the dataset's text unchanged; one that does not fit the space is an error."""
        if len(text) > self.observation_space.max_length:
            raise ValueError(
                f"a {self.dataset_name} question has {len(text)} characters, more than "
                f"max_observation_chars={self.observation_space.max_length}; raise that env.kwargs value"
            )
        return text

    # ----------------------------------------------------------------- no sandbox (see the module docstring)
    def ensure_sandbox(self) -> None:
        """Nothing to create: the task lives in this process."""

    def hold_sandbox(self) -> None:
        """Nothing to lease."""

    def pause(self) -> float:
        """Nothing to checkpoint."""
        return 0.0

    def resume(self) -> float:
        """Nothing to restore."""
        return 0.0

    def run(self, command: str, timeout: float | None = None):
        raise RuntimeError("agentenv/ReasoningGym-v0 has no sandbox to run commands in")

    def fork(self, n: int) -> list[ReasoningGym]:
        """``n`` copies of this env in its current episode state (same problem, same turn)."""
        if self.episode_seed is None:
            raise RuntimeError("reset() the env before forking it")
        forks = []
        for _ in range(n):
            clone = copy.copy(self)
            clone._np_random = copy.deepcopy(self._np_random)
            forks.append(clone)
        return forks
