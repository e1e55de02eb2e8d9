"""Trees of a sandbox's files on the host: the one tree copy of AgentENV (a fork's files, work-dir volume
and writable layer, are copied with it) and the count of their bytes (`SandboxBackend.sample`).

CRIU images hold memory, not files (docker/cli #4621), and CRIU refuses to restore a process whose open
files changed size, so a fork gets copies of the source's files taken while the source is stopped.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from agentenv.errors import CheckpointError


def copy_tree(src: Path, dst: Path) -> None:
    """`cp -a src/. dst/`: owners, modes, xattrs (overlay whiteouts and opaque dirs), hard links; reflinks
    where the filesystem has them."""
    dst.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(["cp", "-a", "--reflink=auto", "--", f"{src}/.", f"{dst}/"], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        raise CheckpointError(f"copying {src} to {dst} failed: {proc.stderr.strip()[:300]}")


def tree_bytes(root: Path, max_files: int) -> int:
    """Bytes of the files below `root` (symlinks as links), counted over at most `max_files` files."""
    total = files = 0
    for dirpath, _dirs, names in os.walk(root):
        for n in names:
            try:
                total += os.lstat(os.path.join(dirpath, n)).st_size
            except OSError:
                continue
            files += 1
            if files >= max_files:
                return total
    return total
