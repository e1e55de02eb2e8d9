#!/usr/bin/env bash
# Builds the AgentENV base image offline, from Debian packages alone (no registry is needed):
# `debootstrap --variant=minbase` with python3, the sandbox user `user` (uid 1000, or uid 0 without
# capabilities), its home /home/user = /workspace and a sudo that grants nothing,
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

# The sandbox user is `user`, as in E2B's sandboxes, with its home /home/user, which is the work dir
# (/home/user -> /workspace: the runtime mounts a volume at /workspace). uid 1000 where the host's CRIU
# can checkpoint another uid; elsewhere sandboxes run as uid 0 without any capability, so the second
# `user` line names uid 0 too (listed before root: `whoami`, `ls -l` and file owners show `user`).
# `agent` is the former name of uid 1000, kept for scripts that use it.
sed -i '1i user:x:1000:1000:sandbox user:/home/user:/bin/bash\nuser:x:0:0:sandbox user (uid 0 without capabilities):/home/user:/bin/bash' "$root/etc/passwd"
sed -i '1i user:x:1000:\nuser:x:0:' "$root/etc/group"
echo 'user:*:19000:0:99999:7:::' >>"$root/etc/shadow"
echo 'agent:x:1000:1000:AgentENV sandbox user:/home/user:/bin/bash' >>"$root/etc/passwd"
echo 'agent:x:1000:' >>"$root/etc/group"
echo 'agent:*:19000:0:99999:7:::' >>"$root/etc/shadow"
mkdir -p "$root/workspace" "$root/home"
chown 1000:1000 "$root/workspace"
ln -s /workspace "$root/home/user"
# sudo runs the command as the caller, granting nothing: sandboxes have no capability to give
# (no_new_privileges), and scripts written for E2B's images call it.
install -m 0755 "$(dirname "$0")/sudo" "$root/usr/bin/sudo"
# Keep the image small: no docs, man pages, locales or apt lists.
rm -rf "$root"/usr/share/{doc,man,info,locale}/* "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin
find "$root/usr/lib" -name __pycache__ -type d -prune -exec rm -rf {} +
# Python's standard library compiled once here: sandboxes run with PYTHONDONTWRITEBYTECODE=1 (nothing
# written into a checkpointed work dir), so without these every python3 start in a sandbox compiled
# each module it imports again (an agent program's json, argparse and urllib.request: 0.2 s a start).
chroot "$root" sh -c 'for lib in /usr/lib/python3.[0-9]*; do python3 -m compileall -q "$lib"; done' >&2

tar -C "$root" --numeric-owner -c . | docker import \
  --change 'WORKDIR /workspace' \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8 PYTHONDONTWRITEBYTECODE=1' \
  --change 'CMD ["sleep", "infinity"]' \
  --change 'LABEL org.k3rl.image=base' \
  - "$TAG" >/dev/null
echo "$TAG"
