"""`SandboxConfig`: the security profile and resource limits of a sandbox.

The defaults live in conf/sandbox/default.yaml (the Hydra group `sandbox`), not in this module: the
dataclass has no field defaults (but `labels`), so a value is either read from that file or given by the
caller; `agentenv.settings` converts and checks each value by its field's type and declared constraints.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from agentenv.errors import ConfigError
from agentenv.paths import default_config_path
from agentenv.settings import Size, build, load_settings, parse_size, read_yaml_mapping, setting

__all__ = ["SandboxConfig", "parse_size", "read_yaml_mapping"]

UserMode = Literal["auto", "agent", "root"]


def _absolute_below_root(path: str) -> bool:
    return path.startswith("/") and path.rstrip("/") not in ("", "/")


@dataclass(frozen=True)
class SandboxConfig:
    """One sandbox's profile. Build it with `SandboxConfig.load(**overrides)` (YAML defaults + overrides).
    Each key's meaning: conf/sandbox/default.yaml."""

    image: str
    user: UserMode
    memory: str
    cpus: float = setting(above=0, max=1024)
    pids_limit: int = setting(min=8)
    network: str = setting(check=(bool, "a Docker network mode (default: none)"))
    cap_drop: tuple[str, ...]
    cap_add: tuple[str, ...]
    no_new_privileges: bool
    read_only: bool
    tmpfs: dict[str, str] = setting(check=(lambda m: all(p.startswith("/") for p in m),
                                           "a mapping of absolute mount points to options"))
    workspace: str = setting(check=(_absolute_below_root, "an absolute path below /"))
    exec_timeout_s: float = setting(above=0)
    output_limit_bytes: Size
    file_limit_bytes: Size
    lock_timeout_s: float = setting(above=0)
    fork_parallelism: int = setting(min=1, max=64)
    labels: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.validate()

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def load(cls, path: str | Path | None = None, **overrides: Any) -> SandboxConfig:
        """Defaults from `path` (default: conf/sandbox/default.yaml), then `overrides` on top."""
        path = Path(path) if path is not None else default_config_path()
        return load_settings(cls, "sandbox config", path, overrides, env_var="AGENTENV_CONFIG")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SandboxConfig:
        """Build from a mapping with every key (e.g. `OmegaConf.to_container(cfg.sandbox)`)."""
        return build(cls, data, "sandbox config")

    def replace(self, **overrides: Any) -> SandboxConfig:
        """A copy with some values changed (None values are ignored, so optional kwargs pass through)."""
        d = self.to_dict()
        d.update({k: v for k, v in overrides.items() if v is not None})
        return SandboxConfig.from_dict(d)

    def with_assignments(self, assignments: list[str]) -> SandboxConfig:
        """Apply CLI `key=value` strings, values parsed as YAML (`read_only=false`, `cap_add=[NET_RAW]`)."""
        d = self.to_dict()
        for item in assignments:
            key, sep, raw = item.partition("=")
            if not sep or not key:
                raise ConfigError(f"--set expects key=value, got {item!r}")
            try:
                d[key.strip()] = yaml.safe_load(raw) if raw.strip() else ""
            except yaml.YAMLError:
                raise ConfigError(f"--set {key}: cannot parse value {raw!r}") from None
        return SandboxConfig.from_dict(d)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["cap_drop"] = list(self.cap_drop)
        d["cap_add"] = list(self.cap_add)
        return d

    # ---- checks --------------------------------------------------------------------------------
    @property
    def memory_bytes(self) -> int:
        return parse_size(self.memory, "memory")

    def validate(self) -> None:
        """What the field types cannot say: a memory limit Docker accepts."""
        if self.memory_bytes < 8 * 1024**2:
            raise ConfigError(f"memory {self.memory!r} is below Docker's minimum of 6 MiB (use e.g. '64m')")
