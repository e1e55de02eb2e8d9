"""Run the server: settings from conf/agentenv/server.yaml, the API key, one server per $AGENTENV_HOME
(a lock), start-up recovery of what an earlier server left (`agentenv.server.reconcile`), then uvicorn."""

from __future__ import annotations

import asyncio
import fcntl
import os
import socket
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from agentenv.errors import ConfigError
from agentenv.runtime import runtime
from agentenv.server.auth import load_api_key
from agentenv.server.reconcile import Recovery, recover
from agentenv.server.settings import ServerSettings
from agentenv.server.state import ServerState

SERVER_LOCK = "server.lock"


def build(host: str | None = None, port: int | None = None) -> tuple[ServerSettings, ServerState, str]:
    """Settings (with CLI overrides), the shared state and where the API key came from."""
    settings = ServerSettings.load(host=host, port=port)
    key, source = load_api_key(runtime().home)
    return settings, ServerState.open(settings, key), source


def serve(host: str | None = None, port: int | None = None) -> int:
    """Serve until interrupted; prints the URL to point the SDK at and where the API key is."""
    import uvicorn

    from agentenv.server.app import create_app

    settings, state, source = build(host, port)
    _check_bindable(settings.host, settings.port)
    lock_fd = hold_home(state.home)  # noqa: F841 - held (flock) until this process ends, however it ends
    done = recover(state.store, settings.default_timeout_s)
    if done.any() or done.busy:
        print(f"agentenv serve: recovered after an earlier server's end: {_recovery_text(done)}",
              file=sys.stderr)
    url = f"http://{settings.host}:{settings.port}"
    print(f"agentenv serve: E2B API and envd on {url} (registry {state.home})\n"
          f"  API key: {source}\n"
          f"  use: E2B_API_URL={url} E2B_SANDBOX_URL={url} E2B_API_KEY=<the key>", file=sys.stderr)
    if settings.host not in ("127.0.0.1", "::1", "localhost"):
        print(f"agentenv serve: warning: listening on {settings.host}, not loopback: anyone who can reach "
              "it and holds the API key controls these sandboxes", file=sys.stderr)
    config = uvicorn.Config(create_app(state), host=settings.host, port=settings.port, log_level="warning",
                            http="h11", ws="none", lifespan="on", timeout_graceful_shutdown=5)
    asyncio.run(_serve(uvicorn.Server(config), settings.worker_threads))
    return 0


async def _serve(server, threads: int) -> None:
    """uvicorn's `Server.serve` with `threads` worker threads for the blocking work of requests: the data
    plane's (`asyncio.to_thread`: the loop's default executor, else min(32, cores + 4): 6 on 2 cores, which
    queued every command behind 6 others under load) and the control plane's (anyio's limiter, else 40)."""
    import anyio.to_thread

    asyncio.get_running_loop().set_default_executor(
        ThreadPoolExecutor(threads, thread_name_prefix="agentenv-serve"))
    anyio.to_thread.current_default_thread_limiter().total_tokens = threads
    await server.serve()


def hold_home(home: Path) -> int:
    """Lock `$AGENTENV_HOME/server.lock` for this process's life (flock: the kernel drops it when the
    process dies, kill -9 included), or a clear error naming the server that holds it: start-up recovery
    (`agentenv.server.reconcile.recover`) may only run where no other server is serving these sandboxes."""
    path = home / SERVER_LOCK
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise ConfigError(f"another agentenv serve (pid {holder}) already serves the sandboxes of {home}; "
                          "stop it, or give this one another $AGENTENV_HOME") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd


def _recovery_text(done: Recovery) -> str:
    parts = [f"{len(ids)} {what}" for what, ids in (
        ("sandboxes it left half made removed", done.unanswered),
        ("interrupted pauses recorded (paused)", done.paused),
        ("interrupted resumes rolled back (paused)", done.rolled_back),
        ("finished resumes recorded (running)", done.resumed),
        ("sandboxes whose container is gone removed", done.gone),
        ("E2B rows rebuilt from the sandboxes' labels (e2b.sqlite3 lost them)", done.rebuilt),
        ("sandboxes busy in another process left alone", done.busy),
        ("unfinished imports from other hosts removed", done.imports_dropped),
        ("moves to other hosts settled", done.moves_settled)) if ids]
    return "; ".join(parts)


def _check_bindable(host: str, port: int) -> None:
    """A clear one-line error (not uvicorn's exit 3) when the address cannot be listened on."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        with socket.socket(infos[0][0], socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(infos[0][4])
    except OSError as e:
        why = e.strerror or str(e)
        raise ConfigError(f"cannot listen on {host}:{port}: {why} (choose another --host/--port)") from None
