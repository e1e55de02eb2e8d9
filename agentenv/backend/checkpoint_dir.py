"""Hand a checkpoint in the store to Docker's own `start --checkpoint` without copying its memory image.

Docker 20.10 restores only from `<docker root>/containers/<id>/checkpoints/<name>/` (`--checkpoint-dir`
is refused on start), and on every restore it tars that folder into containerd's content store, which
unpacks it again into a fresh `<containerd tmp>/ctrd-checkpoint*` folder for runc (moby #40644: two full
copies plus a SHA-256 of the whole memory image). Here the folder Docker sees holds real copies of CRIU's
small metadata files and *symlinks* for the page images (`pages-*.img`, nearly all bytes), so those
copies move kilobytes, and N forks of one checkpoint all read the same page images.

The symlinks are relative and climb far past `/` ("../" x 64, then the absolute path): CRIU opens the
page images after it has entered the container's mount namespace, where an absolute target would resolve
inside the container's root; a relative target resolves from the folder CRIU opened beforehand, on the
host, and extra ".." stop at the host's root. With `link_pages=False` the page images are hard links
(no copy on disk; Docker's tar and containerd's untar then move every byte).

Each folder carries a restore token (containerd.RESTORE_TOKEN_FILE) so that the unpacked copy containerd
leaves behind can be found and removed after the restore.
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
