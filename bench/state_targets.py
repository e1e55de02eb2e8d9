"""The state-move targets of AgentENV's sandboxes and their verdicts, apart from the runs: each target's
line (resume, pause, a pause + resume's CPU, fork(8), the memory of running forks, the server's
`commands.run`), judged **met** or **missed** on the median of the runs that measured it, with their
spread (min-max), and flagged when the runs sit near the line or fall on both sides of it; a quantile of
one run's samples; the rule that says when KSM has settled.

Shared by bench/sandbox.py, restore_paths.py, state_move_cpu.py and sandbox_server_load.py so that every
section words a target alike; free of Docker, checked on hand-made numbers (tests/bench/).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from bench_stats import Spread, spread

NEAR = 0.15       # a median within this share of its line is near it: one run cannot settle it
SETTLED_RUNS = 3  # runs a verdict near its line rests on (their median)


@dataclass(frozen=True)
class Target:
    """One line a figure must stay at or under (`limit`, in `unit`); `moonshot`: a further line."""

    what: str
    limit: float
    unit: str = "s"
    moonshot: float | None = None

    def fmt(self, value: float) -> str:
        """A figure in the target's unit: seconds and CPU-s to the millisecond, ratios to 2 decimals."""
        if self.unit == "×":
            return f"{value:.2f}×"
        return f"{value:.3f} {self.unit}"

    def line(self) -> str:
        more = f" (moonshot ≤ {self.fmt(self.moonshot)})" if self.moonshot is not None else ""
        return f"{self.what} ≤ {self.fmt(self.limit)}{more}"

    def at(self, where: str) -> Target:
        """The same line for one case of it (a size, a backend): `what` followed by `where`."""
        return replace(self, what=f"{self.what} {where}")


RESUME_128 = Target("resume p50 of a warm shell at 128 MiB", 0.12, moonshot=0.06)
RESUME_1G = Target("resume p50 of a warm shell at 1 GiB", 0.2)
RESUME_TAIL = Target("resume p99 ÷ p50 of a warm shell", 2.0, "×")
PAUSE_128 = Target("pause p50 at 128 MiB", 0.3)
CYCLE_CPU = Target("CPU of one pause + resume at 200 MiB (the page daemon's included)", 0.4, "CPU-s")
FORK8 = Target("fork(8) ÷ one resume", 2.0, "×")
FORK_MEMORY = Target("8 running forks of a 128 MiB sandbox ÷ one's memory, KSM settled", 2.5, "×")
SERVER_RUN_P99 = Target("`commands.run` p99 with 32 SDK clients", 2.0)


@dataclass(frozen=True)
class Verdict:
    """A target judged on the runs that measured it (`runs`: their spread; None: none did)."""

    target: Target
    runs: Spread | None

    @property
    def met(self) -> bool | None:
        return None if self.runs is None else self.runs.median <= self.target.limit

    @property
    def near(self) -> bool:
        """Near the line: the median within `NEAR` of it, or runs on both sides of it."""
        if self.runs is None:
            return False
        limit = self.target.limit
        return abs(self.runs.median - limit) <= NEAR * limit or self.runs.low <= limit < self.runs.high

    def text(self) -> str:
        """`line: **met** — figure (median of n runs, min–max)`, with what makes it unsettled."""
        t, s = self.target, self.runs
        if s is None:
            return f"{t.line()}: **no verdict**: not measured in this run"
        runs = "1 run" if s.count == 1 else f"median of {s.count} runs, {t.fmt(s.low)}–{t.fmt(s.high)}"
        out = f"{t.line()}: **{'met' if self.met else 'missed'}** — {t.fmt(s.median)} ({runs})"
        if s.low <= t.limit < s.high:
            out += "; the runs fall on both sides of the line"
        if self.near and s.count < SETTLED_RUNS:
            out += f"; near its line on fewer than {SETTLED_RUNS} runs: not settled, run more rounds"
        if t.moonshot is not None:
            out += f"; moonshot {t.fmt(t.moonshot)} **{'met' if s.median <= t.moonshot else 'missed'}**"
        return out


def judge(target: Target, values: Iterable[float | None]) -> Verdict:
    """`target` judged on the figure of each run (None: a run without it, left out)."""
    got = [v for v in values if v is not None]
    bad = [v for v in got if not math.isfinite(v)]
    if bad:
        raise ValueError(f"{target.what}: a run's figure is {bad[0]}, not a number a verdict can rest on")
    return Verdict(target, spread(got))


def ratios(num: Sequence[float | None], den: Sequence[float | None]) -> list[float | None]:
    """Run by run `num / den` (each pair measured in the same run); None where either is missing."""
    if len(num) != len(den):
        raise ValueError(f"{len(num)} figures against {len(den)} baselines: each run needs both")
    return [None if a is None or not b else a / b for a, b in zip(num, den, strict=True)]


def ksm_settled(samples: Sequence[tuple[int, int]], min_scans: int = 3, tolerance: float = 0.01) -> bool:
    """Has KSM settled? `samples`: (ksmd's `full_scans`, `pages_sharing`) read in time order since the
    pages to merge appeared. Settled once ksmd finished `min_scans` full scans after the first sample (a
    page merges on its second scan at the earliest) and `pages_sharing` moved by at most `tolerance` of
    it (and 16 pages) over the last one."""
    if not samples:
        return False
    ends: list[tuple[int, int]] = []  # the first sample after each scan ended: its result
    for scans, sharing in samples:
        if not ends or scans != ends[-1][0]:
            ends.append((scans, sharing))
    if ends[-1][0] - ends[0][0] < min_scans or len(ends) < 2:
        return False
    (_, before), (_, last) = ends[-2], ends[-1]
    return abs(last - before) <= max(16, tolerance * last)
