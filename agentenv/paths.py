"""Where AgentENV keeps its state and finds its recipes.

`$AGENTENV_HOME` (default: the user's data dir, e.g. ~/.local/share/agentenv) holds the SQLite registry,
the per-sandbox lock files, the pools' bookkeeping and the cached host probe. Checkpoint images live
on local disk, never on tmpfs: in the fast path's store (`store_dir` in conf/agentenv/fastpath.yaml) or,
with the docker-criu backend, in Docker's own directory (/var/lib/docker/containers/<id>/checkpoints).
"""

from __future__ import annotations

import os
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[1]


def agentenv_home() -> Path:
    """The state directory, created on first use. `$AGENTENV_HOME` overrides the default."""
    env = os.environ.get("AGENTENV_HOME")
    if env:
        home = Path(env).expanduser()
    else:
        import platformdirs

        home = Path(platformdirs.user_data_dir("agentenv"))
    home.mkdir(parents=True, exist_ok=True)
    return home


def overridable_path(env_var: str, default: Path) -> Path:
    """`$env_var` (with ~ expanded) when set and non-empty, else `default`."""
    env = os.environ.get(env_var)
    return Path(env).expanduser() if env else default


def default_config_path() -> Path:
    """The YAML with the sandbox defaults (`$AGENTENV_CONFIG` overrides conf/sandbox/default.yaml)."""
    return overridable_path("AGENTENV_CONFIG", PROJECT_ROOT / "conf" / "sandbox" / "default.yaml")


def images_dir() -> Path:
    """The folder of image recipes, one sub-folder per image name (`$AGENTENV_IMAGES_DIR` overrides)."""
    return overridable_path("AGENTENV_IMAGES_DIR", PROJECT_ROOT / "sandbox_images")
