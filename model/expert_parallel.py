"""Expert parallelism for LatentMoE: each of N ranks holds n/N routed experts, and tokens travel to their
experts' ranks and back in the latent space (after W_down, before W_up), as K3's MoonEP does.

With K3's shapes every (token, expert) pair costs half the bytes of dispatching at the backbone width;
`ExpertTraffic` counts them, and `shard_experts` splits each layer's experts over the mesh's ``ep``
dimension as a DTensor, so a distributed checkpoint reshards them.

Design: docs/design/model.md#model-expert-parallel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn


@dataclass
class ExpertTraffic:
    """What this rank sent to other ranks through the expert all_to_alls: the activations (forward and
    backward) in the latent width (``latent_bytes``) and what the same pairs would cost at the backbone
    width (``backbone_bytes``); the routing metadata (``metadata_bytes``: the pair counts per destination
    and the expert ids of the pairs, forward only; a backbone-width dispatch sends the same); the
    (token, expert) pairs routed from this rank. Bytes sent = ``latent_bytes + metadata_bytes``."""

    latent_bytes: int = 0
    backbone_bytes: int = 0
    metadata_bytes: int = 0
    pairs: int = 0

    def reset(self) -> None:
        self.latent_bytes = self.backbone_bytes = self.metadata_bytes = self.pairs = 0


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` of rows with autograd (the backward is the reverse exchange), counting the
    bytes sent off-rank in both directions."""

    @staticmethod
    def forward(ctx, x, send_counts, recv_counts, ep):
        ctx.counts = (send_counts, recv_counts, ep)
        return _exchange(x, send_counts, recv_counts, ep)

    @staticmethod
    def backward(ctx, grad):
        send_counts, recv_counts, ep = ctx.counts
        return _exchange(grad, recv_counts, send_counts, ep), None, None, None


def _exchange(x, send_counts, recv_counts, ep: ExpertParallel) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((sum(recv_counts), *x.shape[1:]))
    dist.all_to_all_single(out, x, output_split_sizes=recv_counts, input_split_sizes=send_counts,
                           group=ep.group)  # fmt: skip
    off_rank = sum(send_counts) - send_counts[ep.rank]
    ep.traffic.latent_bytes += off_rank * x.shape[1] * x.element_size()
    ep.traffic.backbone_bytes += off_rank * ep.backbone_width * x.element_size()
    return out


class ExpertParallel:
    """The routed experts of one LatentMoE layer spread over the ``size`` ranks of ``group``; this rank
    (``rank`` in the group) holds experts ``offset .. offset + per_rank - 1`` (see the module docstring)."""

    def __init__(self, rank: int, size: int, num_experts: int, backbone_width: int, group=None) -> None:
        if num_experts % size:
            raise ValueError(f"expert parallelism: {num_experts} experts do not split across {size} ranks")
        self.rank, self.size, self.group = rank, size, group
        self.per_rank = num_experts // size
        self.offset = rank * self.per_rank
        self.backbone_width = backbone_width
        self.traffic = ExpertTraffic()

    def __call__(
        self, experts: nn.Module, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """u [M, l] = sum_e p_{t,e} E_e(h_t) over the experts of every rank (h [M, l], ids/weights [M, k]);
        ``experts``: the layer's `model.moe.RoutedExperts`, whose forward runs this rank's experts."""
        m, k = ids.shape
        token = torch.arange(m, device=h.device).repeat_interleave(k)
        owner = ids.reshape(-1) // self.per_rank
        order = torch.argsort(owner, stable=True)  # pairs grouped by destination rank
        token, expert = token[order], ids.reshape(-1)[order]
        send = torch.bincount(owner, minlength=self.size)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        send_counts, recv_counts = send.tolist(), recv.tolist()
        self.traffic.pairs += m * k
        # which of this rank's experts each received row goes to (ids travel once, no gradient)
        local_ids = expert.new_empty(sum(recv_counts))
        dist.all_to_all_single(local_ids, expert.contiguous(), recv_counts, send_counts, group=self.group)
        off_rank = sum(send_counts) - send_counts[self.rank]  # pairs whose expert another rank holds
        counts_bytes = (self.size - 1) * send.element_size()  # the counts for the other ranks
        self.traffic.metadata_bytes += counts_bytes + off_rank * expert.element_size()
        received = _AllToAll.apply(h[token], send_counts, recv_counts, self)
        ones = torch.ones(received.shape[0], 1, dtype=received.dtype, device=received.device)
        outputs = experts(received, (local_ids - self.offset)[:, None], ones)  # E_e(h_t) per row
        returned = _AllToAll.apply(outputs, recv_counts, send_counts, self)
        gate = weights.reshape(-1)[order].to(returned.dtype)[:, None]
        return torch.zeros_like(h).index_add(0, token, returned * gate)


def shard_experts(model: nn.Module, mesh) -> list[ExpertParallel]:
    """Split the routed experts of every LatentMoE layer of ``model`` over the 1-d device mesh ``mesh``
    (the expert-parallel dimension): each stacked weight becomes a DTensor sharded on the expert
    dimension (this rank keeps its slice of the weights it holds, the same on every rank at this point),
    and the layer routes through `ExpertParallel`. Returns the layers' dispatchers (``traffic``)."""
    from torch.distributed.tensor import DTensor, Shard

    from model.moe import EXPERT_WEIGHTS, LatentMoE

    rank, size = mesh.get_local_rank(), mesh.size()
    dispatchers = []
    for module in model.modules():
        if isinstance(module, LatentMoE):
            experts = module.experts
            ep = ExpertParallel(rank, size, experts.w1.shape[0], module.cfg.hidden_size, mesh.get_group())
            for name in EXPERT_WEIGHTS:
                param = getattr(experts, name)
                local = param.detach()[ep.offset : ep.offset + ep.per_rank].clone()
                sharded = DTensor.from_local(local, mesh, [Shard(0)], shape=param.shape,
                                             stride=param.stride())  # fmt: skip
                setattr(experts, name, nn.Parameter(sharded, requires_grad=param.requires_grad))
            module.expert_parallel = ep
            dispatchers.append(ep)
    return dispatchers
