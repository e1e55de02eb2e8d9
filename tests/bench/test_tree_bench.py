"""bench/tree.py's verdicts from training records: the cost at which tree GRPO first reaches chain GRPO's
final success, as a share of chain's, and both runs' success at the tokens both generated; and the runs
log that lets a cut-off invocation's finished runs be taken instead of run again."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

sys.path.append(str(Path(__file__).resolve().parents[2] / "bench"))

from tree import TASKS, branch_cost, curve, logged_runs, main, seed_verdict, success_at  # noqa: E402


def records(success: list[float], tokens: int, sandbox_s: float) -> list[dict]:
    return [{"success": s, "generated_tokens": tokens, "sandbox_running_s": sandbox_s, "elapsed_s": 60.0 * i}
            for i, s in enumerate(success)]  # fmt: skip


def test_a_branchs_cost_per_child_is_the_median_fork_and_state_copy_of_the_iterations_that_branched():
    history = [{"sandbox_forks": 0, "sandbox_fork_latency_s": 0.0, "tree_state_copies": 0},
               {"sandbox_forks": 8, "sandbox_fork_latency_s": 0.2, "tree_state_copies": 8,
                "tree_state_copy_s": 0.001, "tree_state_copy_bytes": 4096},
               {"sandbox_forks": 8, "sandbox_fork_latency_s": 0.4, "tree_state_copies": 8,
                "tree_state_copy_s": 0.003, "tree_state_copy_bytes": 4096}]
    assert branch_cost(history) == "300 ms / 2.00 ms (4 KiB)"
    assert branch_cost(history[:1]) == "- / -"  # no branch yet


def test_the_curve_sums_the_costs_and_smooths_success_over_three_iterations():
    points = curve(records([0.0, 0.3, 0.6, 0.9], 100, 10.0))
    assert [p[0] for p in points] == [100, 200, 300, 400] and [p[1] for p in points] == [10, 20, 30, 40]
    assert [p[2] for p in points] == [0, 1, 2, 3]
    assert [p[3] for p in points] == pytest.approx([0.0, 0.15, 0.3, 0.6])


def test_a_tree_that_reaches_chains_final_success_for_less_is_measured_against_chains_cost_to_it():
    chain = curve(records([0.0, 0.0, 0.3, 0.6, 0.6, 0.6], 100, 10.0))  # final 0.6, first at 600 tokens
    tree = curve(records([0.0, 0.6, 0.6, 0.9], 60, 5.0))  # windowed 0.6 first at iteration 3: 240 tokens
    v = seed_verdict(chain, tree)
    assert v["chain_final"] == pytest.approx(0.6) and v["tree_final"] == pytest.approx(0.7)
    assert v["tokens_ratio"] == pytest.approx(240 / 600) and v["sandbox_ratio"] == pytest.approx(20 / 60)
    assert v["budget"] == 240 and v["equal_budget"] == (pytest.approx(0.7), 0.0)


def test_a_tree_that_never_reaches_chains_final_success_has_no_ratio():
    chain = curve(records([0.5, 0.5, 0.5], 100, 10.0))
    tree = curve(records([0.0, 0.1, 0.2], 100, 10.0))
    assert seed_verdict(chain, tree)["tokens_ratio"] is None
    assert success_at(tree, 50) == 0.0 and success_at(tree, 300) == pytest.approx(0.1)


def test_a_chain_that_learned_nothing_gives_no_verdict():
    """Reaching a final success of 0 costs nothing: a 'met' there would be meaningless."""
    chain = curve(records([0.0, 0.0, 0.0], 100, 10.0))
    tree = curve(records([0.0, 0.0, 0.0], 100, 10.0))
    v = seed_verdict(chain, tree)
    assert not v["learned"] and v["tokens_ratio"] is None and v["sandbox_ratio"] is None
    learned = seed_verdict(curve(records([0.0, 0.3, 0.6], 100, 10.0)), tree)
    assert learned["learned"]



MADE = "2026-12-06 05:00 UTC"  # when the cold start of the logged runs was made


def logged(task: str, method: str, seed: int, success: list[float], tokens: int, **fields) -> dict:
    run = {"task": task, "method": method, "seed": seed, "history": records(success, tokens, 10.0),
           "wall_s": 60.0, "error": None, "minutes": 20.0, "overrides": [], "commit": "abc1234",
           "machine": "Python 3.11 on the test's machine", "busy": 0.0, "started": "2026-12-06 06:00 UTC",
           "cold_start": MADE}
    return run | fields


def test_the_runs_log_gives_back_the_finished_runs_of_the_same_settings_and_a_later_line_wins(tmp_path):
    first, second = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    first.write_text("\n".join(json.dumps(r) for r in [
        logged("FindValue", "chain", 0, [0.1], 100),
        logged("FindValue", "tree", 0, [0.2], 100, minutes=12.0),  # other settings: not comparable
        logged("FindValue", "chain", 1, [0.3], 100, overrides=["trainer.lr=1"]),
        logged("StoreRecall", "tree", 0, [], 100, error="Traceback ...\nRuntimeError: boom"),  # run again
        logged("FindValue", "tree", 1, [0.4], 100, cold_start="2026-12-01 00:00 UTC"),  # another start
    ]) + "\n\n")
    second.write_text(json.dumps(logged("FindValue", "chain", 0, [0.9], 100, commit="def5678")) + "\n")
    starts = {"FindValue": {"made": MADE}, "StoreRecall": {"made": MADE}}
    found = logged_runs([first, second], 20.0, [], starts)
    assert set(found) == {("FindValue", "chain", 0)} and found["FindValue", "chain", 0]["commit"] == "def5678"
    assert set(logged_runs([first], 20.0, ["trainer.lr=1"], starts)) == {("FindValue", "chain", 1)}
    (tmp_path / "bad.jsonl").write_text('{"task": "FindValue"}\n')
    with pytest.raises(SystemExit, match=r"bad.jsonl, line 1: not a run of bench/tree.py"):
        logged_runs([tmp_path / "bad.jsonl"], 20.0, [], starts)
    with pytest.raises(SystemExit, match="is not a file"):
        logged_runs([tmp_path / "missing.jsonl"], 20.0, [], starts)


def test_an_invocation_whose_runs_are_all_logged_runs_none_and_writes_the_section_from_them(tmp_path, capsys):
    log = tmp_path / "runs.jsonl"
    runs = [logged("FindValue", "chain", 0, [0.0, 0.3, 0.6, 0.6, 0.6], 100),
            logged("FindValue", "tree", 0, [0.0, 0.6, 0.6, 0.9], 60, commit="def5678",
                   started="2026-12-07 01:00 UTC")]
    log.write_text("".join(json.dumps(r) + "\n" for r in runs))
    kept = tmp_path / "work" / "cold_start" / "FindValue"  # the cold start the runs came from, kept
    (kept / "sft").mkdir(parents=True)
    (kept / "cold_start.json").write_text(json.dumps({
        "recipe": asdict(TASKS["FindValue"].cold_start), "sft_dir": str(kept / "sft"), "expert": 0.57,
        "demos": 1000, "demo_s": 60.0, "sft_s": 600.0, "commit": "0123abc", "made": MADE}))
    main(["--seeds", "1", "--tasks", "FindValue", "--no-write", "--reuse-runs", str(log),
          "--work", str(tmp_path / "work")])
    out = capsys.readouterr().out
    assert "2 runs taken from" in out and "0 to run" in out and "appended to" not in out
    assert "Command: `python bench/tree.py --minutes 20 --seeds 1 --tasks FindValue`." in out
    when = "Measured 2026-12-06 06:00 UTC to 2026-12-07 01:00 UTC"
    assert f"{when}, on commit abc1234 (1 run), def5678 (1 run)" in out
    (row,) = [line for line in out.splitlines() if line.startswith("| FindValue | 0 |")]
    assert "| 0.60 | 0.70 |" in row and "**met**" in row
    experts = TASKS["FindValue"].cold_start.describe()
    assert f"FindValue: 1000 demonstrations of {experts} (their success 0.57)" in out
    assert f"made {MADE} on commit 0123abc" in out


def test_a_kept_cold_start_is_reused_while_its_recipe_holds_and_an_unfinished_one_is_made_again(
        tmp_path, monkeypatch):
    """`cold_start.cached`'s decision (the stages themselves are bench/teacher.py's, run by the bench)."""
    import cold_start

    made = []

    def make(recipe, folder):
        made.append(recipe)
        (folder / "sft").mkdir(parents=True)
        return {"sft_dir": str(folder / "sft"), "expert": 0.5, "demos": recipe.demos, "demo_s": 1.0,
                "sft_s": 2.0}

    monkeypatch.setattr(cold_start, "make", make)
    recipe = cold_start.Recipe(env=("env=store_recall",), experts=(("expert.quality=x", 1.0),), demos=10)
    folder = tmp_path / "cs"
    (folder / "sft").mkdir(parents=True)
    (folder / "sft" / "half_written").write_text("")  # a cut-off cold start: no record
    first = cold_start.cached(recipe, folder)
    assert len(made) == 1 and not (folder / "sft" / "half_written").exists() and first["demos"] == 10
    assert cold_start.cached(recipe, folder) == first and len(made) == 1  # kept: the very same weights
    other = cold_start.Recipe(env=recipe.env, experts=recipe.experts, demos=20)
    assert cold_start.cached(other, folder)["demos"] == 20 and len(made) == 2
