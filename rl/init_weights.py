"""``model.init_from``: start a run (RL or SFT) from the weights of an earlier one.

The path may be a ``save_pretrained`` folder (``config.json`` + ``model.safetensors``), a checkpoint
written by the trainer or the SFT stage (its ``policy/`` folder is used), or a run folder (its latest
checkpoint; layout: ``rl.checkpoints``). The checkpoint's model config must equal the run's ``model``
group: a mismatch is a `ConfigError` naming the differing keys, found before Ray or any sandbox starts.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from agentenv.errors import ConfigError
from model import checkpoint
from model.config import ConfigError as ModelConfigError
from rl.checkpoints import POLICY, latest_checkpoint

if TYPE_CHECKING:
    from model import K3ForCausalLM


def policy_dir(path: str | Path) -> Path:
    """The ``save_pretrained`` folder that ``model.init_from=path`` names (see the module docstring)."""
    path = Path(path)
    if (path / checkpoint.CONFIG_NAME).is_file():
        return path
    if (path / POLICY / checkpoint.CONFIG_NAME).is_file():
        return path / POLICY
    try:
        return latest_checkpoint(path) / POLICY
    except FileNotFoundError:
        raise ConfigError(
            f"model.init_from: {path} holds no policy weights (expected a save_pretrained folder with "
            f"{checkpoint.CONFIG_NAME}, a checkpoint with policy/, or a run folder with checkpoints/iter_*)"
        ) from None


def check_init_from(model_cfg) -> Path | None:
    """The policy folder of ``model_cfg.init_from`` after checking its config equals ``model_cfg``'s
    shapes; None when ``init_from`` is not set. Raises a one-line `ConfigError`."""
    if not model_cfg.init_from:
        return None
    folder = policy_dir(model_cfg.init_from)
    try:
        saved = checkpoint.read_config(folder).to_dict()
    except (FileNotFoundError, ModelConfigError, ValueError) as exc:
        raise ConfigError(f"model.init_from: {exc}") from None
    wanted = model_cfg.to_dict()
    differing = sorted(k for k in set(saved) | set(wanted) if saved.get(k) != wanted.get(k))
    if differing:
        shown = ", ".join(f"{k}={saved.get(k)!r} there vs {wanted.get(k)!r} here" for k in differing[:4])
        more = f" and {len(differing) - 4} more" if len(differing) > 4 else ""
        raise ConfigError(
            f"model.init_from: the checkpoint in {folder} has another model config: {shown}{more}; "
            "pick the model group it was trained with"
        )
    return folder


def load_init_weights(model: K3ForCausalLM, model_cfg) -> Path | None:
    """Copy the ``model.init_from`` weights into ``model`` in place (no-op when it is not set)."""
    folder = check_init_from(model_cfg)
    if folder is not None:
        checkpoint.load_pretrained(model, folder)
    return folder
