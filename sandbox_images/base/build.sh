#!/usr/bin/env bash
# Builds the AgentENV base image offline, from Debian packages alone (no registry is needed):
# `debootstrap --variant=minbase` with python3, a non-root user `agent` (uid 1000) and /workspace,
# then `docker import`. Usage: build.sh TAG   (the caller chooses TAG, e.g. k3rl/base:<content-hash>)
set -euo pipefail
TAG=${1:?usage: build.sh IMAGE_TAG}
SUITE=${K3RL_BASE_SUITE:-bookworm}
MIRROR=${K3RL_DEBIAN_MIRROR:-http://deb.debian.org/debian}
PACKAGES=$(grep -v '^#' "$(dirname "$0")/packages.txt" | xargs | tr ' ' ',')
CACHE=${K3RL_CACHE_DIR:-/var/cache/k3rl}/debootstrap
mkdir -p "$CACHE"

root=$(mktemp -d /var/tmp/k3rl-rootfs.XXXXXX)
trap 'rm -rf "$root"' EXIT
debootstrap --variant=minbase --include="$PACKAGES" --cache-dir="$CACHE" "$SUITE" "$root" "$MIRROR" >&2

# The sandbox user and its work dir; the runtime mounts a volume at /workspace.
echo 'agent:x:1000:1000:AgentENV sandbox user:/workspace:/bin/bash' >>"$root/etc/passwd"
echo 'agent:x:1000:' >>"$root/etc/group"
echo 'agent:*:19000:0:99999:7:::' >>"$root/etc/shadow"
mkdir -p "$root/workspace"
chown 1000:1000 "$root/workspace"
# Keep the image small: no docs, man pages, locales or apt lists.
rm -rf "$root"/usr/share/{doc,man,info,locale}/* "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin
find "$root/usr/lib" -name __pycache__ -type d -prune -exec rm -rf {} +

tar -C "$root" --numeric-owner -c . | docker import \
  --change 'WORKDIR /workspace' \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8 PYTHONDONTWRITEBYTECODE=1' \
  --change 'CMD ["sleep", "infinity"]' \
  --change 'LABEL org.k3rl.image=base' \
  - "$TAG" >/dev/null
echo "$TAG"
