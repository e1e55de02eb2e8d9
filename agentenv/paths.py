"""Where AgentENV keeps its state and where k3rl finds its configs and image recipes.

`$AGENTENV_HOME` holds the registry, locks and bookkeeping; checkpoints live in the store on local disk.
`resource_dir` finds `conf/` and `sandbox_images/` in a wheel, an editable install and a plain checkout.

Design: docs/design/sandboxes.md#agentenv-paths.
"""

from __future__ import annotations

import importlib.util
import os
from functools import cache
from pathlib import Path

SERVER_ENV = "AGENTENV_SERVER"  # the URL of the `agentenv serve` host the CLI and SandboxHost talk to
API_KEY_ENV = "AGENTENV_API_KEY"  # the key of `agentenv serve`: the server's own, and what clients send

# The source checkout this package was imported from; meaningful only there (tests, scripts/). Installed
# code finds its configs and recipes through `conf_dir()` and `images_dir()`, never through this.
PROJECT_ROOT = Path(__file__).resolve().parents[1]
RESOURCES = ("conf", "sandbox_images")


@cache
def resource_dir(name: str) -> Path:
    """The folder `conf` or `sandbox_images`: the installed data package `k3rl_resources.<name>` (a wheel,
    or an editable install mapping it onto the checkout), else the checkout's top-level folder.

    The package is looked up with `importlib.util.find_spec` and not `importlib.resources.files`: these
    folders hold no `__init__.py`, and on Python 3.11 `files()` of such a namespace package raises under
    setuptools' editable installs.
    """
    if name not in RESOURCES:
        raise ValueError(f"unknown resource folder {name!r} (known: {', '.join(RESOURCES)})")
    try:
        spec = importlib.util.find_spec(f"k3rl_resources.{name}")
    except ModuleNotFoundError:  # k3rl is not installed: running from a checkout
        spec = None
    for location in (spec.submodule_search_locations or []) if spec else []:
        if Path(location).is_dir():
            return Path(location)
    checkout = PROJECT_ROOT / name
    if checkout.is_dir():
        return checkout
    raise FileNotFoundError(
        f"k3rl's {name}/ folder is missing: neither the package k3rl_resources.{name} is installed nor "
        f"{checkout} exists; reinstall k3rl (pip install k3rl, or `make bootstrap` in a checkout)"
    )


def conf_dir() -> Path:
    """The Hydra config folder (`conf/`): config groups and AgentENV's settings files."""
    return resource_dir("conf")


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
    return overridable_path("AGENTENV_CONFIG", conf_dir() / "sandbox" / "default.yaml")


def images_dir() -> Path:
    """The folder of image recipes, one sub-folder per image name (`$AGENTENV_IMAGES_DIR` overrides)."""
    return overridable_path("AGENTENV_IMAGES_DIR", resource_dir("sandbox_images"))
