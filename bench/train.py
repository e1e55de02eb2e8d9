"""Training benchmark: how fast the tiny K3 policy learns, what a rollout costs, and training at fixed memory.

Parts: a rollout micro-benchmark, sync and async training runs, fixed memory (``--part memory``) and the
heavy task (``--part heavy``); each replaces its ``bench:train*`` section of docs/benchmarks.md.
Usage: python bench/train.py [--part train|memory|heavy] [--quick]

Design: docs/design/benchmarks.md#bench-train.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import platform
import re
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

from bench_report import (
    ROOT,
    busy_cores_before,
    compose,
    git_commit,
    host_cpu_seconds,
    other_load_text,
    write_section,
)
from bench_stats import spread
from memory_sweep import (
    MIN_REPEATS,
    STEADY_ITERATIONS,
    Comparison,
    break_even,
    break_even_verdict,
    budget_breaches,
    cells,
    compare,
    no_verdict,
    plot_sweep,
    ratio_verdict,
    run_peak,
    run_rate,
    steady_rate,
    verdict,
)


def rollout_throughput(overrides: list[str], groups: int, repeats: int) -> dict:
    """Env steps/s of `EpisodeRunner` (after one warm-up run that creates the sandboxes)."""
    import torch

    from rl.policy import build_policy
    from rl.rollout.engines import build_engine
    from rl.rollout.runner import EpisodeRunner
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
        steps = step_s = reset_s = total = forks = fork_s = fork_phase_s = 0.0
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
            fork_phase_s += stats.fork_phase_s
    finally:
        runner.close()
    return {
        "env_steps_per_s": steps / max(step_s + reset_s, 1e-9),
        "step_ms": 1000 * step_s / max(steps, 1),
        "episodes_per_s": groups * group * repeats / total,
        "fork_ms": 1000 * fork_s / forks if forks else None,
        "fork_phase_ms": 1000 * fork_phase_s / forks if forks else None,
    }


def training_run(overrides: list[str], run_dir: Path, target: float = 0.9,
                 steady_iterations: int = STEADY_ITERATIONS) -> dict:
    """One `rl.train` run with ``overrides``; its figures from the per-iteration records. ``target``:
    the success whose first reaching (mean of the last ``trainer.success_window`` iterations) is timed;
    rates per second cover the iterations after the first, None with fewer than ``steady_iterations``."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from rl.metrics import first_reaching
    from rl.train import train

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = hydra_compose("config", overrides=overrides)
    result = train(cfg, run_dir)
    history = result.history
    reached = first_reaching(history, int(cfg.trainer.success_window), target)
    reached_at = None if reached is None else history[reached]["elapsed_s"]
    total = lambda key: sum(r[key] for r in history)  # noqa: E731

    # steady state: the episodes after the first iteration (Ray, sandbox and template start-up) per
    # second, over at least `steady_iterations` of them; None (no number) for a shorter run
    def steady(key: str) -> float | None:
        return steady_rate(history, key, steady_iterations)

    return {
        "result": result,
        "history": history,
        "iterations": len(history),
        "start_success": result.start_success,
        "end_success": result.end_success,
        "best_success": max(r["success"] for r in history),
        "time_to_target_s": reached_at,
        "episodes": total("episodes"),
        "steady_iterations": len(history) - 1,  # iterations the rates are over
        "steady_needed": steady_iterations,
        "episodes_per_s": steady("episodes"),
        "env_steps_per_s": steady("env_steps"),  # per second of training, as episodes/s (both modes)
        "generated_tokens_per_s": total("generated_tokens") / total("generate_s"),
        "learner_wait_fraction": total("rollout_s") / total("iteration_s"),
        "learner_idle_fraction": 1.0 - total("learner_s") / total("iteration_s"),
        "rollout_s_per_iter": total("rollout_s") / len(history),
        "learner_s_per_iter": total("learner_s") / len(history),
        "pauses_per_episode": total("sandbox_pauses") / max(total("episodes"), 1),
        "pool_running_bytes_max": max(r.get("sandbox_running_bytes", 0.0) for r in history),
        "wall_s": result.wall_s,
    }


def plot_modes(runs: dict[str, dict], path: Path, target: float, title: str) -> None:
    """Success against wall time of several training runs (per iteration, and the mean of the last
    ``window`` iterations the trainer stops on) in one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for (name, run), color in zip(runs.items(), ("tab:blue", "tab:orange", "tab:green"), strict=False):
        minutes = [r["elapsed_s"] / 60 for r in run["history"]]
        success = [r["success"] for r in run["history"]]
        window = run["window"]
        smooth = [
            sum(success[max(0, i - window + 1) : i + 1]) / len(success[max(0, i - window + 1) : i + 1])
            for i in range(len(success))
        ]
        ax.plot(minutes, success, color=color, alpha=0.3, linewidth=1)
        ax.plot(minutes, smooth, color=color, linewidth=2, label=f"{name} (mean of last {window})")
    ax.axhline(target, color="grey", linestyle="--", linewidth=1)
    ax.set_xlabel("wall time (min)")
    ax.set_ylabel("success")
    ax.set_ylim(0, 1.02)
    ax.set_title(title)
    ax.legend(loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _minutes(seconds: float | None, missed: str = "not reached") -> str:
    return f"{seconds / 60:.1f} min" if seconds is not None else missed


def _rate(r: dict, key: str, fmt: str) -> str:
    """A steady-state rate of `training_run`'s result, or why there is none."""
    value = r[key]
    if value is None:
        return (f"no steady state: {r['steady_iterations']} iterations after the first, "
                f"{r['steady_needed']} needed")
    return format(value, fmt)


def header(command: str, start_load: float, busy: float) -> list[str]:
    """The machine, the time, the command, the 1-minute load average at the part's start and now, and
    the cores other jobs kept busy just before it started (`busy_cores_before`: the load average still
    counts a job that ended a minute ago, so it alone cannot say whether another job was running)."""
    return [
        f"Machine: {os.cpu_count()} CPU cores ({platform.processor() or platform.machine()}), no GPU; "
        f"measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. Command: `{command}`.",
        f"Load average (1 min): {start_load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end; "
        + other_load_text(busy),
    ]


def fork_targets(forked_vs_seeded: float, fork_phase_ms: float | None) -> list[str]:
    """The rollout table's targets for forked groups, each ending in met or missed and its figure: their
    episodes/s against seed groups' and the fork phase's wall time per forked member."""
    phase = (verdict(None, "no fork phase measured") if not fork_phase_ms
             else verdict(fork_phase_ms <= 500, f"{fork_phase_ms:.0f} ms"))
    return [
        "- Target forked groups' episodes/s >= 0.5x seed groups' (measured): "
        f"{verdict(forked_vs_seeded >= 0.5, f'{forked_vs_seeded:.2f}x')}",
        f"- Target fork phase per forked member <= 500 ms (measured): {phase}",
    ]


HEAVY_START = ["env=kv_lookup", "rollout.sandbox_pool.overrides.warm_starts=false"]


def group_start_throughput(overrides: list[str], groups: int, repeats: int) -> dict:
    """Episodes/s of runs that start every group from new sandboxes (a new runner per repeat, nothing
    made before): what a task's setup costs each way of starting a group."""
    import torch

    from rl.policy import build_policy
    from rl.rollout.engines import build_engine
    from rl.rollout.runner import EpisodeRunner
    from rl.tokenizer import build_tokenizer

    cfg = compose(overrides)
    torch.set_num_threads(1)
    tokenizer = build_tokenizer(cfg.tokenizer)
    policy = build_policy(cfg.model, cfg.seed)
    engine = build_engine(cfg.rollout, policy, tokenizer, cfg.env.action_vocabulary)
    group = cfg.algo.group_size
    rates, failed = [], 0
    for r in range(repeats):
        runner = EpisodeRunner(cfg.env, cfg.rollout, engine, tokenizer, cfg.sandbox)
        try:
            t0 = time.perf_counter()
            _, stats = runner.run(list(range(r * groups, (r + 1) * groups)), group,
                                  torch.Generator().manual_seed(r))
            rates.append(groups * group / (time.perf_counter() - t0))
            failed += stats.failed
        finally:
            runner.close()
    s = spread(rates)
    if s is None:
        raise ValueError("no run measured a rate")
    return {"episodes_per_s": s.median, "min": s.low, "max": s.high,
            "failed": failed, "runs": len(rates)}


def heavy_start_lines(forked: dict, independent: dict, groups: int, group: int) -> list[str]:
    """The heavy-setup table and its target (forked group starts >= 3x independent starts, on medians)."""
    ratio = forked["episodes_per_s"] / independent["episodes_per_s"]
    worst = forked["min"] / independent["max"]

    def cell(r: dict) -> str:
        spread = f"{r['min']:.2f}-{r['max']:.2f}"
        return f"{r['episodes_per_s']:.2f} ({spread}), {r['runs']} runs, {r['failed']} failed"

    return [
        f"Group starts on a task whose setup is heavy (`{' '.join(HEAVY_START)}`: each new sandbox generates "
        f"and loads its 200 MiB table), {groups} groups x {group} episodes from new sandboxes, a new runner "
        "per run; episodes/s median (min-max):",
        "",
        "| group start | episodes/s |",
        "|---|---|",
        "| independent starts (`env.group_start=seed`: every member sets up its own sandbox) | "
        f"{cell(independent)} |",
        f"| forked group starts (`env.group_start=fork`: one setup, G-1 forks) | {cell(forked)} |",
        "",
        "- Target forked group starts >= 3x the episodes/s of independent starts (median): "
        f"{verdict(ratio >= 3.0, f'{ratio:.2f}x (worst pair {worst:.2f}x)')}",
    ]


def part_train(args: argparse.Namespace, user: list[str], command: str) -> str:
    """The rollout micro-benchmark and the sync vs async training runs of `make train`'s config; the
    text of the ``bench:train`` section."""
    start_load = os.getloadavg()[0]
    busy = busy_cores_before()  # other jobs' load before the part starts anything
    groups, repeats = (2, 2) if args.quick else (8, 3)
    rollout_group_size = compose(user).algo.group_size

    print("rollout micro-benchmark ...", flush=True)
    variants = {
        "exec per command, seed groups (baseline)": ["env.kwargs.session=false"],
        "shell session, seed groups (default)": [],
        "shell session, forked groups": ["env.group_start=fork"],
    }
    rollout = {name: rollout_throughput([*o, *user], groups, repeats) for name, o in variants.items()}
    print("group starts on a heavy-setup task ...", flush=True)
    heavy_groups = 1 if args.quick else 2
    heavy = {mode: group_start_throughput([*HEAVY_START, f"env.group_start={mode}", *user], heavy_groups,
                                          1 if args.quick else 3)
             for mode in ("seed", "fork")}
    base = rollout["exec per command, seed groups (baseline)"]["env_steps_per_s"]
    for name, r in rollout.items():
        print(f"  {name}: {r['env_steps_per_s']:.0f} env steps/s ({r['env_steps_per_s'] / base:.1f}x)")

    # an async checkpoint keeps the sandboxes of the episodes in flight for a resume: the run folders are
    # deleted here, so none is kept (sync runs ignore the key)
    train_overrides = ["trainer.progress_bar=false", "trainer.checkpoint_in_flight=false", *user]
    if args.quick:
        train_overrides = ["trainer.iterations=6", "trainer.time_limit_s=120", *train_overrides]
    runs: dict[str, dict] = {}
    for mode in ("sync", "async"):
        print(f"training run, trainer.mode={mode} ...", flush=True)
        run_dir = Path(tempfile.mkdtemp(prefix=f"k3rl-bench-train-{mode}-"))
        runs[mode] = training_run([f"trainer.mode={mode}", *train_overrides], run_dir)
        runs[mode]["window"] = int(compose(train_overrides).trainer.success_window)
        shutil.rmtree(run_dir, ignore_errors=True)
    t = runs["sync"]
    image = ROOT / "docs" / "img" / "train_learning_curve.png"
    modes_image = ROOT / "docs" / "img" / "train_sync_vs_async.png"
    if not args.no_write:  # --no-write leaves docs/ alone
        from rl.metrics import plot_history

        image.parent.mkdir(parents=True, exist_ok=True)
        plot_history(t["history"], image, title="k3_tiny, GRPO, GuessNumber (make train)")
        plot_modes(runs, modes_image, 0.9, "k3_tiny, GRPO, GuessNumber: trainer.mode sync vs async")

    lines = [
        "## Training (`bench/train.py`)",
        "",
        *header(command, start_load, busy),
        "",
        "Rollout of the default task (GuessNumber, untrained tiny K3 policy, "
        f"{groups} groups x {rollout_group_size} episodes, {repeats} repeats; env steps/s = steps / "
        "wall time of the parallel reset (and fork) and step phases; episodes/s includes generation):",
        "",
        "| sandbox access / group start | env steps/s | episodes/s | fork latency ms per forked sandbox | "
        "fork phase wall ms per forked sandbox | vs baseline (env steps/s) |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in rollout.items():
        fork = f"{r['fork_ms']:.0f}" if r["fork_ms"] else "-"
        phase = f"{r['fork_phase_ms']:.0f}" if r["fork_phase_ms"] else "-"
        lines.append(
            f"| {name} | {r['env_steps_per_s']:.0f} | {r['episodes_per_s']:.1f} | {fork} | {phase} | "
            f"{r['env_steps_per_s'] / base:.1f}x |"
        )
    seeded, forked = rollout["shell session, seed groups (default)"], rollout["shell session, forked groups"]
    lines += [
        "",
        "Fork latency: each group's fork of its G-1 members (all groups fork at once), over its members; "
        "fork phase: the wall time of the whole fork phase over all forked members, i.e. what a forked "
        "member costs the rollout.",
        "",
        *fork_targets(forked["episodes_per_s"] / seeded["episodes_per_s"], forked["fork_phase_ms"]),
        "",
        *heavy_start_lines(heavy["fork"], heavy["seed"], heavy_groups,
                           compose([*HEAVY_START, *user]).algo.group_size),
    ]
    s, a = runs["sync"], runs["async"]
    rows = [
        ("iterations (optimizer steps of a batch)", lambda r: f"{r['iterations']}"),
        ("episodes", lambda r: f"{r['episodes']:.0f}"),
        ("success at the start (first iteration)", lambda r: f"{r['start_success']:.2f}"),
        ("success at the end (mean of the last iterations)", lambda r: f"{r['end_success']:.2f}"),
        ("wall time to 0.9 success", lambda r: _minutes(r["time_to_target_s"])),
        ("total wall time (incl. Ray and sandbox start-up)", lambda r: f"{r['wall_s'] / 60:.1f} min"),
        ("episodes/s (after the first iteration)", lambda r: _rate(r, "episodes_per_s", ".1f")),
        ("env steps/s (after the first iteration)", lambda r: _rate(r, "env_steps_per_s", ".0f")),
        ("generated tokens/s", lambda r: f"{r['generated_tokens_per_s']:.0f}"),
        (
            "rollout (sync) or batch wait (async) / learner seconds per iteration",
            lambda r: f"{r['rollout_s_per_iter']:.2f} / {r['learner_s_per_iter']:.2f}",
        ),
        (
            "learner idle fraction (1 - learner s / iteration s)",
            lambda r: f"{r['learner_idle_fraction']:.2f}",
        ),
    ]
    lines += [
        "",
        "Training with the default config (`make train`), then the same config with `trainer.mode=async` "
        "(each run stops at 0.9 success, mean of the last `trainer.success_window` iterations, or at "
        "`trainer.time_limit_s`; `trainer.checkpoint_in_flight=false`: the bench deletes its run folders, "
        "so no async checkpoint keeps sandboxes for a resume):",
        "",
        "| figure | sync (`make train`) | async (`trainer.mode=async`) |",
        "|---|---|---|",
        *[f"| {name} | {fmt(s)} | {fmt(a)} |" for name, fmt in rows],
        "",
        "![learning curve](img/train_learning_curve.png)",
        "",
        "Success against wall time, both modes (thin: per iteration; thick: mean of the last "
        f"{s['window']} iterations; dashed: 0.9):",
        "",
        "![sync vs async](img/train_sync_vs_async.png)",
    ]
    return "\n".join(lines)


# The fixed-memory table: heavy-state sandboxes under one budget for running ones.
MEMORY_ENV = "kv_lookup"  # agentenv/KVLookup-v0: a service holding data_mib = 200 MiB in memory
MEMORY_BUDGET_MIB = 2048
MEMORY_TARGET = 0.3  # the success the table times (mean of the last 2 iterations)
MEMORY_LATENCIES = (0.0, 2.0, 10.0, 30.0)  # emulated policy latencies of the sweep (s per turn)
MEMORY_MINUTES = 120.0  # time limit of one row: (a) at 30 s plays 8 waves x 3 turns x 30 s per iteration
QUICK_MEMORY = ["algo.episodes_per_step=16"]  # --quick --part memory: smaller batches, a smoke run


class SandboxMemorySampler:
    """Host-side memory of the sandboxes of the pools named ``prefix-*``: every ``interval_s`` the sum of
    the cgroup RSS (anonymous + shared memory, `agentenv.backend.cgroups.read_usage`) of their
    containers that have processes (running or frozen; a CRIU-paused one has none), and the 1-minute
    load average. Runs in a thread of the bench process while the training run's workers own the pools.
    The peak sample keeps what made it (each container's RSS, memory limit and process count, and the
    seconds since the sampler started), so a peak over the budget can be explained from the row log."""

    def __init__(self, prefix: str, interval_s: float = 1.0) -> None:
        self.prefix = prefix
        self.interval_s = interval_s
        self.peak_parts: list[dict] = []  # each container in the peak sample (`_sample`), largest first
        self.peak_at_s = 0.0  # when the peak sample was taken, seconds after start
        self.loads: list[float] = []
        self._started = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _sample(self) -> list[dict]:
        """Each of the pools' containers that have processes: its cgroup RSS in bytes, its memory limit
        (None: none set) and how many processes its cgroup holds. A pool's sandboxes are found by the
        registry's labels, not the containers': a fork restored into a spare shell runs in a container
        made before the pool named it (Docker cannot relabel one), so only the registry says whose it is."""
        from agentenv import Sandbox
        from agentenv.backend import docker_client
        from agentenv.backend.cgroups import cgroup_dirs, cgroup_pids, read_usage
        from agentenv.pool.pool import LABEL_POOL

        api, parts = docker_client.api(), []
        containers = {sb.container_id for sb in Sandbox.list()
                      if sb.container_id and sb.labels.get(LABEL_POOL, "").startswith(f"{self.prefix}-")}
        for cid in sorted(containers):
            try:
                pid = int(api.inspect_container(cid)["State"].get("Pid") or 0)
            except Exception:  # removed meanwhile
                continue
            dirs = cgroup_dirs(pid) if pid else {}
            memory_dir = dirs.get("memory") or dirs.get("unified")
            # only the container's own cgroup: a pid that is gone (or reused) would read another one's
            if memory_dir is not None and cid in str(memory_dir):
                parts.append({"container": cid[:12], "rss": read_usage(pid).rss_bytes,
                              "limit": memory_limit(memory_dir), "processes": len(cgroup_pids(pid))})
        return parts

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                parts = self._sample()
            except Exception:  # Docker busy: skip this sample
                continue
            if sum(p["rss"] for p in parts) > self.peak_mib * 2**20:
                self.peak_parts = sorted(({**p, "rss_mib": round(p["rss"] / 2**20)} for p in parts),
                                         key=lambda p: -p["rss"])
                self.peak_at_s = time.monotonic() - self._started
            self.loads.append(os.getloadavg()[0])

    def __enter__(self) -> SandboxMemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def peak_mib(self) -> float:
        return sum(p["rss"] for p in self.peak_parts) / 2**20

    @property
    def peak_sandboxes(self) -> int:
        """How many sandboxes had processes at the peak sample."""
        return len(self.peak_parts)


def memory_rows(cap: int) -> dict[str, tuple[str, list[str]]]:
    """Row key -> (description, overrides) of the fixed-memory table."""
    return {
        "a": (
            f"(a) sync, no pausing, at most {cap} episodes at once (seed-reset groups on live sandboxes)",
            [
                "trainer.mode=sync",
                "env.group_start=seed",
                "rollout.sandbox_pool.pause_policy=never",
                f"rollout.max_concurrent_episodes={cap}",
            ],
        ),
        "b": (
            "(b) as (a), waiting sandboxes frozen (`docker pause`, memory kept) by the cost model",
            [
                "trainer.mode=sync",
                "env.group_start=seed",
                "rollout.sandbox_pool.pause_policy=cost",
                "+rollout.sandbox_pool.overrides.pause_method=freeze",
                f"rollout.max_concurrent_episodes={cap}",
            ],
        ),
        "c": (
            "(c) async, no cap (waves fitting the slots when faster than pausing), waiting sandboxes "
            "paused by CRIU (zero memory), forked groups, the whole batch in one rollout call",
            [
                "trainer.mode=async",
                # a worker runs its calls one after another, so two calls in flight would play half the
                # batch each and wait for the policy twice per turn; one call plays it all at once
                "trainer.rollouts_in_flight=1",
                "env.group_start=fork",
                "rollout.sandbox_pool.pause_policy=cost",
                "+rollout.sandbox_pool.overrides.idle_after_s=0",
            ],
        ),
    }


def memory_concurrency(user: list[str], sandbox_mib: float) -> tuple[int, int]:
    """The heavy task's GRPO group size and the episodes rows (a) and (b) play at once: whole groups of
    sandboxes of the measured ``sandbox_mib`` within the memory budget (at least one group)."""
    group = compose([f"env={MEMORY_ENV}", *user]).algo.group_size
    return group, max(group, int(MEMORY_BUDGET_MIB // sandbox_mib) // group * group)


def fixed_memory_run(pool_name: str, limit_s: float) -> list[str]:
    """The overrides every run on the heavy task shares: its env, warm starts, the sandbox memory
    budget, its own pool name, a time limit, and no checkpoints, TensorBoard or progress bar (the bench
    deletes the run folder, so an async checkpoint must keep no sandboxes for a resume)."""
    return [
        f"env={MEMORY_ENV}",
        "rollout.sandbox_pool.overrides.warm_starts=true",
        f"+rollout.sandbox_pool.overrides.memory_budget={MEMORY_BUDGET_MIB}m",
        f"rollout.sandbox_pool.name={pool_name}",
        f"trainer.time_limit_s={limit_s:g}",
        "trainer.checkpoint_every=0",
        "trainer.checkpoint_in_flight=false",
        "trainer.tensorboard=false",
        "trainer.progress_bar=false",
    ]


def heavy_sandbox_cost(user: list[str], forks: int, cycles: int = 3) -> dict[str, float]:
    """What one heavy-task sandbox is and what moving its state costs the host, measured on its own
    before the runs: its size (cgroup RSS after the task's install, the data set loaded), CPU seconds (the
    whole host's, `host_cpu_seconds`) and wall seconds of a CRIU pause + resume, and of a group start's
    fork of ``forks`` members (per member); medians over ``cycles``. The sandbox is made as the rollout
    makes it (the env's kwargs and sandbox profile), without a pool."""
    from statistics import median

    from rl.rollout.wrappers import task
    from rl.sft.demonstrations import task_env

    env = task_env(compose([f"env={MEMORY_ENV}", *user]))
    try:
        env.reset(seed=0)
        sandbox_task = task(env)
        sandbox_mib = sandbox_task.sandbox.stats().rss_bytes / 2**20
        cycle_cpu, cycle_wall, fork_cpu, fork_wall = [], [], [], []
        for _ in range(cycles):
            cpu, wall = host_cpu_seconds(), time.perf_counter()
            sandbox_task.pause()
            sandbox_task.resume()
            cycle_cpu.append(host_cpu_seconds() - cpu)
            cycle_wall.append(time.perf_counter() - wall)
            if forks:
                cpu, wall = host_cpu_seconds(), time.perf_counter()
                members = sandbox_task.fork(forks)
                fork_cpu.append((host_cpu_seconds() - cpu) / forks)
                fork_wall.append((time.perf_counter() - wall) / forks)
                for member in members:
                    member.close()
    finally:
        env.close()
    nan = float("nan")
    return {"sandbox_mib": sandbox_mib,
            "cycle_cpu_s": median(cycle_cpu) if cycle_cpu else nan,
            "cycle_wall_s": median(cycle_wall) if cycle_wall else nan,
            "fork_cpu_s": median(fork_cpu) if fork_cpu else nan,
            "fork_wall_s": median(fork_wall) if fork_wall else nan, "cycles": cycles}


def cpu_lines(cost: dict[str, float], pauses_per_episode: float, runs: int, group: int, latency: float,
              busy: float, cores: int) -> list[str]:
    """What moving state costs row (c) at one latency: the CPU of its measured pauses per episode (the
    median of its ``runs``) and forks per episode, at the per-operation CPU `heavy_sandbox_cost`
    measured, and the rate the host's ``cores`` would allow if that were all they did (inferred, an upper
    bound: it depends on how many pauses the cost model chose, which is scheduling, not hardware)."""
    forks_per_episode = (group - 1) / group
    per_episode = pauses_per_episode * cost["cycle_cpu_s"] + forks_per_episode * cost["fork_cpu_s"]
    ceiling = cores / per_episode if per_episode > 0 else float("inf")
    return [
        f"Moving a {cost['sandbox_mib']:.0f} MiB sandbox's state (measured by this command on one sandbox of "
        "the task: `heavy_sandbox_cost` in bench/train.py, the host's busy CPU time from /proc/stat, "
        f"medians of {cost['cycles']}; every process's time counts: before the bench "
        f"{other_load_text(busy)[:-1]}): a CRIU pause + resume costs {cost['cycle_cpu_s']:.2f} "
        f"CPU-s ({cost['cycle_wall_s']:.2f} s of wall time), a group start's fork {cost['fork_cpu_s']:.2f} "
        f"CPU-s per forked member ({cost['fork_wall_s']:.2f} s per member, {group - 1} at once). At "
        f"{latency:g} s (c) made {pauses_per_episode:.1f} pauses and {forks_per_episode:.2f} forks per "
        f"episode (measured, the median of {runs} run{'s' * (runs != 1)}), so {per_episode:.2f} CPU-s per "
        "episode went to moving state; inferred from "
        f"these figures, the {cores} cores could carry at most {ceiling:.2f} episodes/s of (c) if they did "
        "nothing else. That ceiling follows from the pauses the cost model chose per episode (a scheduling "
        "decision), not from the hardware alone.",
    ]


def run_memory_row(key: str, latency: float, overrides: list[str], args: argparse.Namespace,
                   user: list[str]) -> dict:
    """One row of the table at one latency: `training_run` until ``--steady-iterations`` after the first
    (``trainer.iterations``) or ``--memory-minutes`` (``trainer.time_limit_s``), whichever comes first,
    with the host sampled for the sandboxes' memory; ``{"error": ...}`` when the run failed."""
    # a pool name of its own: sandboxes an earlier, killed run left under a reused name would be counted
    # in this run's memory samples (and adopted by its pool)
    prefix = f"bench-mem-{key}-{int(latency)}-{os.urandom(3).hex()}"
    print(f"memory row {key}, policy latency {latency:g} s ...", flush=True)
    run_overrides = [
        *fixed_memory_run(prefix, args.memory_minutes * 60),
        f"trainer.iterations={1 + args.steady_iterations}",
        "trainer.stop_at_success=null",  # every row runs its whole window
        f"rollout.policy_latency_s={latency:g}",
        "trainer.success_window=2",
        *overrides,
        *user,
    ]
    run_dir = Path(tempfile.mkdtemp(prefix=f"k3rl-bench-mem-{key}-"))
    try:
        with SandboxMemorySampler(prefix) as sampler:
            r = training_run(run_overrides, run_dir, target=MEMORY_TARGET,
                             steady_iterations=args.steady_iterations)
    except Exception as exc:  # one failed row (e.g. too many failed episodes) is reported as such
        error = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
        print(f"  failed: {error}", flush=True)
        return {"error": error}
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    r["peak_mib"], r["peak_sandboxes"] = sampler.peak_mib, sampler.peak_sandboxes
    r["peak_parts"], r["peak_at_s"] = sampler.peak_parts, sampler.peak_at_s
    r["load"] = sum(sampler.loads) / max(len(sampler.loads), 1)
    r["pause_s"] = max(h.get("sandbox_pause_p50_s", 0.0) for h in r["history"])
    r["resume_s"] = max(h.get("sandbox_resume_p50_s", 0.0) for h in r["history"])
    rate = "no steady state" if r["episodes_per_s"] is None else f"{r['episodes_per_s']:.3f} episodes/s"
    print(f"  {rate} over {r['steady_iterations']} iterations after the first, peak {r['peak_mib']:.0f} MiB, "
          f"idle {r['learner_idle_fraction']:.2f}, success {r['end_success']:.2f}", flush=True)
    return r


RUN_FIGURES = (  # what the section reads of a run that did not fail
    "episodes", "episodes_per_s", "steady_iterations", "steady_needed", "peak_mib", "peak_sandboxes",
    "learner_idle_fraction", "time_to_target_s", "start_success", "end_success", "best_success", "iterations",
    "pauses_per_episode", "pause_s", "resume_s", "load", "history",
)


@dataclass(frozen=True)
class MemorySetup:
    """What the fixed-memory section says besides its runs: measured before them (the heavy sandbox's
    cost, the host's load) or given on the command line. With a row log it is all `memory_section` reads."""

    header: list[str]  # `header`'s lines: machine, time, command, load
    session: str  # this command's runs (`memory_session`): the verdicts rest on these alone
    commit: str  # the checkout they ran on (`git_commit`)
    cost: dict[str, float]  # `heavy_sandbox_cost`
    group: int  # GRPO group size
    cap: int  # episodes rows (a) and (b) play at once
    episodes: int  # episodes per iteration
    turns: int  # turns of an episode at most
    latencies: list[float]
    steady_iterations: int
    memory_minutes: float
    repeats: int  # runs per row and latency this command made
    smoke: bool  # --quick: no verdict
    reuse_logs: list[str]  # the names of the --reuse-rows logs
    sweep_link: str  # the plot, as the section links it
    busy: float  # cores other processes kept busy before the part started
    cores: int


def memory_session() -> str:
    """A name for this command's runs, dated and unique: a verdict compares runs of one session only."""
    return f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{os.urandom(2).hex()}"


def _ok(runs: list[dict]) -> list[dict]:
    """The runs of a cell that did not fail."""
    return [r for r in runs if "error" not in r]


def _median_of(runs: list[dict], key: str) -> float:
    """The median of ``key`` over runs that did not fail (`RUN_FIGURES`: each has it; NaN if None)."""
    found = spread(r[key] for r in _ok(runs))
    return float("nan") if found is None else found.median


def _typical(runs: list[dict]) -> dict | None:
    """The run of a cell whose steady rate is the median (the lower one of an even count), else its first
    run that did not fail: the run whose details the section tells."""
    steady = sorted((r for r in _ok(runs) if run_rate(r) is not None), key=run_rate)
    return steady[(len(steady) - 1) // 2] if steady else next(iter(_ok(runs)), None)


def _rate_cell(runs: list[dict], minutes: str) -> str:
    """The episodes/s cell: median (min-max) over the runs with a steady rate, or why there is none."""
    ok = _ok(runs)
    rates = spread(run_rate(r) for r in ok)
    failed = f", {len(runs) - len(ok)} failed" if len(ok) < len(runs) else ""
    if rates is None:
        done = max(r["steady_iterations"] for r in ok)
        return (f"not steady within {minutes}: {done} of {ok[0]['steady_needed']} iterations after the first"
                + failed)
    partial = f", {rates.count} of {len(ok)} runs steady" if rates.count < len(ok) else ""
    return rates.text() + partial + failed


def _ratio_cell(runs: list[dict], a_runs: list[dict]) -> str:
    """The vs (a) cell: the ratio of the medians, marked when the two rows are not runs of one session."""
    rates, base = spread(run_rate(r) for r in runs), spread(run_rate(r) for r in a_runs)
    if rates is None or base is None:
        return "-"
    sessions = {r["session"] for r in runs} | {r["session"] for r in a_runs}
    return f"{rates.median / base.median:.2f}x" + ("" if len(sessions) == 1 else " ((a) of other runs)")


def _row_line(name: str, latency: float, runs: list[dict], a_runs: list[dict], minutes: str) -> str:
    """One row of the table at one latency: its runs' medians (episodes/s and peak: with min-max)."""
    ok = _ok(runs)
    if not ok:
        what = f"failed: {runs[-1]['error']}" if runs else "not measured"
        return f"| {name} | {latency:g} s | {len(runs)} | {what} |" + " |" * 9

    def med(key: str) -> float:
        return _median_of(ok, key)

    peaks = spread(r["peak_mib"] for r in ok)
    reached = [r["time_to_target_s"] for r in ok if r["time_to_target_s"] is not None]
    to_target = (f"not within {minutes}" if not reached else
                 f"{_minutes(spread(reached).median)} ({len(reached)} of {len(ok)} runs)")
    return (f"| {name} | {latency:g} s | {len(runs)} | {_rate_cell(runs, minutes)} | "
            f"{_ratio_cell(runs, a_runs)} | "
            f"{peaks.text('.0f')} MiB ({med('peak_sandboxes'):.0f} sandboxes) | "
            f"{med('learner_idle_fraction'):.2f} | {to_target} | {med('start_success'):.2f} / "
            f"{med('end_success'):.2f} / {med('best_success'):.2f} | {med('iterations'):.0f} | "
            f"{med('pauses_per_episode'):.1f} | {med('pause_s'):.2f} / {med('resume_s'):.2f} s | "
            f"{med('load'):.1f} |")


def memory_targets(by_cell: dict, setup: MemorySetup) -> list[str]:
    """The targets of this table, each ending in met or missed on the medians of this command's runs
    (`memory_sweep.compare`), or no verdict and why; the break-even latencies inferred from the ratios
    of medians and of the extremes (`memory_sweep.break_even`)."""
    smoke = (f"a --quick smoke run ({setup.repeats} run{'s' * (setup.repeats != 1)} per row and latency, "
             f"{setup.memory_minutes:g} min rows): its figures carry no verdict" if setup.smoke else None)

    def against_a(latency: float, threshold: float, budget_mib: float | None = None) -> Comparison:
        found = compare(by_cell.get(("c", latency), []), by_cell.get(("a", latency), []), latency, threshold,
                        setup.session, budget_mib)
        return replace(found, refusal="; ".join(x for x in (smoke, found.refusal) if x)) if smoke else found

    latencies = sorted(setup.latencies)
    top = latencies[-1]
    at_top = against_a(top, 3.0, MEMORY_BUDGET_MIB)
    even = break_even([against_a(lat, 1.0) for lat in latencies], 1.0)
    three = break_even([against_a(lat, 3.0) for lat in latencies], 3.0)

    def ratio_words(cmp: Comparison) -> str:
        if cmp.ratio is None:
            return f"{cmp.latency:g} s -"
        extremes = f" ({cmp.worst:.2f}-{cmp.best:.2f}x)" if cmp.c.count > 1 or cmp.a.count > 1 else ""
        return f"{cmp.latency:g} s {cmp.ratio:.2f}x{extremes}"

    cycles, cycle = int(setup.cost["cycles"]), setup.cost["cycle_cpu_s"]
    cpu = (no_verdict(smoke) if smoke else
           no_verdict(f"{cycles} pause + resume cycle{'s' * (cycles != 1)} measured, {MIN_REPEATS} needed "
                      f"({cycle:.2f} CPU-s, for information only)") if cycles < MIN_REPEATS else
           verdict(cycle <= 0.5, f"{cycle:.2f} CPU-s, the median of {cycles} cycles"))
    return [
        "Break-even (inferred: linear interpolation of (c)/(a) between the measured latencies, not a "
        f"measured run at that latency; on the ratios of medians): (c) >= (a) from {even.median[0]}; (c) >= "
        f"3x (a) from {three.median[0]} (from min (c) / max (a): {three.worst[0]}; from max (c) / min (a): "
        f"{three.best[0]}). Ratios (c)/(a) by latency, of the medians (min (c) / max (a) to max (c) / min "
        "(a)): " + ", ".join(ratio_words(against_a(lat, 1.0)) for lat in latencies) + ".",
        "",
        f"- Target row (c) >= 3x row (a)'s episodes/s at {top:g} s within {MEMORY_BUDGET_MIB} MiB "
        f"(measured, medians of the runs): {ratio_verdict(at_top)}",
        "- Target break-even latency for (c) >= (a) <= 10 s (inferred, above): "
        f"{break_even_verdict(even, 10.0)}",
        f"- Target CPU per pause + resume of the heavy sandbox <= 0.5 CPU-s (measured, "
        f"`heavy_sandbox_cost`): {cpu}",
    ]


def provenance_text(by_cell: dict, setup: MemorySetup) -> str:
    """How the runs were made and which this command made: rows repeated and interleaved, the rest taken
    from earlier sweeps' logs (named by commit and session)."""
    runs = [r for cell in by_cell.values() for r in cell]
    mine = sorted({r["row"] for r in runs if r["session"] == setup.session})
    taken = sorted({(r["row"], str(r.get("commit") or "unknown"), str(r["session"]))
                    for r in runs if r["session"] != setup.session})
    text = ""
    if mine:
        text += (f"This command (session {setup.session}, commit {setup.commit}) ran rows "
                 + ", ".join(f"({k})" for k in mine) + f" {setup.repeats} time{'s' * (setup.repeats != 1)} "
                 "at each latency, interleaved (at one latency each repeat runs them one after another, "
                 "so that the host's drift reaches every row alike); a cell gives the median of its runs "
                 "and, in brackets, their min-max; the row log (`--rows-log`, JSON lines) keeps every run "
                 "with its row, latency, session, repeat and commit. ")
    if taken:
        text += ("Rows " + ", ".join(f"({k}) (commit {c}, session {s})" for k, c, s in taken)
                 + " come from the row logs of earlier runs of this script ("
                 + (", ".join(setup.reuse_logs) or "a row log") + ", `--reuse-rows`), taken as they were "
                 "measured; no verdict compares runs that this command did not measure. ")
    return text + (f"Verdicts rest on the medians of at least {MIN_REPEATS} runs each of (a) and (c), both "
                   "measured by this command: \"k of n runs\" counts the runs of (c) at or above the target "
                   "multiple of (a)'s median (within the budget), and the extremes are min (c) / max (a) and "
                   "max (c) / min (a). ")


def memory_section(records: list[dict], setup: MemorySetup) -> str:
    """The text of the ``bench:train-memory`` section from the runs of a row log (`memory_sweep.cells`)
    and ``setup``. Pure: it reads no clock, host or file, so a hand-made row log renders as a measured
    one does. A run that did not fail must carry every figure of `RUN_FIGURES`."""
    by_cell = cells(records)
    for (key, latency), runs in by_cell.items():
        for r in _ok(runs):
            if lacking := [k for k in RUN_FIGURES if k not in r]:
                raise ValueError(f"run {r['repeat']} of row ({key}) at {latency:g} s (session "
                                 f"{r['session']}) lacks {', '.join(lacking)}")
    latencies = sorted(setup.latencies)
    rows = memory_rows(setup.cap)
    by_cell = {(k, lat): by_cell.get((k, lat), []) for lat in latencies for k in rows}  # this table's cells
    minutes, steady = f"{setup.memory_minutes:g} min", setup.steady_iterations
    episodes, cap, top = setup.episodes, setup.cap, latencies[-1]
    lines = [
        "## Training at fixed memory (`bench/train.py --part memory`)",
        "",
        *setup.header,
        "",
        f"Task `agentenv/KVLookup-v0` (`env={MEMORY_ENV}`: a service holding 200 MiB in memory; one "
        f"sandbox measured at {setup.cost['sandbox_mib']:.0f} MiB, cgroup RSS after its install), k3_tiny, "
        f"GRPO groups of {setup.group}, warm starts; every pool's `memory_budget` is {MEMORY_BUDGET_MIB} MiB "
        f"of running sandboxes, so (a) and (b) play at most {cap} episodes at once "
        f"(`rollout.max_concurrent_episodes={cap}`: whole groups of the measured size within the budget). "
        "`rollout.policy_latency_s` sleeps that long in every generation call, an emulation of a larger "
        f"policy's generation time. Each run trains {1 + steady} iterations (`trainer.iterations`), at most "
        f"{minutes} (`trainer.time_limit_s`). Episodes/s: over the iterations after the first only (start-up "
        f"and the pool's template build excluded), and only when a run has all {steady} of them "
        f"({steady * episodes} episodes); a run that does not says so instead of a number. "
        + (f"The steady window is a stated minimum of {steady * episodes} episodes rather than "
           f"{STEADY_ITERATIONS} iterations: (a) and (b) at {top:g} s play {episodes // cap} waves of {cap} "
           f"episodes x up to {setup.turns} turns x {top:g} s, about "
           f"{episodes // cap * setup.turns * top / 60:.0f} min per iteration, so {STEADY_ITERATIONS} "
           "iterations per row would take hours. " if steady < STEADY_ITERATIONS else "")
        + provenance_text(by_cell, setup)
        + "Peak memory: the largest sum, sampled every second from the host, of the cgroup RSS (anonymous + "
        "shared memory) of the run's sandbox containers that have processes (running or frozen; a "
        "CRIU-paused sandbox has none). Load: the mean 1-minute load average during the run "
        f"({setup.cores} cores). Time to {MEMORY_TARGET:g}: the mean success of the last 2 iterations first "
        "at or above it. The figures after the peak are medians of the runs.",
        "",
        "| row | policy latency | runs | episodes/s (steady), median (min-max) | vs (a), ratio of medians | "
        f"peak sandbox memory, median (min-max) | learner idle | time to {MEMORY_TARGET:g} success | success "
        "first / end / best | iterations | pauses per episode | pause / resume p50 | load |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for latency in latencies:
        for key, (name, _o) in rows.items():
            lines.append(_row_line(name, latency, by_cell[(key, latency)], by_cell[("a", latency)], minutes))
    lines += ["", f"![episodes/s against policy latency, median and min-max of the runs]({setup.sweep_link})",
              "", *memory_targets(by_cell, setup), ""]
    failed = [f"({r['row']}) at {latency:g} s, repeat {r['repeat']}: {r['error']}"
              for (_k, latency), runs in by_cell.items() for r in runs if "error" in r]
    if failed:
        lines += ["Failed runs: " + "; ".join(failed) + ".", ""]
    measured_c = [(lat, _ok(by_cell[("c", lat)])) for lat in latencies
                  if any(r["episodes"] for r in _ok(by_cell[("c", lat)]))]
    if measured_c:
        lat, runs = measured_c[-1]
        lines += [*cpu_lines(setup.cost, _median_of(runs, "pauses_per_episode"), len(runs), setup.group, lat,
                             setup.busy, setup.cores), "", *budget_lines(by_cell, measured_c), ""]
        def waves(run: dict) -> str:
            return " / ".join(f"{h.get('rollout_waves', 0.0):.0f}" for h in run["history"])

        lines += ["Waves row (c) played its groups in, per iteration of each run (`rollout_waves`, summed "
                  "over the iteration's rollout calls: a call that plays every episode at once counts 1, one "
                  "that plays waves fitting the free slots, where those beat pausing the episodes beyond "
                  "them every turn, counts each wave; runs separated by commas): "
                  + "; ".join(f"{lat:g} s: " + ", ".join(waves(r) for r in runs) for lat, runs in measured_c)
                  + ".", ""]
    ok = [r for runs in by_cell.values() for r in _ok(runs) if r["history"]]
    if ok:
        best = max(ok, key=lambda r: r["best_success"])
        best_at = max(best["history"], key=lambda h: h["success"])["elapsed_s"]
        lines.append(
            "Learning the heavy task: the best of these runs reached success "
            f"{best['best_success']:.2f} (start {best['start_success']:.2f}, end {best['end_success']:.2f}) "
            f"after {best_at / 60:.1f} min of training; a policy that ignores the answers wins at most 0.50, "
            "binary search 1.0."
        )
    return "\n".join(lines).rstrip()


def part_memory(args: argparse.Namespace, user: list[str], command: str) -> str:
    """The fixed-memory table: rows (a), (b), (c) at each policy latency of ``--latencies``, each run
    ``--repeats`` times (interleaved) and every run appended to ``--rows-log`` as it ends; the plot
    (``args.sweep_image``: medians with min-max bars) and the text of the ``bench:train-memory`` section
    (`memory_section`, from the same runs as the log keeps them)."""
    start_load = os.getloadavg()[0]
    latencies = sorted(args.latencies)
    user = [*QUICK_MEMORY, *user] if args.quick else user
    busy = busy_cores_before()  # other jobs' load now: the per-operation CPU below counts it too
    print("the heavy sandbox's size and the cost of moving its state (pause + resume, fork) ...", flush=True)
    group = compose([f"env={MEMORY_ENV}", *user]).algo.group_size
    cost = heavy_sandbox_cost(user, forks=group - 1, cycles=1 if args.quick else MIN_REPEATS)
    print(f"  {cost}", flush=True)
    group, cap = memory_concurrency(user, cost["sandbox_mib"])
    rows = memory_rows(cap)
    cfg = compose([f"env={MEMORY_ENV}", *user])
    records = reused_rows(args, rows, latencies)  # before the runs: a sweep it cannot complete is refused
    session, commit = memory_session(), git_commit()
    for lat in latencies:
        for repeat in range(1, args.repeats + 1):
            for key, (_name, overrides) in rows.items():
                if key not in args.rows:
                    continue
                print(f"repeat {repeat} of {args.repeats}:", end=" ", flush=True)
                r = run_memory_row(key, lat, overrides, args, user)
                line = json.dumps({"row": key, "latency": lat, "session": session, "repeat": repeat,
                                   "repeats": args.repeats, "commit": commit,
                                   **{k: v for k, v in r.items() if k != "result"}},  # "result": a repr
                                  default=str)
                with open(args.rows_log, "a") as log:  # each run as it ends: a long sweep's partial record
                    log.write(line + "\n")
                records.append(json.loads(line))  # the section reads the runs as the log keeps them
    by_cell = cells(records)
    plot_sweep({key: {lat: [run_rate(r) for r in by_cell.get((key, lat), [])] for lat in latencies}
                for key in rows},
               {key: ",".join(name.split(",")[:2]) for key, (name, _o) in rows.items()},
               args.sweep_image, f"Fixed {MEMORY_BUDGET_MIB} MiB, {MEMORY_ENV}: episodes/s vs policy latency")
    setup = MemorySetup(
        header=header(command, start_load, busy), session=session, commit=commit, cost=cost, group=group,
        cap=cap, episodes=int(cfg.algo.episodes_per_step), turns=int(cfg.env.kwargs["max_turns"]),
        latencies=latencies, steady_iterations=args.steady_iterations, memory_minutes=args.memory_minutes,
        repeats=args.repeats, smoke=args.quick,
        reuse_logs=[p.name for p in args.reuse_rows or []], sweep_link=args.sweep_link, busy=busy,
        cores=os.cpu_count() or 1,
    )
    return memory_section(records, setup)


def reused_rows(args: argparse.Namespace, rows: dict, latencies: list[float]) -> list[dict]:
    """The runs of the rows this command does not run (those not in ``--rows``), from the ``--reuse-rows``
    logs (JSON lines of earlier sweeps, read in order): per row and latency every run of the session of
    its last line (a later sweep wins). A line of an older log that names no session is a session of its
    own (one run), one without a repeat is repeat 1; each must name the commit it ran on (its ``commit``
    field, else ``--reuse-commit``). Refuses a sweep with a row it can neither run nor reuse."""
    wanted = [(k, lat) for lat in latencies for k in rows if k not in args.rows]
    if not wanted:
        return []
    logs = [p for p in args.reuse_rows or [] if p.is_file()]
    if not logs:
        raise SystemExit(f"rows {', '.join(sorted({k for k, _ in wanted}))} are not run (--rows "
                         f"{' '.join(args.rows) or 'none'}): give the logs of the sweeps they come from "
                         "with --reuse-rows")
    found: dict[tuple[str, float], list[dict]] = {}
    for log in logs:
        for number, text in enumerate(log.read_text().splitlines(), 1):
            if not text.strip():
                continue
            try:
                row = json.loads(text)
            except json.JSONDecodeError as exc:
                raise SystemExit(f"{log}, line {number}: not a JSON row ({exc})") from exc
            row["session"] = row.get("session") or f"{log.name}:{number}"
            row["repeat"] = row.get("repeat") or 1
            found.setdefault((row["row"], float(row["latency"])), []).append(row)
    missing = [f"({k}) at {lat:g} s" for k, lat in wanted if (k, lat) not in found]
    if missing:
        raise SystemExit(f"{', '.join(str(p) for p in logs)} hold no row {', '.join(missing)}")
    out = []
    for key in wanted:
        last = found[key][-1]["session"]
        for row in (r for r in found[key] if r["session"] == last):
            row["commit"] = row.get("commit") or args.reuse_commit
            if not row["commit"]:
                raise SystemExit(f"row ({key[0]}) at {key[1]:g} s names no commit; state the one it ran on "
                                 "with --reuse-commit")
            if "history" not in row:  # older logs kept it only inside the repr of the run's result
                found_history = re.search(r"history=(\[.*\])\)$", str(row.get("result", "")), re.S)
                row["history"] = ast.literal_eval(found_history.group(1)) if found_history else []
            out.append(row)
    return out


def memory_limit(memory_dir: Path) -> int | None:
    """The memory limit of a cgroup in bytes (v1 ``memory.limit_in_bytes``, v2 ``memory.max``); None
    when it sets none."""
    for name in ("memory.limit_in_bytes", "memory.max"):
        try:
            text = (memory_dir / name).read_text().strip()
        except OSError:
            continue
        return None if text == "max" or int(text) >= 2**62 else int(text)
    return None


def peak_sample_words(c: dict) -> str:
    """What made row ``c``'s peak memory sample, as its row log kept it: each container's RSS, and its
    limit and processes where one read above its own limit."""
    parts = c.get("peak_parts")
    if not parts:
        return f"its peak sample summed {c['peak_sandboxes']} sandboxes; that run's log keeps no breakdown"

    def part(p: dict) -> str:
        over = p["limit"] is not None and p["rss"] > p["limit"]
        return (f"{p['rss_mib']} MiB (container {p['container']}, above its own {p['limit'] / 2**20:.0f} MiB "
                f"limit, {p['processes']} processes in its cgroup)" if over else f"{p['rss_mib']} MiB")

    return (f"its peak sample, {c['peak_at_s']:.0f} s into the run, summed {c['peak_sandboxes']} sandboxes "
            f"of {' + '.join(part(p) for p in parts)}")


def budget_lines(by_cell: dict, measured_c: list[tuple[float, list[dict]]]) -> list[str]:
    """Whether the runs kept the budget (measured: the host's peak sample): row (c)'s peaks per latency
    (median, min-max), every run of any row over it named by row, latency, repeat and peak (for (c), with
    the containers that made it), and how (c) kept it, told on its median-rate run at the highest latency."""
    peaks = ", ".join(f"{lat:g} s {spread(r['peak_mib'] for r in runs).text('.0f')} MiB"
                      for lat, runs in measured_c)
    over = []
    for (key, _lat), runs in by_cell.items():
        names = budget_breaches(runs, MEMORY_BUDGET_MIB)
        broke = [r for r in runs if (p := run_peak(r)) is not None and p > MEMORY_BUDGET_MIB]
        over += [f"{name} ({peak_sample_words(r)})" if key == "c" else name for name, r in zip(names, broke,
                                                                                             strict=True)]
    kept = "no run of any row exceeded it" if not over else "exceeded by " + "; ".join(over)
    latency, runs = measured_c[-1]
    c = _typical(runs)
    slots = max(h.get("sandbox_slots", 0.0) for h in c["history"])  # admission control's slots
    wait = sum(h.get("sandbox_slot_wait_s", 0.0) for h in c["history"]) / max(len(c["history"]), 1)
    waves = [h.get("rollout_waves", 0.0) for h in c["history"]]
    how = (
        f"At {latency:g} s (repeat {c['repeat']}, its run of median rate) it went through the runner's "
        f"admission control (`rollout.sandbox_pool.admission`, agentenv/pool/residency.py): a sandbox runs "
        f"only in one "
        f"of {slots:.0f} slots (`memory_budget` over the median RSS the pool measured), {wait:.0f} s of slot "
        f"waits per iteration summed over episodes, the groups played in "
        f"{' / '.join(f'{w:.0f}' for w in waves)} waves per iteration (`rollout_waves`, below), and the cost "
        "model pauses under pressure only as many waiting sandboxes as the budget needs."
        if slots else f"At {latency:g} s (repeat {c['repeat']}, its run of median rate) it ran without "
                      "admission control (`rollout.sandbox_pool.admission=false`)."
    )
    return [f"Budget (measured, host samples every second): row (c)'s peaks, median (min-max) of its runs, "
            f"{peaks} against {MEMORY_BUDGET_MIB} MiB; {kept}. {how}"]


HEAVY_TARGET = 0.9  # the success the heavy-task learning run aims at (mean of trainer.success_window)


def part_heavy(args: argparse.Namespace, user: list[str], command: str) -> str:
    """k3_tiny learning the heavy task alone: row (a)'s setup (sync, seed-reset groups on live sandboxes,
    concurrency within the 2 GiB budget), no emulated latency, ``--heavy-minutes`` at most; the text of
    the ``bench:train-heavy`` section and its curve."""
    start_load = os.getloadavg()[0]
    busy = busy_cores_before()  # other jobs' load before the part starts anything
    sandbox_mib = heavy_sandbox_cost(user, forks=0, cycles=0)["sandbox_mib"]  # measured, not typed
    _group, cap = memory_concurrency(user, sandbox_mib)
    _name, row_a = memory_rows(cap)["a"]
    heavy_pool = f"bench-heavy-{os.urandom(3).hex()}"  # its own: see run_memory_row
    overrides = [
        *fixed_memory_run(heavy_pool, args.heavy_minutes * 60),
        f"trainer.stop_at_success={HEAVY_TARGET}",
        *row_a,
        *user,
    ]
    print(f"heavy task: learning run (at most {args.heavy_minutes:g} min) ...", flush=True)
    run_dir = Path(tempfile.mkdtemp(prefix="k3rl-bench-heavy-"))
    try:
        with SandboxMemorySampler(heavy_pool) as sampler:
            r = training_run(overrides, run_dir, target=HEAVY_TARGET)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    cfg = compose(overrides)
    r["window"] = int(cfg.trainer.success_window)
    if not args.no_write:  # --no-write (and --quick) leave docs/ alone
        plot_modes({"KVLookup, k3_tiny": r}, ROOT / "docs" / "img" / "train_heavy_curve.png", HEAVY_TARGET,
                   "k3_tiny on the heavy task (agentenv/KVLookup-v0)")
    reached = _minutes(r["time_to_target_s"], f"not within {args.heavy_minutes:g} min")
    game = cfg.env.kwargs  # a plain dict after the schema's validation
    load = sum(sampler.loads) / max(len(sampler.loads), 1)
    lines = [
        "## Learning the heavy task (`bench/train.py --part heavy`)",
        "",
        *header(command, start_load, busy),
        "",
        f"`python -m rl.train env={MEMORY_ENV}` with row (a)'s setup of the fixed-memory table (sync, "
        f"seed-reset groups on live sandboxes, at most {cap} episodes at once within a "
        f"{MEMORY_BUDGET_MIB} MiB `memory_budget`, warm starts), no emulated latency, stopping at success "
        f"{HEAVY_TARGET} (mean of the last {r['window']} iterations) or after {args.heavy_minutes:g} min. "
        f"The game: {game['num_values']} values, {game['max_turns']} turns; a policy that "
        f"ignores the answers wins at most {game['max_turns'] / game['num_values']:.2f}, "
        "binary search 1.0.",
        "",
        "| figure | value |",
        "|---|---|",
        f"| success at the start (first iteration) | {r['start_success']:.2f} |",
        f"| success at the end (mean of the last {r['window']} iterations) | {r['end_success']:.2f} |",
        f"| best iteration | {r['best_success']:.2f} |",
        f"| time to {HEAVY_TARGET} | {reached} |",
        f"| iterations / episodes | {r['iterations']} / {r['episodes']:.0f} |",
        f"| total wall time (incl. Ray, template build) | {r['wall_s'] / 60:.1f} min |",
        f"| episodes/s (after the first iteration) | {_rate(r, 'episodes_per_s', '.1f')} |",
        f"| peak sandbox memory (host, cgroup RSS) | {sampler.peak_mib:.0f} MiB |",
        f"| mean 1-minute load average | {load:.1f} |",
        "",
        "![heavy task learning curve](img/train_heavy_curve.png)",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="short training and fewer rollout repeats")
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/ alone")
    parser.add_argument(
        "--part",
        choices=("all", "train", "memory", "heavy"),
        default="all",
        help="train: rollout micro-benchmark and sync vs async training (section bench:train); memory: "
        "the fixed-memory table (section bench:train-memory); heavy: k3_tiny learning the heavy task "
        "(section bench:train-heavy); all: every part",
    )
    parser.add_argument(
        "--memory-minutes", type=float, default=MEMORY_MINUTES,
        help="time limit of each fixed-memory run (a row that has not its steady window by then says so)"
    )
    parser.add_argument(
        "--latencies", type=float, nargs="+", default=list(MEMORY_LATENCIES),
        help="emulated policy latencies (s) of the fixed-memory sweep"
    )
    parser.add_argument(
        "--steady-iterations", type=int, default=STEADY_ITERATIONS,
        help="iterations after the first each fixed-memory row runs and takes its rate over"
    )
    parser.add_argument(
        "--repeats", type=int, default=None,
        help=f"runs of each fixed-memory row at each latency (default {MIN_REPEATS}, at least {MIN_REPEATS}: "
        "a verdict rests on their median; fewer only with --quick, whose section then gives no verdict; "
        "--quick's default: 1)"
    )
    parser.add_argument(
        "--rows-log", type=Path, default=Path(tempfile.gettempdir()) / "k3rl-bench-memory-rows.jsonl",
        help="file each fixed-memory run is appended to (JSON lines, every repeat) as it ends"
    )
    parser.add_argument(
        "--rows", nargs="*", choices=("a", "b", "c"), default=["a", "b", "c"],
        help="fixed-memory rows to run (none: the section from --reuse-rows alone); the others come from "
        "--reuse-rows"
    )
    parser.add_argument(
        "--reuse-rows", type=Path, nargs="+", default=None,
        help="JSON-lines row logs of earlier sweeps (read in order, a later line wins) that the rows not "
        "in --rows are taken from"
    )
    parser.add_argument(
        "--reuse-commit", default="",
        help="the commit the reused rows ran on, for log lines that do not name one"
    )
    parser.add_argument(
        "--heavy-minutes", type=float, default=15.0, help="time limit of the heavy-task learning run"
    )
    parser.add_argument(
        "overrides", nargs="*", help="Hydra overrides for every part (e.g. sandbox.image=...)"
    )
    args = parser.parse_args()
    os.environ.setdefault("RAY_worker_niceness", "0")
    user = list(args.overrides)
    options = (" --quick" if args.quick else "") + (f" --part {args.part}" if args.part != "all" else "")
    if args.repeats is not None and args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: a row needs at least one run")
    if args.part in ("all", "memory"):
        if args.quick:  # a smoke run of the plumbing: one latency, short rows; its figures mean nothing
            args.latencies, args.steady_iterations, args.memory_minutes = [2.0], 1, 1.0
        elif args.repeats is not None and args.repeats < MIN_REPEATS:
            parser.error(f"--repeats {args.repeats}: a verdict rests on the median of at least {MIN_REPEATS} "
                         "runs per row and latency; fewer only with --quick (a smoke run, no verdict)")
        if args.repeats is not None and args.repeats != (1 if args.quick else MIN_REPEATS):
            options += f" --repeats {args.repeats}"
        if args.memory_minutes != MEMORY_MINUTES:
            options += f" --memory-minutes {args.memory_minutes:g}"
        if sorted(args.latencies) != list(MEMORY_LATENCIES):
            options += " --latencies " + " ".join(f"{lat:g}" for lat in sorted(args.latencies))
        if args.steady_iterations != STEADY_ITERATIONS:
            options += f" --steady-iterations {args.steady_iterations}"
        if sorted(args.rows) != ["a", "b", "c"]:
            options += " --rows" + "".join(f" {r}" for r in sorted(args.rows))
            if args.reuse_rows is not None:
                options += " --reuse-rows " + " ".join(str(p) for p in args.reuse_rows)
            if args.reuse_commit:
                options += f" --reuse-commit {args.reuse_commit}"
    args.repeats = args.repeats or (1 if args.quick else MIN_REPEATS)
    if args.quick and not args.no_write:
        print("--quick writes nothing to docs/ (sections and images): its figures are a smoke test")
        args.no_write = True
    args.sweep_image = (ROOT / "docs" / "img" / "train_memory_sweep.png" if not args.no_write
                        else Path(tempfile.mkdtemp(prefix="k3rl-bench-sweep-")) / "train_memory_sweep.png")
    args.sweep_link = "img/train_memory_sweep.png" if not args.no_write else str(args.sweep_image)
    if args.part in ("all", "heavy") and args.heavy_minutes != 15.0:
        options += f" --heavy-minutes {args.heavy_minutes:g}"
    command = "python bench/train.py" + options + "".join(f" {o}" for o in user)
    sections = []
    if args.part in ("all", "train"):
        sections.append(("train", part_train(args, user, command)))
    if args.part in ("all", "memory"):
        sections.append(("train-memory", part_memory(args, user, command)))
    if args.part in ("all", "heavy"):
        sections.append(("train-heavy", part_heavy(args, user, command)))
    for name, text in sections:
        print(text)
        if not args.no_write:
            write_section(name, text)


if __name__ == "__main__":
    main()
