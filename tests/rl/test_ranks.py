"""`rl.learner.ranks`: which device a backend's collectives take tensors on (NCCL refuses CPU tensors), and a
group's collectives refusing a tensor elsewhere with an error that says so (a one-process gloo group)."""

from __future__ import annotations

import pytest
import torch

from rl.learner.ranks import (
    RankGroup,
    backend_for,
    collective_device,
    free_port,
    join_rank_group,
    leave_rank_group,
)


def test_each_backend_has_one_collective_device():
    assert collective_device("nccl") == torch.device("cuda")
    assert collective_device("gloo") == torch.device("cpu")
    for device in ("cpu", "cuda"):  # the device a learner runs on picks a backend that takes its tensors
        assert collective_device(backend_for(torch.device(device))).type == device
    with pytest.raises(ValueError, match=r"backend 'mpi': no known collective device \(one of \['gloo'"):
        collective_device("mpi")


def test_a_collective_refuses_a_tensor_off_its_backends_device():
    leave_rank_group()  # a learner of one rank tested before in this process made its own group
    group = join_rank_group("127.0.0.1", free_port(), 0, 1, 1, torch.device("cpu"), timeout_s=30)
    try:
        assert group == RankGroup(0, 1, 1) and group.device == torch.device("cpu")
        assert group.all_reduce_sum(group.tensor([1.0, 2.0], torch.float64)).tolist() == [1.0, 2.0]
        with pytest.raises(ValueError, match=r"^a gloo collective needs tensors on cpu, got one on meta"):
            group.all_reduce_sum(torch.ones(2, device="meta"))
        with pytest.raises(ValueError, match=r"^a gloo collective needs tensors on cpu, got one on meta"):
            group.all_gather_equal(torch.ones(2, device="meta"))
    finally:
        leave_rank_group()
