"""Admission control (the slots of `agentenv.pool.residency.Residency`) with real sandboxes and the tiny
K3 policy: a runner whose pool budget fits two KVLookup sandboxes plays six forked episodes and never
runs more sandboxes than the budget holds (the same run ungated does, with the same tokens); under a
budget that does not bind nothing waits; an in-flight snapshot and its resume finish under a one-slot
budget."""

import threading
from dataclasses import replace

import pytest
import torch
from rl_testutil import compose

from agentenv import Sandbox
from agentenv.runtime import runtime
from rl.episode import Episode
from rl.policy import build_policy
from rl.rollout.runner import EpisodeRunner, RolloutStats
from rl.rollout.torch_engine import TorchEngine
from rl.tokenizer import ByteTokenizer

pytestmark = [pytest.mark.docker, pytest.mark.usefixtures("one_torch_thread")]
TOK = ByteTokenizer()
DATA_MIB = 8  # a KVLookup sandbox then holds ~13 MiB (its service's table, Python, the shell)
BUDGET_MIB = 32  # two of them, not three


class RunningSampler:
    """Samples, every 50 ms from a thread, how many members of ``pool`` run (the registry's state; a
    CRIU-paused member has no process)."""

    def __init__(self, pool) -> None:
        self.pool = pool
        self.counts: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.wait(0.05):
            members = {member.sandbox_id for member in self.pool.state.members()}
            # one registry query: a snapshot of every state at one instant (reading the members one by
            # one would count a sandbox that ran before its pause and the one resumed after it)
            records = runtime().registry.list_sandboxes()
            self.counts.append(sum(r.id in members and r.state == "running" for r in records))

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def _play(cfg, sandbox_config, admission: bool):
    """One run of three forked groups of 2 with the gate on or off: (episodes, stats, sampler, slots,
    measured sandbox size)."""
    rollout = replace(cfg.rollout, sandbox_pool=replace(cfg.rollout.sandbox_pool, admission=admission))
    policy = build_policy(cfg.model, seed=0)
    runner = EpisodeRunner(cfg.env, rollout, TorchEngine(policy, TOK), TOK, sandbox=sandbox_config)
    try:
        with RunningSampler(runner.sandbox_pool) as sampler:
            episodes, stats = runner.run([1, 2, 3], group_size=2, generator=torch.Generator().manual_seed(0))
        slots = runner.residency.slots() if admission else 0
        size = runner.residency.sandbox_bytes() if admission else 0
    finally:
        runner.close()
    return episodes, stats, sampler, slots, size


def test_running_sandboxes_stay_within_the_budget_when_episodes_outnumber_its_slots(sandbox_config):
    cfg = compose(
        "env=kv_lookup",
        f"env.kwargs.data_mib={DATA_MIB}",
        "env.kwargs.max_turns=2",  # every episode still steps (and so resumes) under the gate
        "rollout.env_threads=6",
        "rollout.sandbox_pool.pause_policy=cost",
        "rollout.sandbox_pool.overrides.warm_starts=true",
        f"+rollout.sandbox_pool.overrides.memory_budget={BUDGET_MIB}m",
        "+rollout.sandbox_pool.overrides.idle_after_s=0",
    )
    assert cfg.rollout.sandbox_pool.admission
    episodes, stats, sampler, slots, size = _play(cfg, sandbox_config, admission=True)
    # the pool measured its sandboxes: two fit the budget; all six episodes played to their end
    assert slots == 2 and 8 * 2**20 < size <= BUDGET_MIB * 2**20 // 2
    assert stats.failed == 0, stats.errors
    assert len(episodes) == 6 and all(e.turns >= 1 for e in episodes)
    assert stats.forks == 3 and stats.slot_wait_s > 0 and stats.pool_summary()["sandbox_slots"] == 2
    # never more running than slots, so never more memory than the budget
    assert sampler.counts and max(sampler.counts) <= slots
    assert max(sampler.counts) * size <= BUDGET_MIB * 2**20

    # The same run without the gate: the pool alone goes over (the resets, forks and steps of the groups
    # run at once), and the episodes are the same to the token (the gate changes when envs step only).
    ungated, ungated_stats, ungated_sampler, _, _ = _play(cfg, sandbox_config, admission=False)
    assert ungated_stats.failed == 0, ungated_stats.errors
    assert max(ungated_sampler.counts) > slots
    assert [(e.tokens, e.logprobs, e.step_rewards) for e in ungated] == [
        (e.tokens, e.logprobs, e.step_rewards) for e in episodes
    ]


def test_under_a_binding_budget_running_sandboxes_wait_running_and_step_first(sandbox_config):
    """Six episodes in two slots and a policy whose turns (3 s) are worth a pause for the cost model:
    the sandboxes still running at a generation hold their slots through it (no pause for the wait:
    the turn's steps pause and resume the episodes beyond the slots anyway) and step first, without a
    resume, so each turn resumes at most the episodes beyond the slots plus one."""
    cfg = compose(
        "env=kv_lookup",
        f"env.kwargs.data_mib={DATA_MIB}",
        "env.kwargs.max_turns=2",
        "rollout.env_threads=6",
        "rollout.sandbox_pool.pause_policy=cost",
        "rollout.policy_latency_s=3",
        "rollout.sandbox_pool.overrides.warm_starts=true",
        f"+rollout.sandbox_pool.overrides.memory_budget={BUDGET_MIB}m",
        "+rollout.sandbox_pool.overrides.idle_after_s=0",
    )
    engine = TorchEngine(build_policy(cfg.model, seed=0), TOK)
    instant = replace(cfg.rollout, policy_latency_s=0.0)  # measuring a sandbox needs no slow policy
    runner = EpisodeRunner(cfg.env, instant, engine, TOK, sandbox=sandbox_config)
    try:
        runner.run([1], group_size=2, generator=torch.Generator().manual_seed(0))  # measures a sandbox
        # the 3 s policy from here on, expected at its latency until its first call (as if it had played
        # that measuring run: its turns would have taken that long)
        runner.policy_latency_s = cfg.rollout.policy_latency_s
        runner._generate_s.clear()
        with RunningSampler(runner.sandbox_pool) as sampler:
            episodes, stats = runner.run([1, 2, 3], group_size=2, generator=torch.Generator().manual_seed(0))
        slots = runner.residency.slots()
    finally:
        runner.close()
    assert stats.failed == 0, stats.errors
    assert slots == 2 and max(sampler.counts) <= slots and not stats.pause_waits
    turns = max(e.turns for e in episodes)
    assert turns == 2 and stats.env_steps == 12
    assert stats.resumes <= stats.env_steps - turns * (slots - 1), (stats.resumes, stats.pauses)


def test_a_policy_too_fast_to_pay_for_pauses_plays_waves_that_fit_the_slots(sandbox_config):
    """Under a binding budget (two slots) and a policy that answers at once: once the pool measured its
    sandboxes, a run plays one group per wave, which fits the slots, so no env waits for a slot and no
    waiting sandbox is paused, while a policy that took a minute per turn would play them all at once
    (one wait of a minute and the pauses against three waits); with `pause_policy=always` the same run
    plays every episode at once and pauses the waiting sandboxes to fit."""
    cfg = compose(
        "env=kv_lookup",
        f"env.kwargs.data_mib={DATA_MIB}",
        "env.kwargs.max_turns=2",
        "rollout.env_threads=6",
        "rollout.sandbox_pool.overrides.warm_starts=true",
        f"+rollout.sandbox_pool.overrides.memory_budget={BUDGET_MIB}m",
    )
    seeds = [4, 5, 6]
    pool_cfg = replace(cfg.rollout.sandbox_pool, pause_policy="cost")
    engine = TorchEngine(build_policy(cfg.model, seed=0), TOK)
    runner = EpisodeRunner(cfg.env, replace(cfg.rollout, sandbox_pool=pool_cfg), engine, TOK,
                           sandbox=sandbox_config)
    try:
        runner.run([1], group_size=2, generator=torch.Generator().manual_seed(0))  # measures a sandbox
        assert runner.residency.slots() == 2
        episodes, stats = runner.run(seeds, group_size=2, generator=torch.Generator().manual_seed(1))
        # the same pool's costs against a policy that takes a minute per turn
        assert runner._groups_per_wave(2, 3) == 1
        runner.expected_generation_s = lambda batch_size: 60.0
        assert runner._groups_per_wave(2, 3) == 3  # one long wait beats three
        del runner.expected_generation_s
        # the same run under pause_policy=always, in the same measured pool (its two slots)
        runner.residency.configure("always", pool_cfg.admission)
        assert runner.residency.slots() == 2
        all_episodes, all_stats = runner.run(seeds, group_size=2, generator=torch.Generator().manual_seed(1))
    finally:
        runner.close()
    assert stats.waves == 3 and stats.slot_wait_s == 0 and not stats.pause_waits
    assert stats.failed == 0 and [e.seed for e in episodes] == [s for s in seeds for _ in range(2)]
    assert all_stats.waves == 1 and all_stats.slot_wait_s > 0 and all_stats.pause_waits
    assert all_stats.failed == 0 and len(all_episodes) == 6


def test_without_a_binding_budget_the_gate_never_waits_or_pauses(sandbox_config):
    """The default task under the default budget: its slots outnumber the episodes, so no env waits for
    one, and no sandbox is paused (pause_policy never): the same run as without a gate."""
    cfg = compose(
        "rollout.env_threads=4", "env.kwargs.max_turns=2", "rollout.sandbox_pool.pause_policy=never"
    )
    policy = build_policy(cfg.model, seed=0)
    runner = EpisodeRunner(cfg.env, cfg.rollout, TorchEngine(policy, TOK), TOK, sandbox=sandbox_config)
    try:
        episodes, stats = runner.run([1, 2], group_size=2, generator=torch.Generator().manual_seed(0))
        assert runner.residency.gates and not runner.residency.binds and runner.residency.slots() > 4
    finally:
        runner.close()
    assert stats.failed == 0 and stats.slot_wait_s == 0 and stats.pauses == 0


def test_a_start_that_made_no_sandbox_holds_no_slot(sandbox_config):
    """A reset that failed before its env had a sandbox (e.g. its create failed) gives its slot back at
    once: only the started env's sandbox holds one, and no later start waits for, or tries to pause, a
    sandbox that does not exist."""
    import fault_tasks  # noqa: F401  (registers faults/*)

    cfg = compose("env.kwargs.max_turns=2", "rollout.env_threads=4")
    env_cfg = replace(cfg.env, id="faults/NoSandboxOnOddSeeds-v0", group_start="seed")
    policy = build_policy(cfg.model, seed=0)
    runner = EpisodeRunner(env_cfg, cfg.rollout, TorchEngine(policy, TOK), TOK, sandbox=sandbox_config)
    episodes = [Episode(env_cfg.id, seed, group) for group, seed in enumerate([1, 2])]
    try:
        envs, owned = runner._start_groups([1, 2], 1, episodes, RolloutStats())
        assert [e.error is not None for e in episodes] == [True, False], [e.error for e in episodes]
        assert "no sandbox on purpose" in episodes[0].error
        assert runner.residency.held() == 1  # the started env's parked slot only
        runner._return_envs(envs, episodes, owned)
        assert runner.residency.held() == 1 and len(runner.free_envs) == 1  # the failed env was discarded
    finally:
        runner.close()


def test_a_snapshot_and_its_resume_finish_under_a_one_slot_budget(sandbox_config, tmp_path):
    """In-flight checkpoints under the tightest budget (1 byte: one slot): the snapshot's keep (pause,
    fork, keep) and the resume's restores take slots like steps do, and neither deadlocks."""
    from agentenv.owner import KEEPER_LABEL

    cfg = compose(
        "env.kwargs.max_turns=2",  # turn 2 plays on after the snapshot, and again after the resume
        "env.kwargs.num_values=9",
        "rollout.env_threads=4",
        "+rollout.sandbox_pool.overrides.memory_budget=1",
        "+rollout.sandbox_pool.overrides.idle_after_s=0",
        # every episode at once in the one slot (the cost model would play them in waves of one group)
        "rollout.sandbox_pool.pause_policy=always",
    )
    keeper = tmp_path / "keeper"
    keeper.mkdir()

    def runner(seed: int) -> EpisodeRunner:
        engine = TorchEngine(build_policy(cfg.model, seed=seed), TOK, cfg.rollout.temperature)
        return EpisodeRunner(replace(cfg.env, group_start="seed"), cfg.rollout, engine, TOK, sandbox_config)

    first, taken, calls = runner(0), {}, []

    def policy_version() -> int:  # called once per episode start (4), then once per turn
        calls.append(1)
        if len(calls) == 5:  # turn 1: ask for a snapshot, served at the start of turn 2
            taken["thread"] = threading.Thread(target=lambda: taken.update(r=first.snapshot(keeper, 120)))
            taken["thread"].start()
            while first._snapshot_request is None:
                threading.Event().wait(0.01)
        return 0

    kept: list[str] = []
    try:
        try:
            generator = torch.Generator().manual_seed(0)
            _, stats = first.run([11, 12], 2, generator, policy_version=policy_version)
            taken["thread"].join(timeout=120)
            assert first.residency.slots() == 1 and stats.failed == 0 and stats.slot_wait_s > 0
        finally:
            first.close()
        recorded, _tag = taken["r"]
        kept = [r.sandbox_id for r in recorded if r.playing]
        assert all(r.episode.turns == 1 for r in recorded if r.playing)
        assert kept and all(Sandbox.get(s).labels[KEEPER_LABEL] == str(keeper.resolve()) for s in kept)
        before = [(r.playing, r.episode.turns, list(r.episode.tokens)) for r in recorded]
        second = runner(1)
        try:  # (resume plays the recorded episodes in place)
            done, stats = second.resume(recorded, 2, torch.Generator().manual_seed(1))
            assert stats.failed == 0 and stats.episodes == 4 and second.residency.held() <= 1
        finally:
            second.close()
        for (playing, turns, tokens), episode in zip(before, done, strict=True):  # went on from there
            assert episode.tokens[: len(tokens)] == tokens
            assert episode.turns > turns if playing else episode.turns == turns
    finally:
        for sandbox_id in kept:  # the checkpoint's sandboxes: gone with it
            Sandbox.get(sandbox_id).close()


def test_a_parked_sandbox_whose_pause_fails_keeps_its_slot_until_a_pause_succeeds(sandbox_config):
    """One slot, held by a parked sandbox whose first pause fails (it keeps running): a waiter must not
    get the slot then, only once a later pause of it succeeds."""
    import uuid

    from agentenv import SandboxConfig, SandboxPool
    from agentenv.pool.residency import Residency

    pool = SandboxPool(f"gate-{uuid.uuid4().hex[:6]}", memory_budget="100m", idle_after_s=0.0)
    holder = Sandbox.create(config=SandboxConfig.load(**{**sandbox_config, "labels": {}}))
    pauses: list[str] = []

    def pause(sb: Sandbox) -> bool:
        pauses.append(sb.status)
        if len(pauses) == 1:
            return False  # as when CRIU refuses the dump: the sandbox runs on
        sb.pause()
        return True

    gate = Residency(pool, pause_fn=pause, running_fn=lambda sb: sb.status == "running")
    gate.fallback_bytes = 60 * 1024**2  # no member measured: one slot of the 100 MiB budget
    try:
        assert gate.slots() == 1
        assert gate.acquire(1)[0] == 1
        gate.bind(holder)  # running, parked between its turns
        taken, waited_s = gate.acquire(1)  # the other start: evicts the holder, which fails once
        assert taken == 1 and waited_s > 0
        assert pauses == ["running", "running"]  # the failed pause kept the slot; the retry freed it
        assert holder.status == "paused"
    finally:
        holder.close()
