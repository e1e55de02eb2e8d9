"""Metrics: one record per iteration to the console, ``metrics.jsonl`` and TensorBoard, and a PNG plot.

The plot (reward, success, KL, or the entropy when no KL is computed, and MaxVio per iteration) is
rewritten at the end of a run and on Ctrl-C (``rl.train`` calls ``plot`` from its ``finally``), so an
interrupted run still leaves its curve.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

PLOTTED = (
    ("success", "success rate"),
    ("reward", "mean episode reward"),
    ("kl", "KL to reference"),
    ("maxvio", "MaxVio (mean over MoE layers)"),
)


class MetricsLogger:
    """Appends records to ``<run_dir>/metrics.jsonl`` and TensorBoard events under ``<run_dir>/tb``."""

    def __init__(self, run_dir: str | Path, tensorboard: bool = True) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl_path = self.run_dir / "metrics.jsonl"
        self.history: list[dict[str, Any]] = []
        self._writer = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(str(self.run_dir / "tb"))

    def log(self, iteration: int, record: dict[str, Any]) -> None:
        record = {"iteration": iteration, **record}
        self.history.append(record)
        with self.jsonl_path.open("a") as f:
            f.write(json.dumps(record, default=_jsonable) + "\n")
        if self._writer is not None:
            for key, value in record.items():
                if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
                    self._writer.add_scalar(key, value, iteration)
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def plot(
        self, path: str | Path | None = None, panels: tuple[tuple[str, str], ...] = PLOTTED
    ) -> Path | None:
        """Write the learning curve PNG (default ``<run_dir>/learning_curve.png``); None if no data."""
        return plot_history(self.history, path or self.run_dir / "learning_curve.png", panels=panels)


def first_reaching(history: list[dict[str, Any]], window: int, target: float) -> int | None:
    """Index of the first record at which the mean ``success`` of the last ``window`` records is at least
    ``target`` (the trainer's ``stop_at_success`` rule, read back from a run's records); None if never."""
    success = [r["success"] for r in history]
    return next((i for i in range(window - 1, len(success))
                 if sum(success[i - window + 1 : i + 1]) / window >= target), None)


# a panel whose metric was not computed in the run (every record 0 or missing) shows another instead
FALLBACK = {"kl": ("entropy", "policy entropy (no KL: computed only with algo.kl_coef > 0)")}


def _panel(history: list[dict[str, Any]], key: str, label: str) -> tuple[str, str]:
    """The (key, title) to draw for a panel: ``key`` when any record has a non-zero value of it, else its
    `FALLBACK` (e.g. the KL is a flat 0 without a reference policy, so its panel shows the entropy)."""
    computed = any(r.get(key) not in (None, 0, 0.0) for r in history)
    if computed or key not in FALLBACK:
        return key, label
    return FALLBACK[key]


def plot_history(
    history: list[dict[str, Any]],
    path: str | Path,
    title: str | None = None,
    panels: tuple[tuple[str, str], ...] = PLOTTED,
) -> Path | None:
    """Four panels ``(metric key, title)`` (the RL curve by default) against wall time or iteration."""
    if not history:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(10, 6.5), sharex=True)
    x_key = "elapsed_s" if all("elapsed_s" in r for r in history) else "iteration"
    xs = [r[x_key] / 60 if x_key == "elapsed_s" else r[x_key] for r in history]
    for ax, panel in zip(axes.flat, panels, strict=True):
        key, label = _panel(history, *panel)
        ys = [r.get(key, float("nan")) for r in history]
        ax.plot(xs, ys, lw=1.5)
        ax.set_title(label, fontsize=10)
        ax.grid(alpha=0.3)
        if key == "success":
            ax.set_ylim(-0.02, 1.02)
            ax.axhline(0.9, color="gray", ls="--", lw=1)
    for ax in axes[1]:
        ax.set_xlabel("wall time (min)" if x_key == "elapsed_s" else "iteration")
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _jsonable(value: Any) -> Any:
    try:
        return float(value)
    except (TypeError, ValueError):
        return str(value)
