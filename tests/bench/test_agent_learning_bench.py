"""bench/agent_learning.py's verdict per seed: the agent program's time to the target against twice
`make train`'s, from the two runs' summaries and iteration records."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[2] / "bench"))

from agent_learning import per_iteration, seed_row  # noqa: E402


def run(reached_min: float | None, iteration_s: float, iterations: int = 10) -> dict:
    history = [{"iteration_s": 30.0 if i == 0 else iteration_s, "reset_s": iteration_s / 3,
                "env_step_s": iteration_s / 2, "generate_s": 1.0, "learner_s": 2.0}
               for i in range(iterations)]
    summary = {"reached_min": reached_min, "final_success": 0.9 if reached_min else 0.6,
               "reached_iteration": None if reached_min is None else iterations - 1, "iterations": iterations}
    return {"history": history, "summary": summary}


def test_the_first_iteration_is_left_out_of_the_per_iteration_medians():
    assert per_iteration(run(5.0, 3.0)["history"])["iteration_s"] == 3.0
    assert per_iteration(run(5.0, 3.0, iterations=1)["history"])["iteration_s"] == 30.0


def test_an_agent_within_twice_make_trains_time_meets_the_target_and_one_past_it_misses():
    base = run(6.0, 3.0)
    met = seed_row(0, base, run(11.9, 6.0), limit_min=12.0)
    assert "| 0 | 6.0 min (it 9) | 11.9 min (it 9) | 1.98x | 3.0 / 6.0 s | 2.0 / 3.0 / 1.0 / 2.0 s |" in met
    assert met.endswith("**met** |")
    missed = seed_row(1, base, run(None, 24.0), limit_min=12.0)
    assert "not in 12.0 min (success 0.60 after 10 it)" in missed and missed.endswith("**missed** |")
