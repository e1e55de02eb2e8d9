"""`ServerSettings`: listen address, limits and timings of `agentenv serve` (conf/agentenv/server.yaml)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentenv.config import parse_size, read_settings, require_exact_keys
from agentenv.errors import ConfigError


@dataclass(frozen=True)
class ServerSettings:
    """See conf/agentenv/server.yaml for the meaning of each field."""

    host: str
    port: int
    default_timeout_s: int
    max_timeout_s: int
    max_body_bytes: int
    ttl_check_interval_s: float
    output_poll_s: float
    list_limit: int
    envd_version: str

    @classmethod
    def load(cls, path: str | Path | None = None, **overrides: Any) -> ServerSettings:
        """Values from `path` (default: conf/agentenv/server.yaml), then `overrides` (None ignored)."""
        return cls.from_dict(read_settings(path, "AGENTENV_SERVER_CONFIG", "server.yaml", "server config",
                                           overrides))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ServerSettings:
        require_exact_keys(data, cls, "server config")
        try:
            s = cls(
                host=str(data["host"]),
                port=int(data["port"]),
                default_timeout_s=int(data["default_timeout_s"]),
                max_timeout_s=int(data["max_timeout_s"]),
                max_body_bytes=parse_size(data["max_body_bytes"], "max_body_bytes"),
                ttl_check_interval_s=float(data["ttl_check_interval_s"]),
                output_poll_s=float(data["output_poll_s"]),
                list_limit=int(data["list_limit"]),
                envd_version=str(data["envd_version"]),
            )
        except (TypeError, ValueError) as e:
            if isinstance(e, ConfigError):
                raise
            raise ConfigError(f"server config has a value of the wrong type: {e}") from None
        if not 1 <= s.port <= 65535:
            raise ConfigError(f"server config: port must be from 1 to 65535, got {s.port}")
        if not 0 < s.default_timeout_s <= s.max_timeout_s:
            raise ConfigError("server config: need 0 < default_timeout_s <= max_timeout_s")
        if s.ttl_check_interval_s <= 0 or s.output_poll_s <= 0 or s.list_limit < 1:
            raise ConfigError("server config: ttl_check_interval_s and output_poll_s must be > 0, "
                              "list_limit >= 1")
        return s
