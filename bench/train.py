"""Training benchmark: how fast the tiny K3 policy learns the default task, and what a rollout costs.

Two parts, both in this run on this machine:

1. **Rollout micro-benchmark** (no Ray, the untrained policy): env steps/s of the default task with
   (a) the persistent shell session and seed-reset groups (the default), (b) one ``docker exec`` per
   command (the baseline), (c) forked group starts (reset once + CRIU fork of the sandbox).
2. **Training run** with the default config (``make train``): success at the start, wall time until
   the mean success of the last ``trainer.success_window`` iterations reaches 0.9, env steps/s,
   generated tokens/s, and the fraction of each iteration the learner waits on rollouts.

Results replace the ``bench:train`` section of docs/benchmarks.md; the learning curve goes to
docs/img/train_learning_curve.png.

    python bench/train.py            # full (about 10-15 minutes on 2 cores)
    python bench/train.py --quick    # smoke version (about 2 minutes): short training, fewer episodes
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

from bench_report import write_section

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))



def compose(overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from rl.train import resolve_config

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        return resolve_config(hydra_compose("config", overrides=overrides))


def rollout_throughput(overrides: list[str], groups: int, repeats: int) -> dict:
    """Env steps/s of `EpisodeRunner` (after one warm-up run that creates the sandboxes)."""
    import torch

    from rl.generation import build_engine
    from rl.learner import build_policy
    from rl.rollout import EpisodeRunner
    from rl.tokenizer import build_tokenizer

    cfg = compose(overrides)
    torch.set_num_threads(1)
    tokenizer = build_tokenizer(cfg.tokenizer)
    policy = build_policy(cfg.model, cfg.seed)
    engine = build_engine(cfg.rollout, policy, tokenizer, cfg.env.action_vocabulary)
    runner = EpisodeRunner(cfg.env, cfg.rollout, engine, tokenizer, cfg.sandbox)
    group = cfg.algo.group_size
    try:
        runner.run(list(range(groups)), group, torch.Generator().manual_seed(0))  # warm-up
        steps = step_s = reset_s = total = forks = fork_s = 0.0
        for r in range(repeats):
            _, stats = runner.run(
                list(range(100 + r * groups, 100 + (r + 1) * groups)), group, torch.Generator().manual_seed(r)
            )
            steps += stats.env_steps
            step_s += stats.env_step_s
            reset_s += stats.reset_s
            total += stats.total_s
            forks += stats.forks
            fork_s += stats.fork_s
    finally:
        runner.close()
    return {
        "env_steps_per_s": steps / max(step_s + reset_s, 1e-9),
        "step_ms": 1000 * step_s / max(steps, 1),
        "episodes_per_s": groups * group * repeats / total,
        "fork_ms": 1000 * fork_s / forks if forks else None,
    }


def training_run(overrides: list[str], run_dir: Path) -> dict:
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from rl.metrics import first_reaching
    from rl.train import train

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = hydra_compose("config", overrides=overrides)
    result = train(cfg, run_dir)
    history = result.history
    reached = first_reaching(history, int(cfg.trainer.success_window), 0.9)
    reached_at = None if reached is None else history[reached]["elapsed_s"]
    total = lambda key: sum(r[key] for r in history)  # noqa: E731
    return {
        "result": result,
        "iterations": len(history),
        "start_success": result.start_success,
        "end_success": result.end_success,
        "time_to_0_9_s": reached_at,
        "episodes": total("episodes"),
        "env_steps_per_s": total("env_steps") / total("rollout_s"),
        "generated_tokens_per_s": total("generated_tokens") / total("generate_s"),
        "learner_wait_fraction": total("rollout_s") / total("iteration_s"),
        "rollout_s_per_iter": total("rollout_s") / len(history),
        "learner_s_per_iter": total("learner_s") / len(history),
        "wall_s": result.wall_s,
    }




def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="short training and fewer rollout repeats")
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    parser.add_argument(
        "overrides", nargs="*", help="Hydra overrides for every part (e.g. sandbox.image=...)"
    )
    args = parser.parse_args()
    os.environ.setdefault("RAY_worker_niceness", "0")
    user = list(args.overrides)
    groups, repeats = (2, 2) if args.quick else (8, 3)
    rollout_group_size = compose(user).algo.group_size

    print("rollout micro-benchmark ...", flush=True)
    variants = {
        "exec per command, seed groups (baseline)": ["env.kwargs.session=false"],
        "shell session, seed groups (default)": [],
        "shell session, forked groups": ["env.group_start=fork"],
    }
    rollout = {name: rollout_throughput([*o, *user], groups, repeats) for name, o in variants.items()}
    base = rollout["exec per command, seed groups (baseline)"]["env_steps_per_s"]
    for name, r in rollout.items():
        print(f"  {name}: {r['env_steps_per_s']:.0f} env steps/s ({r['env_steps_per_s'] / base:.1f}x)")

    print("training run ...", flush=True)
    train_overrides = ["trainer.progress_bar=false", *user]
    if args.quick:
        train_overrides = ["trainer.iterations=6", "trainer.time_limit_s=120", *train_overrides]
    run_dir = Path(tempfile.mkdtemp(prefix="k3rl-bench-train-"))
    t = training_run(train_overrides, run_dir)
    image = ROOT / "docs" / "img" / "train_learning_curve.png"
    image.parent.mkdir(parents=True, exist_ok=True)
    if t["result"].plot is not None and not args.no_write:  # --no-write leaves docs/ alone
        from rl.metrics import plot_history

        plot_history(t["result"].history, image, title="k3_tiny, GRPO, GuessNumber (make train)")

    reached = f"{t['time_to_0_9_s'] / 60:.1f} min" if t["time_to_0_9_s"] else "not reached"
    command = "python bench/train.py" + (" --quick" if args.quick else "") + "".join(f" {o}" for o in user)
    lines = [
        "## Training (`bench/train.py`)",
        "",
        f"Machine: {os.cpu_count()} CPU cores ({platform.processor() or platform.machine()}), no GPU; "
        f"measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. Command: `{command}`.",
        "Other jobs shared the cores during the run, so wall times are upper bounds.",
        "",
        "Rollout of the default task (GuessNumber, untrained tiny K3 policy, "
        f"{groups} groups x {rollout_group_size} episodes, {repeats} repeats; env steps/s = steps / "
        "wall time of the parallel reset (and fork) and step phases; episodes/s includes generation):",
        "",
        "| sandbox access / group start | env steps/s | episodes/s | fork ms per sandbox | vs baseline |",
        "|---|---|---|---|---|",
    ]
    for name, r in rollout.items():
        fork = f"{r['fork_ms']:.0f}" if r["fork_ms"] else "-"
        lines.append(
            f"| {name} | {r['env_steps_per_s']:.0f} | {r['episodes_per_s']:.1f} | {fork} | "
            f"{r['env_steps_per_s'] / base:.1f}x |"
        )
    lines += [
        "",
        f"Training with the default config (`make train`; {t['iterations']} iterations, "
        f"{t['episodes']:.0f} episodes):",
        "",
        "| figure | value |",
        "|---|---|",
        f"| success at the start (first iteration) | {t['start_success']:.2f} |",
        f"| success at the end (mean of the last iterations) | {t['end_success']:.2f} |",
        f"| wall time to 0.9 success | {reached} |",
        f"| total wall time (incl. Ray and sandbox start-up) | {t['wall_s'] / 60:.1f} min |",
        f"| env steps/s during rollout | {t['env_steps_per_s']:.0f} |",
        f"| generated tokens/s | {t['generated_tokens_per_s']:.0f} |",
        f"| rollout / learner seconds per iteration | {t['rollout_s_per_iter']:.2f} / "
        f"{t['learner_s_per_iter']:.2f} |",
        f"| fraction of time the learner waits on rollouts | {t['learner_wait_fraction']:.2f} |",
        "",
        "![learning curve](img/train_learning_curve.png)",
    ]
    text = "\n".join(lines)
    print(text)
    if not args.no_write:
        write_section("train", text)
        print(f"\nwrote the train section of {ROOT / 'docs' / 'benchmarks.md'} and {image}")
    shutil.rmtree(run_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
