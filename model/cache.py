"""Decoding caches: constant-size KDA state per KDA layer, compressed latent KV per MLA layer.

Per KDA layer: the recurrent state S [B, H, dk, dv] (fp32) and the last (kernel-1) inputs of the q, k and v
short convolutions. Per MLA layer: the normalised latent c_kv [B, S, kv_lora] and the shared unrotated key
dims k_extra [B, S, rope] (576 values per token at full size), stored in a buffer that grows by doubling.
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
    """Latent KV of one MLA layer, with amortised O(1) appends."""

    c_kv: torch.Tensor | None = None  # [B, capacity, kv_lora]
    k_extra: torch.Tensor | None = None  # [B, capacity, rope]
    length: int = 0

    def append(self, c_kv: torch.Tensor, k_extra: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append [B, T, *] latents; return views of everything cached so far."""
        new = c_kv.shape[1]
        if self.c_kv is None or self.length + new > self.c_kv.shape[1]:
            capacity = max(2 * (self.length + new), 16)
            self.c_kv = _grow(self.c_kv, c_kv, capacity, self.length)
            self.k_extra = _grow(self.k_extra, k_extra, capacity, self.length)
        self.c_kv[:, self.length : self.length + new] = c_kv
        self.k_extra[:, self.length : self.length + new] = k_extra
        self.length += new
        return self.c_kv[:, : self.length], self.k_extra[:, : self.length]

    def select(self, index: torch.Tensor) -> None:
        if self.c_kv is not None:
            self.c_kv = self.c_kv.index_select(0, index)
            self.k_extra = self.k_extra.index_select(0, index)

    def nbytes(self) -> int:
        if self.c_kv is None:
            return 0
        return self.length * (
            self.c_kv.shape[0] * self.c_kv.shape[2] * self.c_kv.element_size()
            + self.k_extra.shape[0] * self.k_extra.shape[2] * self.k_extra.element_size()
        )


def _grow(old: torch.Tensor | None, like: torch.Tensor, capacity: int, length: int) -> torch.Tensor:
    buf = like.new_zeros(like.shape[0], capacity, like.shape[2])
    if old is not None and length:
        buf[:, :length] = old[:, :length]
    return buf


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
    return layer.c_kv.device if layer.c_kv is not None else None
