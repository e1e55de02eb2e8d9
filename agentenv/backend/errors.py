"""Errors of the checkpoint runtime; each subclasses the AgentENV error the core raises for the same case."""

from __future__ import annotations

from agentenv.errors import CheckpointError


class DiskCapExceeded(CheckpointError):
    """A pause would push the checkpoint store past its `disk_cap`; the sandbox was left running."""


class RestoreNotVerified(CheckpointError):
    """Docker reported a successful start but CRIU did not restore the checkpoint (a fresh start)."""
