"""GuessNumber: find a hidden number with higher/lower answers from a program in the sandbox.

The default task. ``reset(seed)`` runs ``guess.sh new SEED`` in the sandbox: the program derives the
hidden number from the seed (an LCG in shell arithmetic) and stores it in the sandbox; the trainer never
sees it. Each action is a guess (the first run of digits in the action text); the program answers
``higher LOW-HIGH``, ``lower LOW-HIGH`` (the numbers that every answer so far still allows, tracked by
the program in the sandbox; ``show_range=False`` keeps only the word) or ``correct``. An action
without a number is answered ``invalid`` and costs the turn (and ``invalid_penalty`` of reward).
Optionally (``ruled_out_penalty``), a guess that the sandbox's earlier answers already ruled out costs
reward too: this shaping rewards reading the observations and lets a small policy leave the "fixed
list of guesses" plateau sooner.

Why the agent must read the sandbox: with ``num_values = 6`` and ``max_turns = 3`` (the defaults), a
policy that ignores the observations plays a fixed list of at most 3 distinct guesses, so it wins on
at most 3 of the 6 equally likely numbers: **success ≤ max_turns / num_values = 0.5**. Binary search on
the answers always wins (3 answers single out one of up to 2³ - 1 = 7 values). ``num_values = 8``
with ``max_turns = 4`` keeps the same 0.5 bound and needs one more decision. The short action format
(one digit and the end-of-turn token) keeps the byte-level policy's actions at two tokens.
"""

from __future__ import annotations

import re

from agentenv.tasks.base import Outcome, SandboxTask

GAME_SCRIPT = r"""#!/bin/sh
# guess.sh new SEED N  -> picks the hidden number from SEED in 0..N-1, prints the rules
# guess.sh G           -> compares guess G with the hidden number: "higher LOW-HIGH", "lower LOW-HIGH"
#                         (LOW-HIGH: the numbers all answers so far still allow), "correct" or "invalid"
state=/workspace/.guess_state
if [ "$1" = new ]; then
  x=$(( ($2 * 1103515245 + 12345) % 2147483648 ))
  x=$(( (x * 1103515245 + 12345) % 2147483648 ))
  x=$(( (x * 1103515245 + 12345) % 2147483648 ))
  echo "$(( (x / 65536) % $3 )) 0 $(( $3 - 1 ))" > "$state"
  echo "guess 0-$(( $3 - 1 ))"
  exit 0
fi
read -r secret low high < "$state"
case "$1" in
  ''|*[!0-9]*) echo invalid; exit 0 ;;
esac
if [ "$1" -lt "$secret" ]; then
  [ "$1" -ge "$low" ] && low=$(( $1 + 1 ))
  echo "$secret $low $high" > "$state"
  echo "higher $low-$high"
elif [ "$1" -gt "$secret" ]; then
  [ "$1" -le "$high" ] && high=$(( $1 - 1 ))
  echo "$secret $low $high" > "$state"
  echo "lower $low-$high"
else
  echo correct
fi
"""

_NUMBER = re.compile(r"\d+")


class GuessNumber(SandboxTask):
    """Guess a number in ``0..num_values-1`` in at most ``max_turns`` guesses (see the module docstring)."""
    in_place_reset = (
        "an action reaches the sandbox only as `guess.sh N`, N a run of digits (or `x`), and guess.sh writes "
        "only its state file, which setup rewrites: no episode can leave a file, a process or a variable"
    )

    def __init__(self, num_values: int = 6, max_turns: int = 3, invalid_penalty: float = 0.1,
                 ruled_out_penalty: float = 0.0, show_range: bool = True, **kwargs):
        if not 2 <= num_values <= 1000:
            raise ValueError(f"num_values must be in 2..1000, got {num_values}")
        super().__init__(max_turns=max_turns, **kwargs)
        self.num_values = num_values
        self.invalid_penalty = invalid_penalty
        self.ruled_out_penalty = ruled_out_penalty
        self.show_range = show_range
        self._low, self._high = 0, num_values - 1  # what the sandbox's answers still allow

    def install(self) -> None:
        self.sandbox.write_file("/workspace/guess.sh", GAME_SCRIPT, mode=0o755)

    def setup(self, seed: int) -> str:
        self._low, self._high = 0, self.num_values - 1
        result = self.run(f"/workspace/guess.sh new {seed % 2**31} {self.num_values}")
        if result.exit_code != 0:
            raise RuntimeError(f"guess.sh failed to start a game: {result.output.strip()!r}")
        return result.output.strip()

    def act(self, action: str) -> Outcome:
        match = _NUMBER.search(action)
        guess = str(int(match.group(0)[:6])) if match else "x"  # "08" is 8 (sh arithmetic reads it as octal)
        reply = self.run(f"/workspace/guess.sh {guess}").output.strip()
        word = reply.split(" ")[0]
        if word not in ("higher", "lower", "correct", "invalid"):
            raise RuntimeError(f"guess.sh answered {reply!r}; the game program in the sandbox is broken")
        if not self.show_range:
            reply = word
        ruled_out = word != "invalid" and not self._low <= int(guess) <= self._high
        if word == "higher":
            self._low = max(self._low, int(guess) + 1)
        elif word == "lower":
            self._high = min(self._high, int(guess) - 1)
        info = {"valid": word != "invalid", "ruled_out": ruled_out}
        return Outcome(observation=reply, success=word == "correct", info=info)

    def reward(self, outcome: Outcome) -> float:
        """1 for the winning guess; penalties for a non-number and for a guess earlier answers ruled out."""
        if outcome.success:
            return 1.0
        if not outcome.info["valid"]:
            return -self.invalid_penalty
        return -self.ruled_out_penalty if outcome.info["ruled_out"] else 0.0
