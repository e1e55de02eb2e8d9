"""Typed errors of AgentENV, and the one table that carries them across `agentenv serve`.

Every message says what went wrong and what to do about it. Callers catch `AgentEnvError` for "anything
AgentENV refused or failed", or one subclass for the case they can handle. `ERROR_TABLE` gives each type
its HTTP status and Connect code (what E2B clients read) and its name on the wire, so the server and the
remote client (`agentenv.remote`) agree on every type (docs/agentenv.md, "Errors across the API").
"""

from __future__ import annotations

from dataclasses import dataclass


class AgentEnvError(Exception):
    """Base class of every error AgentENV raises on purpose (the CLI prints its message, no traceback)."""


class ConfigError(AgentEnvError, ValueError):
    """A configuration value (YAML, CLI flag or keyword argument) is invalid."""


class InvalidArgument(AgentEnvError, ValueError):
    """An argument of a sandbox call is invalid (an empty command, a timeout of 0, a fork count of 65...);
    the message names the argument."""


class PathOutsideWorkspace(InvalidArgument):
    """A file-transfer path escapes the sandbox's work dir (`..`, absolute paths elsewhere, symlinks)."""


class SandboxNotFound(AgentEnvError, LookupError):
    """No sandbox in the registry has this id (or the id prefix is ambiguous)."""


class SandboxStateError(AgentEnvError):
    """The operation is not allowed in the sandbox's current state (e.g. exec on a paused sandbox)."""


class SandboxBusy(SandboxStateError):
    """Another thread or process holds the sandbox's lock for longer than the lock timeout."""


class SessionError(AgentEnvError):
    """The shell session is closed (`close()`, or its `with` block ended)."""


class CheckpointError(AgentEnvError):
    """CRIU could not checkpoint or restore the sandbox, or a restore did not really restore its state."""


class DiskCapExceeded(CheckpointError):
    """A pause would push the checkpoint store past its `disk_cap`; the sandbox was left running."""


class RestoreNotVerified(CheckpointError):
    """Docker reported a successful start but CRIU did not restore the checkpoint (a fresh start)."""


class ExecTimeout(AgentEnvError, TimeoutError):
    """An exec ran past its timeout (raised only with `raise_on_timeout=True`; carries the result)."""

    def __init__(self, message: str, result: object | None = None) -> None:
        super().__init__(message)
        self.result = result


class FileNotFoundInSandbox(AgentEnvError, FileNotFoundError):
    """No file (or directory) at this path in the sandbox."""


class FileExistsInSandbox(AgentEnvError, FileExistsError):
    """The path to create exists already in the sandbox."""


class NotADirectoryInSandbox(AgentEnvError, NotADirectoryError):
    """A directory was expected at this path in the sandbox."""


class ProcessNotFound(AgentEnvError, LookupError):
    """No process with this PID or tag was started through the API in the sandbox."""


class ImageError(AgentEnvError):
    """A sandbox image is unknown, not built, or its build failed."""


class BackendUnavailable(AgentEnvError):
    """The container runtime (Docker daemon, CRIU) is missing or does not answer."""


class HostUnavailable(AgentEnvError, ConnectionError):
    """A sandbox host did not answer (refused, reset or timed out) within the bounded attempts."""


class PoolBudgetExceeded(AgentEnvError):
    """`strict_budget` is on and no idle sandbox of the pool could be paused to make room."""


@dataclass(frozen=True)
class WireError:
    """How one error type travels from `agentenv serve` to a client: the HTTP status and Connect code
    E2B clients read, and the type's name in our `X-AgentEnv-Error` header (HTTP routes) or Connect
    error detail (RPC routes). `also`: Python exceptions of the server sent as this type."""

    type: type[AgentEnvError]
    status: int
    code: str
    also: tuple[type[Exception], ...] = ()

    @property
    def name(self) -> str:
        return self.type.__name__


# Most specific first (the server sends the first row that matches). Among rows of one status or code
# the last is the most general: it is what an error without our name (an E2B-shaped refusal) becomes.
ERROR_TABLE: tuple[WireError, ...] = (
    WireError(SandboxBusy, 409, "unavailable"),
    WireError(SessionError, 409, "failed_precondition"),
    WireError(FileExistsInSandbox, 409, "already_exists", (FileExistsError,)),
    WireError(SandboxStateError, 409, "failed_precondition"),
    WireError(ProcessNotFound, 404, "not_found"),
    WireError(FileNotFoundInSandbox, 404, "not_found", (FileNotFoundError,)),
    WireError(SandboxNotFound, 404, "not_found"),
    WireError(PathOutsideWorkspace, 400, "invalid_argument"),
    WireError(NotADirectoryInSandbox, 400, "invalid_argument", (NotADirectoryError,)),
    WireError(InvalidArgument, 400, "invalid_argument"),
    WireError(ImageError, 400, "invalid_argument"),
    WireError(ConfigError, 400, "invalid_argument"),
    WireError(ExecTimeout, 504, "deadline_exceeded"),
    # a refusal for want of room (the sandbox keeps running), not a server failure: 507 Insufficient Storage
    WireError(DiskCapExceeded, 507, "resource_exhausted"),
    WireError(PoolBudgetExceeded, 429, "resource_exhausted"),
    WireError(HostUnavailable, 502, "unavailable"),
    WireError(BackendUnavailable, 503, "unavailable"),
    WireError(RestoreNotVerified, 500, "internal"),
    WireError(CheckpointError, 500, "internal"),
    WireError(AgentEnvError, 400, "invalid_argument"),
)
WIRE_TYPES: dict[str, type[AgentEnvError]] = {row.name: row.type for row in ERROR_TABLE}
ERROR_HEADER = "X-AgentEnv-Error"  # HTTP routes: the error's name (E2B clients ignore it)


def wire_error(error: BaseException) -> WireError | None:
    """The table row an error is sent as (None: not an AgentENV error; the server reports a 500)."""
    for row in ERROR_TABLE:
        if isinstance(error, (row.type, *row.also)):
            return row
    return None


def error_from_wire(message: str, *, name: str | None = None, status: int | None = None,
                    code: str | None = None, default: type[AgentEnvError] = AgentEnvError) -> AgentEnvError:
    """The error a client raises for an error answer: the type `name`d by the server, else the most general
    type of its HTTP `status` or Connect `code`; `default` for internal errors and anything unknown."""
    cls = WIRE_TYPES.get(name or "")
    if cls is None:
        rows = [r for r in ERROR_TABLE if (status is not None and r.status == status)
                or (code is not None and r.code == code)]
        cls = rows[-1].type if rows and rows[-1].status != 500 else default
    return cls(message)
