"""A sandbox image as a microVM's root file system: the Docker image's files (`docker export` of a created,
never started container) in an ext4 file system image without a journal, attached read-only to every VM
of that image (writes go to an overlay in guest memory). Cached by the image's content id under
`<microvm_dir>/images/`, so each image is converted once; concurrent builders take a file lock.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from agentenv.backend import docker_client
from agentenv.backend.files import tree_bytes
from agentenv.errors import ImageError
from agentenv.locks import file_lock

MIB = 2**20


def image_id(tag: str) -> str:
    """The Docker image's content id (`sha256:...` without the prefix)."""
    return docker_client.api().inspect_image(tag)["Id"].split(":", 1)[-1]


def _export(tag: str, into: Path) -> None:
    """The image's files into `into` (owners, modes and links kept: run as root)."""
    api = docker_client.api()
    cid = api.create_container(tag, command=["true"], network_disabled=True)["Id"]
    try:
        tar = subprocess.Popen(["tar", "-C", str(into), "--numeric-owner", "-xpf", "-"],
                               stdin=subprocess.PIPE, stderr=subprocess.PIPE)
        assert tar.stdin is not None
        try:
            for chunk in api.export(cid):
                tar.stdin.write(chunk)
        finally:
            tar.stdin.close()
            err = tar.stderr.read() if tar.stderr else b""
            tar.wait()
        if tar.returncode != 0:
            raise ImageError(f"could not unpack image {tag}: {err.decode(errors='replace').strip()[-300:]}")
    finally:
        with contextlib.suppress(Exception):
            api.remove_container(cid, force=True)


def build(tag: str, microvm_dir: Path, mkfs_ext4: str) -> Path:
    """The ext4 image of Docker image `tag` (made once per image id)."""
    ident = image_id(tag)
    folder = microvm_dir / "images"
    path = folder / f"{ident[:24]}.ext4"
    if path.exists():
        return path
    folder.mkdir(parents=True, exist_ok=True)
    with file_lock(folder / f"{ident[:24]}.lock"):
        if path.exists():
            return path
        work = Path(tempfile.mkdtemp(prefix=".build-", dir=folder))
        try:
            tree = work / "tree"
            tree.mkdir()
            _export(tag, tree)
            for mount_point in ("proc", "sys", "dev", "run", "tmp", "workspace"):
                (tree / mount_point).mkdir(exist_ok=True)
            size = (int(tree_bytes(tree, 10**7) * 1.3) + 64 * MIB) // MIB * MIB
            out = work / "root.ext4"
            r = subprocess.run([mkfs_ext4, "-q", "-F", "-O", "^has_journal", "-L", "agentenv-root", "-d",
                                str(tree), str(out), f"{size // 1024}k"], capture_output=True, text=True)
            if r.returncode != 0:
                raise ImageError(f"mkfs.ext4 could not make the root file system of {tag}: "
                                 f"{(r.stderr or r.stdout).strip()[-300:]}")
            os.chmod(out, 0o644)
            os.replace(out, path)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return path
