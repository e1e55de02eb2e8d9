"""Save / load a K3 model as `model.safetensors` + `config.json` in Moonshot's layout.

So that vLLM, sglang and transformers read what `save_pretrained` writes; loading is strict
(`CheckpointMismatch` names the first bad tensor), and the export streams tensor by tensor
(`StreamingExport`) for a sharded learner.

Design: docs/design/model.md#model-checkpoint.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from model.config import K3Config

if TYPE_CHECKING:  # the tensor I/O imports torch on use: reading a config (a trainer's check) needs none
    import torch

WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"


class CheckpointMismatch(ValueError):
    """The checkpoint's tensors do not fit the model its config describes."""


def _checkpoint_state(model) -> dict[str, torch.Tensor]:
    return _stored(model.state_dict(), model.config)


def _stored(state: dict[str, torch.Tensor], config: K3Config) -> dict[str, torch.Tensor]:
    state = dict(state)
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # stored once, as model.embed_tokens.weight
    return {k: v.detach().contiguous() for k, v in state.items()}


SAFETENSORS_DTYPES = {  # torch dtype name -> safetensors' name
    "float32": "F32", "bfloat16": "BF16", "float16": "F16", "float64": "F64", "int64": "I64", "int32": "I32",
    "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL",
}  # fmt: skip


class StreamingExport:
    """``save_pretrained``'s folder written tensor by tensor: the safetensors header from ``layout``
    ((name, dtype, shape) of every tensor, in the order they will come), then each chunk of tensors
    handed to `write` (e.g. one sharded learner unit's full weights at a time), so the whole state dict
    is never in memory at once. `close` checks that every tensor came, then puts the file in place
    (atomically) and writes ``config.json``. With tied embeddings ``lm_head.weight`` is left out."""

    def __init__(self, directory: str | Path, config: K3Config,
                 layout: Iterable[tuple[str, torch.dtype, tuple[int, ...]]]) -> None:  # fmt: skip
        self.directory, self.config = Path(directory), config
        self.directory.mkdir(parents=True, exist_ok=True)
        tied = config.tie_word_embeddings
        self.expected = [entry for entry in layout if not (tied and entry[0] == "lm_head.weight")]
        header: dict[str, object] = {}
        offset = 0
        for name, dtype, shape in self.expected:
            size = math.prod(shape) * dtype.itemsize
            kind = SAFETENSORS_DTYPES[str(dtype).removeprefix("torch.")]
            header[name] = {"dtype": kind, "shape": list(shape), "data_offsets": [offset, offset + size]}
            offset += size
        header["__metadata__"] = {"format": "pt"}
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        self.tmp = self.directory / (WEIGHTS_NAME + ".tmp")
        self.file = open(self.tmp, "wb")  # noqa: SIM115 (closed by close())
        self.file.write(struct.pack("<Q", len(blob)) + blob)
        self.done = 0

    def write(self, tensors: dict[str, torch.Tensor]) -> None:
        """The next tensors of the layout (names, dtypes and shapes checked)."""
        import torch

        for name, tensor in tensors.items():
            if self.config.tie_word_embeddings and name == "lm_head.weight":
                continue
            if self.done >= len(self.expected):
                raise ValueError(f"export: {name!r} comes after every tensor of the layout")
            want = self.expected[self.done]
            if (name, tensor.dtype, tuple(tensor.shape)) != want:
                raise ValueError(f"export: got {name!r} {tensor.dtype} {tuple(tensor.shape)}, expected "
                                 f"{want[0]!r} {want[1]} {want[2]}")  # fmt: skip
            self.file.write(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)
            self.done += 1

    def close(self) -> None:
        self.file.close()
        if self.done != len(self.expected):
            missing = self.expected[self.done][0]
            left = len(self.expected) - self.done
            raise ValueError(f"export: {left} tensors never came, the first {missing!r}")
        os.replace(self.tmp, self.directory / WEIGHTS_NAME)  # never a half-written file under the real name
        with open(self.directory / CONFIG_NAME, "w") as f:
            json.dump(self.config.to_hf_dict(), f, indent=2)


def save_pretrained(model, directory: str | Path) -> None:
    """Write ``model.safetensors`` (the state dict's checkpoint names) and ``config.json``."""
    state = {k: v.detach() for k, v in model.state_dict().items()}
    layout = [(k, v.dtype, tuple(v.shape)) for k, v in state.items()]
    writer = StreamingExport(directory, model.config, layout)
    writer.write(state)
    writer.close()


def load_state_checked(model, state: dict[str, torch.Tensor]) -> None:
    """Copy `state` into `model`, refusing any name or shape that disagrees (first offender named)."""
    expected = _checkpoint_state(model)
    for name, tensor in expected.items():
        if name not in state:
            raise CheckpointMismatch(f"checkpoint lacks tensor {name!r} (shape {tuple(tensor.shape)})")
        if tuple(state[name].shape) != tuple(tensor.shape):
            raise CheckpointMismatch(
                f"tensor {name!r} has shape {tuple(state[name].shape)} in the checkpoint but "
                f"{tuple(tensor.shape)} in the model built from its config"
            )
    unexpected = [name for name in state if name not in expected]
    if unexpected:
        raise CheckpointMismatch(f"checkpoint has tensor {unexpected[0]!r} that the model does not have")
    model.load_state_dict(state, strict=not model.config.tie_word_embeddings)


def read_config(directory: str | Path) -> K3Config:
    """The `config.json` of a folder written by `save_pretrained` (both of its files must be there)."""
    directory = Path(directory)
    for name in (CONFIG_NAME, WEIGHTS_NAME):
        if not (directory / name).is_file():
            raise FileNotFoundError(
                f"{directory / name} is missing; expected a folder written by save_pretrained"
            )
    return K3Config.from_json(directory / CONFIG_NAME)


def load_pretrained(model, directory: str | Path, dtype: torch.dtype | None = None):
    """Load `directory/model.safetensors` into `model` (built from `read_config(directory)`), strictly;
    with `dtype`, cast the model but keep the routers' selection bias fp32, as in the checkpoints."""
    from safetensors.torch import load_file

    load_state_checked(model, load_file(str(Path(directory) / WEIGHTS_NAME)))
    if dtype is not None:
        model.to(dtype)
        for router in model.moe_routers():
            router.e_score_correction_bias.data = router.e_score_correction_bias.data.float()
    return model
