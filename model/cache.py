"""Decoding caches: constant-size KDA state per KDA layer, compressed latent KV per MLA layer.

Per KDA layer: the recurrent state S [B, H, dk, dv] (fp32) and the last (kernel-1) inputs of the q, k and v
short convolutions. Per MLA layer: the normalised latent c_kv [B, S, kv_lora] and the shared unrotated key
dims k_extra [B, S, rope] (576 values per token at full size), side by side in one buffer that grows by
doubling.
`K3Cache.key_mask` [B, S] remembers which cached positions are real tokens (left padding).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class KDALayerCache:
    """Recurrent state and conv tails of one KDA layer (None until the first forward fills them)."""

    state: torch.Tensor | None = None  # [B, H, dk, dv] fp32
    conv_tails: dict[str, torch.Tensor] = field(default_factory=dict)  # "q"/"k"/"v" -> [B, C, kernel-1]

    def select(self, index: torch.Tensor) -> None:
        if self.state is not None:
            self.state = self.state.index_select(0, index)
        self.conv_tails = {n: t.index_select(0, index) for n, t in self.conv_tails.items()}

    def nbytes(self) -> int:
        tensors = ([self.state] if self.state is not None else []) + list(self.conv_tails.values())
        return sum(t.numel() * t.element_size() for t in tensors)


@dataclass
class MLALayerCache:
    """Latent KV of one MLA layer in one buffer [B, capacity, kv_lora + rope], with amortised O(1) appends.

    Keeping c_kv and k_extra side by side makes the absorbed (MQA) key a view of the buffer, no copy.
    """

    latent: torch.Tensor | None = None  # [B, capacity, kv_lora + rope]
    kv_lora_rank: int = 0
    length: int = 0

    def append(self, c_kv: torch.Tensor, k_extra: torch.Tensor) -> torch.Tensor:
        """Append [B, T, kv_lora] and [B, T, rope]; return all cached so far, [B, S, kv_lora + rope]."""
        new = c_kv.shape[1]
        if self.latent is None or self.length + new > self.latent.shape[1]:
            capacity = max(2 * (self.length + new), 16)
            buf = c_kv.new_zeros(c_kv.shape[0], capacity, c_kv.shape[2] + k_extra.shape[2])
            if self.latent is not None and self.length:
                buf[:, : self.length] = self.latent[:, : self.length]
            self.latent, self.kv_lora_rank = buf, c_kv.shape[2]
        self.latent[:, self.length : self.length + new, : self.kv_lora_rank] = c_kv
        self.latent[:, self.length : self.length + new, self.kv_lora_rank :] = k_extra
        self.length += new
        return self.latent[:, : self.length]

    @property
    def c_kv(self) -> torch.Tensor | None:
        return None if self.latent is None else self.latent[:, : self.length, : self.kv_lora_rank]

    @property
    def k_extra(self) -> torch.Tensor | None:
        return None if self.latent is None else self.latent[:, : self.length, self.kv_lora_rank :]

    def select(self, index: torch.Tensor) -> None:
        if self.latent is not None:
            self.latent = self.latent.index_select(0, index)

    def nbytes(self) -> int:
        if self.latent is None:
            return 0
        return self.latent.shape[0] * self.length * self.latent.shape[2] * self.latent.element_size()


class K3Cache:
    """Everything incremental decoding carries between forward calls, one entry per decoder layer.

    Create it with `K3ForCausalLM.new_cache(batch_size)`; `forward(..., cache=cache)` fills and advances it.
    """

    def __init__(self, layers: list[KDALayerCache | MLALayerCache], batch_size: int) -> None:
        self.layers = layers
        self.batch_size = batch_size
        self.key_mask: torch.Tensor | None = None  # [B, seen] bool, True = real token

    @property
    def seen_tokens(self) -> int:
        return 0 if self.key_mask is None else self.key_mask.shape[1]

    def extend_mask(self, valid: torch.Tensor) -> torch.Tensor:
        """Record the validity of the new tokens [B, T]; return the mask of all cached positions [B, S]."""
        if valid.shape[0] != self.batch_size:
            raise ValueError(f"this cache holds {self.batch_size} sequences; got a batch of {valid.shape[0]}")
        self.key_mask = valid if self.key_mask is None else torch.cat([self.key_mask, valid], dim=1)
        return self.key_mask

    def select(self, index: torch.Tensor | list[int]) -> K3Cache:
        """Keep (and reorder / repeat) the sequences `index` of the batch, in place; returns self.

        E.g. `cache.select(torch.arange(B).repeat_interleave(G))` turns one prefilled prompt per row into G
        copies, for GRPO groups that share a prompt.
        """
        index = torch.as_tensor(index, dtype=torch.long)
        for layer in self.layers:
            layer.select(index.to(_device_of(layer) or index.device))
        if self.key_mask is not None:
            self.key_mask = self.key_mask.index_select(0, index.to(self.key_mask.device))
        self.batch_size = int(index.numel())
        return self

    def nbytes(self) -> int:
        """Bytes held by the cache tensors (MLA counted up to the cached length, not the capacity)."""
        return sum(layer.nbytes() for layer in self.layers)


def _device_of(layer: KDALayerCache | MLALayerCache) -> torch.device | None:
    if isinstance(layer, KDALayerCache):
        return layer.state.device if layer.state is not None else None
    return layer.latent.device if layer.latent is not None else None
