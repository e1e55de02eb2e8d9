"""Async training end to end (local Ray, real sandboxes, the tiny K3 policy): episodes carry the version
of every token, partial rollouts switch weights between turns, staleness stays within the bound, and
an async run resumes from its checkpoint's weights and optimizer state."""

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from rl_testutil import TINY, assert_drops_add_up, compose

from rl.driver.trainer import Trainer
from rl.policy import build_policy
from rl.rollout.runner import EpisodeRunner
from rl.rollout.torch_engine import TorchEngine
from rl.tokenizer import ByteTokenizer

pytestmark = [pytest.mark.docker, pytest.mark.slow]
TOK = ByteTokenizer()
ASYNC = ("trainer.mode=async", "trainer.checkpoint_every=0")


def test_an_episode_in_flight_across_an_update_continues_with_the_new_weights(sandbox_config):
    """The runner asks the version before every turn; tokens of turn 1 come from v0, those of turn 2
    from v1 (swapped in between), each with the sampling log-probs of the weights that sampled it."""
    cfg = compose("env.kwargs.max_turns=2", "rollout.env_threads=4")
    env_cfg = replace(cfg.env, group_start="seed")
    old, new = build_policy(cfg.model, seed=0), build_policy(cfg.model, seed=1)
    engine = TorchEngine(old, TOK, cfg.rollout.temperature, cfg.env.action_vocabulary)
    runner = EpisodeRunner(env_cfg, cfg.rollout, engine, TOK, sandbox=sandbox_config)
    generations = []
    generate = engine.generate
    engine.generate = lambda *args: generations.append(1) or generate(*args)

    def policy_version() -> int:  # as RolloutWorker._turn_version once v1 is ready after turn 1
        if generations:
            engine.model = new
            return 1
        return 0

    try:
        episodes, stats = runner.run(
            [3, 4], 2, torch.Generator().manual_seed(0), policy_version=policy_version
        )
    finally:
        runner.close()
    assert stats.failed == 0
    two_turns = [e for e in episodes if e.turns == 2]
    assert two_turns, "no episode lasted two turns"
    for e in episodes:
        assert len(e.versions) == len(e.tokens)
        assert e.oldest_version == 0
    for e in two_turns:
        assert (e.oldest_version, e.newest_version) == (0, 1)
        ids = torch.tensor([e.tokens])
        for version, model in ((0, old), (1, new)):
            with torch.no_grad():
                logits = model(ids).logits[0, :-1] / cfg.rollout.temperature
            logits = logits.masked_fill(engine.disallowed, -1e9)  # GuessNumber's action vocabulary
            logp = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
            pairs = enumerate(zip(e.action_mask, e.versions, strict=True))
            where = [i - 1 for i, (m, v) in pairs if m and v == version]
            torch.testing.assert_close(
                logp[where], torch.tensor([e.logprobs[i + 1] for i in where]), atol=2e-4, rtol=0
            )


def test_async_runs_keep_staleness_within_the_bound_and_resume_from_their_checkpoint(
    local_ray, tmp_path: Path
):
    first = Trainer(
        compose(*TINY, *ASYNC, "trainer.iterations=3", "trainer.max_staleness=0"), tmp_path / "a"
    ).run()
    assert [r["weights_version"] for r in first.history] == [1.0, 2.0, 3.0]
    for record in first.history:
        assert record["staleness_max"] == 0 and record["staleness_mean"] == 0  # max_staleness=0: on-policy
        assert record["episodes"] >= 4
        assert 0 <= record["learner_idle_fraction"] <= 1
        assert record["iteration_s"] >= record["learner_s"]
    assert_drops_add_up(first.history, group_size=2, episodes_per_step=4)
    resumed = Trainer(
        compose(
            *TINY,
            *ASYNC,
            "trainer.iterations=5",
            "trainer.max_staleness=1",
            f"trainer.resume={tmp_path / 'a'}",
        ),
        tmp_path / "b",
    ).run()
    assert [r["iteration"] for r in resumed.history] == [0, 1, 2, 3, 4]
    assert [r["weights_version"] for r in resumed.history[3:]] == [4.0, 5.0]  # the checkpoint's learner
    assert all(r["staleness_max"] <= 1 for r in resumed.history[3:])
