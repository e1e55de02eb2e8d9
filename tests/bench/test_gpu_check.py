"""scripts/gpu_check.sh --dry-run: every step of the GPU check (bench/gpu_check.py) runs on the CPU with
tiny shapes, the Triton kernels in Triton's interpreter, installs the wheels of its wheel folder first,
and renders its report into a copy of docs/benchmarks.md, leaving docs/ alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
KERNELS = {"chunk_kda", "fused_recurrent_kda (decode)", "situ_glu", "moe_experts (grouped GEMM)"}


def probe_wheel(folder: Path) -> Path:
    """A pure-Python wheel of one module, ``k3rl_probe``, as `scripts/gpu_wheels.sh` would collect one."""
    wheel = folder / "k3rl_probe-1.0-py3-none-any.whl"
    info = "k3rl_probe-1.0.dist-info"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("k3rl_probe.py", "ANSWER = 42\n")
        z.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: k3rl-probe\nVersion: 1.0\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                    "Tag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", f"k3rl_probe.py,,\n{info}/METADATA,,\n{info}/WHEEL,,\n{info}/RECORD,,\n")
    return wheel


def section(path: Path) -> str:
    text = path.read_text()
    return text[text.index("<!-- bench:gpu-check:start -->") : text.index("<!-- bench:gpu-check:end -->")]


def test_the_dry_run_runs_every_step_on_the_cpu(tmp_path):
    wheels, out = tmp_path / "wheels", tmp_path / "out"
    wheels.mkdir()
    probe_wheel(wheels)
    docs_before = section(ROOT / "docs" / "benchmarks.md")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "K3_KERNELS", "PYTHONPATH")}
    env["PYTHON"] = sys.executable
    command = ["bash", str(SCRIPT), "--dry-run", "--wheels", str(wheels), str(out)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = (out / "summary.txt").read_text()
    assert "wheels: rc=0, 1 from" in summary and "k3rl_probe.py" in (out / "wheels.txt").read_text().split()
    for step in ("env", "learner", "moe", "kernels"):
        assert f"{step}: rc=0," in summary, summary
    env_seen = json.loads((out / "env.json").read_text())
    assert env_seen["gpu"] == "none" and env_seen["python"]
    (learner,) = json.loads((out / "learner.json").read_text())["rows"]
    assert learner["model"] == "k3_tiny" and learner["ok"] and learner["device"] == "cpu"
    assert learner["adam_state_on_device"] and learner["fp32_master_on_device"]
    assert not learner["triton_kernels"]  # the CPU takes the PyTorch kernels
    kernels = json.loads((out / "kernels.json").read_text())
    assert kernels["interpreter"] is True
    assert {(r["kernel"], r["dtype"]) for r in kernels["rows"]} >= {
        (k, d) for k in KERNELS for d in ("float32", "bfloat16")
    }
    fp32 = [r for r in kernels["rows"] if r["dtype"] == "float32"]
    assert all(r["ok"] and r["ours_fwd_ms"] > 0 for r in fp32)  # the interpreter computes fp32 exactly
    moe = json.loads((out / "moe.json").read_text())["lines"]
    assert any(line.startswith("| 32 | fwd+bwd |") for line in moe)
    report = section(out / "benchmarks.md")
    assert (out / "gpu-check.md").read_text().strip() in report
    assert "`bash scripts/gpu_check.sh --dry-run`" in report and "| k3_tiny |" in report
    assert "| chunk_kda | B=1 T=64 H=1 D=16 | float32 |" in report and "grouped GEMM ms" in report
    assert section(ROOT / "docs" / "benchmarks.md") == docs_before  # docs/ untouched


def test_help_and_a_bad_option():
    helped = subprocess.run(["bash", str(SCRIPT), "--help"], capture_output=True, text=True)
    assert helped.returncode == 0 and "--dry-run" in helped.stdout
    bad = subprocess.run(["bash", str(SCRIPT), "--bogus"], capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown option --bogus" in bad.stderr


def test_the_wheel_list_is_what_the_steps_import_beyond_torch():
    """What scripts/gpu_wheels.sh collects: imported with Ray and vLLM made unimportable (the GPU machine
    has neither), less torch, Triton and what torch requires, plus flash-linear-attention."""
    listed = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "distributions"],
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert listed.returncode == 0, listed.stderr[-2000:]
    names = {line.split("==")[0].lower() for line in listed.stdout.split()}
    assert all("==" in line for line in listed.stdout.split())
    assert {"numpy", "hydra-core", "omegaconf", "pyyaml", "gymnasium", "fla-core", "einops"} <= names
    assert not names & {"torch", "triton", "typing-extensions", "sympy", "ray", "vllm", "k3rl"}
