"""A learner checkpoint's manifest (``learner.json``): the writer's facts and every file of ``learner/``
with its size and SHA-256, read and checked before any file is loaded.

Plain files and hashes, no torch: the driver checks and writes manifests without importing the learner
(`rl.learner.checkpoint_files`); `rl.learner.shard_checkpoint` writes the files they list.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from rl.checkpoints import LEARNER_DIR, MANIFEST

OLD_STATE = "learner.pt"  # the layout before DCP (format 1); `rl.learner.checkpoint_convert` converts it


def sha256_of(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def manifest(facts: dict[str, Any], files: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The `MANIFEST`: the writer's ``facts`` and every file of ``learner/`` (name -> bytes, sha256)."""
    return facts | {"files": dict(sorted(files.items()))}


def file_facts(data: bytes) -> dict[str, Any]:
    return {"bytes": len(data), "sha256": sha256_of(data)}


def read_manifest(directory: Path) -> dict[str, Any]:
    """A checkpoint's `MANIFEST`; a clear error for a folder of the old layout or no checkpoint."""
    path = directory / MANIFEST
    if not path.is_file():
        if (directory / OLD_STATE).is_file():
            raise ValueError(f"{directory} is a checkpoint of the earlier layout ({OLD_STATE}); convert it "
                             f"with `python -m rl.learner.checkpoint_convert {directory}`")  # fmt: skip
        raise FileNotFoundError(f"{directory} is not a learner checkpoint (no {MANIFEST})")
    return json.loads(path.read_text())


def check_files(directory: Path, saved: dict[str, Any], checksums: bool) -> None:
    """Every file the manifest lists is in ``learner/`` with its size (and SHA-256 when ``checksums``)."""
    for name, facts in saved["files"].items():
        path = directory / LEARNER_DIR / name
        if not path.is_file():
            raise FileNotFoundError(f"{path}: missing from the checkpoint ({MANIFEST} lists it)")
        if path.stat().st_size != facts["bytes"]:
            raise ValueError(f"{path}: {path.stat().st_size} bytes, {MANIFEST} says {facts['bytes']}")
        if checksums and file_sha256(path) != facts["sha256"]:
            raise ValueError(f"{path}: its SHA-256 differs from the one in {MANIFEST}")

