"""`FastPathSettings`: where the fast path keeps its images and how it reaches Docker's containerd.

The values live in conf/agentenv/fastpath.yaml (`$AGENTENV_FASTPATH_CONFIG` points elsewhere); the
dataclass has no field defaults, so every value comes from that file or from the caller.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentenv.config import parse_size, read_yaml_mapping, require_exact_keys
from agentenv.errors import ConfigError
from agentenv.fastpath.errors import FastPathConfigError
from agentenv.paths import PROJECT_ROOT, overridable_path


def default_settings_path() -> Path:
    return overridable_path("AGENTENV_FASTPATH_CONFIG", PROJECT_ROOT / "conf" / "agentenv" / "fastpath.yaml")


@dataclass(frozen=True)
class FastPathSettings:
    """See conf/agentenv/fastpath.yaml for the meaning of each field."""

    enabled: bool
    store_dir: Path
    disk_cap: int
    pause_headroom: float
    containerd_address: str
    containerd_namespace: str
    ctr: str
    containerd_tmp: Path
    link_pages: bool
    fork_parallelism: int
    verify_restore: bool
    op_timeout_s: float

    @classmethod
    def load(cls, path: str | Path | None = None, **overrides: Any) -> FastPathSettings:
        """Values from `path` (default: conf/agentenv/fastpath.yaml), then `overrides` on top."""
        path = Path(path) if path is not None else default_settings_path()
        try:
            data = read_yaml_mapping(path, "fast-path config")
        except ConfigError as e:
            raise FastPathConfigError(str(e)) from None
        data.update({k: v for k, v in overrides.items() if v is not None})
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FastPathSettings:
        try:
            require_exact_keys(data, cls, "fast-path config")
            settings = cls(
                enabled=_bool(data["enabled"], "enabled"),
                store_dir=Path(str(data["store_dir"])).expanduser(),
                disk_cap=parse_size(data["disk_cap"], "disk_cap"),
                pause_headroom=float(data["pause_headroom"]),
                containerd_address=str(data["containerd_address"]),
                containerd_namespace=str(data["containerd_namespace"]),
                ctr=str(data["ctr"]),
                containerd_tmp=Path(str(data["containerd_tmp"])),
                link_pages=_bool(data["link_pages"], "link_pages"),
                fork_parallelism=int(data["fork_parallelism"]),
                verify_restore=_bool(data["verify_restore"], "verify_restore"),
                op_timeout_s=float(data["op_timeout_s"]),
            )
        except ConfigError as e:
            raise FastPathConfigError(str(e)) from None
        except (TypeError, ValueError) as e:
            raise FastPathConfigError(f"fast-path config has a value of the wrong type: {e}") from None
        settings.validate()
        return settings

    def replace(self, **overrides: Any) -> FastPathSettings:
        d = dataclasses.asdict(self)
        d.update({k: v for k, v in overrides.items() if v is not None})
        return FastPathSettings.from_dict(d)

    def validate(self) -> None:
        if not self.store_dir.is_absolute():
            raise FastPathConfigError(f"store_dir must be an absolute path, got {self.store_dir}")
        if self.pause_headroom < 1.0:
            raise FastPathConfigError(f"pause_headroom must be >= 1.0, got {self.pause_headroom}")
        if self.fork_parallelism < 1:
            raise FastPathConfigError(f"fork_parallelism must be >= 1, got {self.fork_parallelism}")
        if self.op_timeout_s <= 0:
            raise FastPathConfigError(f"op_timeout_s must be positive, got {self.op_timeout_s}")


def _bool(value: Any, what: str) -> bool:
    if isinstance(value, bool):
        return value
    raise FastPathConfigError(f"{what} must be true or false, got {value!r}")
