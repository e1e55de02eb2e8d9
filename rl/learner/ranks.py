"""The learner's rank group: which process of a ``trainer.learner.world_size`` learner this one is, and
the few collectives the sharded learner needs on top of ``torch.distributed``.

gloo on the CPU, NCCL on CUDA; a learner of one rank joins a group of size 1 of its own, so it takes the
same sharded path as a larger one.

Design: docs/design/training.md#rl-ranks.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class RankGroup:
    """This process's place in the learner: ``rank`` of ``world_size``, routed experts split across
    ``expert_parallel`` ranks (1 or ``world_size``)."""

    rank: int
    world_size: int
    expert_parallel: int

    @property
    def device(self) -> torch.device:
        """The device of the tensors this group's collectives take (`collective_device` of its backend)."""
        return collective_device(dist.get_backend())

    def tensor(self, values: list[float] | list[int], dtype: torch.dtype) -> torch.Tensor:
        """A new 1-d tensor of ``values`` on the group's device, to hand to a collective."""
        return torch.tensor(values, dtype=dtype, device=self.device)

    def _on_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor``, which a collective is about to take; a clear error if it is not on the group's
        device."""
        if tensor.device.type != self.device.type:
            raise ValueError(
                f"a {dist.get_backend()} collective needs tensors on {self.device.type}, got one on "
                f"{tensor.device} (rl.learner.ranks.collective_device)"
            )
        return tensor

    def all_reduce_sum(self, values: torch.Tensor) -> torch.Tensor:
        """The sum of ``values`` over the ranks (a new tensor; every rank gets it)."""
        out = self._on_device(values).detach().clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
        return out

    def all_gather_equal(self, tensor: torch.Tensor) -> torch.Tensor:
        """``[world_size, *tensor.shape]``: every rank's ``tensor`` (same shape on all ranks), rank order."""
        tensor = self._on_device(tensor).detach().contiguous()
        out = torch.empty((self.world_size * tensor.numel(),), dtype=tensor.dtype, device=tensor.device)
        dist.all_gather_single(out, tensor.reshape(-1))
        return out.view(self.world_size, *tensor.shape)

    def all_gather_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's ``tensor`` ``[m_r, ...]`` (row counts may differ) concatenated in rank order."""
        tensor = tensor.detach().contiguous()
        counts = self.all_gather_equal(self.tensor([tensor.shape[0]], torch.long)).reshape(-1)
        longest = int(counts.max())
        padded = torch.zeros((longest, *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
        padded[: tensor.shape[0]] = tensor
        gathered = self.all_gather_equal(padded)
        return torch.cat([gathered[r, : int(counts[r])] for r in range(self.world_size)])


def backend_for(device: torch.device) -> str:
    """gloo for CPU tensors, NCCL for CUDA ones."""
    return "nccl" if device.type == "cuda" else "gloo"


COLLECTIVE_DEVICES = {"gloo": "cpu", "nccl": "cuda"}  # backend -> the device type of its tensors


def collective_device(backend: str) -> torch.device:
    """The device whose tensors a ``backend`` group's collectives take: cpu for gloo, cuda for NCCL (the
    current GPU: a learner rank sees only its own). The one answer to "where must this tensor live
    before it is reduced or gathered"."""
    name = str(backend).lower()
    if name not in COLLECTIVE_DEVICES:
        raise ValueError(f"torch.distributed backend {backend!r}: no known collective device (one of "
                         f"{sorted(COLLECTIVE_DEVICES)})")
    return torch.device(COLLECTIVE_DEVICES[name])


def free_port() -> int:
    """A TCP port free on this host now (rank 0 picks its rendezvous port with it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


def interface_of(ip: str) -> str | None:
    """The name of this host's network interface whose IPv4 address is ``ip`` (None if none is)."""
    import fcntl
    import struct

    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _index, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(sock.fileno(), siocgifaddr, struct.pack("256s", name[:15].encode()))
            except OSError:
                continue
            if socket.inet_ntoa(packed[20:24]) == ip:
                return name
    return None


def join_rank_group(
    address: str, port: int, rank: int, world_size: int, expert_parallel: int, device: torch.device,
    timeout_s: float = 300.0, local_ip: str | None = None,
) -> RankGroup:  # fmt: skip
    """Initialise this process's ``torch.distributed`` default group (TCP rendezvous at rank 0's
    ``address:port``) and return its `RankGroup`. Every rank must call it; it returns once all have.

    ``local_ip``: this node's address in the cluster (Ray's node IP). Gloo otherwise binds to what the
    host name resolves to, often a loopback address that the other nodes cannot reach; it is pinned to
    the interface carrying ``local_ip`` (unless ``GLOO_SOCKET_IFNAME`` is set already)."""
    if dist.is_initialized():
        raise RuntimeError("join_rank_group: this process already belongs to a torch.distributed group")
    if backend_for(device) == "gloo" and local_ip and "GLOO_SOCKET_IFNAME" not in os.environ:
        interface = interface_of(local_ip)
        if interface is not None:
            os.environ["GLOO_SOCKET_IFNAME"] = interface
    dist.init_process_group(
        backend=backend_for(device),
        init_method=f"tcp://{address}:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    return RankGroup(rank, world_size, expert_parallel)


def join_single_rank(device: torch.device) -> RankGroup:
    """The rank group of a learner of one rank: this process's default group of size 1, made here if
    there is none yet (several learners of one process share it); a group of another size is an error."""
    if dist.is_initialized():
        if dist.get_world_size() != 1:
            raise RuntimeError(f"a learner of one rank in a process whose torch.distributed group has "
                               f"{dist.get_world_size()} ranks: pass its rank group "
                               f"(rl.learner.ranks.RankGroup)")
        return RankGroup(0, 1, 1)
    options = None
    if backend_for(device) == "gloo":  # no peer to reach: never bind to what the host name resolves to
        options = dist.ProcessGroupGloo._Options()
        options._devices = [dist.ProcessGroupGloo.create_device(interface=loopback_interface())]
    dist.init_process_group(backend_for(device), store=dist.HashStore(), rank=0, world_size=1,
                            pg_options=options)  # fmt: skip
    return RankGroup(0, 1, 1)


def loopback_interface() -> str:
    """The name of this host's loopback interface (``lo`` on Linux)."""
    return interface_of("127.0.0.1") or "lo"


def leave_rank_group() -> None:
    """Destroy this process's default group (if any)."""
    if dist.is_initialized():
        dist.destroy_process_group()
