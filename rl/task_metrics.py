"""What an iteration's episodes say about the task: how many were cut short, and the task's own numbers.

``episodes_cut_by_max_turns``, ``episodes_cut_by_tokens`` (many mean ``env.max_episode_tokens`` is too
low) and ``<Task>/<key>`` for every number the task puts in ``Outcome.info``; failed episodes are left out.

Design: docs/design/training.md#rl-task-metrics.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class TaskOutcome(Protocol):
    """What these metrics read of an episode's outcome (`rl.episode.EpisodeSummary`)."""

    failed: bool
    cut: str | None
    task_info: tuple[tuple[str, float], ...]


def task_name(env_id: str) -> str:
    """The name part of a gymnasium env id: ``module:ns/Name-v0`` -> ``Name``."""
    bare = env_id.split(":", 1)[1] if ":" in env_id else env_id
    name = bare.rsplit("/", 1)[-1]
    head, sep, version = name.rpartition("-v")
    return head if sep and version.isdigit() else name


def cut_metrics(outcomes: Sequence[TaskOutcome]) -> dict[str, float]:
    """``episodes_cut_by_max_turns`` and ``episodes_cut_by_tokens`` among the episodes that did not fail."""
    usable = [o for o in outcomes if not o.failed]
    return {
        "episodes_cut_by_max_turns": float(sum(o.cut == "max_turns" for o in usable)),
        "episodes_cut_by_tokens": float(sum(o.cut == "tokens" for o in usable)),
    }


def info_metrics(outcomes: Sequence[TaskOutcome], name: str) -> dict[str, float]:
    """``<name>/<key>``: the mean of each numeric ``Outcome.info`` key over the episodes reporting it."""
    values: dict[str, list[float]] = {}
    for outcome in outcomes:
        if outcome.failed:
            continue
        for key, value in outcome.task_info:
            values.setdefault(key, []).append(value)
    return {f"{name}/{key}": sum(v) / len(v) for key, v in sorted(values.items())}


def cut_warning(outcomes: Sequence[TaskOutcome], max_episode_tokens: int) -> str | None:
    """A line for the log when episodes were cut by the token limit (None: none was)."""
    usable = [o for o in outcomes if not o.failed]
    cut = sum(o.cut == "tokens" for o in usable)
    if not cut:
        return None
    return (f"{cut} of {len(usable)} episodes were cut by env.max_episode_tokens={max_episode_tokens} before "
            "the task ended them (their observations and actions filled it); raise env.max_episode_tokens "
            "or shorten the task's observations (metric episodes_cut_by_tokens)")
