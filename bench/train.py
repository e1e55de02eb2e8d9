"""Training benchmark: how fast the tiny K3 policy learns, what a rollout costs, and training at fixed memory.

Four parts, all in this run on this machine (``--part train``, ``memory`` or ``heavy`` runs one section):

1. **Rollout micro-benchmark** (no Ray, the untrained policy): env steps/s of the default task with
   (a) the persistent shell session and seed-reset groups (the default), (b) one ``docker exec`` per
   command (the baseline), (c) forked group starts (reset once + CRIU fork of the sandbox).
2. **Training runs** with the default config (``make train``), once with ``trainer.mode=sync`` and once
   with ``trainer.mode=async``: success at the start, wall time until the mean success of the last
   ``trainer.success_window`` iterations reaches 0.9, episodes/s, env steps/s, generated tokens/s and
   the learner's idle fraction.
3. **Fixed memory** (``--part memory``): the heavy task ``agentenv/KVLookup-v0`` (``env=kv_lookup``,
   ~208 MiB per sandbox) with a 2 GiB ``memory_budget`` for running sandboxes and
   ``rollout.policy_latency_s`` at 0 and 2 s (an emulation of a larger policy's generation time); rows
   (a) sync without pausing, concurrency capped by the budget (``rollout.max_concurrent_episodes``),
   (b) as (a) with waiting sandboxes frozen (``pause_method: freeze``, ``docker pause``: memory kept),
   (c) async with zero-memory waits (CRIU pauses by the cost model) and forked groups; each trains for
   ``--memory-minutes``. Columns: episodes/s, peak sandbox memory sampled from the host (cgroup RSS of
   the run's containers), learner idle fraction, time to success 0.3, ratios against (a).

4. **Learning the heavy task** (``--part heavy``): k3_tiny trains on ``env=kv_lookup`` with row (a)'s
   setup and no emulated latency until success 0.9 or ``--heavy-minutes``: start, end and best success,
   the time to 0.9, the curve.

Parts 1-2 replace the ``bench:train`` section of docs/benchmarks.md (curves: docs/img/
train_learning_curve.png, sync vs async: docs/img/train_sync_vs_async.png), part 3 the
``bench:train-memory`` section, part 4 ``bench:train-heavy`` (curve: docs/img/train_heavy_curve.png).

    python bench/train.py                  # everything (about an hour on 2 cores)
    python bench/train.py --part train     # parts 1-2 (about 15-25 minutes)
    python bench/train.py --part memory    # part 3 (6 runs of 3 min, plus start-up and shutdown: ~35 min)
    python bench/train.py --part heavy     # part 4 (at most 15 min of training)
    python bench/train.py --quick          # smoke version: short training, 2 s latency only
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import tempfile
import threading
import time
from pathlib import Path

from bench_report import ROOT, compose, host_cpu_seconds, write_section


def rollout_throughput(overrides: list[str], groups: int, repeats: int) -> dict:
    """Env steps/s of `EpisodeRunner` (after one warm-up run that creates the sandboxes)."""
    import torch

    from rl.engines import build_engine
    from rl.policy import build_policy
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


def training_run(overrides: list[str], run_dir: Path, target: float = 0.9) -> dict:
    """One `rl.train` run with ``overrides``; its figures from the per-iteration records. ``target``:
    the success whose first reaching (mean of the last ``trainer.success_window`` iterations) is timed."""
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

    # steady state: the episodes after the first iteration (Ray, sandbox and template start-up) per second
    def steady(key: str) -> float:
        if len(history) >= 3:
            return (total(key) - history[0][key]) / (history[-1]["elapsed_s"] - history[0]["elapsed_s"])
        return total(key) / history[-1]["elapsed_s"]

    return {
        "result": result,
        "history": history,
        "iterations": len(history),
        "start_success": result.start_success,
        "end_success": result.end_success,
        "best_success": max(r["success"] for r in history),
        "time_to_target_s": reached_at,
        "episodes": total("episodes"),
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


def header(command: str, start_load: float) -> list[str]:
    """The machine, the time, the command, and the 1-minute load average at the part's start (taken
    before it ran anything: other jobs) and now."""
    shared = ""
    if start_load > 1.0:
        shared = " — other jobs were running when it started, so wall times are upper bounds"
    return [
        f"Machine: {os.cpu_count()} CPU cores ({platform.processor() or platform.machine()}), no GPU; "
        f"measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. Command: `{command}`.",
        f"Load average (1 min): {start_load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end{shared}.",
    ]


def part_train(args: argparse.Namespace, user: list[str], command: str) -> str:
    """The rollout micro-benchmark and the sync vs async training runs of `make train`'s config; the
    text of the ``bench:train`` section."""
    start_load = os.getloadavg()[0]
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
        *header(command, start_load),
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
    forked_vs_seeded = forked["episodes_per_s"] / seeded["episodes_per_s"]
    lines += [
        "",
        "Fork latency: each group's fork of its G-1 members (all groups fork at once), over its members; "
        "fork phase: the wall time of the whole fork phase over all forked members, i.e. what a forked "
        f"member costs the rollout. Forked groups run at {forked_vs_seeded:.2f}x "
        "the episodes/s of seed groups (target >= 0.9x), at "
        f"{forked['fork_phase_ms']:.0f} ms of fork phase per forked member (target <= 500 ms).",
    ]
    s, a = runs["sync"], runs["async"]
    rows = [
        ("iterations (optimizer steps of a batch)", lambda r: f"{r['iterations']}"),
        ("episodes", lambda r: f"{r['episodes']:.0f}"),
        ("success at the start (first iteration)", lambda r: f"{r['start_success']:.2f}"),
        ("success at the end (mean of the last iterations)", lambda r: f"{r['end_success']:.2f}"),
        ("wall time to 0.9 success", lambda r: _minutes(r["time_to_target_s"])),
        ("total wall time (incl. Ray and sandbox start-up)", lambda r: f"{r['wall_s'] / 60:.1f} min"),
        ("episodes/s (after the first iteration)", lambda r: f"{r['episodes_per_s']:.1f}"),
        ("env steps/s (after the first iteration)", lambda r: f"{r['env_steps_per_s']:.0f}"),
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
SANDBOX_MIB = 208  # RSS of one KVLookup sandbox at data_mib=200 (docs/tasks.md, cgroup total_rss)
MEMORY_TARGET = 0.3  # the success the table times (mean of the last 2 iterations)


class SandboxMemorySampler:
    """Host-side memory of the sandboxes of the pools named ``prefix-*``: every ``interval_s`` the sum of
    the cgroup RSS (anonymous + shared memory, `agentenv.backend.cgroups.read_usage`) of their
    containers that have processes (running or frozen; a CRIU-paused one has none), and the 1-minute
    load average. Runs in a thread of the bench process while the training run's workers own the pools."""

    def __init__(self, prefix: str, interval_s: float = 1.0) -> None:
        self.prefix = prefix
        self.interval_s = interval_s
        self.samples: list[tuple[int, int]] = []  # (bytes, sandboxes with processes) per sample
        self.loads: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _sample(self) -> tuple[int, int]:
        from agentenv.backend import docker_client
        from agentenv.backend.cgroups import cgroup_dirs, read_usage
        from agentenv.pool.pool import LABEL_POOL

        api, total, count = docker_client.api(), 0, 0
        for c in api.containers(filters={"label": LABEL_POOL}):
            if not (c.get("Labels") or {}).get(LABEL_POOL, "").startswith(f"{self.prefix}-"):
                continue
            try:
                pid = int(api.inspect_container(c["Id"])["State"].get("Pid") or 0)
            except Exception:  # removed meanwhile
                continue
            dirs = cgroup_dirs(pid) if pid else {}
            # only the container's own cgroup: a pid that is gone (or reused) would read another one's
            if c["Id"] in str(dirs.get("memory") or dirs.get("unified") or ""):
                total += read_usage(pid).rss_bytes
                count += 1
        return total, count

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.samples.append(self._sample())
            except Exception:  # Docker busy: skip this sample
                continue
            self.loads.append(os.getloadavg()[0])

    def __enter__(self) -> SandboxMemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def peak_mib(self) -> float:
        return max(self.samples, default=(0, 0))[0] / 2**20

    @property
    def peak_sandboxes(self) -> int:
        """How many sandboxes had processes at the peak sample."""
        return max(self.samples, default=(0, 0))[1]


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
            "(c) async, all episodes at once, waiting sandboxes paused by CRIU (zero memory), forked groups",
            [
                "trainer.mode=async",
                "env.group_start=fork",
                "rollout.sandbox_pool.pause_policy=cost",
                "+rollout.sandbox_pool.overrides.idle_after_s=0",
            ],
        ),
    }


def memory_concurrency(user: list[str]) -> tuple[int, int]:
    """The heavy task's GRPO group size and the episodes rows (a) and (b) play at once: whole groups of
    sandboxes within the memory budget (at least one group)."""
    group = compose([f"env={MEMORY_ENV}", *user]).algo.group_size
    return group, max(group, MEMORY_BUDGET_MIB // SANDBOX_MIB // group * group)


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
    """What moving one heavy-task sandbox's state costs the host, measured on its own before the runs:
    CPU seconds (the whole host's, `host_cpu_seconds`) and wall seconds of a CRIU pause + resume, and of
    a group start's fork of ``forks`` members (per member); medians over ``cycles``. The sandbox is made
    as the rollout makes it (the env's kwargs and sandbox profile), without a pool."""
    from statistics import median

    from rl.demonstrations import task_env
    from rl.wrappers import task

    env = task_env(compose([f"env={MEMORY_ENV}", *user]))
    try:
        env.reset(seed=0)
        sandbox_task = task(env)
        cycle_cpu, cycle_wall, fork_cpu, fork_wall = [], [], [], []
        for _ in range(cycles):
            cpu, wall = host_cpu_seconds(), time.perf_counter()
            sandbox_task.pause()
            sandbox_task.resume()
            cycle_cpu.append(host_cpu_seconds() - cpu)
            cycle_wall.append(time.perf_counter() - wall)
            cpu, wall = host_cpu_seconds(), time.perf_counter()
            members = sandbox_task.fork(forks)
            fork_cpu.append((host_cpu_seconds() - cpu) / forks)
            fork_wall.append((time.perf_counter() - wall) / forks)
            for member in members:
                member.close()
    finally:
        env.close()
    return {"cycle_cpu_s": median(cycle_cpu), "cycle_wall_s": median(cycle_wall),
            "fork_cpu_s": median(fork_cpu), "fork_wall_s": median(fork_wall), "cycles": cycles}


def cpu_floor_lines(cost: dict[str, float], a2: dict, c2: dict, group: int, cap: int) -> list[str]:
    """Why row (c) can or cannot reach 3x row (a) on this host: the CPU its state moves need at that
    rate, from `heavy_sandbox_cost` and (c)'s pauses per episode, against the cores there are."""
    forks_per_episode = (group - 1) / group
    per_episode = c2["pauses_per_episode"] * cost["cycle_cpu_s"] + forks_per_episode * cost["fork_cpu_s"]
    needed = 3 * a2["episodes_per_s"] * per_episode
    cores = os.cpu_count() or 1
    return [
        f"What limits (c) on this machine: moving a {SANDBOX_MIB} MiB sandbox's state. Measured before the "
        "runs on one sandbox of the task, alone on the host (`heavy_sandbox_cost` in bench/train.py, the "
        f"host's busy CPU time from /proc/stat, medians of {cost['cycles']}): a CRIU pause + resume costs "
        f"{cost['cycle_cpu_s']:.2f} CPU-s ({cost['cycle_wall_s']:.2f} s of wall time), a group start's "
        f"fork {cost['fork_cpu_s']:.2f} CPU-s per forked member ({cost['fork_wall_s']:.2f} s of wall time "
        f"per member, {group - 1} at once). At (c)'s {c2['pauses_per_episode']:.1f} pauses per episode and "
        f"{forks_per_episode:.2f} forks per episode that is {per_episode:.2f} CPU-s per episode before the "
        f"policy, the learner or the task run a single instruction; 3x (a)'s "
        f"{a2['episodes_per_s']:.2f} episodes/s would need {needed:.1f} CPU-s per second, "
        f"{needed / cores:.1f}x the {cores} cores this host has. "
        + ("So the target is out of reach here whatever the scheduling: it needs a host with that many "
           "cores to spare for CRIU, or dumps that write only the memory changed since the previous one "
           "(CRIU's pre-dump with memory dirty tracking, which this kernel lacks). "
           if needed > cores else "The cores would suffice, so the limit lies elsewhere. ")
        + f"(a) never moves state: its {cap} sandboxes stay live and only wait.",
    ]


def part_memory(args: argparse.Namespace, user: list[str], command: str) -> str:
    """The fixed-memory table: rows (a), (b), (c) at each policy latency; the text of the
    ``bench:train-memory`` section."""
    start_load = os.getloadavg()[0]
    group, cap = memory_concurrency(user)
    limit_s = args.memory_minutes * 60
    latencies = (2.0,) if args.quick else (0.0, 2.0)
    rows = memory_rows(cap)
    print("the cost of moving one heavy sandbox's state (pause + resume, fork) ...", flush=True)
    cost = heavy_sandbox_cost(user, forks=group - 1)
    print(f"  {cost}", flush=True)
    results: dict[tuple[str, float], dict] = {}
    for latency in latencies:
        for key, (_name, overrides) in rows.items():
            prefix = f"bench-mem-{key}-{int(latency)}"
            print(f"memory row {key}, policy latency {latency:g} s ...", flush=True)
            run_overrides = [
                *fixed_memory_run(prefix, limit_s),
                f"rollout.policy_latency_s={latency:g}",
                "trainer.success_window=2",
                *overrides,
                *user,
            ]
            run_dir = Path(tempfile.mkdtemp(prefix=f"k3rl-bench-mem-{key}-"))
            try:
                with SandboxMemorySampler(prefix) as sampler:
                    r = training_run(run_overrides, run_dir, target=MEMORY_TARGET)
            except Exception as exc:  # one failed row (e.g. too many failed episodes) is reported as such
                results[(key, latency)] = {"error": f"{type(exc).__name__}: {exc}".splitlines()[0][:200]}
                print(f"  failed: {results[(key, latency)]['error']}", flush=True)
                shutil.rmtree(run_dir, ignore_errors=True)
                continue
            r["peak_mib"], r["peak_sandboxes"] = sampler.peak_mib, sampler.peak_sandboxes
            r["load"] = sum(sampler.loads) / max(len(sampler.loads), 1)
            r["pause_s"] = max(h.get("sandbox_pause_p50_s", 0.0) for h in r["history"])
            r["resume_s"] = max(h.get("sandbox_resume_p50_s", 0.0) for h in r["history"])
            results[(key, latency)] = r
            shutil.rmtree(run_dir, ignore_errors=True)
            print(
                f"  {r['episodes_per_s']:.2f} episodes/s, peak {r['peak_mib']:.0f} MiB, "
                f"idle {r['learner_idle_fraction']:.2f}, success {r['end_success']:.2f}",
                flush=True,
            )

    minutes = f"{args.memory_minutes:g} min"
    lines = [
        "## Training at fixed memory (`bench/train.py --part memory`)",
        "",
        *header(command, start_load),
        "",
        f"Task `agentenv/KVLookup-v0` (`env={MEMORY_ENV}`: a service holding 200 MiB in memory, about "
        f"{SANDBOX_MIB} MiB per sandbox), k3_tiny, GRPO groups of {group}, warm starts; every pool's "
        f"`memory_budget` is {MEMORY_BUDGET_MIB} MiB of running sandboxes, so (a) and (b) play at most "
        f"{cap} episodes at once (`rollout.max_concurrent_episodes={cap}`: whole groups). "
        "`rollout.policy_latency_s` sleeps that long in every generation call, an emulation of a larger "
        f"policy's generation time. Each run trains for {minutes} (`trainer.time_limit_s`). Episodes/s: "
        "after the first iteration (start-up and the pool's template build excluded). Peak memory: the "
        "largest sum, sampled every second from the host, of the cgroup RSS (anonymous + shared memory) "
        "of the run's sandbox containers that have processes (running or frozen; a CRIU-paused sandbox "
        "has none). Load: the mean 1-minute load average during the run (2 cores). "
        f"Time to {MEMORY_TARGET:g}: the mean success of the last 2 iterations first at or above it.",
        "",
        "| row | policy latency | episodes/s | vs (a) | peak sandbox memory | learner idle | "
        f"time to {MEMORY_TARGET:g} success | success first / end / best | iterations | pauses per "
        "episode | pause / resume p50 | load |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for latency in latencies:
        base = results[("a", latency)]
        for key, (name, _o) in rows.items():
            r = results[(key, latency)]
            if "error" in r:
                lines.append(f"| {name} | {latency:g} s | failed: {r['error']} |" + " |" * 9)
                continue
            reached = _minutes(r["time_to_target_s"], f"not within {minutes}")
            vs = "-" if "error" in base else f"{r['episodes_per_s'] / base['episodes_per_s']:.2f}x"
            lines.append(
                f"| {name} | {latency:g} s | {r['episodes_per_s']:.2f} | {vs} | {r['peak_mib']:.0f} MiB "
                f"({r['peak_sandboxes']} sandboxes) | "
                f"{r['learner_idle_fraction']:.2f} | {reached} | "
                f"{r['start_success']:.2f} / {r['end_success']:.2f} / {r['best_success']:.2f} | "
                f"{r['iterations']} | {r['pauses_per_episode']:.1f} | "
                f"{r['pause_s']:.2f} / {r['resume_s']:.2f} s | {r['load']:.1f} |"
            )
    a2, c2 = results[("a", 2.0)], results[("c", 2.0)]
    if "error" in a2 or "error" in c2:
        return "\n".join([*lines, "", "Target: not measured, a 2 s run failed (see the table)."])
    ratio = c2["episodes_per_s"] / a2["episodes_per_s"]
    c_slots = max(h.get("sandbox_slots", 0.0) for h in c2["history"])  # admission control's slots
    c_wait = sum(h.get("sandbox_slot_wait_s", 0.0) for h in c2["history"]) / len(c2["history"])
    verdict = "met" if ratio >= 3 and c2["peak_mib"] <= MEMORY_BUDGET_MIB else "missed"
    best = max((r for r in results.values() if "error" not in r), key=lambda r: r["best_success"])
    best_at = max(best["history"], key=lambda h: h["success"])["elapsed_s"]
    lines += [
        "",
        "Target: row (c) at least 3x the episodes/s of row (a) at 2 s latency within the same "
        f"{MEMORY_BUDGET_MIB} MiB: **{verdict}** here, {ratio:.2f}x, (c) peaking at {c2['peak_mib']:.0f} "
        f"MiB of sandbox memory against {a2['peak_mib']:.0f} MiB for (a).",
        "",
        *cpu_floor_lines(cost, a2, c2, group, cap),
        "",
        *(
            [
                f"(c) does not stay within the budget ({c2['peak_mib']:.0f} MiB at its peak) without "
                "the runner's admission control (`rollout.sandbox_pool.admission=false` here): a rollout "
                "call starts all its groups at once (resets and forks run, and stay running until the "
                "first generation), and after each turn's steps every active episode holds its sandbox "
                "(leased, running) until the next generation call pauses it; the pool's budget pauses "
                "only idle members no episode holds, so it goes over budget instead of waiting.",
                "",
            ]
            if c2["peak_mib"] > MEMORY_BUDGET_MIB and not c_slots
            else [
                f"(c) goes over the budget ({c2['peak_mib']:.0f} MiB at its peak) although the runner "
                "gates its sandboxes (`rollout.sandbox_pool.admission`, rl/admission.py): a sandbox "
                f"runs only in one of {c_slots:.0f} slots, `memory_budget` over the median RSS the "
                "pool measured of its sandboxes; the peak is the host's sample of the containers, which "
                "counts more than the slots do.",
                "",
            ]
            if c2["peak_mib"] > MEMORY_BUDGET_MIB
            else [
                f"(c) stays within the budget ({c2['peak_mib']:.0f} MiB at its peak). Without help the "
                "pool cannot: a rollout call starts all its groups at once, and after each turn's "
                "generation every active episode steps at once and holds its sandbox (leased, "
                "running) until the next generation call pauses it, while the pool's budget pauses "
                "only idle members no episode holds. The runner's admission control "
                "(`rollout.sandbox_pool.admission`, rl/admission.py) lets a sandbox run only in one of "
                f"{c_slots:.0f} slots (`memory_budget` over the median RSS the pool measured of its "
                "sandboxes): resets, forks and steps wait for a slot or pause a sandbox parked between "
                "its turns, and a stepped sandbox is paused inside its slot when others wait "
                f"({c_wait:.0f} s of slot waits per iteration, summed over episodes).",
                "",
            ]
        ),
        "Learning the heavy task: the best of these runs reached success "
        f"{best['best_success']:.2f} (start {best['start_success']:.2f}, end {best['end_success']:.2f}) "
        f"after {best_at / 60:.1f} min of training; a policy that ignores the answers wins at most 0.50, "
        "binary search 1.0.",
    ]
    return "\n".join(lines)


HEAVY_TARGET = 0.9  # the success the heavy-task learning run aims at (mean of trainer.success_window)


def part_heavy(args: argparse.Namespace, user: list[str], command: str) -> str:
    """k3_tiny learning the heavy task alone: row (a)'s setup (sync, seed-reset groups on live sandboxes,
    concurrency within the 2 GiB budget), no emulated latency, ``--heavy-minutes`` at most; the text of
    the ``bench:train-heavy`` section and its curve."""
    start_load = os.getloadavg()[0]
    _group, cap = memory_concurrency(user)
    _name, row_a = memory_rows(cap)["a"]
    overrides = [
        *fixed_memory_run("bench-heavy", args.heavy_minutes * 60),
        f"trainer.stop_at_success={HEAVY_TARGET}",
        *row_a,
        *user,
    ]
    print(f"heavy task: learning run (at most {args.heavy_minutes:g} min) ...", flush=True)
    run_dir = Path(tempfile.mkdtemp(prefix="k3rl-bench-heavy-"))
    try:
        with SandboxMemorySampler("bench-heavy") as sampler:
            r = training_run(overrides, run_dir, target=HEAVY_TARGET)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    cfg = compose(overrides)
    r["window"] = int(cfg.trainer.success_window)
    plot_modes({"KVLookup, k3_tiny": r}, ROOT / "docs" / "img" / "train_heavy_curve.png", HEAVY_TARGET,
               "k3_tiny on the heavy task (agentenv/KVLookup-v0)")
    reached = _minutes(r["time_to_target_s"], f"not within {args.heavy_minutes:g} min")
    game = cfg.env.kwargs  # a plain dict after the schema's validation
    load = sum(sampler.loads) / max(len(sampler.loads), 1)
    lines = [
        "## Learning the heavy task (`bench/train.py --part heavy`)",
        "",
        *header(command, start_load),
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
        f"| episodes/s (after the first iteration) | {r['episodes_per_s']:.1f} |",
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
        "--memory-minutes", type=float, default=3.0, help="training minutes of each fixed-memory run"
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
    if args.part in ("all", "memory") and args.memory_minutes != 3.0:
        options += f" --memory-minutes {args.memory_minutes:g}"
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
