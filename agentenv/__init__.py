"""AgentENV: Docker sandboxes that CRIU pauses to zero memory, resumes and forks.

    from agentenv import Sandbox
    sb = Sandbox.create(image="base")
    sb.exec("echo hi").stdout      # 'hi\\n'
    sb.pause(); sb.resume(); forks = sb.fork(4)

Every kind of sandbox (local, pool member, remote) is a `SandboxHandle` (agentenv.api). See docs/agentenv.md
for the API, the CLI, the security defaults and the limits of pause/fork.
"""

from agentenv.api import SandboxFactory, SandboxHandle, ShellSession
from agentenv.config import SandboxConfig
from agentenv.errors import (
    AgentEnvError,
    BackendUnavailable,
    CheckpointError,
    ExecTimeout,
    FileNotFoundInSandbox,
    InvalidArgument,
    PathOutsideWorkspace,
    SandboxBusy,
    SandboxNotFound,
    SandboxStateError,
)
from agentenv.pool import PoolBudgetExceeded, PoolMetrics, SandboxPool
from agentenv.results import ExecResult, SandboxStats
from agentenv.sandbox import Sandbox

__all__ = [
    "AgentEnvError",
    "BackendUnavailable",
    "CheckpointError",
    "ExecResult",
    "ExecTimeout",
    "FileNotFoundInSandbox",
    "InvalidArgument",
    "PathOutsideWorkspace",
    "PoolBudgetExceeded",
    "PoolMetrics",
    "Sandbox",
    "SandboxBusy",
    "SandboxConfig",
    "SandboxFactory",
    "SandboxHandle",
    "SandboxNotFound",
    "SandboxPool",
    "SandboxStateError",
    "SandboxStats",
    "ShellSession",
]
