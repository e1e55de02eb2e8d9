"""The run config: typed schemas of ``conf/`` (`RunConfig` and one dataclass per group), loaded and
checked up front by `rl.config.load.load`. A bad value stops the run with one `ConfigError` line naming
the key and the file to fix, before Ray or any sandbox starts.

`ConfigError` is the project's one config error (AgentENV's `agentenv.errors.ConfigError`). This package
holds only the schemas: the loader's checks import the engines and the env wrappers, which import the
schemas, so every import of a schema would run the loader (and close a circle) if this file imported it.
"""

from agentenv.errors import ConfigError
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
]
