#!/usr/bin/env bash
# Makes a working `criu` the first one on PATH.
#
# The system criu is used where its own `criu check` passes. Elsewhere (Debian 12's criu 3.17 fails on
# recent kernels with "vdso: Unexpected rt vDSO area bounds") Debian 13's criu 4.1 and the libraries it
# needs are unpacked into a private prefix, without touching the system libc, and a wrapper at
# /usr/local/sbin/criu runs it through that prefix's dynamic loader. Idempotent: a second run that finds
# a working criu returns at once.
set -euo pipefail

PREFIX=${K3RL_CRIU_PREFIX:-/opt/k3rl/criu}
WRAPPER=/usr/local/sbin/criu
LOG=${K3RL_LOG_DIR:-/var/log/k3rl}/install_criu.log
mkdir -p "$(dirname "$LOG")"

criu_works() { "$1" check >/dev/null 2>&1; }

if [ -x "$WRAPPER" ] && criu_works "$WRAPPER"; then
  exit 0
fi
if [ -x /usr/sbin/criu ] && criu_works /usr/sbin/criu; then
  echo "criu: system $(/usr/sbin/criu --version | head -1) passes 'criu check'"
  exit 0
fi

echo "criu: system criu missing or failing 'criu check'; installing Debian 13's criu into $PREFIX"
SRC=/etc/apt/sources.list.d/k3rl-trixie.sources
PIN=/etc/apt/preferences.d/k3rl-trixie
if [ ! -f "$SRC" ]; then
  cat >"$SRC" <<'SOURCES'
Types: deb
URIs: http://deb.debian.org/debian
Suites: trixie
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SOURCES
fi
if [ ! -f "$PIN" ]; then
  # Pinned low: nothing from trixie is ever installed, only downloaded by name below.
  printf 'Package: *\nPin: release n=trixie\nPin-Priority: 1\n' >"$PIN"
fi
apt-get update -qq >>"$LOG" 2>&1

# criu 4.1 and the closure of its shared libraries, as trixie builds them.
PKGS="criu libcompel1 libc6 libbsd0 libmd0 libgnutls30t64 libnettle8t64 libhogweed6t64 libgmp10 libtasn1-6
libunistring5 libidn2-0 libp11-kit0 libffi8 libnet1 libnftables1 libmnl0 libnftnl11 libjansson4 libxtables12
libedit2 libtinfo6 libnl-3-200 libprotobuf-c1 libuuid1 libprotobuf32t64 libstdc++6 libgcc-s1 libzstd1 zlib1g
libcap2"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
chmod 755 "$work"
(cd "$work" && for p in $PKGS; do apt-get download -qq "$p/trixie" >>"$LOG" 2>&1; done)
rm -rf "$PREFIX.new" && mkdir -p "$PREFIX.new"
for deb in "$work"/*.deb; do dpkg -x "$deb" "$PREFIX.new"; done
rm -rf "$PREFIX" && mv "$PREFIX.new" "$PREFIX"

mkdir -p "$(dirname "$WRAPPER")"
cat >"$WRAPPER" <<WRAP
#!/bin/sh
# k3rl: Debian 13's criu run through its own loader and libraries (see scripts/install_criu.sh).
exec $PREFIX/usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2 --library-path $PREFIX/usr/lib/x86_64-linux-gnu:$PREFIX/lib/x86_64-linux-gnu $PREFIX/usr/sbin/criu "\$@"
WRAP
chmod 755 "$WRAPPER"
if ! criu_works "$WRAPPER"; then
  echo "criu: the private criu 4.1 also fails 'criu check':" >&2
  "$WRAPPER" check >&2 || true
  exit 1
fi
echo "criu: $("$WRAPPER" --version | head -1) installed in $PREFIX (wrapper $WRAPPER)"
