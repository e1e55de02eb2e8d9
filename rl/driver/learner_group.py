"""The driver's handle on the learner: one `rl.learner.actor.LearnerActor`, or ``trainer.learner.world_size``
of them placed by one Ray placement group and joined in one ``torch.distributed`` group.

Every call goes to every rank and returns rank 0's answer (weights and checkpoints are gathered from all).
A rank that fails ends the run with `LearnerRankLost` naming the rank whose actor died, so the ranks'
shards never silently diverge.

Design: docs/design/training.md#rl-learner-group.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError, RayTaskError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rl.checkpoints import POLICY
from rl.device import learner_options
from rl.errors import LearnerRankLost
from rl.learner.actor import LearnerActor
from rl.learner.checkpoint_files import put_checkpoint_files, write_rank_files
from rl.weights import PublishedWeights

log = logging.getLogger(__name__)

PLACEMENT_TIMEOUT_S = 120.0  # how long Ray may take to find room for every rank
# how long a failed call waits for Ray to say which rank's actor died (a lost node is declared dead after
# Ray's health checks miss: about 30 s with its defaults); only a failure without a death waits it all
DEATH_WAIT_S = 30.0


def first_line(exc: BaseException) -> str:
    """``Type: first line`` of an error; of the exception a rank raised for a `RayTaskError`."""
    cause = exc.cause if isinstance(exc, RayTaskError) and exc.cause is not None else exc
    text = str(cause).strip()
    return f"{type(cause).__name__}: {text.splitlines()[0] if text else ''}"


def lost_rank(actors: list, refs: list, first: int, error: RayError, wait_s: float = DEATH_WAIT_S
              ) -> tuple[int, RayError]:  # fmt: skip
    """The rank to blame for a call whose ``refs[first]`` failed with ``error``: the rank whose actor
    died (its call, or a ping of it, fails with `RayActorError`), else ``first``. Waits at most ``wait_s``
    for Ray to tell, less once every rank is known to be alive (its call returned or its ping answered)."""
    if isinstance(error, RayActorError):
        return first, error
    pings = [actor.__ray_ready__.remote() for actor in actors]
    rank_of = {ref: rank for rank, ref in enumerate(refs)} | {ref: rank for rank, ref in enumerate(pings)}
    pending = [ref for ref in refs + pings if ref != refs[first]]
    alive: set[int] = set()
    deadline = time.monotonic() + wait_s
    while pending and len(alive) < len(actors) and (left := deadline - time.monotonic()) > 0:
        ready, pending = ray.wait(pending, num_returns=1, timeout=left)
        for ref in ready:
            try:
                ray.get(ref)
            except RayActorError as exc:
                return rank_of[ref], exc
            except RayError:
                continue  # another survivor's failure
            alive.add(rank_of[ref])
    return first, error


class LearnerGroup:
    """The learner's ranks (see the module docstring); at world size 1, the single actor as before."""

    def __init__(self, actors: list, placement: Any | None, nodes: list[dict[str, str]], cfg: Any) -> None:
        self.actors = actors
        self.placement = placement
        self.nodes = nodes
        self.cfg = cfg
        self.published: PublishedWeights | None = None  # the latest version's weights, in the object store

    @classmethod
    def start(cls, cfg: Any) -> LearnerGroup:
        """Create the ranks (at world size 1: one actor, constructed in the background as before)."""
        options = learner_options(cfg)
        world = cfg.trainer.learner.world_size
        actor_cls = ray.remote(LearnerActor)
        if world == 1:
            return cls([actor_cls.options(**options).remote(cfg)], None, [], cfg)
        bundle = {"CPU": options["num_cpus"], **options["resources"]}
        if options.get("num_gpus"):
            bundle["GPU"] = options["num_gpus"]
        group = placement_group([dict(bundle) for _ in range(world)], strategy="PACK")
        try:
            ray.get(group.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except GetTimeoutError:
            remove_placement_group(group)
            raise RuntimeError(
                f"trainer.learner.world_size={world}: Ray found no room for {world} learner ranks of "
                f"{bundle} within {PLACEMENT_TIMEOUT_S:.0f} s (cluster: {ray.cluster_resources()})"
            ) from None
        bundles = [
            PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=i) for i in range(world)
        ]
        actors = [
            actor_cls.options(**options, scheduling_strategy=bundles[rank]).remote(cfg, rank)
            for rank in range(world)
        ]
        learner = cls(actors, group, [{} for _ in actors], cfg)
        address, port = learner._call("rendezvous", ranks=actors[:1])
        learner.nodes = learner._every("join", address, port)
        nodes = [n["ip"] for n in learner.nodes]
        log.info("learner: %d ranks joined at %s:%d on nodes %s", world, address, port, nodes)
        return learner

    # ------------------------------------------------------------------ calls
    def _every(self, method: str, *args: Any, ranks: list | None = None) -> list[Any]:
        """``method(*args)`` on every rank; every rank's answer, or `LearnerRankLost` for the first
        rank that fails (the others may be stuck in a collective with it: they are not waited for)."""
        actors = self.actors if ranks is None else ranks
        refs = [getattr(actor, method).remote(*args) for actor in actors]
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            try:
                ray.get(ready[0])
            except RayError as exc:
                first = refs.index(ready[0])
                rank, cause = lost_rank(actors, refs, first, exc)
                node = self.nodes[rank].get("ip", "?") if rank < len(self.nodes) else "?"
                seen_first = "" if rank == first else (
                    f" (its actor died or is unreachable; rank {first}'s call failed first: "
                    f"{first_line(exc)})"
                )
                raise LearnerRankLost(
                    f"learner rank {rank} of {len(self.actors)} (node {node}) failed in {method}: "
                    f"{first_line(cause)}{seen_first}. The run stops (a learner rank is not restarted); "
                    "the last complete checkpoint resumes it (trainer.resume=<run dir>)"
                ) from cause
        return ray.get(refs)

    def _call(self, method: str, *args: Any, ranks: list | None = None) -> Any:
        """Rank 0's answer to ``method(*args)`` called on every rank."""
        if len(self.actors) == 1 and ranks is None:
            return ray.get(getattr(self.actors[0], method).remote(*args))
        return self._every(method, *args, ranks=ranks)[0]

    def train_step(self, *refs: Any) -> tuple[dict[str, Any], int, PublishedWeights]:
        """`LearnerActor.train_step` on the batch's group references: ``(metrics, version, weights)``."""
        answers = self._every("train_step", *refs)
        self.published = PublishedWeights(answers[0][1], [b for _m, _v, blocks in answers for b in blocks])
        return answers[0][0], self.published.version, self.published

    def publish(self) -> tuple[int, PublishedWeights]:
        """The current weights into the object store (every rank's blocks): ``(version, weights)``."""
        answers = self._every("publish")
        self.published = PublishedWeights(answers[0][0], [b for _v, blocks in answers for b in blocks])
        return self.published.version, self.published

    def node(self) -> dict[str, str]:
        """Rank 0's node."""
        return self._call("node")

    def save(self, folder: str) -> None:
        """Write the learner's checkpoint into ``folder`` on the driver's machine: every rank's files
        through the object store, checked, the manifest, then ``policy/`` from the published weights
        (published again first if the learner has moved on since)."""
        answers = self._every("save_files")
        facts = answers[0][0]
        write_rank_files(Path(folder), facts, [files for _facts, files in answers])
        if self.published is None or self.published.version != facts["version"]:
            self.publish()
        self.published.export(Path(folder) / POLICY, self.cfg.model)

    def load(self, path: str) -> None:
        """Resume every rank from the checkpoint ``path`` on the driver's machine (its files checked,
        then sent through the object store), whatever world size wrote it."""
        saved, refs = put_checkpoint_files(Path(path))
        self._every("load_files", saved, refs)

    def kill(self) -> None:
        """Kill every rank and free their placement group."""
        for actor in self.actors:
            ray.kill(actor)
        if self.placement is not None:
            remove_placement_group(self.placement)
