"""SandboxPool: many sandboxes under a memory budget, warm starts (pool.py); which of them run, wait or
pause under that budget (residency.py); whether a waiting sandbox is worth pausing (cost.py)."""

from agentenv.errors import PoolBudgetExceeded
from agentenv.pool.cost import PAUSE_POLICIES, PauseCostModel, PauseDecision
from agentenv.pool.pool import PooledSandbox, PooledSession, PoolMetrics, SandboxPool
from agentenv.pool.residency import NoResidency, Residency
from agentenv.pool.settings import PoolSettings

__all__ = [
    "PAUSE_POLICIES",
    "NoResidency",
    "PauseCostModel",
    "PauseDecision",
    "PoolBudgetExceeded",
    "PoolMetrics",
    "PoolSettings",
    "PooledSandbox",
    "PooledSession",
    "Residency",
    "SandboxPool",
]
