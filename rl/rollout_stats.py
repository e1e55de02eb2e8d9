"""`RolloutStats`: the counters of one rollout call, summed over workers by the driver.

Its own module so that the driver (trainer, sources, worker group) reads rollout counters without
importing the runner, and the runner's parts (trees, agent programs) share them.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

from rl.episode import EpisodeSummary


@dataclass
class RolloutStats:
    """Counters of one `EpisodeRunner.run` call (summed over workers by the driver)."""

    episodes: int = 0
    failed: int = 0
    env_steps: int = 0
    generated_tokens: int = 0
    context_tokens: int = 0  # tokens of the contexts generated from (one per episode and turn)
    context_tokens_read: int = 0  # ... of them, those the engine computed (not from a cache or carried state)
    reset_s: float = 0.0
    generate_s: float = 0.0
    env_step_s: float = 0.0
    total_s: float = 0.0
    pauses: int = 0  # by the sandbox pool during this run
    resumes: int = 0
    forks: int = 0
    fork_s: float = 0.0  # each group's fork latency, summed over groups (they fork at once)
    fork_phase_s: float = 0.0  # wall time of the fork phases: with `forks`, the cost per forked member
    state_copies: int = 0  # a tree's copies of a branching leaf's policy state, one per extra child
    state_copy_s: float = 0.0  # ... their seconds, summed
    state_copy_bytes: int = 0  # ... the bytes of the model cache they copied, summed
    sandboxes_created: int = 0  # by the resets: a new env's, and a new one after each played episode
    sandbox_running_s: float = 0.0  # sandbox-seconds of the pool's members running since the last run
    sandbox_paused_s: float = 0.0  # ... and paused
    pause_waits: list[float] = field(default_factory=list)  # the expected wait that triggered each pause
    slot_wait_s: float = 0.0  # seconds envs waited for a sandbox slot (the residency's), summed
    waves: int = 0  # waves the groups were played in (`EpisodeRunner._groups_per_wave`)
    close_errors: int = 0  # envs whose close raised (logged; the sandbox may be left behind)
    errors: list[str] = field(default_factory=list)
    pool: list[dict] = field(default_factory=list)  # `PoolMetrics.to_dict()` of each worker's pool
    outcomes: list[EpisodeSummary] = field(default_factory=list)  # one per episode, in the episodes' order

    def merge(self, other: RolloutStats) -> None:
        for name, value in vars(other).items():
            if isinstance(value, list):
                getattr(self, name).extend(value)
            else:
                setattr(self, name, getattr(self, name) + value)

    def pool_summary(self) -> dict[str, float]:
        """The workers' pools as trainer metrics: sizes summed, latency percentiles the worst worker's."""
        out: dict[str, float] = {}
        for key in ("running", "paused", "over_budget", "warm_starts", "memory_used_bytes", "disk_bytes"):
            out[f"sandbox_pool_{key}"] = float(sum(p[key] for p in self.pool))
        for key in ("pause_p50_s", "pause_p90_s", "resume_p50_s", "resume_p90_s", "warm_start_p50_s"):
            values = [p[key] for p in self.pool if not math.isnan(p[key])]
            out[f"sandbox_{key}"] = max(values, default=0.0)
        out["sandbox_running_bytes"] = float(sum(p.get("running_bytes", 0.0) for p in self.pool))
        out["sandbox_slots"] = float(sum(p.get("slots", 0) for p in self.pool))
        out["sandbox_slot_wait_s"] = self.slot_wait_s
        out["rollout_waves"] = float(self.waves)
        out["sandbox_running_s"] = self.sandbox_running_s
        out["sandbox_paused_s"] = self.sandbox_paused_s
        out["pauses_per_episode"] = self.pauses / self.episodes if self.episodes else 0.0
        out["waiting_pauses"] = float(len(self.pause_waits))
        out["pause_trigger_wait_p50_s"] = statistics.median(self.pause_waits) if self.pause_waits else 0.0
        return out
