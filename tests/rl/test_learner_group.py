"""A two-rank learner (`rl.learner_group.LearnerGroup` on local Ray, gloo between its ranks) whose rank 1
is killed: the error names rank 1, the rank whose actor died, and not rank 0, whose collective failed
first. The order is made the one of a lost node: rank 1's process is killed while the raylet that would
report its death is paused, so rank 0's "connection reset" reaches the driver before Ray says that rank
1 died (on a real cluster Ray declares a node dead only after its health checks miss, seconds later)."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import ray
from rl_testutil import compose
from test_learner_ranks import episodes

from rl.errors import LearnerRankLost
from rl.learner_group import LearnerGroup

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
