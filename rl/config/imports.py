"""``module:Name`` config values (``env.wrappers``) resolved to objects, with errors that name the key.

A leaf module: ``rl.rollout.wrappers`` and ``rl.sft.experts`` import it.
"""

from __future__ import annotations

import importlib
from typing import Any

from agentenv.errors import ConfigError


def import_object(spec: str, key: str) -> Any:
    """``module:Name`` -> the object, or a `ConfigError` on ``key`` saying what is wrong."""
    module, sep, name = spec.partition(":")
    if not sep or not module or not name:
        raise ConfigError(f"{key}: {spec!r} must be written 'module:Name'")
    try:
        obj = importlib.import_module(module)
    except ImportError as exc:
        raise ConfigError(f"{key}: cannot import module {module!r}: {exc}") from None
    for part in name.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"{key}: module {module!r} has no {name!r}")
        obj = getattr(obj, part)
    return obj
