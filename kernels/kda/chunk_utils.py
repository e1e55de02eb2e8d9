"""What the KDA chunk kernels share: chunk size, block sizes, launch options, the chunk table and the
common kernel parameters (``ChunkArgs``), defined once for ``chunk_fwd.py``, ``chunk_bwd.py`` and
``cumsum.py``.

``ChunkArgs.launch`` fills each kernel's shared parameters by name, so they are written once here.

Design: docs/design/model.md#kernels-kda-chunk-utils.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from triton.runtime.jit import KernelInterface

CHUNK = 64  # tokens per chunk
SUB = 16  # tokens per sub-tile of the intra-chunk score kernels
# Launch options, chosen by compiling for sm_90 (``python scripts/compile_check.py``): 8 warps keep the
# [64, 128] fp32 tiles from spilling much; two pipeline stages keep the state passes within shared memory.
TILE_LAUNCH = {"num_warps": 8}
STATE_LAUNCH = {"num_warps": 8, "num_stages": 2}
SUB_TILE_LAUNCH = {"num_warps": 8}


def check_head_dims(K: int, V: int) -> None:
    """The Triton KDA kernels hold whole head dims in registers: powers of two in [16, 128]."""
    for name, d in (("K", K), ("V", V)):
        if d < 16 or d > 128 or d & (d - 1):
            raise ValueError(
                f"Triton KDA needs head dim {name} to be a power of two in [16, 128]; got {d}. "
                "Use K3_KERNELS=reference for other sizes."
            )


def key_block(K: int) -> int:
    """Key channels per program of the backward's key-side kernel (keeps its [64, BK] tiles small)."""
    return min(K, 64)


def value_block(K: int, V: int) -> int:
    """Value channels per program of the state passes: keeps [K, BV] fp32 tiles within shared memory."""
    return min(V, 64 if K <= 64 else 32)


class ChunkTable:
    """Where every chunk and sequence lies on the packed token axis (int32 tensors on the device)."""

    def __init__(self, bounds: Sequence[tuple[int, int]], device: torch.device) -> None:
        chunk_start, chunk_end, first_chunk = [], [], []
        for bos, eos in bounds:
            first_chunk.append(len(chunk_start))
            for s in range(bos, eos, CHUNK):
                chunk_start.append(s)
                chunk_end.append(min(s + CHUNK, eos))

        def as_tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32, device=device)

        self.n_chunks = len(chunk_start)
        self.n_seqs = len(bounds)
        self.chunk_start, self.chunk_end = as_tensor(chunk_start), as_tensor(chunk_end)
        self.seq_start = as_tensor([b for b, _ in bounds])
        self.seq_end = as_tensor([e for _, e in bounds])
        self.seq_first_chunk = as_tensor(first_chunk)


@dataclass(frozen=True)
class ChunkArgs:
    """The parameters shared by the KDA chunk kernels, for one call (table, heads, head dims, scale)."""

    table: ChunkTable
    H: int
    K: int
    V: int
    scale: float

    @property
    def BK(self) -> int:
        return key_block(self.K)

    @property
    def BV(self) -> int:
        return value_block(self.K, self.V)

    def values(self) -> dict[str, object]:
        """Every shared kernel parameter by name, in the order kernels declare them."""
        t = self.table
        return {
            "chunk_start_ptr": t.chunk_start,  # [n_chunks] first token of each chunk
            "chunk_end_ptr": t.chunk_end,  # [n_chunks] one past its last token
            "seq_start_ptr": t.seq_start,  # [n_seqs] first token of each sequence
            "seq_end_ptr": t.seq_end,  # [n_seqs] one past its last token
            "seq_first_chunk_ptr": t.seq_first_chunk,  # [n_seqs] index of its first chunk
            "scale": self.scale,  # query scale
            "H": self.H,  # heads
            "n_chunks": t.n_chunks,
            "K": self.K,  # constexpr: key head dim
            "V": self.V,  # constexpr: value head dim
            "BK": self.BK,  # constexpr: key channels per program
            "BV": self.BV,  # constexpr: value channels per program
            "C": CHUNK,  # constexpr: tokens per chunk
            "S": SUB,  # constexpr: tokens per sub-tile
            "NKB": self.K // self.BK,  # constexpr: key blocks
        }

    def launch(
        self, kernel: KernelInterface, grid: tuple[int, ...], *tensors: torch.Tensor, **kwargs: object
    ) -> None:
        """``kernel[grid](*tensors, <the shared parameters it declares>, **kwargs)``.

        ``kernel`` is a ``@triton.jit`` function (compiled, or interpreted under ``TRITON_INTERPRET=1``);
        ``kwargs`` carries its own flags and the launch options (``num_warps``, ...).
        """
        shared = self.values()
        declared = {name: shared[name] for name in kernel.arg_names if name in shared}
        kernel[grid](*tensors, **declared, **kwargs)
