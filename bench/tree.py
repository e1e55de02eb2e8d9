"""Chain GRPO against tree GRPO (`rl.rollout.trees`): success against generated tokens, sandbox-seconds and
wall time on FindValue and StoreRecall, seeds 0-2, from one supervised cold start per task.

Each (task, method, seed) is one ``python -m rl.train`` for ``--minutes``, one after the other, each
appended to a runs log as it ends (``--reuse-runs LOG`` takes a cut-off invocation's finished runs). Writes
the ``tree`` section of docs/benchmarks.md and a plot per task. Usage: python bench/tree.py [--minutes M]
[--seeds N] [--reuse-runs LOG ...]. Design: docs/design/benchmarks.md#bench-tree.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench_report import ROOT, busy_cores_before, git_commit, other_load_text, training_machine, write_section
from cold_start import Recipe, cached
from teacher import TASKS as TEACHER
from teacher import recipe as teacher_recipe

SECTION = "tree"


@dataclass(frozen=True)
class Task:
    """One task of the comparison: both methods train it from the same cold start with the same GRPO."""

    env: tuple[str, ...]  # the overrides naming the task
    tree: str  # the rollout.tree of its tree runs: branch where the early, shared turns are done
    cold_start: Recipe  # the supervised start of every run (bench/cold_start.py)
    rl: tuple[str, ...]  # GRPO overrides of both methods


TASKS = {
    # bench/teacher.py's FindValue cold start and GRPO (learns from S_sft 0.37): `grep` ends most games in
    # 2-3 turns, so paths branch after the first and the second turn
    "FindValue": Task(
        env=tuple(TEACHER["find_value"]["env"]),
        tree="{branch_at: [1, 2], width: 2, depth: 2, budget: 4}",
        cold_start=teacher_recipe("find_value"),
        rl=tuple(TEACHER["find_value"]["rl"]),
    ),
    # the cold start copies the instructions (the shared setup) and guesses low (its experts win 0.64):
    # what is left to learn, bisection, is in the answers after the branch; GRPO as bench/teacher.py's
    # GuessNumber from its SFT policy
    "StoreRecall": Task(
        env=("env=store_recall",),
        tree="{branch_at: [2, 3], width: 2, depth: 2, budget: 4}",
        cold_start=Recipe(env=("env=store_recall",), demos=1000,
                          experts=(("env.expert=agentenv.tasks.store_recall:copy_then_linear", 0.75),
                                   ("env.expert=agentenv.tasks.store_recall:copy_then_bisect", 0.25))),
        rl=tuple(TEACHER["guess_number_32"]["rl"]),
    ),  # fmt: skip
}
GROUP = ("algo.group_size=8", "algo.episodes_per_step=32")  # 8 leaves per prompt: 2 trees of 4 leaves
TOKENS_TARGET, SANDBOX_TARGET = 0.67, 0.8  # tree's cost to reach chain's final success, as a share of chain's
LEARNED_FLOOR = 0.05  # a chain run whose final success is at most this learned nothing: no cost to compare
WINDOW = 3  # iterations a success figure is the mean of


def run(task: str, method: str, seed: int, minutes: float, start: dict, folder: Path,
        extra: list[str]) -> dict:
    """One training run from the cold start ``start`` (`cold_start.cached`): its per-iteration records, or
    its error."""
    spec = TASKS[task]
    algo = ["algo=grpo"] if method == "chain" else ["algo=tree_grpo", f"rollout.tree={spec.tree}"]
    command = [sys.executable, "-m", "rl.train", *spec.env, *algo, *GROUP, *spec.rl, f"seed={seed}",
               f"model.init_from={start['sft_dir']}", "trainer.iterations=100000",
               "trainer.stop_at_success=null",
               f"trainer.time_limit_s={minutes * 60:g}",
               "trainer.progress_bar=false", "trainer.eval_every=0", f"hydra.run.dir={folder}", *extra]
    started = time.monotonic()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    wall = time.monotonic() - started
    metrics = folder / "metrics.jsonl"
    history = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    error = None if done.returncode == 0 else (done.stderr or done.stdout)[-2000:]
    return {"task": task, "method": method, "seed": seed, "history": history, "wall_s": wall, "error": error}


def curve(history: list[dict]) -> list[tuple[float, float, float, float]]:
    """(cumulative generated tokens, cumulative sandbox-seconds, wall minutes, success of the last WINDOW
    iterations) after each iteration."""
    out, tokens, sandbox = [], 0.0, 0.0
    for i, record in enumerate(history):
        tokens += record["generated_tokens"]
        sandbox += record.get("sandbox_running_s", 0.0)
        recent = history[max(0, i - WINDOW + 1) : i + 1]
        success = statistics.fmean(r["success"] for r in recent)
        out.append((tokens, sandbox, record["elapsed_s"] / 60, success))
    return out


def cost_to_reach(points: list[tuple], success: float) -> tuple[float, float] | None:
    """(tokens, sandbox-seconds) at the first point whose windowed success is at least ``success``."""
    return next(((t, s) for t, s, _m, ok in points if ok >= success), None)


def success_at(points: list[tuple], tokens: float) -> float:
    """Windowed success at the last point within ``tokens`` generated tokens (0 before the first)."""
    within = [ok for t, _s, _m, ok in points if t <= tokens]
    return within[-1] if within else 0.0


def seed_verdict(chain: list[tuple], tree: list[tuple]) -> dict:
    """Tree against chain on one seed (the module docstring's targets)."""
    final = chain[-1][3]
    reached = cost_to_reach(tree, final)
    chain_cost = cost_to_reach(chain, final)
    budget = min(chain[-1][0], tree[-1][0])
    out = {"chain_final": final, "tree_final": tree[-1][3], "tokens_ratio": None, "sandbox_ratio": None,
           "equal_budget": (success_at(tree, budget), success_at(chain, budget)), "budget": budget,
           "learned": final > LEARNED_FLOOR}
    if (out["learned"] and reached is not None and chain_cost is not None and chain_cost[0] > 0
            and chain_cost[1] > 0):
        out["tokens_ratio"] = reached[0] / chain_cost[0]
        out["sandbox_ratio"] = reached[1] / chain_cost[1]
    return out


def branch_cost(history: list[dict]) -> str:
    """A tree run's cost of a branch per child, the median over its iterations: the sandbox's fork (the
    warm backend's fork of a running sandbox) and the copy of the policy state (its bytes)."""
    forks = [r["sandbox_fork_latency_s"] for r in history if r.get("sandbox_forks")]
    copies = [r for r in history if r.get("tree_state_copies")]
    fork = f"{statistics.median(forks) * 1000:.0f} ms" if forks else "-"
    if not copies:
        return f"{fork} / -"
    seconds = statistics.median(r["tree_state_copy_s"] for r in copies)
    size = statistics.median(r["tree_state_copy_bytes"] for r in copies)
    return f"{fork} / {seconds * 1000:.2f} ms ({size / 2**10:.0f} KiB)"


def plot(runs: list[dict], task: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for r in runs:
        points = curve(r["history"])
        if not points:
            continue
        style = {"color": "tab:blue" if r["method"] == "chain" else "tab:orange", "lw": 1.2,
                 "ls": ["-", "--", ":"][r["seed"] % 3], "label": f"{r['method']} seed {r['seed']}"}
        for ax, column in zip(axes, range(3), strict=True):
            ax.plot([p[column] for p in points], [p[3] for p in points], **style)
    for ax, label in zip(axes, ("generated tokens", "sandbox-seconds (running)", "wall time (min)"),
                         strict=True):
        ax.set(xlabel=label, ylabel=f"success (mean of {WINDOW} iterations)", ylim=(-0.02, 1.02))
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"{task}: chain GRPO vs tree GRPO")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def fmt(value: float | None, spec: str = ".2f", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def unusable(r: dict | None) -> str:
    """Why a run gives no curve ("" when it does)."""
    if r is None:
        return "not run"
    if r["error"]:
        return "failed: " + (r["error"].strip().splitlines() or ["no output"])[-1]
    return "" if r["history"] else "recorded no iteration"


def provenance(runs: list[dict]) -> str:
    """When the runs ran, on which commits and machine, and the most load other processes put on it before
    any of them started."""
    starts = sorted(r["started"] for r in runs)
    commits: dict[str, int] = {}
    for r in runs:
        commits[r["commit"]] = commits.get(r["commit"], 0) + 1
    when = f"Measured {starts[0]}" + (f" to {starts[-1]}" if starts[-1] != starts[0] else "")
    on = ", ".join(f"{c} ({n} run{'s' * (n > 1)})" for c, n in commits.items())
    busy = max(r["busy"] for r in runs)
    return f"{when}, on commit {on}. {runs[0]['machine']}; before a run, {other_load_text(busy)}"


def section(runs: list[dict], tasks: list[str], starts: dict[str, dict], args: argparse.Namespace) -> str:
    chosen = "" if tasks == list(TASKS) else " --tasks " + " ".join(tasks)
    command = f"python bench/tree.py --minutes {args.minutes:g} --seeds {args.seeds}{chosen}" + "".join(
        f" {o}" for o in args.overrides)
    lines = [
        "## Chain GRPO vs tree GRPO (`bench/tree.py`)",
        "",
        f"{provenance(runs)} Command: `{command}`." if runs else f"No run yet. Command: `{command}`.",
        "",
        "Both methods of a task start from the same supervised cold start (`bench/cold_start.py`: "
        "demonstrations of weak scripted experts, then `stage=sft`), so that GRPO has a success to build "
        "on in the time it gets: "
        + "; ".join(f"{t}: {starts[t]['demos']} demonstrations of {TASKS[t].cold_start.describe()} "
                    f"(their success {starts[t]['expert']:.2f}), SFT overrides "
                    f"`{' '.join(TASKS[t].cold_start.sft) or 'none'}` (made {starts[t]['made']} on commit "
                    f"{starts[t]['commit']})" for t in tasks)
        + f". Each run: `python -m rl.train env=TASK seed=S model.init_from=<the cold start>` for "
        f"{args.minutes:g} min (`trainer.time_limit_s`, no stop rule), {' '.join(GROUP)}, GRPO overrides "
        + "; ".join(f"{t}: `{' '.join(TASKS[t].rl)}`" for t in tasks)
        + "; chain = `algo=grpo`, tree = `algo=tree_grpo` with "
        + ", ".join(f"{t}: `rollout.tree={TASKS[t].tree}`" for t in tasks)
        + f". Success is the mean of the last {WINDOW} iterations. Sandbox-seconds: the seconds the rollout "
        "pool's sandboxes ran (`sandbox_running_s`), summed over iterations. Targets, per seed: tree reaches "
        f"chain's final success with <= {TOKENS_TARGET}x its generated tokens and <= {SANDBOX_TARGET}x its "
        "sandbox-seconds; at the tokens both runs generated, tree's success >= chain's. A branch's cost per "
        "child: the fork of the running sandbox on the warm backend's path (`sandbox_fork_latency_s`: a dump "
        "of the running sandbox and a lazy restore per child) and the copy of the policy state "
        "(`tree_state_copy_s`, with the bytes of the model cache it copies).",
        "",
        "| task | seed | chain final | tree final | tree tokens to chain's final | tree sandbox-s to chain's "
        "final | at equal tokens: tree / chain | branch, per child (p50): sandbox fork / policy state copy "
        "| verdict |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for task in tasks:
        for seed in range(args.seeds):
            pair = {r["method"]: r for r in runs if r["task"] == task and r["seed"] == seed}
            broken = [f"{m} {why}" for m in ("chain", "tree") if (why := unusable(pair.get(m)))]
            if broken:
                lines.append(f"| {task} | {seed} | - | - | - | - | - | - | {'; '.join(broken)} |")
                continue
            v = seed_verdict(curve(pair["chain"]["history"]), curve(pair["tree"]["history"]))
            branch = branch_cost(pair["tree"]["history"])
            met = (v["tokens_ratio"] is not None and v["tokens_ratio"] <= TOKENS_TARGET
                   and v["sandbox_ratio"] <= SANDBOX_TARGET and v["equal_budget"][0] >= v["equal_budget"][1])
            reach = "not reached" if v["tokens_ratio"] is None else None
            tokens = reach or fmt(v["tokens_ratio"], ".2f", "x")
            sandbox = reach or fmt(v["sandbox_ratio"], ".2f", "x")
            verdict = "**met**" if met else "**missed**"
            if not v["learned"]:  # reaching a final success of ~0 costs nothing: no comparison to make
                tokens = sandbox = "-"
                verdict = f"no verdict: chain learned nothing (final success <= {LEARNED_FLOOR})"
            tree_at, chain_at = v["equal_budget"]
            lines.append(
                f"| {task} | {seed} | {v['chain_final']:.2f} | {v['tree_final']:.2f} | {tokens} | {sandbox} "
                f"| {tree_at:.2f} / {chain_at:.2f} ({v['budget']:.0f} tokens) | {branch} | {verdict} |"
            )
    lines += ["", *[f"![{task}](img/tree_{task.lower()}.png)" for task in tasks]]
    return "\n".join(lines)


def logged_runs(paths: list[Path], minutes: float, overrides: list[str], starts: dict[str, dict]
                ) -> dict[tuple, dict]:
    """The finished runs in the ``--reuse-runs`` logs (JSON lines, read in order: a later line wins) made
    with these ``minutes`` and ``overrides`` from the cold starts ``starts`` (by task: a run from another
    one is not comparable), by (task, method, seed); a failed run is run again."""
    found: dict[tuple, dict] = {}
    for path in paths:
        if not path.is_file():
            raise SystemExit(f"--reuse-runs: {path} is not a file")
        for number, text in enumerate(path.read_text().splitlines(), 1):
            if not text.strip():
                continue
            try:
                r = json.loads(text)
                key = (r["task"], r["method"], r["seed"])
                same = (r["minutes"] == minutes and r["overrides"] == overrides
                        and r["cold_start"] == starts.get(r["task"], {}).get("made"))
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise SystemExit(f"{path}, line {number}: not a run of bench/tree.py ({exc!r})") from exc
            if same and not r["error"] and r["history"]:
                found[key] = r
    return found


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=20.0, help="wall time of each training run")
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 of each task and method")
    parser.add_argument("--tasks", nargs="+", choices=list(TASKS), default=list(TASKS))
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/ alone")
    parser.add_argument("--reuse-runs", type=Path, nargs="+", default=[], metavar="LOG",
                        help="runs logs of earlier invocations: their finished runs with the same --minutes, "
                        "overrides and cold start are taken as they are, not run again (all there: only "
                        "the section)")
    parser.add_argument("--work", type=Path, default=ROOT / "outputs" / "bench_tree",
                        help="where the cold starts are kept (WORK/cold_start/TASK, reused while their "
                        "recipe holds) and each invocation's runs log goes (default outputs/bench_tree)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every run")
    args = parser.parse_args(argv)
    if args.minutes <= 0 or args.seeds < 1:
        parser.error("--minutes must be above 0 and --seeds at least 1")
    tasks = [t for t in TASKS if t in args.tasks]
    starts = {}
    for task in tasks:
        print(f"{task}: the cold start ...", flush=True)
        starts[task] = cached(TASKS[task].cold_start, args.work / "cold_start" / task)
    done = logged_runs(args.reuse_runs, args.minutes, args.overrides, starts)
    wanted = [(t, m, s) for t in tasks for s in range(args.seeds) for m in ("chain", "tree")]
    runs = [done[k] for k in wanted if k in done]
    todo = [k for k in wanted if k not in done]
    if runs:
        print(f"{len(runs)} runs taken from {', '.join(map(str, args.reuse_runs))}; {len(todo)} to run",
              flush=True)
    if todo:
        log = args.work / time.strftime("%Y%m%dT%H%M%S", time.gmtime()) / "runs.jsonl"
        log.parent.mkdir(parents=True, exist_ok=True)
        print(f"each run is appended to {log} as it ends (--reuse-runs {log} takes them if this is cut off)",
              flush=True)
        machine, commit = training_machine(), git_commit()
        with tempfile.TemporaryDirectory(prefix="k3rl-bench-tree-") as tmp:
            for task, method, seed in todo:
                print(f"{task} {method} seed {seed} ...", flush=True)
                busy = busy_cores_before()
                started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
                folder = Path(tmp) / f"{task}-{method}-{seed}"
                r = run(task, method, seed, args.minutes, starts[task], folder, args.overrides)
                r.update(minutes=args.minutes, overrides=args.overrides, commit=commit, machine=machine,
                         busy=busy, started=started, cold_start=starts[task]["made"])
                with open(log, "a") as out:
                    out.write(json.dumps(r) + "\n")
                runs.append(r)
    text = section(runs, tasks, starts, args)
    print(text)
    if not args.no_write:
        for task in tasks:
            image = ROOT / "docs" / "img" / f"tree_{task.lower()}.png"
            plot([r for r in runs if r["task"] == task], task, image)
        write_section(SECTION, text)


if __name__ == "__main__":
    main()
