"""The sharded learner's memory per rank, measured against the arithmetic of docs/training.md, beside the
flat design it replaced; expert all_to_all bytes; K3's sizing on paper.

Rewrites section `learner-sharding` of docs/benchmarks.md.
Usage: python bench/learner_sharding.py [--no-write] [--no-flat]

Design: docs/design/benchmarks.md#bench-learner-sharding.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

if str(Path(__file__).resolve().parent) not in sys.path:  # (the spawned ranks inherit the parent's path,
    sys.path.append(str(Path(__file__).resolve().parent))  # where bench/model.py must not shadow model/)
from bench_report import ROOT, busy_cores_before, other_load_text, training_machine, write_section  # noqa: E402

SECTION = "learner-sharding"
MODEL = "k3_small"
FLAT_COMMIT = "db1e77e"  # the last tree with the flat design (rl/learner/sharding.py's FlatShard)
MESHES = [(1, 1), (2, 1), (2, 2), (4, 1), (4, 2)]  # (world size, expert parallel)
FLAT_MESHES = [(1, 1), (2, 1), (2, 2), (4, 1)]  # the flat design: expert parallel 1 or all ranks
MIB = 2**20
os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # read by each spawned rank's glibc at start


def episodes(n: int, seed: int = 0) -> list:
    """Groups of 4 guessing-game episodes with random rewards and 1-3 turns."""
    import random

    from rl.episode import Episode

    rng = random.Random(seed)
    out = []
    for i in range(n):
        e = Episode("agentenv/GuessNumber-v0", seed=i // 4, group=i // 4)
        e.append([257, 259, *b"guess a number from 0 to 7", 261, 260], trained=False)
        for _turn in range(1 + rng.randrange(3)):
            e.append([48 + rng.randrange(8), 261], trained=True, logprobs=[-2.0, -1.0])
            e.step_rewards.append((len(e.tokens) - 1, float(rng.random() < 0.5)))
            e.append([259, *b"higher", 261, 260], trained=False)
        out.append(e)
    return out


def overrides(world: int, ep: int) -> list[str]:
    return [f"model={MODEL}", "algo.group_size=4", "algo.episodes_per_step=16", "algo.epochs=1",
            "algo.minibatches=1", "trainer.learner_threads=1", "trainer.num_cpus=5",
            f"trainer.learner.world_size={world}", f"trainer.learner.expert_parallel={ep}"]  # fmt: skip


def compose_at(root: Path, world: int, ep: int):
    """The checked run config of the tree at ``root`` (its own conf/ and rl/)."""
    from hydra import compose, initialize_config_dir

    from rl.train import resolve_config

    with initialize_config_dir(config_dir=str(root / "conf"), version_base=None):
        return resolve_config(compose("config", overrides=overrides(world, ep)))


def status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def reset_peak() -> int:
    """Reset the high-water mark to the current RSS; returns that RSS."""
    Path("/proc/self/clear_refs").write_text("5")
    return status("VmRSS:")


def serialise(state: dict) -> None:
    buffer = io.BytesIO()
    torch.save(state, buffer)


def _rank(rank: int, world: int, ep: int, port: int, root: str, design: str, out: str) -> None:
    """One rank of one row (in a process of its own, importing the tree at ``root``)."""
    sys.path.insert(0, root)
    torch.set_num_threads(1)
    from rl.learner.learner import Learner
    from rl.learner.ranks import RankGroup, join_rank_group, leave_rank_group

    if world > 1:
        join_rank_group("127.0.0.1", port, rank, world, ep, torch.device("cpu"))
    cfg = compose_at(Path(root), world, ep)
    batch = episodes(cfg.algo.episodes_per_step)
    import importlib

    for library in ("torch._dynamo", "torch.distributed.fsdp"):  # ~0.1 GB of code FSDP2 loads: not the
        importlib.import_module(library)  # learner's memory, so in the baseline

    base = status("VmRSS:")
    learner = Learner(cfg, group=RankGroup(rank, world, ep)) if world > 1 else Learner(cfg)
    reset_peak()
    started = time.perf_counter()
    metrics = learner.train_step(batch)
    step_s = time.perf_counter() - started
    result = {"step_s": step_s, "step_peak": status("VmHWM:") - base,
              "held_rss": status("VmRSS:") - base, "metrics": metrics}  # fmt: skip
    if design == "fsdp2":
        result["held"] = learner.sharded.held_bytes(learner.optimizer)
        before = reset_peak()
        learner.sharded.full_units(serialise)
    else:
        if learner.parallel is not None:
            result["held"] = learner.parallel.resident_bytes(learner.optimizer)
        else:
            trained = [p for g in learner.optimizer.param_groups for p in g["params"]]
            fixed = [p for p in learner.model.parameters() if not p.requires_grad]
            state = [t for s in learner.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
            result["held"] = sum(t.numel() * t.element_size() for t in trained + fixed + state)
        before = reset_peak()
        serialise(learner.state_dict())
    result["publish_peak"] = status("VmHWM:") - before
    Path(f"{out}.rank{rank}").write_text(json.dumps(result))
    if world > 1:
        leave_rank_group()


def run_row(root: Path, design: str, world: int, ep: int) -> list[dict]:
    from rl.learner.ranks import free_port

    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "result")
        mp.spawn(_rank, args=(world, ep, free_port(), str(root), design, out), nprocs=world, join=True)
        return [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(world)]


def flat_tree(folder: Path) -> Path:
    """The flat design's tree (commit `FLAT_COMMIT`'s rl/, model/, kernels/, conf/, agentenv/)."""
    folders = ["rl", "model", "kernels", "conf", "agentenv"]
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", FLAT_COMMIT, *folders], check=True,
                             capture_output=True).stdout  # fmt: skip
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
    return folder


# ---------------------------------------------------------------------------------------------- arithmetic


def unit_sizes(model, world: int, ep: int) -> tuple[int, int, list[int]]:
    """(parameters, of them routed experts, the parameters each rank gathers per unit) for ``model`` on a
    ``world / ep`` x ``ep`` mesh: a decoder layer's backbone whole, its experts 1/ep of them."""
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts.w" in n)
    units = []
    for layer in model.model.layers:
        own = sum(p.numel() for n, p in layer.named_parameters() if ".experts.w" not in n)
        units.append(own)
        if layer.is_moe:
            units.append(sum(p.numel() for p in layer.block_sparse_moe.experts.parameters()) // ep)
    units += [model.model.embed_tokens.weight.numel(), model.lm_head.weight.numel()]
    return total, experts, units


def predicted_peak(total: int, units: list[int], world: int, activations: float, weight: int = 4) -> dict:
    """docs/training.md's arithmetic for one rank (fp32 here: ``weight`` bytes per gathered element):
    held = 12 B x P / N (weights, AdamW's two moments); during the step + 4 B x P / N (gradient shards),
    the two largest units in flight (gathered weights + their full gradients), activations / N."""
    held = 12 * total / world
    in_flight = 2 * weight * sum(sorted(units)[-2:])
    return {"held": held, "peak": held + 4 * total / world + in_flight + activations / world}


def k3_sizing(ranks: int, ep: int) -> dict:
    """Per-rank bytes for K3 (conf/model/k3.yaml) on ``ranks`` GPUs with ``ep``-way expert parallelism,
    bf16 compute (fp32 master weights, AdamW, gradients), before activations."""
    from model import K3Config, K3ForCausalLM

    cfg = K3Config.from_yaml(ROOT / "conf" / "model" / "k3.yaml")
    with torch.device("meta"):
        model = K3ForCausalLM(cfg)
    total, experts, units = unit_sizes(model, ranks, ep)
    shard = total / ranks
    largest = sorted(units)[-2:]
    return {"params": total, "experts": experts, "weights": 4 * shard, "adam": 8 * shard,
            "grads": 4 * shard, "in_flight": 2 * 2 * sum(largest) + (2 + 4) * largest[-1],
            "largest_unit": largest[-1]}  # fmt: skip


def k3_table() -> list[str]:
    gb = 1e9
    rows = ["| GPUs | expert parallel | weights (fp32) | AdamW | gradients | units in flight (bf16) | "
            "sum GB |", "|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for ranks, ep in ((256, 128), (448, 448), (896, 448), (1792, 896)):
        k = k3_sizing(ranks, ep)
        parts = [k["weights"], k["adam"], k["grads"], k["in_flight"]]
        rows.append(f"| {ranks} | {ep} | {parts[0] / gb:.1f} | {parts[1] / gb:.1f} | {parts[2] / gb:.1f} | "
                    f"{parts[3] / gb:.1f} | **{sum(parts) / gb:.1f}** |")  # fmt: skip
    return rows


def k3_traffic() -> str:
    """All_to_all bytes per routed token for K3's shapes, counted."""
    from model import K3Config

    cfg = K3Config.from_yaml(ROOT / "conf" / "model" / "k3.yaml")
    k, d, latent = cfg.num_experts_per_token, cfg.hidden_size, cfg.expert_width
    latent_b, backbone_b = k * latent * 2 * 2, k * d * 2 * 2  # bf16, dispatch + combine
    return (f"K3's expert exchange (d = {d}, latent l = {latent}, top-{k}), bf16, dispatch + combine per MoE "
            f"layer: **{latent_b:,} bytes per token in the latent space vs {backbone_b:,} at the backbone "
            f"width = {latent_b / backbone_b:.2f}x**.")  # fmt: skip


# ---------------------------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--no-flat", action="store_true", help="skip the flat design's rows")
    args = parser.parse_args()
    busy = busy_cores_before()
    machine = training_machine()
    started = time.perf_counter()
    from model import K3ForCausalLM

    cfg = compose_at(ROOT, 1, 1)
    with torch.device("meta"):
        small = K3ForCausalLM(cfg.model)
    runs: dict[tuple[str, int, int], list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        trees = [("fsdp2", ROOT, MESHES)]
        if not args.no_flat:
            trees.append(("flat", flat_tree(Path(tmp)), FLAT_MESHES))
        for design, root, meshes in trees:
            for world, ep in meshes:
                runs[design, world, ep] = run_row(root, design, world, ep)
                r = runs[design, world, ep][0]
                print(f"{design} {world}x{ep}: held {r['held'] / MIB:.0f} MiB, peak "
                      f"{r['step_peak'] / MIB:.0f} MiB, {r['step_s']:.1f} s", flush=True)  # fmt: skip
    total, experts, units1 = unit_sizes(small, 1, 1)
    base = runs["fsdp2", 1, 1][0]
    activations = base["step_peak"] - predicted_peak(total, units1, 1, 0.0)["peak"]
    rows, verdicts, traffic = [], [], []
    for (design, world, ep), ranks in runs.items():
        ref = runs[design, 1, 1][0]
        worst = max(ranks, key=lambda r: r["step_peak"])
        held = max(r["held"] for r in ranks)
        pred = predicted_peak(total, unit_sizes(small, world, ep)[2], world, activations)
        kind = "-" if world == 1 else ("DP" if ep == 1 else f"DP {world // ep} x EP {ep}")
        shown = f"{pred['peak'] / MIB:.0f}" if design == "fsdp2" else "-"
        rows.append(f"| {design} | {world} | {kind} | {held / MIB:.1f} | {held / ref['held']:.3f}x | "
                    f"{worst['held_rss'] / MIB:.0f} | {worst['step_peak'] / MIB:.0f} | "
                    f"**{worst['step_peak'] / ref['step_peak']:.3f}x** | {shown} | "
                    f"{max(r['step_s'] for r in ranks):.1f} | "
                    f"{ranks[0]['publish_peak'] / MIB:.0f} |")  # fmt: skip
        if design == "fsdp2" and world > 1:
            peak_ratio, held_ratio = worst["step_peak"] / ref["step_peak"], held / ref["held"]
            if world == 2:
                peak_ok, held_ok = peak_ratio <= 0.6, held_ratio <= 0.55
                verdicts.append(f"world size 2 ({kind}): step peak {peak_ratio:.3f}x (target <= 0.6x: "
                                f"**{'met' if peak_ok else 'missed'}**), held {held_ratio:.3f}x "
                                f"(target <= 0.55x: **{'met' if held_ok else 'missed'}**)")  # fmt: skip
            else:
                verdicts.append(f"world size 4 ({kind}): held {held_ratio:.3f}x (target <= 0.35x: "
                                f"**{'met' if held_ratio <= 0.35 else 'missed'}**), step peak "
                                f"{peak_ratio:.3f}x")  # fmt: skip
        m = ranks[0]["metrics"]
        if ep > 1 and "ep_latent_bytes" in m:
            latent, backbone = m["ep_latent_bytes"], m["ep_backbone_bytes"]
            traffic.append(f"| {design} | {world} | {kind} | {int(m['ep_pairs']):,} | {int(latent):,} | "
                           f"{int(backbone):,} | {latent / backbone:.3f} |")  # fmt: skip
    body = "\n".join([
        "## Sharded learner (`bench/learner_sharding.py`)\n",
        f"Command: `python bench/learner_sharding.py`. {machine}; {other_load_text(busy)}\n",
        f"{MODEL} ({total / 1e6:.1f} M parameters, {experts / 1e6:.1f} M of them routed experts), one "
        "`train_step` of 16 episodes (groups of 4, 1 epoch x 1 minibatch) per row, fp32 on the CPU, gloo. "
        "*fsdp2*: this tree (`rl.learner.sharding`); *flat*: the design it replaced, run from commit "
        f"`{FLAT_COMMIT}` "
        "(`git archive`). *Held* = parameter + AdamW bytes of a rank between steps (counted "
        "from its tensors; "
        "the largest rank); *held RSS*, *step peak* = the rank's resident memory after the step and its "
        "high-water mark during it, above its RSS before the learner was built (the worst rank; ratios "
        "against the same design's world size 1); *predicted* = docs/training.md's arithmetic "
        "(12 B x P / N held, + 4 B x P / N gradients, + the two largest gathered units with "
        "their gradients, "
        f"+ activations / N, the activations ({activations / MIB:.0f} MiB) calibrated at world size 1); "
        "*publish peak* = rank 0's RSS growth while the full weights go to a sink that serialises what it "
        "is handed (unit by unit; flat: the whole state dict).\n",
        "| design | world size | mesh | held MiB | held vs 1 | held RSS MiB | step peak MiB | peak vs 1 | "
        "predicted MiB | step s | publish peak MiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        *rows,
        "\nTargets (fsdp2): " + "; ".join(verdicts) + ".",
        "\nExpert all_to_all traffic of one step (every rank's bytes to the others, forward and backward, "
        "every MoE layer; *backbone* = the same pairs at the backbone width):\n",
        "| design | world size | mesh | pairs routed | latent bytes | backbone-width bytes | ratio |",
        "|---|---|---|---|---|---|---|",
        *traffic,
        "\n" + k3_traffic(),
        "\nK3 on paper (conf/model/k3.yaml, a `meta`-device model: "
        f"{k3_sizing(448, 448)['params'] / 1e9:,.1f} B parameters, "
        f"{k3_sizing(448, 448)['experts'] / 1e9:,.1f} B routed experts), per rank before activations "
        "(docs/training.md, *Sizing N*):\n",
        *k3_table(),
        f"\n(total {time.perf_counter() - started:.0f} s)",
    ])  # fmt: skip
    if args.no_write:
        print(body)
    else:
        write_section(SECTION, body)


if __name__ == "__main__":
    main()
