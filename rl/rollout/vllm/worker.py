"""The vLLM worker extension of the rollout engine (``worker_extension_cls``): methods vLLM 0.32 mixes
into its worker class, called through ``LLM.collective_rpc`` from `rl.rollout.vllm.engine.VllmEngine`.

They reach the running model (`rl.rollout.vllm.model.K3VllmForCausalLM`) to push a new weights version into it
without restarting the engine, and to read its side buffers. The engine runs in the rollout worker's
own process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so the tensors are handed over by reference, not
serialised.
"""

from __future__ import annotations

import torch

from model.moe import parameter_names


class K3WorkerExtension:
    """Mixed into vLLM's worker: ``self.model_runner`` is the worker's model runner."""

    def _k3_model(self):
        return self.model_runner.get_model()  # type: ignore[attr-defined]

    def k3_load_weights(self, version: int, state_dict: dict[str, torch.Tensor]) -> int:
        """Copy the learner's weights of ``version`` (every tensor of the checkpoint) into the model in
        place; returns the version now held. A partial or mismatching state dict is refused whole."""
        model = self._k3_model()
        tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
        expected = set(parameter_names(model)) - tied  # checkpoint names: one per routed expert's weight
        given = set(state_dict) - tied
        if given != expected:
            missing, extra = sorted(expected - given), sorted(given - expected)
            raise ValueError(
                f"weights v{version} do not match the K3 model: missing {missing[:3]}, unexpected {extra[:3]}"
            )
        model.load_weights(state_dict.items())
        model.weights_version = version
        return version

    def k3_weights_version(self) -> int:
        """The learner's version of the weights the model holds (-1: only the start-up checkpoint)."""
        return self._k3_model().weights_version

    def k3_take_expert_loads(self) -> dict[int, torch.Tensor]:
        """Tokens routed to each expert per MoE layer since the last call (then reset)."""
        return self._k3_model().take_expert_loads()

    def k3_record_routes(self) -> None:
        """Make the model record each step's routing per request (`Generation.routes`): it is given the
        model runner's view of the batch's request ids, in the order of the step's tokens."""
        runner = self.model_runner  # type: ignore[attr-defined]
        self._k3_model().request_ids = lambda: runner.input_batch.req_ids

    def k3_take_routes(self, requests: list[str]) -> dict[str, dict[int, torch.Tensor]]:
        """The routes recorded for the finished ``requests``: request id -> token position -> experts
        [moe layers, top_k] at that position."""
        return self._k3_model().take_routes(requests)
