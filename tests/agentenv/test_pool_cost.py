"""`PauseCostModel`: pause a waiting sandbox iff over budget or the wait exceeds the pool's pause +
resume p50s (priors of conf/agentenv/pool.yaml until measured `cost_min_samples` times)."""

from __future__ import annotations

import uuid

import pytest

from agentenv.pool import PAUSE_POLICIES, PauseCostModel, SandboxPool


@pytest.fixture
def pool(agentenv_home):
    """A pool with no members: its event log is what the cost model reads."""
    p = SandboxPool(f"cost-{uuid.uuid4().hex[:6]}", memory_budget="1m", cost_min_samples=3,
                    pause_prior_s=0.25, resume_prior_s=0.3)
    yield p
    p.close()


def test_priors_until_measured_then_the_pools_live_p50s(pool):
    model = PauseCostModel(pool)
    assert model.cost_s() == pytest.approx(0.55)
    for d in (0.1, 0.2, 2.0):  # the pool's measured pauses (what `SandboxPool._timed` records)
        pool.state.record("pause", d)
    for d in (0.4, 0.5):
        pool.state.record("resume", d)
    assert model.cost_s() == pytest.approx(0.2 + 0.3)  # live pause p50; resumes still on their prior
    pool.state.record("resume", 0.6)
    assert model.cost_s() == pytest.approx(0.2 + 0.5)
    keep, pause = model.decide(0.69, running_bytes=0), model.decide(0.71, running_bytes=0)
    assert (keep.pause, keep.reason) == (False, "keep") and (pause.pause, pause.reason) == (True, "cost")
    assert pause.expected_wait_s == 0.71 and pause.cost_s == pytest.approx(0.7)


def test_over_budget_always_pauses_and_the_fixed_policies(pool):
    over = pool.settings.memory_budget + 1
    decision = PauseCostModel(pool).decide(0.0, running_bytes=over)
    assert (decision.pause, decision.reason) == (True, "budget")
    assert PauseCostModel(pool).decide(0.0).pause is False  # no running member: 0 bytes, under budget
    assert PauseCostModel(pool, "never").decide(100.0, running_bytes=over).pause is False
    assert PauseCostModel(pool, "always").decide(0.0, running_bytes=0).pause is True
    assert PAUSE_POLICIES == ("cost", "never", "always")
    with pytest.raises(ValueError, match="pause policy must be one of cost, never, always"):
        PauseCostModel(pool, "sometimes")
