"""The run config: typed schemas of ``conf/`` (`RunConfig` and one dataclass per group), loaded and
checked up front by `load`. A bad value stops the run with one `ConfigError` line naming the key and
the file to fix, before Ray or any sandbox starts.

`ConfigError` is the project's one config error (AgentENV's `agentenv.errors.ConfigError`).
"""

from agentenv.errors import ConfigError
from rl.config.load import load, register_schemas
from rl.config.schema import (
    AlgoConfig,
    EnvConfig,
    OptimConfig,
    RolloutConfig,
    RunConfig,
    SandboxPoolConfig,
    TokenizerConfig,
    TrainerConfig,
)

__all__ = [
    "AlgoConfig",
    "ConfigError",
    "EnvConfig",
    "OptimConfig",
    "RolloutConfig",
    "RunConfig",
    "SandboxPoolConfig",
    "TokenizerConfig",
    "TrainerConfig",
    "load",
    "register_schemas",
]

register_schemas()  # at import, so that group files of `python -m rl.train` can name them in defaults
