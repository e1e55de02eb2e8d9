"""Convert a checkpoint of the earlier layout into the distributed one, in place.

So that a run saved before the distributed layout resumes at any world size; the old files stay beside
the new ones. Usage: python -m rl.learner.checkpoint_convert RUN_DIR/checkpoints/iter_N [--config CONFIG]

Design: docs/design/training.md#rl-checkpoint-convert.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

import torch

from model.moe import EXPERT_WEIGHTS, expert_key, stacked_slot
from rl.checkpoints import POLICY
from rl.learner.manifest import OLD_STATE
from rl.learner.shard_checkpoint import set_rng_state
from rl.learner.sharding import VALUE_HEAD, local, stacked_names

OLD_SHARDS = "shards"


def old_parameter_order(model: torch.nn.Module, value_head: bool) -> list[str]:
    """The names of the parameters the earlier learner's AdamW stepped, in its order (the model's
    trainable parameters with each expert a module of w1, w3, w2, then the value head's)."""
    names: list[str] = []
    for name, param in model.named_parameters():
        head, _, weight = name.rpartition(".")
        if head.endswith(".experts") and weight in EXPERT_WEIGHTS:
            if weight == EXPERT_WEIGHTS[0]:  # expert after expert, each with its three weights
                names += [expert_key(head + ".", e, w) for e in range(param.shape[0]) for w in EXPERT_WEIGHTS]
        elif param.requires_grad:
            names.append(name)
    return names + ([VALUE_HEAD + "weight", VALUE_HEAD + "bias"] if value_head else [])


def single_rank_moments(state: dict[str, Any], order: list[str]) -> dict[str, dict[str, torch.Tensor]]:
    """AdamW's state per parameter name from an earlier single-rank ``learner.pt``."""
    return {order[index]: dict(moments) for index, moments in state["optimizer"]["state"].items()}


Moments = dict[str, dict[str, torch.Tensor]]  # parameter name -> AdamW's step, exp_avg, exp_avg_sq


def sharded_moments(directory: Path, state: dict[str, Any]) -> tuple[Moments, dict[str, torch.Tensor], dict,
                                                                      list[dict]]:  # fmt: skip
    """From an earlier sharded checkpoint's ``shards/rank{r}.pt``: AdamW's state per parameter name,
    the value head's tensors (``value_head.*``), rank 0's RNG states and AdamW's param groups."""
    files = [torch.load(directory / OLD_SHARDS / f"rank{r}.pt", weights_only=False, map_location="cpu")
             for r in range(state["sharded"])]  # fmt: skip
    names, numels = files[0]["flat_names"], files[0]["flat_numels"]
    total = sum(numels)
    moments: dict[str, dict[str, torch.Tensor]] = {}
    step = files[0]["optimizer"]["state"][0]["step"]
    for key in ("exp_avg", "exp_avg_sq"):  # the flat slices, concatenated, cut per parameter
        flat = torch.cat([f["optimizer"]["state"][0][key] for f in files])[:total]
        for name, part in zip(names, flat.split(numels), strict=True):
            moments.setdefault(name, {"step": step.clone()})[key] = part
    values = dict(zip(names, torch.cat([f["flat"] for f in files])[:total].split(numels), strict=True))
    for f in files:  # each rank's experts come after its slice in its optimizer's order
        for index, name in enumerate(f["experts"], start=1):
            if index in f["optimizer"]["state"]:
                moments[name] = dict(f["optimizer"]["state"][index])
    heads = {n: v for n, v in values.items() if n.startswith(VALUE_HEAD)}
    return moments, heads, files[0]["rng"], files[0]["optimizer"]["param_groups"]


def convert(directory: str | Path, cfg: Any) -> None:
    """Convert the checkpoint ``directory`` (see the module docstring); ``cfg``: its run's `RunConfig`."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    from rl.learner.learner import Learner

    directory = Path(directory)
    if not (directory / OLD_STATE).is_file():
        raise FileNotFoundError(f"{directory}: no {OLD_STATE}, not a checkpoint of the earlier layout")
    state = torch.load(directory / OLD_STATE, weights_only=False, map_location="cpu")
    one_rank = dataclasses.replace(cfg.trainer, learner=dataclasses.replace(cfg.trainer.learner, world_size=1,
                                                                             expert_parallel=1))  # fmt: skip
    learner = Learner(dataclasses.replace(cfg, trainer=one_rank))
    order = old_parameter_order(learner.model, learner.value_head is not None)
    if "sharded" in state:
        moments, heads, rng, old_groups = sharded_moments(directory, state)
    else:
        moments, rng = single_rank_moments(state, order), state["rng"]
        heads = {VALUE_HEAD + k: v for k, v in (state["value_head"] or {}).items()}
        old_groups = state["optimizer"]["param_groups"]
    full = StateDictOptions(full_state_dict=True, strict=True)
    learner.load_weights(load_file(str(directory / POLICY / "model.safetensors")))
    if learner.value_head is not None:
        head = {k[len(VALUE_HEAD):]: v.view_as(learner.value_head.get_parameter(k[len(VALUE_HEAD):]))
                for k, v in heads.items()}  # fmt: skip
        set_model_state_dict(learner.value_head, head, options=full)
    if learner.reference is not None and state.get("reference") is not None:
        set_model_state_dict(learner.reference, stacked_names(state["reference"]), options=full)
    _put_moments(learner, moments)
    for group, old in zip(learner.optimizer.param_groups, old_groups, strict=True):
        group.update({k: v for k, v in old.items() if k != "params"})  # the lr the schedule had set
    learner.scheduler.load_state_dict(state["scheduler"])
    learner.version, learner.steps = int(state["version"]), int(state["steps"])
    set_rng_state(rng)
    learner.save(directory)


def _put_moments(learner: Any, moments: dict[str, dict[str, torch.Tensor]]) -> None:
    """The old per-name AdamW state into the learner's optimizer (one rank: its shards are whole); the
    experts' rows stacked in expert order. A parameter the old optimizer never stepped keeps step 0."""
    new: dict[str, dict[str, torch.Tensor]] = {}
    rows: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for old, state in moments.items():
        target, index = stacked_slot(old)
        if index is None:
            new[target] = state
        else:
            rows.setdefault(target, {})[index] = state
    for target, experts in rows.items():
        ordered = [experts[e] for e in sorted(experts)]
        new[target] = {"step": ordered[0]["step"]} | {
            key: torch.stack([row[key] for row in ordered]) for key in ("exp_avg", "exp_avg_sq")}
    named = [(n, p) for n, p in learner.model.named_parameters() if p.requires_grad]
    if learner.value_head is not None:
        named += [(VALUE_HEAD + n, p) for n, p in learner.value_head.named_parameters()]
    for name, param in named:
        if name in new:
            target = learner.optimizer.state[param]
            for key in ("exp_avg", "exp_avg_sq"):
                local(target[key]).copy_(new[name][key].view(param.shape))
            target["step"].copy_(new[name]["step"])


def main(argv: list[str] | None = None) -> None:
    from omegaconf import OmegaConf

    from rl.config.load import load

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--config", type=Path, help="the run's resolved_config.yaml (default: 2 folders up)")
    args = parser.parse_args(argv)
    config = args.config or args.checkpoint.resolve().parents[1] / "resolved_config.yaml"
    if not config.is_file():
        sys.exit(f"rl.learner.checkpoint_convert: {config} not found; name the run's config with --config")
    convert(args.checkpoint, load(OmegaConf.load(config)))
    print(f"converted {args.checkpoint}")


if __name__ == "__main__":
    main()
