"""`PauseCostModel`: how many of the sandboxes about to wait (on a policy, a queue) to pause for the wait.

A pause frees a sandbox's memory but is not free: the pause (CRIU dump) runs while the sandbox waits,
the resume (restore) sits on the path of its next command, and both burn CPU in dockerd, containerd and
CRIU that the learner and the policy on the same host would otherwise use. So, for ``n`` sandboxes about
to wait ``expected_wait_s``:

* **over budget** (RSS of the running members above `memory_budget`): pause only as many as the budget
  needs, the largest first (reason ``budget``): the budget is a limit, not a trade-off;
* **under budget**, pause all ``n`` only when both hold (reason ``cost``), else none (``keep``, or
  ``cpu`` when the wall time alone would have paused):

      expected_wait_s > pause_p50_s + resume_p50_s                              (wall time)
      n × (pause_cpu_p50_s + resume_cpu_p50_s) <= spare_cores × expected_wait_s  (CPU)

  i.e. the dumps and restores fit in the cores the host leaves idle over the wait, so memory nobody asked
  for is freed only when freeing it takes nothing from the run.

The p50s (wall and CPU seconds) are the pool's own, live (its event log, the last `metrics_window`
events of each kind; CPU: `agentenv.pool.cpu.OpCpu`), so the break-even follows the sandboxes' real size,
the disk and the host; until the pool has measured `cost_min_samples` pauses (resumes), the priors of
conf/agentenv/pool.yaml stand in. The spare cores are measured (`agentenv.pool.cpu.SpareCores`, the host's
idle share over the last `cpu_window_s`), never configured.

The expected wait is the caller's to estimate (e.g. `rl.rollout.runner.EpisodeRunner`: the p50 of its recent
generation calls of the same batch size). Policies: ``cost`` (the rule above), ``never`` (waiting
sandboxes keep running; the pool's budget still pauses idle members it may take), ``always`` (every
wait pauses: for measuring, or tasks whose memory matters more than their latency).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from agentenv.pool.cpu import SpareCores
from agentenv.pool.settings import PoolSettings
from agentenv.pool.state import PoolState

PAUSE_POLICIES = ("cost", "never", "always")


class MeasuredPool(Protocol):
    """What the cost model reads of a pool (an `agentenv.pool.SandboxPool`)."""

    settings: PoolSettings
    state: PoolState

    def running_bytes(self) -> int: ...


@dataclass(frozen=True)
class PauseDecision:
    """One decision for ``n`` waiting sandboxes: how many to pause (`count`; the largest first when
    `sizes` were given), why (``budget``, ``cost``, ``cpu``, ``keep``, ``always``, ``never``), the wait it
    was made for, the pause + resume wall seconds and CPU seconds (per sandbox) it was weighed against,
    and the spare cores measured (NaN: not needed for this decision)."""

    count: int
    reason: str
    expected_wait_s: float
    cost_s: float
    cpu_s: float = math.nan
    spare_cores: float = math.nan

    @property
    def pause(self) -> bool:
        """Any sandbox to pause."""
        return self.count > 0


def budget_count(sizes: Sequence[int], used: int, budget: int) -> int:
    """How many of the sandboxes of RSS ``sizes`` (largest first) must pause for ``used`` to fit
    ``budget``; all of them when that is not enough, or when a size is unknown (0)."""
    if used <= budget:
        return 0
    freed = 0
    for k, size in enumerate(sorted(sizes, reverse=True), start=1):
        if size <= 0:
            return len(sizes)
        freed += size
        if used - freed <= budget:
            return k
    return len(sizes)


class PauseCostModel:
    """The rule of the module docstring for one pool, with one of `PAUSE_POLICIES`. ``spare_cores``:
    the host's idle cores now (default: a `SpareCores` over the pool's `cpu_window_s`)."""

    def __init__(self, pool: MeasuredPool, policy: str = "cost",
                 spare_cores: Callable[[], float] | None = None) -> None:
        if policy not in PAUSE_POLICIES:
            raise ValueError(f"pause policy must be one of {', '.join(PAUSE_POLICIES)}, got {policy!r}")
        self.pool = pool
        self.policy = policy
        self.spare_cores = spare_cores or SpareCores(pool.settings.cpu_window_s)

    def _p50(self, kind: str, prior: float, column: str = "duration_s") -> float:
        s = self.pool.settings
        if self.pool.state.count(kind) < s.cost_min_samples:
            return prior
        p50 = self.pool.state.percentiles(kind, s.metrics_window, column)[0]
        return prior if math.isnan(p50) else p50

    def cost_s(self) -> float:
        """Pause p50 + resume p50 (wall): live once measured `cost_min_samples` times each, else priors."""
        s = self.pool.settings
        return self._p50("pause", s.pause_prior_s) + self._p50("resume", s.resume_prior_s)

    def cpu_s(self) -> float:
        """Pause + resume CPU seconds p50 of one sandbox: live as `cost_s`, else the CPU priors."""
        s = self.pool.settings
        return (self._p50("pause", s.pause_cpu_prior_s, "cpu_s")
                + self._p50("resume", s.resume_cpu_prior_s, "cpu_s"))

    def decide(self, expected_wait_s: float, running_bytes: int | None = None, n: int = 1,
               sizes: Sequence[int] | None = None) -> PauseDecision:
        """How many of ``n`` sandboxes about to wait ``expected_wait_s`` to pause. ``running_bytes``: RSS
        of the running members (None: measured now, `SandboxPool.running_bytes`); ``sizes``: the waiting
        sandboxes' RSS (what pausing each frees; unknown: all pause when over budget)."""
        cost = self.cost_s()
        if self.policy == "never":
            return PauseDecision(0, "never", expected_wait_s, cost)
        if self.policy == "always":
            return PauseDecision(n, "always", expected_wait_s, cost)
        used = self.pool.running_bytes() if running_bytes is None else running_bytes
        budget = self.pool.settings.memory_budget
        if used > budget:
            count = budget_count(sizes if sizes is not None else [0] * n, used, budget)
            return PauseDecision(min(count, n), "budget", expected_wait_s, cost)
        cpu = self.cpu_s()
        if n <= 0 or expected_wait_s <= cost:
            return PauseDecision(0, "keep", expected_wait_s, cost, cpu)
        spare = self.spare_cores()
        if n * cpu > spare * expected_wait_s:
            return PauseDecision(0, "cpu", expected_wait_s, cost, cpu, spare)
        return PauseDecision(n, "cost", expected_wait_s, cost, cpu, spare)
