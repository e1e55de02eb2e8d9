#!/usr/bin/env bash
# Collect the wheels scripts/gpu_check.sh needs on a GPU machine that has only Python, torch and Triton:
# every package its steps import beyond those (`python bench/gpu_check.py distributions`: the versions of
# .venv, plus flash-linear-attention's fla-core), as binary wheels for that machine's Python on Linux
# x86-64, into one folder to carry there. The total must stay within the 64 MiB a device run carries.
#
#   bash scripts/gpu_wheels.sh [DIR]     # default DIR: outputs/gpu_wheels (gpu_check.sh's default)
#
# GPU_PYTHON_VERSION (default 3.12) is the target Python; PYTHON=... the interpreter that lists and
# downloads (default .venv/bin/python). A package published only as a source archive
# (antlr4-python3-runtime, for Hydra) is built here into a wheel, which must be pure Python.
set -euo pipefail
if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then
  sed -n '2,/^set /p' "$0" | sed '$d' | cut -c3-
  exit 0
fi
cd "$(dirname "$0")/.."
DIR=${1:-outputs/gpu_wheels}
PY=${PYTHON:-.venv/bin/python}
TARGET=${GPU_PYTHON_VERSION:-3.12}
LIMIT=$((64 * 1024 * 1024))
mkdir -p "$DIR"
"$PY" bench/gpu_check.py distributions >"$DIR/requirements.txt"
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
while read -r requirement; do
  if ! "$PY" -m pip download --quiet --no-deps --only-binary :all: --python-version "$TARGET" \
      --implementation cp "${PLATFORMS[@]}" -d "$DIR" "$requirement" 2>/dev/null; then
    built=$(mktemp -d)
    "$PY" -m pip wheel --quiet --no-deps -w "$built" "$requirement"
    for wheel in "$built"/*.whl; do
      case "$wheel" in
        *-py3-none-any.whl|*-py2.py3-none-any.whl) mv "$wheel" "$DIR/" ;;
        *) echo "$requirement: no binary wheel for Python $TARGET, and its source builds $(basename "$wheel")," \
             "not a pure-Python wheel" >&2; exit 1 ;;
      esac
    done
    rm -rf "$built"
  fi
done <"$DIR/requirements.txt"
total=$(cat "$DIR"/*.whl | wc -c)
echo "$(ls "$DIR"/*.whl | wc -l) wheels, $((total / 1024)) KiB in $DIR (requirements.txt beside them)"
if [ "$total" -gt "$LIMIT" ]; then
  echo "over the 64 MiB a device run carries" >&2
  exit 1
fi
