"""Can RL beat its teacher? Demonstrations of a weak scripted expert, SFT on them, then GRPO from the
SFT weights; does the RL policy end clearly above both the SFT policy and the expert? (Each section's
title says what the figures show: `outcome_title`.)

Each task's results replace its own section of docs/benchmarks.md.
Usage: python bench/teacher.py --task guess_number_32|find_value [--no-write]

Design: docs/design/benchmarks.md#bench-teacher.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from bench_report import ROOT, compose, training_machine, write_section
from cold_start import Recipe, make, stage

TASKS = {
    "guess_number_32": {
        "env": ["env=guess_number_32"],
        "experts": {"random_split": 1.0},  # quality -> share of the demonstrations
        "demos": 1000,
        "sft": [],
        "rl": ["algo.entropy_coef=0.0", "algo.optim.lr=3e-4"],  # GRPO from the SFT policy
        "stop_at_success": 0.92,
        "rl_minutes": 25.0,
        "min_gain": 0.2,
        "beat_expert": True,  # S_rl must also end above the weak expert's success
        "max_minutes": 45,  # all stages
        "section": "teacher",  # of docs/benchmarks.md
    },
    "find_value": {
        "env": ["env=find_value", "env.group_start=seed"],
        "experts": {"wasteful": 0.75, "grep": 0.25},
        "demos": 1000,
        # 15 epochs of 900 training episodes in batches of 32 (435 steps): copying the six digits of the
        # value byte by byte forms late; at 10 epochs (290 steps) one SFT run won 0.37 of the games, a
        # rerun of the same recipe 0.03 (held-out action loss 0.042, most values miscopied)
        "sft": ["sft.epochs=15", "sft.optim.decay_steps=435"],
        "rl": [
            "algo.entropy_coef=0.0",
            "algo.optim.lr=3e-4",
            "algo.kl_coef=0.05",  # to the SFT policy: keeps its copying sharp while the strategy shifts;
            "algo.kl_estimator=k2",  # k2's gradient grows linearly where the policy left the SFT's, k3's
            # exponentially (k3 spiked the gradient norm to 27-47 on a few tokens: measured)
            "rollout.sandbox_pool.pause_policy=never",  # 64 small sandboxes: pausing them between
            # iterations frees memory nobody needs and costs 64 dumps and restores on the learner's cores
        ],
        "stop_at_success": 0.92,
        "rl_minutes": 33.0,
        "min_gain": 0.15,
        "beat_expert": False,
        "max_minutes": 60,
        "section": "teacher-find-value",
    },
}


def evaluate(overrides: list[str], episodes: int):
    from rl.driver.evaluate import success_rate

    return success_rate(compose(overrides), episodes)


def plot(history: list[dict], expert: float, sft: float, rl: float, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    minutes = [r["elapsed_s"] / 60 for r in history]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(
        minutes, [r["success"] for r in history], color="tab:blue", alpha=0.35, label="GRPO batch success"
    )
    window = 5
    smooth = [
        sum(r["success"] for r in history[max(0, i - window + 1) : i + 1]) / min(i + 1, window)
        for i in range(len(history))
    ]
    ax.plot(minutes, smooth, color="tab:blue", label=f"GRPO, mean of {window} iterations")
    ax.axhline(expert, color="tab:gray", linestyle=":", label=f"weak expert {expert:.2f}")
    ax.axhline(sft, color="tab:orange", linestyle="--", label=f"SFT policy (eval) {sft:.2f}")
    ax.axhline(rl, color="tab:green", linestyle="--", label=f"RL policy (eval) {rl:.2f}")
    ax.set_xlabel("GRPO wall time (min)")
    ax.set_ylabel("success")
    ax.set_ylim(0, 1.02)
    ax.set_title(title)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def recipe(task: str, demos: int | None = None) -> Recipe:
    """The cold start of ``task``'s pipeline (``demos``: None = the task's own count)."""
    spec = TASKS[task]
    return Recipe(env=tuple(spec["env"]), experts=tuple((f"expert.quality={q}", share)
                                                        for q, share in spec["experts"].items()),
                  demos=demos or spec["demos"], sft=tuple(spec["sft"]))  # fmt: skip


def pipeline(task: str, demos: int | None, rl_minutes: float | None, eval_episodes: int, tmp: Path) -> dict:
    """Every stage of one task (``demos`` and ``rl_minutes``: None = the task's own)."""
    spec = TASKS[task]
    demos = demos or spec["demos"]
    rl_minutes = rl_minutes or spec["rl_minutes"]
    env = spec["env"]
    rl = [*spec["rl"], f"trainer.stop_at_success={spec['stop_at_success']}"]
    rl_dir = tmp / "rl"
    print(f"{task}: demonstrations and SFT ...", flush=True)
    start = make(recipe(task, demos), tmp / "cold_start")
    sft_dir, expert, demo_s, sft_s = Path(start["sft_dir"]), start["expert"], start["demo_s"], start["sft_s"]
    print(f"{task}: evaluating the SFT policy ...", flush=True)
    sft_eval = evaluate([*env, f"model.init_from={sft_dir}"], eval_episodes)
    print(f"{task}: GRPO ...", flush=True)
    rl_s = stage(
        [
            "-m",
            "rl.train",
            f"model.init_from={sft_dir}",
            *env,
            *rl,
            "trainer.iterations=2000",
            f"trainer.time_limit_s={rl_minutes * 60}",
            "trainer.progress_bar=false",
            f"hydra.run.dir={rl_dir}",
        ]
    )
    history = [json.loads(line) for line in (rl_dir / "metrics.jsonl").read_text().splitlines()]
    print(f"{task}: evaluating the RL policy ...", flush=True)
    rl_eval = evaluate([*env, f"model.init_from={rl_dir}"], eval_episodes)
    return {
        "task": task,
        "expert_quality": " + ".join(f"{q} {share:.0%}" for q, share in spec["experts"].items()),
        "expert": expert,
        "demos": start["demos"],
        "demo_s": demo_s,
        "sft_s": sft_s,
        "sft": sft_eval,
        "rl_s": rl_s,
        "rl": rl_eval,
        "iterations": len(history),
        "history": history,
        "min_gain": spec["min_gain"],
        "beat_expert": spec["beat_expert"],
        "max_minutes": spec["max_minutes"],
        "sft_overrides": spec["sft"],
        "rl_overrides": rl,
        "env": env,
    }


def outcome_title(task: str, expert: float, sft: float, rl: float) -> str:
    """The section's title, from the evaluated figures: whether RL ended above its SFT policy and above
    the weak expert it learned from (only then does it "beat its teacher")."""
    if rl > expert and rl > sft:
        what = f"RL beats its teacher (S_rl {rl:.2f} > S_expert {expert:.2f}, S_sft {sft:.2f})"
    elif rl > sft:
        what = (f"RL improves on its SFT policy ({rl:.2f} > {sft:.2f}) but not on its teacher "
                f"(S_expert {expert:.2f})")
    else:
        what = (f"RL does not improve on its SFT policy (S_rl {rl:.2f}, S_sft {sft:.2f}, "
                f"S_expert {expert:.2f})")
    return f"{what}: {task}"


def report(r: dict, command: str, started: str, host: str) -> str:
    """The text of one task's section."""
    gain = r["rl"].success - r["sft"].success
    total = (r["demo_s"] + r["sft_s"] + r["rl_s"]) / 60
    met = (
        gain >= r["min_gain"]
        and (r["rl"].success > r["expert"] or not r["beat_expert"])
        and total <= r["max_minutes"]
    )
    target = f"gain >= {r['min_gain']}" + (", beats the expert" if r["beat_expert"] else "")
    sft_overrides = " ".join(r["sft_overrides"]) or "none"
    return "\n".join(
        [
            f"## {outcome_title(r['task'], r['expert'], r['sft'].success, r['rl'].success)} "
            "(`bench/teacher.py`)",
            "",
            f"Measured {started}. Command: `{command}`. {host}.",
            "",
            "Each stage a fresh process: weak-expert demonstrations (`python -m rl.sft.demonstrations`), "
            "SFT on "
            "them (`python -m rl.train stage=sft`), GRPO from the SFT weights (`python -m rl.train "
            "model.init_from=...`). SFT and RL policies are evaluated on the same fresh games "
            "(`rl.driver.evaluate`, seeds apart from training's); the expert's success is that of its "
            "demonstrations. Times are wall time of each stage (process start-up included).",
            "",
            "| task | weak expert | S_expert | S_sft (eval) | S_rl (eval) | S_rl - S_sft | demos + SFT "
            "| GRPO | total | target |",
            "|---|---|---|---|---|---|---|---|---|---|",
            f"| {r['task']} (`{' '.join(r['env'])}`) | {r['expert_quality']} ({r['demos']} episodes) "
            f"| {r['expert']:.2f} | {r['sft'].success:.2f} | {r['rl'].success:.2f} | {gain:+.2f} "
            f"| {(r['demo_s'] + r['sft_s']) / 60:.1f} min | {r['rl_s'] / 60:.1f} min ({r['iterations']} it) "
            f"| {total:.1f} min | {'met' if met else '**missed**'}: {target}, <= {r['max_minutes']} min |",
            "",
            f"Evaluated on {r['sft'].episodes} games each (failed episodes: SFT {r['sft'].failed}, RL "
            f"{r['rl'].failed}); SFT overrides `{sft_overrides}`; GRPO overrides "
            f"`{' '.join(r['rl_overrides'])}`.",
            "",
            f"![{r['task']}: GRPO from the SFT policy](img/teacher_{r['task']}.png)",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", choices=sorted(TASKS), action="append", help="default: every task")
    parser.add_argument("--demos", type=int, help="demonstration episodes (default: the task's)")
    parser.add_argument("--rl-minutes", type=float, help="GRPO time limit (default: the task's)")
    parser.add_argument("--eval-episodes", type=int, default=256, help="games per evaluation (default 256)")
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/ alone")
    args = parser.parse_args()
    host = training_machine()
    options = "".join(
        f" {flag} {value}"
        for flag, value in (
            ("--demos", args.demos),
            ("--rl-minutes", args.rl_minutes),
            ("--eval-episodes", None if args.eval_episodes == 256 else args.eval_episodes),
        )
        if value is not None
    )
    for task in args.task or sorted(TASKS):  # each task's section is written as soon as it is measured
        started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        with tempfile.TemporaryDirectory(prefix=f"k3rl-bench-teacher-{task}-") as tmp:
            r = pipeline(task, args.demos, args.rl_minutes, args.eval_episodes, Path(tmp))
        text = report(r, f"python bench/teacher.py --task {task}{options}", started, host)
        print(text, flush=True)
        if args.no_write:
            continue
        plot(
            r["history"],
            r["expert"],
            r["sft"].success,
            r["rl"].success,
            ROOT / "docs" / "img" / f"teacher_{task}.png",
            f"{task}: SFT on {r['expert_quality']}, then GRPO",
        )
        write_section(TASKS[task]["section"], text)


if __name__ == "__main__":
    main()
