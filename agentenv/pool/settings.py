"""`PoolSettings`: the SandboxPool's budget and thresholds, from conf/agentenv/pool.yaml."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentenv.config import parse_size, read_settings, require_exact_keys
from agentenv.errors import ConfigError

# criu: a pause checkpoints the sandbox to disk (no memory, no CPU); freeze: `docker pause` (cgroup
# freezer: no CPU, the memory stays, so it still counts against the budget and frees no room)
PAUSE_METHODS = ("criu", "freeze")


@dataclass(frozen=True)
class PoolSettings:
    """See conf/agentenv/pool.yaml for the meaning of each field."""

    memory_budget: int
    idle_after_s: float
    warm_starts: bool
    strict_budget: bool
    lease_timeout_s: float
    lock_timeout_s: float
    metrics_window: int
    rss_refresh_s: float
    pause_prior_s: float
    resume_prior_s: float
    cost_min_samples: int
    pause_method: str

    @classmethod
    def load(cls, path: str | Path | None = None, **overrides: Any) -> PoolSettings:
        """Values from `path` (default: conf/agentenv/pool.yaml), then `overrides` (None ignored)."""
        return cls.from_dict(read_settings(path, "AGENTENV_POOL_CONFIG", "pool.yaml", "pool config",
                                           overrides))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PoolSettings:
        require_exact_keys(data, cls, "pool config")
        for flag in ("warm_starts", "strict_budget"):
            if not isinstance(data[flag], bool):
                raise ConfigError(f"pool config: {flag} must be true or false, got {data[flag]!r}")
        try:
            s = cls(
                memory_budget=parse_size(data["memory_budget"], "memory_budget"),
                idle_after_s=float(data["idle_after_s"]),
                warm_starts=data["warm_starts"],
                strict_budget=data["strict_budget"],
                lease_timeout_s=float(data["lease_timeout_s"]),
                lock_timeout_s=float(data["lock_timeout_s"]),
                metrics_window=int(data["metrics_window"]),
                rss_refresh_s=float(data["rss_refresh_s"]),
                pause_prior_s=float(data["pause_prior_s"]),
                resume_prior_s=float(data["resume_prior_s"]),
                cost_min_samples=int(data["cost_min_samples"]),
                pause_method=str(data["pause_method"]),
            )
        except (TypeError, ValueError) as e:
            if isinstance(e, ConfigError):
                raise
            raise ConfigError(f"pool config has a value of the wrong type: {e}") from None
        if (
            s.idle_after_s < 0
            or s.lease_timeout_s <= 0
            or s.lock_timeout_s <= 0
            or s.metrics_window < 1
            or s.rss_refresh_s < 0
            or s.pause_prior_s < 0
            or s.resume_prior_s < 0
            or s.cost_min_samples < 1
        ):
            raise ConfigError(
                "pool config: idle_after_s must be >= 0, lease_timeout_s and lock_timeout_s > 0, "
                "metrics_window >= 1, rss_refresh_s, pause_prior_s and resume_prior_s >= 0, "
                "cost_min_samples >= 1"
            )
        if s.pause_method not in PAUSE_METHODS:
            raise ConfigError(
                f"pool config: pause_method must be one of {', '.join(PAUSE_METHODS)}, got {s.pause_method!r}"
            )
        return s
