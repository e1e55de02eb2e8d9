"""bench/tree.py's verdicts from training records: the cost at which tree GRPO first reaches chain GRPO's
final success, as a share of chain's, and both runs' success at the tokens both generated; and the runs
log that lets a cut-off invocation's finished runs be taken instead of run again."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.append(str(Path(__file__).resolve().parents[2] / "bench"))

from tree import curve, logged_runs, main, seed_verdict, success_at  # noqa: E402


def records(success: list[float], tokens: int, sandbox_s: float) -> list[dict]:
    return [{"success": s, "generated_tokens": tokens, "sandbox_running_s": sandbox_s, "elapsed_s": 60.0 * i}
            for i, s in enumerate(success)]  # fmt: skip


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



def logged(task: str, method: str, seed: int, success: list[float], tokens: int, **fields) -> dict:
    run = {"task": task, "method": method, "seed": seed, "history": records(success, tokens, 10.0),
           "wall_s": 60.0, "error": None, "minutes": 20.0, "overrides": [], "commit": "abc1234",
           "machine": "Python 3.11 on the test's machine", "busy": 0.0, "started": "2026-12-06 06:00 UTC"}
    return run | fields


def test_the_runs_log_gives_back_the_finished_runs_of_the_same_settings_and_a_later_line_wins(tmp_path):
    first, second = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    first.write_text("\n".join(json.dumps(r) for r in [
        logged("FindValue", "chain", 0, [0.1], 100),
        logged("FindValue", "tree", 0, [0.2], 100, minutes=12.0),  # other settings: not comparable
        logged("FindValue", "chain", 1, [0.3], 100, overrides=["trainer.lr=1"]),
        logged("StoreRecall", "tree", 0, [], 100, error="Traceback ...\nRuntimeError: boom"),  # run again
    ]) + "\n\n")
    second.write_text(json.dumps(logged("FindValue", "chain", 0, [0.9], 100, commit="def5678")) + "\n")
    found = logged_runs([first, second], 20.0, [])
    assert set(found) == {("FindValue", "chain", 0)} and found["FindValue", "chain", 0]["commit"] == "def5678"
    assert set(logged_runs([first], 20.0, ["trainer.lr=1"])) == {("FindValue", "chain", 1)}
    (tmp_path / "bad.jsonl").write_text('{"task": "FindValue"}\n')
    with pytest.raises(SystemExit, match=r"bad.jsonl, line 1: not a run of bench/tree.py"):
        logged_runs([tmp_path / "bad.jsonl"], 20.0, [])
    with pytest.raises(SystemExit, match="is not a file"):
        logged_runs([tmp_path / "missing.jsonl"], 20.0, [])


def test_an_invocation_whose_runs_are_all_logged_runs_none_and_writes_the_section_from_them(tmp_path, capsys):
    log = tmp_path / "runs.jsonl"
    runs = [logged("FindValue", "chain", 0, [0.0, 0.3, 0.6, 0.6, 0.6], 100),
            logged("FindValue", "tree", 0, [0.0, 0.6, 0.6, 0.9], 60, commit="def5678",
                   started="2026-12-07 01:00 UTC")]
    log.write_text("".join(json.dumps(r) + "\n" for r in runs))
    main(["--seeds", "1", "--tasks", "FindValue", "--no-write", "--reuse-runs", str(log)])
    out = capsys.readouterr().out
    assert "2 runs taken from" in out and "0 to run" in out and "appended to" not in out
    when = "Measured 2026-12-06 06:00 UTC to 2026-12-07 01:00 UTC"
    assert f"{when}, on commit abc1234 (1 run), def5678 (1 run)" in out
    (row,) = [line for line in out.splitlines() if line.startswith("| FindValue | 0 |")]
    assert "| 0.60 | 0.70 |" in row and "**met**" in row
