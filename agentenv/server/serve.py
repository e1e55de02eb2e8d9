"""Run the server: settings from conf/agentenv/server.yaml, the API key, uvicorn on loopback."""

from __future__ import annotations

import socket
import sys

from agentenv.errors import ConfigError
from agentenv.sandbox import runtime
from agentenv.server.auth import load_api_key
from agentenv.server.settings import ServerSettings
from agentenv.server.state import ServerState


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
    url = f"http://{settings.host}:{settings.port}"
    print(f"agentenv serve: E2B API and envd on {url} (registry {state.home})\n"
          f"  API key: {source}\n"
          f"  use: E2B_API_URL={url} E2B_SANDBOX_URL={url} E2B_API_KEY=<the key>", file=sys.stderr)
    if settings.host not in ("127.0.0.1", "::1", "localhost"):
        print(f"agentenv serve: warning: listening on {settings.host}, not loopback: anyone who can reach "
              "it and holds the API key controls these sandboxes", file=sys.stderr)
    uvicorn.run(create_app(state), host=settings.host, port=settings.port, log_level="warning",
                http="h11", ws="none", lifespan="on", timeout_graceful_shutdown=5)
    return 0


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
