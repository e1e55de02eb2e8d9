"""envd's RPCs for `agentenv.remote`, through the generated Connect client (`ProcessClientSync` of
`e2b.envd.process.process_connect`, the module whose ASGI side `agentenv serve` mounts), so one connectrpc
runtime does the envelopes, codecs and end-of-stream errors on both ends. This module adds what the
client needs on top: deadlines, bounded attempts and the AgentENV error types (`agentenv.errors`).

Hand-written because the generated client cannot do it: `_Deadlines` asks the host for a stream's deadline
`exec_slack_s` before the client's own limit (one `timeout_ms` sets both in connectrpc), so that the host's
report of a timed-out command arrives first; `_rpc_error` reads an error answer that is not the Connect
service's (the server's body limit, `{"code": 413, ...}`) by its HTTP status, where connectrpc would
make it `unavailable`.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol, TypeVar

from connectrpc._protocol import ConnectWireError  # the runtime's decoder of a Connect error's JSON
from connectrpc.client import ResponseMetadata
from connectrpc.code import Code
from connectrpc.codec import proto_json_codec
from connectrpc.errors import ConnectError, ErrorDetail
from connectrpc.request import RequestContext
from e2b.envd.process.process_connect import ProcessClientSync
from protobuf.wkt.google.protobuf.wrappers_pb import StringValue
from pyqwest import ReadError, RemoteProtocolError, SyncClient, SyncHTTPTransport, WriteError

from agentenv.backoff import retry_delay
from agentenv.errors import ERROR_HEADER, AgentEnvError, HostUnavailable, error_from_wire
from agentenv.paths import API_KEY_ENV

T = TypeVar("T")
_TIMEOUT_HEADER = "connect-timeout-ms"
_ERROR_DETAIL = "google.protobuf.StringValue"  # the Connect error detail that names the error type
# connectrpc wraps a failed transport as a ConnectError whose cause is one of these (a failed connect is a
# ConnectionError, also when it timed out); any other cause is the client's own failure
_TRANSPORT = (OSError, ReadError, WriteError, RemoteProtocolError)
# the HTTP status of each Connect code (connectrpc.com/docs/protocol): an error answer with another status
# is not the Connect service's (the server's body limit, a proxy in front of the host)
_CONNECT_STATUS = {"canceled": 499, "unknown": 500, "invalid_argument": 400, "deadline_exceeded": 504,
                   "not_found": 404, "already_exists": 409, "permission_denied": 403,
                   "resource_exhausted": 429, "failed_precondition": 400, "aborted": 409, "out_of_range": 400,
                   "unimplemented": 501, "internal": 500, "unavailable": 503, "data_loss": 500,
                   "unauthenticated": 401}


def status_error(text: str, status: int, name: str | None, on_500: type[AgentEnvError]) -> AgentEnvError:
    """The AgentENV error of an HTTP error answer (`agentenv.errors.ERROR_TABLE`: the type the server
    `name`d, else the most general one of the status); `text`: the message, prefixed by the host."""
    if status == 401:
        return AgentEnvError(f"{text} (give the host's key: ${API_KEY_ENV} or api_key=)")
    return error_from_wire(text, name=name, status=status, default=on_500)


def error_name(details: Sequence[ErrorDetail]) -> str | None:
    """The error type a Connect error names in its details (see `agentenv.server.errors.to_connect`)."""
    for detail in details:
        if detail.type_name == _ERROR_DETAIL:
            try:
                return StringValue.from_binary(detail.message_bytes).value
            except (ValueError, TypeError):
                return None
    return None


def connect_error(err: ConnectError | Mapping[str, Any], host: str) -> AgentEnvError:
    """The AgentENV error of a Connect error, as the generated client raises it or in its JSON wire form
    (decoded by connectrpc)."""
    if not isinstance(err, ConnectError):
        err = ConnectWireError.from_dict(dict(err), 500, Code.UNKNOWN).to_exception()
    code = err.code.value
    return error_from_wire(f"{host}: {err.message or code}", name=error_name(err.details), code=code)


def unreachable(url: str, e: BaseException | None, attempts: int) -> HostUnavailable:
    what = type(e).__name__
    return HostUnavailable(f"sandbox host {url} did not answer ({what}: {e or 'no detail'}) after "
                           f"{attempts} attempt(s)")


def _transport_failure(e: ConnectError) -> bool:
    return isinstance(e.__cause__, _TRANSPORT)


def _rpc_error(e: ConnectError, meta: ResponseMetadata, host: str) -> AgentEnvError:
    status = meta.http_status
    if status is not None and status != 200 and status != _CONNECT_STATUS.get(e.code.value):
        # not the Connect service's answer (e.g. the body limit's 413): read as on the HTTP routes
        name = meta.headers.get(ERROR_HEADER)
        return status_error(f"{host}: {e.message or f'HTTP {status}'}", status, name, AgentEnvError)
    return connect_error(e, host)


class _Deadlines:
    """Streams: the host's deadline `slack_ms` before the client's; unary calls: none asked of the host
    (the client's own limit applies, as on the HTTP routes)."""

    def __init__(self, slack_ms: int) -> None:
        self.slack_ms = slack_ms

    def intercept_unary_sync(self, call_next: Callable[..., Any], request: Any, ctx: RequestContext) -> Any:
        ctx.request_headers.pop(_TIMEOUT_HEADER, None)
        return call_next(request, ctx)

    def intercept_server_stream_sync(self, call_next: Callable[..., Iterator[Any]], request: Any,
                                     ctx: RequestContext) -> Iterator[Any]:
        if ctx.timeout_ms is not None:
            ctx.request_headers[_TIMEOUT_HEADER] = str(max(1, round(ctx.timeout_ms) - self.slack_ms))
        return call_next(request, ctx)


class Limits(Protocol):
    """What this module reads of `agentenv.remote.RemoteSettings` (conf/agentenv/remote.yaml; a Protocol:
    importing it would make an import circle)."""

    @property
    def connect_timeout_s(self) -> float: ...
    @property
    def request_timeout_s(self) -> float: ...
    @property
    def exec_slack_s(self) -> float: ...
    @property
    def retries(self) -> int: ...
    @property
    def retry_backoff_s(self) -> float: ...
    @property
    def retry_backoff_max_s(self) -> float: ...


class EnvdClient:
    """envd's `process.Process` service of one host (JSON codec, uncompressed, HTTP/1.1 on http://), over
    its own pyqwest connection pool."""

    def __init__(self, url: str, api_key: str, settings: Limits, rng: random.Random) -> None:
        self.url = url
        self.settings = settings
        self._rng = rng
        self._api_key = api_key
        self._transport = SyncHTTPTransport(connect_timeout=settings.connect_timeout_s,
                                            tls_include_system_certs=True, follow_redirects=False)
        self.process = ProcessClientSync(
            url, codec=proto_json_codec(), accept_compression=(), send_compression=None,
            interceptors=[_Deadlines(int(settings.exec_slack_s * 1000))],
            http_client=SyncClient(self._transport))

    def close(self) -> None:
        self.process.close()
        self._transport.close()

    def stream(self, call: Callable[..., Iterator[T]], message: Any, headers: Mapping[str, str],
               timeout_s: float) -> Iterator[T]:
        """A server stream of the generated client (`call`, e.g. `self.process.start`): its messages. The
        host ends it at `timeout_s` with `deadline_exceeded`, raised as TimeoutError; its other errors are
        raised as their AgentENV types; a host that does not answer within `exec_slack_s` more is
        `HostUnavailable` (one attempt: the call may have started something)."""
        with ResponseMetadata() as meta:
            try:
                yield from call(message, headers={**headers, "X-API-Key": self._api_key},
                                timeout_ms=int((timeout_s + self.settings.exec_slack_s) * 1000))
            except ConnectError as e:
                if _transport_failure(e):
                    raise unreachable(self.url, e.__cause__, 1) from None
                if e.code is Code.DEADLINE_EXCEEDED and not error_name(e.details):
                    raise TimeoutError(e.message or "deadline exceeded") from None
                raise _rpc_error(e, meta, self.url) from None

    def unary(self, call: Callable[..., T], message: Any, headers: Mapping[str, str]) -> T:
        """A unary call of the generated client, within `request_timeout_s`; a call that never reached the
        host is retried (`retries` attempts in all, `agentenv.backoff` waits), one that may have is not."""
        s = self.settings
        for attempt in range(1, s.retries + 1):
            with ResponseMetadata() as meta:
                try:
                    return call(message, headers={**headers, "X-API-Key": self._api_key},
                                timeout_ms=int(s.request_timeout_s * 1000))
                except ConnectError as e:
                    if not _transport_failure(e):
                        raise _rpc_error(e, meta, self.url) from None
                    if attempt < s.retries and isinstance(e.__cause__, ConnectionError):  # never sent
                        time.sleep(retry_delay(attempt, s.retry_backoff_s, s.retry_backoff_max_s, self._rng))
                        continue
                    raise unreachable(self.url, e.__cause__, attempt) from None
        raise AssertionError("unreachable")
