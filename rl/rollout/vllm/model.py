"""`K3VllmForCausalLM`: the K3 policy as a vLLM 0.32 model class (registered by `rl.rollout.vllm.plugin`).

The module tree is `model.k3.K3Model` itself with vLLM-aware attention, and every weight stays a plain
parameter, so names are the checkpoint's and `load_weights` copies in place for every pushed version.

Design: docs/design/training.md#rl-vllm-model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.mamba.mamba_utils import MambaStateCopyFuncCalculator
from vllm.model_executor.models.interfaces import HasInnerState, IsHybrid

from model.checkpoint import CheckpointMismatch, read_config
from model.config import K3Config
from model.k3 import K3Model
from model.moe import stacked_slot
from rl.policy import build_policy_shell
from rl.rollout.torch_engine import route_dtype
from rl.rollout.vllm.layers import VllmKDA, VllmMLA, attention_head_size, kda_state_dtypes, kda_state_shapes
from rl.rollout.vllm.plugin import ARCHITECTURE


def vllm_config_overrides(cfg: K3Config) -> dict[str, Any]:
    """``hf_overrides`` for vLLM's view of the checkpoint's config: our architecture, not vLLM's Kimi
    model; ``model_type`` k3rl so that vLLM does not treat the full-attention layers as MLA (its CPU_MLA
    backend cannot run them, see `rl.rollout.vllm.layers`); the head size and KV heads its attention layers
    really have (for vLLM's page-size arithmetic); the layer types of a hybrid model."""
    layers = range(cfg.num_hidden_layers)
    kinds = ["linear_attention" if cfg.is_kda_layer(i) else "full_attention" for i in layers]
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "k3rl",
        "head_dim": attention_head_size(cfg),
        "num_key_value_heads": cfg.num_attention_heads,
        "layer_types": kinds,
    }


def _k3_config(vllm_config: VllmConfig) -> K3Config:
    return read_config(vllm_config.model_config.model)


class K3VllmForCausalLM(nn.Module, HasInnerState, IsHybrid):
    """The K3 policy on vLLM's model interface (see the module docstring)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        cfg = _k3_config(vllm_config)
        self.config = cfg
        shell = build_policy_shell(cfg)  # allocated, not randomly initialised: load_weights fills it
        self.model: K3Model = shell.model
        self.lm_head = shell.lm_head
        for i, layer in enumerate(self.model.layers):
            name = f"model.layers.{i}.self_attn"
            kind = VllmKDA if layer.is_kda else VllmMLA
            layer.self_attn = kind(cfg, i, name, vllm_config)
        self.weights_version = -1
        self.expert_loads: dict[int, torch.Tensor] = {}
        self.request_ids: Callable[[], list[str]] | None = None  # the batch's request ids, in token order
        self.routes: dict[str, dict[int, torch.Tensor]] = {}  # request -> position -> [moe layers, top_k]
        self.route_dtype = route_dtype(cfg.num_experts)

    # ------------------------------------------------------------------ vLLM's model interface
    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs: object,
    ) -> torch.Tensor:
        """The final hidden states [N, d] of the step's N tokens (positions unused: NoPE)."""
        if input_ids is None:
            raise ValueError("K3VllmForCausalLM takes token ids (prompt embeddings are not supported)")
        hidden, stats = self.model(input_ids.unsqueeze(0), None, None, None)
        metadata = get_forward_context().attn_metadata
        if metadata is not None:  # a real step, not a profiling run
            for st in stats:
                previous = self.expert_loads.get(st.layer)
                self.expert_loads[st.layer] = st.loads if previous is None else previous + st.loads
            if self.request_ids is not None and stats:
                self._record_routes(stats, positions, metadata)
        return hidden[0]

    def _record_routes(self, stats, positions: torch.Tensor, metadata: dict[str, Any]) -> None:
        """Keep the experts of every MoE layer at each request's last token of this step, by position."""
        starts = next(
            m.non_spec_query_start_loc if hasattr(m, "non_spec_query_start_loc") else m.query_start_loc
            for m in metadata.values()
        )
        last = (starts[1:] - 1).long()
        ids = torch.stack([st.ids[last] for st in stats], dim=1).to("cpu", self.route_dtype)
        for request, row, position in zip(self.request_ids(), ids, positions[last].tolist(), strict=False):
            self.routes.setdefault(request, {})[position] = row

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states).float()

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint-named tensors into the parameters in place (names and shapes checked);
        returns the parameter names loaded. ``lm_head.weight`` of a tied model is the embedding and is
        skipped; a routed expert's ``experts.E.wN.weight`` goes to row E of its layer's stacked ``wN``
        (`model.moe.stacked_slot`), which counts as loaded once every expert's row came."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        rows: dict[str, set[int]] = {}  # stacked expert weight -> the experts' rows copied so far
        for name, tensor in weights:
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            target, index = stacked_slot(name)
            param = params.get(target)
            if param is None or (index is not None and index >= param.shape[0]):
                raise CheckpointMismatch(f"weights have tensor {name!r} that the K3 model does not have")
            if index is not None:
                param = param[index]
            if tuple(param.shape) != tuple(tensor.shape):
                raise CheckpointMismatch(
                    f"tensor {name!r} has shape {tuple(tensor.shape)} but the model's is {tuple(param.shape)}"
                )
            param.copy_(tensor)
            if index is None:
                loaded.add(target)
            else:
                rows.setdefault(target, set()).add(index)
        loaded.update(t for t, seen in rows.items() if len(seen) == params[t].shape[0])
        return loaded

    # ------------------------------------------------------------------ hybrid state (IsHybrid)
    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config: VllmConfig):
        return kda_state_shapes(_k3_config(vllm_config))

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config: VllmConfig):
        return kda_state_dtypes(vllm_config.model_config.dtype)

    @classmethod
    def get_mamba_state_copy_func(cls):
        return MambaStateCopyFuncCalculator.gated_delta_net_state_copy_func()

    # ------------------------------------------------------------------ side buffers
    def take_routes(self, requests: list[str]) -> dict[str, dict[int, torch.Tensor]]:
        """The recorded routes of the finished ``requests`` (vLLM's external ids; its internal ones add
        ``-<8 random characters>``), removed from the buffer."""
        wanted = set(requests)
        taken = {}
        for internal in list(self.routes):
            external = internal.rsplit("-", 1)[0]
            if external in wanted:
                taken[external] = self.routes.pop(internal)
        return taken

    def take_expert_loads(self) -> dict[int, torch.Tensor]:
        """Tokens routed to each expert per MoE layer since the last call (then reset)."""
        loads, self.expert_loads = self.expert_loads, {}
        return {layer: t.detach().float().cpu() for layer, t in loads.items()}
