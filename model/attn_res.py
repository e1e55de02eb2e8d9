"""Block Attention Residuals: each sub-layer reads a softmax mixture over earlier representations.

h = sum_i softmax_i(w . RMSNorm(v_i)) v_i, with a learned pseudo-query w in R^d per sub-layer (initialised to
zero: a uniform mix at the start); the mix is over the un-normalised v_i and then feeds the usual pre-norm.
The sources are the embedding, one summed representation per finished block of `attn_res_block_size`
decoder layers, and the running partial sum of the current block (`DepthSources`). Full AttnRes makes
every sub-layer output its own source; the plain residual stream is the model without AttnRes.
"""

from __future__ import annotations

import torch
from torch import nn

from model.norm import RMSNorm


def depth_mix(sources: list[torch.Tensor], norm: RMSNorm, proj: nn.Linear) -> torch.Tensor:
    """Softmax mixture of `sources` (each [..., d]) scored by `proj(norm(v_i))` (proj: d -> 1, no bias)."""
    if len(sources) == 1:
        return sources[0]
    values = torch.stack(sources, dim=0)  # [N, ..., d]
    logits = proj(norm(values)).squeeze(-1).float()  # [N, ...]
    weights = torch.softmax(logits, dim=0).to(values.dtype)
    return (weights.unsqueeze(-1) * values).sum(dim=0)


def make_depth_query(width: int, eps: float) -> tuple[RMSNorm, nn.Linear]:
    """The (RMSNorm, pseudo-query projection [1, d]) pair of one sub-layer, the query zero-initialised."""
    proj = nn.Linear(width, 1, bias=False)
    nn.init.zeros_(proj.weight)
    return RMSNorm(width, eps), proj


class DepthSources:
    """The representations a sub-layer may attend over, across depth (Block AttnRes bookkeeping).

    `blocks` holds the embedding and one sum per finished block; `partial` the sum of the current block's
    sub-layer outputs so far. A block's sum is pushed to `blocks` *after* the first sub-layer of the next
    block has used it as a source (`close_block`), so that sub-layer sees exactly [b_0 .. b_{n-1}].

    A decoder layer gets ``blocks`` and ``partial`` as tensors (so that a sharded learner's wrapper sees
    them, `model.k3.K3DecoderLayer.forward`) and works on its own copy; the model replays the layer's two
    outputs on its sources with the same two steps, `open_layer` then `add_output` per sub-layer.
    """

    def __init__(self, embedding: torch.Tensor, block_size: int = 1, full: bool = True) -> None:
        self.blocks: list[torch.Tensor] = [embedding]
        self.partial: torch.Tensor | None = None
        self.block_size, self.full = block_size, full

    def copy(self) -> DepthSources:
        twin = DepthSources(self.blocks[0], self.block_size, self.full)
        twin.blocks, twin.partial = list(self.blocks), self.partial
        return twin

    def open_layer(self, index: int) -> None:
        """After layer ``index``'s attention read its sources: its block starts here (block AttnRes)."""
        if not self.full and index > 0 and index % self.block_size == 0:
            self.close_block()  # the finished block was a source of this sub-layer; now it is a block sum

    def add_output(self, output: torch.Tensor) -> None:
        """A sub-layer's output joins the sources (full AttnRes: as a source of its own)."""
        self.add(output)
        if self.full:
            self.close_block()

    def sources(self) -> list[torch.Tensor]:
        return self.blocks + ([self.partial] if self.partial is not None else [])

    def add(self, output: torch.Tensor) -> None:
        self.partial = output if self.partial is None else self.partial + output

    def close_block(self) -> None:
        if self.partial is not None:
            self.blocks.append(self.partial)
            self.partial = None
