"""The driver's side of a Ray learner's checkpoint: every rank's files reach the driver's folder through
Ray's object store, checked, and come back the same way on resume. No rank reads or writes the
checkpoint folder, so nodes that share no file system with the driver save and resume whole.

Every file is checked for size and SHA-256 before ``learner.json`` is written, so a failed save is never
taken for a complete one.

Design: docs/design/training.md#rl-checkpoint-files.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray

from rl.checkpoints import LEARNER_DIR, MANIFEST
from rl.learner.manifest import check_files, file_facts, file_sha256, manifest, read_manifest


@dataclass
class RankFile:
    """One file a rank wrote in memory, in the object store."""

    name: str
    ref: ray.ObjectRef
    bytes: int
    sha256: str


def put_rank_files(files: dict[str, bytes]) -> list[RankFile]:
    """A rank's in-memory checkpoint files into the object store (their sizes and checksums beside)."""
    out = []
    for name, data in files.items():
        facts = file_facts(data)
        out.append(RankFile(name, ray.put(data), facts["bytes"], facts["sha256"]))
    return out


def write_rank_files(directory: Path, facts: dict[str, Any], ranks: list[list[RankFile]]) -> dict[str, Any]:
    """Write every rank's files into ``directory/learner/``, check each on disk, then the manifest (with
    the writer's ``facts``); returns the manifest. A stale ``learner/`` (of a save that failed) goes first."""
    folder = directory / LEARNER_DIR
    (directory / MANIFEST).unlink(missing_ok=True)
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    files: dict[str, dict[str, Any]] = {}
    for rank, rank_files in enumerate(ranks):
        for item in rank_files:
            if item.name in files:
                raise ValueError(f"checkpoint: two ranks wrote {item.name!r}")
            data = ray.get(item.ref)
            if len(data) != item.bytes or file_facts(data)["sha256"] != item.sha256:
                raise ValueError(f"checkpoint: rank {rank}'s {item.name!r} arrived changed "
                                 f"({len(data)} bytes, {item.bytes} sent)")  # fmt: skip
            _write_synced(folder / item.name, data)
            del data
            path = folder / item.name
            if path.stat().st_size != item.bytes or file_sha256(path) != item.sha256:
                raise ValueError(f"checkpoint: {path} does not read back as rank {rank} wrote it")
            files[item.name] = {"bytes": item.bytes, "sha256": item.sha256}
    saved = manifest(facts, files)
    _write_synced(directory / MANIFEST, json.dumps(saved, indent=1).encode())
    return saved


def _write_synced(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def put_checkpoint_files(directory: Path) -> tuple[dict[str, Any], dict[str, ray.ObjectRef]]:
    """A checkpoint's manifest and its ``learner/`` files in the object store, each checked (size and
    SHA-256) against the manifest first."""
    saved = read_manifest(directory)
    check_files(directory, saved, checksums=True)
    refs = {name: ray.put((directory / LEARNER_DIR / name).read_bytes()) for name in saved["files"]}
    return saved, refs
