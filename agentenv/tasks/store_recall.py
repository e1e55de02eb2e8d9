"""StoreRecall: store instructed digits in the sandbox, then answer a question about what was stored.

For branching rollouts (Tree-GRPO): the early turns cost turns and build state in the sandbox (one
``store.sh D`` per box; a digit other than the instruction's ends the episode); the late turns guess the
value stored now in the box the question names, answered by GuessNumber's ``guess.sh`` from that box's
file, and win only while every box holds its instruction. Actions are one digit, as in GuessNumber.
Rules, rewards and measured baselines: docs/tasks.md, "State built early, read late".
"""

from __future__ import annotations

import random
import re

from agentenv.tasks.base import Outcome, SandboxTask
from agentenv.tasks.guess_number import GAME_SCRIPT

STORE_SCRIPT = r"""#!/bin/sh
# store.sh new "V0 V1 .." Q N -> a new episode: store V0 in box 0, V1 in box 1, ..; the question asks for
#                                box Q; values 0..N-1. Prints "store V0 V1 .."
# store.sh D                  -> setup: stores digit D in the next box ("box I=D, store REST", after the
#                                last box "box I=D, find box Q: 0-M"; a digit that is not the instruction:
#                                "wrong: box I=D, store REST", the episode is over). Question: guess D at
#                                the value stored in box Q now (guess.sh's answers); "correct" only while
#                                every box holds its instruction ("wrong store: box I=X, should be V").
dir=/workspace/store
game=/workspace/.guess_state
nth() { i=0; for v in $2; do [ "$i" -eq "$1" ] && { echo "$v"; return; }; i=$((i + 1)); done; }
rest() {  # the values from the $1-th on
  i=0; out=""
  for v in $2; do [ "$i" -ge "$1" ] && out="$out $v"; i=$((i + 1)); done
  echo "${out# }"
}
if [ "$1" = new ]; then
  rm -rf "$dir" "$game" && mkdir -p "$dir/boxes" || exit 1
  echo "$2" > "$dir/plan" && echo "$3 $4" > "$dir/query" && echo 0 > "$dir/next" || exit 1
  echo "store $2"
  exit 0
fi
case "$1" in
  ''|*[!0-9]*) echo invalid; exit 0 ;;
esac
read -r plan < "$dir/plan"; read -r q n < "$dir/query"; read -r next < "$dir/next"
keys=$(set -- $plan; echo $#)
if [ "$next" -lt "$keys" ]; then
  want=$(nth "$next" "$plan")
  echo "$1" > "$dir/boxes/$next"
  if [ "$1" -ne "$want" ]; then
    echo "$keys" > "$dir/next"
    echo "wrong: box $next=$1, store $(rest "$next" "$plan")"
    exit 0
  fi
  echo $((next + 1)) > "$dir/next"
  if [ $((next + 1)) -lt "$keys" ]; then
    echo "box $next=$1, store $(rest $((next + 1)) "$plan")"
  else
    echo "- 0 $((n - 1))" > "$game"
    echo "box $next=$1, find box $q: 0-$((n - 1))"
  fi
  exit 0
fi
check() {  # every box holds its instruction, else says which does not
  i=0
  for v in $plan; do
    got=$(cat "$dir/boxes/$i" 2>/dev/null)
    [ "$got" = "$v" ] || { echo "wrong store: box $i=${got:-?}, should be $v"; return 1; }
    i=$((i + 1))
  done
}
stored=$(cat "$dir/boxes/$q" 2>/dev/null)
case "$stored" in
  ''|*[!0-9]*) check; exit 0 ;;
esac
read -r _ low high < "$game"
echo "$stored $low $high" > "$game"
reply=$(/workspace/guess.sh "$1")
if [ "$reply" = correct ]; then
  check || exit 0
fi
echo "$reply"
"""

_NUMBER = re.compile(r"\d+")
_STORE = re.compile(r"store (\d+)")
_RANGE = re.compile(r"(\d+)-(\d+)$")
_WORDS = ("store", "box", "wrong:", "wrong", "higher", "lower", "correct", "invalid")


def copy_then_bisect(observation: str) -> str:
    """The scripted expert (``env.expert``): store the next instructed value, then bisect the range the
    sandbox's answers allow. It wins every game with ``max_turns >= num_keys + ceil(log2(num_values+1))``."""
    store = _STORE.search(observation)
    if store:
        return store.group(1)
    low, high = _allowed(observation)
    return str((low + high) // 2)


def copy_then_linear(observation: str) -> str:
    """A weaker expert, for a cold start that leaves RL a strategy to find: it stores as
    `copy_then_bisect` does, then guesses the lowest value the sandbox's answers allow, so it wins only
    when the asked value is among the first ``max_turns - num_keys`` (half the games by default)."""
    store = _STORE.search(observation)
    if store:
        return store.group(1)
    return str(_allowed(observation)[0])


def _allowed(observation: str) -> tuple[int, int]:
    """The range of values the observation's last answer allows (``higher 3-5`` -> (3, 5))."""
    found = _RANGE.search(observation.strip())
    if found is None:
        raise ValueError(f"StoreRecall expert: cannot read the observation {observation!r}")
    return int(found.group(1)), int(found.group(2))


class StoreRecall(SandboxTask):
    """Store ``num_keys`` instructed digits in the sandbox, then find the value of the box asked about
    (see the module docstring).

    Task kwargs: ``num_keys`` (boxes to store, 1..9: the setup turns), ``num_values`` (values 0..N-1,
    2..10: one digit each), ``max_turns`` (setup and question together, at least ``num_keys + 1``),
    ``invalid_penalty``/``ruled_out_penalty`` (shaping, as in GuessNumber)."""

    in_place_reset = (
        "an action reaches the sandbox only as `store.sh N`, N a run of digits (or `x`), which writes only "
        "under /workspace/store and guess.sh's state file; setup removes both first: no episode can leave "
        "a file, a process or a variable"
    )

    def __init__(self, num_keys: int = 2, num_values: int = 6, max_turns: int = 5,
                 invalid_penalty: float = 0.1, ruled_out_penalty: float = 0.0, **kwargs):
        for key, value, low, high, what in (("num_keys", num_keys, 1, 9, "boxes to store"),
                                             ("num_values", num_values, 2, 10, "values 0..N-1, one digit")):
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise ValueError(f"{key} must be an integer in {low}..{high} ({what}), got {value!r}")
        if isinstance(max_turns, bool) or not isinstance(max_turns, int) or max_turns < num_keys + 1:
            raise ValueError(f"max_turns must be an integer >= num_keys + 1 = {num_keys + 1} (a turn per "
                             f"box to store and one to answer), got {max_turns!r}")
        for key, value in (("invalid_penalty", invalid_penalty), ("ruled_out_penalty", ruled_out_penalty)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"{key} must be a number >= 0, got {value!r}")
        super().__init__(max_turns=max_turns, **kwargs)
        self.num_keys, self.num_values = num_keys, num_values
        self.invalid_penalty, self.ruled_out_penalty = float(invalid_penalty), float(ruled_out_penalty)
        # the episode's instructions and question (tuples and ints only: `fork` copies the env shallowly)
        self.plan: tuple[int, ...] = ()
        self.query = 0
        self.stored = 0  # boxes stored as instructed so far
        self._low, self._high = 0, num_values - 1  # what the sandbox's answers to the question still allow

    def install(self) -> None:
        self.sandbox.write_file("/workspace/guess.sh", GAME_SCRIPT, mode=0o755)
        self.sandbox.write_file("/workspace/store.sh", STORE_SCRIPT, mode=0o755)

    def setup(self, seed: int) -> str:
        rng = random.Random(seed)
        self.plan = tuple(rng.randrange(self.num_values) for _ in range(self.num_keys))
        self.query = rng.randrange(self.num_keys)
        self.stored = 0
        self._low, self._high = 0, self.num_values - 1
        plan = " ".join(map(str, self.plan))
        result = self.run(f"/workspace/store.sh new '{plan}' {self.query} {self.num_values}")
        if result.exit_code != 0 or result.output.strip() != f"store {plan}":
            raise RuntimeError(f"store.sh failed to start an episode: {result.output.strip()!r}")
        return result.output.strip()

    def act(self, action: str) -> Outcome:
        match = _NUMBER.search(action)
        digit = str(int(match.group(0)[:6])) if match else "x"  # "08" is 8 (sh reads it as octal)
        asking = self.stored == self.num_keys  # the setup is done: this action answers the question
        reply = self.run(f"/workspace/store.sh {digit}").output.strip()
        word = reply.split(" ")[0]
        if word not in _WORDS:
            raise RuntimeError(f"store.sh answered {reply!r}; the program in the sandbox is broken")
        valid = word != "invalid"
        ruled_out = False
        if word == "box":
            self.stored += 1
        elif asking and word in ("higher", "lower"):
            ruled_out = not self._low <= int(digit) <= self._high
            if word == "higher":
                self._low = max(self._low, int(digit) + 1)
            else:
                self._high = min(self._high, int(digit) - 1)
        done = word in ("wrong:", "wrong")
        info = {"valid": valid, "ruled_out": ruled_out, "stored": self.stored}
        return Outcome(observation=reply, done=done, success=word == "correct", info=info)

    def reward(self, outcome: Outcome) -> float:
        """1 for the right answer after the right setup; penalties for a non-number and for a guess the
        sandbox's earlier answers ruled out; 0 otherwise (a wrong store ends the episode)."""
        if outcome.success:
            return 1.0
        if not outcome.info["valid"]:
            return 0.0 - self.invalid_penalty  # 0.0 - x: no -0.0 when a penalty is off
        return 0.0 - self.ruled_out_penalty if outcome.info["ruled_out"] else 0.0
