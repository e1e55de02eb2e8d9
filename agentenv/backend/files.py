"""The one tree copy of AgentENV: a fork's files (work-dir volume, writable layer) are copied with it.

CRIU images hold memory, not files (docker/cli #4621), and CRIU refuses to restore a process whose open
files changed size, so a fork gets copies of the source's files taken while the source is stopped.
"""

from __future__ import annotations

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
