"""Config keys that were accepted and then ignored, or combinations that could only fail at run time, are
refused by the config check with a message naming the key (issue 26, item 5)."""

import pytest
from rl_testutil import compose

from agentenv.errors import ConfigError


def test_algo_name_must_match_its_advantage_estimator():
    with pytest.raises(ConfigError, match=r"algo.name: ppo uses algo.advantage=gae, got algo.advantage=grpo"):
        compose("algo.name=ppo")
    with pytest.raises(ConfigError, match=r"algo.name: grpo uses algo.advantage=grpo, got .*=rloo"):
        compose("algo.advantage=rloo")
    assert compose("algo=rloo").algo.name == "rloo"


def test_a_concurrency_cap_below_one_group_is_refused():
    group = compose().algo.group_size
    with pytest.raises(ConfigError, match=rf"rollout.max_concurrent_episodes: {group - 1} is below "
                                          rf"algo.group_size={group}"):
        compose(f"rollout.max_concurrent_episodes={group - 1}")
    assert compose(f"rollout.max_concurrent_episodes={group}").rollout.max_concurrent_episodes == group


def test_in_flight_checkpoints_are_refused_with_a_freezing_pool():
    freeze = ("trainer.mode=async", "+rollout.sandbox_pool.overrides.pause_method=freeze")
    with pytest.raises(ConfigError, match=r"trainer.checkpoint_in_flight: .*pause_method=freeze"):
        compose(*freeze, "trainer.checkpoint_in_flight=true")
    assert not compose(*freeze, "trainer.checkpoint_in_flight=false").trainer.checkpoint_in_flight
    assert compose("trainer.mode=async", "trainer.checkpoint_in_flight=true").trainer.checkpoint_in_flight
