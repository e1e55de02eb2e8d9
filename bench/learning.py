"""Learning benchmark: does `make train`'s config reach its target on every seed, and how fast?

Runs ``python -m rl.train seed=S`` per seed, one after the other, and reports when the stop rule held.
Replaces the ``bench:learning`` section of docs/benchmarks.md.
Usage: python bench/learning.py --seeds N [overrides]

Design: docs/design/benchmarks.md#bench-learning.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from bench_report import ROOT, training_machine, write_section

IMAGE = ROOT / "docs" / "img" / "learning_seeds.png"
MAXVIO_FROM = 20  # iterations before this are the balancing's warm-up and not judged


def run_seed(seed: int, overrides: list[str], run_dir: Path) -> dict:
    """One `python -m rl.train` process; its per-iteration records and wall time."""
    command = [sys.executable, "-m", "rl.train", f"seed={seed}", "trainer.progress_bar=false",
               f"hydra.run.dir={run_dir}", *overrides]
    start = time.monotonic()
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    wall = time.monotonic() - start
    if proc.returncode != 0:
        output = (proc.stdout + proc.stderr)[-3000:]
        raise SystemExit(f"seed {seed}: rl.train exited {proc.returncode}:\n{output}")
    history = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    config = (run_dir / "resolved_config.yaml").read_text()
    return {"seed": seed, "history": history, "wall_s": wall, "config": config}


def summarise(run: dict, window: int, target: float) -> dict:
    from rl.metrics import first_reaching  # after ROOT is on sys.path

    history = run["history"]
    success = [r["success"] for r in history]
    reached = first_reaching(history, window, target)
    late = [r for r in history if r["iteration"] >= MAXVIO_FROM and "maxvio_floor" in r]
    return {
        "seed": run["seed"],
        "iterations": len(history),
        "reached_iteration": None if reached is None else history[reached]["iteration"],
        "reached_min": None if reached is None else history[reached]["elapsed_s"] / 60,
        "final_success": float(np.mean(success[-window:])),
        "wall_min": run["wall_s"] / 60,
        "maxvio": float(np.mean([r["maxvio"] for r in late])) if late else None,
        "maxvio_floor": float(np.mean([r["maxvio_floor"] for r in late])) if late else None,
        "final_entropy": float(np.mean([r["entropy"] for r in history[-window:]])),
    }


def plot(runs: list[dict], target: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for run in runs:
        h = run["history"]
        minutes = [r["elapsed_s"] / 60 for r in h]
        axes[0].plot(minutes, [r["success"] for r in h], lw=1.2, label=f"seed {run['seed']}")
        axes[1].plot(minutes, [r["entropy"] for r in h], lw=1.2)
        axes[2].plot([r["iteration"] for r in h], [r.get("maxvio", np.nan) for r in h], lw=1.0)
        axes[2].plot([r["iteration"] for r in h], [r.get("maxvio_floor", np.nan) for r in h], lw=1.0,
                     ls="--", color="grey")
    axes[0].axhline(target, color="black", lw=0.8, ls=":")
    axes[0].set(title="success per iteration", xlabel="wall time (min)")
    axes[1].set(title="policy entropy (nats per action token)", xlabel="wall time (min)")
    axes[2].set(title="in-loop MaxVio (dashed: sampling floor)", xlabel="iteration")
    axes[0].legend(fontsize=8)
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=5, help="run seeds 0..N-1 (default 5)")
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every seed")
    args = parser.parse_args()
    machine = training_machine()
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    runs = []
    with tempfile.TemporaryDirectory(prefix="k3rl-bench-learning-") as tmp:
        for seed in range(args.seeds):
            print(f"seed {seed} ...", flush=True)
            runs.append(run_seed(seed, args.overrides, Path(tmp) / f"seed{seed}"))
    import yaml

    trainer = yaml.safe_load(runs[0]["config"])["trainer"]
    window, target = int(trainer["success_window"]), float(trainer["stop_at_success"])
    rows = [summarise(run, window, target) for run in runs]
    plot(runs, target, IMAGE)

    command = "python bench/learning.py" + f" --seeds {args.seeds}" + "".join(f" {o}" for o in args.overrides)
    lines = [
        "## Learning (`bench/learning.py`)",
        "",
        f"`make train`'s config{' with ' + ' '.join(args.overrides) if args.overrides else ''} on seeds "
        f"0-{args.seeds - 1}, one `python -m rl.train seed=S` process after the other; measured {started}. "
        f"Command: `{command}`. {machine}.",
        "",
        f"Target: mean success of the last {window} iterations >= {target} (the trainer stops there; "
        f"`trainer.time_limit_s`={trainer['time_limit_s']} s, `trainer.iterations`={trainer['iterations']}). "
        "Time to target is wall time from the trainer's start (Ray and sandbox start-up included). "
        f"MaxVio is the in-loop value (routing of each optimizer step's batch with the bias balanced on the "
        f"previous step), mean over MoE layers and over iterations >= {MAXVIO_FROM}; its floor is what a "
        "perfectly balanced router shows on the same tokens: every distinct causal context (tokens with "
        "one shared prefix route together) sends its tokens to k experts drawn uniformly, mean of 32 draws.",
        "",
        "| seed | reached target | at iteration | final success | iterations | wall time | final entropy "
        "| MaxVio / floor (it >= 20) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        reached = f"{r['reached_min']:.1f} min" if r["reached_min"] is not None else "**not reached**"
        vio = (f"{r['maxvio']:.2f} / {r['maxvio_floor']:.2f} ({r['maxvio'] / r['maxvio_floor']:.1f}x)"
               if r["maxvio"] is not None else "-")
        at = r["reached_iteration"] if r["reached_iteration"] is not None else "-"
        lines.append(
            f"| {r['seed']} | {reached} | {at} "
            f"| {r['final_success']:.2f} | {r['iterations']} | {r['wall_min']:.1f} min | "
            f"{r['final_entropy']:.2f} | {vio} |"
        )
    reached = [r for r in rows if r["reached_min"] is not None]
    lines += [
        "",
        f"{len(reached)} of {len(rows)} seeds reached the target"
        + (f"; slowest {max(r['reached_min'] for r in reached):.1f} min." if reached else "."),
        "",
        f"![success, entropy and MaxVio of every seed](img/{IMAGE.name})",
    ]
    text = "\n".join(lines)
    print(text)
    if not args.no_write:
        write_section("learning", text)


if __name__ == "__main__":
    main()
