"""The arithmetic of the fixed-memory table (`bench/train.py --part memory`), apart from the runs: a run's
steady-state rate, the break-even latencies inferred from the measured rows, the target lines, and the
plot of episodes/s against the emulated policy latency.

Kept free of Ray, Docker and torch so that it is checked by fast unit tests (tests/bench/).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

STEADY_ITERATIONS = 5  # iterations after the first a rate is taken over (the first: start-up, templates)


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


def plot_sweep(rates: Mapping[str, Mapping[float, float | None]], labels: Mapping[str, str], path: Path,
               title: str) -> None:
    """Episodes/s against emulated policy latency, one line per row (rows without a steady rate at a
    latency leave a gap there), log scale on y."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for key, by_latency in rates.items():
        points = sorted((lat, v) for lat, v in by_latency.items() if v)
        if points:
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=labels.get(key, key))
    ax.set_xlabel("emulated policy latency per turn (s)")
    ax.set_ylabel("episodes/s (steady state)")
    ax.set_yscale("log")
    ax.set_title(title)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
