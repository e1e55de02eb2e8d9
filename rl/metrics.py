"""Metrics: one record per iteration to the console, ``metrics.jsonl`` and TensorBoard, and a PNG plot.

The plot (reward, success with the held-out ``eval_success`` beside it when the run evaluates, KL, or the
entropy when no KL is computed, and MaxVio per iteration) is rewritten at the end of a run and on Ctrl-C
(``rl.train`` calls ``plot`` from its ``finally``), so an interrupted run still leaves its curve.
``python -m rl.metrics RUN_DIR`` prints a run's metrics as a table (`run_table`).
"""

from __future__ import annotations

import json
import math
import sys
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
            held_out = [(x, r["eval_success"]) for x, r in zip(xs, history, strict=True)
                        if "eval_success" in r]
            if held_out:  # trainer.eval_every: the held-out games beside the training episodes
                ax.plot(*zip(*held_out, strict=True), "o-", lw=1, ms=3, label="held-out (eval_success)")
                ax.legend(fontsize=8, loc="lower right")
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


SHOWN = ("success", "eval_success", "reward", "turns", "episodes_cut_by_max_turns", "episodes_cut_by_tokens",
         "failed_episodes")


def run_table(run_dir: str | Path) -> str:
    """A run folder's ``metrics.jsonl`` as a table: one row per iteration, the columns of `SHOWN` that the
    run recorded and the task's own metrics (``<Task>/<key>``, `rl.task_metrics`)."""
    from rl.task_metrics import task_name

    run_dir = Path(run_dir)
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file (a run folder of `python -m rl.train` holds it)")
    history = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    prefix = ""
    resolved = run_dir / "resolved_config.yaml"
    if resolved.is_file():
        import yaml

        env_id = ((yaml.safe_load(resolved.read_text()) or {}).get("env") or {}).get("id", "")
        prefix = f"{task_name(env_id)}/" if env_id else ""
    columns = [k for k in SHOWN if any(k in r for r in history)]
    columns += sorted({k for r in history for k in r if prefix and k.startswith(prefix)})
    rows = [["iteration", *columns]]
    for record in history:
        cells = [record.get(k) for k in columns]
        rows.append([str(record["iteration"]), *("-" if v is None else f"{v:.3g}" for v in cells)])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in rows)


def main(argv: list[str] | None = None) -> int:
    """``python -m rl.metrics RUN_DIR``: print `run_table`."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m rl.metrics",
                                     description="a training run's metrics, one row per iteration")
    parser.add_argument("run_dir", help="the run folder (hydra.run.dir, outputs/<date>/<time>)")
    args = parser.parse_args(argv)
    try:
        print(run_table(args.run_dir))
    except FileNotFoundError as exc:
        print(f"rl.metrics: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
