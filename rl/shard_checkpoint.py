"""Checkpoints of a sharded learner (``trainer.learner.world_size`` > 1): one file per rank, plus the
full policy, so that the same folder resumes at its own world size bit-exactly and loads at world size 1.

A checkpoint folder holds, besides the trainer's own files:

- ``policy/``: the full weights (`model.checkpoint.save_state`, gathered from the ranks; written by rank 0):
  what ``save_pretrained`` exports and ``model.init_from`` reads, whatever the world size;
- ``learner.pt`` (rank 0): schedule, reference policy, step and version, and ``sharded: world_size``;
- ``shards/rank{r}.pt`` (rank r): its flat parameter slice, its routed experts (names local to the rank,
  with their offset), its AdamW state, its RNG states and the layout (names and sizes) of its slice.

Resuming at the same world size reads each rank's own file: the slice, experts and AdamW state come back
exactly. At world size 1 (`consolidated_optimizer_state`) the slices are concatenated and cut back into
per-parameter AdamW moments in the single-rank learner's parameter order, so training continues there.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from model import checkpoint
from model.expert_parallel import local_expert_name
from rl.checkpoints import LEARNER_STATE, POLICY
from rl.data_parallel import VALUE_HEAD

SHARDS = "shards"
# ``learner`` below is a `rl.learner.Learner` (not imported: it imports this module)


def shard_file(directory: Path, rank: int) -> Path:
    return directory / SHARDS / f"rank{rank}.pt"


def rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}


def set_rng_state(rng: dict[str, Any]) -> None:
    torch.set_rng_state(rng["torch"])
    np.random.set_state(rng["numpy"])
    random.setstate(rng["python"])


def save_sharded(learner: Any, directory: Path) -> None:
    """Every rank calls it (the full weights are gathered): see the module docstring."""
    parallel = learner.parallel
    group = parallel.group
    state = parallel.full_state_dict()
    if group.rank == 0:
        checkpoint.save_state(state, learner.model.config, directory / POLICY)
        torch.save(
            {
                "sharded": group.world_size,
                "expert_parallel": group.expert_parallel,
                "scheduler": learner.scheduler.state_dict(),
                "reference": learner.reference.state_dict() if learner.reference is not None else None,
                "version": learner.version,
                "steps": learner.steps,
            },
            directory / LEARNER_STATE,
        )
    del state
    path = shard_file(directory, group.rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    per_rank = parallel.dispatchers[0].per_rank if parallel.dispatchers else 0
    torch.save(
        {
            "flat": parallel.flat.shard.detach().clone(),
            "flat_names": parallel.flat_names,
            "flat_numels": parallel.flat.numels,
            "experts": {local_expert_name(n, group.rank * per_rank): p.detach().clone()
                        for n, p in zip(parallel.expert_names, parallel.experts, strict=True)},
            "optimizer": learner.optimizer.state_dict(),
            "rng": rng_state(),
        },
        path,
    )  # fmt: skip


def load_sharded(learner: Any, directory: Path, state: dict[str, Any]) -> None:
    """Resume each rank from its own file of a checkpoint written at the same world size."""
    parallel = learner.parallel
    group = parallel.group
    if state["sharded"] != group.world_size or state["expert_parallel"] != group.expert_parallel:
        raise ValueError(
            f"{directory} was written by {state['sharded']} learner ranks (expert_parallel "
            f"{state['expert_parallel']}); this learner has {group.world_size} ({group.expert_parallel}): "
            "resume at the same trainer.learner sizes, or at world_size 1"
        )
    from safetensors.torch import load_file

    full = load_file(str(directory / POLICY / checkpoint.WEIGHTS_NAME))
    with torch.no_grad():  # what is not sharded (router biases, buffers) comes from the full policy
        trained = set(parallel.flat_names) | set(parallel.expert_names)
        for name, tensor in learner.model.state_dict().items():
            if name not in trained and name in full:
                tensor.copy_(full[name])
    mine = torch.load(shard_file(directory, group.rank), weights_only=False, map_location="cpu")
    if mine["flat_names"] != parallel.flat_names:
        raise ValueError(f"{shard_file(directory, group.rank)}: its parameter layout is not this learner's")
    with torch.no_grad():
        parallel.flat.shard.copy_(mine["flat"])
        per_rank = parallel.dispatchers[0].per_rank if parallel.dispatchers else 0
        for name, p in zip(parallel.expert_names, parallel.experts, strict=True):
            p.copy_(mine["experts"][local_expert_name(name, group.rank * per_rank)])
    learner.optimizer.load_state_dict(mine["optimizer"])
    learner.scheduler.load_state_dict(state["scheduler"])
    if learner.reference is not None and state["reference"] is not None:
        learner.reference.load_state_dict(state["reference"])
    learner.version, learner.steps = int(state["version"]), int(state["steps"])
    set_rng_state(mine["rng"])


def consolidated(learner: Any, directory: Path, state: dict[str, Any]) -> dict[str, Any]:
    """A world_size-1 learner's view of a sharded checkpoint: its AdamW state dict (per parameter, in
    the single-rank order), value head and rank 0's RNG states."""
    files = [
        torch.load(shard_file(directory, r), weights_only=False, map_location="cpu")
        for r in range(state["sharded"])
    ]
    names = files[0]["flat_names"]
    numels = files[0]["flat_numels"]
    moments: dict[str, dict[str, torch.Tensor]] = {}
    total = sum(numels)
    for key in ("exp_avg", "exp_avg_sq"):
        flat = torch.cat([f["optimizer"]["state"][0][key] for f in files])[:total]
        for name, part in zip(names, flat.split(numels), strict=True):
            moments.setdefault(name, {})[key] = part
    flat_values = torch.cat([f["flat"] for f in files])[:total]
    values = dict(zip(names, flat_values.split(numels), strict=True))
    step = files[0]["optimizer"]["state"][0]["step"]
    for f in files:  # experts: the rank's parameters after the flat slice, in its optimizer's order
        expert_names = list(f["experts"])
        for i, name in enumerate(expert_names, start=1):
            if i in f["optimizer"]["state"]:
                moments[name] = dict(f["optimizer"]["state"][i])
    order = [n for n, p in learner.model.named_parameters() if p.requires_grad]
    if learner.value_head is not None:
        order += [VALUE_HEAD + n for n, _ in learner.value_head.named_parameters()]
    shapes = {n: p.shape for n, p in learner.model.named_parameters()}
    if learner.value_head is not None:
        shapes |= {VALUE_HEAD + n: p.shape for n, p in learner.value_head.named_parameters()}
    opt_state = {}
    for index, name in enumerate(order):
        if name in moments:
            entry = {k: v if k == "step" else v.view(shapes[name]) for k, v in moments[name].items()}
            entry.setdefault("step", step.clone())
            opt_state[index] = entry
    groups = learner.optimizer.state_dict()["param_groups"]
    files[0]["optimizer"]["param_groups"][0]["params"] = groups[0]["params"]
    value_head = {
        n[len(VALUE_HEAD) :]: v.view(shapes[n]) for n, v in values.items() if n.startswith(VALUE_HEAD)
    }
    return {
        "optimizer": {"state": opt_state, "param_groups": [files[0]["optimizer"]["param_groups"][0]]},
        "value_head": value_head or None,
        "rng": files[0]["rng"],
    }
