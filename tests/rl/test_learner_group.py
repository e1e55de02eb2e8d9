"""A two-rank learner (`rl.driver.learner_group.LearnerGroup` on local Ray, gloo between its ranks) whose
rank 1
is killed. In a step: the error names rank 1, the rank whose actor died, and not rank 0, whose collective
failed first. The order is made the one of a lost node: rank 1's process is killed while the raylet that would
report its death is paused, so rank 0's "connection reset" reaches the driver before Ray says that rank
1 died (on a real cluster Ray declares a node dead only after its health checks miss, seconds later).
In a save: the checkpoint is not completed, and the previous one resumes bit-exactly."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import ray
import torch
from rl_testutil import compose
from test_learner_ranks import episodes

from rl.checkpoints import (
    LEARNER_DIR,
    MANIFEST,
    TrainerState,
    checkpoint_dir,
    is_checkpoint,
    latest_checkpoint,
    write_checkpoint,
)
from rl.driver.learner_group import LearnerGroup
from rl.errors import LearnerRankLost

pytestmark = pytest.mark.usefixtures("local_ray")

PAUSE_S = 3.0  # how long the raylet stays paused (Ray's health checks declare a node dead after ~30 s)


def pids(actor) -> tuple[int, int]:
    """(the actor's process, its parent: the raylet that started it)."""
    return ray.get(actor.__ray_call__.remote(lambda _self: (os.getpid(), os.getppid())))


def test_the_error_names_the_rank_whose_actor_died_not_the_first_to_fail():
    cfg = compose("trainer.num_cpus=3", "rollout.num_workers=1", "trainer.learner.world_size=2",
                  "algo.group_size=4", "algo.episodes_per_step=8", "algo.minibatches=1",
                  "trainer.learner_threads=1")  # fmt: skip
    group = LearnerGroup.start(cfg)
    try:
        victim, raylet = pids(group.actors[1])
        assert Path(f"/proc/{raylet}/comm").read_text().strip() == "raylet"
        outcome: dict = {}

        def step() -> None:  # the episodes go by value: rank 0 needs no object store (the raylet's) for them
            try:
                group.train_step(episodes(cfg.algo.episodes_per_step))
            except LearnerRankLost as exc:
                outcome["error"] = str(exc)

        os.kill(raylet, signal.SIGSTOP)
        try:
            os.kill(victim, signal.SIGKILL)
            caller = threading.Thread(target=step)
            started = time.monotonic()
            caller.start()
            caller.join(PAUSE_S)
        finally:
            os.kill(raylet, signal.SIGCONT)
        caller.join(60)
        assert not caller.is_alive() and time.monotonic() - started < 60
    finally:
        group.kill()
    error = outcome["error"]
    assert error.startswith("learner rank 1 of 2 (node "), error
    assert "failed in train_step" in error


def test_a_rank_killed_mid_save_leaves_the_previous_checkpoint_which_resumes_bit_exactly(tmp_path):
    """Every rank's files reach the driver's folder through Ray; rank 1 is killed while a save is in
    flight (stopped first, so rank 0 waits for it inside the checkpoint's collectives): the save fails
    naming rank 1, its folder never gets ``trainer_state.json``, and a new learner resumes from the
    previous checkpoint to the very weights the first one reached. A file changed on disk is refused."""
    cfg = compose("trainer.num_cpus=3", "rollout.num_workers=1", "trainer.learner.world_size=2",
                  "algo.group_size=4", "algo.episodes_per_step=8", "algo.minibatches=1",
                  "trainer.learner_threads=1")  # fmt: skip
    run = tmp_path / "run"
    group = LearnerGroup.start(cfg)
    try:
        group.train_step(episodes(8))
        first = write_checkpoint(run, TrainerState("rl", 0), lambda folder: group.save(str(folder)))
        _metrics, _version, weights = group.train_step(episodes(8, seed=1))
        straight = weights.state_dict()
        victim, _raylet = pids(group.actors[1])
        os.kill(victim, signal.SIGSTOP)
        with pytest.raises(LearnerRankLost, match=r"^learner rank 1 of 2 .* failed in save_files"):
            threading.Timer(2.0, os.kill, (victim, signal.SIGKILL)).start()
            write_checkpoint(run, TrainerState("rl", 1), lambda folder: group.save(str(folder)))
    finally:
        group.kill()
    assert not is_checkpoint(checkpoint_dir(run, 1)) and latest_checkpoint(run) == first
    saved = json.loads((first / MANIFEST).read_text())
    assert sorted(saved["files"]) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    files = saved["files"].items()
    assert all((first / LEARNER_DIR / name).stat().st_size == f["bytes"] for name, f in files)
    fresh = LearnerGroup.start(cfg)
    try:
        fresh.load(str(first))
        _metrics, version, weights = fresh.train_step(episodes(8, seed=1))
        resumed = weights.state_dict()
        assert version == 2 and resumed.keys() == straight.keys()
        assert all(torch.equal(resumed[k], straight[k]) for k in straight)
        shard = first / LEARNER_DIR / "__1_0.distcp"
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 1
        shard.write_bytes(bytes(data))
        with pytest.raises(ValueError, match=r"__1_0\.distcp: its SHA-256 differs from the one in learner"):
            fresh.load(str(first))
    finally:
        fresh.kill()
