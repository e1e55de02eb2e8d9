"""Benchmark of the K3 policy model on CPU: throughput, decode cost vs context, cache size, balancing.

Each figure against a baseline taken in the same run; rewrites only the `model` section of
docs/benchmarks.md. Usage: python bench/model.py [--quick] [--no-write]

Design: docs/design/benchmarks.md#bench-model.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_report import write_section  # noqa: E402

from model import K3Config, K3ForCausalLM, count_parameters  # noqa: E402
from model.balancing import (  # noqa: E402
    expert_loads,
    max_violation,
    quantile_balance,
    route_top_k,
    sign_update,
)

CONFIGS = {"k3_tiny": ROOT / "conf/model/k3_tiny.yaml", "k3_small": ROOT / "conf/model/k3_small.yaml"}


def _timed(fn, repeats: int) -> float:
    """Median wall time of `fn()` over `repeats` runs (after one warm-up)."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@torch.no_grad()
def prefill_tokens_per_s(model: K3ForCausalLM, length: int, repeats: int) -> float:
    ids = torch.randint(0, model.config.vocab_size, (1, length))
    return length / _timed(lambda: model(ids), repeats)


@torch.no_grad()
def prefilled_cache(model: K3ForCausalLM, batch: int, context: int):
    cache = model.new_cache(batch)
    vocab = model.config.vocab_size
    for start in range(0, context, 1024):  # chunked prefill bounds the MLA score matrix
        model(torch.randint(0, vocab, (batch, min(1024, context - start))), cache=cache)
    return cache


@torch.no_grad()
def decode_step_seconds(model: K3ForCausalLM, contexts: list[int], batch: int, steps: int) -> list[float]:
    """Median time of one cached decode step for each context length in `contexts`.

    The steps of the different contexts are interleaved, so load from other jobs on the machine hits all
    of them alike and their ratio stays meaningful.
    """
    caches = [prefilled_cache(model, batch, c) for c in contexts]
    tokens = [torch.randint(0, model.config.vocab_size, (batch, 1)) for _ in contexts]
    times: list[list[float]] = [[] for _ in contexts]
    for step in range(steps + 1):
        for i, cache in enumerate(caches):
            t0 = time.perf_counter()
            logits = model(tokens[i], cache=cache).logits
            if step:  # the first step is a warm-up
                times[i].append(time.perf_counter() - t0)
            tokens[i] = logits[:, -1].argmax(-1, keepdim=True)
    return [statistics.median(t) for t in times]


@torch.no_grad()
def cache_bytes_per_token(model: K3ForCausalLM) -> tuple[float, int]:
    """(bytes added per token of context, constant bytes) of the live cache, batch 1."""
    cache = model.new_cache(1)
    vocab = model.config.vocab_size
    model(torch.randint(0, vocab, (1, 64)), cache=cache)
    at_64 = cache.nbytes()
    model(torch.randint(0, vocab, (1, 192)), cache=cache)
    per_token = (cache.nbytes() - at_64) / 192
    return per_token, int(at_64 - 64 * per_token)


def mha_bytes_per_token(cfg: K3Config, element_size: int = 4) -> int:
    """A standard MHA cache for the same model: K and V of width heads x v_head_dim in every layer."""
    return 2 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.v_head_dim * element_size


def k3_full_cache_values(cfg: K3Config) -> tuple[int, int]:
    """(K3 values per token: MLA latent only, MHA values per token) at full size, from the config."""
    mla_layers = sum(not cfg.is_kda_layer(i) for i in range(cfg.num_hidden_layers))
    ours = mla_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    mha = 2 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.v_head_dim
    return ours, mha


def text_batches(batch: int, length: int, steps: int, seed: int = 0) -> list[torch.Tensor]:
    """Fresh byte-level batches (token = byte value) cut from this repository's text files."""
    corpus = b"".join(p.read_bytes() for p in sorted(ROOT.glob("**/*.py")) if ".venv" not in p.parts)
    corpus += b"".join(p.read_bytes() for p in sorted((ROOT / "docs").glob("*.md")))
    data = torch.frombuffer(bytearray(corpus), dtype=torch.uint8).long()
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        starts = torch.randint(0, data.numel() - length, (batch,), generator=gen)
        out.append(torch.stack([data[s : s + length] for s in starts.tolist()]))
    return out


def train_without_balancing(model: K3ForCausalLM, steps: int, batch: int = 16, length: int = 64) -> float:
    """Train `model` on byte text with the router biases left at zero; returns the final loss.

    A trained router scores experts far more unevenly than a freshly initialised one (whose sigmoid
    scores all sit near 0.5), which is the regime where the balancing rules differ.
    """
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loss = torch.tensor(0.0)
    for ids in text_batches(batch, length + 1, steps, seed=1):
        logits = model(ids[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    return loss.item()


@torch.no_grad()
def recorded_router_scores(model: K3ForCausalLM, batches: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Router scores [tokens, n] of every MoE layer (inner list) for each batch (outer list)."""
    return [[s.scores for s in model(ids).router_stats] for ids in batches]


def balancing_curves(scores: list[list[torch.Tensor]], k: int, steps: int) -> dict[str, list[float]]:
    """MaxVio per step (mean over MoE layers) for Quantile Balancing and the sign update.

    Both methods route the same recorded scores: at step t, batch t mod len(scores) is routed (top-k of
    s + b) with the bias computed from the earlier steps, so during the first pass over the batches every
    figure is measured on tokens that bias has not seen.
    """
    n = scores[0][0].shape[1]
    curves = {}
    for method in ("quantile", "sign"):
        biases = [torch.zeros(n) for _ in scores[0]]
        vio = []
        for step in range(steps):
            per_layer = []
            for j, s in enumerate(scores[step % len(scores)]):
                loads = expert_loads(route_top_k(s, biases[j], k), n)
                per_layer.append(max_violation(loads))
                if method == "quantile":
                    biases[j] = quantile_balance(s, k, biases[j])
                else:
                    biases[j] = sign_update(loads, biases[j], u=1e-3)
            vio.append(statistics.mean(per_layer))
        curves[method] = vio
    return curves


def same_batch_curves(scores: list[torch.Tensor], k: int, steps: int) -> dict[str, list[float]]:
    """As `balancing_curves`, but every step re-routes the same batch (in-sample convergence)."""
    return balancing_curves([scores], k, steps)


def noise_floor(tokens: int, n: int, k: int, draws: int = 20) -> float:
    """MaxVio of a perfectly balanced router (k distinct uniform experts per token) at this batch size."""
    vals = []
    for _ in range(draws):
        ids = torch.rand(tokens, n).topk(k, dim=-1).indices
        vals.append(max_violation(torch.bincount(ids.reshape(-1), minlength=n).float()))
    return statistics.mean(vals)


def steps_to(curve: list[float], level: float) -> str:
    for i, v in enumerate(curve):
        if v <= level:
            return str(i)
    return f"> {len(curve) - 1}"


def run(quick: bool, threads: int) -> str:
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    prefill_len = 256 if quick else 1024
    repeats = 3 if quick else 5
    steps = 16 if quick else 48
    lines = []
    add = lines.append
    models = {name: K3ForCausalLM(K3Config.from_yaml(path)).eval() for name, path in CONFIGS.items()}

    add("### Throughput (batch 1 unless noted, fp32)\n")
    add(f"| model | params total / active | prefill tok/s (T={prefill_len}) | decode tok/s (b=1) "
        "| decode tok/s (b=8) |")
    add("|---|---|---|---|---|")
    for name, model in models.items():
        total, active = count_parameters(model.config)
        pre = prefill_tokens_per_s(model, prefill_len, repeats)
        d1 = 1 / decode_step_seconds(model, [64], 1, steps)[0]
        d8 = 8 / decode_step_seconds(model, [64], 8, steps)[0]
        add(f"| {name} | {total / 1e6:.2f} M / {active / 1e6:.2f} M | {pre:,.0f} | {d1:,.0f} | {d8:,.0f} |")
        print(lines[-1], flush=True)

    add("\n### Decode cost per token vs context length (batch 1, cached)\n")
    add("| model | ms/token at 256 | ms/token at 4096 | ratio 4096 / 256 (target <= 1.5 for k3_tiny) |")
    add("|---|---|---|---|")
    for name, model in models.items():
        short, long = decode_step_seconds(model, [256, 4096], 1, 2 * steps)
        add(f"| {name} | {short * 1e3:.2f} | {long * 1e3:.2f} | {long / short:.2f}x |")
        print(lines[-1], flush=True)

    add("\n### Cache size per token of context (fp32, batch 1)\n")
    add("| model | K3 cache bytes/token | constant KDA state bytes | same-size MHA bytes/token | MHA / K3 |")
    add("|---|---|---|---|---|")
    for name, model in models.items():
        per_token, constant = cache_bytes_per_token(model)
        mha = mha_bytes_per_token(model.config)
        add(f"| {name} | {per_token:,.0f} | {constant:,} | {mha:,} | {mha / per_token:.1f}x |")
    full = K3Config.from_yaml(ROOT / "conf/model/k3.yaml")
    ours, mha = k3_full_cache_values(full)
    add(f"| k3 (full, from config) | {ours:,} values | 69 x 96 x 128 x 128 state | {mha:,} values | "
        f"{mha / ours:.0f}x |")

    bal_model = models["k3_tiny"]
    cfg = bal_model.config
    train_steps, train_batch = (60, 8) if quick else (300, 16)
    final_loss = train_without_balancing(bal_model, train_steps, batch=train_batch)
    batch, length, record = 128, 32, 20
    tokens = batch * length
    scores = recorded_router_scores(bal_model, text_batches(batch, length, record))
    curves = balancing_curves(scores, cfg.num_experts_per_token, steps=200)
    floor = noise_floor(tokens, cfg.num_experts, cfg.num_experts_per_token)
    add(f"\n### Router balancing ({cfg.num_experts} experts, top-{cfg.num_experts_per_token})\n")
    add(f"Scores from k3_tiny after {train_steps} training steps ({train_batch} x 64 bytes) without "
        f"balancing (final loss {final_loss:.2f}), recorded for {record} fresh batches of {tokens} tokens "
        f"({batch} windows of "
        f"{length} bytes of this repository's sources). Step t routes batch t mod {record} with the bias "
        f"from earlier steps (steps < {record} are out-of-sample); MaxVio is averaged over the "
        f"{len(bal_model.moe_routers())} MoE layers.\n")
    cols = (0, 1, 2, 3, 5, 10, 19, 100, 199)
    add("| method | " + " | ".join(f"step {c}" for c in cols) + " | steps to <= 2x floor |")
    add("|---" * (len(cols) + 2) + "|")
    for method, curve in curves.items():
        cells = " | ".join(f"{curve[i]:.3f}" for i in cols)
        add(f"| {'Quantile Balancing' if method == 'quantile' else 'sign update u=1e-3'} | {cells} | "
            f"{steps_to(curve, 2 * floor)} |")
    add(f"| balanced router (sampling-noise floor at {tokens} tokens) | {floor:.3f} |" + " |" * len(cols))
    same = same_batch_curves(scores[0], cfg.num_experts_per_token, steps=200)
    add("\nThe same, re-routing one batch every step (in-sample: how fast each rule solves a fixed batch):\n")
    add("| method | " + " | ".join(f"step {c}" for c in cols) + " | steps to <= 2x floor |")
    add("|---" * (len(cols) + 2) + "|")
    for method, curve in same.items():
        cells = " | ".join(f"{curve[i]:.3f}" for i in cols)
        add(f"| {'Quantile Balancing' if method == 'quantile' else 'sign update u=1e-3'} | {cells} | "
            f"{steps_to(curve, 2 * floor)} |")
    print("\n".join(lines[-11:]), flush=True)

    header = (
        f"Machine: {platform.machine()}, {torch.get_num_threads()} torch thread(s), "
        f"torch {torch.__version__}; "
        f"CPU shared with other jobs (absolute figures are indicative, ratios come from the same run).\n"
        f"Command: `python bench/model.py{' --quick' if quick else ''}`\n"
    )
    return header + "\n" + "\n".join(lines) + "\n"




def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="shorter sequences and fewer steps")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = parser.parse_args()
    body = run(args.quick, args.threads)
    print(body)
    if not args.no_write:
        write_section("model", "## Model (`bench/model.py`)\n\n" + body)


if __name__ == "__main__":
    main()
