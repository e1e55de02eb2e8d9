"""The learner's checkpoints: ``torch.distributed.checkpoint`` (DCP) through the state-dict API, so a
checkpoint written at one world size loads at any other (N -> 1, 1 -> N, 2 -> 4, with or without expert
parallelism: DCP reshards each DTensor).

A folder holds ``learner/`` (DCP's files), ``learner.json`` (the verified manifest) and ``policy/`` (full
weights for ``model.init_from`` and vLLM); written locally or through the driver (`checkpoint_files`).

Design: docs/design/training.md#rl-shard-checkpoint.
"""

from __future__ import annotations

import io
import json
import random
import shutil
import warnings
from collections.abc import Callable, Generator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystemBase, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from rl.checkpoints import LEARNER_DIR, MANIFEST
from rl.learner.manifest import check_files, file_sha256, manifest, read_manifest

FORMAT = 2  # 1: learner.pt (and shards/rank*.pt), before DCP; `rl.learner.checkpoint_convert` converts them


def rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}


def set_rng_state(rng: dict[str, Any]) -> None:
    torch.set_rng_state(rng["torch"])
    np.random.set_state(rng["numpy"])
    random.setstate(rng["python"])


def _pickled(value: Any) -> io.BytesIO:
    """A value DCP stores whole (a dict would be flattened into entries): `_unpickled` of what a load
    returns for it gives ``value`` back."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    buffer.seek(0)
    return buffer


def _unpickled(buffer: io.BytesIO) -> Any:
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


# ---------------------------------------------------------------------------------------------- state


def learner_state(learner: Any) -> dict[str, Any]:
    """The DCP state dict of a `rl.learner.learner.Learner` rank (its shards; see the module docstring)."""
    model, optimizer = get_state_dict(learner.trained, learner.optimizer)
    state = {"model": model, "optimizer": optimizer,
             "trainer": _pickled({"scheduler": learner.scheduler.state_dict(), "version": learner.version,
                                  "steps": learner.steps}),
             f"rng.{dist.get_rank()}": _pickled(rng_state())}  # fmt: skip
    if learner.reference is not None:
        state["reference"] = get_model_state_dict(learner.reference)
    return state


def apply_state(learner: Any, state: dict[str, Any], saved_world: int) -> None:
    """Put a loaded `learner_state` into the learner (every rank; collective)."""
    set_state_dict(learner.trained, learner.optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"])  # fmt: skip
    if learner.reference is not None and "reference" in state:
        set_model_state_dict(learner.reference, state["reference"])
    trainer = _unpickled(state["trainer"])
    learner.scheduler.load_state_dict(trainer["scheduler"])
    learner.version, learner.steps = int(trainer["version"]), int(trainer["steps"])
    set_rng_state(_unpickled(state[rng_key(saved_world)]))


def rng_key(saved_world: int) -> str:
    """The RNG states this rank resumes with: its own, or rank 0's when the writer had fewer ranks."""
    rank = dist.get_rank()
    return f"rng.{rank if rank < saved_world else 0}"


def load_template(learner: Any, saved: dict[str, Any]) -> dict[str, Any]:
    """What this rank asks DCP for: its own shards' places, the writer's scalar state (``saved``: the
    manifest), and no reference when the checkpoint has none."""
    state = learner_state(learner)
    state.pop(f"rng.{dist.get_rank()}")
    state[rng_key(saved["world_size"])] = io.BytesIO()
    state["trainer"] = io.BytesIO()
    if not saved.get("reference", False):
        state.pop("reference", None)
    return state


# ---------------------------------------------------------------------------------------------- memory


class _Kept(io.BytesIO):
    """A file in memory whose content goes to ``keep`` when it is closed (DCP closes what it writes)."""

    def __init__(self, keep: Callable[[bytes], None]) -> None:
        super().__init__()
        self.keep = keep

    def close(self) -> None:
        if not self.closed:
            self.keep(self.getvalue())
        super().close()


class MemoryFiles(FileSystemBase):
    """DCP's file system in memory: files written land in ``files`` (name -> bytes); files read come from
    ``fetch(name)`` (e.g. a Ray object per file). One flat folder."""

    def __init__(self, fetch: Callable[[str], bytes] | None = None) -> None:
        self.files: dict[str, bytes] = {}
        self.fetch = fetch

    @contextmanager
    def create_stream(self, path, mode: str) -> Generator[io.IOBase, None, None]:
        name = Path(path).name
        if "w" in mode:
            stream = _Kept(lambda data: self.files.__setitem__(name, data))
            yield stream
            stream.close()
        else:
            if name not in self.files:
                if self.fetch is None:
                    raise FileNotFoundError(f"{name}: not in this in-memory checkpoint")
                self.files[name] = self.fetch(name)
            yield io.BytesIO(self.files[name])

    def concat_path(self, path, suffix: str):
        return Path(path) / suffix

    def rename(self, path, new_path) -> None:
        self.files[Path(new_path).name] = self.files.pop(Path(path).name)

    def init_path(self, path):
        return Path(path)

    def mkdir(self, path) -> None:
        pass

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return True

    def exists(self, path) -> bool:
        return Path(path).name in self.files

    def rm_file(self, path) -> None:
        self.files.pop(Path(path).name, None)


class MemoryWriter(FileSystemWriter):
    """DCP's file writer (one file per rank) into `MemoryFiles`: after ``dcp.save``, ``files`` holds this
    rank's ``__R_0.distcp`` (and on rank 0 ``.metadata``)."""

    def __init__(self) -> None:
        super().__init__(LEARNER_DIR, single_file_per_rank=True, sync_files=False, overwrite=True)
        self.fs = MemoryFiles()

    @property
    def files(self) -> dict[str, bytes]:
        return self.fs.files


class MemoryReader(FileSystemReader):
    """DCP's file reader over `MemoryFiles`: each file is fetched once, when first needed."""

    def __init__(self, fetch: Callable[[str], bytes]) -> None:
        super().__init__(LEARNER_DIR)
        self.fs = MemoryFiles(fetch)


# ---------------------------------------------------------------------------------------------- save / load


def save_to_memory(learner: Any) -> dict[str, bytes]:
    """Every rank: DCP-save the learner's state into memory; this rank's files (name -> bytes)."""
    writer = MemoryWriter()
    dcp.save(learner_state(learner), storage_writer=writer)
    return dict(writer.files)


def learner_facts(learner: Any) -> dict[str, Any]:
    """What a `MANIFEST` says of the learner that wrote the checkpoint."""
    return {"format": FORMAT, "world_size": learner.group.world_size,
            "expert_parallel": learner.group.expert_parallel, "version": learner.version,
            "steps": learner.steps, "reference": learner.reference is not None}  # fmt: skip


def save_local(learner: Any, directory: Path) -> None:
    """Every rank, ranks sharing ``directory``: DCP's file writer into a fresh ``learner/``, then rank 0
    writes the manifest."""
    folder = directory / LEARNER_DIR
    if dist.get_rank() == 0:  # no file of an earlier save (of another world size) may stay listed
        (directory / MANIFEST).unlink(missing_ok=True)
        shutil.rmtree(folder, ignore_errors=True)
    dist.barrier()
    dcp.save(learner_state(learner), storage_writer=FileSystemWriter(folder, overwrite=True))
    if dist.get_rank() == 0:
        files = {p.name: {"bytes": p.stat().st_size, "sha256": file_sha256(p)}
                 for p in sorted(folder.iterdir())}  # fmt: skip
        (directory / MANIFEST).write_text(json.dumps(manifest(learner_facts(learner), files), indent=1))
    dist.barrier()


def load_from(learner: Any, saved: dict[str, Any], reader: FileSystemReader) -> None:
    """Every rank: load a checkpoint whose manifest is ``saved`` through ``reader`` (collective)."""
    state = load_template(learner, saved)
    dcp.load(state, storage_reader=reader)
    apply_state(learner, state, saved["world_size"])


def load_local(learner: Any, directory: Path) -> None:
    """Every rank, ranks sharing ``directory``: the files checked (sizes), then DCP's file reader."""
    saved = read_manifest(directory)
    check_files(directory, saved, checksums=False)
    load_from(learner, saved, FileSystemReader(directory / LEARNER_DIR))


def read_learner_state(directory: str | Path) -> dict[str, Any]:
    """A checkpoint's learner state in one process, full tensors (no process group needed): ``model``
    (``policy.*`` and ``value_head.*``) and ``reference`` (if any) under checkpoint names, ``optimizer``
    (AdamW's state by parameter name), ``trainer`` (schedule, version, steps). For tests and inspection."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    from rl.learner.sharding import per_expert_names

    with warnings.catch_warnings():  # "torch.distributed ... uninitialized": one process is the point
        warnings.simplefilter("ignore", UserWarning)
        loaded = _load_state_dict_from_keys(checkpoint_id=str(Path(directory) / LEARNER_DIR))
    out: dict[str, Any] = {"model": loaded["model"], "optimizer": loaded["optimizer"]["state"],
                           "trainer": _unpickled(loaded["trainer"])}  # fmt: skip
    if "reference" in loaded:
        out["reference"] = loaded["reference"]
    for part in ("model", "reference"):
        if part in out:
            per_expert_names(out[part])
    return out
