"""`LearnerActor`, the Ray actor of the learner wing: it holds the `Learner` (one rank of it when
``trainer.learner.world_size`` > 1), publishes each weights version to Ray's object store unit by unit and
moves its checkpoint files through it. The driver holds references, never the tensors; it imports this
class but not the learner's modules, which load in the actor's process.

Design: docs/design/training.md#rl-actors.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import ray
import torch

from rl.config import RunConfig
from rl.device import Placement, node_address
from rl.episode import Episode
from rl.learner.checkpoint_files import RankFile, put_rank_files
from rl.learner.ranks import RankGroup, free_port, join_rank_group
from rl.weights import WeightBlock, put_unit

if TYPE_CHECKING:
    from rl.learner.learner import Learner


class LearnerActor:
    """Ray actor: the `Learner` (``self.learner``), with its torch thread count set for its process,
    publishing each weights version to Ray's object store and moving its checkpoints through it.

    With ``trainer.learner.world_size`` > 1 it is rank ``rank`` of the learner (`rl.driver.learner_group`
    starts the ranks): the `Learner` is built in `join`, once every rank knows rank 0's address; every
    rank then gets every call and answers with its own part (its weight blocks, its checkpoint files)."""

    def __init__(self, cfg: RunConfig, rank: int = 0) -> None:
        torch.set_num_threads(cfg.trainer.learner_threads)
        self.cfg, self.rank = cfg, rank
        self._learner: Learner | None = None
        if cfg.trainer.learner.world_size == 1:
            self._build(None)

    def _build(self, group: RankGroup | None) -> None:
        from rl.learner.learner import Learner

        self._learner = Learner(self.cfg, group=group)

    @property
    def learner(self) -> Learner:
        if self._learner is None:
            raise RuntimeError(f"learner rank {self.rank} has not joined its process group yet (call join)")
        return self._learner

    def rendezvous(self) -> tuple[str, int]:
        """Rank 0: the address (this node's IP, a free port) the ranks' process group meets at."""
        return node_address()["ip"], free_port()

    def join(self, address: str, port: int) -> dict[str, str]:
        """Join the learner's process group at ``address:port`` and build this rank's `Learner`;
        returns `node_address`."""
        ranks = self.cfg.trainer.learner
        device = Placement.of(self.cfg.trainer.device).device
        here = node_address()["ip"]
        self._build(join_rank_group(
            address, port, self.rank, ranks.world_size, ranks.expert_parallel, device, local_ip=here
        ))
        return node_address()

    def node(self) -> dict[str, str]:
        """`node_address` of the learner."""
        return node_address()

    def publish(self) -> tuple[int, list[WeightBlock]]:
        """Put the current full weights in the object store, unit by unit (a collective: every rank
        gathers each unit's shards; rank 0 puts the backbone, each expert-parallel rank its own experts;
        from a GPU they are copied to the CPU first, so that any worker can read them); returns
        ``(version, this rank's blocks)``."""
        blocks: list[WeightBlock] = []
        self.learner.sharded.full_units(lambda unit: put_unit(blocks, unit), experts_stay=True)
        return self.learner.version, blocks

    def train_step(self, *shares: list[Episode]) -> tuple[dict[str, Any], int, list[WeightBlock]]:
        """One `Learner.train_step` on the episode lists concatenated in order (the driver passes the
        rollouts' group references; Ray resolves them here), then `publish`; returns
        ``(metrics, version, this rank's weight blocks)``. Every rank gets the whole batch and trains its
        share (`rl.learner.data_parallel`)."""
        metrics = self.learner.train_step([episode for share in shares for episode in share])
        version, blocks = self.publish()
        return metrics, version, blocks

    def save_files(self) -> tuple[dict[str, Any], list[RankFile]]:
        """This rank's part of a checkpoint, into the object store (`rl.learner.checkpoint_files`): the
        writer's facts for the manifest and this rank's files; the driver writes them into the checkpoint."""
        from rl.learner.shard_checkpoint import learner_facts, save_to_memory

        return learner_facts(self.learner), put_rank_files(save_to_memory(self.learner))

    def load_files(self, saved: dict[str, Any], refs: dict[str, ray.ObjectRef]) -> None:
        """Resume from the checkpoint whose manifest is ``saved`` and whose files the driver put in the
        object store (``refs``: name -> reference); this rank fetches the files its shards need."""
        from rl.learner.shard_checkpoint import MemoryReader, load_from

        load_from(self.learner, saved, MemoryReader(lambda name: ray.get(refs[name])))
