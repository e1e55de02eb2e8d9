"""Scripted experts: hand-written policies for the built-in tasks, used to write demonstration episodes.

An expert plays through ``env.step(action)`` as a policy does and never reads the task's hidden state; its
``quality`` knob writes demonstrations of different skill. Get one with :func:`expert_for`; a task names
its expert in ``env.expert``.

Design: docs/design/training.md#rl-experts.
"""

from __future__ import annotations

import random
import re
import shlex
from collections.abc import Callable

# ---------------------------------------------------------------------------------------------- base


class Expert:
    """A scripted policy over observation texts. Subclasses write `start` and `act`."""

    quality: str = ""

    def __init__(self, quality: str, seed: int = 0) -> None:
        self.quality = quality
        self.rng = random.Random(seed)  # the only randomness an expert may use (reproducible demos)

    def start(self, observation: str) -> None:
        """Begin an episode from its first observation."""
        raise NotImplementedError

    def act(self, observation: str) -> str:
        """The next action, given the latest observation (the first one on the first turn)."""
        raise NotImplementedError


class ExpertError(ValueError):
    """An expert was asked for with an unknown task or quality, or saw an observation it cannot read."""


# --------------------------------------------------------------------------------------- GuessNumber

_RANGE = re.compile(r"(\d+)-(\d+)")


class GuessNumberExpert(Expert):
    """Keeps the range of numbers that the answers still allow and guesses inside it.

    ``bisection`` guesses the middle (optimal: k answers single out one of 2^k - 1 numbers), ``linear``
    the lowest allowed number (wins only when the number is among the first ``max_turns``),
    ``random_split`` a uniformly random allowed number. The range is read from the first observation
    (``guess 0-5``) and narrowed with the expert's own guesses and the ``higher``/``lower`` answers,
    so it also plays ``show_range=false`` games, whose answers are a bare word.
    """

    QUALITIES = ("bisection", "linear", "random_split")

    def start(self, observation: str) -> None:
        match = _RANGE.search(observation)
        if match is None:
            raise ExpertError(
                f"GuessNumber expert: no 'LOW-HIGH' range in the first observation {observation!r}"
            )
        self.low, self.high = int(match.group(1)), int(match.group(2))
        self.last_guess: int | None = None

    def act(self, observation: str) -> str:
        if self.last_guess is not None:
            word = observation.split(" ")[0]
            if word == "higher":
                self.low = max(self.low, self.last_guess + 1)
            elif word == "lower":
                self.high = min(self.high, self.last_guess - 1)
        low, high = self.low, max(self.low, self.high)
        if self.quality == "bisection":
            guess = (low + high) // 2
        elif self.quality == "linear":
            guess = low
        else:  # random_split
            guess = self.rng.randint(low, high)
        self.last_guess = guess
        return str(guess)


# ----------------------------------------------------------------------------------------- FindValue

_VALUE = re.compile(r"value: (\S+)")


class FindValueExpert(Expert):
    """Finds the ``value: N`` line in the file tree and submits N.

    ``grep`` searches the whole tree with one ``grep -r`` (2 turns); ``wasteful`` lists the top folder,
    then each folder, and ``cat``-s its files one by one until a file holds the value, so it runs out of
    turns when the value sits in a late file.
    """

    QUALITIES = ("grep", "wasteful")

    def start(self, observation: str) -> None:
        self.plan: list[str] = []  # commands still to run (wasteful)
        self.last: str | None = None  # the last command, whose output the next observation is

    def act(self, observation: str) -> str:
        found = _VALUE.search(observation) if self.last is not None else None
        if found is not None:
            return f"submit {found.group(1)}"
        if self.quality == "grep":
            self.last = "grep -r 'value:' ."
            return self.last
        if self.last is None:
            self.last = "ls"
            return self.last
        if observation != "(no output)":
            if self.last == "ls":  # the top-level folders: list each of them
                self.plan = [f"ls {shlex.quote(name)}" for name in observation.split()]
            elif self.last.startswith("ls "):  # one folder's files: cat them before the next folder
                folder = shlex.split(self.last)[1]
                self.plan[:0] = [f"cat {shlex.quote(f'{folder}/{name}')}" for name in observation.split()]
        if not self.plan:
            return "submit unknown"  # looked everywhere without finding it
        self.last = self.plan.pop(0)
        return self.last


# ------------------------------------------------------------------------------------------- FixCode

# The bugs an expert recognises in a module's source, and their fixes: (buggy line, full fix, partial
# fix). A partial fix is the kind a hasty developer makes: it passes some tests, not all.
KNOWN_BUGS: tuple[tuple[str, str, str], ...] = (
    ("return a - b", "return a + b", "return a * 2"),
    ("return n % 2 == 1", "return n % 2 == 0", "return n % 4 == 0"),
    ("return min(xs)", "return max(xs)", "return xs[0]"),
    ("return s", "return s[::-1]", "return s[-1:] + s[:-1]"),
)


def _sed_escape(text: str, replacement: bool) -> str:
    """``text`` quoted for one side of a ``sed s/PATTERN/REPLACEMENT/`` command (basic regex)."""
    special = "\\/&" if replacement else "\\/.*[]^$"
    return "".join(f"\\{c}" if c in special else c for c in text)


class FixCodeExpert(Expert):
    """Reads ``mod.py``, replaces the line it recognises as the bug, runs the tests, and submits.

    ``fix`` applies the known fix (all tests pass); ``partial_fix`` applies a plausible one that passes
    only some tests. A module with no known bug is submitted unchanged.
    """

    QUALITIES = ("fix", "partial_fix")

    def start(self, observation: str) -> None:
        self.step_index = 0

    def act(self, observation: str) -> str:
        self.step_index += 1
        if self.step_index == 1:
            return "cat mod.py"
        if self.step_index == 2:
            edit = self._edit(observation)
            if edit is not None:
                return edit
            return "submit"
        if self.step_index == 3:
            return "python3 run_tests.py"
        return "submit"

    def _edit(self, source: str) -> str | None:
        lines = [line.strip() for line in source.splitlines()]
        for buggy, fix, partial in KNOWN_BUGS:
            if buggy in lines:
                new = fix if self.quality == "fix" else partial
                script = f"s/{_sed_escape(buggy, False)}$/{_sed_escape(new, True)}/"
                return f"sed -i {shlex.quote(script)} mod.py"
        return None


# ---------------------------------------------------------------------------------- pluggable experts


class FunctionExpert(Expert):
    """A plain function ``observation text -> action text`` as an expert of one quality, its name."""

    def __init__(self, act: Callable[[str], str], quality: str, seed: int = 0) -> None:
        super().__init__(quality, seed)
        self._act = act

    def start(self, observation: str) -> None:
        """Nothing to remember: the function reads each observation afresh."""

    def act(self, observation: str) -> str:
        return str(self._act(observation))


_OBJECT_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


def expert_spec(env_id: str) -> str:
    """The ``expert`` (``module:Name``) of the shipped task config whose ``id`` is ``env_id``
    (conf/env/*.yaml): how a caller that knows only a built-in task's id finds its expert."""
    import yaml

    from agentenv.paths import conf_dir

    bare = env_id.split(":", 1)[1] if ":" in env_id else env_id
    found = set()
    for path in sorted((conf_dir() / "env").glob("*.yaml")):
        data = yaml.safe_load(path.read_text()) or {}
        ids = {data.get("id"), str(data.get("id", "")).split(":", 1)[-1]}
        if data.get("expert") and bare in ids:
            found.add(data["expert"])
    if len(found) != 1:
        which = f"several scripted experts ({sorted(found)})" if found else "no scripted expert"
        raise ExpertError(f"{which} for task {env_id!r} in the shipped configs (conf/env/*.yaml, key "
                          "expert); name one with env.expert=module:Name")
    return found.pop()


def _resolve(spec: str) -> type[Expert] | Callable[[str], str]:
    """``module:Name`` (or a built-in task's env id, see `expert_spec`) -> the expert class or function."""
    from rl.config.imports import import_object

    if not _OBJECT_PATH.match(spec):
        spec = expert_spec(spec)
    try:
        obj = import_object(spec, "env.expert")
    except ValueError as exc:  # ConfigError: the module or the name is not there
        raise ExpertError(str(exc)) from None
    if isinstance(obj, type) and issubclass(obj, Expert):
        return obj
    if callable(obj) and not isinstance(obj, type):
        return obj
    raise ExpertError(f"env.expert: {spec!r} is neither an rl.sft.experts.Expert subclass nor a function "
                      "observation -> action")


def qualities(spec: str) -> tuple[str, ...]:
    """The qualities of an expert (``module:Name``, or a built-in task's env id), best (the default) first."""
    expert = _resolve(spec)
    if isinstance(expert, type):
        return expert.QUALITIES
    return (expert.__name__,)


def expert_for(spec: str, quality: str | None = None, seed: int = 0) -> Expert:
    """A fresh expert of the given quality (None: the best): ``spec`` is a task config's ``env.expert``
    (``module:Name``, an `Expert` subclass or a function) or a built-in task's env id.

    ``seed`` seeds the expert's own randomness (only ``random_split`` uses any)."""
    expert = _resolve(spec)
    names = qualities(spec)
    quality = quality or names[0]
    if quality not in names:
        raise ExpertError(f"expert.quality={quality!r} is unknown for {spec}; choose one of {list(names)}")
    if isinstance(expert, type):
        return expert(quality, seed)
    return FunctionExpert(expert, quality, seed)


__all__ = ["KNOWN_BUGS", "Expert", "ExpertError", "FunctionExpert", "expert_for", "expert_spec", "qualities"]
