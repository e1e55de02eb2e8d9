"""Every Triton kernel compiles for an H100/H200 (sm_90) within its shared memory, without a GPU.

The interpreter used by the other tests accepts programs that Triton's compiler would reject (shapes,
layouts, shared-memory overruns), so this runs ``scripts/compile_check.py`` — a real lowering to PTX
and ``ptxas`` for sm_90 at the benchmark's shapes (K = V = 128, bf16) — in a subprocess without
``TRITON_INTERPRET``. Which kernels must appear is found here independently of the script: every
``@triton.jit`` function in ``kernels/`` that no other ``@triton.jit`` function calls.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "compile_check.py"


def _is_triton_jit(decorator: ast.expr) -> bool:
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    return isinstance(target, ast.Attribute) and target.attr == "jit"


def launchable_kernels() -> set[str]:
    """Names of the ``@triton.jit`` functions under ``kernels/`` that are not called by another one."""
    jitted: dict[str, ast.FunctionDef] = {}
    for path in (ROOT / "kernels").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and any(map(_is_triton_jit, node.decorator_list)):
                assert node.name not in jitted, f"two @triton.jit functions named {node.name}"
                jitted[node.name] = node
    called = {
        call.func.id if isinstance(call.func, ast.Name) else call.func.attr
        for fn in jitted.values()
        for call in ast.walk(fn)
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Name | ast.Attribute)
    }
    return set(jitted) - called


def run_compile_check(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--arch", "90", "--head-dim", "128", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.slow
def test_every_kernel_compiles_for_sm90() -> None:
    expected = launchable_kernels()
    assert len(expected) >= 14, expected  # KDA chunk (9) and recurrent, SiTU-GLU (2), MoE (2)
    result = run_compile_check()
    report = result.stdout + result.stderr[-2000:]
    assert result.returncode == 0, report
    lines = result.stdout.splitlines()
    assert not [line for line in lines if line.startswith("FAIL")], report
    compiled = {line.split()[1] for line in lines if line.startswith("ok ")}
    assert compiled == expected, report


@pytest.mark.slow
def test_compile_check_fails_a_kernel_over_the_shared_memory_limit() -> None:
    """The state pass needs ~160 KiB of shared memory at K = V = 128: over a 64 KiB part it must fail."""
    result = run_compile_check("--kernel", "^_state_fwd_kernel$", "--shared-memory-kib", "64")
    assert result.returncode == 1, result.stdout + result.stderr[-2000:]
    assert result.stdout.startswith("FAIL (shared memory over 64 KiB) _state_fwd_kernel"), result.stdout
