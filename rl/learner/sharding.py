"""The learner's policy on PyTorch's own sharding: FSDP2 (``fully_shard``) block by block on a device
mesh whose two dimensions are data and expert parallelism.

A unit's full weights exist only while it runs, so a step's peak is about two units' weights beside this
rank's shards; `ShardedPolicy.full_units` publishes weights unit by unit, never a second full copy.

Design: docs/design/training.md#rl-sharding.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard

from model import K3ForCausalLM
from model.expert_parallel import ExpertParallel, shard_experts
from model.moe import EXPERT_WEIGHTS, stacked_slot, write_per_expert
from rl.learner.ranks import RankGroup

VALUE_HEAD = "value_head."  # name prefix of the PPO value head's parameters beside the policy's


@dataclass(frozen=True)
class LearnerMesh:
    """The learner's device mesh: ``mesh`` 2-d (``dp``, ``ep``), ``world`` its flattened 1-d view."""

    mesh: DeviceMesh
    world: DeviceMesh

    @property
    def dp(self) -> DeviceMesh:
        return self.mesh["dp"]

    @property
    def ep(self) -> DeviceMesh:
        return self.mesh["ep"]


# per default group and shape; each entry keeps its group alive, so no later group can reuse its id
_MESHES: dict[tuple[int, int, int, str], tuple[object, LearnerMesh]] = {}


def learner_mesh(group: RankGroup, device: torch.device) -> LearnerMesh:
    """The mesh of ``group``'s ranks (made once per process group and shape: every rank makes it
    together; a group made again after the last was destroyed gets meshes of its own)."""
    world = dist.GroupMember.WORLD
    key = (id(world), group.world_size, group.expert_parallel, device.type)
    if key not in _MESHES:
        if group.world_size % group.expert_parallel:
            raise ValueError(f"expert_parallel={group.expert_parallel} does not divide the learner's "
                             f"{group.world_size} ranks")  # fmt: skip
        shape = (group.world_size // group.expert_parallel, group.expert_parallel)
        mesh = init_device_mesh(device.type, shape, mesh_dim_names=("dp", "ep"))
        _MESHES[key] = (world, LearnerMesh(mesh, mesh["dp", "ep"]._flatten("world")))
    return _MESHES[key][1]


def local(tensor: torch.Tensor) -> torch.Tensor:
    """The part of ``tensor`` this rank holds (a DTensor's local shard; a plain tensor itself)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def check_no_replicas(tensor: torch.Tensor) -> None:
    """Summing squares of local shards over the ranks counts each element once only if no mesh dimension
    of size > 1 replicates ``tensor``; a clear error otherwise."""
    if isinstance(tensor, DTensor):
        for size, placement in zip(tensor.device_mesh.shape, tensor.placements, strict=True):
            if size > 1 and isinstance(placement, Replicate):
                raise ValueError(f"a gradient replicated over {size} ranks ({tensor.placements}): the global "
                                 "norm would count it more than once")  # fmt: skip


class ShardedPolicy:
    """``model`` (and the value head, the KL reference) sharded with FSDP2 on ``mesh``; see the module
    docstring. ``compute_dtype`` bf16 turns on the mixed-precision policy."""

    def __init__(
        self, model: K3ForCausalLM, value_head: nn.Module | None, reference: K3ForCausalLM | None,
        mesh: LearnerMesh, compute_dtype: torch.dtype,
    ) -> None:  # fmt: skip
        self.model, self.value_head, self.reference, self.mesh = model, value_head, reference, mesh
        self.mp = MixedPrecisionPolicy()
        if compute_dtype != torch.float32:
            self.mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
        self.dispatchers: list[ExpertParallel] = self._shard(model, prefetch=True)
        if reference is not None:
            self._shard(reference, prefetch=False)
        if value_head is not None:
            self._unit(value_head, mesh.world)

    # ------------------------------------------------------------------ sharding
    def _unit(self, module: nn.Module, mesh: DeviceMesh, ignored: set[nn.Parameter] | None = None) -> None:
        fully_shard(module, mesh=mesh, mp_policy=self.mp, ignored_params=ignored or None)
        module.set_gradient_divide_factor(1.0)  # the ranks' losses are shares of the global loss: sum
        module.set_force_sum_reduction_for_comms(True)

    def _shard(self, model: K3ForCausalLM, prefetch: bool) -> list[ExpertParallel]:
        mesh = self.mesh
        dispatchers = shard_experts(model, mesh.ep) if mesh.ep.size() > 1 else []
        biases = {router.e_score_correction_bias for router in model.moe_routers()}
        layers = list(model.model.layers)
        units: list[list[nn.Module]] = []  # per layer: the layer, then its experts
        for layer in layers:
            experts = [layer.block_sparse_moe.experts] if layer.is_moe else []
            for module in experts:
                self._unit(module, mesh.dp)
            self._unit(layer, mesh.world, biases)
            units.append([layer, *experts])
        if not model.config.tie_word_embeddings:  # a tied weight belongs to one unit: the root
            self._unit(model.model.embed_tokens, mesh.world)
            self._unit(model.lm_head, mesh.world)
        self._unit(model, mesh.world, biases)
        if prefetch:  # gather the next unit (in backward: the previous) while this one computes
            for this, following in zip(units, units[1:], strict=False):
                this[0].set_modules_to_forward_prefetch(following)
                following[0].set_modules_to_backward_prefetch(this)
        return dispatchers

    # ------------------------------------------------------------------ parameters
    def trainable(self) -> list[nn.Parameter]:
        """What AdamW steps: the policy's trainable parameters (DTensor shards), then the value head's."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        if self.value_head is not None:
            params += list(self.value_head.parameters())
        return params

    def held_bytes(self, optimizer: torch.optim.Optimizer) -> int:
        """Bytes of parameters and AdamW state this rank holds between steps: its shards of every
        parameter (the router biases whole), of the value head, and of the optimizer's moments."""
        params = [*self.model.parameters()] + ([*self.value_head.parameters()] if self.value_head else [])
        state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
        return sum(local(t).numel() * local(t).element_size() for t in params + state)

    # ------------------------------------------------------------------ full weights, unit by unit
    def layout(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """(name, dtype, shape) of every tensor `full_units` hands out, in its order (rank 0, gathered
        experts); computed from the shapes, nothing gathered."""
        out: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
        self.full_units(lambda unit: out.extend((n, t.dtype, tuple(t.shape)) for n, t in unit.items()),
                        meta=True)  # fmt: skip
        return out

    def full_units(self, sink: Callable[[dict[str, torch.Tensor]], None], experts_stay: bool = False,
                   meta: bool = False) -> None:  # fmt: skip
        """Hand ``sink`` the policy's full weights one unit at a time, under the checkpoint names of
        ``state_dict`` (per-expert names; fp32, the master copy). A collective: every rank calls it, and
        every rank's ``sink`` is called once per unit with what that rank hands out (rank 0: the
        backbone; the others: nothing), then the unit's gathered tensors are dropped: the sink keeps a
        copy (``ray.put``, a file) if it needs one.

        ``experts_stay``: each expert-parallel rank hands out its own experts (rank ``dp = 0`` of each
        ``ep`` coordinate, under their global numbers) instead of gathering every expert onto rank 0.
        ``meta``: rank 0's tensors as shapes only (``meta`` device), no collective (`layout`)."""
        rank = 0 if meta else dist.get_rank()
        tied = self.model.config.tie_word_embeddings
        for names in self._unit_params():
            out: dict[str, torch.Tensor] = {}
            for name in names:
                param = self.model.get_parameter(name)
                if experts_stay and self.dispatchers and _expert_weight(name):
                    self._own_experts(out, name, param)
                    continue
                if meta:
                    full = torch.empty(param.shape, dtype=param.dtype, device="meta")
                else:
                    full = param.full_tensor() if isinstance(param, DTensor) else param.detach()
                if rank == 0:
                    out[name] = full
            if rank == 0 and tied and "model.embed_tokens.weight" in out:
                out["lm_head.weight"] = out["model.embed_tokens.weight"]
            per_expert_names(out)
            sink(out)
            del out

    def _own_experts(self, out: dict[str, torch.Tensor], name: str, param: DTensor) -> None:
        """This ep rank's experts of ``param`` (gathered over dp only) into ``out`` if its dp index is 0."""
        mesh = self.mesh
        mine = param.redistribute(mesh.mesh, [Replicate(), Shard(0)]).to_local()
        if mesh.dp.get_local_rank() == 0:
            head, weight = name.rsplit(".", 1)
            stacked = {weight: mine}
            write_per_expert(out, head + ".", stacked, first=mesh.ep.get_local_rank() * mine.shape[0])

    def _unit_params(self) -> Iterator[list[str]]:
        """The parameter names each FSDP unit of the policy owns, unit by unit, the root last."""
        prefixes = [n for n, m in self.model.named_modules() if isinstance(m, FSDPModule)]
        owned: dict[str, list[str]] = {p: [] for p in prefixes}
        for name, _param in self.model.named_parameters():
            owner = max((p for p in prefixes if p == "" or name.startswith(p + ".")), key=len)
            owned[owner].append(name)
        for prefix in [*prefixes[1:], prefixes[0]]:
            if owned[prefix]:
                yield owned[prefix]


def _expert_weight(name: str) -> bool:
    head, _, weight = name.rpartition(".")
    return head.endswith(".experts") and weight in EXPERT_WEIGHTS


def stacked_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A full state dict with per-expert checkpoint names turned into the stacked parameters' names
    (each layer's experts stacked in order); other entries as they are."""
    out: dict[str, torch.Tensor] = {}
    rows: dict[str, dict[int, torch.Tensor]] = {}
    for name, tensor in state.items():
        target, index = stacked_slot(name)
        if index is None:
            out[name] = tensor
        else:
            rows.setdefault(target, {})[index] = tensor
    for target, experts in rows.items():
        if sorted(experts) != list(range(len(experts))):
            raise ValueError(f"{target}: the state dict holds experts {sorted(experts)}, not 0..n-1")
        out[target] = torch.stack([experts[e] for e in range(len(experts))])
    return out


def per_expert_names(state: dict[str, torch.Tensor]) -> None:
    """Stacked full expert weights (``..experts.wN``) in ``state`` replaced by their per-expert entries."""
    for name in [n for n in state if _expert_weight(n)]:
        head, weight = name.rsplit(".", 1)
        write_per_expert(state, head + ".", {weight: state.pop(name)})
