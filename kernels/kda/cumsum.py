"""In-chunk cumulative sum of the KDA log decay (forward: ``G`` from ``g``; backward, reversed: ``dg``
from ``dG``), one program per chunk and head."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.kda.chunk_utils import TILE_LAUNCH, ChunkArgs


@triton.jit
def _chunk_cumsum_kernel(
    x_ptr, out_ptr, chunk_start_ptr, chunk_end_ptr, H, C: tl.constexpr, D: tl.constexpr, REVERSE: tl.constexpr
):
    """Cumulative sum over the tokens of one chunk (reverse: from the chunk's last token)."""
    c = tl.program_id(0).to(tl.int64)  # 64-bit offsets: T·H·D can pass 2³¹
    h = tl.program_id(1)
    start = tl.load(chunk_start_ptr + c).to(tl.int64)
    end = tl.load(chunk_end_ptr + c).to(tl.int64)
    rows = start + tl.arange(0, C)
    cols = tl.arange(0, D)
    mask = (rows < end)[:, None]
    offs = (rows[:, None] * H + h) * D + cols[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, tl.cumsum(x, axis=0, reverse=REVERSE), mask=mask)


def chunk_local_cumsum(x: torch.Tensor, args: ChunkArgs, reverse: bool) -> torch.Tensor:
    """fp32 cumulative sum of ``x [T, H, D]`` over the tokens of each chunk (from its end if ``reverse``)."""
    T, H, D = x.shape
    out = torch.empty(T, H, D, dtype=torch.float32, device=x.device)
    if args.table.n_chunks:
        grid = (args.table.n_chunks, H)
        args.launch(_chunk_cumsum_kernel, grid, x, out, D=D, REVERSE=reverse, **TILE_LAUNCH)
    return out
