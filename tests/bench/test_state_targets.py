"""The state-move benchmarks' verdicts on hand-made numbers: each target judged on the median of its runs
with their spread (near-line and two-sided runs flagged), ratios taken run by run against the baseline
of the same run, KSM's settling rule, and each script's target lines (bench/sandbox.py,
restore_paths.py, state_move_cpu.py, sandbox_server_load.py); plus the figures read from /proc (ksmd's
CPU, PSS) and the backend config files of the benchmark's variants."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

# appended, not prepended: bench/ holds kernels.py and model.py, which must not shadow the packages for
# the other tests of this process
sys.path.append(str(Path(__file__).resolve().parents[2] / "bench"))

from backend_variants import Backends, Variant  # noqa: E402
from restore_paths import PathSamples, Row, lever_cells  # noqa: E402
from sandbox import Samples, pss_bytes, target_verdicts  # noqa: E402
from sandbox_server_load import LoadResult, target_lines  # noqa: E402
from state_move_cpu import Window, cycle_verdicts  # noqa: E402
from state_targets import (  # noqa: E402
    FORK8,
    RESUME_128,
    Target,
    judge,
    ksm_settled,
    ratios,
)

from agentenv.backend import ksm  # noqa: E402
from agentenv.backend.settings import BackendSettings  # noqa: E402


def test_a_verdict_rests_on_the_median_of_the_runs_with_their_spread():
    v = judge(RESUME_128, [0.10, 0.09, 0.30])
    assert v.met and v.text() == ("resume p50 of a warm shell at 128 MiB ≤ 0.120 s (moonshot ≤ 0.060 s): "
                                  "**met** — 0.100 s (median of 3 runs, 0.090 s–0.300 s); the runs fall "
                                  "on both sides of the line; moonshot 0.060 s **missed**")
    assert judge(RESUME_128, [0.05, 0.055, None]).text().endswith("moonshot 0.060 s **met**")
    missed = judge(Target("x", 2.0, "×"), [3.1, 2.9, 3.5]).text()
    assert missed == "x ≤ 2.00×: **missed** — 3.10× (median of 3 runs, 2.90×–3.50×)"


def test_one_run_near_its_line_is_flagged_as_not_settled():
    near = judge(RESUME_128, [0.125]).text()
    assert "**missed** — 0.125 s (1 run)" in near and "near its line on fewer than 3 runs" in near
    far = judge(RESUME_128, [0.5]).text()
    assert "(1 run)" in far and "near its line" not in far
    assert "near its line" not in judge(RESUME_128, [0.118, 0.119, 0.117]).text()  # 3 runs settle it


def test_no_run_is_no_verdict_and_a_broken_figure_is_refused():
    assert judge(RESUME_128, [None, None]).text().endswith("**no verdict**: not measured in this run")
    with pytest.raises(ValueError, match="not a number"):
        judge(RESUME_128, [0.1, float("nan")])


def test_ratios_pair_each_run_with_its_own_baseline():
    assert ratios([0.2, 0.3, None], [0.1, 0.1, 0.1]) == [2.0, pytest.approx(3.0), None]
    assert ratios([0.2], [0.0]) == [None]
    with pytest.raises(ValueError, match="each run needs both"):
        ratios([0.1, 0.2], [0.1])


def test_ksm_settles_after_enough_full_scans_once_sharing_stops_moving():
    growing = [(10, 0), (11, 1000), (12, 50_000), (13, 90_000)]
    assert not ksm_settled(growing)
    assert ksm_settled(growing + [(13, 90_010), (14, 90_050)])
    assert not ksm_settled([(10, 0), (11, 0)])  # too few scans to tell
    assert ksm_settled([(10, 0), (11, 0), (12, 0), (13, 0)])  # nothing to merge: settled at none
    assert not ksm_settled([])


def _size(resumes: list[list[float]], fork8_ready: list[float], fork8_none: list[float]) -> dict:
    """A size's results as bench/sandbox.py keeps them: per round, its samples."""
    return {"resume": [Samples(r) for r in resumes], "pause": [Samples([0.2, 0.25, 0.22]) for _ in resumes],
            "forks": [{(8, True): Samples([f]), (8, False): Samples([g]), (1, True): Samples([0.1]),
                       (1, False): Samples([0.2])} for f, g in zip(fork8_ready, fork8_none, strict=True)]}


def test_sandbox_verdicts_take_each_rounds_figure_against_the_same_rounds_resume():
    results = {128: _size([[0.10, 0.11, 0.30], [0.20, 0.20, 0.21], [0.10, 0.10, 0.10]],
                          [0.2, 0.3, 0.15], [0.5, 0.5, 0.5])}
    forks_memory = {"rounds": [{"one": {"drop": 100, "pss": 100}, "many": {"drop": 300, "pss": 180}},
                               {"one": {"drop": 100, "pss": 100}, "many": {"drop": 200, "pss": 150}},
                               {"one": {"drop": 100, "pss": 100}, "many": {"drop": 260, "pss": 170}}]}
    lines = target_verdicts(results, forks_memory)
    by_start = {line.split(" ≤")[0]: line for line in lines}
    # round p50s 0.11, 0.20, 0.10: median 0.11
    assert "**met** — 0.110 s (median of 3 runs, 0.100 s–0.200 s)" in by_start[RESUME_128.what]
    assert "**no verdict**" in by_start["resume p50 of a warm shell at 1 GiB"]
    # p99/p50 per round: 0.30/0.11, 0.21/0.20, 1.0
    assert "**met** — 1.05× (median of 3 runs, 1.00×–2.73×)" in \
        by_start["resume p99 ÷ p50 of a warm shell at 128 MiB"]
    assert "**met** — 0.220 s" in by_start["pause p50 at 128 MiB"]
    # fork(8) over the same round's resume: 0.2/0.11, 0.3/0.2, 0.15/0.1 -> 1.82, 1.5, 1.5
    assert "**met** — 1.50× (median of 3 runs, 1.50×–1.82×)" in \
        by_start[f"{FORK8.what} at 128 MiB, spare shells ready"]
    assert "**missed**" in by_start[f"{FORK8.what} at 128 MiB, no spare shell (a template's first fork)"]
    memory = [line for line in lines if line.startswith("8 running forks")]
    assert "**missed** — 2.60×" in memory[0] and "`MemAvailable`" in memory[0]
    assert "**met** — 1.70×" in memory[1] and "PSS" in memory[1]


def test_fork_verdicts_leave_out_sizes_without_forks():
    results = {1024: _size([[0.15, 0.16, 0.17]], [0.5], [0.5])}
    lines = target_verdicts(results, None)
    assert not [line for line in lines if line.startswith(FORK8.what)]
    assert "**met** — 0.160 s (1 run)" in next(line for line in lines if "1 GiB" in line)


def test_each_lever_is_set_against_the_row_it_changes():
    paths = {"a": PathSamples(resume=[0.4, 0.5, 0.6], cpu=[1.0, 1.0, 1.0]),
             "b": PathSamples(resume=[0.1, 0.1, 0.1], cpu=[0.5, 0.4, 0.6])}
    assert lever_cells(paths, Row("a", "A", "x", None)) == ("(baseline)", "(baseline)")
    assert lever_cells(paths, Row("b", "B", "y", "a")) == ("-0.400 s (0.20×)", "-0.500 CPU-s (0.50×)")
    paths["c"] = PathSamples()
    assert lever_cells(paths, Row("c", "C", "z", "a")) == ("-", "-")


def _window(cpu: float) -> Window:
    return Window({"CRIU": cpu * 0.75, "dockerd": cpu * 0.25}, 0.0, 0.0, 0.1, {}, {}, 0.1)


def test_cpu_target_sums_each_repetitions_pause_and_resume():
    runs = {"warm": {"runs": {"pause": [_window(0.1), _window(0.1), _window(0.1)],
                              "resume": [_window(0.2), _window(0.15), _window(0.5)]}},
            "fastpath": {"runs": {"pause": [_window(0.5)], "resume": [_window(0.4)]}}}
    warm, fastpath = cycle_verdicts(runs, 200)
    assert warm.startswith("CPU of one pause + resume at 200 MiB (the page daemon's included) — warm")
    assert "**met** — 0.300 CPU-s (median of 3 runs, 0.250 CPU-s–0.600 CPU-s)" in warm
    assert "**missed** — 0.900 CPU-s (1 run)" in fastpath
    assert "(measured at 64 MiB)" in cycle_verdicts(runs, 64)[0]


def _load(clients: int, run_s: list[float], five_xx: int = 0) -> LoadResult:
    r = LoadResult(clients, 200.0)
    r.lat["run"] = run_s
    r.five_xx = five_xx
    r.leftover = {"sandboxes": 0, "containers": 0, "checkpoints": 0}
    r.samples = [(0.0, 90.0, 10), (1.0, 120.0, 20)]
    return r


def test_server_target_is_the_median_of_the_32_client_runs():
    results = [_load(8, [9.0]), _load(32, [0.5] * 98 + [1.5, 2.5]), _load(32, [1.0, 1.8]),
               _load(32, [2.2]), _load(64, [9.0], five_xx=3)]
    lines = target_lines(results)
    assert "3 run(s) of at least 200 s" in lines[1]
    assert lines[3] == ("- `commands.run` p99 with 32 SDK clients ≤ 2.000 s: **met** — 1.800 s (median of "
                        "3 runs, 1.500 s–2.200 s); the runs fall on both sides of the line")
    assert "zero 5xx (0: met)" in lines[4] and "(120 MiB: met)" in lines[4]  # the 64-client run's left out
    assert target_lines([_load(8, [0.1])]) == []


def test_ksmd_cpu_is_read_from_its_stat_line():
    line = "39 (ksmd (x) y) S 2 0 0 0 -1 2097216 6 0 0 0 150 2819 0 0 25 5 1 0 27 0 0"
    assert ksm.stat_cpu_seconds(line) == pytest.approx((150 + 2819) / os.sysconf("SC_CLK_TCK"))
    if not Path("/sys/kernel/mm/ksm").exists():
        pytest.fail("this kernel has no KSM (/sys/kernel/mm/ksm): forks share pages through it")
    first = ksm.ksmd_cpu_seconds()
    assert first is not None and first >= 0.0 and ksm.ksmd_cpu_seconds() >= first
    assert set(ksm.counters()) <= set(ksm.COUNTERS) and "pages_sharing" in ksm.counters()


def test_pss_counts_live_processes_and_skips_gone_ones():
    # a child that holds 16 MiB of its own written pages and then only sleeps: its PSS stays put (the test
    # process's own moves by MiBs as the suite imports and allocates, so it is no fixed yardstick)
    child = subprocess.Popen([sys.executable, "-c", HOLD_16_MIB], stdout=subprocess.PIPE)
    try:
        assert child.stdout.readline() == b"ready\n"
        held = pss_bytes([child.pid])
        assert held > 16 << 20
        assert pss_bytes([2**22 + 1]) == 0  # no such pid: counts 0, no error
        # a PSS moves as other processes map and unmap the libraries it shares: close, not equal
        assert abs(pss_bytes([child.pid, 2**22 + 1]) - held) < 1 << 20
    finally:
        child.kill()
        child.wait()


HOLD_16_MIB = ("import time; b = bytearray(16 << 20); b[::4096] = b'x' * 4096; "
               "print('ready', flush=True); time.sleep(60)")


def test_variants_get_the_configured_backend_file_with_their_settings(tmp_path, monkeypatch):
    monkeypatch.delenv("AGENTENV_BACKEND_CONFIG", raising=False)
    backends = Backends(tmp_path)
    eager = Variant("eager", "warm", "eager", {"lazy_pages": False, "spare_shells": False})
    s = BackendSettings.load(backends._config_file(eager))
    base = BackendSettings.load()
    assert (s.backend, s.lazy_pages, s.spare_shells) == ("warm", False, False)
    assert (s.store_dir, s.ksm_pages_to_scan) == (base.store_dir, base.ksm_pages_to_scan)
    fast = BackendSettings.load(backends._config_file(Variant("fp", "fastpath", "fp")))
    assert fast.backend == "fastpath" and fast.lazy_pages == base.lazy_pages
    with pytest.raises(SystemExit, match="not keys of"):
        backends._config_file(Variant("bad", "warm", "bad", {"lazy_page": False}))
    assert yaml.safe_load((tmp_path / "eager.backend.yaml").read_text())["lazy_pages"] is False


def test_quick_runs_refuse_bad_arguments():
    import sandbox

    with pytest.raises(SystemExit, match="--sizes"):
        sandbox.sandbox_part(argparse.Namespace(sizes="16,x", quick=True), "cmd")
