"""One low-level Docker API client per process, shared by all threads (connection pool sized for a
thread pool of env steps). Reusing it keeps an exec at ~30 ms instead of paying a new connection."""

from __future__ import annotations

import os
import threading

import docker
import requests

from agentenv.errors import BackendUnavailable

_lock = threading.Lock()
_client: docker.APIClient | None = None
_client_pid: int | None = None

# Long enough for a checkpoint/restore of a few GiB; exec sockets get their own timeout.
API_TIMEOUT_S = 900
POOL_SIZE = 64


def daemon_url() -> str:
    return os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")


def unavailable(error: Exception | str) -> BackendUnavailable:
    why = str(error).splitlines()[0] if str(error) else type(error).__name__
    if len(why) > 160:
        why = why[:160] + "..."
    return BackendUnavailable(
        f"no Docker daemon answers at {daemon_url()} ({why}); run `make bootstrap` "
        "(or scripts/ensure_dockerd.sh) to start one"
    )


def api() -> docker.APIClient:
    """The process-wide client (recreated after os.fork, whose children must not share sockets)."""
    global _client, _client_pid
    if _client is not None and _client_pid == os.getpid():
        return _client
    with _lock:
        if _client is None or _client_pid != os.getpid():
            try:
                client = docker.APIClient(base_url=daemon_url(), version="auto", timeout=API_TIMEOUT_S,
                                          max_pool_size=POOL_SIZE)
            except (docker.errors.DockerException, requests.exceptions.RequestException) as e:
                raise unavailable(e) from None
            _client, _client_pid = client, os.getpid()
    return _client


def reset() -> None:
    """Forget the client (after the daemon restarted, its pooled connections are dead)."""
    global _client
    with _lock:
        if _client is not None:
            try:
                _client.close()
            except Exception:
                pass
        _client = None
