"""Hand a checkpoint in the store to Docker's own `start --checkpoint` without copying its memory image.

Docker 20.10 restores only from `<docker root>/containers/<id>/checkpoints/<name>/`, and on every
restore it tars that folder into containerd's content store, which unpacks it again into a fresh
`<containerd tmp>/ctrd-checkpoint*` folder for runc (moby #40644: two full copies plus a SHA-256 of the
whole memory image; containerd then never deletes the unpacked copy, containerd #10166). Here the
folder Docker sees holds real copies of CRIU's small metadata files and *symlinks* for the page images
(`pages-*.img`, i.e. nearly all bytes), so those copies move kilobytes.

The symlinks are relative and climb far past `/` ("../" x 64, then the absolute path): CRIU opens the
page images after it has entered the container's mount namespace, where an absolute target would resolve
inside the container's root; a relative target resolves from the folder CRIU opened beforehand, on the
host, and extra ".." stop at the host's root. If this ever fails on another kernel, the restore reports a
CRIU error, nothing is lost, and the caller retries with `link_pages=False` (real files, Docker's cost).

Each folder carries a token file so that the unpacked copy containerd leaves behind can be found and
removed after the restore (and by `gc` if a process died in between).
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from pathlib import Path

from agentenv.fastpath.store import RECORD_FILE

TOKEN_FILE = "k3rl-restore-token"
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
        if src.name == RECORD_FILE or not src.is_file():
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
    (docker_checkpoint_dir / TOKEN_FILE).write_text(token)
    return token


def remove_unpacked_copies(containerd_tmp: Path, tokens: set[str], token_file_name: str = TOKEN_FILE) -> int:
    """Delete containerd's unpacked copies of the restores with these tokens; returns how many.

    `token_file_name` names the file in the checkpoint folder whose content identifies the restore.
    """
    removed = 0
    for token_file in containerd_tmp.glob(f"ctrd-checkpoint*/{token_file_name}"):
        try:
            if token_file.read_text().strip() in tokens:
                shutil.rmtree(token_file.parent, ignore_errors=True)
                removed += 1
        except OSError:
            continue
    return removed


def stale_unpacked_copies(
    containerd_tmp: Path, older_than_s: float, token_file_name: str = TOKEN_FILE
) -> list[Path]:
    """Unpacked copies of our restores older than `older_than_s` (their restore is long over)."""
    now = time.time()
    out = []
    for token_file in containerd_tmp.glob(f"ctrd-checkpoint*/{token_file_name}"):
        try:
            if now - token_file.stat().st_mtime > older_than_s:
                out.append(token_file.parent)
        except OSError:
            continue
    return out
