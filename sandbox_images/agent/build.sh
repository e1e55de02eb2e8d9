#!/usr/bin/env bash
# Builds the `agent` image: the base image plus the wheels of requirements.txt, installed by Dockerfile.
# The wheels are downloaded here, on the host (its pip, index and certificates: the image has no CA
# certificates to reach an index over TLS), for CPython 3.11 on Linux x86-64 as the base's Debian
# bookworm runs it, and kept in a cache folder so that a rebuild needs no network.
# Usage: build.sh TAG BASE_TAG   (AgentENV passes both: Dockerfile's `ARG BASE=base` names the parent)
set -euo pipefail
TAG=${1:?usage: build.sh IMAGE_TAG BASE_IMAGE_TAG}
BASE=${2:?usage: build.sh IMAGE_TAG BASE_IMAGE_TAG}
PIP=pip==26.3  # the installer run inside the image, from its wheel
here=$(cd "$(dirname "$0")" && pwd)
CACHE=${K3RL_CACHE_DIR:-/var/cache/k3rl}/wheels
mkdir -p "$CACHE"

# A pip to download with: python3's own, else one in a virtualenv in the cache.
PYTHON=python3
if ! "$PYTHON" -m pip --version >/dev/null 2>&1; then
  [ -x "$CACHE/venv/bin/python" ] || python3 -m venv "$CACHE/venv" >&2
  PYTHON=$CACHE/venv/bin/python
fi

ctx=$(mktemp -d /var/tmp/k3rl-agent.XXXXXX)
trap 'rm -rf "$ctx"' EXIT
requirements=$(mktemp "$ctx/req.XXXXXX")
{ grep -v '^#' "$here/requirements.txt"; echo "$PIP"; } >"$requirements"
download() {  # download DEST [OPTION...]: the wheels of $requirements for the image's Python into DEST
  "$PYTHON" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.11 --implementation cp --abi cp311 --abi abi3 --abi none \
    --platform manylinux_2_36_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any -r "$requirements" -d "$1" "${@:2}" >&2
}
# From the cache when it holds them all; else from the index into the cache first.
if ! download "$ctx/wheels" --no-index --find-links "$CACHE" 2>/dev/null; then
  download "$CACHE"
  download "$ctx/wheels" --no-index --find-links "$CACHE"
fi
rm "$requirements"
mv "$ctx"/wheels/pip-*.whl "$ctx/wheels/pip.whl"
cp "$here/Dockerfile" "$here/requirements.txt" "$ctx/"
docker build --quiet --build-arg "BASE=$BASE" --label org.k3rl.image=agent -t "$TAG" "$ctx" >/dev/null
echo "$TAG"
