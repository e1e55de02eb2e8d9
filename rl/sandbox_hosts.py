"""``sandbox.hosts``: the rollout sandboxes on `agentenv serve` hosts instead of this machine's Docker.

Each sandbox is created on the host with the most free memory and used through a `RemoteSandbox` with the
same methods as a local one, so the step path does not change; the API key reaches the workers as a
constructor argument, never through Ray's ``runtime_env`` or the saved config.

Design: docs/design/training.md#rl-sandbox-hosts.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from agentenv.errors import ConfigError
from agentenv.paths import API_KEY_ENV

HOSTS_KEY = "hosts"


def split_hosts(sandbox: Mapping[str, Any] | None) -> tuple[dict[str, Any], list[str]]:
    """The ``sandbox`` group as (its `SandboxConfig` keys, its host URLs; [] = local sandboxes)."""
    config = dict(sandbox or {})
    hosts = config.pop(HOSTS_KEY, None)
    return config, list(hosts or [])


def check_hosts(hosts: Any) -> list[str]:
    """``sandbox.hosts`` is null or a list of distinct ``http(s)://host[:port]`` URLs; with hosts, the
    API key is in this process's environment. Raises a one-line `ConfigError` naming the key."""
    if hosts is None:
        return []
    if isinstance(hosts, str) or not isinstance(hosts, list | tuple):
        raise ConfigError(f"sandbox.hosts: expected a list of agentenv serve URLs, got {hosts!r}")
    for i, url in enumerate(hosts):
        parts = urlsplit(url) if isinstance(url, str) else None
        try:
            port_ok = parts is not None and (parts.port is None or parts.port > 0)
        except ValueError:
            port_ok = False
        if not parts or parts.scheme not in ("http", "https") or not parts.hostname or not port_ok \
                or parts.path.strip("/") or parts.query:
            raise ConfigError(f"sandbox.hosts[{i}]: {url!r} is not the URL of an agentenv serve host "
                              "(http://HOST:PORT or https://HOST:PORT)")
    if len({u.rstrip("/") for u in hosts}) != len(hosts):
        raise ConfigError(f"sandbox.hosts: a host is listed twice in {list(hosts)}")
    if hosts and not os.environ.get(API_KEY_ENV):
        raise ConfigError(f"sandbox.hosts: set ${API_KEY_ENV} (the hosts' API key) in the trainer's "
                          "environment")
    return list(hosts)


def worker_environment(sandbox: Mapping[str, Any] | None) -> dict[str, str]:
    """What a rollout worker needs in its environment for the run's sandboxes: the hosts' API key
    (from the driver's environment) when ``sandbox.hosts`` is set, else nothing."""
    _config, hosts = split_hosts(sandbox)
    if not hosts:
        return {}
    check_hosts(hosts)
    return {API_KEY_ENV: os.environ[API_KEY_ENV]}


def apply_worker_environment(env: Mapping[str, str]) -> None:
    """In a rollout worker's own process: put the driver's `worker_environment` in place."""
    os.environ.update(env)
