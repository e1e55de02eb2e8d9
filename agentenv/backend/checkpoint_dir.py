"""Hand a checkpoint in the store to Docker's own `start --checkpoint` without copying its memory image.

Docker restores only from its own folder and copies it twice on the way; the folder built here holds copies
of CRIU's small metadata files and links to the page images, so a restore (and N forks of one checkpoint)
moves kilobytes instead of the whole memory image.

Design: docs/design/sandboxes.md#agentenv-backend-checkpoint-dir.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

from agentenv.backend.containerd import RESTORE_TOKEN_FILE
from agentenv.backend.store import RECORD_FILE

_ESCAPE = "../" * 64


def _escaping_symlink_target(target: Path) -> str:
    return _ESCAPE + str(target.resolve()).lstrip("/")


def is_page_image(name: str) -> bool:
    return name.startswith("pages-") and name.endswith(".img")


def materialize(images: Path, docker_checkpoint_dir: Path, link_pages: bool) -> str:
    """Fill Docker's checkpoint folder from the store's `images`; returns this restore's token."""
    if docker_checkpoint_dir.exists():
        shutil.rmtree(docker_checkpoint_dir)
    docker_checkpoint_dir.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    docker_checkpoint_dir.mkdir(mode=0o700)
    for src in images.iterdir():
        if src.name in (RECORD_FILE, RESTORE_TOKEN_FILE) or not src.is_file():
            continue
        dst = docker_checkpoint_dir / src.name
        if is_page_image(src.name) and link_pages:
            os.symlink(_escaping_symlink_target(src), dst)
        elif is_page_image(src.name):
            try:
                os.link(src, dst)  # same filesystem: no copy here (Docker's tar still reads it all)
            except OSError:
                shutil.copy2(src, dst)
        else:
            shutil.copy2(src, dst)
    token = uuid.uuid4().hex
    (docker_checkpoint_dir / RESTORE_TOKEN_FILE).write_text(token)
    return token
