"""`rl.driver.evaluate.success_rate`: a policy plays fresh games of the configured task in real sandboxes; the
same seed plays the same games with the same samples (so two policies are compared on equal terms), and
the weights come from ``model.init_from``."""

import pytest
from rl_testutil import compose

from model import checkpoint
from rl.driver.evaluate import success_rate
from rl.policy import build_policy
from rl.seeds import eval_seeds

pytestmark = pytest.mark.docker
# actions are digits (every one a guess), so that two policies' games differ in their rewards
SMALL = ("env=guess_number_32", "env.action_vocabulary='0123456789'", "sandbox.memory=128m",
         "sandbox.pids_limit=64", "rollout.env_threads=4")


def test_the_same_seed_plays_the_same_games_and_init_from_loads_the_weights(task_home, tmp_path):
    cfg = compose(*SMALL)
    first = success_rate(cfg, episodes=6, seed=3, batch=4)
    assert first.episodes == 6 and first.failed == 0
    assert first.success * 6 == pytest.approx(round(first.success * 6))  # a share of the 6 games
    assert 1 <= first.turns <= 6
    assert success_rate(cfg, episodes=6, seed=3, batch=4) == first
    assert eval_seeds(3, 6) != eval_seeds(4, 6)

    # other weights (the policy seed 1 builds) play other games: saved and loaded through init_from into
    # a run whose own seed (0) would build the first policy, they must play as seed 1's policy does
    other = success_rate(compose(*SMALL, "seed=1"), episodes=6, seed=3, batch=4)
    assert other != first  # the two policies are told apart by this evaluation
    checkpoint.save_pretrained(build_policy(cfg.model, seed=1), tmp_path / "other")
    loaded = compose(*SMALL, f"model.init_from={tmp_path / 'other'}")
    assert loaded.seed == cfg.seed
    assert success_rate(loaded, episodes=6, seed=3, batch=4) == other  # init_from's weights, not seed 0's
