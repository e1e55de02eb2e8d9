"""`BackendSettings`: which container runtime runs sandboxes, where it keeps checkpoint images, and how
it reaches Docker's containerd.

The values live in conf/agentenv/backend.yaml (`$AGENTENV_BACKEND_CONFIG` points elsewhere); the dataclass
has no field defaults, so every value comes from that file or from the caller. `$AGENTENV_BACKEND`
overrides `backend` (a one-off switch without editing the file).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentenv.config import parse_size, read_settings, require_exact_keys, settings_path
from agentenv.errors import ConfigError

BACKENDS = ("fastpath", "docker-criu")
FALLBACKS = ("none", "docker-criu")
WHAT = "backend config"


def default_settings_path() -> Path:
    return settings_path("AGENTENV_BACKEND_CONFIG", "backend.yaml")


@dataclass(frozen=True)
class BackendSettings:
    """See conf/agentenv/backend.yaml for the meaning of each field."""

    backend: str
    fallback: str
    store_dir: Path
    disk_cap: int
    pause_headroom: float
    containerd_address: str
    containerd_namespace: str
    ctr: str
    link_pages: bool
    verify_restore: bool
    op_timeout_s: float

    @classmethod
    def load(cls, path: str | Path | None = None, **overrides: Any) -> BackendSettings:
        """Values from `path` (default: conf/agentenv/backend.yaml), `$AGENTENV_BACKEND`, then `overrides`."""
        given = {k: v for k, v in overrides.items() if v is not None}
        environment = {"backend": os.environ.get("AGENTENV_BACKEND") or None}
        return cls.from_dict(read_settings(path, "AGENTENV_BACKEND_CONFIG", "backend.yaml", WHAT,
                                           {**environment, **given}))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BackendSettings:
        require_exact_keys(data, cls, WHAT)
        try:
            settings = cls(
                backend=str(data["backend"]),
                fallback=str(data["fallback"]),
                store_dir=Path(str(data["store_dir"])).expanduser(),
                disk_cap=parse_size(data["disk_cap"], "disk_cap"),
                pause_headroom=float(data["pause_headroom"]),
                containerd_address=str(data["containerd_address"]),
                containerd_namespace=str(data["containerd_namespace"]),
                ctr=str(data["ctr"]),
                link_pages=_bool(data["link_pages"], "link_pages"),
                verify_restore=_bool(data["verify_restore"], "verify_restore"),
                op_timeout_s=float(data["op_timeout_s"]),
            )
        except (TypeError, ValueError) as e:
            if isinstance(e, ConfigError):
                raise
            raise ConfigError(f"{WHAT} has a value of the wrong type: {e}") from None
        settings.validate()
        return settings

    def replace(self, **overrides: Any) -> BackendSettings:
        d = dataclasses.asdict(self)
        d.update({k: v for k, v in overrides.items() if v is not None})
        return BackendSettings.from_dict(d)

    def validate(self) -> None:
        if self.backend not in BACKENDS:
            raise ConfigError(f"backend must be one of {BACKENDS} (conf/agentenv/backend.yaml or "
                              f"$AGENTENV_BACKEND), got {self.backend!r}")
        if self.fallback not in FALLBACKS:
            raise ConfigError(f"fallback must be one of {FALLBACKS}, got {self.fallback!r}")
        if not self.store_dir.is_absolute():
            raise ConfigError(f"store_dir must be an absolute path, got {self.store_dir}")
        if self.pause_headroom < 1.0:
            raise ConfigError(f"pause_headroom must be >= 1.0, got {self.pause_headroom}")
        if self.op_timeout_s <= 0:
            raise ConfigError(f"op_timeout_s must be positive, got {self.op_timeout_s}")
        if self.containerd_address != "auto" and not self.containerd_address.startswith("/"):
            raise ConfigError(f"containerd_address must be `auto` or an absolute socket path, "
                              f"got {self.containerd_address!r}")


def _bool(value: Any, what: str) -> bool:
    if isinstance(value, bool):
        return value
    raise ConfigError(f"{what} must be true or false, got {value!r}")
