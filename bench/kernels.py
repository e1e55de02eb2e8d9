"""Benchmark the kernels: chunked vs token-by-token KDA on CPU; Triton vs PyTorch (and fla) on CUDA.

    python bench/kernels.py            # full grid
    python bench/kernels.py --quick    # fits in ~2 minutes
    python bench/kernels.py --no-write # print only; otherwise rewrite the `kernels` section of
                                       # docs/benchmarks.md

CPU (always run): wall time of ``naive_recurrent_kda`` (the recurrence) against ``chunk_kda_reference``
(the chunked PyTorch algorithm) at T = 1K–8K with the KDA heads of ``conf/model/k3_tiny.yaml`` and
``k3_small.yaml``, forward only, fp32, one thread; the figure is their ratio.

CUDA (run when a GPU is visible; none was lent while this was written, so that path has not run yet):

* KDA chunk forward+backward, bf16, D = K = V = 128, B·T = 32K–256K tokens, H = 16–64: ms and TFLOP/s
  of our Triton ``chunk_kda`` against the chunked PyTorch reference (where it fits in memory) and
  flash-linear-attention's ``fla.ops.kda.chunk_kda`` when that package is importable. A correctness
  check against the reference runs first.
* MoE routed experts, bf16, 64 experts top-8 with K3's expert shapes (``conf/model/k3.yaml``): the
  grouped-GEMM Triton path against the per-expert loop, forward and forward+backward.

FLOP model for KDA (per head and 64-token chunk C, head dims K, V; dense matmuls as executed, the
triangular solve left out): forward = 4C²K (scores) + 2C²(K+V) (WY products) + 2C²V + 6CKV (state
and output); forward+backward = 3 × forward (the usual convention).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_report import write_section  # noqa: E402

from kernels.kda.reference import CPU_CHUNK_SIZE, chunk_kda_reference, naive_recurrent_kda  # noqa: E402
from kernels.moe.reference import moe_experts_reference  # noqa: E402

SECTION = "kernels"
CHUNK = 64


# ---------------------------------------------------------------------------------------------- inputs


def kda_inputs(
    B: int, T: int, H: int, K: int, V: int, device: str, dtype: torch.dtype, seed: int = 0
) -> dict:  # noqa: E501
    """Inputs as the KDA layer makes them: L2-normalised q, k; K3 gate g ∈ (−5, 0); β ∈ (0, 1)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, K, device=device, generator=gen), dim=-1).to(dtype)
    k = F.normalize(torch.randn(B, T, H, K, device=device, generator=gen), dim=-1).to(dtype)
    v = torch.randn(B, T, H, V, device=device, generator=gen).to(dtype)
    g = (-5.0 * torch.sigmoid(torch.randn(B, T, H, K, device=device, generator=gen))).to(torch.float32)
    beta = torch.sigmoid(torch.randn(B, T, H, device=device, generator=gen)).to(dtype)
    return {"q": q, "k": k, "v": v, "g": g, "beta": beta}


def kda_flops(tokens: int, H: int, K: int, V: int, backward: bool) -> float:
    """Matmul FLOPs of the chunk algorithm (see the module docstring)."""
    C = CHUNK
    per_chunk = 4 * C * C * K + 2 * C * C * (K + V) + 2 * C * C * V + 6 * C * K * V
    forward = per_chunk * H * tokens / C
    return 3 * forward if backward else forward


# ---------------------------------------------------------------------------------------------- timing


def cpu_time(fn: Callable[[], object], repeats: int) -> float:
    """Best CPU time of this process over ``repeats`` runs (seconds).

    CPU time rather than wall time: on a shared machine wall time also counts the other tenants.
    """
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        fn()
        best = min(best, time.process_time() - start)
    return best


def cuda_ms(fn: Callable[[], object]) -> float:
    """Median milliseconds of ``fn`` on the GPU (Triton's do_bench: warm-up, flushed cache)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=5, rep=50, return_mode="median"))


# ---------------------------------------------------------------------------------------------- CPU


def model_config(name: str) -> dict:
    """A model config of ``conf/model`` (the benchmark shapes come from there, not from this file)."""
    return yaml.safe_load((ROOT / "conf" / "model" / f"{name}.yaml").read_text())


def bench_cpu_kda(quick: bool) -> list[str]:
    """Recurrence vs chunked reference at chunk 64 (the Triton kernels' size) and 32 (what
    ``kernels.chunk_kda`` runs on CPU)."""
    torch.set_num_threads(1)
    lengths = (1024, 4096) if quick else (1024, 2048, 4096, 8192)
    lines = [
        "| heads of | T | H | K = V | naive (s) | chunk 64 (s) | ratio | chunk 32, `chunk_kda` (s) | ratio |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for model in ("k3_tiny", "k3_small"):
        kda = model_config(model)["linear_attn_config"]
        H, D = kda["num_heads"], kda["head_dim"]
        for T in lengths:
            x = kda_inputs(1, T, H, D, D, "cpu", torch.float32)
            with torch.no_grad():
                naive = cpu_time(lambda x=x: naive_recurrent_kda(**x), 2)
                c64 = cpu_time(lambda x=x: chunk_kda_reference(**x, chunk_size=64), 5)
                c32 = cpu_time(lambda x=x: chunk_kda_reference(**x, chunk_size=CPU_CHUNK_SIZE), 5)
            cells = [model, T, H, D, f"{naive:.3f}", f"{c64:.4f}", f"{naive / c64:.1f}×", f"{c32:.4f}"]
            line = "| " + " | ".join(str(c) for c in cells) + f" | {naive / c32:.1f}× |"
            print(line, flush=True)
            lines.append(line)
    return lines


# ---------------------------------------------------------------------------------------------- CUDA


def _fla_chunk_kda():
    try:
        from fla.ops.kda import chunk_kda as fla_chunk_kda
    except Exception:  # not installed, or installed without a working build
        return None
    return fla_chunk_kda


def _fwd_bwd(fn: Callable, x: dict) -> Callable[[], None]:
    leaves = {n: t.detach().clone().requires_grad_(True) for n, t in x.items()}
    do = torch.randn_like(leaves["v"])

    def run() -> None:
        for t in leaves.values():
            t.grad = None
        o, _ = fn(**leaves)
        o.backward(do)

    return run


def check_cuda_kda() -> str:
    """Triton vs reference on one moderate shape before timing anything."""
    from kernels.kda.chunk import chunk_kda_triton

    x = kda_inputs(2, 1000, 4, 128, 128, "cuda", torch.float32, seed=1)
    o, s = chunk_kda_triton(**x, output_final_state=True)
    o_ref, s_ref = chunk_kda_reference(**x, output_final_state=True)
    err_o = (o - o_ref).abs().max().item()
    err_s = (s - s_ref).abs().max().item()
    return f"fp32 check (B=2, T=1000, H=4, D=128): max |Δo| = {err_o:.1e}, max |Δstate| = {err_s:.1e}"


def bench_cuda_kda(quick: bool) -> list[str]:
    from kernels.kda.chunk import chunk_kda_triton

    fla = _fla_chunk_kda()
    T, D = 4096, 128
    configs = [(32768, 16), (32768, 64)]  # (B·T tokens, heads)
    if not quick:
        configs += [(65536, 16), (131072, 16), (262144, 16), (131072, 32), (65536, 64)]
    lines = [
        check_cuda_kda(),
        "",
        "| B·T | H | ours ms | ours TFLOP/s | PyTorch ref ms | ours vs ref | fla ms | ours vs fla |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for tokens, H in configs:
        x = kda_inputs(tokens // T, T, H, D, D, "cuda", torch.bfloat16)
        ours = cuda_ms(_fwd_bwd(chunk_kda_triton, x))
        tflops = kda_flops(tokens, H, D, D, backward=True) / ours / 1e9
        try:
            ref = f"{cuda_ms(_fwd_bwd(chunk_kda_reference, x)):.1f}" if tokens * H <= 32768 * 16 else "—"
        except torch.cuda.OutOfMemoryError:
            ref = "OOM"
        torch.cuda.empty_cache()
        fla_ms = cuda_ms(_fwd_bwd(fla, x)) if fla is not None else None
        vs_ref = f"{float(ref) / ours:.1f}×" if ref not in ("—", "OOM") else "—"
        fla_txt = f"{fla_ms:.1f}" if fla_ms is not None else "not installed"
        vs_fla = f"{fla_ms / ours:.2f}×" if fla_ms is not None else "—"
        cells = [f"{tokens // 1024}K", H, f"{ours:.1f}", f"{tflops:.0f}", ref, vs_ref, fla_txt, vs_fla]
        line = "| " + " | ".join(str(c) for c in cells) + " |"
        print(line, flush=True)
        lines.append(line)
        del x
        torch.cuda.empty_cache()
    return lines


def bench_cuda_moe(quick: bool) -> list[str]:
    from kernels.moe.grouped import moe_experts_triton

    k3 = model_config("k3")
    L, I = k3["routed_expert_hidden_size"], k3["moe_intermediate_size"]  # K3's expert shapes
    E, top_k = 64, 8  # the 64-expert target (K3 itself: 896 experts, top-16)
    token_counts = (4096,) if quick else (4096, 16384)
    lines = [
        f"MoE, {E} experts top-{top_k}, K3 expert shapes (latent L={L}, intermediate I={I}), bf16:",
        "",
        "| tokens | pass | grouped GEMM ms | per-expert loop ms | ratio |",
        "|---:|---|---:|---:|---:|",
    ]
    for M in token_counts:
        gen = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(M, L, device="cuda", generator=gen).bfloat16()
        w_gate = (0.02 * torch.randn(E, I, L, device="cuda", generator=gen)).bfloat16()
        w_up = (0.02 * torch.randn(E, I, L, device="cuda", generator=gen)).bfloat16()
        w_down = (0.02 * torch.randn(E, L, I, device="cuda", generator=gen)).bfloat16()
        ids = torch.rand(M, E, device="cuda", generator=gen).topk(top_k, dim=-1).indices
        weights = torch.rand(M, top_k, device="cuda", generator=gen)
        tensors = (x, weights, w_gate, w_up, w_down)
        with torch.no_grad():
            y_ours = moe_experts_triton(x, ids, weights, w_gate, w_up, w_down).float()
            y_loop = moe_experts_reference(x, ids, weights, w_gate, w_up, w_down).float()
        rel = ((y_ours - y_loop).abs().max() / y_loop.abs().max()).item()
        lines.insert(1, f"check at {M} tokens: max |Δy| / max |y| = {rel:.1e} (grouped vs loop, bf16)")
        for name, backward in (("fwd", False), ("fwd+bwd", True)):
            timings = []
            for fn in (moe_experts_triton, moe_experts_reference):
                leaves = [t.detach().clone().requires_grad_(backward) for t in tensors]

                def run(fn=fn, leaves=leaves, backward=backward, ids=ids) -> None:
                    y = fn(leaves[0], ids, leaves[1], *leaves[2:])
                    if backward:
                        y.float().sum().backward()

                timings.append(cuda_ms(run))
            line = f"| {M} | {name} | {timings[0]:.2f} | {timings[1]:.2f} | {timings[1] / timings[0]:.1f}× |"
            print(line, flush=True)
            lines.append(line)
    return lines


# ---------------------------------------------------------------------------------------------- report




def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small grid, about 2 minutes")
    parser.add_argument("--no-write", action="store_true", help="print only, leave docs/benchmarks.md alone")
    args = parser.parse_args(argv)
    command = "python bench/kernels.py" + (" --quick" if args.quick else "")
    started = time.perf_counter()
    body = [f"## Kernels\n\nCommand: `{command}`  (`make bench-kernels`)\n"]
    cpu = platform.processor() or platform.machine()
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    body += [
        f"### CPU: chunked vs token-by-token KDA ({cpu}, torch {torch.__version__})\n",
        "Forward, fp32, one thread; CPU time of the process (the machine is shared, so wall time would",
        "count the other tenants), best of 2 runs for the recurrence and of 5 for the chunked version.",
        f"Load average when the run started: {load} (on {os.cpu_count()} cores).\n",
    ]
    body += bench_cpu_kda(args.quick)
    if torch.cuda.is_available():
        body += [f"\n### CUDA: {torch.cuda.get_device_name()} (KDA: forward+backward, bf16, D=128, T=4096)\n"]
        body += bench_cuda_kda(args.quick)
        body += [""]
        body += bench_cuda_moe(args.quick)
    else:
        body += [
            "\n### CUDA\n",
            "No GPU was available for this run; the CUDA part of the script (KDA fwd+bwd vs the PyTorch",
            "reference and flash-linear-attention, MoE grouped GEMM vs the per-expert loop) did not run.",
        ]
    body.append(f"\n(total {time.perf_counter() - started:.0f} s)")
    text = "\n".join(body)
    if args.no_write:
        print(text)
    else:
        write_section(SECTION, text)


if __name__ == "__main__":
    main()
