"""Every seed stream of a run, derived from the run's ``seed``: one module, so that no two streams share
their entropy by accident and a resumed run replays exactly what the uninterrupted one drew.

Task seeds are ``SeedSequence`` states below 2**31; the tags below keep the streams apart.
"""

from __future__ import annotations

import numpy as np

SYNC_SAMPLING = 1  # sync sampling seeds: (seed, iteration, SYNC_SAMPLING, worker)
ASYNC_SEEDS = 2  # async task seeds: (seed, ASYNC_SEEDS, stream, call); sync's are (seed, iteration)
ASYNC_SAMPLING = 3  # async sampling seeds: (seed, ASYNC_SAMPLING, stream, call)
EVAL_STREAM = 0x6576616C  # "eval": evaluation games, apart from training's and the demonstrations'
DEMONSTRATION_STREAM = 0x64656D6F  # "demo": demonstration episodes (rl.sft.demonstrations)
_STEP_STRIDE = 1_000_003  # torch generator seeds per (seed, step): seed x stride + step


def _task_seeds(entropy: list[int], count: int) -> list[int]:
    return [int(s) % 2**31 for s in np.random.SeedSequence(entropy).generate_state(count)]


def _one(entropy: list[int]) -> int:
    return int(np.random.SeedSequence(entropy).generate_state(1)[0])


def group_seeds(seed: int, iteration: int, num_groups: int) -> list[int]:
    """Sync: task seeds of one iteration's groups (distinct, reproducible from ``(seed, iteration)``)."""
    return _task_seeds([seed, iteration], num_groups)


def sampling_seed(seed: int, iteration: int, worker: int) -> int:
    """Sync: the sampling seed of worker ``worker``'s share of iteration ``iteration`` (a retried share
    samples the same)."""
    return _one([seed, iteration, SYNC_SAMPLING, worker])


def async_group_seeds(seed: int, stream: int, call: int, num_groups: int) -> list[int]:
    """Async: task seeds of rollout call ``call`` of a run started (or resumed) at iteration ``stream``."""
    return _task_seeds([seed, ASYNC_SEEDS, stream, call], num_groups)


def async_sampling_seed(seed: int, stream: int, call: int) -> int:
    """Async: the sampling seed of rollout call ``call`` (see `async_group_seeds`)."""
    return _one([seed, ASYNC_SAMPLING, stream, call])


def eval_seeds(seed: int, episodes: int) -> list[int]:
    """Task seeds of an evaluation (``rl.driver.evaluate``): the same games for every policy."""
    return _task_seeds([seed, EVAL_STREAM], episodes)


def demonstration_seeds(seed: int, count: int) -> list[int]:
    """Task seeds of a demonstration command's episodes (``rl.sft.demonstrations``)."""
    return _task_seeds([seed, DEMONSTRATION_STREAM], count)


def sft_epoch_seed(seed: int, epoch: int) -> int:
    """The torch generator seed of SFT's batch order in ``epoch`` (``rl.sft.trainer.batch_rows``)."""
    return seed * _STEP_STRIDE + epoch


def maxvio_floor_seed(seed: int, step: int) -> int:
    """The torch generator seed of the learner's MaxVio floor estimate at ``step``: its own generator,
    so that logging the floor leaves the run's RNG alone."""
    return seed * _STEP_STRIDE + step
