"""Errors as E2B's clients expect them: `{"code": N, "message": "..."}` bodies on HTTP routes, Connect
error codes on RPC routes, both from `agentenv.errors.ERROR_TABLE`, which also names each error's type
(header `X-AgentEnv-Error`, a Connect error detail) so that `agentenv.remote` raises the same type."""

from __future__ import annotations

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from protobuf.wkt.google.protobuf.wrappers_pb import StringValue
from starlette.responses import JSONResponse

from agentenv.errors import ERROR_HEADER, wire_error


class ApiError(Exception):
    """An HTTP error with E2B's body shape, raised by route handlers (no AgentENV type: a refusal of the
    request itself, such as a bad parameter or a timeout over the server's maximum)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def classify(error: Exception) -> tuple[int, Code, str | None]:
    """(HTTP status, Connect code, type name) of an error; (500, INTERNAL, None) for an unexpected one."""
    row = wire_error(error)
    if row is None:
        return 500, Code.INTERNAL, None
    return row.status, Code(row.code), row.name


def e2b_json(status: int, message: str, name: str | None = None) -> JSONResponse:
    """E2B's error body; `name`: the AgentENV error type, in our header."""
    return JSONResponse({"code": status, "message": message}, status_code=status,
                        headers={ERROR_HEADER: name} if name else None)


def to_connect(error: Exception) -> ConnectError:
    """A Connect error carrying the AgentENV message and type (ConnectErrors pass through)."""
    if isinstance(error, ConnectError):
        return error
    _status, code, name = classify(error)
    return ConnectError(code, str(error), details=[StringValue(value=name)] if name else ())
