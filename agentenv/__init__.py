"""AgentENV: Docker sandboxes that CRIU pauses to zero memory, resumes and forks.

    from agentenv import Sandbox
    sb = Sandbox.create(image="base"); sb.exec("echo hi").stdout

Every kind of sandbox (local, pool member, remote) is a `SandboxHandle` (agentenv.api); see docs/agentenv.md.

Design: docs/design/sandboxes.md#agentenv.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from agentenv.errors import (
    AgentEnvError,
    BackendUnavailable,
    CheckpointError,
    ExecTimeout,
    FileNotFoundInSandbox,
    InvalidArgument,
    PathOutsideWorkspace,
    PoolBudgetExceeded,
    SandboxBusy,
    SandboxNotFound,
    SandboxStateError,
)

if TYPE_CHECKING:
    from agentenv.api import SandboxFactory, SandboxHandle, ShellSession
    from agentenv.config import SandboxConfig
    from agentenv.pool import PoolMetrics, SandboxPool
    from agentenv.results import ExecResult, SandboxStats
    from agentenv.sandbox import Sandbox

# Only the errors load with the package: every other name loads on its first use, so that importing any
# module of it (the `agentenv` command, a remote client) pays only for what it uses. The local runtime
# (Docker client, CRIU backend, registry) is behind `Sandbox` and the pool; the configs read YAML.
_LAZY = {"Sandbox": "agentenv.sandbox", "SandboxPool": "agentenv.pool", "PoolMetrics": "agentenv.pool",
         "SandboxFactory": "agentenv.api", "SandboxHandle": "agentenv.api", "ShellSession": "agentenv.api",
         "SandboxConfig": "agentenv.config", "ExecResult": "agentenv.results",
         "SandboxStats": "agentenv.results"}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'agentenv' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


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
