#!/usr/bin/env bash
# The GPU checks of k3rl in one go, for a machine with a CUDA GPU. None of this has run on a GPU yet:
# the project was built and tested on CPU-only machines (docs/training.md, "GPU placement").
#
#   bash scripts/gpu_check.sh [OUT_DIR]      # default OUT_DIR: outputs/gpu_check/<UTC time>
#
# Steps (each one's output in OUT_DIR/<step>.log, its exit code and wall time in OUT_DIR/summary.txt;
# a failing step does not stop the next):
#   env       torch / CUDA / Triton / flash-linear-attention versions, the GPU
#   pytest    the tests that skip without a GPU (tests/rl/test_device.py: bf16 policy, Triton dispatch)
#   kernels   bench/kernels.py --quick --no-write: its CUDA part, Triton KDA forward+backward against the
#             PyTorch reference and fla's chunk_kda (numerics, then ms), MoE grouped GEMM vs the
#             per-expert loop
#   train     make train with trainer.device=cuda, a few iterations, routing replay off
#   replay    the same with algo.routing_replay=true
#   vllm      make train with rollout=vllm trainer.device=cuda, a few iterations
# then OUT_DIR/summary.txt gets rollout_logprob_gap and routing_mismatch per iteration of each run.
#
# The venv's torch must be a CUDA build: requirements.lock pins the CPU wheel (torch 2.13.0+cpu), so on
# a GPU machine install a CUDA torch (and triton; fla and vllm for those steps) into .venv after the
# bootstrap (`make train` re-syncs .venv only when requirements.lock changes). PYTHON=... picks another
# interpreter for the python steps; ITERATIONS (default 3) and STEP_TIMEOUT (s, default 900) size it.
set -uo pipefail
if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then
  sed -n '2,/^set /p' "$0" | sed '$d' | cut -c3-
  exit 0
fi
cd "$(dirname "$0")/.."
OUT=${1:-outputs/gpu_check/$(date -u +%Y%m%d-%H%M%S)}
OUT=$(mkdir -p "$OUT" && cd "$OUT" && pwd)
PY=${PYTHON:-.venv/bin/python}
ITERATIONS=${ITERATIONS:-3}
STEP_TIMEOUT=${STEP_TIMEOUT:-900}
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"

step() {  # step NAME COMMAND...: run it with a time limit, log to OUT/NAME.log, record rc and seconds
  local name=$1 started rc
  shift
  echo "== $name: $*"
  started=$(date +%s)
  timeout "$STEP_TIMEOUT" "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  echo "$name: rc=$rc, $(($(date +%s) - started)) s" | tee -a "$SUMMARY"
  return 0
}

step env "$PY" - <<'EOF'
import importlib, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(), "count", torch.cuda.device_count())
for name in ("triton", "fla", "vllm", "ray"):
    try:
        print(name, getattr(importlib.import_module(name), "__version__", "?"))
    except Exception as exc:  # absent or broken: the step that needs it says so
        print(name, "not importable:", exc)
EOF
if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "torch in $PY sees no CUDA GPU (see $OUT/env.log): install a CUDA torch build first" | tee -a "$SUMMARY"
  exit 1
fi

step pytest "$PY" -m pytest -q -rs tests/rl/test_device.py tests/rl/test_routing_replay.py tests/model/test_moe_routing_override.py
step kernels "$PY" bench/kernels.py --quick --no-write

RUN=(trainer.device=cuda "trainer.iterations=$ITERATIONS" trainer.stop_at_success=null trainer.time_limit_s=null
     trainer.progress_bar=false trainer.checkpoint_every=0)
step train make train ARGS="${RUN[*]} hydra.run.dir=$OUT/train"
step replay make train ARGS="${RUN[*]} algo.routing_replay=true hydra.run.dir=$OUT/replay"
step vllm make train ARGS="rollout=vllm ${RUN[*]} hydra.run.dir=$OUT/vllm"

"$PY" - "$OUT" >>"$SUMMARY" <<'EOF'
import json, sys
from pathlib import Path
for run in ("train", "replay", "vllm"):
    metrics = Path(sys.argv[1]) / run / "metrics.jsonl"
    if not metrics.is_file():
        print(f"{run}: no metrics.jsonl")
        continue
    for line in metrics.read_text().splitlines():
        r = json.loads(line)
        keys = ("rollout_logprob_gap", "routing_mismatch", "routing_mismatch_any", "success", "learner_s")
        print(run, r["iteration"], {k: r.get(k) for k in keys})
EOF
echo "outputs: $OUT"
cat "$SUMMARY"
