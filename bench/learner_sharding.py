"""The sharded learner (``trainer.learner.world_size``, ``expert_parallel``): memory per rank, expert
all_to_all bytes in the latent width against the backbone width, and the rank-0 peak of publishing
full weights.

    python bench/learner_sharding.py             # rewrites section `learner-sharding` of docs/benchmarks.md
    python bench/learner_sharding.py --no-write  # print only

In one run, on the same synthetic batch (groups of guessing-game episodes, no sandboxes):

- world size 1 (a plain `Learner`, the baseline) and world size 2 (data parallel; data + expert parallel),
  two gloo processes: one `train_step` each, then the parameter + AdamW bytes each rank holds between
  steps (counted from the tensors: `rl.data_parallel.DataParallel.resident_bytes`) and the step's time;
- with expert parallelism, the bytes each rank sent through the experts' all_to_alls (forward and
  backward, off-rank only) and what the same (token, expert) pairs would cost at the backbone width;
- the peak RSS growth of a rank while it gathers the full weights to publish them (`Learner.state_dict`,
  what `LearnerActor.publish` puts in Ray's object store on rank 0), measured by resetting the kernel's
  high-water mark (/proc/self/clear_refs);
- for K3's own shapes (conf/model/k3.yaml), the all_to_all bytes per routed token, counted from the shapes
  (bf16, dispatch + combine, top-k pairs), latent against backbone width.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

if str(Path(__file__).resolve().parent) not in sys.path:  # (the spawned ranks inherit the parent's path,
    sys.path.append(str(Path(__file__).resolve().parent))  # where bench/model.py must not shadow model/)
from bench_report import busy_cores_before, compose, other_load_text, training_machine, write_section  # noqa: E402

SECTION = "learner-sharding"


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


def overrides(model: str, world: int, ep: int) -> list[str]:
    return [f"model={model}", "algo.group_size=4", "algo.episodes_per_step=16", "algo.epochs=1",
            "algo.minibatches=1", "trainer.learner_threads=1", "trainer.num_cpus=4",
            f"trainer.learner.world_size={world}", f"trainer.learner.expert_parallel={ep}"]  # fmt: skip


def peak_rss_growth(fn) -> tuple[object, int]:
    """``fn()``'s result and how far this process's peak RSS rose above its RSS before the call (bytes)."""

    def status(key: str) -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key):
                return int(line.split()[1]) * 1024
        raise KeyError(key)

    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := current RSS
    before = status("VmRSS:")
    result = fn()
    return result, status("VmHWM:") - before


def measure(learner, batch) -> dict:
    """One step of ``learner``: its time, the bytes held after it, its traffic and the publish peak."""
    started = time.perf_counter()
    metrics = learner.train_step(batch)
    step_s = time.perf_counter() - started
    if learner.parallel is not None:
        held = learner.parallel.resident_bytes(learner.optimizer)
    else:
        trained = [p for g in learner.optimizer.param_groups for p in g["params"]]
        fixed = [p for p in learner.model.parameters() if not p.requires_grad]
        state = [t for s in learner.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
        held = sum(t.numel() * t.element_size() for t in trained + fixed + state)
    state, publish_peak = peak_rss_growth(learner.state_dict)  # what LearnerActor.publish gathers
    full = sum(t.numel() * t.element_size() for t in state.values())
    return {"step_s": step_s, "held": held, "metrics": metrics, "publish_peak": publish_peak, "full": full}


def _rank_main(rank: int, port: int, model: str, ep: int, out: str) -> None:
    from rl.learner import Learner
    from rl.ranks import RankGroup, join_rank_group, leave_rank_group

    torch.set_num_threads(1)
    join_rank_group("127.0.0.1", port, rank, 2, ep, torch.device("cpu"))
    try:
        cfg = compose(overrides(model, 2, ep))
        learner = Learner(cfg, group=RankGroup(rank, 2, ep))
        result = measure(learner, episodes(cfg.algo.episodes_per_step))
        torch.save(result, f"{out}.rank{rank}")
    finally:
        leave_rank_group()


def two_ranks(model: str, ep: int) -> list[dict]:
    from rl.ranks import free_port

    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "result")
        mp.spawn(_rank_main, args=(free_port(), model, ep, out), nprocs=2, join=True)
        return [torch.load(f"{out}.rank{r}", weights_only=False) for r in range(2)]


def k3_counted() -> str:
    """All_to_all bytes per routed token for K3's shapes (conf/model/k3.yaml), counted."""
    cfg = compose(["model=k3"]).model
    k, d, latent = cfg.num_experts_per_token, cfg.hidden_size, cfg.expert_width
    bf16 = 2
    moe_layers = sum(1 for i in range(cfg.num_hidden_layers) if i >= cfg.first_k_dense_replace)
    latent_b = k * latent * bf16 * 2  # dispatch + combine, per MoE layer, every pair off-rank
    backbone_b = k * d * bf16 * 2
    mib = 2**20
    return (f"K3 (conf/model/k3.yaml: d = {d}, latent l = {latent}, top-{k} of {cfg.num_experts} experts, "
            f"{moe_layers} MoE layers), bf16, dispatch + combine per MoE layer: **{latent_b:,} bytes "
            f"per token in the latent space vs {backbone_b:,} at the backbone width = "
            f"{latent_b / backbone_b:.2f}x** ({latent_b * moe_layers / mib:.1f} MiB vs "
            f"{backbone_b * moe_layers / mib:.1f} MiB per token through all MoE layers, forward; "
            "the backward sends the same again).")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["k3_small"])
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    busy = busy_cores_before()
    machine = training_machine()
    started = time.perf_counter()
    torch.set_num_threads(1)
    rows, traffic_rows = [], []
    from rl.learner import Learner

    for model in args.models:
        cfg = compose(overrides(model, 1, 1))
        single = measure(Learner(cfg), episodes(cfg.algo.episodes_per_step))
        rows.append(f"| {model} | 1 | - | {single['held'] / 2**20:.1f} | 1.00x | {single['step_s']:.1f} | "
                    f"{single['full'] / 2**20:.1f} | {single['publish_peak'] / 2**20:.1f} |")  # fmt: skip
        for ep in (1, 2):
            ranks = two_ranks(model, ep)
            for rank, r in enumerate(ranks):
                ratio = r["held"] / single["held"]
                kind = "DP+EP" if ep > 1 else "DP"
                rows.append(f"| {model} | 2 ({kind}) | {rank} | {r['held'] / 2**20:.1f} | "
                            f"**{ratio:.3f}x** | {r['step_s']:.1f} | {r['full'] / 2**20:.1f} | "
                            f"{r['publish_peak'] / 2**20:.1f} |")  # fmt: skip
                m = r["metrics"]
                if ep > 1 and rank == 0:  # the step's traffic, summed over the ranks: the same on each
                    latent, backbone = m["ep_latent_bytes"], m["ep_backbone_bytes"]
                    traffic_rows.append(
                        f"| {model} | {int(m['ep_pairs']):,} | {int(latent):,} | "
                        f"{int(m['ep_metadata_bytes']):,} | {int(backbone):,} | **{latent / backbone:.3f}** |"
                    )
            print("\n".join(rows[-2:]), flush=True)
    body = "\n".join([
        "## Sharded learner (`bench/learner_sharding.py`)\n",
        f"Command: `python bench/learner_sharding.py --models {' '.join(args.models)}`. {machine}; "
        f"{other_load_text(busy)}\n",
        "One `train_step` (16 episodes, groups of 4, 1 epoch x 1 minibatch) at world size 1 (the baseline, "
        "same run) and in two gloo processes (data parallel; data + expert parallel). *Held* = parameter + "
        "AdamW bytes a rank holds between steps, counted from its tensors (the full parameters are "
        "gathered only inside a step); *publish peak* = rank-0 RSS growth while it gathers the full "
        "weights for the rollout workers (gathered once per version on every rank; rank 0 puts them in "
        "Ray's object store, whose copy is in its shared memory, not in this figure). Pairs include the "
        "padding positions, which the single-rank learner also runs through the experts.\n",
        "| model | world size | rank | held MiB | vs world size 1 | step s | full weights MiB "
        "| publish peak MiB |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
        "\nExpert all_to_all traffic of one step, data + expert parallel (bytes the two ranks sent each "
        "other, forward and backward, every MoE layer, summed over the ranks; *metadata* = the pair counts "
        "and expert ids sent first; *backbone* = the same pairs' activations at the backbone width):\n",
        "| model | (token, expert) pairs routed | latent bytes sent | metadata bytes | backbone-width bytes "
        "| ratio |",
        "|---|---|---|---|---|---|",
        *traffic_rows,
        "\n" + k3_counted(),
        f"\n(total {time.perf_counter() - started:.0f} s)",
    ])  # fmt: skip
    if args.no_write:
        print(body)
    else:
        write_section(SECTION, body)


if __name__ == "__main__":
    main()
