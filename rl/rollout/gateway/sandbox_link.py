"""`SandboxLink`: the gateway reached from inside sandboxes, which have no network device.

It listens on 127.0.0.1:PORT in each linked sandbox's own network namespace (a socket of this process,
`agentenv.Sandbox.loopback_listener`) and relays each connection to the gateway, served on a private unix
socket with ``Connection: close``: between calls no process of the sandbox holds a socket, so pauses and
forks (CRIU) meet none. ``link.env(sandbox, key)`` links the sandbox's current namespace and gives a
program its ``OPENAI_BASE_URL`` and episode key. Why so: docs/tasks.md, "Calls from inside a sandbox".
"""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import uvicorn

from agentenv import Sandbox
from agentenv.errors import ConfigError, SandboxStateError
from rl.rollout.gateway.app import create_app
from rl.rollout.gateway.errors import ApiError
from rl.rollout.gateway.service import Gateway

DEFAULT_PORT = 4141  # where the link listens in every sandbox's loopback
SOCKET_NAME = "gateway.sock"
START_TIMEOUT_S = 20.0
CHUNK_BYTES = 65536
DRAIN_S = 5.0  # after a refusal: how long the client may take to close its side


def closing(app):
    """`app` answering every HTTP request with ``Connection: close``: uvicorn then closes the connection
    after the answer, and so does the link with the sandbox's side."""

    async def wrapped(scope, receive, send):
        if scope["type"] != "http":
            return await app(scope, receive, send)

        async def send_closing(message):
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"connection"]
                message = {**message, "headers": [*headers, (b"connection", b"close")]}
            await send(message)

        return await app(scope, receive, send_closing)

    return wrapped


def unreachable(reason: str) -> bytes:
    """A 502 in OpenAI's error shape: the gateway's server could not be reached."""
    error = ApiError(
        f"the policy gateway is not reachable: {reason}",
        status=502,
        type="server_error",
        code="gateway_unreachable",
    )
    body = json.dumps(error.body()).encode()
    head = (
        f"HTTP/1.1 502 Bad Gateway\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
        "connection: close\r\n\r\n"
    ).encode()
    return head + body


@dataclass
class _Listener:
    namespace: int  # the sandbox's network namespace it listens in
    server: asyncio.Server


class SandboxLink:
    """The gateway on each linked sandbox's 127.0.0.1:`port` (see the module docstring); a context
    manager."""

    def __init__(self, gateway: Gateway, port: int = DEFAULT_PORT) -> None:
        if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
            raise ConfigError(f"the link's port must be an integer from 1 to 65535, got {port!r}")
        self.gateway = gateway
        self.port = port
        self._folder: Path | None = None
        self._upstream = ""  # the gateway's socket, as the relays connect to it
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._listeners: dict[str, _Listener] = {}  # sandbox id -> its listener
        self._lock = threading.Lock()  # guards _listeners
        self._attaching = threading.Lock()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def socket_path(self) -> Path:
        if self._folder is None:
            raise RuntimeError("the link is not started")
        return self._folder / SOCKET_NAME

    # ---- the gateway's server -------------------------------------------------------------------
    def start(self) -> SandboxLink:
        """Serve the gateway on a unix socket in a private folder; returns once it listens."""
        if self._server is not None:
            raise RuntimeError("the link is already started")
        self._folder = Path(tempfile.mkdtemp(prefix="k3rl-gateway-"))  # mode 0700: this user's only
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._upstream = str(self.socket_path)
        listener.bind(self._upstream)
        server = uvicorn.Server(uvicorn.Config(closing(create_app(self.gateway)), log_level="warning"))
        thread = threading.Thread(
            target=server.run, kwargs={"sockets": [listener]}, daemon=True, name="gateway-sandbox-link"
        )
        thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not server.started:
            if time.monotonic() > deadline or not thread.is_alive():
                server.should_exit = True
                thread.join(5)
                listener.close()
                shutil.rmtree(self._folder, ignore_errors=True)
                raise RuntimeError("the gateway's server did not start")
            time.sleep(0.01)
        self._server, self._thread = server, thread
        self._loop = server.servers[0].get_loop()
        return self

    def close(self) -> None:
        """Close every sandbox's listener and stop serving."""
        for sandbox_id in list(self._listeners):
            self._drop(sandbox_id)
        if self._server is not None:
            self._server.should_exit = True
            self._thread.join(10)
            self._server = self._thread = self._loop = None
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None

    def __enter__(self) -> SandboxLink:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- sandboxes ------------------------------------------------------------------------------
    def env(self, sandbox: Sandbox, key: str) -> dict[str, str]:
        """The environment of a program in ``sandbox`` whose calls belong to the episode of ``key``; the
        sandbox is linked first (`attach`)."""
        self.attach(sandbox)
        return {"OPENAI_BASE_URL": self.base_url, "OPENAI_API_KEY": key}

    def attach(self, sandbox: Sandbox) -> None:
        """Listen on the running sandbox's 127.0.0.1:`port` unless the link already does in its current
        network namespace (cheap then: call it before each program runs)."""
        if self._loop is None:
            raise RuntimeError("the link is not started")
        if not isinstance(sandbox, Sandbox):
            raise ConfigError(
                f"the link listens in local sandboxes (agentenv.Sandbox), not in a {type(sandbox).__name__}"
            )
        namespace = sandbox.network_namespace()
        if namespace is None:
            raise SandboxStateError(
                f"sandbox {sandbox.id} is {sandbox.status}: the link reaches running sandboxes only"
            )
        with self._attaching:  # one listener per sandbox, also when two threads link it at once
            with self._lock:
                known = self._listeners.get(sandbox.id)
            if known is not None and known.namespace == namespace:
                return
            self._drop(sandbox.id)  # a listener in a namespace the sandbox left (a new one since a resume)
            listener = sandbox.loopback_listener(self.port)
            try:
                future = asyncio.run_coroutine_threadsafe(
                    asyncio.start_server(self._relay, sock=listener), self._loop
                )
                server = future.result(START_TIMEOUT_S)
            except BaseException:
                listener.close()
                raise
            with self._lock:
                self._listeners[sandbox.id] = _Listener(namespace, server)

    def detach(self, sandbox: Sandbox | str) -> None:
        """Stop listening in a sandbox (call it when the sandbox is closed: a listener keeps the network
        namespace of its sandbox alive)."""
        self._drop(sandbox if isinstance(sandbox, str) else sandbox.id)

    def _drop(self, sandbox_id: str) -> None:
        with self._lock:
            listener = self._listeners.pop(sandbox_id, None)
        if listener is None or self._loop is None:
            return

        async def shut() -> None:  # stops listening; a call in flight ends on its own
            listener.server.close()

        asyncio.run_coroutine_threadsafe(shut(), self._loop).result(START_TIMEOUT_S)

    # ---- one connection from a sandbox ----------------------------------------------------------
    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Relay one of a sandbox's connections to the gateway's socket until the gateway's answer ends."""
        try:
            try:
                up_reader, up_writer = await asyncio.open_unix_connection(self._upstream)
            except OSError as e:
                writer.write(unreachable(e.strerror or str(e)))
                await writer.drain()
                writer.write_eof()  # then read what the client sends until it closes: closing a socket
                async with asyncio.timeout(DRAIN_S):  # with unread bytes would reset the answer
                    while await reader.read(CHUNK_BYTES):
                        pass
                return
            to_gateway = asyncio.create_task(_pipe(reader, up_writer))
            try:
                await _pipe(up_reader, writer)
            finally:
                to_gateway.cancel()
                await asyncio.gather(to_gateway, return_exceptions=True)
                up_writer.close()
        except (OSError, TimeoutError):
            pass  # the sandbox's client went away
        finally:
            writer.close()


async def _pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
    while data := await source.read(CHUNK_BYTES):
        sink.write(data)
        await sink.drain()
