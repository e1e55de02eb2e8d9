"""`rl.evaluate.success_rate`: a policy plays fresh games of the configured task in real sandboxes; the
same seed plays the same games with the same samples (so two policies are compared on equal terms), and
the weights come from ``model.init_from``."""

import pytest
from rl_testutil import compose

from model import checkpoint
from rl.evaluate import success_rate
from rl.policy import build_policy
from rl.seeds import eval_seeds

pytestmark = pytest.mark.docker
SMALL = ("env=guess_number_32", "sandbox.memory=128m", "sandbox.pids_limit=64", "rollout.env_threads=4")


def test_the_same_seed_plays_the_same_games_and_init_from_loads_the_weights(task_home, tmp_path):
    cfg = compose(*SMALL)
    first = success_rate(cfg, episodes=6, seed=3, batch=4)
    assert first.episodes == 6 and first.failed == 0 and 0.0 <= first.success <= 1.0
    assert 1 <= first.turns <= 6
    assert success_rate(cfg, episodes=6, seed=3, batch=4) == first
    assert eval_seeds(3, 6) != eval_seeds(4, 6)

    checkpoint.save_pretrained(build_policy(cfg.model, seed=cfg.seed), tmp_path / "same")
    loaded = compose(*SMALL, f"model.init_from={tmp_path / 'same'}")
    assert success_rate(loaded, episodes=6, seed=3, batch=4) == first  # the same weights, read back
