"""Errors as E2B's clients expect them: `{"code": N, "message": "..."}` bodies on HTTP routes, Connect
error codes on RPC routes, both derived from one table of AgentENV's error types."""

from __future__ import annotations

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from starlette.responses import JSONResponse

from agentenv.errors import (
    AgentEnvError,
    BackendUnavailable,
    CheckpointError,
    ConfigError,
    ImageError,
    PathOutsideWorkspace,
    SandboxBusy,
    SandboxNotFound,
    SandboxStateError,
)
from agentenv.server.procs import ProcessNotFound, SandboxUnavailable


class ApiError(Exception):
    """An HTTP error with E2B's body shape, raised by route handlers."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


# Most specific first: (type, HTTP status, Connect code).
_TABLE: tuple[tuple[type[Exception], int, Code], ...] = (
    (SandboxNotFound, 404, Code.NOT_FOUND),
    (ProcessNotFound, 404, Code.NOT_FOUND),
    (FileNotFoundError, 404, Code.NOT_FOUND),
    (FileExistsError, 409, Code.ALREADY_EXISTS),
    (SandboxBusy, 409, Code.UNAVAILABLE),
    (SandboxUnavailable, 409, Code.FAILED_PRECONDITION),
    (SandboxStateError, 409, Code.FAILED_PRECONDITION),
    (PathOutsideWorkspace, 400, Code.INVALID_ARGUMENT),
    (ImageError, 400, Code.INVALID_ARGUMENT),
    (ConfigError, 400, Code.INVALID_ARGUMENT),
    (BackendUnavailable, 503, Code.UNAVAILABLE),
    (CheckpointError, 500, Code.INTERNAL),
    (AgentEnvError, 400, Code.INVALID_ARGUMENT),
)


def classify(error: Exception) -> tuple[int, Code]:
    for cls, status, code in _TABLE:
        if isinstance(error, cls):
            return status, code
    return 500, Code.INTERNAL


def e2b_json(status: int, message: str) -> JSONResponse:
    return JSONResponse({"code": status, "message": message}, status_code=status)


def to_connect(error: Exception) -> ConnectError:
    """A Connect error carrying the AgentENV message (ConnectErrors pass through)."""
    if isinstance(error, ConnectError):
        return error
    return ConnectError(classify(error)[1], str(error))
