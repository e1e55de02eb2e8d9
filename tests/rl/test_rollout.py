"""`EpisodeRunner` with the tiny K3 policy and real sandboxes: token layout, group starts, faults."""

from dataclasses import replace

import pytest
import torch
from rl_testutil import compose

from rl.driver.trainer import check_failures
from rl.episode import EpisodeSummary, collate
from rl.errors import TooManyFailures
from rl.failures import failure_metrics
from rl.policy import build_policy
from rl.rollout.runner import EpisodeRunner
from rl.rollout.torch_engine import TorchEngine
from rl.rollout.wrappers import task
from rl.tokenizer import ByteTokenizer

pytestmark = pytest.mark.docker
TOK = ByteTokenizer()


@pytest.fixture(scope="module")
def policy():
    torch.manual_seed(0)
    return build_policy(compose().model, seed=0)


def make_runner(
    policy,
    sandbox_config,
    env_id="agentenv/GuessNumber-v0",
    group_start="seed",
    pool=None,
    pause_policy="never",
    wrappers=None,
    policy_latency_s=0.0,
    max_concurrent_episodes=None,
):
    """A runner on ``env_id`` with the test sandbox limits; ``pool``: conf/agentenv/pool.yaml overrides."""
    import fault_tasks  # noqa: F401  (registers faults/*)

    cfg = compose("env.kwargs.max_turns=2", "rollout.env_threads=4")
    env_cfg = replace(cfg.env, id=env_id, group_start=group_start, wrappers=wrappers)
    pool_cfg = cfg.rollout.sandbox_pool
    pool_cfg = replace(pool_cfg, pause_policy=pause_policy, overrides={**pool_cfg.overrides, **(pool or {})})
    rollout_cfg = replace(
        cfg.rollout,
        sandbox_pool=pool_cfg,
        policy_latency_s=policy_latency_s,
        max_concurrent_episodes=max_concurrent_episodes,
    )
    return EpisodeRunner(env_cfg, rollout_cfg, TorchEngine(policy, TOK), TOK, sandbox=sandbox_config)


def test_episodes_keep_exact_tokens_masks_and_sampling_logprobs(policy, sandbox_config):
    runner = make_runner(policy, sandbox_config)
    try:
        episodes, stats = runner.run([7, 8], group_size=2, generator=torch.Generator().manual_seed(0))
    finally:
        runner.close()
    assert len(episodes) == 4 and stats.failed == 0 and stats.env_steps == sum(e.turns for e in episodes)
    for ep in episodes:
        assert ep.tokens[:2] == [TOK.bos_id, TOK.observation_id]
        assert TOK.decode(ep.tokens).startswith("guess 0-5")
        assert len(ep.tokens) == len(ep.action_mask) == len(ep.logprobs)
        assert 1 <= ep.turns <= 2 and len(ep.step_rewards) == ep.turns
        trained = [t for t, m in zip(ep.tokens, ep.action_mask, strict=True) if m]
        assert len(trained) <= 2 * ep.turns  # max_new_tokens = 2 per action
    # The sampling log-probs are the policy's own: recomputing them in one forward gives the same values.
    batch = collate(episodes, TOK.pad_id)
    with torch.no_grad():
        logits = policy(batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
    logp = torch.log_softmax(logits, -1).gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    mask = batch.action_mask.bool()
    torch.testing.assert_close(logp[mask], batch.rollout_logprobs[mask], atol=2e-4, rtol=0)


def test_sandboxes_stay_alive_across_iterations(policy, sandbox_config):
    runner = make_runner(policy, sandbox_config)
    try:
        _, first = runner.run([1, 2], 2, torch.Generator().manual_seed(0))
        _, second = runner.run([3, 4], 2, torch.Generator().manual_seed(1))
    finally:
        runner.close()
    assert first.sandboxes_created == 4 and second.sandboxes_created == 0


def test_max_concurrent_episodes_plays_whole_groups_in_waves_on_the_same_sandboxes(policy, sandbox_config):
    """A cap of 5 episodes with groups of 2 plays 2 groups per wave: 3 waves for 6 groups, each wave on
    the sandboxes of the first (4 created, not 12), episodes still in group order and all played."""
    runner = make_runner(policy, sandbox_config, max_concurrent_episodes=5)
    try:
        episodes, stats = runner.run([1, 2, 3, 4, 5, 6], 2, torch.Generator().manual_seed(0))
        with pytest.raises(ValueError, match="max_concurrent_episodes=5 is below the group size 6"):
            runner.run([1], 6, torch.Generator().manual_seed(0))  # a wave cannot hold one group
    finally:
        runner.close()
    assert stats.sandboxes_created == 4 and stats.failed == 0 and len(episodes) == 12
    assert [e.group for e in episodes] == [g for g in range(6) for _ in range(2)]
    assert [e.seed for e in episodes] == [s for s in [1, 2, 3, 4, 5, 6] for _ in range(2)]
    assert all(e.turns >= 1 for e in episodes)


def test_fork_group_start_gives_byte_identical_starts_even_for_random_state(policy, sandbox_config):
    runner = make_runner(policy, sandbox_config, env_id="faults/RandomStart-v0", group_start="fork")
    try:
        episodes, stats = runner.run([5, 6], group_size=3, generator=torch.Generator().manual_seed(0))
    finally:
        runner.close()
    assert stats.failed == 0 and stats.forks == 4
    # the two groups fork at once: the phase's wall time is at most their summed latencies
    assert 0 < stats.fork_phase_s <= stats.fork_s
    firsts = [e.first_observation for e in episodes]
    assert firsts[0] == firsts[1] == firsts[2] and firsts[3] == firsts[4] == firsts[5]
    assert firsts[0] != firsts[3] and len(firsts[0]) == 12  # 6 random bytes drawn inside the sandbox
    # The first step reads the state back from each member's own (forked) sandbox.
    assert [e.observations[1] for e in episodes] == firsts


def test_seed_group_start_of_a_nondeterministic_task_differs(policy, sandbox_config):
    runner = make_runner(policy, sandbox_config, env_id="faults/RandomStart-v0", group_start="seed")
    try:
        episodes, _ = runner.run([5], group_size=2, generator=torch.Generator().manual_seed(0))
    finally:
        runner.close()
    assert episodes[0].first_observation != episodes[1].first_observation


def test_an_exception_in_a_task_step_fails_only_that_episode(policy, sandbox_config):
    runner = make_runner(policy, sandbox_config, env_id="faults/RaisesOnOddSeeds-v0")
    try:
        episodes, stats = runner.run([2, 3], group_size=2, generator=torch.Generator().manual_seed(0))
        assert stats.failed == 2 and len(runner.free_envs) == 2  # the two broken envs were discarded
    finally:
        runner.close()
    assert [e.error is not None for e in episodes] == [False, False, True, True]
    assert "task bug on purpose" in episodes[2].error and episodes[2].weight == 0.0
    assert [e.failure for e in episodes] == [None, None, "runtime_error", "runtime_error"]
    # what the driver reads instead of the episodes: one outcome per episode, in order
    assert stats.outcomes == [EpisodeSummary.of(e) for e in episodes]
    assert [o.failed for o in stats.outcomes] == [False, False, True, True]
    assert [o.tokens for o in stats.outcomes] == [len(e.tokens) for e in episodes]
    batch = collate(episodes, TOK.pad_id)
    assert batch.action_mask[2:].sum() == 0 and batch.action_mask[:2].sum() > 0  # zero-weight samples
    with pytest.raises(
        TooManyFailures, match="(?s)2 of 4 episodes failed.*2 x ValueError: task bug on purpose"
    ):
        check_failures(stats, max_fraction=0.25, iteration=0)
    check_failures(stats, max_fraction=0.5, iteration=0)  # at the limit: the run goes on


def test_a_sandbox_killed_mid_episode_fails_the_episode_and_is_replaced(policy, sandbox_config):
    runner = make_runner(policy, sandbox_config, env_id="faults/KillsItsSandbox-v0")
    try:
        episodes, stats = runner.run([1], group_size=2, generator=torch.Generator().manual_seed(0))
        assert stats.failed == 2 and all(e.error for e in episodes) and runner.free_envs == []
    finally:
        runner.close()
    assert [e.failure for e in episodes] == ["sandbox_lost"] * 2, [e.error for e in episodes]


def test_the_platforms_command_timeout_fails_the_episode_and_its_group_is_left_out(policy, sandbox_config):
    """Odd seeds hang past the platform's command timeout: an exec_timeout failure, counted per kind, and
    a group left with one valid member (below algo.min_valid_members=2) is left out; an even seed's
    command that ends by its own `timeout` is an ordinary step."""
    runner = make_runner(policy, sandbox_config, env_id="faults/HangsOnOddSeeds-v0")
    try:
        episodes, stats = runner.run([2, 3], group_size=1, generator=torch.Generator().manual_seed(0))
    finally:
        runner.close()
    assert [e.failure for e in episodes] == [None, "exec_timeout"], [e.error for e in episodes]
    assert "command timeout (1.0 s)" in episodes[1].error and episodes[0].turns >= 1
    ok, hung = stats.outcomes
    metrics = failure_metrics([[ok, ok], [ok, hung]], min_valid=compose().algo.min_valid_members)
    counted = (metrics["failed_exec_timeout"], metrics["excluded_groups"], metrics["excluded_episodes"])
    assert counted == (1, 1, 2)


def test_an_env_that_fails_to_close_is_logged_and_counted_not_raised(policy, sandbox_config, caplog):
    """Forks are closed after their episode: each fork's failed close is a warning and a count in the
    run's stats (the trainer's env_close_errors), and the run returns its episodes."""
    runner = make_runner(policy, sandbox_config, env_id="faults/CloseFails-v0", group_start="fork")
    try:
        episodes, stats = runner.run([0], group_size=3, generator=torch.Generator().manual_seed(0))
        assert stats.failed == 0 and len(episodes) == 3
        assert stats.close_errors == 2  # the group's two forks
        assert runner.run([2], group_size=2, generator=torch.Generator().manual_seed(1))[1].close_errors == 1
    finally:
        runner.free_envs = []  # they cannot close either
        runner.close()
    assert "close failed on purpose" in caplog.text and "faults/CloseFails-v0" in caplog.text


def test_a_failed_resume_fails_the_episode_not_the_run(policy, sandbox_config):
    from agentenv.runtime import runtime

    runner = make_runner(policy, sandbox_config, pause_policy="always")
    try:
        _, first = runner.run([1], group_size=2, generator=torch.Generator().manual_seed(0))
        # paused while the policy generated (and resumed for each step), and again at the end of the run
        assert first.pauses >= 4 and first.resumes >= 2 and first.failed == 0
        assert all(task(env).paused for env in runner.free_envs)
        broken = task(runner.free_envs[0])
        checkpoint = runtime().registry.latest_checkpoint(broken.sandbox.id)
        import shutil

        shutil.rmtree(checkpoint.path)  # the checkpoint is lost: resuming this sandbox must fail
        episodes, second = runner.run([2], group_size=2, generator=torch.Generator().manual_seed(1))
    finally:
        runner.close()
    assert second.resumes >= 1 and second.failed == 1
    assert sum(e.error is not None for e in episodes) == 1
    failed = next(e for e in episodes if e.error)
    assert "checkpoint" in failed.error.lower() and failed.failure == "sandbox_lost"


def test_a_long_wait_on_the_policy_pauses_the_waiting_sandboxes_and_a_short_one_does_not(
    policy, sandbox_config
):
    """``pause_policy: cost`` with a pause + resume cost fixed at 2 s (the priors, live p50s never taking
    over): the tiny policy's own generation never pauses a sandbox (milliseconds on an idle host; on a
    busy one, where a generation can take longer, the pauses' CPU finds no spare cores); an emulated 3 s
    generation (``policy_latency_s``) with pauses priced at 0 CPU-s (so they always fit the spare cores:
    that rule is test_pool_cost.py's) pauses the waiting sandboxes, which their steps resume."""
    cost = {"pause_prior_s": 1.0, "resume_prior_s": 1.0, "cost_min_samples": 10**6}
    fast = make_runner(policy, sandbox_config, pause_policy="cost", pool=cost)
    try:
        runs = [fast.run([s], 2, torch.Generator().manual_seed(s))[1] for s in (1, 2)]
        assert fast.residency.cost.cost_s() == 2.0
    finally:
        fast.close()
    assert all(r.pauses == 0 and r.pause_waits == [] and r.failed == 0 for r in runs)
    kept = runs[1].pool_summary()
    assert kept["sandbox_paused_s"] == 0 and kept["sandbox_running_s"] > 0
    assert kept["sandbox_running_bytes"] > 0 and kept["pauses_per_episode"] == 0

    free_cpu = {**cost, "pause_cpu_prior_s": 0.0, "resume_cpu_prior_s": 0.0}
    slow = make_runner(policy, sandbox_config, pause_policy="cost", pool=free_cpu, policy_latency_s=3.0)
    try:
        episodes, stats = slow.run([2], 2, torch.Generator().manual_seed(2))
    finally:
        slow.close()
    turns = sum(e.turns for e in episodes)  # every turn's wait paused the sandbox of its episode
    assert stats.failed == 0 and turns >= 2
    assert len(stats.pause_waits) == turns and min(stats.pause_waits) >= 3.0
    assert stats.pauses == turns and stats.resumes == turns  # each step resumed its sandbox
    summary = stats.pool_summary()
    assert summary["pause_trigger_wait_p50_s"] >= 3.0 and summary["pauses_per_episode"] == turns / 2
    assert summary["sandbox_paused_s"] > turns * 1.0 and summary["sandbox_running_s"] > 0
    # while they waited, the paused sandboxes held no memory
    assert summary["sandbox_running_bytes"] < kept["sandbox_running_bytes"] / 2


def test_waiting_envs_without_a_sandbox_are_left_out_of_the_pause_decision(policy, sandbox_config, caplog):
    """A free env whose sandbox was discarded (episode isolation closes a played one; the next reset
    makes a new one) has nothing to pause: the others are paused, and no pause of `None` is tried."""
    runner = make_runner(policy, sandbox_config, pause_policy="always")
    try:
        runner.run([1, 2], group_size=2, generator=torch.Generator().manual_seed(0))
        emptied, kept = runner.free_envs[0], runner.free_envs[1]
        task(emptied).discard_sandbox()
        with caplog.at_level("WARNING", logger="rl.rollout.runner"):
            runner.release_idle()
        assert task(emptied).sandbox is None and task(kept).paused
        assert "could not pause waiting sandbox" not in caplog.text
    finally:
        runner.close()


def test_sandboxes_are_pool_members_paused_over_budget_and_removed_at_close(policy, sandbox_config):
    from agentenv import Sandbox

    # A 1-byte budget: every idle member is paused (LRU) to make room; steps resume them on demand.
    budget = {"memory_budget": "1", "idle_after_s": 0.0, "warm_starts": True}
    # both groups at once (uncapped, the gate's one slot would play them in waves of one group)
    runner = make_runner(policy, sandbox_config, group_start="fork", pool=budget, max_concurrent_episodes=4)
    pool = runner.sandbox_pool
    try:
        episodes, first = runner.run([1, 2], group_size=2, generator=torch.Generator().manual_seed(0))
        member_ids = {m.id for m in pool.members()}
        assert {task(env).sandbox.id for env in runner.free_envs} <= member_ids and len(member_ids) == 2
        assert all(task(env).paused for env in runner.free_envs)  # over budget and idle after the run
        again, second = runner.run([3, 4], group_size=2, generator=torch.Generator().manual_seed(1))
        assert first.failed == second.failed == 0 and all(e.turns >= 1 for e in episodes + again)
        assert first.pauses >= 2 and second.resumes >= 2 and second.sandboxes_created == 0
        summary = second.pool_summary()
        assert summary["sandbox_pool_paused"] == 2 and summary["sandbox_pool_disk_bytes"] > 0
        assert summary["sandbox_pause_p50_s"] > 0 and summary["sandbox_resume_p90_s"] > 0
        assert first.pool[0]["warm_starts"] == 2 and first.pool[0]["templates"] == 1
    finally:
        runner.close()
    assert pool.members() == [] and pool.metrics().templates == 0
    assert all(s.status == "closed" for s in Sandbox.list(include_closed=True) if s.id in member_ids)


def test_user_wrappers_shape_what_the_policy_sees_and_is_trained_on_forks_included(policy, sandbox_config):
    """``env.wrappers``: the runner steps the wrapped env; a fork gets a copy of the wrapper chain."""
    wrappers = [
        "user_wrappers:NumberedObservations",
        {"cls": "user_wrappers:BonusReward", "kwargs": {"bonus": 10.0}},
    ]
    runner = make_runner(policy, sandbox_config, group_start="fork", wrappers=wrappers)
    try:
        episodes, stats = runner.run([3, 4], group_size=2, generator=torch.Generator().manual_seed(0))
        env = runner.free_envs[0]
        chain = []
        while env is not env.unwrapped:
            chain.append(type(env).__name__)
            env = env.env
    finally:
        runner.close()
    assert chain[:2] == ["BonusReward", "NumberedObservations"] and "PassiveEnvChecker" in chain
    assert stats.failed == 0 and stats.forks == 2
    for episode in episodes:  # forked members go on counting from the state they were forked in
        assert [o.split(" ", 1)[0] for o in episode.observations] == [
            f"#{i}" for i in range(len(episode.observations))
        ]
        assert TOK.decode(episode.tokens).startswith("#0 guess 0-5")
        assert episode.turns >= 1 and all(r >= 9.0 for _, r in episode.step_rewards)
    batch = collate(episodes, TOK.pad_id)
    assert bool((batch.rewards >= 9.0).all()) and batch.token_rewards.sum() == batch.rewards.sum()


