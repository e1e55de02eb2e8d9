"""bench/memory_sweep.py and the fixed-memory section of bench/train.py: the steady-state rate (no
whole-run fallback), each row's spread over repeated runs, verdicts on the medians (with how many runs
meet them, the extremes and the runs over the budget; none on too few runs or on a baseline this command
did not measure), the break-even latencies, and the section rendered from hand-made row logs."""

from __future__ import annotations

import json
import sys
from argparse import Namespace
from pathlib import Path

import pytest

# appended, not prepended: bench/ holds kernels.py and model.py, which must not shadow the packages for
# the other tests of this process
sys.path.append(str(Path(__file__).resolve().parents[2] / "bench"))

from memory_sweep import (  # noqa: E402
    break_even,
    break_even_verdict,
    cells,
    compare,
    crossing,
    plot_sweep,
    ratio_verdict,
    steady_rate,
    sweep_points,
    verdict,
)
from train import MemorySetup, main, memory_section, reused_rows  # noqa: E402

NOW = "20261205T101500Z-ab12"  # the session of "this command" in these tests
EARLIER = "20261201T080000Z-0f0f"


def _history(n: int, episodes: int = 64, first_s: float = 100.0, step_s: float = 10.0) -> list[dict]:
    return [{"episodes": episodes, "elapsed_s": first_s + i * step_s} for i in range(n)]


def _run(row: str, latency: float, repeat: int, rate: float | None, peak: float = 1875.0,
         session: str = NOW, commit: str = "abc1234") -> dict:
    """A hand-made run as the row log keeps it (every figure the section reads)."""
    history = [{"success": 0.05, "elapsed_s": 60.0 * (i + 1), "rollout_waves": 1.0, "sandbox_slots": 9.0,
                "sandbox_slot_wait_s": 100.0} for i in range(2)]
    return {"row": row, "latency": latency, "session": session, "repeat": repeat, "repeats": 3,
            "commit": commit, "episodes": 128, "episodes_per_s": rate, "steady_iterations": 1,
            "steady_needed": 1, "peak_mib": peak, "peak_sandboxes": 9 if row == "c" else 8,
            "peak_parts": [], "peak_at_s": 30.0, "learner_idle_fraction": 0.9, "time_to_target_s": None,
            "start_success": 0.02, "end_success": 0.05, "best_success": 0.09, "iterations": 2,
            "pauses_per_episode": 2.7 if row == "c" else 0.0, "pause_s": 2.0, "resume_s": 2.4,
            "load": 1.5, "history": history}


def _cell(row: str, latency: float, rates: list[float | None], peaks: list[float] | None = None,
          session: str = NOW) -> list[dict]:
    peaks = peaks or [1875.0] * len(rates)
    pairs = zip(rates, peaks, strict=True)
    return [_run(row, latency, i + 1, r, p, session) for i, (r, p) in enumerate(pairs)]


# the review's case: (c) at 30 s over three runs straddles the 3x line; one run of (c) at 10 s broke 2 GiB
A = {0.0: [12.9, 12.5, 13.1], 10.0: [0.26, 0.255, 0.262], 30.0: [0.088, 0.0885, 0.0875]}
B = {0.0: [12.1, 12.0, 12.3], 10.0: [0.256, 0.25, 0.26], 30.0: [0.0876, 0.088, 0.0874]}
C = {0.0: [1.29, 1.41, 1.55], 10.0: [0.372, 0.346, 0.369], 30.0: [0.255, 0.276, 0.290]}
C_PEAKS = {0.0: [1876, 1880, 1878], 10.0: [1873, 2202, 1872], 30.0: [1875, 1873, 1876]}


def _log(a_session: str = NOW) -> list[dict]:
    runs = []
    for lat in (0.0, 10.0, 30.0):
        runs += _cell("a", lat, A[lat], session=a_session) + _cell("b", lat, B[lat])
        runs += _cell("c", lat, C[lat], [float(p) for p in C_PEAKS[lat]])
    return runs


def _setup(**changes) -> MemorySetup:
    fields = dict(
        header=["Machine: hand-made."], session=NOW, commit="abc1234",
        cost={"sandbox_mib": 208.0, "cycle_cpu_s": 0.84, "cycle_wall_s": 1.0, "fork_cpu_s": 0.58,
              "fork_wall_s": 0.36, "cycles": 3},
        group=8, cap=8, episodes=64, turns=3, latencies=[0.0, 10.0, 30.0], steady_iterations=1,
        memory_minutes=40.0, repeats=3, smoke=False, reuse_logs=[], sweep_link="img/sweep.png", busy=0.02,
        cores=2,
    )
    return MemorySetup(**{**fields, **changes})


def test_the_rate_covers_only_the_iterations_after_the_first_and_needs_the_whole_window():
    assert steady_rate(_history(6), "episodes") == pytest.approx(5 * 64 / 50.0)  # start-up's 100 s left out
    assert steady_rate(_history(5), "episodes") is None  # 4 after the first: no number, no fallback
    assert steady_rate(_history(3), "episodes", min_iterations=2) == pytest.approx(2 * 64 / 20.0)


def test_break_even_is_interpolated_between_measured_latencies():
    lat = [0.0, 2.0, 10.0, 30.0]
    words, value = crossing(lat, [0.1, 0.5, 1.5, 4.0], 1.0)
    assert value == pytest.approx(6.0) and "inferred" in words
    assert crossing(lat, [0.1, 0.5, 1.5, 4.0], 3.0)[1] == pytest.approx(10 + 1.5 / 2.5 * 20)
    never = crossing(lat, [0.1, 0.2, 0.3, 0.4], 1.0)
    assert never == ("above 30 s (not reached at any measured latency)", None)
    assert crossing(lat, [1.2, None, 2.0, 5.0], 1.0)[1] == 0.0  # at or below the first measured one
    assert crossing(lat, [0.5, None, 1.5, 4.0], 1.0)[1] == pytest.approx(5.0)  # skips the unmeasured 2 s
    assert crossing(lat, [None] * 4, 1.0)[1] is None
    assert crossing(lat, [2.0, 2.0, 0.5, 2.0], 1.0)[1] == pytest.approx(10 + 0.5 / 1.5 * 20)  # last crossing


def test_cells_group_every_repeat_and_refuse_a_log_they_cannot_read():
    log = _cell("c", 30, [0.29, 0.255]) + _cell("a", 30.0, [0.088])
    by_cell = cells(list(reversed(log)))
    assert sorted(by_cell) == [("a", 30.0), ("c", 30.0)]
    assert [r["repeat"] for r in by_cell[("c", 30.0)]] == [1, 2]  # each repeat kept, in order
    with pytest.raises(ValueError, match="run 1 of the row log lacks session, repeat"):
        cells([{"row": "c", "latency": 30.0}])
    with pytest.raises(ValueError, match=r"row \(c\) at 30 s has repeat 1 of session .* more than once"):
        cells(log + log[:1])


def test_the_3x_verdict_is_on_the_medians_and_says_how_many_runs_meet_it_and_the_extremes():
    cmp = compare(_cell("c", 30.0, C[30.0]), _cell("a", 30.0, A[30.0]), 30.0, 3.0, NOW, 2048)
    assert cmp.refusal is None
    assert cmp.ratio == pytest.approx(0.276 / 0.088)
    assert cmp.worst == pytest.approx(0.255 / 0.0885) and cmp.best == pytest.approx(0.290 / 0.0875)
    text = ratio_verdict(cmp)
    assert text.startswith("**met** on the median (2 of 3 runs): 3.14x, the ratio of medians ((c) 0.276 "
                           "(0.255-0.29) / (a) 0.088 (0.0875-0.0885) episodes/s")
    assert "min (c) / max (a) 2.88x, max (c) / min (a) 3.31x (met only at max (c) / min (a))" in text
    assert text.endswith("over the 2048 MiB budget: no run")
    # the same medians with (c)'s fastest run over the budget: met on the median, 1 run meets it, named
    over = compare(_cell("c", 30.0, C[30.0], [1875.0, 1873.0, 2202.0]), _cell("a", 30.0, A[30.0]), 30.0, 3.0,
                   NOW, 2048)
    assert ratio_verdict(over).startswith("**met** on the median (1 of 3 runs)")
    assert ratio_verdict(over).endswith("over the 2048 MiB budget: (c) at 30 s, repeat 3 of 3: 2202 MiB")
    slow = compare(_cell("c", 30.0, [0.25, 0.26, 0.27]), _cell("a", 30.0, A[30.0]), 30.0, 3.0, NOW, 2048)
    assert ratio_verdict(slow).startswith("**missed** on the median (1 of 3 runs): 2.95x")
    assert "(missed at both extremes)" not in ratio_verdict(slow)  # 0.27 / 0.0875 = 3.09 at the best end
    bust = compare(_cell("c", 30.0, [0.3] * 3, [2100.0] * 3), _cell("a", 30.0, A[30.0]), 30.0, 3.0, NOW, 2048)
    assert ratio_verdict(bust).startswith("**missed** on the median (0 of 3 runs): 3.41x")  # over budget


def test_no_verdict_on_a_baseline_from_another_run_or_on_too_few_runs():
    reused = compare(_cell("c", 30.0, C[30.0]), _cell("a", 30.0, A[30.0], session=EARLIER), 30.0, 3.0, NOW)
    assert ratio_verdict(reused) == (
        "**no verdict**: baseline not measured in this run: (a) at 30 s comes from session "
        f"{EARLIER}, commit abc1234 (ratio of medians 3.14x, for information only)")
    one_a = compare(_cell("c", 30.0, C[30.0]), _cell("a", 30.0, [0.088]), 30.0, 3.0, NOW)
    assert "(a) at 30 s has 1 run with a steady rate (of 1), 3 needed" in ratio_verdict(one_a)
    unsteady = compare(_cell("c", 30.0, [0.27, None, 0.28]), _cell("a", 30.0, A[30.0]), 30.0, 3.0, NOW)
    assert ratio_verdict(unsteady).startswith(
        "**no verdict**: (c) at 30 s has 2 runs with a steady rate (of 3), 3 needed")
    assert ratio_verdict(compare([], [], 30.0, 3.0, NOW)).startswith(
        "**no verdict**: baseline not measured in this run: no run of (a) at 30 s; no run of (c) at 30 s")


def test_break_even_on_the_medians_and_the_extremes_and_none_when_a_latency_has_no_verdict():
    lats = [0.0, 10.0, 30.0]
    comparisons = [compare(_cell("c", lat, C[lat]), _cell("a", lat, A[lat]), lat, 1.0, NOW) for lat in lats]
    even = break_even(comparisons, 1.0)
    ratio_0, ratio_10 = 1.41 / 12.9, 0.369 / 0.26
    assert even.median[1] == pytest.approx((1 - ratio_0) * 10 / (ratio_10 - ratio_0))
    assert even.worst[1] > even.median[1] > even.best[1]  # min (c) / max (a) crosses latest
    assert break_even_verdict(even, 10.0).startswith(f"**met** on the median: {even.median[0]}; from the ext")
    assert break_even_verdict(even, 10.0).endswith("(met at both extremes)")
    assert break_even_verdict(even, 7.3).endswith("(met only at max (c) / min (a))")
    reused = [compare(_cell("c", lat, C[lat]), _cell("a", lat, A[lat], session=EARLIER), lat, 1.0, NOW)
              for lat in lats]
    text = break_even_verdict(break_even(reused, 1.0), 10.0)
    assert text.startswith("**no verdict**: baseline not measured in this run: (a) at 0 s comes from session "
                           f"{EARLIER}, commit abc1234; no verdict either at 10 s, 30 s (from the medians: ")
    assert text.endswith("for information only)")
    assert break_even_verdict(break_even([], 1.0), 10.0).startswith("**no verdict**: no latency compared")
    only_30 = break_even([comparisons[2]], 1.0)  # reached at the one latency measured, above the target's
    assert only_30.median == ("at or below 30 s (reached at every measured latency)", 30.0)
    assert break_even_verdict(only_30, 10.0) == (
        "**no verdict**: reached already at the lowest latency measured, 30 s, above the target's 10 s: the "
        "break-even lies somewhere below it (a sweep over lower latencies places it)")
    assert break_even_verdict(only_30, 30.0).startswith("**met** on the median: at or below 30 s")
    late = break_even(comparisons[1:], 3.0)  # 3x: not reached at 10 s, reached at 30 s
    assert break_even_verdict(late, 10.0).startswith("**missed**")


def test_the_plot_draws_each_rows_median_with_min_max_bars(tmp_path):
    assert verdict(True, "3.2x") == "**met**: 3.2x"
    assert verdict(None, "row (c) not steady").startswith("**missed**: not measured")
    rates = {"a": {0.0: [1.0, 1.2, 0.9], 2.0: [0.5]}, "c": {0.0: [None, None], 2.0: [0.2, 0.3, 0.25]}}
    points = sweep_points(rates)
    assert [(lat, s.median, s.low, s.high) for lat, s in points["a"]] == [(0.0, 1.0, 0.9, 1.2),
                                                                         (2.0, 0.5, 0.5, 0.5)]
    assert [lat for lat, _s in points["c"]] == [2.0]  # no steady run at 0 s: a gap
    path = tmp_path / "sweep.png"
    plot_sweep(rates, {"a": "(a)"}, path, "t")
    assert path.stat().st_size > 1000


def test_the_section_renders_from_a_hand_made_row_log_with_spreads_and_verdicts(tmp_path):
    log = tmp_path / "rows.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in _log()))
    text = memory_section([json.loads(line) for line in log.read_text().splitlines()], _setup())
    assert "| 30 s | 3 | 0.276 (0.255-0.29) | 3.14x | 1875 (1873-1876) MiB (9 sandboxes) |" in text
    assert "| 10 s | 3 | 0.26 (0.255-0.262) | 1.00x | 1875 (1875-1875) MiB (8 sandboxes) |" in text
    assert "session 20261205T101500Z-ab12, commit abc1234) ran rows (a), (b), (c) 3 times" in text
    assert ("- Target row (c) >= 3x row (a)'s episodes/s at 30 s within 2048 MiB (measured, medians of the "
            "runs): **met** on the median (2 of 3 runs): 3.14x") in text
    assert "- Target break-even latency for (c) >= (a) <= 10 s (inferred, above): **met** on the med" in text
    assert "exceeded by (c) at 10 s, repeat 2 of 3: 2202 MiB (its peak sample" in text
    assert "- Target CPU per pause + resume of the heavy sandbox <= 0.5 CPU-s" in text
    assert "**missed**: 0.84 CPU-s, the median of 3 cycles" in text
    assert "30 s: 1 / 1, 1 / 1, 1 / 1." in text  # every run's waves
    assert "no verdict" not in text


def test_the_section_gives_no_verdict_on_a_reused_baseline_a_smoke_run_or_a_bad_log():
    reused = memory_section(_log(a_session=EARLIER), _setup(reuse_logs=["rows_old.jsonl"]))
    assert (f"Rows (a) (commit abc1234, session {EARLIER}) come from the row logs of earlier runs of this "
            "script (rows_old.jsonl, `--reuse-rows`)") in reused
    assert "| 30 s | 3 | 0.276 (0.255-0.29) | 3.14x ((a) of other runs) |" in reused
    assert ("within 2048 MiB (measured, medians of the runs): **no verdict**: baseline not measured in this "
            f"run: (a) at 30 s comes from session {EARLIER}") in reused
    assert "<= 10 s (inferred, above): **no verdict**: baseline not measured in this run" in reused
    smoke = memory_section([r for r in _log() if r["repeat"] == 1],
                           _setup(smoke=True, repeats=1, cost={**_setup().cost, "cycles": 1}))
    assert smoke.count("**no verdict**: a --quick smoke run (1 run per row and latency") == 3
    assert "**met**" not in smoke and "**missed**" not in smoke
    failed = [*_log()[:-1], {"row": "c", "latency": 30.0, "session": NOW, "repeat": 3, "error": "boom"}]
    text = memory_section(failed, _setup())
    assert "| 30 s | 3 | 0.266 (0.255-0.276), 1 failed |" in text
    assert "Failed runs: (c) at 30 s, repeat 3: boom." in text
    assert "**no verdict**: (c) at 30 s has 2 runs with a steady rate (of 3), 3 needed" in text
    lacking = _log()
    del lacking[0]["peak_mib"]
    with pytest.raises(ValueError, match=r"run 1 of row \(a\) at 0 s \(session .*\) lacks peak_mib"):
        memory_section(lacking, _setup())


def test_reused_rows_take_every_run_of_the_latest_session_and_old_lines_as_one_run_each(tmp_path):
    old = tmp_path / "rows_old.jsonl"
    unnamed = [{k: v for k, v in r.items() if k not in ("session", "repeat", "commit")}
               for r in _cell("a", 30.0, [0.08, 0.09])]
    old.write_text("".join(json.dumps(r) + "\n" for r in unnamed))
    new = tmp_path / "rows_new.jsonl"
    new.write_text("".join(json.dumps(r) + "\n" for r in _cell("a", 30.0, A[30.0], session=EARLIER)))
    args = Namespace(rows=["c"], reuse_rows=[old, new], reuse_commit="b6ec00c")
    runs = reused_rows(args, {"a": (), "c": ()}, [30.0])
    assert [(r["session"], r["repeat"], r["episodes_per_s"]) for r in runs] == [
        (EARLIER, 1, 0.088), (EARLIER, 2, 0.0885), (EARLIER, 3, 0.0875)]
    only_old = reused_rows(Namespace(rows=["c"], reuse_rows=[old], reuse_commit="b6ec00c"),
                           {"a": (), "c": ()}, [30.0])
    assert [(r["session"], r["repeat"], r["commit"]) for r in only_old] == [
        ("rows_old.jsonl:2", 1, "b6ec00c")]  # an old line: a session of its own, the last one wins


def test_fewer_than_three_repeats_are_refused_except_for_a_smoke_run(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["train.py", "--part", "memory", "--repeats", "2"])
    with pytest.raises(SystemExit):
        main()
    assert "--repeats 2: a verdict rests on the median of at least 3 runs" in capsys.readouterr().err
    monkeypatch.setattr(sys, "argv", ["train.py", "--part", "memory", "--quick", "--repeats", "0"])
    with pytest.raises(SystemExit):
        main()
    assert "--repeats 0: a row needs at least one run" in capsys.readouterr().err
