"""`BackendSettings`: which container runtime runs sandboxes, where it keeps checkpoint images, and how
it reaches Docker's containerd. The values live in conf/agentenv/backend.yaml (`$AGENTENV_BACKEND_CONFIG`
points elsewhere); `$AGENTENV_BACKEND` overrides `backend` (a one-off switch without editing the file).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

from agentenv.settings import Size, build, load_settings, setting, settings_path

Backend = Literal["warm", "fastpath", "docker-criu", "microvm"]
Fallback = Literal["none", "docker-criu"]
BACKENDS: tuple[str, ...] = get_args(Backend)
FALLBACKS: tuple[str, ...] = get_args(Fallback)
WHAT = "backend config"
ENV_VAR = "AGENTENV_BACKEND_CONFIG"


def default_settings_path() -> Path:
    return settings_path(ENV_VAR, "backend.yaml")


def _socket(address: str) -> bool:
    return address == "auto" or address.startswith("/")


@dataclass(frozen=True)
class BackendSettings:
    """See conf/agentenv/backend.yaml for the meaning of each field."""

    backend: Backend
    fallback: Fallback
    store_dir: Path = setting(check=(Path.is_absolute, "an absolute path"))
    disk_cap: Size
    pause_headroom: float = setting(min=1.0)
    containerd_address: str = setting(check=(_socket, "`auto` or an absolute socket path"))
    containerd_namespace: str
    ctr: str
    link_pages: bool
    verify_restore: bool
    op_timeout_s: float = setting(above=0)
    runtime_dir: Path = setting(check=(Path.is_absolute, "an absolute path"))
    lazy_pages: bool
    warm_shells: int = setting(min=0)
    warm_tmpfs_limit: Size
    ksm: bool
    ksm_pages_to_scan: int = setting(min=1)
    ksm_sleep_ms: int = setting(min=0)
    spare_shells: bool
    spare_ttl_s: float = setting(above=0)
    # microvm backend (defaults: a file that predates it still loads)
    microvm_dir: Path = setting(check=(Path.is_absolute, "an absolute path"),
                                default=Path("/var/lib/agentenv/microvm"))
    microvm_kernel_dir: Path = setting(check=(Path.is_absolute, "an absolute path"),
                                       default=Path("/opt/k3rl/microvm/kernel"))
    microvm_accel: Literal["auto", "kvm", "tcg"] = "auto"
    microvm_kvm_probe_s: float = setting(above=0, default=15.0)
    microvm_memory_overhead: Size = setting(default=160 * 2**20)
    microvm_channels: int = setting(min=2, max=30, default=8)
    microvm_boot_timeout_s: float = setting(above=0, default=180.0)
    microvm_nice: int = setting(min=0, max=19, default=0)

    @classmethod
    def load(cls, path: str | Path | None = None, **overrides: Any) -> BackendSettings:
        """Values from `path` (default: conf/agentenv/backend.yaml), `$AGENTENV_BACKEND`, then `overrides`."""
        from_env = os.environ.get("AGENTENV_BACKEND") or None
        given = {"backend": from_env, **{k: v for k, v in overrides.items() if v is not None}}
        origins = {"backend": "$AGENTENV_BACKEND"} if from_env and given["backend"] == from_env else {}
        return load_settings(cls, WHAT, path, given, env_var=ENV_VAR, file_name="backend.yaml",
                             origins=origins)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BackendSettings:
        return build(cls, data, WHAT)

    def replace(self, **overrides: Any) -> BackendSettings:
        d = dataclasses.asdict(self)
        d.update({k: v for k, v in overrides.items() if v is not None})
        return BackendSettings.from_dict(d)
