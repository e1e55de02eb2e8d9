"""Every Triton kernel compiles for an H100/H200 (sm_90) within its shared memory, without a GPU.

The interpreter used by the other tests accepts programs that Triton's compiler would reject (shapes,
layouts, shared-memory overruns), so this runs ``python -m kernels.compile_check`` — a real lowering to
PTX and ``ptxas`` for sm_90 at the benchmark's shapes (K = V = 128, bf16) — in a subprocess without
``TRITON_INTERPRET``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_every_kernel_compiles_for_sm90() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    result = subprocess.run(
        [sys.executable, "-m", "kernels.compile_check", "--arch", "90", "--head-dim", "128"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    report = result.stdout + result.stderr[-2000:]
    assert result.returncode == 0, report
    compiled = [line for line in result.stdout.splitlines() if line.startswith("ok")]
    assert len(compiled) == 14, report  # every kernel of kernels.compile_check.kernel_specs
