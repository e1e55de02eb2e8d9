"""SandboxPool: many sandboxes under a memory budget, LRU pausing of idle ones, warm starts (pool.py)."""

from agentenv.pool.pool import PoolBudgetExceeded, PooledSandbox, PoolMetrics, SandboxPool
from agentenv.pool.settings import PoolSettings

__all__ = ["PoolBudgetExceeded", "PoolMetrics", "PoolSettings", "PooledSandbox", "SandboxPool"]
