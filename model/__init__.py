"""The K3 policy model in PyTorch (see docs/model.md for the equation -> module map).

from model import K3Config, K3ForCausalLM, count_parameters, situ_glu

The configs import without torch (a trainer's config check, `--cfg job`, a config error come back in a
second); the modules that need torch load on first use of their names.
"""

from __future__ import annotations

import importlib
from typing import Any

from model.config import ConfigError, K3Config, LinearAttnConfig

_LAZY = {
    "K3Cache": "model.cache", "CheckpointMismatch": "model.checkpoint", "count_parameters": "model.count",
    "situ_glu": "model.ffn", "swiglu": "model.ffn", "K3ForCausalLM": "model.k3", "K3Output": "model.k3",
    "RecordedRoutes": "model.k3", "RouterStats": "model.moe", "RoutingOverride": "model.moe",
}  # fmt: skip

__all__ = ["ConfigError", "K3Config", "LinearAttnConfig", *_LAZY]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'model' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value
