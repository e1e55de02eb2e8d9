"""FindValue: a shell task. A value is hidden in one file of a generated directory tree; find it with
``ls``/``cat``/``grep``-like commands and submit it.

Actions: ``submit VALUE`` ends the episode (reward 1 when VALUE is the hidden one); any other action is
run as a shell command in ``/workspace/tree`` (5 s timeout) and its output, cut to ``max_output_chars``,
is the observation. The tree (directory names, decoy files, the file holding the value and the value
itself) is generated from the seed, so episodes are reproducible; the value exists only in the sandbox.
"""

from __future__ import annotations

import random
import shlex

from agentenv.tasks.base import Outcome, SandboxTask

WORDS = ("alpha", "beta", "gamma", "delta", "omega", "notes", "logs", "data", "tmp", "src", "docs", "etc")


def build_tree(seed: int, num_dirs: int = 3, files_per_dir: int = 3) -> tuple[dict[str, str], str]:
    """The files of one episode (relative path -> content) and the hidden value, from ``seed``."""
    rng = random.Random(seed)
    dirs = rng.sample(WORDS, num_dirs)
    value = f"{rng.randrange(10**5, 10**6)}"
    files: dict[str, str] = {}
    for d in dirs:
        for j in range(files_per_dir):
            files[f"{d}/file{j}.txt"] = f"nothing here ({rng.randrange(1000)})\n"
    secret_path = rng.choice(sorted(files))
    files[secret_path] = f"value: {value}\n"
    return files, value


class FindValue(SandboxTask):
    """Find the hidden value in the sandbox's file tree and ``submit`` it (see the module docstring)."""

    def __init__(
        self,
        max_turns: int = 8,
        num_dirs: int = 3,
        files_per_dir: int = 3,
        max_output_chars: int = 512,
        **kwargs,
    ):
        super().__init__(max_turns=max_turns, **kwargs)
        self.num_dirs, self.files_per_dir = num_dirs, files_per_dir
        self.max_output_chars = max_output_chars
        self._answer = ""

    def setup(self, seed: int) -> str:
        files, self._answer = build_tree(seed, self.num_dirs, self.files_per_dir)
        script = ["rm -rf /workspace/tree"]
        for path, content in sorted(files.items()):
            full = shlex.quote(f"/workspace/tree/{path}")
            script.append(f"mkdir -p $(dirname {full}) && printf %s {shlex.quote(content)} > {full}")
        result = self.run(" && ".join(script))
        if result.exit_code != 0:
            raise RuntimeError(f"could not build the file tree: {result.output.strip()!r}")
        return "Find the value hidden under /workspace/tree. Run shell commands; answer with: submit VALUE"

    def act(self, action: str) -> Outcome:
        action = action.strip()
        if action.startswith("submit"):
            submitted = action[len("submit") :].strip()
            success = submitted == self._answer
            return Outcome("correct" if success else "wrong", done=True, success=success)
        return Outcome(self.run_agent_command(action, "/workspace/tree", 5, self.max_output_chars))
