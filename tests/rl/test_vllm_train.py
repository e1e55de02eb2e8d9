"""rollout=vllm end to end (local Ray, real sandboxes, the tiny K3 policy): the rollout worker samples with
its in-process vLLM engine, receives every new version as a push into that running engine, and the
learner trains on what it sampled. (Async mode's vLLM-specific path, an offer pushed between turns, is
tested on a worker in tests/rl/test_vllm_engine.py: a second end-to-end run would cost ~20 s, most of it
vLLM's start in a new worker process.)"""

import math

import pytest
from rl_testutil import TINY, compose

from rl.driver.trainer import Trainer

pytestmark = [pytest.mark.docker, pytest.mark.slow]
VLLM = ("rollout=vllm", "rollout.vllm.kv_cache_mib=32", "rollout.vllm.max_num_seqs=16")


def test_sync_training_samples_with_vllm_and_pushes_every_version(local_ray, tmp_path):
    result = Trainer(compose(*TINY, *VLLM, "algo.routing_replay=true"), tmp_path / "sync").run()
    records = result.history
    assert [r["weights_version"] for r in records] == [1.0, 2.0]  # each batch sampled by the pushed version
    for record in records:
        assert record["episodes"] == 4 and record["failed_episodes"] == 0 and record["worker_restarts"] == 0
        assert math.isfinite(record["loss"])
        # routing replay: vLLM recorded every action token's experts, and the learner, holding the same
        # version, routes them the same way before its update (fp32 on both sides)
        assert record["routing_recorded_tokens"] > 0 and record["routing_mismatch"] < 0.02
        for layer in (1, 2, 3):  # expert loads measured inside the vLLM engine
            loads = record[f"rollout_expert_load/layer{layer}"]
            assert len(loads) == 16 and abs(sum(loads) - 1.0) < 1e-4

