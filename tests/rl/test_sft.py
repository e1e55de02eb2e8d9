"""The SFT cold start (`python -m rl.train stage=sft`) and `model.init_from`: trained on bisection
demonstrations recorded in real sandboxes, resumed bit for bit, and handed to the RL trainer, whose
learner and rollout workers start from the SFT weights."""

import json
import math
from pathlib import Path

import pytest
import torch
from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from rl_testutil import ROOT, TINY, compose, compose_raw
from safetensors.torch import load_file

from rl.config import ConfigError
from rl.driver.trainer import Trainer
from rl.learner.shard_checkpoint import read_learner_state
from rl.policy import build_policy
from rl.sft.demonstrations import run_demonstrations
from rl.sft.trainer import SFTRunner
from rl.train import train

pytestmark = pytest.mark.docker

SMALL_SANDBOX = ("sandbox.memory=128m", "sandbox.pids_limit=64")
SFT = (
    "stage=sft",
    "sft.batch_size=4",
    "sft.holdout_fraction=0.25",
    "sft.checkpoint_every=0",
    "trainer.progress_bar=false",
    "trainer.learner_threads=1",
)


@pytest.fixture(scope="module")
def demos(task_home, tmp_path_factory) -> Path:
    """8 bisection episodes of GuessNumber, recorded by `rl.sft.demonstrations` in real sandboxes."""
    out = tmp_path_factory.mktemp("demos") / "bisection.jsonl"
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = hydra_compose(
            "demonstrations",
            overrides=[*SMALL_SANDBOX, f"out={out}", "expert.quality=bisection", "num_episodes=8"],
        )
    _, summary = run_demonstrations(cfg)
    assert summary["episodes"] == 8 and summary["success_rate"] == 1.0
    return out


def sft(run_dir: Path, demos: Path, *overrides: str):
    return SFTRunner(compose(*SFT, f"data={demos}", *overrides), run_dir).run()


def weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    return load_file(str(checkpoint / "policy" / "model.safetensors"))


def test_sft_learns_the_actions_and_resumes_bit_for_bit(demos, tmp_path):
    straight = sft(tmp_path / "straight", demos, "sft.max_steps=4")
    sft(tmp_path / "half", demos, "sft.max_steps=2")
    resumed = sft(tmp_path / "resumed", demos, "sft.max_steps=4", f"trainer.resume={tmp_path / 'half'}")
    assert straight.steps == resumed.steps == 4 and straight.train_episodes == 6
    wa, wb = weights(straight.checkpoint), weights(resumed.checkpoint)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa), "policy weights differ"
    sa, sb = read_learner_state(straight.checkpoint), read_learner_state(resumed.checkpoint)
    assert sa["trainer"]["steps"] == sb["trainer"]["steps"] == 4
    assert sa["optimizer"].keys() == sb["optimizer"].keys()
    for name, a in sa["optimizer"].items():
        b = sb["optimizer"][name]
        assert torch.equal(a["exp_avg"], b["exp_avg"]) and torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])

    # same metrics step by step (a run's metrics.jsonl holds the steps it ran), the loss going down
    def losses(run: str) -> list[float]:
        lines = (tmp_path / run / "metrics.jsonl").read_text().splitlines()
        return [r["loss"] for r in map(json.loads, lines) if "loss" in r]

    assert losses("straight") == losses("half") + losses("resumed")
    steps = losses("straight")
    assert len(steps) == 4 and steps[-1] < steps[0]
    held = straight.heldout  # over the held-out episodes' action tokens: a share of a whole count
    assert held["episodes"] == 2 and held["action_tokens"] > 0 and math.isfinite(held["loss"])
    correct = held["accuracy"] * held["action_tokens"]
    assert correct == pytest.approx(round(correct), abs=1e-3)
    assert straight.heldout == resumed.heldout
    assert (tmp_path / "straight" / "learning_curve.png").is_file()
    assert list((tmp_path / "straight" / "tb").iterdir())


def test_rl_starts_from_the_sft_checkpoint(demos, local_ray, tmp_path):
    sft_result = train(compose_raw(*SFT, f"data={demos}", "sft.max_steps=3"), tmp_path / "sft")
    sft_weights = weights(sft_result.checkpoint)
    # kl_coef > 0: the learner's frozen reference is a copy of the weights it started from
    cfg = compose(*TINY, "trainer.iterations=1", "algo.kl_coef=0.01", f"model.init_from={tmp_path / 'sft'}")
    result = Trainer(cfg, tmp_path / "rl").run()
    reference = read_learner_state(result.checkpoint)["reference"]
    assert all(torch.equal(reference[k], sft_weights[k]) for k in sft_weights), (
        "the learner did not start there"
    )
    fresh = build_policy(cfg.model, cfg.seed).state_dict()  # what the run would start from without it
    assert not all(torch.equal(fresh[k], sft_weights[k]) for k in sft_weights)
    # the workers sampled iteration 0 with those weights: their log-probs are the learner's
    assert result.history[0]["rollout_logprob_gap"] < 1e-4


def test_init_from_refuses_another_model_config(demos, tmp_path):
    train(compose_raw(*SFT, f"data={demos}", "sft.max_steps=1"), tmp_path / "sft")
    with pytest.raises(
        ConfigError, match=r"model.init_from: .*max_position_embeddings=8192 there vs 4096 here"
    ):
        compose("model.max_position_embeddings=4096", f"model.init_from={tmp_path / 'sft'}")
    with pytest.raises(ConfigError, match="model.init_from: .* holds no policy weights"):
        compose(f"model.init_from={tmp_path}")
    with pytest.raises(ConfigError, match="data: stage=sft needs an existing demonstration JSONL"):
        compose("stage=sft", f"data={tmp_path / 'missing.jsonl'}")
