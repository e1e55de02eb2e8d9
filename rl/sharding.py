"""Parameters and AdamW state sharded across the learner's ranks: one flat fp32 vector, 1/N per rank.

Design (ZeRO-3 with the whole backbone as one unit), and why not FSDP2's ``fully_shard``:

- every trainable parameter outside the routed experts is laid out, in ``named_parameters`` order, in one
  flat vector padded to a multiple of N; rank r owns the contiguous slice r, as an ``nn.Parameter`` that the
  rank's AdamW steps (AdamW is elementwise, so stepping slices equals stepping the whole: the exactness
  test checks it against the single-rank learner);
- between steps a rank holds only its slice and its AdamW moments: ``release`` empties the model's
  parameters. ``gather`` (one ``all_gather_single``) refills them as views of one full vector for a
  step's forward and backward passes; ``reduce_grads`` (one ``reduce_scatter_single``, summed) leaves each
  rank the gradient of its slice. So resident parameter + optimizer memory is 1/N, while a step's peak holds
  the full backbone once (FSDP would gather layer by layer; with one unit the peak is one full copy);
- the routed experts are not in the flat vector when ``expert_parallel`` splits them: each rank keeps its
  own experts whole (`model.expert_parallel`) and steps them itself; their gradients are complete (the
  all_to_all's backward brings every rank's tokens' contribution), so they need no reduction;
- the router's selection bias is not trainable: it stays whole on every rank, and quantile balancing
  updates it identically everywhere from the global statistics.

FSDP2 would wrap each layer's parameters as DTensors: quantile balancing's in-place bias update, the MoE
layer's stacked-expert cache keyed on storage pointers and the experts split by expert parallelism would
each need special cases, and its CPU/gloo path is not what it is tested on; the flat layout here is a few
collectives whose result the exactness test pins down.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from rl.ranks import RankGroup


class FlatShard:
    """``params`` (same values on every rank at construction) sharded as one flat vector; see the module
    docstring. ``shard`` is this rank's slice, the parameter the optimizer steps."""

    def __init__(
        self, params: list[nn.Parameter], group: RankGroup, after_gather: Callable[[], None] | None = None
    ) -> None:
        """``after_gather``: called once the parameters hold new storage (the MoE layers' stacked-expert
        cache is keyed on storage pointers, which a new buffer may reuse: it must be dropped)."""
        self.params = params
        self.group = group
        self.after_gather = after_gather
        self.shapes = [p.shape for p in params]
        self.numels = [p.numel() for p in params]
        self.total = sum(self.numels)
        self.size = -(-self.total // group.world_size)  # ceil: the last rank's slice is padded
        first = params[0]
        flat = torch.zeros(self.size * group.world_size, dtype=first.dtype, device=first.device)
        torch.cat([p.detach().reshape(-1) for p in params], out=flat[: self.total])
        start = group.rank * self.size
        self.shard = nn.Parameter(flat[start : start + self.size].clone())
        self.release()

    def gather(self) -> None:
        """Refill every parameter with its full value (views of one gathered vector)."""
        full = torch.empty(
            self.size * self.group.world_size, dtype=self.shard.dtype, device=self.shard.device
        )
        dist.all_gather_single(full, self.shard.detach())
        for p, view, shape in zip(
            self.params, full[: self.total].split(self.numels), self.shapes, strict=True
        ):
            p.data = view.view(shape)
        if self.after_gather is not None:
            self.after_gather()

    def release(self) -> None:
        """Drop the full parameters (and their gradients): this rank keeps only ``shard``."""
        for p in self.params:
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
            p.grad = None

    def reduce_grads(self) -> None:
        """``shard.grad`` = this rank's slice of the gradient summed over the ranks; the full gradients
        are dropped. A parameter without a gradient counts as zeros."""
        grads = [
            p.grad.reshape(-1) if p.grad is not None else p.new_zeros(n)
            for p, n in zip(self.params, self.numels, strict=True)
        ]
        flat = torch.zeros(
            self.size * self.group.world_size, dtype=self.shard.dtype, device=self.shard.device
        )
        torch.cat(grads, out=flat[: self.total])
        out = torch.empty_like(self.shard)
        dist.reduce_scatter_single(out, flat, op=dist.ReduceOp.SUM)
        self.shard.grad = out
        for p in self.params:
            p.grad = None

    def full_tensors(self) -> list[torch.Tensor]:
        """Every parameter's full value (a gathered copy; the model's parameters are left as they are)."""
        full = torch.empty(
            self.size * self.group.world_size, dtype=self.shard.dtype, device=self.shard.device
        )
        dist.all_gather_single(full, self.shard.detach())
        return [v.view(s) for v, s in zip(full[: self.total].split(self.numels), self.shapes, strict=True)]

    def slice_of(self, values: list[torch.Tensor]) -> torch.Tensor:
        """This rank's slice of full per-parameter ``values`` laid out like ``params`` (e.g. a world_size-1
        checkpoint's AdamW moments)."""
        flat = torch.zeros(
            self.size * self.group.world_size, dtype=self.shard.dtype, device=self.shard.device
        )
        torch.cat([v.reshape(-1).to(flat) for v in values], out=flat[: self.total])
        start = self.group.rank * self.size
        return flat[start : start + self.size].clone()


def sharded_optimizer_step(
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    loss: torch.Tensor,
    grad_clip: float,
    flat: FlatShard,
    group: RankGroup,
) -> torch.Tensor:
    """`rl.optim.optimizer_step` across ranks: ``loss`` is this rank's share of the global loss (the
    shares sum to it), so the summed gradients are the global gradient. Clipped to the global norm
    (squares summed over the ranks' slices and local experts), then AdamW on this rank's part; the model's
    full parameters are refilled from the new slices. Returns the global norm before clipping."""
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    flat.reduce_grads()
    grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    squares = torch.stack([g.detach().float().pow(2).sum() for g in grads]).sum()
    norm = group.all_reduce_sum(squares).sqrt()
    coef = torch.clamp(grad_clip / (norm + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.dtype))
    optimizer.step()
    scheduler.step()
    flat.gather()
    return norm
