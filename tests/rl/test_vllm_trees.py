"""Trees on vLLM (`rollout=vllm`): vLLM keeps no per-episode state, so each turn of each leaf is a request
with its whole context, and (its prefix cache being unusable with seeded CPU sampling, see
`rl.config.checks.check_vllm_prefix_caching`) each child re-reads the shared prefix: measured through
`Generation.context_read`, against the torch engine, which reads it once per tree.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from test_tree_rollout import make_runner

from rl.config import ConfigError
from rl.config.schema import VllmEngineConfig
from rl.policy import build_policy
from rl.tokenizer import ByteTokenizer

from rl_testutil import compose  # isort: skip

TOK = ByteTokenizer()
SETTINGS = VllmEngineConfig(
    dtype="float32", max_model_len=2048, max_num_seqs=16, kv_cache_mib=32, enable_prefix_caching=False
)


@pytest.fixture(scope="module")
def policy():
    return build_policy(compose().model, seed=0).float()


@pytest.fixture(scope="module")
def engine(policy, tmp_path_factory):
    from rl.rollout.vllm.engine import VllmEngine

    folder = tmp_path_factory.mktemp("k3_tiny")
    policy.save_pretrained(folder)
    return VllmEngine(SETTINGS, folder, TOK, temperature=1.0, action_vocabulary="abcdefghij")


def test_the_engine_refuses_prefix_caching_with_the_reason(tmp_path):
    from rl.rollout.vllm.engine import VllmEngine

    with pytest.raises(ConfigError, match=r"^rollout\.vllm\.enable_prefix_caching: vLLM 0\.32 caches"):
        VllmEngine(replace(SETTINGS, enable_prefix_caching=True), tmp_path, TOK, temperature=1.0)


@pytest.mark.docker
def test_a_tree_grows_on_vllm_and_each_child_re_reads_the_shared_prefix(
    policy, engine, sandbox_config
):
    runner = make_runner(policy, sandbox_config, "Notebook", {"branch_at": [1], "width": 2, "depth": 1,
                                                             "budget": 2}, engine=engine)  # fmt: skip
    try:
        leaves, stats = runner.run([3], group_size=2, generator=torch.Generator().manual_seed(0))
    finally:
        runner.close()
    assert stats.failed == 0 and stats.forks == 1 and stats.env_steps == 3  # the shared turn stepped once
    (offset, first), (offset_b, second) = leaves[0].branches[0], leaves[1].branches[0]
    assert (first, second) == (0, 1) and offset == offset_b
    assert leaves[0].tokens[:offset] == leaves[1].tokens[:offset]  # the shared prefix, sampled once
    assert leaves[0].observations[:2] == leaves[1].observations[:2]
    prompt = leaves[0].action_mask.index(1)
    assert stats.context_tokens == prompt + 2 * offset
    assert stats.context_tokens_read == stats.context_tokens  # each child re-read the prefix
