"""`PauseCostModel`: should a sandbox that waits (on a policy, a queue) be paused for the wait?

A pause frees the sandbox's memory but is not free: the pause itself (CRIU dump) runs while the sandbox
waits, and the resume (restore) sits on the path of its next command. So a wait is worth pausing for
only when it is longer than both together:

    pause  iff  over budget  or  expected_wait_s > pause_p50_s + resume_p50_s

The p50s are the pool's own, live (its event log, the last `metrics_window` events of each kind), so
the break-even follows the sandboxes' real size and the disk's speed; until the pool has measured
`cost_min_samples` pauses (resumes), the prior `pause_prior_s` (`resume_prior_s`) of
conf/agentenv/pool.yaml stands in. Over the memory budget (RSS of the running members above
`memory_budget`) a waiting sandbox is paused whatever the wait: the budget is a limit, not a trade-off.

The expected wait is the caller's to estimate (e.g. `rl.rollout.EpisodeRunner`: the p50 of its recent
generation calls of the same batch size). Policies: ``cost`` (the rule above), ``never`` (waiting
sandboxes keep running; the pool's budget still pauses idle members it may take), ``always`` (every
wait pauses: for measuring, or tasks whose memory matters more than their latency).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from agentenv.pool.pool import SandboxPool

PAUSE_POLICIES = ("cost", "never", "always")


@dataclass(frozen=True)
class PauseDecision:
    """One decision: pause or keep, why (``budget``, ``cost``, ``keep``, ``always``, ``never``), the wait
    it was made for and the pause + resume cost it was weighed against (seconds)."""

    pause: bool
    reason: str
    expected_wait_s: float
    cost_s: float


class PauseCostModel:
    """The rule of the module docstring for one pool, with one of `PAUSE_POLICIES`."""

    def __init__(self, pool: SandboxPool, policy: str = "cost") -> None:
        if policy not in PAUSE_POLICIES:
            raise ValueError(f"pause policy must be one of {', '.join(PAUSE_POLICIES)}, got {policy!r}")
        self.pool = pool
        self.policy = policy

    def _p50(self, kind: str, prior: float) -> float:
        s = self.pool.settings
        if self.pool.state.count(kind) < s.cost_min_samples:
            return prior
        p50 = self.pool.state.percentiles(kind, s.metrics_window)[0]
        return prior if math.isnan(p50) else p50

    def cost_s(self) -> float:
        """Pause p50 + resume p50: live once measured `cost_min_samples` times each, else the priors."""
        s = self.pool.settings
        return self._p50("pause", s.pause_prior_s) + self._p50("resume", s.resume_prior_s)

    def decide(self, expected_wait_s: float, running_bytes: int | None = None) -> PauseDecision:
        """Pause or keep a sandbox about to wait ``expected_wait_s``; ``running_bytes``: RSS of the
        running members (None: measured now, `SandboxPool.running_bytes`)."""
        cost = self.cost_s()
        if self.policy == "never":
            return PauseDecision(False, "never", expected_wait_s, cost)
        if self.policy == "always":
            return PauseDecision(True, "always", expected_wait_s, cost)
        used = self.pool.running_bytes() if running_bytes is None else running_bytes
        if used > self.pool.settings.memory_budget:
            return PauseDecision(True, "budget", expected_wait_s, cost)
        if expected_wait_s > cost:
            return PauseDecision(True, "cost", expected_wait_s, cost)
        return PauseDecision(False, "keep", expected_wait_s, cost)
