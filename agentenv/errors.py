"""Typed errors of AgentENV. Every message says what went wrong and what to do about it.

The hierarchy mirrors docker-py's small exception tree: callers catch `AgentEnvError` for "anything
AgentENV refused or failed", or one subclass for the case they can handle.
"""

from __future__ import annotations


class AgentEnvError(Exception):
    """Base class of every error AgentENV raises on purpose (the CLI prints its message, no traceback)."""


class ConfigError(AgentEnvError, ValueError):
    """A sandbox configuration value (YAML, CLI flag or keyword argument) is invalid."""


class SandboxNotFound(AgentEnvError, LookupError):
    """No sandbox in the registry has this id (or the id prefix is ambiguous)."""


class SandboxStateError(AgentEnvError):
    """The operation is not allowed in the sandbox's current state (e.g. exec on a paused sandbox)."""


class SandboxBusy(SandboxStateError):
    """Another thread or process holds the sandbox's lock for longer than the lock timeout."""


class CheckpointError(AgentEnvError):
    """CRIU could not checkpoint or restore the sandbox, or a restore did not really restore its state."""


class ExecTimeout(AgentEnvError, TimeoutError):
    """An exec ran past its timeout (raised only with `raise_on_timeout=True`; carries the result)."""

    def __init__(self, message: str, result: object | None = None) -> None:
        super().__init__(message)
        self.result = result


class PathOutsideWorkspace(AgentEnvError, ValueError):
    """A file-transfer path escapes the sandbox's work dir (`..`, absolute paths elsewhere, symlinks)."""


class ImageError(AgentEnvError):
    """A sandbox image is unknown, not built, or its build failed."""


class BackendUnavailable(AgentEnvError):
    """The container runtime (Docker daemon, CRIU) is missing or does not answer."""
