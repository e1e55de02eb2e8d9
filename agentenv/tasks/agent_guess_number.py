"""The GuessNumber game for an agent program (``env=agent_guess_number``, `agentenv.tasks.agent_program`).

The sandbox holds GuessNumber's own game (``guess.sh``, `agentenv.tasks.guess_number.GAME_SCRIPT`) and
``play.sh``, which plays one guess and appends ``GUESS ANSWER`` to ``/workspace/.plays``. The agent
program (`agentenv.tasks.programs.guess_agent`) plays through ``play.sh``; the verifier `verify` scores the
logged plays exactly as `agentenv.tasks.guess_number.GuessNumber` rewards its steps: 1 for the winning
guess, ``-invalid_penalty`` for a non-number, ``-ruled_out_penalty`` for a guess the earlier answers
already ruled out, 0 otherwise; summed over the plays.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from agentenv.api import SandboxHandle

PLAYS = "/workspace/.plays"
PLAY_SCRIPT = f"""#!/bin/sh
# play.sh GUESS -> the game's answer to GUESS (guess.sh), logged as "GUESS ANSWER" in {PLAYS}
answer=$(/workspace/guess.sh "$1")
printf '%s %s\\n' "$1" "$answer" >> {PLAYS}
printf '%s\\n' "$answer"
"""


def score(plays: list[tuple[str, str]], num_values: int, invalid_penalty: float,
          ruled_out_penalty: float) -> dict[str, float]:
    """GuessNumber's summed reward of ``plays`` ((guess, guess.sh's answer) in order), and the facts."""
    low, high = 0, num_values - 1
    reward, success, invalid = 0.0, False, 0
    for guess, answer in plays:
        word = answer.split(" ")[0]
        if word not in ("higher", "lower", "correct", "invalid"):
            raise RuntimeError(f"guess.sh answered {answer!r} to {guess!r}; the sandbox's game is broken")
        if word == "invalid":
            reward -= invalid_penalty
            invalid += 1
            continue
        if word == "correct":
            reward += 1.0
            success = True
        elif not low <= int(guess) <= high:
            reward -= ruled_out_penalty
        if word == "higher":
            low = max(low, int(guess) + 1)
        elif word == "lower":
            high = min(high, int(guess) - 1)
    return {"reward": reward, "success": float(success), "plays": float(len(plays)),
            "invalid": float(invalid)}


def verify(sandbox: SandboxHandle, seed: int, num_values: int = 6, invalid_penalty: float = 0.1,
           ruled_out_penalty: float = 0.0) -> dict[str, float]:
    """The episode's verdict from the sandbox's log of plays (see the module docstring)."""
    listed = sandbox.exec(["sh", "-c", f"cat {PLAYS} 2>/dev/null || true"], timeout=30)
    plays = [tuple(line.split(" ", 1)) for line in listed.stdout.splitlines() if " " in line]
    return score(plays, num_values, invalid_penalty, ruled_out_penalty)
