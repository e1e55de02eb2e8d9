"""`SandboxConfig`: the security profile and resource limits of a sandbox.

The defaults live in conf/sandbox/default.yaml (the Hydra group `sandbox`), not in this module: the
dataclass has no field defaults, so a value is either read from that file or given by the caller.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from agentenv.errors import ConfigError
from agentenv.paths import conf_dir, default_config_path, overridable_path

USER_MODES = ("auto", "agent", "root")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4}


def parse_size(value: str | int, what: str = "size") -> int:
    """'512m' / '1g' / '64MiB' / 1048576 -> bytes (binary units, as Docker reads them)."""
    if isinstance(value, bool):
        raise ConfigError(f"{what}: expected a size like '512m', got {value!r}")
    if isinstance(value, int):
        if value <= 0:
            raise ConfigError(f"{what}: must be positive, got {value}")
        return value
    m = _SIZE.match(str(value))
    if not m:
        raise ConfigError(f"{what}: expected a size like '512m' or '1g', got {value!r}")
    n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if n <= 0:
        raise ConfigError(f"{what}: must be positive, got {value!r}")
    return n


def read_yaml_mapping(path: Path, what: str, hint: str = "") -> dict[str, Any]:
    """The mapping in a YAML file, or a ConfigError naming `what` and the file (for every agentenv config)."""
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError:
        raise ConfigError(f"{what} {path} does not exist" + (f" ({hint})" if hint else "")) from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{what} {path} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{what} {path} must be a mapping of keys to values")
    return data


def settings_path(env_var: str, file_name: str) -> Path:
    """An agentenv settings file: `$env_var` when set, else conf/agentenv/<file_name>."""
    return overridable_path(env_var, conf_dir() / "agentenv" / file_name)


def read_settings(path: str | Path | None, env_var: str, file_name: str, what: str,
                  overrides: dict[str, Any]) -> dict[str, Any]:
    """The mapping of a settings file (`path`, else `settings_path(env_var, file_name)`) with
    `overrides` on top (None values ignored): what every `*Settings.load` starts from."""
    path = Path(path) if path is not None else settings_path(env_var, file_name)
    data = read_yaml_mapping(path, what, f"set {env_var} to another file")
    data.update({k: v for k, v in overrides.items() if v is not None})
    return data


def require_exact_keys(data: dict[str, Any], cls: type, what: str) -> None:
    """ConfigError unless `data` has exactly the fields of dataclass `cls` (no unknown, none missing)."""
    names = [f.name for f in dataclasses.fields(cls)]
    unknown, missing = sorted(set(data) - set(names)), sorted(set(names) - set(data))
    if unknown or missing:
        raise ConfigError(f"{what}: unknown key(s) {unknown}, missing key(s) {missing}; keys are {names}")


@dataclass(frozen=True)
class SandboxConfig:
    """One sandbox's profile. Build it with `SandboxConfig.load(**overrides)` (YAML defaults + overrides)."""

    image: str
    user: str
    memory: str
    cpus: float
    pids_limit: int
    network: str
    cap_drop: tuple[str, ...]
    cap_add: tuple[str, ...]
    no_new_privileges: bool
    read_only: bool
    tmpfs: dict[str, str]
    workspace: str
    exec_timeout_s: float
    output_limit_bytes: int
    file_limit_bytes: int
    lock_timeout_s: float
    fork_parallelism: int
    labels: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.validate()

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def load(cls, path: str | Path | None = None, **overrides: Any) -> SandboxConfig:
        """Defaults from `path` (default: conf/sandbox/default.yaml), then `overrides` on top."""
        path = Path(path) if path is not None else default_config_path()
        data = read_yaml_mapping(path, "sandbox config", "set AGENTENV_CONFIG to another file")
        data.update({k: v for k, v in overrides.items() if v is not None})
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SandboxConfig:
        """Build from a mapping with every key (e.g. `OmegaConf.to_container(cfg.sandbox)`)."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ConfigError(f"unknown sandbox config key(s) {unknown}; known keys: {sorted(names)}")
        missing = sorted(n for n in names if n not in data and n != "labels")
        if missing:
            raise ConfigError(f"sandbox config lacks key(s) {missing}")
        d = dict(data)
        try:
            d["cpus"] = float(d["cpus"])
            d["pids_limit"] = int(d["pids_limit"])
            d["fork_parallelism"] = int(d["fork_parallelism"])
            d["exec_timeout_s"] = float(d["exec_timeout_s"])
            d["lock_timeout_s"] = float(d["lock_timeout_s"])
            d["output_limit_bytes"] = parse_size(d["output_limit_bytes"], "output_limit_bytes")
            d["file_limit_bytes"] = parse_size(d["file_limit_bytes"], "file_limit_bytes")
        except (TypeError, ValueError) as e:
            if isinstance(e, ConfigError):
                raise
            raise ConfigError(f"sandbox config has a value of the wrong type: {e}") from None
        d["cap_drop"] = tuple(str(c) for c in (d.get("cap_drop") or ()))
        d["cap_add"] = tuple(str(c) for c in (d.get("cap_add") or ()))
        d["tmpfs"] = {str(k): str(v or "") for k, v in (d.get("tmpfs") or {}).items()}
        d["labels"] = {str(k): str(v) for k, v in (d.get("labels") or {}).items()}
        d["memory"] = str(d["memory"])
        return cls(**d)

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
        """Refuse values Docker would reject late or that would silently weaken the sandbox."""
        if self.user not in USER_MODES:
            raise ConfigError(f"user must be one of {USER_MODES}, got {self.user!r}")
        if self.memory_bytes < 8 * 1024**2:
            raise ConfigError(f"memory {self.memory!r} is below Docker's minimum of 6 MiB (use e.g. '64m')")
        if not 0 < self.cpus <= 1024:
            raise ConfigError(f"cpus must be > 0, got {self.cpus}")
        if self.pids_limit < 8:
            raise ConfigError(f"pids_limit must be at least 8, got {self.pids_limit}")
        if not 1 <= self.fork_parallelism <= 64:
            raise ConfigError(f"fork_parallelism must be from 1 to 64, got {self.fork_parallelism}")
        if self.exec_timeout_s <= 0 or self.lock_timeout_s <= 0:
            raise ConfigError("exec_timeout_s and lock_timeout_s must be positive")
        if not self.workspace.startswith("/") or self.workspace.rstrip("/") in ("", "/"):
            raise ConfigError(f"workspace must be an absolute path below /, got {self.workspace!r}")
        for mount in self.tmpfs:
            if not mount.startswith("/"):
                raise ConfigError(f"tmpfs mount points must be absolute paths, got {mount!r}")
        if not self.network:
            raise ConfigError("network must name a Docker network mode (default: none)")
