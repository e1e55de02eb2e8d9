"""Config validation: bad values stop the run up front with the key in the message."""

import pytest
from rl_testutil import compose

from rl.config import ConfigError


def test_default_config_composes_and_validates():
    cfg = compose()
    assert cfg["algo"]["name"] == "grpo" and cfg["env"]["id"] == "agentenv/GuessNumber-v0"
    assert cfg["model"]["vocab_size"] == cfg["tokenizer"]["vocab_size"] == 272
    assert (
        cfg["env"]["kwargs"]["sandbox"]["config"]["network"] == "none"
    )  # the sandbox group reaches the task


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["algo.group_size=1"], "algo.group_size"),
        (["algo.episodes_per_step=10"], "algo.episodes_per_step"),
        (["algo.loss_aggregation=sum"], "algo.loss_aggregation"),
        (["env.id=agentenv/Nope-v0"], "env.id"),
        (["env.group_start=clone"], "env.group_start"),
        (["rollout.num_workers=3"], "trainer.num_cpus"),
        (["model.vocab_size=200"], "model.vocab_size"),
    ],
)
def test_bad_values_name_their_key(overrides, key):
    with pytest.raises(ConfigError, match=f"^{key}:"):
        compose(*overrides)


def test_vllm_rollout_is_refused_with_an_explanation_on_this_host():
    with pytest.raises(ConfigError, match="rollout=vllm cannot run on this host.*rollout=torch"):
        compose("rollout=vllm")


def test_ppo_and_rloo_compose():
    assert compose("algo=ppo")["algo"]["advantage"] == "gae"
    assert compose("algo=rloo")["algo"]["advantage"] == "rloo"
