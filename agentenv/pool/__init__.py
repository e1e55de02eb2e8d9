"""SandboxPool: many sandboxes under a memory budget, LRU pausing of idle ones, warm starts (pool.py);
whether a waiting sandbox is worth pausing (cost.py)."""

from agentenv.errors import PoolBudgetExceeded
from agentenv.pool.cost import PAUSE_POLICIES, PauseCostModel, PauseDecision
from agentenv.pool.pool import PooledSandbox, PooledSession, PoolMetrics, SandboxPool
from agentenv.pool.settings import PoolSettings

__all__ = [
    "PAUSE_POLICIES",
    "PauseCostModel",
    "PauseDecision",
    "PoolBudgetExceeded",
    "PoolMetrics",
    "PoolSettings",
    "PooledSandbox",
    "PooledSession",
    "SandboxPool",
]
