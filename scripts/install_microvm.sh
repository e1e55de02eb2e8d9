#!/usr/bin/env bash
# What the `microvm` sandbox backend needs on the host: QEMU from Debian 12 (7.2; Debian 13's QEMU 10 would
# replace libc6 and much of the system, so it is never taken), busybox-static for the guest's initramfs, lz4
# to unpack the guest kernel, and Debian's cloud kernel (`linux-image-<version>-cloud-amd64`, downloaded, not
# installed) unpacked into $PREFIX/kernel/<version>: `vmlinux` (the uncompressed ELF that QEMU boots directly
# through PVH) and its modules. With the project's Python given as $1 it then builds the initramfs and the
# root file system image of the base sandbox image, both cached by content hash (agentenv/backend/microvm/).
# Idempotent: a second run on a ready host returns at once.
set -euo pipefail

PREFIX=${K3RL_MICROVM_PREFIX:-/opt/k3rl/microvm}
LOG=${K3RL_LOG_DIR:-/var/log/k3rl}/install_microvm.log
PY=${1:-}
mkdir -p "$(dirname "$LOG")"

missing=()
command -v qemu-system-x86_64 >/dev/null || missing+=(qemu-system-x86)
[ -x /bin/busybox ] && /bin/busybox --list 2>/dev/null | grep -qx switch_root || missing+=(busybox-static)
command -v lz4 >/dev/null || missing+=(lz4)
command -v mkfs.ext4 >/dev/null || missing+=(e2fsprogs)
if [ ${#missing[@]} -gt 0 ]; then
  echo "microvm: installing Debian packages: ${missing[*]}"
  apt-get update -qq >>"$LOG" 2>&1
  # bookworm's own versions (the default release); --no-install-recommends keeps out GUI and audio stacks
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >>"$LOG" 2>&1
fi
qemu_major=$(qemu-system-x86_64 --version | sed -n 's/^QEMU emulator version \([0-9]*\)\..*/\1/p')
if [ "${qemu_major:-0}" -lt 7 ]; then
  echo "microvm: QEMU >= 7.2 is needed (microvm machine, x-ignore-shared), found: $(qemu-system-x86_64 --version | head -1)" >&2
  exit 1
fi

# The guest kernel: the version the `linux-image-cloud-amd64` meta package of the default release names.
have_kernel() { ls "$PREFIX"/kernel/*/vmlinux >/dev/null 2>&1; }
if ! have_kernel; then
  pkg=$(apt-cache depends linux-image-cloud-amd64 2>>"$LOG" | sed -n 's/^ *Depends: \(linux-image-[0-9].*-cloud-amd64\)$/\1/p' | head -1)
  if [ -z "$pkg" ]; then
    apt-get update -qq >>"$LOG" 2>&1
    pkg=$(apt-cache depends linux-image-cloud-amd64 | sed -n 's/^ *Depends: \(linux-image-[0-9].*-cloud-amd64\)$/\1/p' | head -1)
  fi
  [ -n "$pkg" ] || { echo "microvm: no linux-image-cloud-amd64 in the apt sources" >&2; exit 1; }
  ver=${pkg#linux-image-}
  echo "microvm: unpacking the guest kernel $pkg into $PREFIX/kernel/$ver"
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  chmod 755 "$work"
  (cd "$work" && apt-get download -qq "$pkg" >>"$LOG" 2>&1)
  dpkg-deb -x "$work"/"$pkg"_*.deb "$work/x"
  dest="$work/kernel/$ver"
  mkdir -p "$dest"
  # vmlinuz is a bzImage whose payload is one lz4 stream (the cloud kernel's CONFIG_KERNEL_LZ4): its frame
  # magic 02 21 4c 18 marks where it starts; what follows the stream is ignored by lz4 (a warning).
  offset=$(grep -obUaP '\x02\x21\x4c\x18' "$work/x/boot/vmlinuz-$ver" | head -1 | cut -d: -f1)
  [ -n "$offset" ] || { echo "microvm: $pkg's vmlinuz holds no lz4 stream" >&2; exit 1; }
  tail -c +"$((offset + 1))" "$work/x/boot/vmlinuz-$ver" | lz4 -dc >"$dest/vmlinux" 2>>"$LOG" || true
  [ "$(head -c 4 "$dest/vmlinux" | od -An -c | tr -d ' ')" = '177ELF' ] || {
    echo "microvm: could not unpack an ELF vmlinux from $pkg" >&2; exit 1; }
  cp "$work/x/boot/config-$ver" "$dest/config"
  mv "$work/x/lib/modules/$ver" "$dest/modules"
  mkdir -p "$PREFIX/kernel"
  rm -rf "$PREFIX/kernel/$ver"
  mv "$dest" "$PREFIX/kernel/$ver"
fi

# The initramfs and the base image's root file system (cached; nothing to do when up to date).
if [ -n "$PY" ]; then
  "$PY" -m agentenv.backend.microvm.build --quiet
fi
