"""Shared fixtures for the model tests."""

from __future__ import annotations

import pytest
import torch
from model_testutil import tiny_config_dict


# The tiny model's ops are far too small to gain from intra-op threads; on a shared 2-core machine a second
# thread makes each matmul wait for a busy core (measured: 16 ms vs 0.1 ms per tiny linear under load).
@pytest.fixture(autouse=True)
def _single_thread_and_seeded():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_dict() -> dict:
    return tiny_config_dict()
