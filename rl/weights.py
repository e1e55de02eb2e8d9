"""The learner's weights of one version in Ray's object store, unit by unit: what the driver hands the
rollout workers and writes as a checkpoint's ``policy/``.

Every learner rank puts what `rl.learner.sharding.ShardedPolicy.full_units` hands it, one FSDP unit at a time
(`put_unit`: rank 0 the backbone, each expert-parallel rank its own experts), so no rank ever holds a
second full copy of the model; `PublishedWeights` collects the blocks of every rank. A worker resolves it
into a state dict (`resolve`); the driver streams it into ``model.safetensors`` block by block (`export`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
import torch

from model.checkpoint import StreamingExport
from model.config import K3Config

Layout = list[tuple[str, torch.dtype, tuple[int, ...]]]


@dataclass
class WeightBlock:
    """One unit's tensors (or a rank's experts of one unit) in the object store: their layout and ref."""

    layout: Layout
    ref: ray.ObjectRef


@dataclass
class PublishedWeights:
    """The full weights of ``version``, as blocks in the object store (any rank's, in unit order)."""

    version: int
    blocks: list[WeightBlock] = field(default_factory=list)

    @property
    def layout(self) -> Layout:
        return [entry for block in self.blocks for entry in block.layout]

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The whole state dict (fetched from the object store)."""
        state: dict[str, torch.Tensor] = {}
        for part in ray.get([block.ref for block in self.blocks]):
            state.update(part)
        return state

    def export(self, directory: str | Path, config: K3Config) -> None:
        """``save_pretrained``'s folder (``model.safetensors`` + ``config.json``) from the blocks, one
        block fetched at a time."""
        writer = StreamingExport(directory, config, self.layout)
        for block in self.blocks:
            writer.write(ray.get(block.ref))
        writer.close()


def put_unit(blocks: list[WeightBlock], unit: dict[str, torch.Tensor]) -> None:
    """A `full_units` sink: ``unit``'s tensors (CPU copies) into the object store as one block."""
    if not unit:
        return
    cpu = {name: tensor.detach().cpu() for name, tensor in unit.items()}
    layout = [(name, t.dtype, tuple(t.shape)) for name, t in cpu.items()]
    blocks.append(WeightBlock(layout, ray.put(cpu)))


def resolve(weights: Any) -> dict[str, torch.Tensor]:
    """A state dict from what a worker was handed: `PublishedWeights` (fetched), or a state dict."""
    return weights.state_dict() if isinstance(weights, PublishedWeights) else weights
