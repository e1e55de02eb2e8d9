"""Save / load a K3 model as `model.safetensors` + `config.json` in Moonshot's layout.

The state dict already carries the checkpoint names (the module tree mirrors them), and `config.json` is
`K3Config.to_hf_dict()` (`model_type: kimi_linear`, `architectures: [KimiLinearForCausalLM]`), so vLLM,
sglang and transformers can read what `save_pretrained` writes. Loading is strict: a missing, unexpected or
differently shaped tensor raises `CheckpointMismatch` naming the first such tensor.
`K3ForCausalLM.from_pretrained` builds the model from `read_config` and fills it with `load_pretrained`;
this module never imports the model class (model.k3 imports it, not the other way round).
"""

from __future__ import annotations

import json
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


def save_pretrained(model, directory: str | Path) -> None:
    save_state(model.state_dict(), model.config, directory)


def save_state(state: dict[str, torch.Tensor], config: K3Config, directory: str | Path) -> None:
    """`save_pretrained` of a model's full state dict and config, without the model (a sharded learner
    gathers the state dict from its ranks)."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = _stored(state, config)
    tmp = directory / (WEIGHTS_NAME + ".tmp")
    save_file(state, str(tmp), metadata={"format": "pt"})
    tmp.replace(directory / WEIGHTS_NAME)  # never leave a half-written checkpoint under the real name
    with open(directory / CONFIG_NAME, "w") as f:
        json.dump(config.to_hf_dict(), f, indent=2)


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
