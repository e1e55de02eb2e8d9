"""Errors of the fast path; each is a subclass of the AgentENV error the core raises for the same case."""

from __future__ import annotations

from agentenv.errors import BackendUnavailable, CheckpointError, ConfigError


class FastPathUnavailable(BackendUnavailable):
    """This host cannot run the fast path (no ctr, no access to Docker's containerd, not root, ...).

    Callers fall back to Docker's own checkpoint path (`docker checkpoint create` / `start --checkpoint`).
    """


class FastPathConfigError(ConfigError):
    """A value in conf/agentenv/fastpath.yaml is invalid (e.g. a store folder on tmpfs)."""


class DiskCapExceeded(CheckpointError):
    """A pause would push the checkpoint store past its `disk_cap`; the sandbox was left running."""


class RestoreNotVerified(CheckpointError):
    """Docker reported a successful start but CRIU did not restore the checkpoint (a fresh start)."""
