"""Benchmark the kernels: chunked vs token-by-token KDA on CPU; Triton vs PyTorch (and fla) on CUDA.

Also the GPU check's kernel cases (`kernel_cases` / `check_kernel`). Rewrites the `kernels` section of
docs/benchmarks.md. Usage: python bench/kernels.py [--quick] [--no-write]

Design: docs/design/benchmarks.md#bench-kernels.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
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


def time_ms(fn: Callable[[], object], device: str) -> float:
    """Milliseconds of one ``fn()``: `cuda_ms` on the GPU; on the CPU one wall time (the GPU check's dry
    run, whose figures only show the step ran: repeats would run Triton's interpreter again for nothing)."""
    if device == "cuda":
        return cuda_ms(fn)
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


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


def moe_inputs(M: int, E: int, top_k: int, L: int, I: int, device: str, dtype: torch.dtype) -> dict:
    """Routed-expert inputs: M tokens of width L, E experts of intermediate width I, top-k routing."""
    gen = torch.Generator(device=device).manual_seed(0)
    return {
        "x": torch.randn(M, L, device=device, generator=gen).to(dtype),
        "expert_ids": torch.rand(M, E, device=device, generator=gen).topk(top_k, dim=-1).indices,
        "expert_weights": torch.rand(M, top_k, device=device, generator=gen),
        "w_gate": (0.02 * torch.randn(E, I, L, device=device, generator=gen)).to(dtype),
        "w_up": (0.02 * torch.randn(E, I, L, device=device, generator=gen)).to(dtype),
        "w_down": (0.02 * torch.randn(E, L, I, device=device, generator=gen)).to(dtype),
    }


def moe_rows(device: str, E: int, top_k: int, L: int, I: int, token_counts: tuple[int, ...]) -> list[str]:
    """Our grouped GEMM (Triton) and PyTorch's ``grouped_mm`` vs the per-expert loop, bf16: a check of
    the output, then fwd and fwd+bwd times (ratio: the loop over ours)."""
    from kernels.moe.grouped import moe_experts_triton
    from kernels.moe.torch_grouped import moe_experts_grouped_mm

    lines = [
        f"MoE, {E} experts top-{top_k}, latent L={L}, intermediate I={I}, bf16, {device}:",
        "",
        "| tokens | pass | grouped GEMM ms | torch grouped_mm ms | per-expert loop ms | ratio |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for M in token_counts:
        x = moe_inputs(M, E, top_k, L, I, device, torch.bfloat16)
        with torch.no_grad():
            y_ours = moe_experts_triton(**x).float()
            y_loop = moe_experts_reference(**x).float()
        rel = ((y_ours - y_loop).abs().max() / y_loop.abs().max()).item()
        lines.insert(1, f"check at {M} tokens: max |Δy| / max |y| = {rel:.1e} (grouped vs loop, bf16)")
        for name, backward in (("fwd", False), ("fwd+bwd", True)):
            timings = []
            for fn in (moe_experts_triton, moe_experts_grouped_mm, moe_experts_reference):
                leaves = {n: t.detach().clone().requires_grad_(backward and t.is_floating_point())
                          for n, t in x.items()}  # fmt: skip

                def run(fn=fn, leaves=leaves, backward=backward) -> None:
                    y = fn(**leaves)
                    if backward:
                        y.float().sum().backward()

                timings.append(time_ms(run, device))
            line = (f"| {M} | {name} | {timings[0]:.2f} | {timings[1]:.2f} | {timings[2]:.2f} | "
                    f"{timings[2] / timings[0]:.1f}× |")  # fmt: skip
            print(line, flush=True)
            lines.append(line)
    return lines


def bench_cuda_moe(quick: bool) -> list[str]:
    k3 = model_config("k3")
    L, I = k3["routed_expert_hidden_size"], k3["moe_intermediate_size"]  # K3's expert shapes
    E, top_k = 64, 8  # the 64-expert target (K3 itself: 896 experts, top-16)
    return moe_rows("cuda", E, top_k, L, I, (4096,) if quick else (4096, 16384))


# ---------------------------------------------------------------------------------------------- checks


TOLERANCE = {torch.float32: 5e-3, torch.bfloat16: 5e-2}  # fp32: tl.dot takes fp32 operands as TF32 on GPUs


@dataclass(frozen=True)
class KernelCase:
    """One kernel of the GPU check: ``ours`` against ``reference`` on ``make(device, dtype)``'s inputs
    (keyword arguments of both); ``backward``: whether it has one to check."""

    name: str
    make: Callable[[str, torch.dtype], dict]
    ours: Callable[..., object]
    reference: Callable[..., object]
    backward: bool = True
    shape: str = ""


def _first(out: object) -> torch.Tensor:
    """A kernel's output tensor (KDA kernels return (o, final_state))."""
    return out[0] if isinstance(out, tuple) else out


def scaled_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual − expected| / max(1, max |expected|) (as the kernel tests measure it)."""
    expected = expected.double()
    if not expected.numel():
        return 0.0
    return (actual.double() - expected).abs().max().item() / max(1.0, expected.abs().max().item())


def _outputs(fn: Callable[..., object], x: dict, backward: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``fn``'s output on leaf copies of ``x`` and, with ``backward``, the gradients of a fixed weighted sum
    of it with respect to every floating input."""
    leaves = {n: t.detach().clone().requires_grad_(backward and t.is_floating_point()) for n, t in x.items()}
    out = _first(fn(**leaves))
    if not backward:
        return out.detach(), []
    weight = torch.randn(out.shape, device=out.device, generator=torch.Generator(out.device).manual_seed(1))
    (out.float() * weight).sum().backward()
    return out.detach(), [t.grad for t in leaves.values() if t.requires_grad]


def _fwd_bwd_run(fn: Callable[..., object], x: dict, backward: bool) -> Callable[[], None]:
    leaves = {n: t.detach().clone().requires_grad_(backward and t.is_floating_point()) for n, t in x.items()}

    def run() -> None:
        if not backward:
            with torch.no_grad():
                fn(**leaves)
            return
        for t in leaves.values():
            t.grad = None
        _first(fn(**leaves)).float().sum().backward()

    return run


def check_kernel(case: KernelCase, dtype: torch.dtype, device: str) -> dict:
    """``case`` in ``dtype``: the largest scaled error of its output and gradients against the reference
    (run in fp32 on the same, ``dtype``-rounded inputs), the verdict at `TOLERANCE`, and the times (ms)
    of forward and forward+backward, ours and the reference's in ``dtype``."""
    x = case.make(device, dtype)
    upcast = {n: t.float() if t.is_floating_point() else t for n, t in x.items()}
    out, grads = _outputs(case.ours, x, case.backward)
    ref_out, ref_grads = _outputs(case.reference, upcast, case.backward)
    errors = [scaled_error(out, ref_out)]
    errors += [scaled_error(a, b) for a, b in zip(grads, ref_grads, strict=True)]
    finite = bool(torch.isfinite(out).all()) and all(bool(torch.isfinite(g).all()) for g in grads)
    row = {"kernel": case.name, "shape": case.shape, "dtype": str(dtype).removeprefix("torch."),
           "error": max(errors), "ok": finite and max(errors) <= TOLERANCE[dtype]}  # fmt: skip
    for who, fn in (("ours", case.ours), ("reference", case.reference)):
        row[f"{who}_fwd_ms"] = time_ms(_fwd_bwd_run(fn, x, False), device)
        row[f"{who}_fwd_bwd_ms"] = time_ms(_fwd_bwd_run(fn, x, True), device) if case.backward else None
    return row


def fla_chunk_kda() -> Callable[..., object] | None:
    """flash-linear-attention's ``chunk_kda``, or None when ``fla`` does not import."""
    return _fla_chunk_kda()


def kernel_cases(device: str, small: bool) -> list[KernelCase]:
    """The kernels of the GPU check with their references; ``small``: the dry run's tiny shapes."""
    from kernels.kda.chunk import chunk_kda_triton
    from kernels.kda.fused_recurrent import fused_recurrent_kda_triton
    from kernels.kda.reference import fused_recurrent_kda_reference
    from kernels.moe.grouped import moe_experts_triton
    from kernels.situ_glu import situ_glu_reference
    from kernels.situ_glu_triton import situ_glu_triton

    B, T, H, D = (1, 64, 1, 16) if small else (2, 4096, 16, 128)
    decode = (2, 1, 1, 16) if small else (64, 1, 16, 128)
    rows, width = (64, 32) if small else (16384, 4096)
    M, E, top_k, L, I = (32, 4, 2, 16, 32) if small else (4096, 16, 4, 512, 256)

    def kda(b, t, h, d):
        return lambda device, dtype: kda_inputs(b, t, h, d, d, device, dtype)

    def with_state(device, dtype):
        b, _t, h, d = decode
        x = kda_inputs(*decode, d, device, dtype)
        gen = torch.Generator(device=device).manual_seed(2)
        x["initial_state"] = torch.randn(b, h, d, d, device=device, generator=gen)
        return x

    def moe(device, dtype):
        return moe_inputs(M, E, top_k, L, I, device, dtype)

    def glu(device, dtype):
        gen = torch.Generator(device=device).manual_seed(3)
        gate, up = (4 * torch.randn(2, rows, width, device=device, generator=gen)).to(dtype)
        return {"gate": gate, "up": up}

    cases = [
        KernelCase("chunk_kda", kda(B, T, H, D), chunk_kda_triton, chunk_kda_reference,
                   shape=f"B={B} T={T} H={H} D={D}"),
        KernelCase("fused_recurrent_kda (decode)", with_state, fused_recurrent_kda_triton,
                   fused_recurrent_kda_reference, backward=False,
                   shape=f"B={decode[0]} T=1 H={decode[2]} D={decode[3]}"),
        KernelCase("situ_glu", glu, situ_glu_triton, situ_glu_reference, shape=f"{rows}x{width}"),
        KernelCase("moe_experts (grouped GEMM)", moe, moe_experts_triton, moe_experts_reference,
                   shape=f"M={M} E={E} top-{top_k} L={L} I={I}"),
    ]  # fmt: skip
    fla = fla_chunk_kda()
    if fla is not None:
        cases.append(KernelCase("chunk_kda (fla)", kda(B, T, H, D), fla, chunk_kda_reference,
                                shape=f"B={B} T={T} H={H} D={D}"))  # fmt: skip
    return cases


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
