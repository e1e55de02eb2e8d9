"""The K3 policy model in PyTorch (see docs/model.md for the equation -> module map).

from model import K3Config, K3ForCausalLM, count_parameters, situ_glu
"""

from model.cache import K3Cache
from model.checkpoint import CheckpointMismatch
from model.config import ConfigError, K3Config, LinearAttnConfig
from model.count import count_parameters
from model.ffn import situ_glu, swiglu
from model.k3 import K3ForCausalLM, K3Output
from model.moe import RouterStats

__all__ = [
    "K3Config", "LinearAttnConfig", "ConfigError", "K3ForCausalLM", "K3Output", "K3Cache", "RouterStats",
    "CheckpointMismatch", "count_parameters", "situ_glu", "swiglu",
]  # fmt: skip
