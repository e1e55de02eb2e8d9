"""Does an agent program learn within twice `make train`'s time? Per seed, `make train`'s own run
(`python -m rl.train seed=S`: GuessNumber played turn by turn by the trainer), then the shipped agent
program on the same game (`env=agent_guess_number`: a Python program in each sandbox plays it through the
policy gateway), limited to twice the first's time to its target; both GRPO from scratch and stopped at
``trainer.stop_at_success``. Writes the ``agent-learning`` section of docs/benchmarks.md.

Usage: python bench/agent_learning.py [--seeds N] [--no-write]. Design:
docs/design/benchmarks.md#bench-agent-learning.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from bench_report import busy_cores_before, other_load_text, training_machine, write_section
from learning import run_seed, summarise

SECTION = "agent-learning"
AGENT = ("env=agent_guess_number",)
TIME_TARGET = 2.0  # the agent's time to the target, as a multiple of make train's
PARTS = ("iteration_s", "reset_s", "env_step_s", "generate_s", "learner_s")  # of an iteration's records


def per_iteration(history: list[dict]) -> dict[str, float]:
    """Median seconds of each of `PARTS` over the iterations after the first (start-up aside)."""
    rows = history[1:] or history
    return {p: statistics.median(r.get(p, 0.0) for r in rows) for p in PARTS}


def seed_row(seed: int, base: dict, agent: dict, limit_min: float) -> str:
    """A seed's line of the table."""
    b, a = per_iteration(base["history"]), per_iteration(agent["history"])
    base_s, agent_s = base["summary"], agent["summary"]
    if agent_s["reached_min"] is None:
        reached = f"not in {limit_min:.1f} min (success {agent_s['final_success']:.2f} after " \
                  f"{agent_s['iterations']} it)"
        ratio, met = "-", False
    else:
        reached = f"{agent_s['reached_min']:.1f} min (it {agent_s['reached_iteration']})"
        ratio = agent_s["reached_min"] / base_s["reached_min"]
        met = ratio <= TIME_TARGET
        ratio = f"{ratio:.2f}x"
    parts = " / ".join(f"{a[p]:.1f}" for p in PARTS[1:])
    return (f"| {seed} | {base_s['reached_min']:.1f} min (it {base_s['reached_iteration']}) | {reached} "
            f"| {ratio} | {b['iteration_s']:.1f} / {a['iteration_s']:.1f} s | {parts} s "
            f"| {'**met**' if met else '**missed**'} |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=2, help="seeds 0..N-1 (default 2)")
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = parser.parse_args(argv)
    if args.seeds < 1:
        parser.error("--seeds must be at least 1")
    busy, machine = busy_cores_before(), training_machine()
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    import yaml

    rows = []
    with tempfile.TemporaryDirectory(prefix="k3rl-bench-agent-learning-") as tmp:
        for seed in range(args.seeds):
            print(f"seed {seed}: make train's run ...", flush=True)
            base = run_seed(seed, [], Path(tmp) / f"base{seed}")
            trainer = yaml.safe_load(base["config"])["trainer"]
            window, target = int(trainer["success_window"]), float(trainer["stop_at_success"])
            base["summary"] = summarise(base, window, target)
            if base["summary"]["reached_min"] is None:
                raise SystemExit(f"seed {seed}: make train's run did not reach {target} (its own target), so "
                                 "there is no time to compare with; see bench/learning.py")
            limit_min = TIME_TARGET * base["summary"]["reached_min"]
            print(f"seed {seed}: the agent program, at most {limit_min:.1f} min ...", flush=True)
            agent = run_seed(seed, [*AGENT, f"trainer.time_limit_s={limit_min * 60 + 30:.0f}"],
                             Path(tmp) / f"agent{seed}")
            agent["summary"] = summarise(agent, window, target)
            rows.append(seed_row(seed, base, agent, limit_min))
    lines = [
        "## An agent program learns: agent_guess_number against `make train` (`bench/agent_learning.py`)",
        "",
        f"Measured {started}. Command: `python bench/agent_learning.py --seeds {args.seeds}`. {machine}; "
        f"{other_load_text(busy)}",
        "",
        f"Per seed, one `python -m rl.train seed=S` (`make train`'s config: GuessNumber played turn by turn "
        f"by the trainer), then `python -m rl.train {' '.join(AGENT)} seed=S` (the shipped agent program "
        "plays the same game from inside each sandbox through the policy gateway; its episodes reuse their "
        f"sandbox, `program.in_place_reset`), limited to {TIME_TARGET:g}x the first run's time to its "
        "target. Target: mean success "
        f"of the last {window} iterations >= {target}, reached by the agent within {TIME_TARGET:g}x "
        "`make train`'s time (both from the trainer's start). Seconds per iteration: the median over "
        "iterations after the first; the agent's split: resets (`program.setup`; new sandboxes at the "
        "first), "
        "the programs (their whole run, generation included), generation inside it, the learner.",
        "",
        "| seed | make train: time to target | agent program: time to target | ratio | s/iteration: make "
        "train / agent | agent: reset / programs / generation / learner | verdict |",
        "|---|---|---|---|---|---|---|",
        *rows,
    ]
    text = "\n".join(lines)
    print(text)
    if not args.no_write:
        write_section(SECTION, text)


if __name__ == "__main__":
    main()
