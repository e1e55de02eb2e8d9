"""In-flight episodes in a checkpoint: what an async run was doing when it saved, so a resumed run
continues it instead of throwing it away.

When an async run writes a checkpoint (``trainer.checkpoint_in_flight``), every rollout worker stops its
running rollout at the next turn boundary for as long as it takes to record it (`EpisodeRunner.snapshot`):

- each episode still playing keeps its sandbox **paused**: the pause's CRIU images are the episode's
  world at that turn. The sandbox leaves the worker's pool and is labelled as kept by the checkpoint
  folder (``agentenv.owner.keeper_labels``), so neither the worker's exit nor gc's orphan rule removes it;
  the live run continues in a fork of it. Gc closes it once the checkpoint folder is deleted; the trainer
  closes the previous checkpoint's kept sandboxes when it writes the next one;
- its tokens, log-probs, step rewards and the weights version of every token are copied, with the
  env's own state (the task's attributes but its sandbox handles, and each wrapper's attributes);
- episodes of the rollout that already ended are copied whole.

The driver adds the groups that finished but were not trained yet (`InFlightRecord.ready`) and writes
the record beside the learner's state (`IN_FLIGHT_FILE`, a pickle, and `IN_FLIGHT_SUMMARY`, JSON for
people and tools). On resume each recorded rollout is handed back to a worker (`EpisodeRunner.resume`):
the episodes are rebuilt from the record, their envs from a fresh ``make_env`` with the recorded state,
and their sandboxes are restored from the kept ones (a fork: the kept sandbox stays as it was, so the
same checkpoint can be resumed again). They go on from the recorded turn with the current weights: the
versions of their earlier tokens stay what they were, and the staleness bound and the decoupled loss
treat them as they treat any partial rollout.

An episode whose kept sandbox cannot be restored (its node is gone, the folder was copied elsewhere)
fails with the reason, a zero-weight sample; its group is trained on the others.
"""

from __future__ import annotations

import copy
import json
import pickle
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gymnasium

from rl.episode import Episode

IN_FLIGHT_FILE = "in_flight.pkl"
IN_FLIGHT_SUMMARY = "in_flight.json"
FORMAT_VERSION = 1
TASK_HANDLES = frozenset({"sandbox", "sandboxes", "_live", "_lease", "_session", "_session_of", "spec"})
WRAPPER_HANDLES = frozenset({"env", "_cached_spec"})


@dataclass
class InFlightEpisode:
    """One episode of a recorded rollout: a copy of it, and for one still playing, its env's state and
    the id of its kept (paused) sandbox."""

    episode: Episode
    playing: bool
    sandbox_id: str | None = None
    env_state: list[dict[str, Any]] | None = None  # `env_state` of its env, outermost layer first


@dataclass
class InFlightRollout:
    """A rollout call that was running on a worker when the checkpoint was written."""

    call: int  # the driver's number of the call (its first seeds and sampling stream)
    node_ip: str  # where its kept sandboxes live (a worker on that node can restore them)
    group_size: int
    episodes: list[InFlightEpisode]

    @property
    def playing(self) -> int:
        return sum(e.playing for e in self.episodes)


@dataclass
class InFlightRecord:
    """Everything an async run had started and not trained when it saved (see the module docstring)."""

    version: int  # the learner's weights version at the checkpoint
    group_size: int
    ready: list[list[Episode]] = field(default_factory=list)  # finished groups not trained yet
    rollouts: list[InFlightRollout] = field(default_factory=list)

    @property
    def sandbox_ids(self) -> list[str]:
        return [e.sandbox_id for r in self.rollouts for e in r.episodes if e.sandbox_id]

    def describe(self) -> str:
        """One line for the trainer's log: what the record holds."""
        episodes = sum(len(r.episodes) for r in self.rollouts)
        playing = sum(r.playing for r in self.rollouts)
        return f"{episodes} episodes in flight ({playing} playing) and {len(self.ready)} finished groups"

    def summary(self) -> dict[str, Any]:
        return {
            "format": FORMAT_VERSION,
            "version": self.version,
            "group_size": self.group_size,
            "ready_groups": len(self.ready),
            "rollouts": [
                {
                    "call": r.call,
                    "node_ip": r.node_ip,
                    "episodes": len(r.episodes),
                    "playing": r.playing,
                    "kept_sandboxes": [e.sandbox_id for e in r.episodes if e.sandbox_id],
                }
                for r in self.rollouts
            ],
        }


def save_record(record: InFlightRecord, folder: Path) -> None:
    """Write the record (pickle) and its JSON summary into a checkpoint folder."""
    tmp = folder / f".{IN_FLIGHT_FILE}.tmp"
    with tmp.open("wb") as f:
        pickle.dump({"format": FORMAT_VERSION, "record": record}, f)
    tmp.replace(folder / IN_FLIGHT_FILE)
    (folder / IN_FLIGHT_SUMMARY).write_text(json.dumps(record.summary(), indent=1))


def load_record(folder: Path) -> InFlightRecord | None:
    """The record a checkpoint folder holds (None: it has none, e.g. a sync run's)."""
    path = folder / IN_FLIGHT_FILE
    if not path.exists():
        return None
    with path.open("rb") as f:
        data = pickle.load(f)  # a checkpoint is trusted as the learner's torch state is
    if not isinstance(data, dict) or data.get("format") != FORMAT_VERSION:
        raise ValueError(f"{path}: not an in-flight record of format {FORMAT_VERSION}")
    return data["record"]


def remove_record(folder: Path) -> None:
    """Delete a checkpoint folder's record (its kept sandboxes are closed: it can no longer be resumed)."""
    for name in (IN_FLIGHT_FILE, IN_FLIGHT_SUMMARY):
        (folder / name).unlink(missing_ok=True)


def kept_sandboxes(folder: Path) -> list[str]:
    """Ids of the sandboxes a checkpoint folder keeps (from its summary; [] without one)."""
    path = folder / IN_FLIGHT_SUMMARY
    if not path.exists():
        return []
    return [sid for r in json.loads(path.read_text())["rollouts"] for sid in r["kept_sandboxes"]]


def _layers(env: gymnasium.Env) -> list[gymnasium.Env]:
    """The wrapper chain, outermost first, ending with the task itself."""
    layers = [env]
    while layers[-1] is not layers[-1].unwrapped:
        layers.append(layers[-1].env)  # type: ignore[attr-defined]
    return layers


def env_state(env: gymnasium.Env) -> list[dict[str, Any]]:
    """Deep copies of the attributes of every layer of ``env`` (wrappers, then the task), without the
    task's sandbox handles: what `restore_env_state` puts back on a fresh env of the same config."""
    layers = _layers(env)
    return [
        {k: copy.deepcopy(v) for k, v in vars(layer).items() if k not in handles}
        for layer, handles in zip(layers, [WRAPPER_HANDLES] * (len(layers) - 1) + [TASK_HANDLES], strict=True)
    ]


def restore_env_state(env: gymnasium.Env, states: list[dict[str, Any]]) -> None:
    """Put `env_state`'s copies back on a fresh ``env`` built from the same env id and wrappers."""
    layers = _layers(env)
    if len(layers) != len(states):
        raise ValueError(
            f"the recorded episode had {len(states)} env layers, this env has {len(layers)}: "
            "env.wrappers changed since the checkpoint"
        )
    for layer, state in zip(layers, states, strict=True):
        vars(layer).update(copy.deepcopy(state))
