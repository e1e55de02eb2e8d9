"""End to end: local Ray, real sandboxes, the tiny K3 policy — GRPO and PPO for 2 iterations, a dead
rollout worker restarted with its batch retried, and exact resume (2 + 2 iterations == 4)."""

import json
from pathlib import Path

import pytest
from rl_testutil import TINY, compose
from safetensors.torch import load_file

from rl.trainer import Trainer

pytestmark = [pytest.mark.docker, pytest.mark.slow]


def run(tmp_path: Path, name: str, *overrides: str):
    cfg = compose(*TINY, *overrides)
    return Trainer(cfg, tmp_path / name).run()


def weights(checkpoint: Path) -> dict:
    return load_file(str(checkpoint / "policy" / "model.safetensors"))


@pytest.fixture(scope="module")
def grpo_run(local_ray, tmp_path_factory):
    """2 GRPO iterations in which rollout worker 0 dies once (iteration 1)."""
    return run(tmp_path_factory.mktemp("grpo"), "grpo", "rollout.chaos.crash_worker_at_iteration=1")


def test_grpo_two_iterations_survive_a_dead_rollout_worker(grpo_run):
    result = grpo_run
    assert result.iterations == 2
    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [0, 1]
    assert records[0]["worker_restarts"] == 0 and records[1]["worker_restarts"] == 1  # batch retried
    assert all(r["episodes"] == 4 and r["failed_episodes"] == 0 for r in records)
    assert records[1]["weights_version"] == 2 and "maxvio/layer1" in records[1]
    assert result.plot.is_file() and (result.run_dir / "tb").is_dir()
    assert (result.checkpoint / "policy" / "model.safetensors").is_file()


def test_ppo_two_iterations_with_forked_group_starts(local_ray, tmp_path):
    result = run(tmp_path, "ppo", "algo=ppo", "algo.group_size=2", "env.group_start=fork")
    records = result.history
    assert len(records) == 2 and all(r["failed_episodes"] == 0 for r in records)
    assert records[0]["sandbox_forks"] == 2 and "value_loss" in records[0]


def test_resume_continues_exactly(grpo_run, tmp_path):
    """4 iterations == the 2 of `grpo_run` + resume + 2 (whose retried batch was replayed identically)."""
    straight = run(tmp_path, "straight", "trainer.iterations=4")
    resumed = run(tmp_path, "resumed", "trainer.iterations=4", f"trainer.resume={grpo_run.run_dir}")
    assert [r["iteration"] for r in resumed.history] == [0, 1, 2, 3]
    a, b = weights(straight.checkpoint), weights(resumed.checkpoint)
    assert a.keys() == b.keys()
    assert all((a[k] == b[k]).all() for k in a), "resumed weights differ from the uninterrupted run"
    assert [r["reward"] for r in straight.history] == [r["reward"] for r in resumed.history]
