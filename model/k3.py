"""The K3 policy: hybrid KDA / NoPE-MLA decoder layers, LatentMoE FFNs, Block Attention Residuals.

`K3ForCausalLM(cfg)` builds the module tree with Moonshot's checkpoint names, so `state_dict()` is the
checkpoint vLLM / sglang / transformers read (see docs/model.md). `forward` returns fp32 logits, the
updated decoding cache, optionally the final hidden states, and router statistics per MoE layer.
``forward(..., routes=RecordedRoutes(...))`` replays recorded expert choices (routing replay, see
`model.moe`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from model import checkpoint
from model.attn_res import DepthSources, depth_mix, make_depth_query
from model.cache import K3Cache, KDALayerCache, MLALayerCache
from model.config import K3Config
from model.ffn import GatedFFN, glu_activation
from model.kda import KimiDeltaAttention
from model.mla import MultiHeadLatentAttention
from model.moe import LatentMoE, RoutedExperts, RouterStats, RoutingOverride, TopKRouter
from model.norm import RMSNorm


@dataclass
class K3Output:
    logits: torch.Tensor  # [B, T, vocab] fp32
    cache: K3Cache | None
    hidden: torch.Tensor | None  # [B, T, d] after the final norm, when return_hidden
    router_stats: list[RouterStats]


@dataclass
class RecordedRoutes:
    """Experts to replay in `K3ForCausalLM.forward`: ``ids`` [B, T, n_moe_layers, top_k] (integers; for
    each token the experts of every MoE layer, in the model's layer order) and ``mask`` [B, T] bool (the
    tokens that have a record; the others route normally)."""

    ids: torch.Tensor
    mask: torch.Tensor

    def layer(self, n: int) -> RoutingOverride:
        """The override of the ``n``-th MoE layer, over the flattened B*T tokens."""
        return RoutingOverride(self.ids[:, :, n].reshape(-1, self.ids.shape[-1]), self.mask.reshape(-1))

    def check(self, batch: int, time: int, cfg: K3Config) -> None:
        """Shapes and expert ids fit the model and ``input_ids`` [batch, time]; ValueError otherwise."""
        n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
        want = (batch, time, n_moe, cfg.num_experts_per_token)
        mask_ok = tuple(self.mask.shape) == want[:2] and self.mask.dtype == torch.bool
        if tuple(self.ids.shape) != want or not mask_ok:
            raise ValueError(
                f"routes: ids must be {list(want)} [batch, time, moe layers, top_k] and mask "
                f"[{batch}, {time}] bool, got ids {list(self.ids.shape)} and mask {list(self.mask.shape)} "
                f"{self.mask.dtype}"
            )
        given = self.ids[self.mask]
        if given.numel() and not (0 <= int(given.min()) and int(given.max()) < cfg.num_experts):
            low, high = int(given.min()), int(given.max())
            raise ValueError(f"routes: expert ids must be in [0, {cfg.num_experts}), got {low}..{high}")


class K3DecoderLayer(nn.Module):
    """Attention (KDA or MLA) then FFN (dense or LatentMoE), each behind a pre-norm and, with AttnRes,
    behind a depth mixture (`self_attention_res_*`, `mlp_res_*`)."""

    def __init__(self, cfg: K3Config, layer_idx: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.layer_idx = layer_idx
        self.is_kda = cfg.is_kda_layer(layer_idx)
        self.is_moe = cfg.is_moe_layer(layer_idx)
        self.self_attn = (
            KimiDeltaAttention(cfg, layer_idx) if self.is_kda else MultiHeadLatentAttention(cfg, layer_idx)
        )
        if self.is_moe:
            self.block_sparse_moe = LatentMoE(cfg, layer_idx)
        else:
            self.mlp = GatedFFN(cfg.hidden_size, cfg.intermediate_size, glu_activation(cfg))
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.uses_attn_res:
            self.self_attention_res_norm, self.self_attention_res_proj = make_depth_query(
                cfg.hidden_size, cfg.rms_norm_eps
            )
            self.mlp_res_norm, self.mlp_res_proj = make_depth_query(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self, stream: torch.Tensor | list[torch.Tensor], partial: torch.Tensor | None, valid, key_valid,
        cache, override: RoutingOverride | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, RouterStats | None]:  # fmt: skip
        """One decoder layer, in one forward (the unit a sharded learner gathers, `rl.learner.sharding`).

        Plain residual stream: ``stream`` is h [B, T, d] (``partial`` None); returns (h + attention + FFN,
        None, router stats). Block AttnRes: ``stream`` and ``partial`` are the `DepthSources` blocks and
        partial sum; returns (attention output, FFN output, router stats), which the model adds to its
        sources in the same order. Every tensor returned is made here (none passed through)."""
        if not self.cfg.uses_attn_res:
            h = stream + self.attention(stream, valid, key_valid, cache)
            out, stats = self.feed_forward(h, valid, override)
            return h + out, None, stats
        src = DepthSources(stream[0], self.cfg.attn_res_block_size, self.cfg.attn_res_full)
        src.blocks, src.partial = list(stream), partial
        h = depth_mix(src.sources(), self.self_attention_res_norm, self.self_attention_res_proj)
        src.open_layer(self.layer_idx)
        attended = self.attention(h, valid, key_valid, cache)
        src.add_output(attended)
        h = depth_mix(src.sources(), self.mlp_res_norm, self.mlp_res_proj)
        out, stats = self.feed_forward(h, valid, override)
        return attended, out, stats

    def attention(self, h: torch.Tensor, valid, key_valid, cache) -> torch.Tensor:
        x = self.input_layernorm(h)
        if self.is_kda:
            return self.self_attn(x, valid, cache)
        return self.self_attn(x, key_valid, cache)

    def feed_forward(
        self, h: torch.Tensor, valid, override: RoutingOverride | None = None
    ) -> tuple[torch.Tensor, RouterStats | None]:
        x = self.post_attention_layernorm(h)
        if self.is_moe:
            return self.block_sparse_moe(x, valid, override)
        return self.mlp(x), None


class K3Model(nn.Module):
    """Embedding, decoder layers, the final (AttnRes-mixed) norm: the `model.` prefix of the checkpoint."""

    def __init__(self, cfg: K3Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(K3DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        moe = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]
        self.moe_ordinal = {layer: n for n, layer in enumerate(moe)}  # decoder layer -> its MoE layer number
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.uses_attn_res:
            self.output_attn_res_norm, self.output_attn_res_proj = make_depth_query(
                cfg.hidden_size, cfg.rms_norm_eps
            )

    def forward(
        self, input_ids, valid, key_valid, cache: K3Cache | None, routes: RecordedRoutes | None = None
    ):
        h = self.embed_tokens(input_ids)
        stats: list[RouterStats] = []
        layer_caches = cache.layers if cache is not None else [None] * len(self.layers)
        src = DepthSources(h, self.cfg.attn_res_block_size, self.cfg.attn_res_full)
        for layer, layer_cache in zip(self.layers, layer_caches, strict=True):
            override = self._override(layer, routes)
            if self.cfg.uses_attn_res:  # Block AttnRes: every sub-layer reads a depth mixture of the sources
                attended, out, st = layer(src.blocks, src.partial, valid, key_valid, layer_cache, override)
                src.open_layer(layer.layer_idx)
                src.add_output(attended)
                src.add_output(out)
            else:
                h, _none, st = layer(h, None, valid, key_valid, layer_cache, override)
            if st is not None:
                stats.append(st)
        if self.cfg.uses_attn_res:
            h = depth_mix(src.sources(), self.output_attn_res_norm, self.output_attn_res_proj)
        return self.norm(h), stats

    def _override(self, layer: K3DecoderLayer, routes: RecordedRoutes | None) -> RoutingOverride | None:
        if routes is None or not layer.is_moe:
            return None
        return routes.layer(self.moe_ordinal[layer.layer_idx])


class K3ForCausalLM(nn.Module):
    """K3 language model: `model.` (K3Model) + `lm_head`. See `forward` for the API."""

    def __init__(self, cfg: K3Config) -> None:
        super().__init__()
        self.config = cfg
        self.model = K3Model(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.reset_parameters()
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Normal(0, initializer_range) for projections and embeddings, ones for norms, zeros for the AttnRes
        pseudo-queries and router biases, the KDA gate init of `KimiDeltaAttention.reset_gate_parameters`."""
        std = self.config.initializer_range
        for name, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                if name.endswith("_res_proj"):
                    nn.init.zeros_(module.weight)
                else:
                    nn.init.normal_(module.weight, std=std)
            elif isinstance(module, TopKRouter):
                nn.init.normal_(module.weight, std=std)
                module.e_score_correction_bias.zero_()
            elif isinstance(module, RoutedExperts):
                module.reset_parameters(std)
            elif isinstance(module, KimiDeltaAttention):
                module.reset_gate_parameters()

    # ------------------------------------------------------------------ API
    def new_cache(self, batch_size: int) -> K3Cache:
        """An empty decoding cache for `batch_size` sequences."""
        layers = [KDALayerCache() if layer.is_kda else MLALayerCache() for layer in self.model.layers]
        return K3Cache(layers, batch_size)

    def moe_routers(self) -> list[TopKRouter]:
        """The router of every MoE layer, in layer order (for `update_bias` after each learner step)."""
        return [layer.block_sparse_moe.gate for layer in self.model.layers if layer.is_moe]

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache: K3Cache | None = None,
        return_hidden: bool = False,
        routes: RecordedRoutes | None = None,
    ) -> K3Output:
        """Logits for `input_ids` [B, T].

        attention_mask: [B, T] (or [B, cached + T], HF style) with 1 = real token, 0 = padding; use left
        padding for batched decoding. cache: a `K3Cache` from `new_cache`, advanced in place; the new tokens
        continue the cached sequences. routes: experts to replay for some of the new tokens (routing
        replay; `RecordedRoutes`), None = every token routes by its router.
        """
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, time], got shape {tuple(input_ids.shape)}")
        B, T = input_ids.shape
        if cache is not None and cache.batch_size != B:
            raise ValueError(f"the cache holds {cache.batch_size} sequences but input_ids has {B} rows")
        valid = self._current_mask(attention_mask, B, T, cache, input_ids.device)
        if cache is not None:
            key_valid = cache.extend_mask(valid if valid is not None else self._ones(B, T, input_ids.device))
            if bool(key_valid.all()):
                key_valid = None
        else:
            key_valid = valid
        if routes is not None:
            routes.check(B, T, self.config)
        hidden, stats = self.model(input_ids, valid, key_valid, cache, routes)
        logits = self.lm_head(hidden).float()
        return K3Output(
            logits=logits, cache=cache, hidden=hidden if return_hidden else None, router_stats=stats
        )

    @staticmethod
    def _ones(B: int, T: int, device) -> torch.Tensor:
        return torch.ones(B, T, dtype=torch.bool, device=device)

    @staticmethod
    def _current_mask(attention_mask, B, T, cache, device) -> torch.Tensor | None:
        """The validity [B, T] (bool) of the new tokens, or None when every token is real."""
        if attention_mask is None:
            return None
        seen = cache.seen_tokens if cache is not None else 0
        if (
            attention_mask.dim() != 2
            or attention_mask.shape[0] != B
            or attention_mask.shape[1] not in (T, seen + T)
        ):
            raise ValueError(
                f"attention_mask must be [batch={B}, {T}] (or [batch, cached {seen} + {T}]), "
                f"got {tuple(attention_mask.shape)}"
            )
        valid = attention_mask[:, -T:].to(device=device, dtype=torch.bool)
        return None if bool(valid.all()) else valid

    # ------------------------------------------------------------------ weights
    def save_pretrained(self, directory: str | Path) -> None:
        """Write `model.safetensors` and `config.json` (model_type kimi_linear) into `directory`."""
        checkpoint.save_pretrained(self, directory)

    @classmethod
    def from_pretrained(cls, directory: str | Path, dtype: torch.dtype | None = None) -> K3ForCausalLM:
        """Build from `directory/config.json` and load `model.safetensors` (strict: names and shapes)."""
        return checkpoint.load_pretrained(cls(checkpoint.read_config(directory)), directory, dtype)
