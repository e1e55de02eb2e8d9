"""`agentenv.pool.residency`: a pool's one owner of which sandboxes run, keyed by sandbox handle. A task
leases its sandbox per call (reset, step), so between its calls the residency may pause it without any
release from outside; a slot follows its owner to a new sandbox; remote sandboxes get a residency that
does nothing."""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from agentenv import SandboxConfig
from agentenv.factory import PooledSandboxes
from agentenv.pool import NoResidency, SandboxPool
from agentenv.tasks.guess_number import GuessNumber

pytestmark = pytest.mark.docker


@pytest.fixture
def make_pool(base_image):
    config = SandboxConfig.load(memory="128m", pids_limit=64, tmpfs={"/tmp": "size=32m,mode=1777"},
                                exec_timeout_s=60.0, lock_timeout_s=120.0)
    made: list[SandboxPool] = []

    def make(**overrides) -> SandboxPool:
        made.append(SandboxPool(f"residency-{uuid.uuid4().hex[:6]}", config=config, warm_starts=False,
                                **overrides))
        return made[-1]

    yield make
    for pool in made:
        pool.close()


def test_between_its_calls_a_tasks_sandbox_runs_unleased_and_the_residency_may_pause_it(make_pool):
    pool = make_pool()
    env = GuessNumber(max_turns=4, sandbox={"config": pool.config}, sandboxes=PooledSandboxes(pool))
    try:
        env.reset(seed=3)
        assert env.sandbox.status == "running" and env._lease is None  # the reset's lease ended with it
        pool.residency.configure("always", admission=False)  # every wait pauses
        with ThreadPoolExecutor(1) as threads:
            with pool.residency.waiting([env.sandbox], 1.0, threads.submit) as waited:
                pass
        assert waited.paused == 1 and env.paused  # nothing had to release it first
        _, _, terminated, truncated, _ = env.step("50")  # the step's lease resumes it
        assert env.sandbox.status == "running" and env._lease is None
        assert terminated or truncated or pool.pause(env.sandbox)  # unleased after the step too
    finally:
        env.close()


def test_a_slot_follows_its_owner_to_a_new_sandbox_and_a_start_pauses_a_parked_one(make_pool):
    pool = make_pool(memory_budget="1", idle_after_s=3600.0)  # one slot; the LRU pauses nothing
    residency = pool.residency.configure("always", admission=True)
    first = pool.create()
    with residency.running(None) as slot:  # a reset of an owner with no sandbox yet
        slot.handle = first
    assert residency.parked(first) and residency.held() == 1
    assert residency.slots() == 1 and residency.metrics()["slots"] == 1
    second = pool.create()
    with residency.running(first) as slot:  # a reset that replaced the owner's sandbox
        assert slot.held and not residency.parked(first)
        slot.handle = second
    assert residency.parked(second) and not residency.parked(first) and residency.held() == 1
    with residency.starting(1) as start:  # no free slot: the parked sandbox is paused for it
        assert start.taken == 1 and start.waited_s > 0 and second.status == "paused"
    assert residency.held() == 0


def test_remote_sandboxes_get_a_residency_that_does_nothing():
    nothing = NoResidency()
    assert nothing.plan(2, 5, lambda n: 60.0, cores=1) == 5
    with nothing.waiting([object()], 100.0, submit=None) as waited:
        pass
    assert waited.decision is None and waited.paused == 0
    with nothing.starting(3) as start:
        assert start.taken == 3
    assert nothing.metrics()["slots"] == 0
