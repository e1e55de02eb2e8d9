"""The arithmetic of the fixed-memory table (`bench/train.py --part memory`), apart from the runs: a run's
steady-state rate, each row's spread over its repeated runs (median, min, max), the comparison of row (c)
with row (a) a verdict rests on (ratio of medians, the extremes, how many runs meet it, which broke the
memory budget, and when there is no verdict), the break-even latencies inferred from the medians, and the
plot of episodes/s against the emulated policy latency.

Kept free of Ray, Docker and torch so that it is checked by fast unit tests (tests/bench/).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from bench_stats import Spread, spread

STEADY_ITERATIONS = 5  # iterations after the first a rate is taken over (the first: start-up, templates)
MIN_REPEATS = 3  # runs per row and latency a verdict rests on (their median): one run can straddle a line


def steady_rate(history: Sequence[Mapping[str, float]], key: str,
                min_iterations: int = STEADY_ITERATIONS) -> float | None:
    """``key`` per second over the iterations after the first (each record's ``elapsed_s`` is the time
    at its end), or None when the run has fewer than ``min_iterations`` of them: no whole-run fallback,
    which would count start-up against steady state."""
    if len(history) < 1 + min_iterations:
        return None
    span = history[-1]["elapsed_s"] - history[0]["elapsed_s"]
    if span <= 0:
        return None
    return sum(r[key] for r in history[1:]) / span


def crossing(latencies: Sequence[float], ratios: Sequence[float | None],
             threshold: float) -> tuple[str, float | None]:
    """The latency above which ``ratio`` (row (c) over row (a)) reaches ``threshold``, inferred by linear
    interpolation between the measured latencies (in increasing order; None: not measured there).
    Returns (words, value): value None when it is not within the measured range, the words say which
    way. Only the last crossing from below counts: above it every measured ratio is at or over it."""
    points = [(lat, r) for lat, r in zip(latencies, ratios, strict=True) if r is not None]
    if not points:
        return "not inferable: no latency with both rows measured", None
    if all(r < threshold for _lat, r in points):
        return f"above {points[-1][0]:g} s (not reached at any measured latency)", None
    last_below = max((i for i, (_lat, r) in enumerate(points) if r < threshold), default=None)
    if last_below is None:
        return f"at or below {points[0][0]:g} s (reached at every measured latency)", points[0][0]
    if last_below == len(points) - 1:
        return f"above {points[-1][0]:g} s (below it again at the highest measured latency)", None
    (l0, r0), (l1, r1) = points[last_below], points[last_below + 1]
    value = l0 + (threshold - r0) * (l1 - l0) / (r1 - r0)
    return f"{value:.1f} s (inferred: linear between {l0:g} s and {l1:g} s)", value


def verdict(met: bool | None, figure: str) -> str:
    """A target line's end: **met** or **missed** and the figure (``met`` None: not measured)."""
    if met is None:
        return f"**missed**: not measured ({figure})"
    return f"**{'met' if met else 'missed'}**: {figure}"


def no_verdict(reason: str) -> str:
    """A target line's end when the runs cannot carry a verdict, and why."""
    return f"**no verdict**: {reason}"


Cell = tuple[str, float]  # (row key, emulated policy latency in s)
RUN_KEYS = ("row", "latency", "session", "repeat")  # what every run of a row log names


def cells(records: Iterable[Mapping]) -> dict[Cell, list[dict]]:
    """A row log's runs grouped by (row, latency), each cell's runs ordered by session and ``repeat``.
    Every run names its row, latency, session (the bench command that measured it) and repeat; the same
    repeat of one cell twice in one session (a log appended twice) is refused."""
    out: dict[Cell, list[dict]] = {}
    for i, rec in enumerate(records, 1):
        missing = [k for k in RUN_KEYS if k not in rec]
        if missing:
            raise ValueError(f"run {i} of the row log lacks {', '.join(missing)} (it has: "
                             f"{', '.join(sorted(rec)) or 'nothing'})")
        out.setdefault((str(rec["row"]), float(rec["latency"])), []).append(dict(rec))
    for (row, lat), runs in out.items():
        seen = [(str(r["session"]), r["repeat"]) for r in runs]
        twice = sorted({x for x in seen if seen.count(x) > 1})
        if twice:
            raise ValueError(f"row ({row}) at {lat:g} s has repeat {twice[0][1]} of session {twice[0][0]} "
                             "more than once")
        runs.sort(key=lambda r: (str(r["session"]), r["repeat"]))
    return out


def run_rate(run: Mapping) -> float | None:
    """A run's steady episodes/s; None for a failed run or one without its steady window."""
    return None if "error" in run else run.get("episodes_per_s")


def run_peak(run: Mapping) -> float | None:
    """A run's peak sandbox memory (MiB, host samples); None for a failed run."""
    return None if "error" in run else run.get("peak_mib")


def budget_breaches(runs: Sequence[Mapping], budget_mib: float) -> list[str]:
    """Each of one cell's runs (`cells`) whose peak sandbox memory broke the budget, named by row,
    latency, repeat and peak: ``(c) at 10 s, repeat 2 of 3: 2202 MiB``."""
    return [f"({r['row']}) at {float(r['latency']):g} s, repeat {r['repeat']} of {len(runs)}: {p:.0f} MiB"
            for r in runs if (p := run_peak(r)) is not None and p > budget_mib]


@dataclass(frozen=True)
class Comparison:
    """Row (c)'s runs against row (a)'s at one latency, for a target "(c) >= threshold x (a)" (and
    within a memory budget when one is given)."""

    latency: float
    threshold: float
    budget_mib: float | None
    c: Spread | None  # (c)'s episodes/s over its runs with a steady rate
    a: Spread | None  # (a)'s
    peak: Spread | None  # (c)'s peak sandbox memory, MiB
    runs: int  # runs of (c)
    meeting: int  # runs of (c) at or above threshold x (a)'s median, within the budget when one is given
    over_budget: tuple[str, ...]  # runs of (c) that broke the budget (`budget_breaches`)
    refusal: str | None  # why no verdict may be drawn; None: one may

    @property
    def ratio(self) -> float | None:
        """The ratio of the medians, (c) over (a)."""
        return None if self.c is None or self.a is None else self.c.median / self.a.median

    @property
    def worst(self) -> float | None:
        """min (c) / max (a): the ratio at the extremes least favourable to (c)."""
        return None if self.c is None or self.a is None else self.c.low / self.a.high

    @property
    def best(self) -> float | None:
        """max (c) / min (a): the ratio at the extremes most favourable to (c)."""
        return None if self.c is None or self.a is None else self.c.high / self.a.low


def _elsewhere(runs: Sequence[Mapping], session: str) -> str:
    """Where the runs not measured by ``session`` come from, in words ('' when all were)."""
    return "; ".join(sorted({f"session {r['session']}, commit {r.get('commit') or 'unknown'}"
                             for r in runs if r["session"] != session}))


def compare(c_runs: Sequence[Mapping], a_runs: Sequence[Mapping], latency: float, threshold: float,
            session: str, budget_mib: float | None = None, min_runs: int = MIN_REPEATS) -> Comparison:
    """Row (c)'s runs at ``latency`` against row (a)'s (one cell each, `cells`). ``session``: the bench
    command whose verdicts these are. A verdict compares only runs that command measured itself, (a) and
    (c) alike (a baseline from a reused log, another commit or another day: none), and needs at least
    ``min_runs`` runs of each with a steady rate; ``refusal`` says what is lacking."""
    c, a = spread(run_rate(r) for r in c_runs), spread(run_rate(r) for r in a_runs)
    meeting = 0 if a is None else sum(
        1 for r in c_runs
        if (v := run_rate(r)) is not None and v >= threshold * a.median
        and (budget_mib is None or (run_peak(r) or 0.0) <= budget_mib))
    reasons = []
    if not a_runs:
        reasons.append(f"baseline not measured in this run: no run of (a) at {latency:g} s")
    elif where := _elsewhere(a_runs, session):
        reasons.append(f"baseline not measured in this run: (a) at {latency:g} s comes from {where}")
    if not c_runs:
        reasons.append(f"no run of (c) at {latency:g} s")
    elif where := _elsewhere(c_runs, session):
        reasons.append(f"(c) at {latency:g} s not measured in this run: it comes from {where}")
    for key, runs, got in (("a", a_runs, a), ("c", c_runs, c)):
        steady = 0 if got is None else got.count
        if runs and steady < min_runs:
            reasons.append(f"({key}) at {latency:g} s has {steady} run{'s' * (steady != 1)} with a steady "
                           f"rate (of {len(runs)}), {min_runs} needed")
    return Comparison(latency, threshold, budget_mib, c, a, spread(run_peak(r) for r in c_runs), len(c_runs),
                      meeting, tuple(budget_breaches(c_runs, budget_mib)) if budget_mib is not None else (),
                      "; ".join(reasons) or None)


def _extremes(worst_met: bool, best_met: bool) -> str:
    """Whether a verdict holds at the extremes of the runs, in words."""
    if worst_met and best_met:
        return "met at both extremes"
    if worst_met or best_met:
        return f"met only at {'min (c) / max (a)' if worst_met else 'max (c) / min (a)'}"
    return "missed at both extremes"


def ratio_verdict(cmp: Comparison) -> str:
    """The end of a target line "(c) >= threshold x (a)": **met** or **missed** on the ratio of medians
    (and (c)'s median peak within the budget), with how many runs of (c) meet it against (a)'s median,
    the ratios at the extremes, and every run over the budget; or **no verdict** and why."""
    t = cmp.threshold
    if cmp.refusal is not None:
        info = "" if cmp.ratio is None else f" (ratio of medians {cmp.ratio:.2f}x, for information only)"
        return no_verdict(cmp.refusal + info)
    assert cmp.c is not None and cmp.a is not None and cmp.peak is not None  # no refusal: both measured
    ratio, worst, best = cmp.c.median / cmp.a.median, cmp.c.low / cmp.a.high, cmp.c.high / cmp.a.low
    within = cmp.budget_mib is None or cmp.peak.median <= cmp.budget_mib
    text = (f"**{'met' if ratio >= t and within else 'missed'}** on the median ({cmp.meeting} of {cmp.runs} "
            f"runs): {ratio:.2f}x, the ratio of medians ((c) {cmp.c.text()} / (a) {cmp.a.text()} episodes/s, "
            f"median (min-max) of the runs); min (c) / max (a) {worst:.2f}x, max (c) / min (a) {best:.2f}x "
            f"({_extremes(worst >= t, best >= t)})")
    if cmp.budget_mib is not None:
        text += (f"; (c) peaking at {cmp.peak.text('.0f')} MiB of sandbox memory (host samples); over the "
                 f"{cmp.budget_mib:.0f} MiB budget: {', '.join(cmp.over_budget) or 'no run'}")
    return text


@dataclass(frozen=True)
class BreakEven:
    """The latency from which (c) reaches a multiple of (a), inferred (`crossing`) from the ratios of
    medians and from the extremes' ratios; ``refusal``: why no verdict may rest on it."""

    median: tuple[str, float | None]
    worst: tuple[str, float | None]  # from min (c) / max (a)
    best: tuple[str, float | None]  # from max (c) / min (a)
    refusal: str | None
    lowest_s: float | None = None  # the lowest latency with a ratio: reached there, the break-even is below


def break_even(comparisons: Sequence[Comparison], threshold: float) -> BreakEven:
    """`BreakEven` over one `Comparison` per measured latency (in increasing order); no verdict when
    any latency has none (the first one's reasons, and the others named) or none was compared."""
    lats = [c.latency for c in comparisons]
    refused = [c for c in comparisons if c.refusal]
    refusal = None if not refused else refused[0].refusal + (
        "; no verdict either at " + ", ".join(f"{c.latency:g} s" for c in refused[1:]) if refused[1:] else "")
    measured = [c.latency for c in comparisons if c.ratio is not None]
    return BreakEven(crossing(lats, [c.ratio for c in comparisons], threshold),
                     crossing(lats, [c.worst for c in comparisons], threshold),
                     crossing(lats, [c.best for c in comparisons], threshold),
                     refusal if comparisons else "no latency compared", min(measured, default=None))


def break_even_verdict(be: BreakEven, limit_s: float) -> str:
    """The end of the target line "break-even at or below ``limit_s``": **met** or **missed** on the
    medians' crossing, with the extremes' crossings; or **no verdict** and why."""
    if be.refusal is not None:
        return no_verdict(f"{be.refusal} (from the medians: {be.median[0]}, for information only)")
    if be.median[1] is not None and be.median[1] == be.lowest_s and be.lowest_s > limit_s:
        return no_verdict(f"reached already at the lowest latency measured, {be.lowest_s:g} s, above the "
                          f"target's {limit_s:g} s: the break-even lies somewhere below it (a sweep over "
                          "lower latencies places it)")
    at = lambda found: found[1] is not None and found[1] <= limit_s  # noqa: E731
    return (f"**{'met' if at(be.median) else 'missed'}** on the median: {be.median[0]}; from the extremes' "
            f"ratios: min (c) / max (a) {be.worst[0]}, max (c) / min (a) {be.best[0]} "
            f"({_extremes(at(be.worst), at(be.best))})")


Rates = Mapping[str, Mapping[float, Sequence[float | None]]]  # row key -> latency -> each run's episodes/s


def sweep_points(rates: Rates) -> dict[str, list[tuple[float, Spread]]]:
    """Per row, the (latency, spread of its runs' episodes/s) points a plot draws, by latency; a latency
    where no run of the row has a (positive) rate is left out."""
    out = {}
    for key, by_latency in rates.items():
        points = [(lat, s) for lat, runs in sorted(by_latency.items())
                  if (s := spread(v for v in runs if v)) is not None]
        if points:
            out[key] = points
    return out


def plot_sweep(rates: Rates, labels: Mapping[str, str], path: Path, title: str) -> None:
    """Episodes/s against emulated policy latency, one line per row through the medians of its runs with
    min-max bars (`sweep_points`: a latency without a rate leaves a gap), log scale on y."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for key, points in sweep_points(rates).items():
        medians = [s.median for _lat, s in points]
        bars = [[s.median - s.low for _lat, s in points], [s.high - s.median for _lat, s in points]]
        ax.errorbar([lat for lat, _s in points], medians, yerr=bars, marker="o", capsize=3,
                    label=labels.get(key, key))
    ax.set_xlabel("emulated policy latency per turn (s)")
    ax.set_ylabel("episodes/s (steady state): median, min-max")
    ax.set_yscale("log")
    ax.set_title(title)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
