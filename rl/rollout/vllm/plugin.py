"""vLLM plugin: registers the K3 model class (`rl.rollout.vllm.model.K3VllmForCausalLM`) with vLLM's registry.

Declared under the entry-point group ``vllm.general_plugins`` (pyproject.toml), which vLLM 0.32 loads in
every process it starts, so the architecture name `rl.rollout.vllm.model.ARCHITECTURE` resolves wherever the
engine runs. The class is given as a lazy ``"module:Class"`` string: registering imports nothing heavy.
"""

from __future__ import annotations

ARCHITECTURE = "K3RLForCausalLM"  # the name our config overrides give vLLM (rl.rollout.vllm.model)
MODEL_CLASS = "rl.rollout.vllm.model:K3VllmForCausalLM"


def register() -> None:
    """Register the K3 model class under `ARCHITECTURE` (idempotent)."""
    from vllm import ModelRegistry

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, MODEL_CLASS)
