"""Why an episode failed: the kind of infrastructure failure behind an exception, for the metrics.

A failed episode's reward says nothing of the policy, so it is left out of advantages and loss; its kind
(``sandbox_lost``, ``exec_timeout``, ``runtime_error``) is counted per iteration as ``failed_<kind>``.

Design: docs/design/training.md#rl-failures.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from agentenv.errors import (
    BackendUnavailable,
    CheckpointError,
    HostUnavailable,
    SandboxNotFound,
    SandboxStateError,
    SessionError,
)

FAILURE_KINDS = ("sandbox_lost", "exec_timeout", "runtime_error")


class Failed(Protocol):
    """What `failure_metrics` reads of an episode's outcome (`rl.episode.EpisodeSummary`)."""

    failed: bool
    failure: str | None


def failure_kind(error: BaseException) -> str:
    """The kind (one of `FAILURE_KINDS`) of an exception that ended an episode."""
    if isinstance(error, TimeoutError):  # agentenv.errors.ExecTimeout among them
        return "exec_timeout"
    lost = (SandboxNotFound, SandboxStateError, SessionError, CheckpointError, HostUnavailable,
            BackendUnavailable, ConnectionError)
    if isinstance(error, lost) or type(error).__module__.startswith("docker."):
        return "sandbox_lost"
    return "runtime_error"


def failure_metrics(groups: Sequence[Sequence[Failed]], min_valid: int) -> dict[str, float]:
    """One iteration's failed episodes by kind (``failed_<kind>``), the groups left out because fewer
    than ``min_valid`` members remained (``excluded_groups``), and every episode the loss leaves out,
    failed or in such a group (``excluded_episodes``)."""
    out = {f"failed_{kind}": 0.0 for kind in FAILURE_KINDS}
    excluded_groups = excluded_episodes = 0
    for group in groups:
        failed = [o for o in group if o.failed]
        for outcome in failed:
            kind = outcome.failure if outcome.failure in FAILURE_KINDS else "runtime_error"
            out[f"failed_{kind}"] += 1
        if len(group) - len(failed) < min_valid:
            excluded_groups += 1
            excluded_episodes += len(group)
        else:
            excluded_episodes += len(failed)
    out["excluded_groups"] = float(excluded_groups)
    out["excluded_episodes"] = float(excluded_episodes)
    return out
