"""Compile every Triton kernel under ``kernels/`` ahead of time for an NVIDIA GPU, without a GPU.

The interpreter the tests use accepts programs Triton's compiler rejects, so this binds every launch of
the real entry points as on a GPU and compiles each specialisation to PTX. Must run with
``TRITON_INTERPRET`` unset. Usage: python scripts/compile_check.py [--arch 90] [--head-dim 128]

Design: docs/design/tooling.md#scripts-compile-check.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import multiprocessing
import os
import pkgutil
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, stated (silences a warning)

import torch  # noqa: E402

if TYPE_CHECKING:
    from triton.backends.compiler import GPUTarget
    from triton.runtime.jit import JITFunction

SHARED_MEMORY_KIB = {80: 163, 86: 99, 89: 99, 90: 227, 100: 227, 120: 99}  # per block, opt-in maximum
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass
class Launch:
    """One specialisation of a kernel, as Triton would compile it for the launch that was recorded."""

    kernel: JITFunction
    signature: dict[str, str]
    constexprs: dict
    attrs: dict
    options: object  # the backend's options dataclass (num_warps, num_stages, ...)

    @property
    def name(self) -> str:
        return self.kernel.__name__

    def describe(self) -> str:
        """Constexpr values by name (specialised ints equal to 1 included), warps and pipeline stages."""
        names = self.kernel.arg_names
        values = " ".join(f"{names[path[0]]}={value}" for path, value in self.constexprs.items())
        return f"{values}  warps={self.options.num_warps} stages={self.options.num_stages}"


@contextmanager
def record_launches(target: GPUTarget) -> Iterator[list[Launch]]:
    """Within the block, ``kernel[grid](...)`` records the launch's specialisation instead of running it.

    The recorder is ``JITFunction.run`` up to the point where it would compile: the same binder
    (``create_function_from_signature``) and argument packing (``_pack_args``), for ``target``.
    """
    from triton import knobs
    from triton.compiler import make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    backend = make_backend(target)
    launches: list[Launch] = []
    seen: set[tuple] = set()
    binders: dict[int, Callable] = {}  # per kernel, as JITFunction.create_binder
    real_run = JITFunction.run

    def run(kernel, *args, grid, warmup, **kwargs):
        kwargs["debug"] = kwargs.get("debug", kernel.debug) or knobs.runtime.debug
        kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
        kwargs["fpsan_homomorphic_casts"] = knobs.compilation.fpsan_homomorphic_casts
        if id(kernel) not in binders:
            binders[id(kernel)] = create_function_from_signature(kernel.signature, kernel.params, backend)
        bound_args, specialization, extra = binders[id(kernel)](*args, **kwargs)
        key = (id(kernel), repr(specialization), repr(sorted(extra.items())))
        if key not in seen:
            seen.add(key)
            options, signature, constexprs, attrs = kernel._pack_args(
                backend, kwargs, bound_args, specialization, extra
            )
            launches.append(Launch(kernel, signature, constexprs, attrs, options))

    JITFunction.run = run
    try:
        yield launches
    finally:
        JITFunction.run = real_run


def run_entry_points(head_dim: int, dtype: torch.dtype) -> None:
    """Call every Triton entry point of ``kernels`` the way the benchmark does, at compile-relevant shapes.

    KDA: K = V = ``head_dim``, 16 heads, 16 chunks, initial state, final state and its gradient (every
    flag on). MoE: expert widths ≥ the block caps (64) and multiples of 16, so block sizes match K3's.
    """
    from kernels.kda.chunk import chunk_kda_triton
    from kernels.kda.fused_recurrent import fused_recurrent_kda_triton
    from kernels.moe.grouped import moe_experts_triton
    from kernels.situ_glu_triton import situ_glu_triton

    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int, dt: torch.dtype = dtype, grad: bool = True) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dt).requires_grad_(grad)

    B, T, H, K, V = 1, 16 * 64, 16, head_dim, head_dim
    q, k, v = rand(B, T, H, K), rand(B, T, H, K), rand(B, T, H, V)
    g, beta, h0 = rand(B, T, H, K, dt=torch.float32), rand(B, T, H), rand(B, H, K, V, dt=torch.float32)
    o, final = chunk_kda_triton(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    (o.float().sum() + final.sum()).backward()
    with torch.no_grad():
        step = [x[:, :4].detach() for x in (q, k, v, g, beta)]
        fused_recurrent_kda_triton(*step, initial_state=h0.detach(), output_final_state=True)

    gate, up = rand(64, 256), rand(64, 256)
    situ_glu_triton(gate, up).float().sum().backward()

    M, L, I, E, top_k = 64, 256, 192, 8, 2
    x, weights = rand(M, L), rand(M, top_k, dt=torch.float32)
    w_gate, w_up, w_down = rand(E, I, L), rand(E, I, L), rand(E, L, I)
    ids = torch.rand(M, E, generator=gen).topk(top_k, dim=-1).indices
    moe_experts_triton(x, ids, weights, w_gate, w_up, w_down).float().sum().backward()


def jit_functions_under(package: str) -> dict[str, JITFunction]:
    """Every ``@triton.jit`` function defined in the modules of ``package``, by qualified name."""
    from triton.runtime.jit import JITFunction

    root = importlib.import_module(package)
    modules = [root] + [
        importlib.import_module(info.name) for info in pkgutil.walk_packages(root.__path__, f"{package}.")
    ]
    return {
        f"{module.__name__}.{name}": obj
        for module in modules
        for name, obj in vars(module).items()
        if isinstance(obj, JITFunction) and obj.module == module.__name__
    }


def called_jit_functions(kernel: JITFunction, package: str) -> set[JITFunction]:
    """The ``@triton.jit`` functions of ``package`` that ``kernel`` calls, directly or through each other."""
    from triton.runtime.jit import JITFunction

    found: set[JITFunction] = set()
    todo = [kernel]
    while todo:
        fn = todo.pop()
        for node in ast.walk(ast.parse(fn.src)):
            if not isinstance(node, ast.Call):
                continue
            parts, func = [], node.func
            while isinstance(func, ast.Attribute):
                parts.append(func.attr)
                func = func.value
            if not isinstance(func, ast.Name) or func.id not in fn.__globals__:
                continue
            obj = fn.__globals__[func.id]
            for attr in reversed(parts):
                obj = getattr(obj, attr, None)
            own = isinstance(obj, JITFunction) and obj.module.split(".")[0] == package
            if own and obj not in found:
                found.add(obj)
                todo.append(obj)
    return found


def resource_usage(cubin: bytes) -> dict[str, int]:
    """Registers, spill (local memory) bytes and stack of a cubin, via the bundled cuobjdump."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run(
            [str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True, check=False
        ).stdout
    return {key: int(val) for key, val in re.findall(r"(REG|LOCAL|STACK):(\d+)", out)}


def compile_launch(launch: Launch, target: GPUTarget, limit_bytes: int) -> tuple[bool, str]:
    """Compile one specialisation: (whether it compiled within the shared memory, its report line)."""
    import triton
    from triton.compiler import ASTSource

    try:
        compiled = triton.compile(
            ASTSource(launch.kernel, launch.signature, constexprs=launch.constexprs, attrs=launch.attrs),
            target=target,
            options=launch.options.__dict__,
        )
    except Exception as exc:  # report every kernel, then fail
        reason = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        return False, f"FAIL {launch.name}: {reason}  {launch.describe()}"
    shared = compiled.metadata.shared
    usage = resource_usage(compiled.asm["cubin"])
    fits = shared <= limit_bytes
    status = "ok" if fits else f"FAIL (shared memory over {limit_bytes // 1024} KiB)"
    spilled = usage.get("STACK", 0) + usage.get("LOCAL", 0)
    return fits, (
        f"{status:4} {launch.name:28} shared {shared / 1024:6.1f} KiB  regs {usage.get('REG', -1):3}  "
        f"stack/spill {spilled:5} B/thread  {launch.describe()}"
    )


_TO_COMPILE: list[tuple[Launch, GPUTarget, int]] = []  # what forked workers of `compile_all` compile


def _compile_nth(i: int) -> tuple[bool, str]:
    return compile_launch(*_TO_COMPILE[i])


def compile_all(launches: list[Launch], target: GPUTarget, limit_bytes: int, jobs: int) -> int:
    """Compile every launch, `jobs` at a time (forked processes: Triton's compiler holds the GIL), print
    their report lines in launch order; returns the number of failures."""
    from concurrent.futures import ProcessPoolExecutor

    _TO_COMPILE[:] = [(launch, target, limit_bytes) for launch in launches]
    if jobs <= 1 or len(launches) <= 1:
        results = [_compile_nth(i) for i in range(len(launches))]
    else:
        context = multiprocessing.get_context("fork")  # the workers inherit the recorded launches
        with ProcessPoolExecutor(min(jobs, len(launches)), mp_context=context) as pool:
            results = list(pool.map(_compile_nth, range(len(launches))))
    for _ok, line in results:
        print(line)
    return sum(not ok for ok, _line in results)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability ×10 (80, 86, 89, 90, ...)")
    parser.add_argument("--head-dim", type=int, default=128, help="KDA head dims K = V")
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES), help="activations' dtype")
    parser.add_argument("--kernel", default="", help="compile only kernels whose name matches this regex")
    parser.add_argument(
        "--shared-memory-kib", type=int, default=None, help="shared memory per block (default: the arch's)"
    )
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                        help="kernels compiled at once (default: this machine's CPUs)")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET: interpreted kernels cannot be compiled", file=sys.stderr)
        return 2
    if args.arch not in SHARED_MEMORY_KIB and args.shared_memory_kib is None:
        print(f"no shared-memory size known for sm_{args.arch}; pass --shared-memory-kib", file=sys.stderr)
        return 2
    from triton.backends.compiler import GPUTarget

    target = GPUTarget("cuda", args.arch, 32)
    limit = 1024 * (args.shared_memory_kib or SHARED_MEMORY_KIB[args.arch])
    with record_launches(target) as launches:
        run_entry_points(args.head_dim, DTYPES[args.dtype])
    selected = [launch for launch in launches if re.search(args.kernel, launch.name)]
    failures = compile_all(selected, target, limit, args.jobs)

    kernels = {launch.kernel for launch in selected}
    if not args.kernel:  # every kernel under kernels/ must have been launched
        device_functions = set().union(*(called_jit_functions(kernel, "kernels") for kernel in kernels))
        for name, fn in sorted(jit_functions_under("kernels").items()):
            if fn not in kernels and fn not in device_functions:
                failures += 1
                print(f"FAIL {name}: never launched by run_entry_points (call its host entry point there)")
        inlined = ", ".join(sorted(f.__name__ for f in device_functions))
        print(f"device functions (compiled inside the kernels above): {inlined}")
    print(
        f"sm_{args.arch}: {len(selected)} specialisations of {len(kernels)} kernels checked, "
        f"{failures} failure{'s' if failures != 1 else ''}"
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
