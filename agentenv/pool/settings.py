"""`PoolSettings`: the SandboxPool's budget and thresholds, from conf/agentenv/pool.yaml."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

from agentenv.settings import Size, build, load_settings, setting

# criu: a pause checkpoints the sandbox to disk (no memory, no CPU); freeze: `docker pause` (cgroup
# freezer: no CPU, the memory stays, so it still counts against the budget and frees no room)
PauseMethod = Literal["criu", "freeze"]
PAUSE_METHODS: tuple[str, ...] = get_args(PauseMethod)
WHAT = "pool config"
ENV_VAR = "AGENTENV_POOL_CONFIG"


@dataclass(frozen=True)
class PoolSettings:
    """See conf/agentenv/pool.yaml for the meaning of each field."""

    memory_budget: Size
    idle_after_s: float = setting(min=0)
    warm_starts: bool
    strict_budget: bool
    lease_timeout_s: float = setting(above=0)
    lock_timeout_s: float = setting(above=0)
    metrics_window: int = setting(min=1)
    rss_refresh_s: float = setting(min=0)
    pause_prior_s: float = setting(min=0)
    resume_prior_s: float = setting(min=0)
    pause_cpu_prior_s: float = setting(min=0)
    resume_cpu_prior_s: float = setting(min=0)
    cpu_window_s: float = setting(above=0)
    cost_min_samples: int = setting(min=1)
    pause_method: PauseMethod

    @classmethod
    def load(cls, path: str | Path | None = None, **overrides: Any) -> PoolSettings:
        """Values from `path` (default: conf/agentenv/pool.yaml), then `overrides` (None ignored)."""
        return load_settings(cls, WHAT, path, overrides, env_var=ENV_VAR, file_name="pool.yaml")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PoolSettings:
        return build(cls, data, WHAT)
