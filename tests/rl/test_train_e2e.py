"""End to end: local Ray, real sandboxes, the tiny K3 policy. GRPO survives a dead rollout worker; PPO
with a KL reference model and routing replay trains through the user's gymnasium wrappers; and exact
resume for both,
so for every kind of learner state (policy, value head, frozen reference, AdamW moments): N iterations
straight == N/2 + resume + N/2, bit for bit (the N/2 of a run stopped there, or a checkpoint N/2 into the
straight run)."""

import json
from pathlib import Path

import pytest
import torch
from rl_testutil import TINY, compose
from safetensors.torch import load_file

from rl.checkpoints import checkpoint_dir
from rl.driver.trainer import Trainer
from rl.learner.shard_checkpoint import read_learner_state
from rl.seeds import group_seeds

pytestmark = [pytest.mark.docker, pytest.mark.slow]

# What a resumed run must reproduce exactly (timings and sandbox latencies are not part of it).
LEARNING_METRICS = (
    "success",
    "reward",
    "turns",
    "episode_tokens",
    "loss",
    "policy_loss",
    "value_loss",
    "kl",
    "entropy",
    "grad_norm",
    "maxvio",
    "rollout_maxvio",
    "lr",
    "weights_version",
)
PPO = (  # PPO's value head and GAE, a KL reference, routing replay, forked group starts, a reward wrapper
    "algo=ppo",
    "algo.kl_coef=0.05",
    "algo.routing_replay=true",
    "algo.group_size=2",
    "env.group_start=fork",
    "env.wrappers=[{cls: 'user_wrappers:BonusReward', kwargs: {bonus: 10.0}}]",
)


def run(tmp_path: Path, name: str, *overrides: str):
    cfg = compose(*TINY, *overrides)
    return Trainer(cfg, tmp_path / name).run()


def weights(checkpoint: Path) -> dict:
    return load_file(str(checkpoint / "policy" / "model.safetensors"))


def learner_state(checkpoint: Path) -> dict:
    return read_learner_state(checkpoint)


def assert_same_run(straight, resumed) -> None:
    """Same iterations, learning metrics, policy, value head, reference and optimizer state."""
    assert [r["iteration"] for r in resumed.history] == [r["iteration"] for r in straight.history]
    for a, b in zip(straight.history, resumed.history, strict=True):
        for key in LEARNING_METRICS:
            assert a.get(key) == b.get(key), f"iteration {a['iteration']}: {key} {a.get(key)} != {b.get(key)}"
    wa, wb = weights(straight.checkpoint), weights(resumed.checkpoint)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa), "policy weights differ"
    sa, sb = learner_state(straight.checkpoint), learner_state(resumed.checkpoint)
    for part in ("model", "reference"):  # policy and value head; the frozen reference
        assert (part in sa) == (part in sb) and sa.get(part, {}).keys() == sb.get(part, {}).keys()
        assert all(torch.equal(sa[part][k], sb[part][k]) for k in sa.get(part, {})), f"{part} differs"
    assert sa["optimizer"].keys() == sb["optimizer"].keys()
    assert all(torch.equal(sa["optimizer"][n][m], sb["optimizer"][n][m])
               for n in sa["optimizer"] for m in ("step", "exp_avg", "exp_avg_sq"))  # fmt: skip


@pytest.fixture(scope="module")
def grpo_run(local_ray, tmp_path_factory):
    """2 GRPO iterations in which the rollout worker dies once, at the first reset of iteration 1."""
    tmp = tmp_path_factory.mktemp("grpo")
    seed = group_seeds(0, 1, 2)[0]
    dies = f"{{cls: 'user_wrappers:DiesOnce', kwargs: {{seed: {seed}, marker: '{tmp / 'died'}'}}}}"
    result = run(tmp, "grpo", f"env.wrappers=[{dies}]")
    assert (tmp / "died").exists()  # the fault really fired
    return result


@pytest.fixture(scope="module")
def ppo_run(local_ray, tmp_path_factory):
    """2 iterations of `PPO`, run straight, with a checkpoint after each (the first one is where
    `test_ppo_with_a_kl_reference_resumes_exactly` resumes)."""
    return run(tmp_path_factory.mktemp("ppo"), "ppo", *PPO, "trainer.checkpoint_every=1")


def test_grpo_two_iterations_survive_a_dead_rollout_worker(grpo_run):
    result = grpo_run
    assert result.iterations == 2
    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [0, 1]
    assert records[0]["worker_restarts"] == 0 and records[1]["worker_restarts"] == 1  # batch retried
    assert all(r["episodes"] == 4 and r["failed_episodes"] == 0 for r in records)
    assert records[1]["weights_version"] == 2 and "maxvio/layer1" in records[1]
    # the learner's own routing of every generated token is the rollout's (same weights, sync mode)
    assert all(r["routing_recorded_tokens"] == r["generated_tokens"] for r in records)
    assert all(r["routing_mismatch_any"] == 0.0 and r["rollout_logprob_gap"] < 1e-4 for r in records)
    assert result.plot.is_file() and (result.run_dir / "tb").is_dir()
    assert (result.checkpoint / "policy" / "model.safetensors").is_file()


def test_ppo_trains_on_the_wrapped_env_and_balances_every_optimizer_step(ppo_run):
    records = ppo_run.history
    assert len(records) == 2 and all(r["failed_episodes"] == 0 for r in records)
    assert records[0]["sandbox_forks"] == 2 and "value_loss" in records[0] and records[1]["kl"] > 0
    # BonusReward (+10 per step) is what the learner saw: rewards, and the value head's targets.
    assert all(r["reward"] >= 9.0 * r["turns"] for r in records) and records[1]["value_loss"] > 1.0
    assert all(r["optimizer_steps"] == 4.0 for r in records)  # 2 epochs x 2 minibatches, each balanced
    assert all(r["routing_recorded_tokens"] == r["generated_tokens"] for r in records)  # replayed, measured
    assert all(r["routing_mismatch"] == 0.0 for r in records)
    for layer in (1, 2, 3):  # rollout-side expert loads, per layer
        loads = records[0][f"rollout_expert_load/layer{layer}"]
        assert len(loads) == 16 and abs(sum(loads) - 1.0) < 1e-4
        # MaxVio = (max - mean) / mean of those same loads (shares summing to 1, rounded to 1e-6 each)
        assert records[0][f"rollout_maxvio/layer{layer}"] == pytest.approx(16 * max(loads) - 1, abs=1e-4)
        assert f"maxvio/layer{layer}" in records[0]


def test_grpo_resume_continues_exactly(grpo_run, tmp_path):
    """3 iterations == the 2 of `grpo_run` (whose retried batch was replayed identically) + resume + 1."""
    straight = run(tmp_path, "straight", "trainer.iterations=3")
    resumed = run(tmp_path, "resumed", "trainer.iterations=3", f"trainer.resume={grpo_run.run_dir}")
    assert_same_run(straight, resumed)


def test_ppo_with_a_kl_reference_resumes_exactly(ppo_run, tmp_path):
    """Value head, frozen reference and their optimizer state: 2 straight == 1 + resume + 1, resumed from
    the checkpoint the straight run wrote after its first iteration (what a run stopped there would have
    written: a checkpoint that changed the run it was taken from would fail the comparison too)."""
    first = checkpoint_dir(ppo_run.run_dir, 0)
    assert first.is_dir() and ppo_run.checkpoint == checkpoint_dir(ppo_run.run_dir, 1)
    resumed = run(tmp_path, "resumed", *PPO, f"trainer.resume={first}")
    state = learner_state(resumed.checkpoint)
    assert state["reference"] and any(name.startswith("value_head.") for name in state["model"])
    assert_same_run(ppo_run, resumed)
