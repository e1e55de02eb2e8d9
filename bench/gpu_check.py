"""The steps of the GPU check (`scripts/gpu_check.sh` runs each in a process of its own, under a time
limit, and renders the `gpu-check` section of docs/benchmarks.md from what they wrote).

Steps: env, learner, moe, kernels, report, distributions; each writes ``DIR/<step>.json`` as it goes.
``--dry-run`` proves the steps and their imports on the CPU; its figures say nothing of a GPU.

Design: docs/design/benchmarks.md#bench-gpu-check.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # before bench/ (this script's folder): bench/model.py must not shadow model/

import torch  # noqa: E402
from bench_report import BENCHMARKS_MD, compose, write_section  # noqa: E402

SECTION = "gpu-check"
STEPS = ("env", "learner", "moe", "kernels")
NOT_ON_THE_GPU_MACHINE = ("ray", "vllm")  # the steps must not need them (the GPU machine has neither)
# the kernels step's flash-linear-attention (not in .venv) and its one requirement (pinned as installed)
EXTRA_WHEELS = ("fla-core==0.6.0", "einops")


def write_json(out: Path, step: str, data: dict) -> None:
    (out / f"{step}.json").write_text(json.dumps(data, indent=1))


def device_of(dry_run: bool) -> str:
    return "cpu" if dry_run else "cuda"


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------------- env


def env_step(out: Path, dry_run: bool) -> int:
    import importlib

    versions = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    for name in ("triton", "fla", "numpy", "hydra", "ray"):
        try:
            versions[name] = getattr(importlib.import_module(name), "__version__", "?")
        except Exception as exc:  # absent or broken: the step that needs it says so
            versions[name] = f"not importable ({type(exc).__name__})"
    seen = torch.cuda.is_available()
    versions["gpu"] = f"{torch.cuda.get_device_name()} x {torch.cuda.device_count()}" if seen else "none"
    write_json(out, "env", versions)
    print(json.dumps(versions, indent=1))
    if not dry_run and not seen:
        print("torch sees no CUDA GPU: install a CUDA build of torch first", file=sys.stderr)
        return 1
    return 0


# ---------------------------------------------------------------------------------------------- learner


def synthetic_episodes(n: int, turns: int, group_size: int, seed: int = 0) -> list:
    """Groups of guessing-game episodes (byte tokens, no sandbox): a prompt, then ``turns`` turns of an
    8-token action and an observation; random rewards, so the groups have advantages to train on."""
    from rl.episode import Episode

    rng = random.Random(seed)
    episodes = []
    for i in range(n):
        e = Episode("agentenv/GuessNumber-v0", seed=i // group_size, group=i // group_size)
        e.append([257, 259, *b"guess a number from 0 to 999, one guess a turn", 261, 260], trained=False)
        for _turn in range(turns):
            action = [48 + rng.randrange(10) for _ in range(7)] + [261]
            e.append(action, trained=True, logprobs=[-2.0] * len(action))
            e.step_rewards.append((len(e.tokens) - 1, float(rng.random() < 0.5)))
            e.append([259, *b"higher than that, try again", 261, 260], trained=False)
        episodes.append(e)
    return episodes


def learner_row(model: str, device: str, episodes: int, turns: int) -> dict:
    """Two `Learner.train_step` calls of the policy ``model`` in bf16 (autocast, fp32 master weights) on
    ``device``; the first compiles the Triton kernels. For k3_tiny the first step is also taken by a
    CPU fp32 learner from the same weights: loss and gradient norm agree up to bf16's rounding."""
    from kernels.dispatch import use_triton
    from rl.device import Placement
    from rl.learner.learner import Learner

    overrides = [f"model={model}", "algo.group_size=4", f"algo.episodes_per_step={episodes}", "algo.epochs=1",
                 "algo.minibatches=1", "rollout.num_workers=1"]  # fmt: skip
    cfg = compose([*overrides, f"trainer.device={device}"])
    batch = synthetic_episodes(episodes, turns, cfg.algo.group_size)
    learner = Learner(cfg, Placement(torch.device(device), torch.bfloat16))
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    seconds, metrics = [], []
    for _ in range(2):
        sync(device)
        started = time.perf_counter()
        metrics.append(learner.train_step(batch))
        sync(device)
        seconds.append(time.perf_counter() - started)
    weight = next(learner.model.parameters())
    states = [t for state in learner.optimizer.state.values() for t in state.values()
              if torch.is_tensor(t) and t.dim()]  # fmt: skip
    tokens = sum(len(e.tokens) for e in batch)
    row = {
        "model": model, "device": device, "episodes": episodes, "tokens": tokens,
        "parameters": sum(p.numel() for p in learner.model.parameters()),
        "first_step_s": seconds[0], "step_s": seconds[1], "tokens_per_s": tokens / seconds[1],
        "peak_mib": torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else None,
        "loss": metrics[0]["loss"], "grad_norm": metrics[0]["grad_norm"],
        "finite": all(math.isfinite(v) for m in metrics for v in m.values()),
        "fp32_master_on_device": all(p.dtype == torch.float32 and p.device.type == device
                                     for p in learner.model.parameters()),
        "adam_state_on_device": bool(states) and all(t.device.type == device for t in states),
        "triton_kernels": use_triton(weight),
    }  # fmt: skip
    if model == "k3_tiny":  # the same first step in fp32 on the CPU, from the same initial weights
        reference = Learner(compose([*overrides, "trainer.device=cpu"])).train_step(batch)
        row["fp32_cpu_loss"], row["fp32_cpu_grad_norm"] = reference["loss"], reference["grad_norm"]
        row["loss_gap"] = abs(row["loss"] - reference["loss"])
        row["grad_norm_ratio"] = row["grad_norm"] / reference["grad_norm"]
    checks = [row["finite"], row["fp32_master_on_device"], row["adam_state_on_device"],
              row["triton_kernels"] == (device == "cuda")]  # fmt: skip
    if "loss_gap" in row:  # bf16 rounding, not a different computation
        checks += [row["loss_gap"] <= 0.05 * max(1.0, abs(row["fp32_cpu_loss"])),
                   abs(row["grad_norm_ratio"] - 1) <= 0.1]  # fmt: skip
    row["ok"] = all(checks)
    return row


def learner_step(out: Path, dry_run: bool) -> int:
    device = device_of(dry_run)
    plan = [("k3_tiny", 8, 2)] if dry_run else [("k3_tiny", 32, 8), ("k3_small", 32, 8)]
    rows = []
    for model, episodes, turns in plan:
        rows.append(learner_row(model, device, episodes, turns))
        print(json.dumps(rows[-1]), flush=True)
        write_json(out, "learner", {"rows": rows})
    return 0 if all(r["ok"] for r in rows) else 1


# ---------------------------------------------------------------------------------------------- moe


def moe_step(out: Path, dry_run: bool) -> int:
    import bench.kernels as kernel_bench

    if dry_run:
        lines = kernel_bench.moe_rows("cpu", 4, 2, 16, 32, (32,))
    else:
        k3 = kernel_bench.model_config("k3")
        L, I = k3["routed_expert_hidden_size"], k3["moe_intermediate_size"]  # K3's expert shapes
        lines = kernel_bench.moe_rows("cuda", 64, 8, L, I, (4096,))
    write_json(out, "moe", {"lines": lines})
    return 0


# ---------------------------------------------------------------------------------------------- kernels


def kernels_step(out: Path, dry_run: bool) -> int:
    import bench.kernels as kernel_bench

    device = device_of(dry_run)
    cases = kernel_bench.kernel_cases(device, small=dry_run)
    rows: list[dict] = []
    fla = "present" if kernel_bench.fla_chunk_kda() is not None else "not importable"
    for case in cases:
        for dtype in (torch.float32, torch.bfloat16):
            started = time.perf_counter()
            try:
                row = kernel_bench.check_kernel(case, dtype, device)
            except Exception as exc:  # one kernel's failure (a compile error, OOM) leaves the others' rows
                text = str(exc).strip().splitlines()
                row = {"kernel": case.name, "shape": case.shape, "dtype": str(dtype).removeprefix("torch."),
                       "ok": False, "failure": f"{type(exc).__name__}: {text[0] if text else ''}"[:300]}
            row["seconds"] = time.perf_counter() - started  # the first dtype's includes compiling
            rows.append(row)
            print(json.dumps(row), flush=True)
            write_json(out, "kernels", {"rows": rows, "fla": fla, "interpreter": dry_run})
            if device == "cuda":
                torch.cuda.empty_cache()
    return 0 if dry_run or all(r["ok"] for r in rows) else 1


# ---------------------------------------------------------------------------------------------- report


def read_json(out: Path, step: str) -> dict | None:
    path = out / f"{step}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def ms(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}"


def kernel_lines(data: dict) -> list[str]:
    rows = data["rows"]
    fla = {(r["dtype"]): r for r in rows if r["kernel"].endswith("(fla)")}
    lines = [
        "| kernel | shape | dtype | max error | verdict | ours fwd ms | ours fwd+bwd ms | reference fwd ms "
        "| reference fwd+bwd ms | ours vs reference (fwd+bwd) | ours vs fla (fwd+bwd) |",
        "|---|---|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "failure" in r:
            lines.append(f"| {r['kernel']} | {r['shape']} | {r['dtype']} | — | **failed**: {r['failure']} "
                         "| | | | | | |")  # fmt: skip
            continue
        ours = r["ours_fwd_bwd_ms"] or r["ours_fwd_ms"]
        ref = r["reference_fwd_bwd_ms"] or r["reference_fwd_ms"]
        other = fla.get(r["dtype"]) if r["kernel"] == "chunk_kda" else None
        vs_fla = f"{other['ours_fwd_bwd_ms'] / ours:.2f}×" if other and "failure" not in other else "—"
        verdict = "ok" if r["ok"] else "**over tolerance**"
        lines.append(f"| {r['kernel']} | {r['shape']} | {r['dtype']} | {r['error']:.1e} | {verdict} | "
                     f"{ms(r['ours_fwd_ms'])} | {ms(r['ours_fwd_bwd_ms'])} | {ms(r['reference_fwd_ms'])} | "
                     f"{ms(r['reference_fwd_bwd_ms'])} | {ref / ours:.2f}× | {vs_fla} |")  # fmt: skip
    return lines


def learner_lines(data: dict) -> list[str]:
    lines = [
        "| model | parameters | episodes (tokens) | first step s | step s | tokens/s | peak GPU MiB | loss "
        "| grad norm | vs fp32 on the CPU | checks |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in data["rows"]:
        versus = "—"
        if "loss_gap" in r:
            versus = f"Δloss {r['loss_gap']:.1e}, grad norm ×{r['grad_norm_ratio']:.3f}"
        peak = "—" if r["peak_mib"] is None else f"{r['peak_mib']:.0f}"
        checks = "ok" if r["ok"] else "**failed**"
        lines.append(f"| {r['model']} | {r['parameters']:,} | {r['episodes']} ({r['tokens']:,}) | "
                     f"{r['first_step_s']:.1f} | {r['step_s']:.2f} | {r['tokens_per_s']:,.0f} | {peak} | "
                     f"{r['loss']:.4f} | {r['grad_norm']:.4f} | {versus} | {checks} |")
    return lines


def report(out: Path, dry_run: bool, doc: Path | None) -> str:
    env = read_json(out, "env") or {}
    summary = (out / "summary.txt").read_text().strip() if (out / "summary.txt").is_file() else ""
    where = "a dry run on the CPU (tiny shapes, the Triton kernels in Triton's interpreter): it shows the " \
        "steps run, not what a GPU does" if dry_run else f"{env.get('gpu', '?')}"
    body = [
        "## GPU check (`scripts/gpu_check.sh`)\n",
        f"Command: `bash scripts/gpu_check.sh{' --dry-run' if dry_run else ''}`; {where}. Python "
        f"{env.get('python', '?')}, torch {env.get('torch', '?')} (CUDA {env.get('cuda') or 'none'}), Triton "
        f"{env.get('triton', '?')}, fla {env.get('fla', '?')}; {time.strftime('%Y-%m-%d', time.gmtime())}.\n",
        "Steps (exit code, seconds; 124 = stopped at its time limit):\n",
        "```", summary or "(no summary)", "```\n",
        "### The K3 policy: learner steps in bf16 (no Ray)\n",
        "`rl.learner.learner.Learner` called directly, bf16 autocast over fp32 master weights and AdamW "
        "state on the "
        "device; synthetic guessing-game groups of 4, one optimizer step per call, the first call compiles "
        "the kernels. *vs fp32 on the CPU*: the same first step of a CPU fp32 learner from the same weights "
        "(checks: finite metrics, weights and AdamW state on the device, the Triton kernels on CUDA, loss "
        "within 5% and gradient norm within 10% of fp32).\n",
    ]
    learner = read_json(out, "learner")
    body += learner_lines(learner) if learner else ["(the learner step wrote nothing)"]
    body += ["\n### Kernels against their PyTorch references\n",
             "Error: max |ours − reference| / max(1, max |reference|) over the output and every input's "
             "gradient, the reference in fp32 on the same (rounded) inputs; tolerance 5e-3 in fp32 (Triton's "
             "`tl.dot` takes fp32 operands as TF32 on the GPU) and 5e-2 in bf16. The decode kernel has no "
             "backward. Times: " + ("one wall time in the interpreter, and Triton 3.9's interpreter "
             "gets bf16 `tl.dot` wrong (the GEMM kernels' bf16 errors here mean nothing)" if dry_run else
             "median ms (`triton.testing.do_bench`)") + ", the reference in the same dtype.\n"]
    kernels = read_json(out, "kernels")
    if kernels:
        body += kernel_lines(kernels)
        body.append(f"\nflash-linear-attention: {kernels['fla']}.")
    else:
        body.append("(the kernels step wrote nothing)")
    body.append("\n### MoE: grouped GEMM against the per-expert loop\n")
    moe = read_json(out, "moe")
    body += moe["lines"] if moe else ["(the moe step wrote nothing)"]
    text = "\n".join(body)
    (out / f"{SECTION}.md").write_text(text + "\n")
    target = doc or (out / "benchmarks.md" if dry_run else BENCHMARKS_MD)
    if dry_run and doc is None:
        shutil.copyfile(BENCHMARKS_MD, target)
    write_section(SECTION, text, target)
    return text


# ---------------------------------------------------------------------------------------------- wheels


def distributions() -> list[str]:
    """``name==version`` of every installed distribution the steps import (with Ray and vLLM made
    unimportable, so that a step needing them fails here), less this project and what torch requires (the
    GPU machine has those), plus `EXTRA_WHEELS`: what `scripts/gpu_wheels.sh` collects."""
    import importlib.metadata as metadata
    import re

    for name in NOT_ON_THE_GPU_MACHINE:
        sys.modules[name] = None  # type: ignore[assignment]
    compose(["trainer.device=cpu"])
    import bench.kernels as kernel_bench
    import rl.learner.learner  # noqa: F401

    kernel_bench.kernel_cases("cpu", small=True)  # imports every kernel module
    import triton.testing  # noqa: F401

    def key(name: str) -> str:
        return re.split(r"[ ;<>=!~\[(]", name, maxsplit=1)[0].lower().replace("_", "-")

    provided, todo = set(), ["torch", "triton"]  # the GPU machine's torch, Triton and what torch requires
    while todo:
        name = todo.pop()
        if name in provided:
            continue
        provided.add(name)
        try:
            todo += [key(r) for r in metadata.requires(name) or [] if "extra ==" not in r]
        except metadata.PackageNotFoundError:
            pass
    owners = metadata.packages_distributions()
    modules = {m.split(".")[0] for m, module in sys.modules.items() if module is not None}
    names = {owner for m in modules for owner in owners.get(m, []) if key(owner) not in provided | {"k3rl"}}
    names |= set(EXTRA_WHEELS)
    return sorted((n if "==" in n else f"{n}=={metadata.version(n)}" for n in names), key=str.lower)


# ---------------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("step", choices=(*STEPS, "report", "distributions"))
    parser.add_argument("--out", type=Path, help="the check's output folder")
    parser.add_argument("--dry-run", action="store_true", help="on the CPU, tiny shapes (see the docstring)")
    parser.add_argument("--doc", type=Path, help="report: the benchmarks file to write (default: "
                        "docs/benchmarks.md; with --dry-run a copy in --out)")
    args = parser.parse_args(argv)
    if args.step == "distributions":
        print("\n".join(distributions()))
        return 0
    if args.out is None:
        parser.error(f"{args.step} needs --out DIR")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.dry_run:  # tiny shapes: a second intra-op thread only spins against the machine's other work
        torch.set_num_threads(1)  # (on 2 busy cores, a k3_tiny learner step: 0.3-1.5 s on one, 3-19 s on two)
    if args.step == "report":
        report(args.out, args.dry_run, args.doc)  # prints where it wrote the section
        return 0
    steps = {"env": env_step, "learner": learner_step, "moe": moe_step, "kernels": kernels_step}
    return steps[args.step](args.out, args.dry_run)


if __name__ == "__main__":
    sys.exit(main())
