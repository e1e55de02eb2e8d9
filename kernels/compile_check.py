"""Compile every Triton kernel ahead of time for an NVIDIA GPU target, without a GPU.

    python -m kernels.compile_check              # sm_90 (H100/H200), K = V = 128, bf16
    python -m kernels.compile_check --arch 80 --head-dim 64

Triton lowers each kernel to PTX and runs the bundled ``ptxas``, so compile errors, shared-memory
overruns and register spills show up on a machine without a GPU (the interpreter used by the tests
accepts programs that the compiler would reject). Prints one line per kernel: shared memory,
registers per thread and stack (spill) bytes per thread (from ``cuobjdump --dump-resource-usage``).
Exits non-zero when a kernel fails to compile or needs more shared memory than the target has.

Must run with ``TRITON_INTERPRET`` unset (kernels decorated for the interpreter cannot be compiled).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

SHARED_MEMORY_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}


@dataclass
class KernelSpec:
    """A kernel and the argument types of one specialisation (constexpr values given as values)."""

    fn: object
    types: dict[str, str]
    constexprs: dict[str, object]
    launch: dict[str, int] | None = None  # num_warps / num_stages as the host code launches it


def kernel_specs(head_dim: int, dtype: str) -> list[KernelSpec]:
    """Every Triton kernel of the package, specialised as ``bench/kernels.py`` launches it."""
    from kernels import situ_glu_triton
    from kernels.kda import chunk as kda_chunk
    from kernels.kda import fused_recurrent
    from kernels.moe import grouped

    K = V = head_dim
    BV = kda_chunk.value_block(K, V)
    C, S = kda_chunk.CHUNK, kda_chunk.SUB
    x, f32, i32 = f"*{dtype}", "*fp32", "*i32"
    chunk_idx = {"chunk_start_ptr": i32, "chunk_end_ptr": i32}
    seq_idx = {"seq_start_ptr": i32, "seq_end_ptr": i32}
    specs = [
        KernelSpec(
            kda_chunk._chunk_cumsum_kernel,
            {"x_ptr": f32, "out_ptr": f32, **chunk_idx, "H": "i32"},
            {"D": K, "C": C, "REVERSE": True},
        ),
        KernelSpec(
            kda_chunk._intra_scores_fwd_kernel,
            {
                "q_ptr": x,
                "k_ptr": x,
                "G_ptr": f32,
                "Akk_ptr": f32,
                "Aqk_ptr": f32,
                **chunk_idx,
                "scale": "fp32",
                "H": "i32",
            },
            {"K": K, "C": C, "S": S},
        ),
        KernelSpec(
            kda_chunk._solve_wy_kernel,
            {
                "Akk_ptr": f32,
                "beta_ptr": x,
                "k_ptr": x,
                "v_ptr": x,
                "G_ptr": f32,
                "M_ptr": f32,
                "U_ptr": f32,
                "W_ptr": f32,
                **chunk_idx,
                "H": "i32",
            },
            {"K": K, "V": V, "C": C},
        ),
        KernelSpec(
            kda_chunk._state_fwd_kernel,
            {
                "k_ptr": x,
                "G_ptr": f32,
                "U_ptr": f32,
                "W_ptr": f32,
                "u_ptr": f32,
                "h_ptr": f32,
                "h0_ptr": f32,
                "ht_ptr": f32,
                **seq_idx,
                "seq_first_chunk_ptr": i32,
                "H": "i32",
            },
            {"K": K, "V": V, "BV": BV, "C": C, "HAS_H0": True, "STORE_HT": True},
        ),
        KernelSpec(
            kda_chunk._output_fwd_kernel,
            {
                "q_ptr": x,
                "G_ptr": f32,
                "Aqk_ptr": f32,
                "u_ptr": f32,
                "h_ptr": f32,
                "o_ptr": x,
                **chunk_idx,
                "scale": "fp32",
                "H": "i32",
            },
            {"K": K, "V": V, "BV": BV, "C": C},
        ),
        KernelSpec(
            kda_chunk._state_bwd_kernel,
            {
                "q_ptr": x,
                "k_ptr": x,
                "G_ptr": f32,
                "W_ptr": f32,
                "Aqk_ptr": f32,
                "do_ptr": x,
                "du_ptr": f32,
                "dh_ptr": f32,
                "dht_ptr": f32,
                "dh0_ptr": f32,
                **seq_idx,
                "seq_first_chunk_ptr": i32,
                "scale": "fp32",
                "H": "i32",
            },
            {"K": K, "V": V, "BV": BV, "C": C, "HAS_DHT": True, "STORE_DH0": True},
        ),
        KernelSpec(
            kda_chunk._chunk_bwd_keys_kernel,
            {
                **{name: x for name in ("q_ptr", "k_ptr", "beta_ptr", "do_ptr")},
                **{name: f32 for name in ("G_ptr", "M_ptr", "u_ptr", "du_ptr", "h_ptr", "dh_ptr", "dq_ptr")},
                **{name: f32 for name in ("dk_ptr", "dG_ptr", "dM_part_ptr", "dbeta_part_ptr")},
                **chunk_idx,
                "scale": "fp32",
                "H": "i32",
                "n_chunks": "i32",
            },
            {"K": K, "V": V, "BK": kda_chunk.key_block(K), "BV": BV, "C": C},
        ),
        KernelSpec(
            kda_chunk._chunk_bwd_values_kernel,
            {
                **{name: x for name in ("v_ptr", "beta_ptr", "do_ptr")},
                **{name: f32 for name in ("Akk_ptr", "M_ptr", "u_ptr", "du_ptr", "dM_part_ptr")},
                **{name: f32 for name in ("dbeta_part_ptr", "dAqk_ptr", "dAkk_ptr", "dv_ptr", "dbeta_ptr")},
                **chunk_idx,
                "H": "i32",
                "n_chunks": "i32",
            },
            {"V": V, "BV": BV, "C": C, "NKB": K // kda_chunk.key_block(K)},
        ),
        KernelSpec(
            kda_chunk._intra_scores_bwd_kernel,
            {
                "q_ptr": x,
                "k_ptr": x,
                "G_ptr": f32,
                "dAqk_ptr": f32,
                "dAkk_ptr": f32,
                "dq_ptr": f32,
                "dk_ptr": f32,
                "dG_ptr": f32,
                **chunk_idx,
                "scale": "fp32",
                "H": "i32",
            },
            {"K": K, "C": C, "S": S},
        ),
        KernelSpec(
            fused_recurrent._fused_recurrent_fwd_kernel,
            {
                "q_ptr": x,
                "k_ptr": x,
                "v_ptr": x,
                "g_ptr": f32,
                "beta_ptr": x,
                "o_ptr": x,
                "h0_ptr": f32,
                "ht_ptr": f32,
                **seq_idx,
                "scale": "fp32",
                "H": "i32",
            },
            {"K": K, "V": V, "BK": K, "BV": BV, "HAS_H0": True, "STORE_HT": True},
        ),
        KernelSpec(
            situ_glu_triton._situ_glu_fwd_kernel,
            {"gate_ptr": x, "up_ptr": x, "y_ptr": x, "n": "i32", "beta1": "fp32", "beta2": "fp32"},
            {"BLOCK": situ_glu_triton.BLOCK},
        ),
        KernelSpec(
            situ_glu_triton._situ_glu_bwd_kernel,
            {
                "gate_ptr": x,
                "up_ptr": x,
                "dy_ptr": x,
                "dgate_ptr": x,
                "dup_ptr": x,
                "n": "i32",
                "beta1": "fp32",
                "beta2": "fp32",
            },
            {"BLOCK": situ_glu_triton.BLOCK},
        ),
        KernelSpec(
            grouped._grouped_mm_kernel,
            {
                "a_ptr": x,
                "b_ptr": x,
                "b2_ptr": x,
                "c_ptr": x,
                "gate_out_ptr": x,
                "up_out_ptr": x,
                "tile_expert_ptr": i32,
                "tile_start_ptr": i32,
                "tile_end_ptr": i32,
                "N": "i32",
                "Kd": "i32",
                "stride_a": "i32",
                "stride_be": "i32",
                "stride_bk": "i32",
                "stride_bn": "i32",
                "stride_c": "i32",
                "beta1": "fp32",
                "beta2": "fp32",
            },
            {"DUAL": True, "ACCUMULATE": False, "BM": grouped.BM, "BN": 64, "BK": 32},
        ),
        KernelSpec(
            grouped._grouped_wgrad_kernel,
            {
                "a_ptr": x,
                "b_ptr": x,
                "out_ptr": x,
                "seg_start_ptr": i32,
                "seg_end_ptr": i32,
                "P": "i32",
                "Q": "i32",
                "stride_a": "i32",
                "stride_b": "i32",
                "stride_oe": "i32",
                "stride_op": "i32",
                "stride_oq": "i32",
            },
            {"BP": 64, "BQ": 64, "BR": 32},
        ),
    ]
    kda_launch = {
        "_chunk_cumsum_kernel": kda_chunk.TILE_LAUNCH,
        "_intra_scores_fwd_kernel": kda_chunk.SUB_TILE_LAUNCH,
        "_solve_wy_kernel": kda_chunk.TILE_LAUNCH,
        "_state_fwd_kernel": kda_chunk.STATE_LAUNCH,
        "_output_fwd_kernel": kda_chunk.TILE_LAUNCH,
        "_state_bwd_kernel": kda_chunk.STATE_LAUNCH,
        "_chunk_bwd_keys_kernel": kda_chunk.TILE_LAUNCH,
        "_chunk_bwd_values_kernel": kda_chunk.TILE_LAUNCH,
        "_intra_scores_bwd_kernel": kda_chunk.SUB_TILE_LAUNCH,
    }
    for spec in specs:
        spec.launch = spec.launch or kda_launch.get(spec.fn.__name__)
    return specs


def resource_usage(cubin: bytes) -> dict[str, int]:
    """Registers, spill (local memory) bytes and static shared memory of a cubin, via cuobjdump."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run(
            [str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True
        ).stdout
    return {key: int(val) for key, val in re.findall(r"(REG|LOCAL|STACK):(\d+)", out)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability ×10 (80, 86, 89, 90)")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET: interpreted kernels cannot be compiled", file=sys.stderr)
        return 2
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", args.arch, 32)
    limit = SHARED_MEMORY_LIMIT.get(args.arch, 99 * 1024)
    failures = 0
    for spec in kernel_specs(args.head_dim, args.dtype):
        name = spec.fn.__name__
        signature = dict(spec.types)
        signature.update({c: "constexpr" for c in spec.constexprs})
        ordered = {a: signature[a] for a in spec.fn.arg_names}
        try:
            compiled = triton.compile(
                ASTSource(fn=spec.fn, signature=ordered, constexprs=spec.constexprs),
                target=target,
                options=dict(spec.launch or {}),
            )
        except Exception as exc:  # report every kernel, then fail
            failures += 1
            print(f"FAIL {name}: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
            continue
        shared = compiled.metadata.shared
        usage = resource_usage(compiled.asm["cubin"])
        status = "ok" if shared <= limit else "FAIL (shared memory)"
        failures += shared > limit
        spilled = usage.get("STACK", 0) + usage.get("LOCAL", 0)
        print(
            f"{status:4} {name:32} shared {shared / 1024:6.1f} KiB  regs {usage.get('REG', -1):3}  "
            f"stack/spill {spilled:5} B/thread  {spec.launch or {}}"
        )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
