#!/usr/bin/env bash
# Installs `perf` (Debian/Ubuntu: linux-perf) when it is missing; bench/state_move_cpu.py samples every
# core with it. Idempotent and quick when perf is there. The tests do not need it.
set -euo pipefail
command -v perf >/dev/null && exit 0
if [ "$(id -u)" != 0 ]; then
  echo "perf is missing and installing it needs root: apt-get install linux-perf" >&2
  exit 1
fi
echo "perf: installing Debian's linux-perf"
apt-get update -qq >/dev/null 2>&1 || true
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq linux-perf >/dev/null ||
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq linux-tools-common linux-tools-generic >/dev/null
command -v perf >/dev/null || { echo "perf still not on PATH after installing linux-perf" >&2; exit 1; }
