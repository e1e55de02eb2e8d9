"""`agentenv tasks new NAME`: a new task's module, its training config and its test, from a template.

Writes ``NAME.py``, ``conf/env/NAME.yaml`` and ``test_NAME.py`` (each refused if it exists), so that a new
task starts from one that already passes the checker and trains, with every part a real task has.

Design: docs/design/sandboxes.md#agentenv-scaffold.
"""

from __future__ import annotations

import importlib.util
import keyword
import re
from pathlib import Path
from string import Template

from agentenv.errors import ConfigError

_NAME = re.compile(r"^[a-z][a-z0-9_]*$")

MODULE = Template('''"""${Name}: a k3rl task (written by `agentenv tasks new ${name}`: edit it to your game).

The sandbox holds a digit; the first observation asks for it. An action starting with `?` runs the task's
program in the sandbox, which reveals the digit; one starting with a digit answers. The reward is 1 for
the right digit and -invalid_penalty for any other action. See docs/tasks.md, "Writing a task".
"""

from __future__ import annotations

import random
import re

import gymnasium

from agentenv.tasks import Outcome, SandboxTask

PROGRAM = "#!/bin/sh\\necho \\"the digit is $$(cat /workspace/${name}/digit)\\"\\n"


class ${Name}(SandboxTask):
    """Find the digit the sandbox holds (see the module docstring)."""

    # setup rewrites the only file an episode reads, and an action reaches the sandbox only as the fixed
    # command `peek.sh`, which writes nothing: no episode can leave anything for the next one
    in_place_reset = "setup rewrites the digit file and actions only run peek.sh, which writes nothing"

    def __init__(self, num_digits: int = 10, invalid_penalty: float = 0.1, max_turns: int = 3, **kwargs):
        # the task's own options come first; every other one (sandbox, session, ...) goes on to SandboxTask
        if not 2 <= num_digits <= 10:
            raise ValueError(f"num_digits must be in 2..10, got {num_digits}")
        super().__init__(max_turns=max_turns, **kwargs)
        self.num_digits = num_digits
        self.invalid_penalty = invalid_penalty

    def install(self) -> None:
        """Once per sandbox: the task's program (files go under /workspace or /tmp; the rest is read-only)."""
        self.sandbox.write_file("/workspace/${name}/peek.sh", PROGRAM, mode=0o755)

    def setup(self, seed: int) -> str:
        """A new episode: its state (the digit) lives in the sandbox; return the first observation."""
        digit = random.Random(seed).randrange(self.num_digits)
        result = self.run(f"echo {digit} > /workspace/${name}/digit")
        if result.exit_code != 0:
            raise RuntimeError(f"could not write the digit: {result.output!r}")
        return f"digit 0-{self.num_digits - 1}? (? = look)"

    def act(self, action: str) -> Outcome:
        action = action.strip()[:1]  # the first character decides
        looked, answered = action == "?", action.isdigit()
        # numbers in info become training metrics (${Name}/looked: the share of steps that looked)
        info = {"looked": looked, "invalid": not (looked or answered)}
        if looked:
            return Outcome(self.run("/workspace/${name}/peek.sh").output.strip(), info=info)
        if answered:
            success = action == self.run("cat /workspace/${name}/digit").output.strip()
            return Outcome("right" if success else "wrong", done=True, success=success, info=info)
        return Outcome("type ? or a digit", info=info)

    def reward(self, outcome: Outcome) -> float:
        if outcome.success:
            return 1.0
        return -self.invalid_penalty if outcome.info["invalid"] else 0.0


def expert(observation: str) -> str:
    """The task's scripted expert (conf/env/${name}.yaml, `expert:`): look first, then answer."""
    found = re.search(r"the digit is (\\d)", observation)
    return found.group(1) if found else "?"


gymnasium.register("user/${Name}-v0", entry_point=${Name})
''')

CONFIG = Template('''# The training config of the ${name} task: `python -m rl.train env=${name}` from the
# folder above conf/ (the trainer reads ./conf after its own configs). Keys: rl/config/schema.py.
id: ${name}:user/${Name}-v0    # "module:id": the trainer imports ${name}, which registers the env
group_start: seed           # setup is deterministic given the seed: a GRPO group resets G envs alike
max_new_tokens: 2           # an action: one character and the end-of-turn token
action_vocabulary: "?0123456789"  # the policy types only these characters (null: any byte)
max_episode_tokens: 128     # an episode longer than this is cut (metric episodes_cut_by_tokens)
wrappers: []
expert: ${name}:expert      # its scripted expert, for demonstrations (python -m rl.sft.demonstrations)
kwargs:                     # the task's options (its __init__ and SandboxTask's)
  num_digits: 10
  invalid_penalty: 0.1
  max_turns: 3
''')

TEST = Template('''"""Tests of the ${name} task in real sandboxes (`python -m pytest test_${name}.py`)."""

from pathlib import Path

import gymnasium
import yaml

import ${name}
from agentenv.tasks.check import check_task

CONFIG = yaml.safe_load((Path(__file__).parent / "conf" / "env" / "${name}.yaml").read_text())


def test_the_task_passes_gymnasiums_env_checker():
    check_task(CONFIG["id"], CONFIG["kwargs"], action="?")  # raises, naming your line, when a check fails


def test_the_expert_wins_an_episode():
    env = gymnasium.make(CONFIG["id"], **CONFIG["kwargs"])
    try:
        observation, _ = env.reset(seed=3)
        for _ in range(CONFIG["kwargs"]["max_turns"]):
            observation, reward, terminated, truncated, info = env.step(${name}.expert(observation))
            if terminated or truncated:
                break
        assert info["success"] and reward > 0, observation
    finally:
        env.close()  # closes its sandbox
''')


def check_name(name: str) -> None:
    """A task name is a new lower-case Python module name (it becomes ``NAME.py`` and ``env=NAME``)."""
    if not _NAME.match(name) or keyword.iskeyword(name):
        raise ConfigError(f"task name {name!r}: use lower-case letters, digits and _ (a Python module name, "
                          "e.g. word_hunt)")
    if importlib.util.find_spec(name) is not None:
        raise ConfigError(f"task name {name!r}: a module of that name is importable already "
                          f"({importlib.util.find_spec(name).origin}); pick another name")


def class_name(name: str) -> str:
    """``word_hunt`` -> ``WordHunt``."""
    return "".join(part.capitalize() for part in name.split("_") if part)


def files(name: str) -> dict[str, str]:
    """Relative path -> text of the files `new_task` writes."""
    values = {"name": name, "Name": class_name(name)}
    return {f"{name}.py": MODULE.substitute(values), f"conf/env/{name}.yaml": CONFIG.substitute(values),
            f"test_{name}.py": TEST.substitute(values)}


def new_task(name: str, folder: str | Path = ".", force: bool = False) -> list[Path]:
    """Write the task ``name``'s files into ``folder`` (see the module docstring); returns their paths."""
    check_name(name)
    folder = Path(folder)
    written = {folder / rel: text for rel, text in files(name).items()}
    existing = [str(p) for p in written if p.exists()]
    if existing and not force:
        raise ConfigError(f"{', '.join(existing)} exist(s) already; pick another name or pass --force")
    for path, text in written.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return list(written)
