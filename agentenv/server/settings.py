"""`ServerSettings`: listen address, limits and timings of `agentenv serve` (conf/agentenv/server.yaml)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentenv.errors import ConfigError
from agentenv.settings import Size, build, load_settings, setting

WHAT = "server config"
ENV_VAR = "AGENTENV_SERVER_CONFIG"


@dataclass(frozen=True)
class ServerSettings:
    """See conf/agentenv/server.yaml for the meaning of each field."""

    host: str = setting(check=(bool, "an address to listen on"))
    port: int = setting(min=1, max=65535)
    default_timeout_s: int = setting(above=0)
    max_timeout_s: int = setting(above=0)
    max_body_bytes: Size
    ttl_check_interval_s: float = setting(above=0)
    liveness_check_interval_s: float = setting(above=0)
    output_poll_s: float = setting(above=0)
    list_limit: int = setting(min=1)
    worker_threads: int = setting(min=1, max=1024)
    envd_version: str
    memory_reserve_mib: int = setting(min=0, default=0)

    def __post_init__(self) -> None:
        if self.default_timeout_s > self.max_timeout_s:
            raise ConfigError(f"default_timeout_s must be <= max_timeout_s ({self.max_timeout_s}), got "
                              f"{self.default_timeout_s}")

    @classmethod
    def load(cls, path: str | Path | None = None, **overrides: Any) -> ServerSettings:
        """Values from `path` (default: conf/agentenv/server.yaml), then `overrides` (None ignored)."""
        return load_settings(cls, WHAT, path, overrides, env_var=ENV_VAR, file_name="server.yaml")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ServerSettings:
        return build(cls, data, WHAT)
