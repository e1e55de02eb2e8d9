"""K3's attention layers as vLLM 0.32 layers: the `model/` modules with vLLM's per-request state.

`VllmKDA` keeps each request's recurrent state in vLLM's state slots (vLLM's own Kimi KDA layer is
CUDA/XPU only in 0.32); `VllmMLA` runs MLA as ordinary attention on vLLM's paged cache, zero-padding heads
to a size vLLM's CPU backend accepts.

Design: docs/design/training.md#rl-vllm-layers.
"""

from __future__ import annotations

import torch
from vllm.config import VllmConfig
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

from kernels import chunk_kda, fused_recurrent_kda
from model.config import K3Config
from model.kda import KimiDeltaAttention
from model.mla import MultiHeadLatentAttention

# vLLM 0.32's CPU_ATTN head sizes (vllm/v1/attention/backends/cpu_attn.py, get_supported_head_sizes).
CPU_ATTN_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
CONV_NAMES = ("q", "k", "v")


def attention_head_size(cfg: K3Config) -> int:
    """The head size the MLA layers present to vLLM's attention: the smallest CPU_ATTN size that holds
    both the query/key width (nope + extra) and the value width."""
    need = max(cfg.mla_qk_head_dim, cfg.v_head_dim)
    for size in CPU_ATTN_HEAD_SIZES:
        if size >= need:
            return size
    raise ValueError(f"MLA head width {need} exceeds vLLM's largest CPU attention head size (512)")


def kda_state_shapes(cfg: K3Config) -> tuple[tuple[int, int], tuple[int, int, int]]:
    """Per-request state of one KDA layer: the q, k, v conv tails stacked [3 C, kernel-1], and the
    recurrent state [H, dk, dv]."""
    lac = cfg.linear_attn_config
    channels = lac.num_heads * lac.head_dim
    return (3 * channels, lac.short_conv_kernel_size - 1), (lac.num_heads, lac.head_dim, lac.head_dim)


def kda_state_dtypes(model_dtype: torch.dtype) -> tuple[torch.dtype, torch.dtype]:
    """Conv tails in the model's dtype, the recurrent state in fp32 (as the torch engine's cache)."""
    return model_dtype, torch.float32


def _register(vllm_config: VllmConfig, prefix: str, layer: torch.nn.Module) -> None:
    context = vllm_config.compilation_config.static_forward_context
    if prefix in context:
        raise ValueError(f"duplicate vLLM layer name {prefix!r}")
    context[prefix] = layer


class VllmKDA(KimiDeltaAttention, MambaBase):
    """A KDA layer whose state lives in vLLM's per-request slots (see the module docstring)."""

    def __init__(self, cfg: K3Config, layer_idx: int, prefix: str, vllm_config: VllmConfig) -> None:
        KimiDeltaAttention.__init__(self, cfg, layer_idx)
        self.prefix = prefix
        self.cfg = cfg
        self.model_dtype = vllm_config.model_config.dtype
        self.kv_cache = (torch.tensor([]), torch.tensor([]))  # bound by vLLM (`bind_kv_cache`)
        _register(vllm_config, prefix, self)

    @property
    def mamba_type(self) -> MambaAttentionBackendEnum:
        return MambaAttentionBackendEnum.GDN_ATTN

    def get_state_shape(self) -> tuple[tuple[int, int], tuple[int, int, int]]:
        return kda_state_shapes(self.cfg)

    def get_state_dtype(self) -> tuple[torch.dtype, torch.dtype]:
        return kda_state_dtypes(self.model_dtype)

    def forward(self, x: torch.Tensor, valid=None, cache=None) -> torch.Tensor:
        """x [1, N, d]: the step's tokens packed (vLLM's order: decodes, then prefills) -> y [1, N, d].
        ``valid`` and ``cache`` (the torch engine's) are not used: vLLM packs without padding."""
        metadata = get_forward_context().attn_metadata
        if metadata is None:  # vLLM's profiling / dummy runs: no requests, no state
            return torch.zeros_like(x)
        meta = metadata[self.prefix]
        out = torch.zeros_like(x[0])
        decode_tokens = meta.num_decode_tokens
        slots = meta.non_spec_state_indices_tensor.long()
        starts = meta.non_spec_query_start_loc
        if meta.num_decodes:
            out[:decode_tokens] = self._decode(x[0, :decode_tokens], slots[: meta.num_decodes])
        if meta.num_prefills:
            first, last = meta.num_decodes, meta.num_decodes + meta.num_prefills
            offsets = (starts[first : last + 1] - decode_tokens).tolist()
            end = decode_tokens + meta.num_prefill_tokens
            out[decode_tokens:end] = self._prefill(
                x[0, decode_tokens:end], slots[first:last], meta.has_initial_state[first:last], offsets
            )
        return out.unsqueeze(0)

    def _tails(self, slots: torch.Tensor) -> dict[str, torch.Tensor]:
        return dict(zip(CONV_NAMES, self.kv_cache[0][slots].chunk(3, dim=1), strict=True))

    def _store(self, slots: torch.Tensor, tails: dict[str, torch.Tensor], state: torch.Tensor) -> None:
        conv, recurrent = self.kv_cache
        conv[slots] = torch.cat([tails[n] for n in CONV_NAMES], dim=1).to(conv.dtype)
        recurrent[slots] = state.to(recurrent.dtype)

    def _decode(self, x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """One token of each of D requests: x [D, d] -> [D, d]."""
        x = x.unsqueeze(1)
        q, k, v, tails = self.short_convs(x, self._tails(slots))
        q, k, v, g, beta = self.kernel_inputs(x, q, k, v)
        state = self.kv_cache[1][slots]
        o, final = fused_recurrent_kda(q, k, v, g, beta, initial_state=state, output_final_state=True)
        self._store(slots, tails, final)
        return self.output(o, x)[:, 0]

    def _prefill(
        self, x: torch.Tensor, slots: torch.Tensor, continued: torch.Tensor, offsets: list[int]
    ) -> torch.Tensor:
        """P requests' new tokens packed, x [sum L, d]; ``continued`` [P] says which carry a state already
        (a prefill split over steps); ``offsets`` [P + 1] their starts. -> [sum L, d]."""
        convs: list[list[torch.Tensor]] = [[], [], []]
        new_tails: list[dict[str, torch.Tensor]] = []
        for i, (start, end) in enumerate(zip(offsets[:-1], offsets[1:], strict=True)):
            tails = self._tails(slots[i : i + 1]) if bool(continued[i]) else {}
            *qkv, tails = self.short_convs(x[None, start:end], tails)
            for acc, t in zip(convs, qkv, strict=True):
                acc.append(t)
            new_tails.append(tails)
        q, k, v = (torch.cat(acc, dim=1) for acc in convs)
        q, k, v, g, beta = self.kernel_inputs(x[None], q, k, v)
        # A new request's slot holds whatever the cache memory held (never zeroed; NaN possible): select,
        # do not multiply by 0 (NaN * 0 is NaN).
        held = self.kv_cache[1][slots]
        state = torch.where(continued.view(-1, 1, 1, 1).bool(), held, torch.zeros_like(held))
        cu_seqlens = torch.tensor(offsets, dtype=torch.long, device=x.device)
        o, final = chunk_kda(
            q, k, v, g, beta, initial_state=state, output_final_state=True, cu_seqlens=cu_seqlens
        )
        tails = {n: torch.cat([t[n] for t in new_tails], dim=0) for n in CONV_NAMES}
        self._store(slots, tails, final)
        return self.output(o, x[None])[0]


class VllmMLA(MultiHeadLatentAttention):
    """A NoPE MLA layer run as multi-head attention on vLLM's `Attention` (see the module docstring)."""

    def __init__(self, cfg: K3Config, layer_idx: int, prefix: str, vllm_config: VllmConfig) -> None:
        super().__init__(cfg, layer_idx)
        self.head_size = attention_head_size(cfg)
        self.attn = Attention(
            num_heads=self.num_heads,
            head_size=self.head_size,
            scale=self.scale,
            num_kv_heads=self.num_heads,
            cache_config=vllm_config.cache_config,
            prefix=f"{prefix}.attn",
        )

    def forward(self, x: torch.Tensor, key_valid=None, cache=None) -> torch.Tensor:
        """x [1, N, d] (the step's tokens packed) -> y [1, N, d]; the paged K/V cache is vLLM's."""
        q = self.queries(x[0])
        c_kv, k_extra = self.latents(x[0])
        k, v = self.expanded_keys_values(c_kv, k_extra)
        q, k, v = (self._pad(t) for t in (q, k, v))
        o = self.attn(q.flatten(1), k.flatten(1), v.flatten(1))
        o = o.view(-1, self.num_heads, self.head_size)[..., : self.v_dim]
        return self.output(o.unsqueeze(0), x)

    def _pad(self, t: torch.Tensor) -> torch.Tensor:
        """[N, H, w] -> [N, H, head_size] with zeros."""
        return torch.nn.functional.pad(t, (0, self.head_size - t.shape[-1]))
