#!/usr/bin/env bash
# The GPU check of k3rl, for a machine with a CUDA GPU, a Python with a CUDA build of torch and Triton,
# and nothing else: no .venv, no Ray, no Docker, no vLLM, no network. The other Python packages its steps
# import come as wheels collected beforehand by scripts/gpu_wheels.sh (they install into a temporary
# folder, never into that Python). It fits in 8 minutes (GPU_CHECK_BUDGET_S: 450 s for wheels and steps).
#
#   bash scripts/gpu_check.sh [--dry-run] [--wheels DIR] [OUT_DIR]
#       OUT_DIR   default outputs/gpu_check/<UTC time>
#       --wheels  the wheel folder (default $K3RL_WHEELS, else outputs/gpu_wheels; none there: skipped)
#       --dry-run the same steps on the CPU with tiny shapes, the Triton kernels in Triton's interpreter;
#                 the report goes to OUT_DIR/benchmarks.md, docs/ is left alone
#
# Steps (python bench/gpu_check.py STEP; each one's output in OUT_DIR/<step>.log and .json, its exit
# code and seconds in OUT_DIR/summary.txt; a failing step does not stop the next):
#   env      Python, torch, CUDA, Triton, fla versions and the GPU
#   learner  the K3 policy (k3_tiny, k3_small): rl.learner.learner.Learner steps in bf16 on CUDA, no Ray; k3_tiny's
#            first step against a CPU fp32 learner's
#   moe      the MoE grouped GEMM against the per-expert loop at K3's expert shapes, bf16, fwd and fwd+bwd
#   kernels  every Triton kernel (chunk_kda, the decode kernel, situ_glu, moe_experts) and fla's chunk_kda
#            against the PyTorch references, fp32 and bf16, forward and backward: errors and ms
#   report   the gpu-check section of docs/benchmarks.md (bench/bench_report.py's write_section), and
#            the same text in OUT_DIR/gpu-check.md (what a machine that is handed back leaves)
# Exit code: 0 when every step succeeded. PYTHON=... picks the interpreter (default: .venv/bin/python
# where it exists, else python3).
set -uo pipefail
DRY=0
WHEELS=${K3RL_WHEELS:-outputs/gpu_wheels}
OUT=
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) sed -n '2,/^set /p' "$0" | sed '$d' | cut -c3-; exit 0 ;;
    --dry-run) DRY=1 ;;
    --wheels) WHEELS=${2:?--wheels needs a folder}; shift ;;
    -*) echo "gpu_check.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) OUT=$1 ;;
  esac
  shift
done
cd "$(dirname "$0")/.."
ROOT=$(pwd)
OUT=${OUT:-outputs/gpu_check/$(date -u +%Y%m%d-%H%M%S)}
OUT=$(mkdir -p "$OUT" && cd "$OUT" && pwd)
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON; elif [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
BUDGET=${GPU_CHECK_BUDGET_S:-450}
STARTED=$(date +%s)
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
FAILED=0
DRY_ARG=()
if [ "$DRY" = 1 ]; then
  DRY_ARG=(--dry-run)
  export TRITON_INTERPRET=1  # before anything imports Triton: its kernels run on CPU tensors
fi

# the wheels: into a temporary folder (removed at the end), first on the path (pip's --target; unzipped
# where pip is missing); OUT/wheels.txt lists what it holds
if compgen -G "$WHEELS/*.whl" >/dev/null; then
  SITE=$(mktemp -d "${TMPDIR:-/tmp}/k3rl-gpu-check-site.XXXXXX")
  trap 'rm -rf "$SITE"' EXIT
  if "$PY" -m pip --version >/dev/null 2>&1; then
    "$PY" -m pip install --quiet --no-index --no-deps --target "$SITE" "$WHEELS"/*.whl >"$OUT/wheels.log" 2>&1
  else
    for wheel in "$WHEELS"/*.whl; do "$PY" -m zipfile -e "$wheel" "$SITE"; done >"$OUT/wheels.log" 2>&1
  fi
  rc=$?
  ls "$SITE" >"$OUT/wheels.txt"
  echo "wheels: rc=$rc, $(ls "$WHEELS"/*.whl | wc -l) from $WHEELS" | tee -a "$SUMMARY"
  [ "$rc" = 0 ] || FAILED=1
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
else
  echo "wheels: none in $WHEELS (the packages $PY has are used)" | tee -a "$SUMMARY"
fi

step() {  # step NAME LIMIT_S: bench/gpu_check.py NAME within LIMIT_S and what is left of the budget
  local name=$1 limit=$2 left started rc
  left=$((BUDGET - ($(date +%s) - STARTED)))
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -lt 10 ]; then
    echo "$name: skipped, the ${BUDGET} s budget is spent" | tee -a "$SUMMARY"
    FAILED=1
    return 1
  fi
  echo "== $name (at most $limit s)"
  started=$(date +%s)
  timeout "$limit" "$PY" "$ROOT/bench/gpu_check.py" "$name" --out "$OUT" "${DRY_ARG[@]}" >"$OUT/$name.log" 2>&1
  rc=$?
  echo "$name: rc=$rc, $(($(date +%s) - started)) s" | tee -a "$SUMMARY"
  [ "$rc" = 0 ] || { FAILED=1; tail -n 5 "$OUT/$name.log"; }
  return "$rc"
}

if ! step env 60 && [ "$DRY" = 0 ]; then  # no CUDA GPU (or no torch): nothing else can run
  echo "see $OUT/env.log; --dry-run runs the steps on the CPU" | tee -a "$SUMMARY"
  exit 1
fi
step learner 150
step moe 90
step kernels 240
"$PY" "$ROOT/bench/gpu_check.py" report --out "$OUT" "${DRY_ARG[@]}" >"$OUT/report.log" 2>&1 || FAILED=1
echo "report: $(tail -n 1 "$OUT/report.log")"
echo "total: $(($(date +%s) - STARTED)) s; outputs: $OUT"
cat "$SUMMARY"
exit "$FAILED"
