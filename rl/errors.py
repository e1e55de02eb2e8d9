"""Why a training run stops, or a worker refuses a call: the trainer's own exceptions, in one module that
imports nothing of ``rl`` so that the driver, the actors and the entry point can all name them."""

from __future__ import annotations


class StaleWeights(RuntimeError):
    """A worker was asked to use weights of another version than the one it should hold."""


class RolloutWorkerLost(RuntimeError):
    """A rollout worker kept dying after ``rollout.max_worker_restarts`` restarts, or did not come back."""


class LearnerRankLost(RuntimeError):
    """A rank of a sharded learner (``trainer.learner.world_size`` > 1) failed; ranks are not restarted."""


class TooManyFailures(RuntimeError):
    """More than ``rollout.max_failed_fraction`` of an iteration's episodes failed."""
