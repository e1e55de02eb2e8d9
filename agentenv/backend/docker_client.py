"""One low-level Docker API client per process, shared by all threads (connection pool sized for a
thread pool of env steps). Reusing it keeps an exec at ~30 ms instead of paying a new connection.

Fork-safe: a child of `os.fork` (multiprocessing, Ray workers started by fork) forgets the parent's client
without touching its connections, and gets a fresh lock (the parent's may have been held by a thread that
does not exist in the child); its first `api()` call connects anew."""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import docker
import requests

from agentenv.errors import BackendUnavailable

_lock = threading.Lock()
_client: docker.APIClient | None = None

# Long enough for a checkpoint/restore of a few GiB; exec sockets get their own timeout.
API_TIMEOUT_S = 900
POOL_SIZE = 64

T = TypeVar("T")


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


def docker_errors(fn: Callable[..., T]) -> Callable[..., T]:
    """Turn "cannot reach the daemon" into BackendUnavailable (and forget the dead client); leave other
    errors alone."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> T:
        try:
            return fn(*args, **kwargs)
        except (requests.exceptions.ConnectionError, ConnectionRefusedError, FileNotFoundError) as e:
            if isinstance(e, FileNotFoundError) and "docker.sock" not in str(e):
                raise
            reset()
            raise unavailable(e) from None

    return wrapper


def first_line(e: docker.errors.APIError) -> str:
    """The first line of the daemon's explanation of an API error."""
    return str(e.explanation or e).strip().splitlines()[0]


def api() -> docker.APIClient:
    """The process-wide client (a forked child gets its own: see the module docstring)."""
    global _client
    client = _client
    if client is not None:
        return client
    with _lock:
        if _client is None:
            try:
                _client = docker.APIClient(base_url=daemon_url(), version="auto", timeout=API_TIMEOUT_S,
                                           max_pool_size=POOL_SIZE)
            except (docker.errors.DockerException, requests.exceptions.RequestException) as e:
                raise unavailable(e) from None
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


def _forget_after_fork() -> None:
    """In a forked child: drop the parent's client unclosed (its sockets are the parent's) and the lock."""
    global _client, _lock
    _client = None
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_after_fork)
