"""The checkpoint layout (rl.checkpoints), shared by the RL trainer, the SFT stage and model.init_from."""

import json

import pytest

from rl.checkpoints import (
    TRAINER_STATE,
    TrainerState,
    checkpoint_dir,
    latest_checkpoint,
    read_checkpoint,
    write_checkpoint,
)
from rl.config import ConfigError


def save_learner(folder):
    (folder / "policy").mkdir(parents=True)
    (folder / "learner.pt").write_bytes(b"state")


def test_a_checkpoint_is_complete_once_its_trainer_state_is_written_and_the_newest_is_found(tmp_path):
    for iteration in (9, 99_999, 100_000):
        history = [{"iteration": iteration, "success": 0.5}]
        path = write_checkpoint(tmp_path, TrainerState("rl", iteration, history), save_learner)
        assert path == checkpoint_dir(tmp_path, iteration) == tmp_path / f"checkpoints/iter_{iteration:05d}"
        assert json.loads((path / TRAINER_STATE).read_text())["stage"] == "rl"
    save_learner(checkpoint_dir(tmp_path, 200_000))  # interrupted before its trainer state: not a checkpoint
    newest = latest_checkpoint(tmp_path)
    assert newest.name == "iter_100000"  # by number, not by name
    assert latest_checkpoint(newest) == newest
    folder, state = read_checkpoint(tmp_path, stage="rl")
    assert folder == newest and state.iteration == 100_000 and state.history[0]["success"] == 0.5


def test_resume_refuses_the_other_stage_and_a_folder_without_checkpoints(tmp_path):
    write_checkpoint(tmp_path / "sft", TrainerState(stage="sft", iteration=3), save_learner)
    with pytest.raises(ConfigError, match=r"^trainer\.resume: .* stage=sft; start RL from its weights"):
        read_checkpoint(tmp_path / "sft", stage="rl")
    assert read_checkpoint(tmp_path / "sft", stage="sft")[1].iteration == 3
    old_rl = checkpoint_dir(tmp_path / "old", 0)  # written before the stage was recorded: RL
    old_rl.mkdir(parents=True)
    (old_rl / TRAINER_STATE).write_text(json.dumps({"iteration": 0, "history": []}))
    with pytest.raises(ConfigError, match="stage=rl; stage=sft resumes SFT runs only"):
        read_checkpoint(tmp_path / "old", stage="sft")
    with pytest.raises(ConfigError, match=r"^trainer\.resume: .* holds no checkpoint"):
        read_checkpoint(tmp_path / "empty", stage="rl")
