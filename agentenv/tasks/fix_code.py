"""FixCode: edit a small Python module in the sandbox until its unit tests pass.

Meant for larger or pretrained policies (the tiny byte-level policy will not learn it from scratch).
Each seed picks one buggy module from :data:`PROBLEMS` and writes it, with its tests, under
``/workspace/fix``. Actions are shell commands run there (e.g. ``sed -i 's/a - b/a + b/' mod.py``,
``cat mod.py``); ``submit`` ends the episode. The reward, given when the episode ends (``submit`` or
the last turn), is the **fraction of unit tests that pass** when ``python3 run_tests.py`` runs in the
sandbox.
"""

from __future__ import annotations

import random
import shlex

from agentenv.tasks.base import Outcome, SandboxTask

# (module source with one bug, test bodies); each test is an expression that must be true.
PROBLEMS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "def add(a, b):\n    return a - b\n",
        ("add(1, 2) == 3", "add(0, 0) == 0", "add(-1, 1) == 0", "add(2, 2) == 4"),
    ),
    (
        "def is_even(n):\n    return n % 2 == 1\n",
        ("is_even(2)", "not is_even(3)", "is_even(0)", "not is_even(7)"),
    ),
    (
        "def biggest(xs):\n    return min(xs)\n",
        ("biggest([1, 5, 2]) == 5", "biggest([3]) == 3", "biggest([-1, -4]) == -1"),
    ),
    (
        "def reverse(s):\n    return s\n",
        ("reverse('ab') == 'ba'", "reverse('') == ''", "reverse('x') == 'x'", "reverse('abc') == 'cba'"),
    ),
)

RUNNER = """import importlib, sys
sys.path.insert(0, ".")
TESTS = {tests!r}
passed = 0
for expr in TESTS:
    try:
        mod = importlib.import_module("mod")
        if eval(expr, vars(mod)):
            passed += 1
    except Exception:
        pass
print(f"passed {{passed}} of {{len(TESTS)}}")
"""


def problem_index(seed: int) -> int:
    """Which of :data:`PROBLEMS` an episode with this seed gets."""
    return random.Random(seed).randrange(len(PROBLEMS))


class FixCode(SandboxTask):
    """Make ``mod.py``'s unit tests pass (see the module docstring)."""

    def __init__(self, max_turns: int = 6, max_output_chars: int = 512, **kwargs):
        super().__init__(max_turns=max_turns, **kwargs)
        self.max_output_chars = max_output_chars

    def setup(self, seed: int) -> str:
        source, tests = PROBLEMS[problem_index(seed)]
        runner = RUNNER.format(tests=tests)
        result = self.run(
            "rm -rf /workspace/fix && mkdir -p /workspace/fix && cd /workspace/fix"
            f" && printf %s {shlex.quote(source)} > mod.py && printf %s {shlex.quote(runner)} > run_tests.py"
        )
        if result.exit_code != 0:
            raise RuntimeError(f"could not write the problem: {result.output.strip()!r}")
        return "Fix /workspace/fix/mod.py so that run_tests.py passes. Run shell commands; end with: submit"

    def score(self) -> tuple[int, int]:
        """(passed, total) from running the tests in the sandbox."""
        out = self.run("cd /workspace/fix && timeout 10 python3 run_tests.py").output.split()
        if len(out) >= 4 and out[0] == "passed":
            return int(out[1]), int(out[3])
        return 0, 1

    def act(self, action: str) -> Outcome:
        action = action.strip()
        last_turn = self.turn >= self.max_turns
        if action == "submit" or last_turn:
            observation = ""
            if action != "submit":
                observation = self._shell(action)
            passed, total = self.score()
            return Outcome(
                f"{observation}passed {passed} of {total}",
                done=True,
                success=passed == total,
                info={"passed_fraction": passed / total},
            )
        return Outcome(self._shell(action))

    def _shell(self, action: str) -> str:
        return self.run_agent_command(action, "/workspace/fix", 5, self.max_output_chars)

    def reward(self, outcome: Outcome) -> float:
        return float(outcome.info.get("passed_fraction", 0.0))
