"""The checkpoint layout of every training stage (RL and SFT), written and read here only.

``<run>/checkpoints/iter_NNNNN/`` (``NNNNN``: the last finished iteration, or SFT optimizer step, from 0)
holds ``policy/`` (``save_pretrained``), ``learner/`` and ``learner.json`` (the learner's distributed
checkpoint and its manifest of sizes and checksums, `rl.learner.shard_checkpoint`) and ``trainer_state.json``,
written last: a folder without it is not a checkpoint. Async runs add their episodes in flight beside
them (``rl.rollout.inflight``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from agentenv.errors import ConfigError

CHECKPOINTS = "checkpoints"  # the run folder's subfolder of checkpoints
POLICY = "policy"  # the weights, as `model.checkpoint.save_pretrained` writes them
LEARNER_DIR = "learner"  # the learner's distributed checkpoint: one file per rank and .metadata
MANIFEST = "learner.json"  # world size, version, steps, and each file of learner/ with size and SHA-256
TRAINER_STATE = "trainer_state.json"  # `TrainerState`
_PREFIX = "iter_"


@dataclass
class TrainerState:
    """``trainer_state.json``: which stage wrote the checkpoint, its last finished iteration (SFT: step),
    and the metrics history up to it (a resumed run continues the history)."""

    stage: str  # "rl" or "sft"
    iteration: int
    history: list[dict[str, Any]] = field(default_factory=list)


def checkpoint_dir(run_dir: str | Path, iteration: int) -> Path:
    """The checkpoint folder of ``iteration`` in a run folder."""
    return Path(run_dir) / CHECKPOINTS / f"{_PREFIX}{iteration:05d}"


def is_checkpoint(path: Path) -> bool:
    return (path / TRAINER_STATE).is_file()


def latest_checkpoint(path: str | Path) -> Path:
    """The newest checkpoint in a run folder, or ``path`` itself if it is a checkpoint."""
    path = Path(path)
    if is_checkpoint(path):
        return path
    folder = path / CHECKPOINTS
    found = [c for c in folder.glob(f"{_PREFIX}*") if is_checkpoint(c)] if folder.is_dir() else []
    numbered = [c for c in found if c.name.removeprefix(_PREFIX).isdigit()]
    if not numbered:
        raise FileNotFoundError(
            f"trainer.resume={path}: no checkpoint found (expected {CHECKPOINTS}/{_PREFIX}*/)"
        )
    return max(numbered, key=lambda c: int(c.name.removeprefix(_PREFIX)))


def write_checkpoint(run_dir: str | Path, state: TrainerState, save_learner: Callable[[Path], None]) -> Path:
    """Checkpoint ``state.iteration`` of a run: ``save_learner(folder)`` writes ``policy/``, ``learner/``
    and ``learner.json``, then ``trainer_state.json`` completes it. Returns the folder."""
    path = checkpoint_dir(run_dir, state.iteration)
    save_learner(path)
    (path / TRAINER_STATE).write_text(json.dumps(asdict(state), default=float))
    return path


def read_checkpoint(path: str | Path, stage: str) -> tuple[Path, TrainerState]:
    """``trainer.resume=path`` (a run folder: its newest checkpoint; or a checkpoint) for a run of
    ``stage``: the checkpoint folder and its `TrainerState`. A checkpoint of the other stage is a
    `ConfigError` (start RL from SFT weights with ``model.init_from``), and so is a path without one."""
    try:
        folder = latest_checkpoint(path)
    except FileNotFoundError:
        raise ConfigError(
            f"trainer.resume: {path} holds no checkpoint (expected a checkpoint folder with {TRAINER_STATE}, "
            f"or a run folder with {CHECKPOINTS}/{_PREFIX}*/)"
        ) from None
    data = json.loads((folder / TRAINER_STATE).read_text())
    state = TrainerState(
        stage=data.get("stage", "rl"), iteration=int(data["iteration"]), history=list(data.get("history", []))
    )
    if state.stage != stage:
        hint = "start RL from its weights with model.init_from" if state.stage == "sft" else (
            "stage=sft resumes SFT runs only"
        )
        raise ConfigError(f"trainer.resume: {folder} is a checkpoint of stage={state.stage}; {hint}")
    return folder, state
