"""`RolloutWorker`, the Ray actor of the rollout wing: a policy copy behind one `Engine` and an
`EpisodeRunner` that plays groups of episodes with it. Weights come from the object store by reference and
episodes go back to the learner unopened; in async mode new weights are staged beside the running rollout
and swapped in between turns, so generation never waits for weight loading.

Design: docs/design/training.md#rl-actors.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import ray
import torch

from rl.config import RunConfig
from rl.device import Placement, node_address
from rl.episode import Episode
from rl.errors import StaleWeights
from rl.policy import build_policy_shell
from rl.rollout.engines import build_engine
from rl.rollout.inflight import InFlightRollout
from rl.rollout.runner import EpisodeRunner
from rl.rollout_stats import RolloutStats
from rl.sandbox_hosts import apply_worker_environment
from rl.tokenizer import build_tokenizer
from rl.weights import resolve

NO_WEIGHTS = -1  # the version of a worker that has not loaded any weights yet
WEIGHTS_GROUP = "weights"  # the concurrency group `offer_weights` runs in (beside `rollout`)
CONTROL_GROUP = "control"  # the concurrency group of `snapshot_in_flight` and `release_kept`


class RolloutWorker:
    """Ray actor: rolls out groups of episodes with its copy of the policy (make the actor class with
    `rollout_worker_actor`; see the module docstring)."""

    def __init__(self, cfg: RunConfig, index: int, environment: dict[str, str] | None = None) -> None:
        """``environment``: `rl.sandbox_hosts.worker_environment` of the driver (the sandbox hosts' key)."""
        apply_worker_environment(environment or {})
        torch.set_num_threads(cfg.rollout.torch_threads)
        self.cfg = cfg
        self.index = index
        self.tokenizer = build_tokenizer(cfg.tokenizer)
        self.placement = Placement.of(cfg.trainer.device)  # on cuda: the policy in bf16 on the GPU
        shell = self._policy_shell()  # no random init: `load_weights` fills it
        self.engine = build_engine(cfg.rollout, shell, self.tokenizer, cfg.env.action_vocabulary)
        self.runner = EpisodeRunner(cfg.env, cfg.rollout, self.engine, self.tokenizer, cfg.sandbox)
        self.version = NO_WEIGHTS
        self._standby_version = NO_WEIGHTS
        self._standby_lock = threading.Lock()
        self._last_call = -1  # async: the driver's number of the last rollout call this worker finished

    def load_weights(self, version: int, state_dict: Any) -> int:
        """Copy the learner's weights of ``version`` into the policy (``state_dict``: the learner's
        `rl.weights.PublishedWeights`, fetched here, or a state dict); returns the version now held."""
        if version < self.version:
            raise StaleWeights(
                f"worker {self.index} holds weights v{self.version}; refusing older v{version}"
            )
        self.version = self.engine.load_weights(version, resolve(state_dict))
        return self.version

    @property
    def model(self):
        """The torch policy the engine samples with, None where the engine holds the weights (vLLM)."""
        return getattr(self.engine, "model", None)

    @ray.method(concurrency_group=WEIGHTS_GROUP)
    def offer_weights(self, version: int, state_dict: Any) -> int:
        """Async mode: copy the weights of ``version`` into the standby policy (runs beside a rollout);
        the rollout swaps them in before its next turn. Older offers are ignored. Returns the version
        now in standby."""
        with self._standby_lock:
            if version <= max(self.version, self._standby_version):
                return self._standby_version
            self.engine.stage_weights(version, resolve(state_dict))
            self._standby_version = version
        return version

    def _policy_shell(self):
        """An uninitialised policy on this worker's device, in its compute dtype (`rl.device.Placement`)."""
        return self.placement.inference_policy(build_policy_shell(self.cfg.model))

    def _turn_version(self) -> int:
        """Called by the runner before each turn: swap in newer standby weights if a finished copy is
        there (a copy in progress is not waited for: this turn keeps the current weights)."""
        if self._standby_version > self.version and self._standby_lock.acquire(blocking=False):
            try:
                if self._standby_version > self.version:
                    self.version = self.engine.swap_staged()  # no generation runs now
            finally:
                self._standby_lock.release()
        return self.version

    def rollout(
        self,
        seeds: list[int],
        group_size: int,
        first_group: int,
        sample_seed: int,
        expected_version: int | None,
        call: int | None = None,
    ) -> tuple[tuple[int, RolloutStats, dict[int, torch.Tensor]], ...]:
        """Episodes of the groups started from ``seeds``; sampling is seeded by ``sample_seed``.

        Returns ``((version, stats, expert_loads), group_0, group_1, ...)``: the weights version the
        last turn was sampled with (echoed back), the run's counters and the tokens the policy routed
        to each expert per MoE layer; then each group's episodes. Called with ``num_returns=1 + groups``
        so that each part is its own Ray object: the driver reads the first and passes the groups on to
        the learner. ``expected_version`` (sync mode) is the version the batch must be sampled with;
        None (async mode) samples with the newest weights, swapped in between turns. ``call`` (async
        mode) is the driver's number of this call, which names it in `snapshot_in_flight`.
        """
        if expected_version is not None and self.version != expected_version:
            raise StaleWeights(
                f"worker {self.index} holds weights v{self.version} but the batch needs v{expected_version}"
            )
        self._check_weights()
        generator = torch.Generator().manual_seed(sample_seed)
        episodes, stats = self.runner.run(
            seeds, group_size, generator, first_group, policy_version=self._turn_version, tag=call
        )
        return self._returned(episodes, stats, group_size, call)

    def _check_weights(self) -> None:
        if self.version == NO_WEIGHTS:
            raise StaleWeights(f"worker {self.index} holds no weights yet")
        self.engine.require_version(self.version)  # what the engine really holds, not what it was sent

    def _returned(self, episodes: list[Episode], stats: RolloutStats, group_size: int, call: int | None):
        """``((version, stats, expert loads), group 0, group 1, ...)`` of a finished rollout call."""
        if call is not None:
            self._last_call = max(self._last_call, call)
        groups = [episodes[g : g + group_size] for g in range(0, len(episodes), group_size)]
        return (self.version, stats, self.engine.take_expert_loads()), *groups

    def continue_rollout(
        self, recorded: InFlightRollout, sample_seed: int, call: int
    ) -> tuple[tuple[int, RolloutStats, dict[int, torch.Tensor]], ...]:
        """Async resume: finish a rollout a checkpoint recorded (``rl.rollout.inflight``); returns as
        `rollout`."""
        self._check_weights()
        generator = torch.Generator().manual_seed(sample_seed)
        episodes, stats = self.runner.resume(
            recorded.episodes, recorded.group_size, generator, policy_version=self._turn_version, tag=call
        )
        return self._returned(episodes, stats, recorded.group_size, call)

    @ray.method(concurrency_group=CONTROL_GROUP)
    def snapshot_in_flight(self, keeper: str) -> tuple[int, InFlightRollout | None]:
        """Async checkpoint: ``(the last call this worker finished, the running call recorded at its next
        turn boundary)`` (None: no call running). Runs beside the rollout; see ``rl.rollout.inflight``."""
        taken = self.runner.snapshot(Path(keeper))
        last = self._last_call  # read after: a call that ended meanwhile is finished, not lost
        if taken is None:
            return last, None
        episodes, call = taken
        group_size = self.cfg.algo.group_size
        return last, InFlightRollout(call, node_address()["ip"], group_size, episodes)

    @ray.method(concurrency_group=CONTROL_GROUP)
    def release_kept(self, sandbox_ids: list[str]) -> list[str]:
        """Close the sandboxes a superseded checkpoint kept, those of this node's registry; their ids."""
        from agentenv import Sandbox
        from agentenv.errors import SandboxNotFound

        closed = []
        for sid in sandbox_ids:
            try:
                Sandbox.get(sid).close()
            except SandboxNotFound:
                continue
            closed.append(sid)
        return closed

    def node(self) -> dict[str, str]:
        """`node_address` of this worker (and so of its sandboxes, which this process creates)."""
        return node_address()

    @ray.method(concurrency_group=CONTROL_GROUP)
    def engine_stats(self) -> dict[str, Any]:
        """This worker's engine as it is now (runs beside a rollout): ``worker``, ``engine`` (its
        ``rollout.engine``) and, for vLLM, `rl.rollout.vllm.engine.VllmEngine.stats` (engines this process
        built,
        each push's version and seconds, generation calls per version): how a benchmark sees that a run
        pushed every version into one running engine."""
        return {"worker": self.index, "engine": self.cfg.rollout.engine, **self.engine.stats()}

    def close(self) -> None:
        self.runner.close()


def rollout_worker_actor():
    """`RolloutWorker` as a Ray actor class, with the concurrency group its weight offers run in."""
    return ray.remote(concurrency_groups={WEIGHTS_GROUP: 1, CONTROL_GROUP: 1})(RolloutWorker)
